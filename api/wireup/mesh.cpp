#include "api/wireup/mesh.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <linux/sockios.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>

#include "api/wireup/byte_order.h"
#include "api/wireup/host.h"
#include "api/wireup/mesh_wire.h"
#include "common/unix_socket.h"

namespace hcomm::api {

using namespace meshwire;

namespace {

std::string peer_name(int peer_rank) {
  return peer_rank >= 0 ? "rank " + std::to_string(peer_rank) : std::string("the peer");
}

Status poll_for(int fd, short events, const Deadline& dl, const char* what, int peer_rank) {
  for (;;) {
    pollfd p{fd, events, 0};
    int n = ::poll(&p, 1, dl.remaining_ms());
    if (n > 0) return Status::ok();
    if (n == 0)
      return Status::error(Code::timeout, "%s %s: deadline passed", what, peer_name(peer_rank).c_str());
    if (errno != EINTR) return Status::from_errno(errno, "poll");
  }
}

// ------------------------------------------------- SOCK_SEQPACKET (same host) --

Status send_packet(int fd, const void* data, size_t len, std::span<const int> fds, int peer_rank) {
  iovec iov{const_cast<void*>(data), len};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * kMaxMsgFds)];  // send_msg checked the count
  unix_socket::attach_fds(&mh, cbuf, fds);
  for (;;) {
    ssize_t n = ::sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n == static_cast<ssize_t>(len)) return Status::ok();
    if (n >= 0)  // cannot happen on SOCK_SEQPACKET; refuse to pretend it worked
      return Status::error(Code::io_error, "send_msg to %s: short send %zd of %zu", peer_name(peer_rank).c_str(), n,
                           len);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK)
      return Status::error(Code::no_resource, "send_msg to %s: socket full", peer_name(peer_rank).c_str());
    if (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN)
      return Status::error(Code::peer_failure, "%s closed its connection (exited, killed, or declared this rank failed?)",
                           peer_name(peer_rank).c_str());
    return Status::from_errno(errno, "send_msg to " + peer_name(peer_rank));
  }
}

Status recv_packet(int fd, std::vector<uint8_t>* out, std::vector<UniqueFd>* fds, const Deadline& dl,
                   int peer_rank) {
  // One byte more than the limit would be wasted: MSG_TRUNC tells us.
  out->resize(kMaxMsg);
  iovec iov{out->data(), out->size()};
  // Room for one more descriptor than allowed, so that "too many" shows up
  // as a count instead of a silent MSG_CTRUNC alone.
  alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * (kMaxMsgFds + 1))];
  for (;;) {
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof cbuf;
    ssize_t n = ::recvmsg(fd, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        out->clear();
        HCOMM_TRY(poll_for(fd, POLLIN, dl, "waiting for a message from", peer_rank));
        out->resize(kMaxMsg);
        continue;
      }
      out->clear();
      if (errno == ECONNRESET)
        return Status::error(Code::peer_failure, "%s closed its connection (exited, killed, or declared this rank failed?)",
                             peer_name(peer_rank).c_str());
      return Status::from_errno(errno, "recv_msg from " + peer_name(peer_rank));
    }
    // Take ownership of every descriptor first, so that each error path
    // below closes them instead of leaking them into this process.
    std::vector<UniqueFd> got;
    unix_socket::take_fds(&mh, &got);
    out->resize(static_cast<size_t>(n));
    if (n == 0)
      return Status::error(Code::peer_failure, "%s closed its connection (exited, killed, or declared this rank failed?)",
                           peer_name(peer_rank).c_str());
    if ((mh.msg_flags & MSG_TRUNC) != 0) {
      out->clear();
      return Status::error(Code::protocol_error, "message from %s exceeds %zu bytes", peer_name(peer_rank).c_str(),
                           kMaxMsg);
    }
    if ((mh.msg_flags & MSG_CTRUNC) != 0 || got.size() > kMaxMsgFds) {
      out->clear();
      return Status::error(Code::protocol_error, "message from %s carries more than %zu descriptors",
                           peer_name(peer_rank).c_str(), kMaxMsgFds);
    }
    if (!got.empty() && fds == nullptr) {
      out->clear();
      return Status::error(Code::protocol_error, "message from %s carries %zu unexpected descriptors",
                           peer_name(peer_rank).c_str(), got.size());
    }
    if (fds != nullptr) *fds = std::move(got);
    return Status::ok();
  }
}

// ------------------------------------------------------ SOCK_STREAM (TCP) --

// How long a stream may stall in the middle of a message (see mesh.h).
constexpr auto kStreamStall = std::chrono::seconds(2);

// max(dl, now + kStreamStall)
Deadline stall_deadline(const Deadline& dl) {
  auto left = std::max<Clock::duration>(dl.at() - Clock::now(), kStreamStall);
  return Deadline(std::chrono::duration_cast<std::chrono::nanoseconds>(left));
}

Status closed_error(int peer_rank, int err = 0) {
  // Keepalive or TCP_USER_TIMEOUT gave up: the host went silent, nobody closed anything.
  if (err == ETIMEDOUT)
    return Status::error(Code::peer_failure, "%s's host stopped answering (keepalive timed out: silent, stopped or unreachable)",
                         peer_name(peer_rank).c_str());
  return Status::error(Code::peer_failure, "%s closed its connection (exited, killed, or declared this rank failed?)", peer_name(peer_rank).c_str());
}

