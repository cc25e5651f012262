// The verbs transport's wire-up message (api/transport/verbs): what each rank
// contributes to the bootstrap allgather, and the parser that checks what the
// others contributed before any of it reaches a queue pair. Kept apart from
// verbs.cpp so that it builds without rdma-core (the fuzz target
// tests/fuzz/fuzz_verbs_wire.cpp runs on machines with no NIC and no
// libibverbs headers).
//
// Blob of a rank with verbs:    VerbsWireHdr (present = 1), then nqp x u32:
//                               the QPN it created for each rank, in rank order.
// Blob of a rank without verbs: VerbsWireHdr (present = 0), then its reason as
//                               text (it sends at most kVerbsWhyMax bytes).
// Host byte order, like the packed keys: one job runs on one architecture.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace hcomm::api {

inline constexpr uint32_t kVerbsWireMagic = 0x48434956u;  // "HCIV"
inline constexpr uint16_t kVerbsWireVersion = 1;
inline constexpr size_t kVerbsWhyMax = 1024;
// ibv_mtu as rdma-core numbers it: IBV_MTU_256 = 1 .. IBV_MTU_4096 = 5.
inline constexpr uint8_t kVerbsMtuMin = 1, kVerbsMtuMax = 5;

struct VerbsWireHdr {
  uint32_t magic;
  uint16_t version;
  uint16_t present;  // 0: this rank has no verbs; the rest is its reason
  uint8_t gid[16];
  uint16_t lid;
  uint8_t mtu;  // ibv_mtu
  uint8_t pad;
  uint32_t psn;
  uint64_t table_addr, locks_addr, mailbox_addr;
  uint32_t table_rkey, locks_rkey, mailbox_rkey;
  uint32_t nqp;  // then nqp x u32: the QPN this rank created for each rank
};
static_assert(sizeof(VerbsWireHdr) == 72, "the wire-up header is a wire format");

// One rank's contribution as this rank needs it.
struct VerbsPeerWire {
  bool present = false;  // that rank opened verbs
  VerbsWireHdr h{};      // present: its header (copied once out of the blob)
  uint32_t qpn = 0;      // present: the QPN it created for this rank
};

// The blob of a rank with verbs (h.magic, version, present and nqp are set
// here from qpns) and of one without.
std::string verbs_wire_blob(VerbsWireHdr h, const std::vector<uint32_t>& qpns);
std::string verbs_wire_absent(const std::string& why);

// Checks every rank's blob (nranks of them, as the allgather returned them;
// my_rank: this rank) and fills out[r]. protocol_error names the first rank
// whose blob is malformed: wrong size, magic or version, a QPN count that is
// not nranks, an MTU outside 256..4096.
Status parse_verbs_wire(const std::vector<std::string>& blobs, int nranks, int my_rank,
                        std::vector<VerbsPeerWire>* out);

}  // namespace hcomm::api
