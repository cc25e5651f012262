// Mesh: one connected socket between every pair of ranks, plus the message
// helpers the API layer uses on them.
//  - Ranks on the same host (same host_id(), see host.h): AF_UNIX
//    SOCK_SEQPACKET in the abstract namespace (no file: nothing is left
//    behind by a rank that is killed); one message = one packet;
//    file descriptors ride along with SCM_RIGHTS.
//  - Ranks on different hosts: TCP. A message is a 4-byte big-endian length
//    and that many bytes; descriptors cannot cross hosts.
// send_msg / recv_msg tell the two apart by the socket's type (SOCK_STREAM
// = framed), so an AF_UNIX SOCK_STREAM pair stands in for TCP in tests.
//
// Partial messages on a stream (no per-socket state is kept): send_msg
// returns no_resource when the send buffer lacks room for the whole frame
// (SIOCOUTQ against SO_SNDBUF) or the kernel took none of it; once the
// kernel took the first byte, it writes the rest, waiting at most 2 s for
// room (rare: only when the room estimate was wrong).
// Likewise recv_msg waits only for a message's first byte until the caller's
// deadline (a zero deadline polls), and once one byte has arrived reads the
// rest within max(deadline, 2 s). A peer that stalls mid-message for that
// long has desynchronised the stream: the socket is shut down both ways and
// the call fails with peer_failure, as do all later ones.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "api/wireup/bootstrap.h"
#include "common/fd.h"
#include "common/status.h"
#include "common/time.h"

namespace hcomm::api {

// Largest message send_msg/recv_msg carry, and most fds in one message.
constexpr size_t kMaxMsg = 64 * 1024;
constexpr size_t kMaxMsgFds = 16;

// One peer's link. peers[rank] of this rank: invalid fd, same_host = true,
// host = our own host id.
struct MeshLink {
  UniqueFd fd;            // connected, non-blocking, close-on-exec
  bool same_host = true;  // AF_UNIX SOCK_SEQPACKET (fds may ride along), else TCP
  std::string host;       // the peer's host id
};

// The TCP link's hello, both ways, before any message (network byte order):
//   magic u32 'HCMT' | version u16 | type u16 (1 HELLO, 2 REFUSE)
//   | job cookie u64 | rank u32 | world size u32 | text length u32
// followed by `text length` bytes (REFUSE: why, at most 1024; HELLO: none).
// The connecting (higher) rank speaks first; the listener answers HELLO, or
// REFUSE naming what differed (magic = not hcomm, version = another build,
// cookie = another job, size, rank) and keeps waiting for the real peer.
constexpr uint32_t kMeshTcpMagic = 0x48434d54;  // "HCMT"
constexpr uint16_t kMeshTcpVersion = 1;
constexpr size_t kMeshTcpHello = 28;
// The job cookie: FNV-1a (64 bit) of the job id.
uint64_t mesh_job_cookie(const std::string& job_id);

// Collective (every rank of `boot` calls it). On success (*peers)[r] is the
// link to rank r (see MeshLink). How:
//  1. allgather (pid, host id, UNIX socket name): every rank listens on an
//     abstract name the kernel picks (autobind); same host id = same host.
//     A local connection that is not a rank of this job (another uid, a bad
//     hello or SO_PEERCRED, silence past 2 s) is dropped and noted.
//  2. only if some hosts differ: every rank with a peer on another host
//     listens on TCP, on an ephemeral port of mesh_listen_address() (env
//     HCOMM_SOCKET_ADDR / HCOMM_SOCKET_IFNAME / the route to MASTER_ADDR /
//     the first up non-loopback IPv4 / 127.0.0.1, see host.h), and the
//     endpoints are allgathered.
//  3. the higher rank of each pair connects to the lower; the hellos are
//     checked both ways. UNIX: (rank, pid, job id) plus SO_PEERCRED, so a
//     stale or foreign socket is protocol_error. TCP: the hello above; a
//     stranger is refused and noted, and the mesh still forms.
// TCP links get TCP_NODELAY and keepalive bounded by env HCOMM_KEEPALIVE_MS
// (default 5000, 1000..3600000; formula in mesh.cpp): a peer host that goes
// silent fails the link within about that long. The listening sockets are
// closed before returning, success or not.
Status connect_mesh(Bootstrap& boot, const Deadline& deadline, std::vector<MeshLink>* peers);

// Orderly close: shuts our sending side (the peer's recv_msg sees the end,
// peer_failure, after everything we sent), then discards whatever the peer
// still sends until its end arrives too, within the deadline (else timeout).
// Call it on both ends after the last message, before destroying what the
// messages referred to: on TCP, closing a socket with unread data resets the
// connection and can destroy data still in flight to the peer. The fd stays
// open (the caller closes it). An invalid fd is ok.
Status mesh_goodbye(MeshLink& link, const Deadline& deadline);

// Sends one message of 1..kMaxMsg bytes with up to kMaxMsgFds descriptors
// (duplicated into the receiver; the caller keeps its own). Never blocks
// (but see "partial messages" above): a full socket is no_resource
// (back-pressure: retry or use the Deadline overload). A zero-length message
// is invalid_argument: on SOCK_SEQPACKET it would be indistinguishable from
// the peer closing. Descriptors on a stream socket are invalid_argument
// ("descriptors cannot cross hosts"). A closed peer is peer_failure, naming
// peer_rank when >= 0.
Status send_msg(int fd, const void* data, size_t len, std::span<const int> fds = {}, int peer_rank = -1);
// The same, waiting for room until the deadline (then timeout).
Status send_msg(int fd, const void* data, size_t len, std::span<const int> fds, const Deadline& deadline,
                int peer_rank = -1);

// Receives one message into *out (resized to its length) and its descriptors
// into *fds (owned by the caller, close-on-exec; may be null only if the
// sender passes none). A message longer than kMaxMsg or carrying more than
// kMaxMsgFds descriptors is protocol_error (whatever descriptors did arrive
// are closed; on SOCK_SEQPACKET the socket stays usable, a stream is shut
// down). A zero length on a stream is protocol_error too. The peer closing
// is peer_failure naming peer_rank when >= 0 (mid-message: saying so); no
// message before the deadline is timeout.
Status recv_msg(int fd, std::vector<uint8_t>* out, std::vector<UniqueFd>* fds, const Deadline& deadline,
                int peer_rank = -1);

}  // namespace hcomm::api