// The stream is out of step (half a message went out or came in): make sure
// nothing more travels on it, so both ends fail instead of misreading. What
// is already buffered is dropped too (SHUT_RD alone leaves it readable), so
// that our next recv_msg sees the end: peer_failure.
Status desync(int fd, Status why) {
  (void)::shutdown(fd, SHUT_RDWR);
  char sink[4096];
  for (int i = 0; i < 256 && ::recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0; ++i) {
  }
  return why;
}

// Back-pressure before the first byte: a frame goes out only if the send
// buffer seems to have room for all of it (queued bytes, SIOCOUTQ, against
// half of SO_SNDBUF, which the kernel doubles for bookkeeping) or is empty.
// The kernel may still take part of it; this only makes that rare, so that a
// receiver that is merely slow sees back-pressure, not a broken link.
bool room_for(int fd, size_t bytes) {
  int queued = 0, sndbuf = 0;
  socklen_t sl = sizeof sndbuf;
  if (::ioctl(fd, SIOCOUTQ, &queued) != 0 || ::getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, &sl) != 0)
    return true;  // cannot tell: let the send find out
  return queued <= 0 || static_cast<size_t>(queued) + bytes <= static_cast<size_t>(sndbuf) / 2;
}

Status send_frame(int fd, const void* data, size_t len, int peer_rank) {
  if (!room_for(fd, 4 + len))
    return Status::error(Code::no_resource, "send_msg to %s: socket full", peer_name(peer_rank).c_str());
  uint32_t be = htonl(static_cast<uint32_t>(len));
  iovec iov[2] = {{&be, 4}, {const_cast<void*>(data), len}};
  const size_t total = 4 + len;
  size_t off = 0;
  Deadline finish(std::chrono::nanoseconds(0));
  for (;;) {
    // Skip what already went out.
    iovec cur[2];
    int n_iov = 0;
    size_t skip = off;
    for (const iovec& v : iov) {
      if (skip >= v.iov_len) {
        skip -= v.iov_len;
        continue;
      }
      cur[n_iov++] = {static_cast<char*>(v.iov_base) + skip, v.iov_len - skip};
      skip = 0;
    }
    msghdr mh{};
    mh.msg_iov = cur;
    mh.msg_iovlen = static_cast<size_t>(n_iov);
    ssize_t n = ::sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      if (off == 0) finish = Deadline(kStreamStall);
      off += static_cast<size_t>(n);
      if (off == total) return Status::ok();
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (off == 0) return Status::error(Code::no_resource, "send_msg to %s: socket full", peer_name(peer_rank).c_str());
      Status w = poll_for(fd, POLLOUT, finish, "finishing a message to", peer_rank);
      if (!w)
        return desync(fd, Status::error(Code::peer_failure,
                                        "%s stopped reading in the middle of a message (%zu of %zu bytes sent); "
                                        "connection shut down",
                                        peer_name(peer_rank).c_str(), off, total));
      continue;
    }
    if (n < 0 && (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN || errno == ETIMEDOUT))
      return off == 0 ? closed_error(peer_rank) : desync(fd, closed_error(peer_rank));
    Status st = Status::from_errno(n < 0 ? errno : EIO, "send_msg to " + peer_name(peer_rank));
    return off == 0 ? st : desync(fd, st);
  }
}

// Reads exactly len bytes; *got counts what arrived. Until the message's
// first byte (*rest empty) it waits until `first`; from then on until *rest,
// set when that byte came to max(first, now + kStreamStall).
Status read_stream(int fd, uint8_t* buf, size_t len, size_t* got, const Deadline& first,
                   std::optional<Deadline>* rest, int peer_rank) {
  while (*got < len) {
    ssize_t n = ::recv(fd, buf + *got, len - *got, MSG_DONTWAIT);
    if (n > 0) {
      if (!rest->has_value()) rest->emplace(stall_deadline(first));
      *got += static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return closed_error(peer_rank);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      HCOMM_TRY(poll_for(fd, POLLIN, rest->has_value() ? **rest : first, "waiting for a message from", peer_rank));
      continue;
    }
    if (errno == ECONNRESET || errno == ETIMEDOUT || errno == ENOTCONN) return closed_error(peer_rank, errno);
    return Status::from_errno(errno, "recv_msg from " + peer_name(peer_rank));
  }
  return Status::ok();
}

Status recv_frame(int fd, std::vector<uint8_t>* out, const Deadline& dl, int peer_rank) {
  out->clear();
  uint8_t h[4];
  size_t got = 0;
  std::optional<Deadline> rest;
  Status st = read_stream(fd, h, 4, &got, dl, &rest, peer_rank);
  if (!st) {
    if (!rest) return st;  // nothing of this message yet: timeout / closed as such
    return desync(fd, st.code() == Code::timeout
                          ? Status::error(Code::peer_failure,
                                          "%s stalled in the middle of a message header; connection shut down",
                                          peer_name(peer_rank).c_str())
                          : Status(st.code(), st.message() + " (in the middle of a message)"));
  }
  uint32_t be;
  std::memcpy(&be, h, 4);
  size_t len = ntohl(be);
  if (len == 0 || len > kMaxMsg)
    return desync(fd, Status::error(Code::protocol_error, "message from %s has length %zu, outside 1..%zu",
                                    peer_name(peer_rank).c_str(), len, kMaxMsg));
  out->resize(len);
  got = 0;
  st = read_stream(fd, out->data(), len, &got, dl, &rest, peer_rank);
  if (!st) {
    out->clear();
    return desync(fd, st.code() == Code::timeout
                          ? Status::error(Code::peer_failure,
                                          "%s stalled in the middle of a message (%zu of %zu bytes); connection "
                                          "shut down",
                                          peer_name(peer_rank).c_str(), got, len)
                          : Status(st.code(), st.message() + " (in the middle of a message)"));
  }
  return Status::ok();
}

