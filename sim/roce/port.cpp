#include "sim/roce/port.h"

#include "sim/roce/dpdk_port.h"

#include <arpa/inet.h>
#include <cerrno>
#include <cstring>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

namespace hcomm::sim::roce {

DgramPort::~DgramPort() {
  if (_fd >= 0) ::close(_fd);
}

Status DgramPort::open(uint16_t local_port, uint16_t remote_port) {
  _fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (_fd < 0) return Status::from_errno(errno, "socket(AF_INET, SOCK_DGRAM)");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(local_port);
  if (::bind(_fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
    return Status::from_errno(errno, "bind 127.0.0.1:" + std::to_string(local_port));
  // Room for a window of full frames (the engine keeps at most kWindow
  // packets of one QP unacknowledged) and then some: a link's buffer, so
  // that only injected faults and real overload drop frames. Root may go
  // past net.core.rmem_max (FORCE); otherwise the kernel caps it there.
  const int want = 16 << 20;
  if (::setsockopt(_fd, SOL_SOCKET, SO_RCVBUFFORCE, &want, sizeof want) != 0)
    (void)::setsockopt(_fd, SOL_SOCKET, SO_RCVBUF, &want, sizeof want);
  const int one = 1;  // what overflows anyway is counted (overflow())
  (void)::setsockopt(_fd, SOL_SOCKET, SO_RXQ_OVFL, &one, sizeof one);
  _local = local_port;
  _remote = remote_port;
  return Status::ok();
}

std::string DgramPort::describe() const {
  return "dgram:127.0.0.1:" + std::to_string(_local) + "->" + std::to_string(_remote);
}

Status DgramPort::send(const uint8_t* frame, size_t len) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(_remote);
  if (::sendto(_fd, frame, len, 0, reinterpret_cast<sockaddr*>(&a), sizeof a) < 0) {
    // Nobody listening yet (ECONNREFUSED from an earlier ICMP) is a lost
    // frame on a wire, as on a real link: the reliability layer resends.
    if (errno == ECONNREFUSED) return Status::ok();
    return Status::from_errno(errno, "sendto 127.0.0.1:" + std::to_string(_remote));
  }
  return Status::ok();
}

Status DgramPort::recv(uint8_t* buf, size_t cap, size_t* len, int timeout_ms) {
  *len = 0;
  pollfd p{_fd, POLLIN, 0};
  const int r = ::poll(&p, 1, timeout_ms);
  if (r < 0) return errno == EINTR ? Status::ok() : Status::from_errno(errno, "poll");
  if (r == 0) return Status::ok();
  sockaddr_in from{};
  iovec iov{buf, cap};
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(uint32_t))];
  msghdr m{};
  m.msg_name = &from;
  m.msg_namelen = sizeof from;
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = ctl;
  m.msg_controllen = sizeof ctl;
  const ssize_t n = ::recvmsg(_fd, &m, MSG_DONTWAIT | MSG_TRUNC);
  if (n < 0) return errno == EAGAIN || errno == ECONNREFUSED ? Status::ok() : Status::from_errno(errno, "recvmsg");
  for (cmsghdr* c = CMSG_FIRSTHDR(&m); c != nullptr; c = CMSG_NXTHDR(&m, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SO_RXQ_OVFL && c->cmsg_len >= CMSG_LEN(sizeof(uint32_t))) {
      uint32_t v;
      std::memcpy(&v, CMSG_DATA(c), sizeof v);
      _overflow.store(v, std::memory_order_relaxed);
    }
  }
  if (from.sin_addr.s_addr != htonl(INADDR_LOOPBACK) || ntohs(from.sin_port) != _remote) return Status::ok();
  if (static_cast<size_t>(n) > cap) return Status::ok();  // larger than any frame the port takes: dropped
  *len = static_cast<size_t>(n);
  return Status::ok();
}

namespace {

bool parse_port(const std::string& s, uint16_t* out) {
  if (s.empty() || s.size() > 5 || s.find_first_not_of("0123456789") != std::string::npos) return false;
  const unsigned long v = std::stoul(s);
  if (v == 0 || v > 65535) return false;
  *out = static_cast<uint16_t>(v);
  return true;
}

}  // namespace

bool valid_link_spec(const std::string& spec, uint16_t* local, uint16_t* remote) {
  if (spec.rfind("dpdk:", 0) == 0) return true;
  const size_t c = spec.find(':');
  uint16_t l = 0, r = 0;
  if (c == std::string::npos || !parse_port(spec.substr(0, c), &l) || !parse_port(spec.substr(c + 1), &r)) return false;
  if (local != nullptr) *local = l;
  if (remote != nullptr) *remote = r;
  return true;
}

Status open_link(const std::string& spec, const std::string& run_dir, std::unique_ptr<Link>* out) {
  if (spec.rfind("dpdk:", 0) == 0) return open_dpdk_link(spec.substr(5), run_dir, out);
  uint16_t local = 0, remote = 0;
  if (!valid_link_spec(spec, &local, &remote))
    return Status::error(Code::invalid_argument,
                         "uplink '%s': LOCAL_PORT:REMOTE_PORT (UDP, 1-65535) or dpdk:DEVARGS", spec.c_str());
  auto d = std::make_unique<DgramPort>();
  HCOMM_TRY(d->open(local, remote));
  *out = std::move(d);
  return Status::ok();
}

namespace {

void le32(std::FILE* f, uint32_t v) {
  const uint8_t b[4] = {static_cast<uint8_t>(v), static_cast<uint8_t>(v >> 8), static_cast<uint8_t>(v >> 16),
                        static_cast<uint8_t>(v >> 24)};
  std::fwrite(b, 1, 4, f);
}

}  // namespace

PcapWriter::~PcapWriter() { (void)close(); }

Status PcapWriter::open(const std::string& path) {
  _f = std::fopen(path.c_str(), "wb");
  if (_f == nullptr) return Status::from_errno(errno, "open " + path);
  le32(_f, 0xa1b2c3d4);   // magic (microseconds)
  le32(_f, 2 | 4u << 16);  // version 2.4
  le32(_f, 0);            // thiszone
  le32(_f, 0);            // sigfigs
  le32(_f, 65535);        // snaplen
  le32(_f, 1);            // LINKTYPE_ETHERNET
  return Status::ok();
}

void PcapWriter::write(const uint8_t* frame, size_t len, uint64_t now_ns) {
  if (_f == nullptr) return;
  le32(_f, static_cast<uint32_t>(now_ns / 1'000'000'000));
  le32(_f, static_cast<uint32_t>(now_ns / 1000 % 1'000'000));
  le32(_f, static_cast<uint32_t>(len));
  le32(_f, static_cast<uint32_t>(len));
  std::fwrite(frame, 1, len, _f);
}

Status PcapWriter::close() {
  if (_f == nullptr) return Status::ok();
  const int r = std::fclose(_f);
  _f = nullptr;
  return r == 0 ? Status::ok() : Status::from_errno(errno, "close capture");
}

}  // namespace hcomm::sim::roce
