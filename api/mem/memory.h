// Registered memory and packed remote keys.
//
// A registration (hcomm_mem) belongs to the context; every open transport is
// told about it (Transport::mem_add: map it into the NPU, register it with a
// NIC, hand its memfd to same-host peers) and contributes a section to its
// packed key. The packed key:
//
//   RkeyHeader (48 bytes, host byte order: keys travel between processes of
//   one job on machines of one architecture)
//   then nsections x { u8 transport id, u8 length, length bytes }
//
// An importer validates the header (form, job, owner; on the same host the
// owner's live registration table, api/transport/shm), then binds the key to
// the first RMA lane of that peer whose transport has a section in it.
#pragma once

#include <atomic>
#include <cstdint>

#include "api/include/hcomm/hcomm.h"
#include "api/mem/access_mark.h"
#include "api/transport/transport.h"
#include "driver/dma_memory.h"
#include "hal/npu/device.h"

namespace hcomm::api {

class Context;

enum class MemKind : uint32_t { host_alloc = 1, host_user = 2, device = 3 };

inline constexpr uint32_t kRkeyMagic = 0x4852434bu;  // "HRCK"
inline constexpr uint16_t kRkeyVersion = 2;          // 1: fixed 56-byte key (API 0.1)
struct RkeyHeader {
  uint32_t magic;
  uint16_t version;
  uint8_t kind;       // MemKind
  uint8_t nsections;  // sections that follow
  int32_t owner;
  uint32_t slot;      // owner's registration slot
  uint32_t gen;       // its generation (odd while registered)
  uint32_t rights;    // HCOMM_ACCESS_*
  uint64_t size;
  uint64_t addr;      // owner's virtual address (host memory) / HBM offset (device)
  uint64_t job_hash;
};
static_assert(sizeof(RkeyHeader) == 48);
inline constexpr size_t kRkeySectionHdr = 2;
static_assert(sizeof(RkeyHeader) + 3 * (kRkeySectionHdr + Transport::kMaxSection) <= HCOMM_RKEY_MAX,
              "three full sections must fit a packed key");

}  // namespace hcomm::api

struct hcomm_mem {
  hcomm::api::Context* ctx = nullptr;
  uint32_t slot = 0;
  uint32_t gen = 0;
  hcomm::api::MemKind kind = hcomm::api::MemKind::host_alloc;
  uint8_t* ptr = nullptr;  // CPU address (device memory: through the HBM aperture, may be null)
  size_t size = 0;
  unsigned access = 0;
  hcomm::driver::DmaBuffer buf;   // host_alloc: the memfd-backed pages
  uint64_t hbm_offset = 0;        // device
  hcomm::hal::npu::Mapping npu;   // npu transport: our device's mapping of this memory
  void* verbs_mr = nullptr;       // verbs transport: its ibv_mr
  uint32_t roce_key = 0;          // npu_roce transport: the engine's memory key over `npu` (0: none)
};

// An imported remote key: the peer's memory as reached through one lane.
struct hcomm_rkey {
  hcomm::api::Context* ctx = nullptr;
  hcomm::api::RkeyHeader h{};
  int peer = -1;
  hcomm::api::Transport* lane = nullptr;
  uint8_t* mapped = nullptr;  // shm: our mapping of the peer's memfd (own memory: borrowed pointer)
  size_t mapped_len = 0;      // bytes to munmap (0: borrowed)
  hcomm::hal::npu::Mapping npu;  // npu: our device's mapping of the peer's memory
  uint32_t vrkey = 0;            // verbs: the NIC's remote key of the peer's registration
  uint32_t roce_key = 0;         // npu_roce: the peer engine's memory key and the memory's IOVA there
  uint64_t roce_iova = 0;
  // Accumulate and fetch atomics: one atomicity agent per memory. When peers
  // on other hosts reach this memory through the NIC, every rank's atomics
  // on it go through the NIC too (verbs), whatever lane moves its puts.
  hcomm::api::Transport* alane = nullptr;
  // Fixed at import, for the one-sided fast path (docs/api.md, "Threads"):
  // every lane of this key completes inside the call (shm, cma), and the
  // owner's generation word in the node registry when every lane of the key
  // validates against it (null: ask the lanes).
  bool sync = false;
  const std::atomic<uint32_t>* live_gen = nullptr;
  // A CPU copy on this host (data lane shm or cma): our process's mark table
  // and the value naming the owner (api/mem/access_mark.h), held from before
  // the look at the owner's generation to the last byte.
  hcomm::api::MarkTable* marks = nullptr;
  uint32_t mark_value = 0;
  // Both lanes are shm: the mapped memory, which the fast path loads and
  // stores itself (cpu_rma in api/transport/shm/shm.h); null otherwise.
  uint8_t* direct = nullptr;
};
