// Mesh: one connected AF_UNIX SOCK_SEQPACKET socket between every pair of
// ranks on this host, plus the message helpers the API layer uses on them
// (one message = one packet; file descriptors ride along with SCM_RIGHTS).
//
// SINGLE HOST: the sockets are UNIX sockets under /tmp/hcomm-<uid>/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "api/wireup/bootstrap.h"
#include "common/fd.h"
#include "common/status.h"
#include "common/time.h"

namespace hcomm::api {

// Largest message send_msg/recv_msg carry, and most fds in one message.
constexpr size_t kMaxMsg = 64 * 1024;
constexpr size_t kMaxMsgFds = 16;

// Collective (every rank of `boot` calls it). On success (*peers)[r] is a
// connected, non-blocking, close-on-exec socket to rank r and (*peers)[rank]
// is invalid. How: each rank listens on a private socket path
// (/tmp/hcomm-<uid>/mesh-<job>/r<rank>.sock), the paths and pids are
// exchanged with boot.allgather, the higher rank of each pair connects to the
// lower, and a hello carrying (rank, pid, job id) is checked both ways, so a
// stale or foreign socket is refused (protocol_error). The listening sockets
// are unlinked before returning, success or not.
Status connect_mesh(Bootstrap& boot, const Deadline& deadline, std::vector<UniqueFd>* peers);

// Sends one message of 1..kMaxMsg bytes with up to kMaxMsgFds descriptors
// (duplicated into the receiver; the caller keeps its own). Never blocks:
// a full socket is no_resource (back-pressure: retry or use the Deadline
// overload). A zero-length message is invalid_argument: on SOCK_SEQPACKET it
// would be indistinguishable from the peer closing. A closed peer is
// peer_failure, naming peer_rank when >= 0.
Status send_msg(int fd, const void* data, size_t len, std::span<const int> fds = {}, int peer_rank = -1);
// The same, waiting for room until the deadline (then timeout).
Status send_msg(int fd, const void* data, size_t len, std::span<const int> fds, const Deadline& deadline,
                int peer_rank = -1);

// Receives one message into *out (resized to its length) and its descriptors
// into *fds (owned by the caller, close-on-exec; may be null only if the
// sender passes none). A message longer than kMaxMsg or carrying more than
// kMaxMsgFds descriptors is protocol_error (whatever descriptors did arrive
// are closed). The peer closing is peer_failure naming peer_rank when >= 0;
// no message before the deadline is timeout.
Status recv_msg(int fd, std::vector<uint8_t>* out, std::vector<UniqueFd>* fds, const Deadline& deadline,
                int peer_rank = -1);

}  // namespace hcomm::api
