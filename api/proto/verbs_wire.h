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

// ---- keys: what peers read of each other's registrations (verbs, npu_roce) ----
// Each rank publishes its registrations in a table (one entry per slot) that
// peers RDMA READ when they import a key; the key's section names the
// transport's handle for the memory. Import accepts a key only when the
// entry, read at that moment, is live, of the key's generation, and says
// what the key says.
struct RegTableEntry {
  uint64_t gen;   // odd while registered
  uint64_t addr;  // verbs: the owner's virtual address; npu_roce: the IOVA
  uint64_t size;
  uint32_t rights;
  uint32_t key;   // the rkey (verbs) or the engine's memory key (npu_roce)
};
static_assert(sizeof(RegTableEntry) == 32, "peers read the registration table");

// What an imported key claims: its header (peer, slot, generation, address,
// size, rights) and its transport section's key (and, for npu_roce, the IOVA
// as addr).
struct RegClaim {
  int peer = -1;
  uint32_t slot = 0;
  uint64_t gen = 0, addr = 0, size = 0;
  uint32_t rights = 0, key = 0;
};

// The sections, as a peer packed them. verbs: the rkey (4 bytes, host order;
// none for device memory, which the NIC cannot reach). npu_roce: the memory
// key (4) and the IOVA (8). protocol_error when malformed.
Status parse_verbs_key_section(const uint8_t* sec, size_t len, bool device_memory, uint32_t* rkey);
Status parse_npu_roce_key_section(const uint8_t* sec, size_t len, uint32_t* key, uint64_t* iova);
// access_denied unless the owner's entry is live, of the claim's generation,
// and matches it (address, size, key; the claim's rights within the entry's).
Status check_reg_entry(const RegClaim& k, const RegTableEntry& e);

}  // namespace hcomm::api