// SOCK_STREAM (framed) or SOCK_SEQPACKET; anything else is refused.
Status is_stream(int fd, bool* stream) {
  int type = 0;
  socklen_t len = sizeof type;
  if (::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0) return Status::from_errno(errno, "getsockopt(SO_TYPE)");
  if (type != SOCK_STREAM && type != SOCK_SEQPACKET)
    return Status::error(Code::invalid_argument, "mesh socket has type %d, neither stream nor seqpacket", type);
  *stream = type == SOCK_STREAM;
  return Status::ok();
}

}  // namespace

Status send_msg(int fd, const void* data, size_t len, std::span<const int> fds, int peer_rank) {
  if (len == 0 || data == nullptr)
    return Status::error(Code::invalid_argument, "send_msg: empty message (SOCK_SEQPACKET cannot tell it from EOF)");
  if (len > kMaxMsg) return Status::error(Code::invalid_argument, "send_msg: %zu bytes exceeds %zu", len, kMaxMsg);
  if (fds.size() > kMaxMsgFds)
    return Status::error(Code::invalid_argument, "send_msg: %zu descriptors exceed %zu", fds.size(), kMaxMsgFds);
  bool stream = false;
  HCOMM_TRY(is_stream(fd, &stream));
  if (!stream) return send_packet(fd, data, len, fds, peer_rank);
  if (!fds.empty())
    return Status::error(Code::invalid_argument, "send_msg to %s: descriptors cannot cross hosts",
                         peer_name(peer_rank).c_str());
  return send_frame(fd, data, len, peer_rank);
}

Status send_msg(int fd, const void* data, size_t len, std::span<const int> fds, const Deadline& dl, int peer_rank) {
  for (;;) {
    Status st = send_msg(fd, data, len, fds, peer_rank);
    if (st.code() != Code::no_resource) return st;
    HCOMM_TRY(poll_for(fd, POLLOUT, dl, "sending to", peer_rank));
  }
}

Status recv_msg(int fd, std::vector<uint8_t>* out, std::vector<UniqueFd>* fds, const Deadline& dl, int peer_rank) {
  if (out == nullptr) return Status::error(Code::invalid_argument, "recv_msg: null output");
  if (fds != nullptr) fds->clear();
  bool stream = false;
  HCOMM_TRY(is_stream(fd, &stream));
  return stream ? recv_frame(fd, out, dl, peer_rank) : recv_packet(fd, out, fds, dl, peer_rank);
}

// ------------------------------------------------------------------ mesh --

uint64_t mesh_job_cookie(const std::string& job_id) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : job_id) h = (h ^ c) * 1099511628211ull;
  return h;
}

namespace {

// --- same host: AF_UNIX SOCK_SEQPACKET ---


}  // namespace

namespace meshwire {

constexpr uint32_t kHelloMagic = 0x48434d48;  // "HCMH"
constexpr uint32_t kHelloVersion = 1;

std::string hello(int rank, pid_t pid, const std::string& job) {
  std::string h(16, '\0');
  uint32_t v[4] = {kHelloMagic, kHelloVersion, static_cast<uint32_t>(rank), static_cast<uint32_t>(pid)};
  std::memcpy(h.data(), v, sizeof v);  // host order: both ends are on this host
  return h + job;
}

// Checks a hello against what the allgather promised for `expect_rank`
// (-1: any rank in (self, size)); *rank_out gets the claimed rank.
Status check_hello(const std::vector<uint8_t>& m, const std::string& job, int self, int size, int expect_rank,
                   const std::vector<pid_t>& pids, int* rank_out) {
  if (m.size() < 16) return Status::error(Code::protocol_error, "mesh hello: %zu bytes, too short", m.size());
  uint32_t v[4];
  std::memcpy(v, m.data(), sizeof v);
  if (v[0] != kHelloMagic) return Status::error(Code::protocol_error, "mesh hello: bad magic 0x%08x", v[0]);
  if (v[1] != kHelloVersion)
    return Status::error(Code::protocol_error, "mesh hello: version %u, expected %u", v[1], kHelloVersion);
  int r = static_cast<int>(v[2]);
  if (expect_rank >= 0 ? r != expect_rank : (v[2] >= static_cast<uint32_t>(size) || r <= self))
    return Status::error(Code::protocol_error, "mesh hello from unexpected rank %u (rank %d expected %s)", v[2], self,
                         expect_rank >= 0 ? std::to_string(expect_rank).c_str() : "a higher rank");
  std::string their_job(reinterpret_cast<const char*>(m.data()) + 16, m.size() - 16);
  if (their_job != job)
    return Status::error(Code::protocol_error, "mesh hello from rank %d: job \"%s\", expected \"%s\"", r,
                         their_job.c_str(), job.c_str());
  if (static_cast<pid_t>(v[3]) != pids[static_cast<size_t>(r)])
    return Status::error(Code::protocol_error, "mesh hello from rank %d: pid %u, but the bootstrap said %d", r, v[3],
                         static_cast<int>(pids[static_cast<size_t>(r)]));
  *rank_out = r;
  return Status::ok();
}

}  // namespace meshwire

