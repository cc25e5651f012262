// Deadline-bounded message I/O on a non-blocking AF_UNIX stream socket, with
// SCM_RIGHTS file descriptors. Shared by the vfio-user client (driver/) and
// server (sim/), which sit on opposite sides of the layering and both may
// include common/ only. Header-only: a few small loops around poll/recvmsg/
// sendmsg.
//
// Ownership: every fd received is wrapped in a UniqueFd the moment recvmsg
// returns it, so a caller that bails out early can never leak one. Fds sent
// are borrowed (the kernel duplicates them into the peer).
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "common/fd.h"
#include "common/status.h"
#include "common/time.h"

namespace hcomm::unix_socket {

enum class Io {
  ok,
  eof,      // the peer closed the connection (orderly or reset)
  timeout,  // the deadline passed
  aborted,  // abort_fd became readable (owner is shutting down)
  error,    // a system call failed; see *err
};

inline const char* io_name(Io io) {
  switch (io) {
    case Io::ok: return "ok";
    case Io::eof: return "peer closed the connection";
    case Io::timeout: return "timed out";
    case Io::aborted: return "aborted";
    case Io::error: return "socket error";
  }
  return "?";
}

// SCM_RIGHTS, the one home of the control-message handling that the
// vfio-user link and the api's mesh (api/wireup/mesh.cpp) both need.
// Attaches `fds` to `mh` as one SCM_RIGHTS message built in `cbuf`, which
// holds at least CMSG_SPACE(sizeof(int) * fds.size()) bytes, aligned for
// cmsghdr. No fds: no control message.
inline void attach_fds(msghdr* mh, void* cbuf, std::span<const int> fds) {
  if (fds.empty()) return;
  std::memset(cbuf, 0, CMSG_SPACE(sizeof(int) * fds.size()));
  mh->msg_control = cbuf;
  mh->msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
  cmsghdr* c = CMSG_FIRSTHDR(mh);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
  std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
}

// Every descriptor that arrived with `mh` (recvmsg's result), each owned by a
// UniqueFd the moment it is seen: appended to *out, or closed at once when out
// is null, so that no path can leak one into the process.
inline void take_fds(msghdr* mh, std::vector<UniqueFd>* out) {
  for (cmsghdr* c = CMSG_FIRSTHDR(mh); c != nullptr; c = CMSG_NXTHDR(mh, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      if (out != nullptr) {
        out->emplace_back(fd);
      } else {
        UniqueFd drop(fd);
      }
    }
  }
}

// Wait until `fd` is ready for `events` or the deadline / abort_fd fires.
// abort_fd < 0: none.
inline Io wait_fd(int fd, short events, const Deadline& dl, int abort_fd, int* err) {
  for (;;) {
    pollfd p[2] = {{fd, events, 0}, {abort_fd, POLLIN, 0}};
    int n = ::poll(p, abort_fd >= 0 ? 2 : 1, dl.remaining_ms());
    if (n < 0) {
      if (errno == EINTR) continue;
      *err = errno;
      return Io::error;
    }
    if (abort_fd >= 0 && (p[1].revents & POLLIN)) return Io::aborted;
    if (n == 0) {
      if (dl.expired()) return Io::timeout;
      continue;  // poll rounds to ms; re-check
    }
    // POLLHUP/POLLERR: let the following recv/send report what happened.
    if (p[0].revents != 0) return Io::ok;
  }
}

// Receive exactly `len` bytes (len may be 0: returns ok at once). Fds that
// arrive with any part are appended to *fds; *ctrunc is set when the kernel
// had to drop fds because more came than `max_fds` (those are closed by the
// kernel). *got counts bytes received so far, also on failure, so a caller can
// tell "closed between messages" (got == 0) from "closed mid-message".
inline Io recv_exact(int fd, void* buf, size_t len, const Deadline& dl, int abort_fd,
                     size_t max_fds, std::vector<UniqueFd>* fds, bool* ctrunc, size_t* got,
                     int* err) {
  *got = 0;
  auto* p = static_cast<uint8_t*>(buf);
  // Room for max_fds descriptors; at least one so that a peer sending an fd we
  // did not ask for is seen (and the fd closed) rather than silently dropped.
  std::vector<uint8_t> cbuf(CMSG_SPACE(sizeof(int) * (max_fds > 0 ? max_fds : 1)));
  while (*got < len) {
    iovec iov{p + *got, len - *got};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf.data();
    mh.msg_controllen = cbuf.size();
    ssize_t n = ::recvmsg(fd, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        Io w = wait_fd(fd, POLLIN, dl, abort_fd, err);
        if (w != Io::ok) return w;
        continue;
      }
      if (errno == ECONNRESET) return Io::eof;
      *err = errno;
      return Io::error;
    }
    take_fds(&mh, fds);
    if ((mh.msg_flags & MSG_CTRUNC) && ctrunc != nullptr) *ctrunc = true;
    if (n == 0) return Io::eof;
    *got += static_cast<size_t>(n);
  }
  return Io::ok;
}

