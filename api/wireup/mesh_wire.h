// What peers say to each other on the mesh (mesh.h), apart so that every
// parser is fuzzed exactly as connect_mesh and the context run it
// (tests/fuzz/fuzz_mesh.cpp): the hellos that open a link, and the control
// messages the context and the shm transport exchange over it afterwards.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "api/wireup/mesh.h"
#include "common/status.h"
#include "common/time.h"

namespace hcomm::api::meshwire {

// --- same host (AF_UNIX SOCK_SEQPACKET): the connecting rank's hello, in
// host byte order: magic 'HCMH' u32 | version u32 | rank u32 | pid u32 | job id.
std::string hello(int rank, pid_t pid, const std::string& job);
// Checks a hello against what the allgather promised for `expect_rank`
// (-1: any rank in (self, size)); pids[r] is rank r's pid (pids.size() ==
// size); *rank_out gets the claimed rank. Anything else is protocol_error.
Status check_hello(const std::vector<uint8_t>& m, const std::string& job, int self, int size, int expect_rank,
                   const std::vector<pid_t>& pids, int* rank_out);

// --- other hosts (TCP): the hello of mesh.h (kMeshTcpMagic).
enum : uint16_t { kTcpHello = 1, kTcpRefuse = 2 };
constexpr size_t kMaxRefuse = 1024;
struct TcpHello {
  uint32_t magic = 0;
  uint16_t version = 0, type = 0;
  uint64_t cookie = 0;
  uint32_t rank = 0, size = 0;
  std::string text;
};
std::string tcp_hello(uint16_t type, uint64_t cookie, int rank, int size, const std::string& text = {});
// Reads one hello; the magic and the text length are checked before the
// text is read, so a stranger's garbage never makes us wait for or allocate
// what it announces.
Status read_tcp_hello(int fd, const Deadline& dl, int peer_rank, TcpHello* h);
// What a hello must say to be the rank we expect: `expect` >= 0 (we
// connected to it), or any higher rank on another host (-1: we accepted it;
// links[r] tells whether r is on this host and already connected;
// links.size() == size).
Status check_tcp_hello(const TcpHello& h, uint64_t cookie, int me, int size, int expect,
                       const std::vector<MeshLink>& links);

// --- after wire-up: control messages between ranks of one host (with fds).
enum class CtrlType : uint32_t { segments = 1, advert = 2 };
struct CtrlMsg {
  uint32_t type;  // CtrlType
  int32_t rank;
  int32_t pid;
  uint32_t slot;  // advert
  uint32_t gen;   // advert
  uint32_t nfds;
};
static_assert(sizeof(CtrlMsg) == 24);

// A received control message: exactly one CtrlMsg of type `want` from
// `from_rank` (the sender puts its own rank in), carrying exactly `want_fds`
// descriptors; for an advert, a slot below max_slots. Else protocol_error
// naming what was wrong.
Status parse_ctrl(const std::vector<uint8_t>& buf, size_t nfds, CtrlType want, int from_rank, size_t want_fds,
                  uint32_t max_slots, CtrlMsg* out);

}  // namespace hcomm::api::meshwire
