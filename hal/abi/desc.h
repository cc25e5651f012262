// The hcomm NPU device ABI: DMA queue descriptors, completions and the
// shadow index block (docs/device-abi.md §7-§9).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace hcomm::hal::abi {

// ---- §9.1 opcodes -----------------------------------------------------------
enum class Opcode : uint8_t {
  NOP = 0,     // completes with OK; length must be 0
  COPY = 1,    // dst[0..length) = src[0..length)
  FILL = 2,    // dst[0..length) = the 8-byte pattern `value` repeated (little-endian)
  REDUCE = 3,  // dst[i] = dst[i] <redop> src[i] over length / sizeof(dtype) elements
  NOTIFY = 4,  // after every earlier descriptor of the queue completed, store the
               // 64-bit `value` at dst (8-byte aligned, length must be 8)
  // Fetch atomics (ABI 1.1, cap::ATOMIC): one atomic read-modify-write of the
  // 64-bit word at dst; the old value is written to the 8-byte word at src
  // (the result address: needs WRITE). length must be 8, dst and src 8-aligned.
  FETCH_ADD = 5,  // *dst += value (wraps)
  CMP_SWAP = 6,   // if (*dst == compare) *dst = value
};
inline constexpr uint8_t kOpcodeCount = 7;

// ---- §9.2 flags ---------------------------------------------------------------
namespace desc_flag {
inline constexpr uint8_t FENCE = 1u << 0;      // start only after every earlier descriptor completed
inline constexpr uint8_t INTERRUPT = 1u << 1;  // signal the queue's MSI-X vector on completion
inline constexpr uint8_t kKnown = FENCE | INTERRUPT;
}  // namespace desc_flag

// ---- §9.3 element types and reduction operators -------------------------------
enum class DType : uint8_t {
  INT8 = 0, INT16 = 1, INT32 = 2, INT64 = 3,
  UINT8 = 4, UINT16 = 5, UINT32 = 6, UINT64 = 7,
  FP16 = 8, BF16 = 9, FP32 = 10, FP64 = 11,
};
inline constexpr uint8_t kDTypeCount = 12;

inline constexpr uint32_t dtype_size(DType t) {
  switch (t) {
    case DType::INT8: case DType::UINT8: return 1;
    case DType::INT16: case DType::UINT16: case DType::FP16: case DType::BF16: return 2;
    case DType::INT32: case DType::UINT32: case DType::FP32: return 4;
    case DType::INT64: case DType::UINT64: case DType::FP64: return 8;
  }
  return 0;
}

enum class RedOp : uint8_t { SUM = 0, PROD = 1, MAX = 2, MIN = 3 };
inline constexpr uint8_t kRedOpCount = 4;

// ---- §9.4 submission queue entry: 64 bytes, one cache line --------------------
// Written by the driver in place in the SQ ring; the device copies the whole
// entry once, then validates and executes only its copy.
struct SqEntry {
  uint8_t opcode;      // Opcode
  uint8_t flags;       // desc_flag bits; unknown bits -> BAD_FIELD
  uint8_t dtype;       // DType (REDUCE only, else 0)
  uint8_t redop;       // RedOp (REDUCE only, else 0)
  uint32_t rsvd0;      // must be 0
  uint64_t user_data;  // opaque, echoed in the completion
  uint64_t src;        // IOVA (COPY, REDUCE; the result address of FETCH_ADD/CMP_SWAP)
  uint64_t dst;        // IOVA (COPY, FILL, REDUCE, NOTIFY)
  uint64_t length;     // bytes
  uint64_t value;      // FILL pattern / NOTIFY value / FETCH_ADD addend / CMP_SWAP new value
  uint64_t compare;    // CMP_SWAP expected value; must be 0 for every other opcode
  uint64_t rsvd1;      // must be 0
};
static_assert(sizeof(SqEntry) == 64);
static_assert(offsetof(SqEntry, user_data) == 8);
static_assert(offsetof(SqEntry, src) == 16);
static_assert(offsetof(SqEntry, dst) == 24);
static_assert(offsetof(SqEntry, length) == 32);
static_assert(offsetof(SqEntry, value) == 40);
static_assert(offsetof(SqEntry, compare) == 48);
static_assert(offsetof(SqEntry, rsvd1) == 56);