namespace {

// The kernel's word on who is at the other end, against the claimed pid.
Status check_cred(int fd, pid_t want, int r) {
  ucred cr{};
  socklen_t len = sizeof cr;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0) return Status::from_errno(errno, "SO_PEERCRED");
  if (cr.pid != want || cr.uid != ::getuid())
    return Status::error(Code::protocol_error, "mesh socket of rank %d belongs to pid %d uid %u, expected pid %d", r,
                         static_cast<int>(cr.pid), static_cast<unsigned>(cr.uid), static_cast<int>(want));
  return Status::ok();
}

// The mesh listens in Linux's abstract socket namespace, on a name the
// kernel picks (autobind: NUL and five hex digits) and the allgather
// publishes (written with a leading '@' for the NUL): gone the moment its
// socket closes, so a rank killed at any point leaves no file behind; never
// taken by someone else first, since nobody can predict it. Anyone in the
// network namespace may still connect: the accept path checks the uid, the
// hello and SO_PEERCRED, as file permissions would.
Status listen_abstract(int backlog, UniqueFd* out, std::string* name) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return Status::from_errno(errno, "socket(AF_UNIX, SOCK_SEQPACKET)");
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(sa_family_t)) != 0)
    return Status::from_errno(errno, "bind (abstract autobind)");
  socklen_t len = sizeof a;
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0)
    return Status::from_errno(errno, "getsockname");
  const size_t n = len > offsetof(sockaddr_un, sun_path) ? len - offsetof(sockaddr_un, sun_path) : 0;
  if (n < 2 || a.sun_path[0] != '\0')
    return Status::error(Code::io_error, "autobind gave no abstract name (%zu bytes)", n);
  if (::listen(fd.get(), backlog) != 0) return Status::from_errno(errno, "listen (mesh)");
  *name = "@" + std::string(a.sun_path + 1, n - 1);
  *out = std::move(fd);
  return Status::ok();
}

Status make_addr(const std::string& name, sockaddr_un* a, socklen_t* len) {
  if (name.size() < 2 || name[0] != '@' || name.size() > sizeof a->sun_path)
    return Status::error(Code::protocol_error, "bad mesh socket name \"%s\"", name.c_str());
  *a = {};
  a->sun_family = AF_UNIX;
  std::memcpy(a->sun_path + 1, name.data() + 1, name.size() - 1);  // sun_path[0] = 0: abstract
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size());
  return Status::ok();
}

// --- other hosts: TCP ---

// A connection that has not said hello within this long is dropped, so that
// a silent stranger cannot hold up the mesh for long.
constexpr auto kHelloWait = std::chrono::seconds(2);


using wire::get32;
using wire::put16;
using wire::put32;

}  // namespace

namespace meshwire {

std::string tcp_hello(uint16_t type, uint64_t cookie, int rank, int size, const std::string& text) {
  std::string h;
  put32(&h, kMeshTcpMagic);
  put16(&h, kMeshTcpVersion);
  put16(&h, type);
  put32(&h, static_cast<uint32_t>(cookie >> 32));
  put32(&h, static_cast<uint32_t>(cookie));
  put32(&h, static_cast<uint32_t>(rank));
  put32(&h, static_cast<uint32_t>(size));
  std::string t = text.substr(0, kMaxRefuse);
  put32(&h, static_cast<uint32_t>(t.size()));
  return h + t;
}

}  // namespace meshwire

namespace {

Status write_all(int fd, const std::string& bytes, const Deadline& dl, int peer_rank) {
  size_t off = 0;
  while (off < bytes.size()) {
    ssize_t n = ::send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      off += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      HCOMM_TRY(poll_for(fd, POLLOUT, dl, "sending a hello to", peer_rank));
      continue;
    }
    if (n < 0 && (errno == EPIPE || errno == ECONNRESET)) return closed_error(peer_rank);
    return Status::from_errno(errno, "send to " + peer_name(peer_rank));
  }
  return Status::ok();
}

}  // namespace

