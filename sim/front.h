// Front: one transport through which a client reaches a sim::Device.
// The vfio-user server (sim/vfio_user_server.h) is one, the QEMU/ivshmem front
// (sim/ivshmem_front.h) another. hcomm-sim owns its fronts and drives them only through this
// interface, so adding a transport does not touch main or the device.
#pragma once

#include <string>
#include <thread>

#include "common/fd.h"
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

// What both fronts are: a server for one client at a time on a UNIX stream
// socket. It owns the listening socket, the stop eventfd and the front
// thread with its accept loop; a front implements serve(). Its start() and
// stop() call start_serving() and stop_serving(), and its destructor must
// call stop(): serve() is virtual and runs on the front thread.
class SocketFront : public Front {
 protected:
  // `kind` names the front in log lines ("vfio-user", "ivshmem").
  SocketFront(const char* kind, std::string socket_path) : _path(std::move(socket_path)), _kind(kind) {}

  // Bind the socket (a stale one is replaced) and start the front thread.
  Status start_serving();
  // Wake the thread, join it, remove the socket. Idempotent.
  void stop_serving();
  bool serving() const { return _thread.joinable(); }
  // Serve one connection until it ends; true if stop was requested. Every
  // wait inside must also watch stop_fd() (readable once stop is asked).
  virtual bool serve(UniqueFd client) = 0;
  int stop_fd() const { return _stop_efd.get(); }

  const std::string _path;

 private:
  void run();

  const char* _kind;
  UniqueFd _listen;
  UniqueFd _stop_efd;
  std::thread _thread;
};

}  // namespace hcomm::sim
