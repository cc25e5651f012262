#include "sim/control.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "common/time.h"
#include "sim/device.h"

namespace hcomm::sim {

namespace {

// net faults drop=P dup=P reorder=P corrupt=P [seed=S] | net drop-next N |
// net corrupt-next N | net clear | net stats (faults, uplink losses, the uplink) | net info DEV (counters; bad_icrc_total, retransmits_total, timeouts_total since start)
std::string net_command(Fabric& fabric, std::istringstream& in) {
  std::string sub;
  in >> sub;
  roce::NetSwitch& sw = fabric.net_switch();
  roce::NetFaultConfig f = sw.faults();
  if (sub == "faults") {
    std::string kv;
    bool any = false;
    while (in >> kv) {
      const size_t eq = kv.find('=');
      if (eq == std::string::npos) return "error: net faults KEY=VALUE...: '" + kv + "'";
      const std::string k = kv.substr(0, eq);
      char* end = nullptr;
      errno = 0;
      const unsigned long long v = std::strtoull(kv.c_str() + eq + 1, &end, 0);
      if (errno != 0 || end == kv.c_str() + eq + 1 || *end != '\0') return "error: net faults: bad number in '" + kv + "'";
      if (k == "seed") {
        f.seed = v;
      } else {
        if (v > 100) return "error: net faults: " + k + " is a percentage (0..100)";
        const auto pct = static_cast<uint32_t>(v);
        if (k == "drop") f.drop_pct = pct;
        else if (k == "dup") f.dup_pct = pct;
        else if (k == "reorder") f.reorder_pct = pct;
        else if (k == "corrupt") f.corrupt_pct = pct;
        else return "error: net faults: unknown key '" + k + "' (drop, dup, reorder, corrupt, seed)";
      }
      any = true;
    }
    if (!any) return "error: usage: net faults drop=P dup=P reorder=P corrupt=P [seed=S]";
    sw.set_faults(f);
    return "ok";
  }
  if (sub == "drop-next" || sub == "corrupt-next") {
    long long n = -1;
    if (!(in >> n) || n < 0 || n > 1000000000LL) return "error: net " + sub + " needs a count 0..1e9";
    (sub == "drop-next" ? f.drop_next : f.corrupt_next) = static_cast<uint32_t>(n);
    sw.set_faults(f);
    return "ok";
  }
  if (sub == "clear") {
    sw.set_faults(roce::NetFaultConfig{});
    return "ok";
  }
  if (sub == "stats") {
    const roce::NetFaultCounters c = sw.fault_counters();
    return "ok dropped=" + std::to_string(c.dropped) + " duplicated=" + std::to_string(c.duplicated) +
           " reordered=" + std::to_string(c.reordered) + " corrupted=" + std::to_string(c.corrupted) +
           " uplink_lost=" + std::to_string(fabric.uplink_overflow()) + " uplink=" + fabric.uplink_describe();
  }
  if (sub == "info") {
    long long dev = -1;
    if (!(in >> dev) || dev < 0 || static_cast<unsigned long long>(dev) >= fabric.size())
      return "error: usage: net info DEV";
    roce::NetPort* p = fabric.device(static_cast<uint32_t>(dev))->net();
    if (p == nullptr) return "error: device has no network engine";
    const roce::Counters c = p->counters();
    const roce::NetPort::Totals t = p->totals();
    std::string d = p->describe();
    for (char& ch : d)
      if (ch == '\n') ch = ';';
    return "ok " + d + " counters tx=" + std::to_string(c.tx_frames) + " rx=" + std::to_string(c.rx_frames) +
           " bad_icrc=" + std::to_string(c.rx_bad_icrc) + " retransmits=" + std::to_string(c.retransmits) +
           " timeouts=" + std::to_string(c.timeouts) + " bad_icrc_total=" + std::to_string(t.bad_icrc) +
           " retransmits_total=" + std::to_string(t.retransmits) + " timeouts_total=" + std::to_string(t.timeouts);
  }
  return "error: usage: net faults|drop-next|corrupt-next|clear|stats|info ...";
}

}  // namespace

std::string control_command(Fabric& fabric, const std::string& line) {
  std::istringstream in(line);
  std::string cmd;
  in >> cmd;
  if (cmd == "ping") return "ok";
  if (cmd == "net") return net_command(fabric, in);
  long long dev = -1;
  if (!(in >> dev) || dev < 0 || static_cast<unsigned long long>(dev) >= fabric.size())
    return "error: usage: fail|corrupt|stale|stall|clear|stats|reset DEV [N]; DEV must be 0.." +
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
    f.stall_after = 0;
    f.stale_next = 0;
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
  } else if (cmd == "stale") {
    f.stale_next = static_cast<uint32_t>(n);
  } else if (cmd == "stall") {
    long long after = 0;
    if (!(in >> after)) {
      in.clear();
      if (std::string rest; in >> rest) return "error: stall DEV MS [AFTER]: AFTER must be a number";
      after = 0;
    } else if (after < 1 || after > 1000000000LL) {
      return "error: stall DEV MS [AFTER]: AFTER must be 1..1e9 descriptors";
    }
    if (after > 0) {
      f.stall_ms = n;
      f.stall_after = static_cast<uint32_t>(after);
    } else {
      auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(n);
      f.stall_until_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(until.time_since_epoch()).count();
    }
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
