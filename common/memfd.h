// Shared-memory files handed between processes (memfds): sealed by their
// creator at their final size, checked by whoever maps one it received.
//
// A process that maps a peer's memfd trusts it not to shrink: a peer that
// truncated its file under our mapping would turn our next access into
// SIGBUS. So every memfd hcomm shares is sealed against shrinking and
// growing (F_SEAL_SHRINK | F_SEAL_GROW) once sized, and a receiver maps one
// only if it holds the bytes it expects and carries that seal.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstddef>

#include "common/status.h"

namespace hcomm {

// memfd_create flags for a file that will be sealed.
inline constexpr unsigned kSealableMemfd = MFD_ALLOW_SEALING;

// Seals a sized memfd: its size is final.
inline Status seal_size(int fd, const char* what) {
  if (::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0)
    return Status::from_errno(errno, std::string(what) + ": sealing its size");
  return Status::ok();
}

// A memfd from a peer: at least `len` bytes, and it can no longer shrink.
inline Status check_peer_memfd(int fd, size_t len, const char* what) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return Status::from_errno(errno, std::string(what) + ": fstat");
  if (st.st_size < 0 || static_cast<size_t>(st.st_size) < len)
    return Status::error(Code::protocol_error, "%s: the peer's file holds %lld bytes, %zu expected", what,
                         static_cast<long long>(st.st_size), len);
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0)
    return Status::error(Code::protocol_error, "%s: the peer's file is not sealed against shrinking", what);
  return Status::ok();
}

}  // namespace hcomm
