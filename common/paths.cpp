#include "common/paths.h"

#include <unistd.h>

#include <cstdlib>

namespace hcomm {

std::string default_sim_dir() {
  if (const char* d = std::getenv("HCOMM_SIM_DIR"); d != nullptr && *d != '\0') return d;
  return "/tmp/hcomm-sim-" + std::to_string(::getuid());
}

std::string sim_socket_path(const std::string& dir, unsigned index) {
  return dir + "/npu" + std::to_string(index) + ".sock";
}

}  // namespace hcomm
