#include "sim/front.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common/unix_socket.h"

namespace hcomm::sim {

using unix_socket::Io;

Status SocketFront::start_serving() {
  if (serving()) return Status::error(Code::invalid_argument, "%s: already started", _path.c_str());
  UniqueFd lfd;
  HCOMM_TRY(unix_socket::listen_at(_path, &lfd));
  UniqueFd efd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!efd.valid()) {
    int e = errno;
    ::unlink(_path.c_str());
    return Status::from_errno(e, "eventfd");
  }
  _listen = std::move(lfd);
  _stop_efd = std::move(efd);
  _thread = std::thread([this] { run(); });
  return Status::ok();
}

void SocketFront::stop_serving() {
  if (_thread.joinable()) {
    uint64_t one = 1;
    // Level-triggered: the thread sees it in whichever poll it is in.
    ssize_t n = ::write(_stop_efd.get(), &one, sizeof one);
    (void)n;  // cannot fail on a fresh counter
    _thread.join();
  }
  if (_listen.valid()) {
    _listen.reset();
    ::unlink(_path.c_str());
  }
  _stop_efd.reset();
}

void SocketFront::run() {
  for (;;) {
    UniqueFd client;
    int err = 0;
    Io io = unix_socket::accept_next(_listen.get(), _stop_efd.get(), &client, &err);
    if (io == Io::aborted) return;
    if (io != Io::ok) {
      std::fprintf(stderr, "hcomm-sim: %s %s: poll: %s\n", _kind, _path.c_str(), std::strerror(err));
      return;
    }
    if (serve(std::move(client))) return;
  }
}

}  // namespace hcomm::sim