namespace meshwire {

// Reads one hello; the magic and the text length are checked before the
// text is read, so a stranger's garbage never makes us wait for or allocate
// what it announces.
Status read_tcp_hello(int fd, const Deadline& dl, int peer_rank, TcpHello* h) {
  uint8_t b[kMeshTcpHello];
  size_t got = 0;
  std::optional<Deadline> rest;
  HCOMM_TRY(read_stream(fd, b, sizeof b, &got, dl, &rest, peer_rank));
  h->magic = get32(b);
  h->version = static_cast<uint16_t>(get32(b + 4) >> 16);
  h->type = static_cast<uint16_t>(get32(b + 4) & 0xffff);
  h->cookie = (uint64_t{get32(b + 8)} << 32) | get32(b + 12);
  h->rank = get32(b + 16);
  h->size = get32(b + 20);
  uint32_t tlen = get32(b + 24);
  if (h->magic != kMeshTcpMagic)
    return Status::error(Code::protocol_error, "not an hcomm mesh hello (magic 0x%08x, expected 0x%08x)", h->magic,
                         kMeshTcpMagic);
  if (tlen > kMaxRefuse)
    return Status::error(Code::protocol_error, "mesh hello announces %u bytes of text, more than %zu", tlen,
                         kMaxRefuse);
  h->text.assign(tlen, '\0');
  got = 0;
  return read_stream(fd, reinterpret_cast<uint8_t*>(h->text.data()), tlen, &got, dl, &rest, peer_rank);
}

// What a hello must say to be the rank we expect: `expect` >= 0 (we
// connected to it), or any higher rank on another host (-1: we accepted it).
Status check_tcp_hello(const TcpHello& h, uint64_t cookie, int me, int size, int expect,
                       const std::vector<MeshLink>& links) {
  if (h.version != kMeshTcpVersion)
    return Status::error(Code::protocol_error,
                         "mesh wire protocol version %u, this build speaks %u (a different hcomm build?)", h.version,
                         kMeshTcpVersion);
  if (h.type != kTcpHello) return Status::error(Code::protocol_error, "mesh hello of type %u, expected HELLO", h.type);
  if (h.cookie != cookie)
    return Status::error(Code::protocol_error, "mesh hello from another job (job cookie %016llx, this job's is %016llx)",
                         static_cast<unsigned long long>(h.cookie), static_cast<unsigned long long>(cookie));
  if (h.size != static_cast<uint32_t>(size))
    return Status::error(Code::protocol_error, "mesh hello: world size %u, this job has %d", h.size, size);
  if (expect >= 0) {
    if (h.rank != static_cast<uint32_t>(expect))
      return Status::error(Code::protocol_error, "mesh hello from rank %u, expected rank %d", h.rank, expect);
    return Status::ok();
  }
  if (h.rank >= static_cast<uint32_t>(size) || static_cast<int>(h.rank) <= me)
    return Status::error(Code::protocol_error, "mesh hello from rank %u: only ranks above %d connect to rank %d",
                         h.rank, me, me);
  const MeshLink& l = links[h.rank];
  if (l.same_host)
    return Status::error(Code::protocol_error, "mesh hello from rank %u over TCP, but it is on this host (%s)", h.rank,
                         l.host.c_str());
  if (l.fd.valid()) return Status::error(Code::protocol_error, "mesh hello: rank %u connected twice", h.rank);
  return Status::ok();
}

Status parse_ctrl(const std::vector<uint8_t>& buf, size_t nfds, CtrlType want, int from_rank, size_t want_fds,
                  uint32_t max_slots, CtrlMsg* out) {
  const char* what = want == CtrlType::segments ? "segment message" : "control message";
  if (buf.size() != sizeof(CtrlMsg))
    return Status::error(Code::protocol_error, "rank %d: malformed %s (%zu bytes, expected %zu)", from_rank, what,
                         buf.size(), sizeof(CtrlMsg));
  CtrlMsg m;
  std::memcpy(&m, buf.data(), sizeof m);
  if (m.type != static_cast<uint32_t>(want))
    return Status::error(Code::protocol_error, "rank %d: unexpected control message type %u (expected %u)", from_rank,
                         m.type, static_cast<uint32_t>(want));
  if (m.rank != from_rank)
    return Status::error(Code::protocol_error, "rank %d: %s claims to come from rank %d", from_rank, what, m.rank);
  if (nfds != want_fds)
    return Status::error(Code::protocol_error, "rank %d: %s with %zu descriptors, expected %zu", from_rank, what, nfds,
                         want_fds);
  if (want == CtrlType::advert && m.slot >= max_slots)
    return Status::error(Code::protocol_error, "rank %d: advert of key slot %u, beyond %u", from_rank, m.slot,
                         max_slots);
  *out = m;
  return Status::ok();
}

}  // namespace meshwire

