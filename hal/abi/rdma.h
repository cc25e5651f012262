// The NPU network engine's work requests, completions, memory keys and
// queue-pair attributes (docs/device-abi.md §15): what the driver writes
// into an RDMA queue pair's rings and what the engine writes back. Declared
// once, shared by the engine (sim/roce/) and the HAL. The frames these turn
// into are hal/abi/roce.h (§14).
#pragma once

#include <cstddef>
#include <cstdint>

namespace hcomm::hal::abi::rdma {

// ---- memory keys (§15.1) ------------------------------------------------------------
// A key is (table index << 8) | key byte. The driver picks a new key byte
// each time it reuses an index, so a stale key never matches a later
// registration (verbs lkeys/rkeys work the same way).
inline constexpr uint32_t key_index(uint32_t key) { return key >> 8; }
inline constexpr uint8_t key_byte(uint32_t key) { return static_cast<uint8_t>(key); }
inline constexpr uint32_t make_key(uint32_t index, uint8_t byte) { return index << 8 | byte; }

// Access rights of a memory-key entry.
namespace access {
inline constexpr uint8_t LOCAL_WRITE = 1u << 0;    // the engine may write it for this node's own requests (READ results, receives)
inline constexpr uint8_t REMOTE_WRITE = 1u << 1;   // RDMA WRITE, WRITE_WITH_IMM
inline constexpr uint8_t REMOTE_READ = 1u << 2;    // RDMA READ
inline constexpr uint8_t REMOTE_ATOMIC = 1u << 3;  // FETCH_ADD, CMP_SWAP
inline constexpr uint8_t REMOTE_REDUCE = 1u << 4;  // WRITE_REDUCE (reads and writes the target)
inline constexpr uint8_t ALL = 0x1f;
}  // namespace access

// One entry of the engine's memory-key table (32 bytes).
struct MrEntry {
  uint64_t iova;    // first byte, in the device's address space (the ATT's IOVAs, §6)
  uint64_t length;  // bytes; 0 = invalid
  uint32_t key;     // index << 8 | key byte; the index is the entry's own
  uint8_t access;   // access:: bits; unknown bits refused
  uint8_t valid;    // 1 = in use
  uint16_t rsvd0;
  uint64_t rsvd1;
};
static_assert(sizeof(MrEntry) == 32);

// ---- queue pairs (§15.2) ---------------------------------------------------------------
enum class QpState : uint8_t { RESET = 0, INIT = 1, RTR = 2, RTS = 3, ERR = 4 };

// Path MTU as verbs encodes it: 1 = 256 ... 5 = 4096 bytes.
inline constexpr uint32_t mtu_bytes(uint8_t code) { return code >= 1 && code <= 5 ? 128u << code : 0; }

// The connection a driver programs with a modify command (64 bytes).
struct QpAttr {
  uint8_t state;          // QpState to move to
  uint8_t path_mtu;       // 1..5 (RTR)
  uint8_t retry_cnt;      // 0..7: retransmissions after a local ACK timeout before RETRY_EXC (RTS)
  uint8_t rnr_retry;      // 0..7, 7 = without limit (RTS)
  uint8_t timeout;        // local ACK timeout 4.096 us * 2^timeout, 1..31; 0 = none (RTS)
  uint8_t min_rnr_timer;  // RNR NAK timer code 0..31 this responder asks for (RTR)
  uint8_t max_rd_atomic;  // READ/atomic requests outstanding at once, 1..16 (RTS)
  uint8_t rsvd0;
  uint32_t dest_qpn;      // 24 bits (RTR)
  uint32_t rq_psn;        // first PSN expected from the peer, 24 bits (RTR)
  uint32_t sq_psn;        // first PSN sent, 24 bits (RTS)
  uint32_t remote_ip;     // IPv4 (the peer's GID), host order (RTR)
  uint8_t remote_mac[6];  // (RTR)
  uint16_t udp_sport;     // UDP source port; 0 = 0xC000 | (qpn & 0x3fff)
  uint8_t rsvd1[32];
};
static_assert(sizeof(QpAttr) == 64);

// ---- send work requests (§15.3, 64 bytes) -----------------------------------------------
enum class WrOp : uint8_t {
  WRITE = 0,
  WRITE_IMM = 1,
  SEND = 2,
  SEND_IMM = 3,
  READ = 4,
  CMP_SWAP = 5,
  FETCH_ADD = 6,
  WRITE_REDUCE = 7,  // vendor: the target reduces the payload into its memory (dtype, redop)
};
inline constexpr uint8_t kWrOpCount = 8;

namespace wr_flag {
inline constexpr uint8_t SIGNALED = 1u << 0;   // a completion on success (errors always complete)
inline constexpr uint8_t FENCE = 1u << 1;      // wait for earlier READs and atomics to finish first
inline constexpr uint8_t SOLICITED = 1u << 2;  // SE bit on the last packet
inline constexpr uint8_t KNOWN = SIGNALED | FENCE | SOLICITED;
}  // namespace wr_flag

struct SendWqe {
  uint8_t opcode;     // WrOp
  uint8_t flags;      // wr_flag::
  uint8_t dtype;      // WRITE_REDUCE: element type (desc.h DType)
  uint8_t redop;      // WRITE_REDUCE: operator (desc.h RedOp)
  uint32_t imm;       // WRITE_IMM, SEND_IMM
  uint64_t wr_id;     // echoed in the completion
  uint64_t laddr;     // local IOVA: the data sent, or where READ/atomic results land
  uint32_t lkey;      // memory key of laddr (LOCAL_WRITE needed for READ and atomics)
  uint32_t length;    // bytes; atomics: 8
  uint64_t raddr;     // remote IOVA (not SEND)
  uint32_t rkey;      // remote memory key (not SEND)
  uint32_t rsvd0;
  uint64_t compare;   // CMP_SWAP
  uint64_t swap_add;  // CMP_SWAP: the new value; FETCH_ADD: the addend
};
static_assert(sizeof(SendWqe) == 64);
static_assert(offsetof(SendWqe, wr_id) == 8 && offsetof(SendWqe, laddr) == 16 && offsetof(SendWqe, lkey) == 24 &&
              offsetof(SendWqe, raddr) == 32 && offsetof(SendWqe, rkey) == 40 && offsetof(SendWqe, compare) == 48);

// A send work request with its usual fields; the rest (immediate, dtype,
// compare, swap/add) the caller sets on the result.
inline SendWqe make_wqe(WrOp op, uint64_t laddr, uint32_t lkey, uint32_t length, uint64_t raddr, uint32_t rkey,
                        uint64_t wr_id, uint8_t flags = wr_flag::SIGNALED) {
  SendWqe w{};
  w.opcode = static_cast<uint8_t>(op);
  w.flags = flags;
  w.wr_id = wr_id;
  w.laddr = laddr;
  w.lkey = lkey;
  w.length = length;
  w.raddr = raddr;
  w.rkey = rkey;
  return w;
}

// ---- receive work requests (§15.4, 32 bytes) ---------------------------------------------
struct RecvWqe {
  uint64_t wr_id;
  uint64_t laddr;   // where an incoming SEND's payload lands (LOCAL_WRITE)
  uint32_t lkey;
  uint32_t length;  // capacity
  uint64_t rsvd;
};
static_assert(sizeof(RecvWqe) == 32);

// ---- completions (§15.5, 32 bytes) ------------------------------------------------------
enum class WcStatus : uint8_t {
  SUCCESS = 0,
  LOC_LEN_ERR = 1,        // a SEND longer than the receive buffer (both sides)
  LOC_PROT_ERR = 2,       // the local key does not cover laddr/length with the right
  WR_FLUSH_ERR = 3,       // the QP went to ERR before this request ran
  REM_INV_REQ_ERR = 4,    // the responder refused the request (NAK invalid request)
  REM_ACCESS_ERR = 5,     // bad remote key, range or right (NAK remote access)
  REM_OP_ERR = 6,         // the responder could not complete it (NAK remote operational)
  RETRY_EXC_ERR = 7,      // no ACK after retry_cnt retransmissions
  RNR_RETRY_EXC_ERR = 8,  // receiver not ready after rnr_retry tries
  BAD_WQE = 9,            // unknown opcode/flags, nonzero reserved fields, bad atomic length or alignment
};
const char* wc_status_name(WcStatus s);

enum class WcOp : uint8_t {
  SEND = 0, WRITE = 1, READ = 2, CMP_SWAP = 3, FETCH_ADD = 4, WRITE_REDUCE = 5,
  RECV = 0x80, RECV_WRITE_IMM = 0x81,  // receive side
};

namespace wc_flag {
inline constexpr uint8_t IMM = 1u << 0;  // imm is valid
}  // namespace wc_flag

struct Cqe {
  uint64_t wr_id;
  uint32_t byte_len;  // receives: bytes received; READ: bytes read
  uint32_t imm;       // wc_flag::IMM
  uint32_t qpn;
  uint8_t opcode;     // WcOp
  uint8_t status;     // WcStatus
  uint8_t flags;      // wc_flag::
  uint8_t phase;      // ring phase bit (as §8.7): written last
  uint32_t vendor_err;  // the AETH syndrome of a NAK, else 0
  uint32_t wqe_index;   // the free-running SQ or RQ index of the work request
};
static_assert(sizeof(Cqe) == 32 && offsetof(Cqe, phase) == 23);

// ---- a queue pair's rings (§15.3) ---------------------------------------------------------
// QP_CREATE's argument: three rings and a shadow block, each inside one ATT
// entry (SQ and RQ readable, CQ and shadow writable), 64-byte aligned.
struct QpCreate {
  uint64_t sq_iova;  // 1 << sq_log2 SendWqe
  uint64_t rq_iova;  // 1 << rq_log2 RecvWqe
  uint64_t cq_iova;  // 1 << cq_log2 Cqe (send and receive completions)
  uint64_t shadow_iova;  // QpShadow
  uint32_t sq_log2, rq_log2, cq_log2;  // 1..12 each
  uint32_t rsvd[5];
};
static_assert(sizeof(QpCreate) == 64);

// The indices driver and engine exchange through memory (no MMIO on the
// data path): the driver stores sq_tail / rq_tail (release) after writing
// work requests and cq_head after consuming completions; the engine stores
// sq_head / rq_head as it takes work requests. Free-running u32 indices.
struct QpShadow {
  uint32_t sq_tail;
  uint32_t rq_tail;
  uint32_t cq_head;
  uint32_t rsvd0;
  uint32_t sq_head;  // engine-written
  uint32_t rq_head;  // engine-written
  uint32_t rsvd1[10];
};
static_assert(sizeof(QpShadow) == 64);

// QP numbers: a device's QP slot s has number kQpnBase + s (0 and 1 are
// special in the IBA).
inline constexpr uint32_t kQpnBase = 0x100;
inline constexpr uint32_t kMaxRingLog2 = 12;

}  // namespace hcomm::hal::abi::rdma