// Send `a` then `b` as one message (`a` non-empty, `b` may be empty);
// `send_fds` ride on the first byte. Never raises SIGPIPE.
inline Io send_all(int fd, std::span<const uint8_t> a, std::span<const uint8_t> b,
                   std::span<const int> send_fds, const Deadline& dl, int abort_fd, int* err) {
  size_t total = a.size() + b.size();
  size_t sent = 0;
  std::vector<uint8_t> cbuf;
  while (sent < total) {
    iovec iov[2];
    int niov = 0;
    if (sent < a.size()) {
      iov[niov++] = {const_cast<uint8_t*>(a.data()) + sent, a.size() - sent};
      if (!b.empty()) iov[niov++] = {const_cast<uint8_t*>(b.data()), b.size()};
    } else {
      size_t off = sent - a.size();
      iov[niov++] = {const_cast<uint8_t*>(b.data()) + off, b.size() - off};
    }
    msghdr mh{};
    mh.msg_iov = iov;
    mh.msg_iovlen = static_cast<size_t>(niov);
    if (sent == 0 && !send_fds.empty()) {
      cbuf.resize(CMSG_SPACE(sizeof(int) * send_fds.size()));
      attach_fds(&mh, cbuf.data(), send_fds);
    }
    ssize_t n = ::sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        Io w = wait_fd(fd, POLLOUT, dl, abort_fd, err);
        if (w != Io::ok) return w;
        continue;
      }
      if (errno == EPIPE || errno == ECONNRESET) return Io::eof;
      *err = errno;
      return Io::error;
    }
    sent += static_cast<size_t>(n);
  }
  return Io::ok;
}

// Bind and listen on a non-blocking AF_UNIX stream socket at `path`. A stale
// socket file left by a crashed server is replaced, but never a file that is
// not a socket, nor one a live server still listens on. The caller unlinks
// the path when it stops serving.
inline Status listen_at(const std::string& path, UniqueFd* out) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof addr.sun_path)
    return Status::error(Code::invalid_argument, "socket path '%s' is empty or too long", path.c_str());
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  struct stat sb {};
  if (::lstat(path.c_str(), &sb) == 0) {
    if (!S_ISSOCK(sb.st_mode))
      return Status::error(Code::invalid_argument, "%s exists and is not a socket", path.c_str());
    UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (probe.valid()) {
      int rc = ::connect(probe.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr);
      if (rc == 0 || errno == EAGAIN)
        return Status::error(Code::invalid_argument, "%s is served by another live server", path.c_str());
    }
    ::unlink(path.c_str());
  }
  UniqueFd lfd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!lfd.valid()) return Status::from_errno(errno, "socket(AF_UNIX)");
  if (::bind(lfd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
    return Status::from_errno(errno, "bind " + path);
  if (::listen(lfd.get(), 8) != 0) {
    int e = errno;
    ::unlink(path.c_str());
    return Status::from_errno(e, "listen " + path);
  }
  *out = std::move(lfd);
  return Status::ok();
}

// The accept loop of a one-client-at-a-time server: waits for the next
// client on `listen_fd` (non-blocking, from listen_at) until `stop_fd`
// becomes readable. Returns ok with *out set, aborted on stop, or error
// (*err) when poll itself fails. Transient accept failures are retried; out
// of fds or memory backs off 100 ms instead of spinning on a readable
// listener.
inline Io accept_next(int listen_fd, int stop_fd, UniqueFd* out, int* err) {
  for (;;) {
    pollfd p[2] = {{listen_fd, POLLIN, 0}, {stop_fd, POLLIN, 0}};
    if (::poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      *err = errno;
      return Io::error;
    }
    if (p[1].revents & POLLIN) return Io::aborted;
    if (!(p[0].revents & POLLIN)) continue;
    UniqueFd client(::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (client.valid()) {
      *out = std::move(client);
      return Io::ok;
    }
    if (errno == EMFILE || errno == ENFILE || errno == ENOMEM || errno == ENOBUFS) {
      pollfd s{stop_fd, POLLIN, 0};
      if (::poll(&s, 1, 100) > 0) return Io::aborted;
    }
    // EAGAIN, ECONNABORTED, EINTR: the next poll decides
  }
}

}  // namespace hcomm::unix_socket