namespace {

// env HCOMM_KEEPALIVE_MS: the bound on noticing a silent peer host.
Status keepalive_ms(int* out) {
  *out = 5000;
  const char* e = std::getenv("HCOMM_KEEPALIVE_MS");
  if (e == nullptr || *e == '\0') return Status::ok();
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(e, &end, 10);
  if (end == e || *end != '\0' || errno == ERANGE || v < 1000 || v > 3600000)
    return Status::error(Code::invalid_argument, "HCOMM_KEEPALIVE_MS=\"%s\": use 1000..3600000 (milliseconds)", e);
  *out = static_cast<int>(v);
  return Status::ok();
}

// TCP_NODELAY (control messages are small and latency-bound) and keepalive.
// With T = HCOMM_KEEPALIVE_MS (ms; keepalive settings are whole seconds):
//   TCP_KEEPIDLE  = idle  = max(1, T / 2000) s   (half the bound idle)
//   TCP_KEEPCNT   = cnt   = 3
//   TCP_KEEPINTVL = intvl = max(1, (T / 1000 - idle) / cnt) s
//   TCP_USER_TIMEOUT = T ms (data unacknowledged for T fails the link)
// so an idle link to a silent host fails after idle + cnt * intvl (= T for
// T a multiple of 2 s up to rounding; 4 s for T < 4000), a busy one after T.
// The default 5000 gives idle 2 s, intvl 1 s: 5 s either way.
Status tune_tcp(int fd, int t_ms) {
  const int one = 1;
  const int idle = std::max(1, t_ms / 2000), cnt = 3;
  const int intvl = std::max(1, (t_ms / 1000 - idle) / cnt);
  const unsigned user_timeout = static_cast<unsigned>(t_ms);
  struct Opt {
    int level, name;
    const void* v;
    socklen_t len;
    const char* what;
  } opts[] = {
      {IPPROTO_TCP, TCP_NODELAY, &one, sizeof one, "TCP_NODELAY"},
      {SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one, "SO_KEEPALIVE"},
      {IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle, "TCP_KEEPIDLE"},
      {IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl, "TCP_KEEPINTVL"},
      {IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt, "TCP_KEEPCNT"},
      {IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, sizeof user_timeout, "TCP_USER_TIMEOUT"},
  };
  for (const Opt& o : opts)
    if (::setsockopt(fd, o.level, o.name, o.v, o.len) != 0) return Status::from_errno(errno, o.what);
  return Status::ok();
}

Status numeric_addr(const std::string& addr, int port, sockaddr_storage* ss, socklen_t* len) {
  *ss = {};
  auto* v4 = reinterpret_cast<sockaddr_in*>(ss);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(ss);
  if (::inet_pton(AF_INET, addr.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(static_cast<uint16_t>(port));
    *len = sizeof *v4;
    return Status::ok();
  }
  if (::inet_pton(AF_INET6, addr.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(static_cast<uint16_t>(port));
    *len = sizeof *v6;
    return Status::ok();
  }
  return Status::error(Code::invalid_argument, "\"%s\" is not a numeric IPv4/IPv6 address", addr.c_str());
}

std::string endpoint(const std::string& addr, int port) {
  if (addr.find(':') != std::string::npos) return "[" + addr + "]:" + std::to_string(port);
  return addr + ":" + std::to_string(port);
}

Status listen_tcp(const std::string& addr, int backlog, UniqueFd* out, int* port) {
  sockaddr_storage ss{};
  socklen_t len = 0;
  HCOMM_TRY(numeric_addr(addr, 0, &ss, &len));
  UniqueFd fd(::socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return Status::from_errno(errno, "socket(TCP)");
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&ss), len) != 0 || ::listen(fd.get(), backlog) != 0)
    return Status::from_errno(errno, "mesh: listen on " + endpoint(addr, 0));
  len = sizeof ss;
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len) != 0)
    return Status::from_errno(errno, "getsockname");
  *port = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                         : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  *out = std::move(fd);
  return Status::ok();
}

Status connect_tcp(const std::string& addr, int port, const Deadline& dl, int me, int j, UniqueFd* out) {
  sockaddr_storage ss{};
  socklen_t len = 0;
  HCOMM_TRY(numeric_addr(addr, port, &ss, &len));
  UniqueFd fd(::socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return Status::from_errno(errno, "socket(TCP)");
  int err = 0;
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&ss), len) != 0) {
    err = errno;
    if (err == EINPROGRESS) {
      Status w = poll_for(fd.get(), POLLOUT, dl, "connecting to", j);
      if (!w) return w;
      socklen_t el = sizeof err;
      (void)::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &el);
    }
  }
  if (err != 0)
    return Status::error(err == ECONNREFUSED ? Code::peer_failure : Code::io_error,
                         "mesh: rank %d cannot connect to rank %d at %s: %s", me, j, endpoint(addr, port).c_str(),
                         std::strerror(err));
  *out = std::move(fd);
  return Status::ok();
}

// Parses round 1's blob "pid\nhost\npath".
Status parse_unix_blob(const std::string& s, int r, pid_t* pid, std::string* host, std::string* path) {
  size_t a = s.find('\n'), b = a == std::string::npos ? a : s.find('\n', a + 1);
  char* end = nullptr;
  long p = a == std::string::npos ? 0 : std::strtol(s.c_str(), &end, 10);
  if (b == std::string::npos || p <= 0 || end != s.c_str() + a)
    return Status::error(Code::protocol_error, "mesh: rank %d published a malformed address \"%s\"", r, s.c_str());
  *pid = static_cast<pid_t>(p);
  *host = s.substr(a + 1, b - a - 1);
  *path = s.substr(b + 1);
  return Status::ok();
}

// Parses round 2's blob "addr port" ("" = no listener).
Status parse_tcp_blob(const std::string& s, int r, std::string* addr, int* port) {
  size_t sp = s.rfind(' ');
  char* end = nullptr;
  long p = sp == std::string::npos ? 0 : std::strtol(s.c_str() + sp + 1, &end, 10);
  if (sp == std::string::npos || p < 1 || p > 65535 || *end != '\0')
    return Status::error(Code::protocol_error, "mesh: rank %d published a malformed TCP endpoint \"%s\"", r,
                         s.c_str());
  *addr = s.substr(0, sp);
  *port = static_cast<int>(p);
  return Status::ok();
}

Deadline min_deadline(const Deadline& dl, std::chrono::nanoseconds cap) {
  auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(dl.at() - Clock::now());
  return Deadline(std::min(left, cap));
}

}  // namespace