// ---- §9.5 completion status codes ---------------------------------------------
enum class CqStatus : uint16_t {
  OK = 0,
  BAD_OPCODE = 1,    // opcode unknown
  BAD_LENGTH = 2,    // zero length where data moves, or NOP/NOTIFY with the wrong length
  BAD_ALIGN = 3,     // src/dst/length not a multiple of the dtype size (REDUCE) or 8 (NOTIFY)
  BAD_DTYPE = 4,     // dtype unknown, or not in CAPS (FP16/BF16)
  BAD_REDOP = 5,     // redop unknown
  BAD_FIELD = 6,     // reserved field or unknown flag bit set
  SRC_FAULT = 7,     // [src, src+length) not inside one valid ATT entry
  DST_FAULT = 8,     // [dst, dst+length) not inside one valid ATT entry
  SRC_PERM = 9,      // src entry lacks READ
  DST_PERM = 10,     // dst entry lacks WRITE (REDUCE also needs READ on dst)
  HOST_FAULT = 11,   // ATT target not backed by host DMA memory any more
  PEER_FAULT = 12,   // peer device absent or its HBM range invalid
  INJECTED = 13,     // fault injection (simulator)
  ABORTED = 14,      // queue disabled or device reset while the descriptor was pending
};
inline constexpr uint16_t kCqStatusCount = 15;
const char* cq_status_name(CqStatus s);

// ---- §9.6 completion queue entry: 16 bytes --------------------------------------
struct CqEntry {
  uint64_t user_data;  // copied from the SqEntry
  uint32_t sq_index;   // free-running SQ index of the descriptor this completes
  uint16_t status;     // CqStatus
  uint16_t info;       // bit 0: phase. Written last (the device publishes the entry
                       // by storing `info` with release ordering).
};
static_assert(sizeof(CqEntry) == 16);
static_assert(offsetof(CqEntry, sq_index) == 8);
static_assert(offsetof(CqEntry, status) == 12);
static_assert(offsetof(CqEntry, info) == 14);
inline constexpr uint16_t kCqPhase = 1u << 0;

// ---- §8 the shadow index block ------------------------------------------------------
// Lives in host memory (mapped through the ATT with READ|WRITE) so that neither
// side needs an MMIO read on the fast path. Each index has its own cache line
// and exactly one writer.
struct alignas(64) ShadowIndex {
  std::atomic<uint32_t> value;
  uint8_t pad[60];
};
static_assert(sizeof(ShadowIndex) == 64);
static_assert(std::atomic<uint32_t>::is_always_lock_free);

struct QueueShadow {
  // Free-running producer index of the SQ. Writer: driver, store-release after
  // the entries it publishes. Reader: device, load-acquire.
  ShadowIndex sq_tail;
  // Free-running consumer index of the SQ: entries below it were copied by the
  // device and may be rewritten. Writer: device (release). Reader: driver.
  ShadowIndex sq_head;
  // Free-running consumer index of the CQ. Writer: driver (release) after it
  // read entries. Reader: device; it never overwrites an unconsumed entry.
  ShadowIndex cq_head;
  // Wake-up suppression. Writer: device. 1 = the engine of this queue is going
  // to sleep (or sleeps): the driver must ring the doorbell after publishing
  // sq_tail. 0 = the engine is polling sq_tail: no doorbell needed.
  // Protocol (both sides use a full fence between the two steps):
  //   device: need_wakeup = 1; fence; re-read sq_tail; sleep only if unchanged.
  //   driver: sq_tail = t (release); fence; if need_wakeup: ring doorbell.
  ShadowIndex need_wakeup;
};
static_assert(sizeof(QueueShadow) == 256);
static_assert(offsetof(QueueShadow, sq_head) == 64);
static_assert(offsetof(QueueShadow, cq_head) == 128);
static_assert(offsetof(QueueShadow, need_wakeup) == 192);

}  // namespace hcomm::hal::abi
