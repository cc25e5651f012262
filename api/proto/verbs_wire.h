// The verbs and npu_roce transports' wire-up messages (api/transport/verbs,
// api/transport/npu_roce): what each rank
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

// ---- the npu_roce transport's wire-up message (api/transport/npu_roce) ----
// Same layout rule: NpuRoceWireHdr (present = 1), then nqp x u32 QPNs (0 for
// a rank it has no queue pair to: same node); absent: the header and a reason.
inline constexpr uint32_t kNpuRoceWireMagic = 0x48434952u;  // "HCIR"
inline constexpr uint16_t kNpuRoceWireVersion = 1;

struct NpuRoceWireHdr {
  uint32_t magic;
  uint16_t version;
  uint16_t present;  // 0: this rank has no NPU network engine; the rest is its reason
  uint32_t ip;       // the port's IPv4 address (its GID), host order
  uint8_t mac[6];
  uint8_t mtu;  // path MTU code, 1 = 256 .. 5 = 4096
  uint8_t pad0;
  uint32_t psn;  // the first PSN its queue pairs send
  uint32_t table_key, mailbox_key;
  uint32_t nqp;  // then nqp x u32
  uint32_t pad1;
  uint64_t table_iova, mailbox_iova;
};
static_assert(sizeof(NpuRoceWireHdr) == 56, "the wire-up header is a wire format");

struct NpuRoceWire {
  bool present = false;
  NpuRoceWireHdr h{};
  uint32_t qpn = 0;  // the QPN that rank created for this rank (0: none)
};

std::string npu_roce_wire_blob(NpuRoceWireHdr h, const std::vector<uint32_t>& qpns);
std::string npu_roce_wire_absent(const std::string& why);
// As parse_verbs_wire: protocol_error names the first malformed blob.
Status parse_npu_roce_wire(const std::vector<std::string>& blobs, int nranks, int my_rank,
                           std::vector<NpuRoceWire>* out);

}  // namespace hcomm::api