Status connect_mesh(Bootstrap& boot, const Deadline& dl, std::vector<MeshLink>* peers) {
  if (peers == nullptr) return Status::error(Code::invalid_argument, "connect_mesh: null output");
  const int me = boot.rank(), size = boot.size();
  std::vector<MeshLink> out(static_cast<size_t>(size));
  const std::string my_host = host_id();
  out[static_cast<size_t>(me)].host = my_host;
  if (size == 1) {
    *peers = std::move(out);
    return Status::ok();
  }
  if (my_host.find('\n') != std::string::npos)
    return Status::error(Code::invalid_argument, "host id \"%s\" (HCOMM_HOST_ID?) contains a newline",
                         my_host.c_str());
  int keep_ms = 0;
  HCOMM_TRY(keepalive_ms(&keep_ms));

  // Round 1: who is where. Every rank listens on its abstract name first (the
  // allgather orders listening before anyone connects).
  UniqueFd listener;
  std::string my_name;
  HCOMM_TRY(listen_abstract(size, &listener, &my_name));

  std::vector<std::string> all;
  HCOMM_TRY(boot.allgather(std::to_string(::getpid()) + "\n" + my_host + "\n" + my_name, &all, dl));
  std::vector<pid_t> pids(static_cast<size_t>(size));
  std::vector<std::string> paths(static_cast<size_t>(size));
  bool hosts_differ = false, have_remote = false;
  for (int r = 0; r < size; ++r) {
    auto& link = out[static_cast<size_t>(r)];
    HCOMM_TRY(parse_unix_blob(all[static_cast<size_t>(r)], r, &pids[static_cast<size_t>(r)], &link.host,
                              &paths[static_cast<size_t>(r)]));
    link.same_host = link.host == my_host;
    have_remote |= !link.same_host;
    hosts_differ |= link.host != out[0].host;
  }

  // Round 2, only when the job spans hosts (every rank sees the same hosts,
  // so every rank agrees on whether it happens): TCP endpoints.
  UniqueFd tcp_l;
  std::vector<std::string> tcp_addr(static_cast<size_t>(size));
  std::vector<int> tcp_port(static_cast<size_t>(size), 0);
  if (hosts_differ) {
    std::string mine;
    if (have_remote) {
      std::string a;
      int port = 0;
      HCOMM_TRY(mesh_listen_address(&a));
      HCOMM_TRY(listen_tcp(a, size, &tcp_l, &port));
      mine = a + " " + std::to_string(port);
    }
    HCOMM_TRY(boot.allgather(mine, &all, dl));
    for (int r = 0; r < size; ++r)
      if (!out[static_cast<size_t>(r)].same_host)
        HCOMM_TRY(parse_tcp_blob(all[static_cast<size_t>(r)], r, &tcp_addr[static_cast<size_t>(r)],
                                 &tcp_port[static_cast<size_t>(r)]));
  }
  const std::string my_hello = hello(me, ::getpid(), boot.job_id());
  const uint64_t cookie = mesh_job_cookie(boot.job_id());
  const std::string my_tcp_hello = tcp_hello(kTcpHello, cookie, me, size);

  // Connect to every lower rank, one at a time. Deadlock-free: rank j
  // answers once it has finished its own lower ranks, and rank 0 has none.
  for (int j = 0; j < me; ++j) {
    auto& link = out[static_cast<size_t>(j)];
    UniqueFd fd;
    if (!link.same_host) {
      HCOMM_TRY(connect_tcp(tcp_addr[static_cast<size_t>(j)], tcp_port[static_cast<size_t>(j)], dl, me, j, &fd));
      HCOMM_TRY(tune_tcp(fd.get(), keep_ms));
      HCOMM_TRY(write_all(fd.get(), my_tcp_hello, dl, j));
      TcpHello h;
      HCOMM_TRY(read_tcp_hello(fd.get(), dl, j, &h));
      if (h.type == kTcpRefuse)
        return Status::error(Code::protocol_error, "mesh: rank %d refused rank %d's connection: %s", j, me,
                             h.text.c_str());
      if (Status st = check_tcp_hello(h, cookie, me, size, j, out); !st)
        return Status(st.code(), "mesh: rank " + std::to_string(j) + " at " +
                                     endpoint(tcp_addr[static_cast<size_t>(j)], tcp_port[static_cast<size_t>(j)]) +
                                     ": " + st.message());
      link.fd = std::move(fd);
      continue;
    }
    sockaddr_un a;
    socklen_t alen = 0;
    HCOMM_TRY(make_addr(paths[static_cast<size_t>(j)], &a, &alen));
    for (;;) {
      fd.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
      if (!fd.valid()) return Status::from_errno(errno, "socket(AF_UNIX, SOCK_SEQPACKET)");
      if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), alen) == 0) break;
      int err = errno;
      if (err != EAGAIN && err != EINTR)  // EAGAIN: backlog full, retry
        return Status::error(err == ECONNREFUSED || err == ENOENT ? Code::peer_failure : Code::io_error,
                             "mesh: rank %d cannot connect to rank %d at %s: %s", me, j,
                             paths[static_cast<size_t>(j)].c_str(), std::strerror(err));
      if (dl.expired())
        return Status::error(Code::timeout, "mesh: rank %d: rank %d's socket stayed busy", me, j);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    HCOMM_TRY(check_cred(fd.get(), pids[static_cast<size_t>(j)], j));
    HCOMM_TRY(send_msg(fd.get(), my_hello.data(), my_hello.size(), {}, dl, j));
    std::vector<uint8_t> m;
    HCOMM_TRY(recv_msg(fd.get(), &m, nullptr, dl, j));
    int r;
    HCOMM_TRY(check_hello(m, boot.job_id(), me, size, j, pids, &r));
    link.fd = std::move(fd);
  }

  // Accept every higher rank, in whatever order and over whichever listener
  // they come.
  std::string refused;  // strangers turned away, for the timeout message
  for (int pending = size - 1 - me; pending > 0;) {
    pollfd pf[2] = {{listener.get(), POLLIN, 0}, {tcp_l.get(), POLLIN, 0}};
    int n = ::poll(pf, tcp_l.valid() ? 2 : 1, dl.remaining_ms());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::from_errno(errno, "poll");
    if (n == 0) {
      std::string missing;
      for (int r = me + 1; r < size; ++r)
        if (!out[static_cast<size_t>(r)].fd.valid()) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      return Status::error(Code::timeout, "mesh: rank %d: ranks %s did not connect before the deadline%s", me,
                           missing.c_str(), refused.c_str());
    }
    if (pf[1].revents != 0) {
      UniqueFd fd(::accept4(tcp_l.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (!fd.valid()) {
        if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED)
          return Status::from_errno(errno, "accept (mesh TCP listener)");
      } else {
        TcpHello h;
        Status st = read_tcp_hello(fd.get(), min_deadline(dl, kHelloWait), -1, &h);
        if (st) st = check_tcp_hello(h, cookie, me, size, -1, out);
        if (!st) {
          // Say why, then keep waiting for the real peers.
          (void)write_all(fd.get(), tcp_hello(kTcpRefuse, cookie, me, size, st.message()), Deadline::after_ms(200), -1);
          refused += "; refused a TCP connection: " + st.message();
          continue;
        }
        const int r = static_cast<int>(h.rank);
        HCOMM_TRY(tune_tcp(fd.get(), keep_ms));
        HCOMM_TRY(write_all(fd.get(), my_tcp_hello, dl, r));
        out[static_cast<size_t>(r)].fd = std::move(fd);
        --pending;
      }
    }
    if (pf[0].revents == 0) continue;
    UniqueFd fd(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!fd.valid()) {
      if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED) continue;
      return Status::from_errno(errno, "accept " + my_name);
    }
    // Anyone in this network namespace can reach an abstract name: a
    // connection that is not one of our ranks (another user, a stale or
    // foreign process, one that stays silent past kHelloWait) is dropped
    // and noted, and the mesh keeps waiting for the real peers.
    std::vector<uint8_t> m;
    int r = -1;
    ucred cr{};
    socklen_t crlen = sizeof cr;
    Status st = ::getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cr, &crlen) == 0 && cr.uid == ::getuid()
                    ? Status::ok()
                    : Status::error(Code::protocol_error, "a connection from uid %u", static_cast<unsigned>(cr.uid));
    if (st) st = recv_msg(fd.get(), &m, nullptr, min_deadline(dl, kHelloWait));
    if (st) st = check_hello(m, boot.job_id(), me, size, -1, pids, &r);
    if (st && out[static_cast<size_t>(r)].fd.valid())
      st = Status::error(Code::protocol_error, "rank %d connected twice", r);
    if (st && !out[static_cast<size_t>(r)].same_host)
      st = Status::error(Code::protocol_error, "rank %d (host %s) connected over AF_UNIX to host %s", r,
                         out[static_cast<size_t>(r)].host.c_str(), my_host.c_str());
    if (st) st = check_cred(fd.get(), pids[static_cast<size_t>(r)], r);
    if (!st) {
      refused += "; dropped a local connection: " + st.message();
      continue;
    }
    HCOMM_TRY(send_msg(fd.get(), my_hello.data(), my_hello.size(), {}, dl, r));
    out[static_cast<size_t>(r)].fd = std::move(fd);
    --pending;
  }
  *peers = std::move(out);
  return Status::ok();
}

