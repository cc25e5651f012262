#include "sim/control.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <sstream>

#include "common/time.h"
#include "sim/device.h"

namespace hcomm::sim {

std::string control_command(Fabric& fabric, const std::string& line) {
  std::istringstream in(line);
  std::string cmd;
  in >> cmd;
  if (cmd == "ping") return "ok";
  long long dev = -1;
  if (!(in >> dev) || dev < 0 || static_cast<unsigned long long>(dev) >= fabric.size())
    return "error: usage: fail|corrupt|stall|clear|stats|reset DEV [N]; DEV must be 0.." +
           std::to_string(fabric.size() == 0 ? 0 : fabric.size() - 1);
  Device& d = *fabric.device(static_cast<uint32_t>(dev));
  FaultState& f = d.faults();
  if (cmd == "reset") {
    d.self_reset();
    return "ok";
  }
  if (cmd == "clear") {
    f.fail_next = 0;
    f.corrupt_next = 0;
    f.stall_until_ns = 0;
    return "ok";
  }
  if (cmd == "stats") {
    return "ok completed=" + std::to_string(d.completed()) + " errors=" + std::to_string(d.errors());
  }
  long long n = -1;
  if (!(in >> n) || n < 0 || n > 1000000000LL) return "error: " + cmd + " needs a count 0..1e9";
  if (cmd == "fail") {
    f.fail_next = static_cast<uint32_t>(n);
  } else if (cmd == "corrupt") {
    f.corrupt_next = static_cast<uint32_t>(n);
  } else if (cmd == "stall") {
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(n);
    f.stall_until_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(until.time_since_epoch()).count();
  } else {
    return "error: unknown command '" + cmd + "'";
  }
  return "ok";
}

Status ControlServer::start(const std::string& path) {
  sockaddr_un addr{};
  if (path.size() >= sizeof addr.sun_path)
    return Status::error(Code::invalid_argument, "control socket path too long: %s", path.c_str());
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return Status::from_errno(errno, "socket");
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  ::unlink(path.c_str());
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
    return Status::from_errno(errno, "bind " + path);
  if (::listen(fd.get(), 8) != 0) return Status::from_errno(errno, "listen");
  _path = path;
  _listen = std::move(fd);
  _thread = std::thread([this] { loop(); });
  return Status::ok();
}

void ControlServer::stop() {
  _stop = true;
  if (_thread.joinable()) _thread.join();
  if (!_path.empty()) ::unlink(_path.c_str());
  _path.clear();
}

void ControlServer::loop() {
  while (!_stop) {
    pollfd p{_listen.get(), POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    UniqueFd c(::accept4(_listen.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (c.valid()) serve(c.get());
  }
}

std::string ControlSession::feed(const char* data, size_t n, bool* drop) {
  *drop = false;
  _buf.append(data, n);
  std::string replies;
  size_t nl;
  while ((nl = _buf.find('\n')) != std::string::npos) {
    if (nl > kMaxLine) break;
    replies += control_command(_fabric, _buf.substr(0, nl)) + "\n";
    _buf.erase(0, nl + 1);
  }
  if (_buf.size() > kMaxLine) {
    replies += "error: line too long\n";
    *drop = true;
  }
  return replies;
}

// One client at a time; a client idle for 5 s is dropped.
void ControlServer::serve(int fd) {
  ControlSession session(_fabric);
  Deadline idle = Deadline::after_ms(5000);
  while (!_stop && !idle.expired()) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    char tmp[256];
    ssize_t n = ::read(fd, tmp, sizeof tmp);
    if (n <= 0) return;
    idle = Deadline::after_ms(5000);
    bool drop = false;
    std::string reply = session.feed(tmp, static_cast<size_t>(n), &drop);
    if (!reply.empty() && ::send(fd, reply.data(), reply.size(), MSG_NOSIGNAL) < 0) return;
    if (drop) return;
  }
}

}  // namespace hcomm::sim
