// Where hcomm-sim puts its sockets, and where the driver looks for them.
#pragma once

#include <string>

namespace hcomm {

// $HCOMM_SIM_DIR, else /tmp/hcomm-sim-<uid>.
std::string default_sim_dir();
// DIR/npu<index>.sock
std::string sim_socket_path(const std::string& dir, unsigned index);

}  // namespace hcomm