Status mesh_goodbye(MeshLink& link, const Deadline& dl) {
  if (!link.fd.valid()) return Status::ok();
  const int fd = link.fd.get();
  const std::string who = "the peer on host " + link.host;
  if (::shutdown(fd, SHUT_WR) != 0 && errno != ENOTCONN) return Status::from_errno(errno, "shutdown " + who);
  char buf[4096];
  for (;;) {
    // Without a control buffer the kernel closes any descriptors that arrive.
    ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n == 0) return Status::ok();
    if (n > 0 || (n < 0 && errno == EINTR)) continue;  // late messages: the caller has said it is done
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      pollfd p{fd, POLLIN, 0};
      int k = ::poll(&p, 1, dl.remaining_ms());
      if (k == 0)
        return Status::error(Code::timeout, "mesh goodbye: %s did not close its end before the deadline",
                             who.c_str());
      if (k < 0 && errno != EINTR) return Status::from_errno(errno, "poll");
      continue;
    }
    if (errno == ECONNRESET || errno == ETIMEDOUT || errno == ENOTCONN || errno == EPIPE)
      return Status::error(Code::peer_failure, "mesh goodbye: %s reset the connection instead of closing it",
                           who.c_str());
    return Status::from_errno(errno, "recv from " + who);
  }
}

}  // namespace hcomm::api
