// Helpers for fuzz targets that push their input through a real socket, so
// the code under test reads it exactly as it reads a peer.
#pragma once

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace fuzz_io {

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "fuzz: %s\n", what);
  std::abort();
}

// A connected AF_UNIX pair of `type`; [0] is the reader. Room for 1 MiB
// queued, so that a whole input is written before it is read.
struct Pair {
  int fd[2] = {-1, -1};
  explicit Pair(int type) {
    if (::socketpair(AF_UNIX, type | SOCK_CLOEXEC, 0, fd) != 0) fail("socketpair");
    int big = 1 << 20;
    (void)::setsockopt(fd[1], SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
    (void)::setsockopt(fd[0], SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
  }
  ~Pair() {
    for (int f : fd)
      if (f >= 0) ::close(f);
  }
  Pair(const Pair&) = delete;
  Pair& operator=(const Pair&) = delete;
  // Writes all of `bytes` (a stream), then ends the writer's side: the
  // reader sees the input and then the peer closing.
  void write_and_close(const void* bytes, size_t n) {
    const char* p = static_cast<const char*>(bytes);
    while (n > 0) {
      ssize_t w = ::send(fd[1], p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w <= 0) fail("socketpair send (input larger than the socket buffer?)");
      p += w;
      n -= static_cast<size_t>(w);
    }
    close_writer();
  }
  void close_writer() {
    ::close(fd[1]);
    fd[1] = -1;
  }
};

// The lowest free descriptor number: equal before and after an input means
// the code under test closed every descriptor it was handed.
inline int lowest_free_fd() {
  int f = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (f < 0) fail("open /dev/null");
  ::close(f);
  return f;
}

}  // namespace fuzz_io
