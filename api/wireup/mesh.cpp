#include "api/wireup/mesh.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <thread>

#include "api/wireup/run_dir.h"

namespace hcomm::api {

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

}  // namespace

Status send_msg(int fd, const void* data, size_t len, std::span<const int> fds, int peer_rank) {
  if (len == 0 || data == nullptr)
    return Status::error(Code::invalid_argument, "send_msg: empty message (SOCK_SEQPACKET cannot tell it from EOF)");
  if (len > kMaxMsg) return Status::error(Code::invalid_argument, "send_msg: %zu bytes exceeds %zu", len, kMaxMsg);
  if (fds.size() > kMaxMsgFds)
    return Status::error(Code::invalid_argument, "send_msg: %zu descriptors exceed %zu", fds.size(), kMaxMsgFds);
  iovec iov{const_cast<void*>(data), len};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * kMaxMsgFds)];
  if (!fds.empty()) {
    std::memset(cbuf, 0, sizeof cbuf);
    mh.msg_control = cbuf;
    mh.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
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
      return Status::error(Code::peer_failure, "%s closed its connection (exited or killed?)",
                           peer_name(peer_rank).c_str());
    return Status::from_errno(errno, "send_msg to " + peer_name(peer_rank));
  }
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
        return Status::error(Code::peer_failure, "%s closed its connection (exited or killed?)",
                             peer_name(peer_rank).c_str());
      return Status::from_errno(errno, "recv_msg from " + peer_name(peer_rank));
    }
    // Take ownership of every descriptor first, so that each error path
    // below closes them instead of leaking them into this process.
    std::vector<UniqueFd> got;
    for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c != nullptr; c = CMSG_NXTHDR(&mh, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int v;
        std::memcpy(&v, CMSG_DATA(c) + i * sizeof(int), sizeof v);
        got.emplace_back(v);
      }
    }
    out->resize(static_cast<size_t>(n));
    if (n == 0)
      return Status::error(Code::peer_failure, "%s closed its connection (exited or killed?)",
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

// ------------------------------------------------------------------ mesh --

namespace {

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

Status make_addr(const std::string& path, sockaddr_un* a) {
  if (path.size() >= sizeof a->sun_path)
    return Status::error(Code::invalid_argument, "socket path too long: %s", path.c_str());
  *a = {};
  a->sun_family = AF_UNIX;
  std::memcpy(a->sun_path, path.c_str(), path.size() + 1);
  return Status::ok();
}

// Owns the listening socket and its path; unlinks both on every exit.
struct Listener {
  UniqueFd fd;
  std::string dir, path;
  ~Listener() {
    fd.reset();
    if (!path.empty()) ::unlink(path.c_str());
    if (!dir.empty()) (void)::rmdir(dir.c_str());  // the last rank out removes it (ENOTEMPTY otherwise)
  }
};

}  // namespace

Status connect_mesh(Bootstrap& boot, const Deadline& dl, std::vector<UniqueFd>* peers) {
  if (peers == nullptr) return Status::error(Code::invalid_argument, "connect_mesh: null output");
  const int me = boot.rank(), size = boot.size();
  std::vector<UniqueFd> out(static_cast<size_t>(size));
  if (size == 1) {
    *peers = std::move(out);
    return Status::ok();
  }
  Listener l;
  std::string base;
  HCOMM_TRY(private_run_dir(&base));
  l.dir = base + "/mesh-" + file_safe_job(boot.job_id());
  if (::mkdir(l.dir.c_str(), 0700) != 0 && errno != EEXIST) return Status::from_errno(errno, "mkdir " + l.dir);
  l.path = l.dir + "/r" + std::to_string(me) + ".sock";
  sockaddr_un addr;
  HCOMM_TRY(make_addr(l.path, &addr));
  l.fd.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!l.fd.valid()) return Status::from_errno(errno, "socket(AF_UNIX, SOCK_SEQPACKET)");
  ::unlink(l.path.c_str());  // a stale socket of an earlier run with this job id and rank
  if (::bind(l.fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
    return Status::from_errno(errno, "bind " + l.path);
  if (::listen(l.fd.get(), size) != 0) return Status::from_errno(errno, "listen " + l.path);

  // Everyone listens before anyone connects: the allgather orders it.
  std::vector<std::string> all;
  HCOMM_TRY(boot.allgather(std::to_string(::getpid()) + " " + l.path, &all, dl));
  std::vector<pid_t> pids(static_cast<size_t>(size));
  std::vector<std::string> paths(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    const std::string& s = all[static_cast<size_t>(r)];
    size_t sp = s.find(' ');
    char* end = nullptr;
    long pid = sp == std::string::npos ? 0 : std::strtol(s.c_str(), &end, 10);
    if (pid <= 0 || end != s.c_str() + sp)
      return Status::error(Code::protocol_error, "mesh: rank %d published a malformed address \"%s\"", r, s.c_str());
    pids[static_cast<size_t>(r)] = static_cast<pid_t>(pid);
    paths[static_cast<size_t>(r)] = s.substr(sp + 1);
  }
  const std::string my_hello = hello(me, ::getpid(), boot.job_id());

  // Connect to every lower rank, one at a time. Deadlock-free: rank j
  // answers once it has finished its own lower ranks, and rank 0 has none.
  for (int j = 0; j < me; ++j) {
    sockaddr_un a;
    HCOMM_TRY(make_addr(paths[static_cast<size_t>(j)], &a));
    UniqueFd fd;
    for (;;) {
      fd.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
      if (!fd.valid()) return Status::from_errno(errno, "socket(AF_UNIX, SOCK_SEQPACKET)");
      if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) break;
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
    out[static_cast<size_t>(j)] = std::move(fd);
  }

  // Accept every higher rank, in whatever order they come.
  for (int pending = size - 1 - me; pending > 0;) {
    Status w = poll_for(l.fd.get(), POLLIN, dl, "waiting for mesh connections as", me);
    if (!w.is_ok()) {
      std::string missing;
      for (int r = me + 1; r < size; ++r)
        if (!out[static_cast<size_t>(r)].valid()) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      return Status::error(Code::timeout, "mesh: rank %d: ranks %s did not connect before the deadline", me,
                           missing.c_str());
    }
    UniqueFd fd(::accept4(l.fd.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!fd.valid()) {
      if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED) continue;
      return Status::from_errno(errno, "accept " + l.path);
    }
    std::vector<uint8_t> m;
    HCOMM_TRY(recv_msg(fd.get(), &m, nullptr, dl));
    int r = -1;
    HCOMM_TRY(check_hello(m, boot.job_id(), me, size, -1, pids, &r));
    if (out[static_cast<size_t>(r)].valid())
      return Status::error(Code::protocol_error, "mesh: rank %d connected twice", r);
    HCOMM_TRY(check_cred(fd.get(), pids[static_cast<size_t>(r)], r));
    HCOMM_TRY(send_msg(fd.get(), my_hello.data(), my_hello.size(), {}, dl, r));
    out[static_cast<size_t>(r)] = std::move(fd);
    --pending;
  }
  *peers = std::move(out);
  return Status::ok();
}

}  // namespace hcomm::api
