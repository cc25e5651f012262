// Front: one transport through which a client reaches a sim::Device.
// The vfio-user server (sim/vfio_user_server.h) is one; the QEMU front will be
// another. hcomm-sim owns its fronts and drives them only through this
// interface, so adding a transport does not touch main or the device.
#pragma once

#include <string>

#include "common/status.h"

namespace hcomm::sim {

class Front {
 public:
  virtual ~Front() = default;

  // Start serving (e.g. bind the socket, start the front's thread). Returns
  // once the front accepts clients, or an error with nothing left running.
  virtual Status start() = 0;
  // Stop serving: returns once the front's thread has exited and no call into
  // the device from this front is in flight. A connected client is dropped
  // (the device sees client_gone()). Idempotent; safe without start().
  virtual void stop() = 0;
  // One line for logs and probe output, e.g. "vfio-user /run/hcomm/npu0.sock".
  virtual std::string describe() const = 0;
};

}  // namespace hcomm::sim
