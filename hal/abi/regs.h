// The hcomm NPU device ABI: PCI identity, BAR layout and registers.
//
// This header is the contract between the driver (driver/, hal/npu/) and any
// device that implements the ABI (hcomm-sim in sim/, or silicon). Both sides
// compile exactly this file; nothing here is declared twice. The prose spec
// is docs/device-abi.md; section numbers below refer to it.
//
// All registers are little-endian. Access widths: 32-bit registers take
// 32-bit accesses; 64-bit registers take one 64-bit access. The RW 64-bit
// configuration registers (ATT_*, Q_*_BASE) may also be written as two 32-bit
// halves in any order: they take effect only on ATT_CMD / Q_CTRL.ENABLE. A
// 64-bit counter read as two halves may tear; read it with one access.
#pragma once

#include <cstdint>

namespace hcomm::hal::abi {

// ---- §2 PCI identity ------------------------------------------------------
// Placeholder identity for the hcomm NPU ABI (the simulator uses it; silicon
// carries its vendor's ids and the same class code).
inline constexpr uint16_t kPciVendorId = 0x1dea;
inline constexpr uint16_t kPciDeviceId = 0x0001;
inline constexpr uint32_t kPciClassCode = 0x120000;  // processing accelerator

// ABI version: major in [31:16], minor in [15:0]. A driver accepts any device
// with the same major and a minor >= the one it was built for.
inline constexpr uint16_t kAbiMajor = 1;
inline constexpr uint16_t kAbiMinor = 3;  // 1.1: FETCH_ADD / CMP_SWAP (cap::ATOMIC); 1.2: cap::ATT_SPAN; 1.3: cap::ROCE
inline constexpr uint32_t abi_version(uint16_t major, uint16_t minor) {
  return (uint32_t{major} << 16) | minor;
}
inline constexpr uint32_t kAbiVersion = abi_version(kAbiMajor, kAbiMinor);

// ---- §3 BARs ----------------------------------------------------------------
// BAR0: registers (control page) + doorbell page.  Size kBar0Size.
// BAR2: HBM aperture, the device memory, mmapable, size = HBM_SIZE.
// BAR4: MSI-X table and PBA (PCI implementations; vfio-user exposes the same
//       vectors through VFIO_PCI_MSIX_IRQ_INDEX).
inline constexpr uint32_t kBarRegs = 0;
inline constexpr uint32_t kBarHbm = 2;
inline constexpr uint32_t kBarMsix = 4;
inline constexpr uint64_t kBar0Size = 0x2000;
inline constexpr uint64_t kControlPageSize = 0x1000;
inline constexpr uint64_t kDoorbellPageOffset = 0x1000;

// ---- §4 control page registers (BAR0 offsets) -------------------------------
namespace reg {
// Identity (RO)
inline constexpr uint32_t ID = 0x000;             // [15:0] vendor id, [31:16] device id
inline constexpr uint32_t ABI_VERSION = 0x004;    // see abi_version()
inline constexpr uint32_t CAPS = 0x008;           // u64, cap:: bits
inline constexpr uint32_t HBM_SIZE = 0x010;       // u64, bytes
inline constexpr uint32_t NUM_QUEUES = 0x018;     // u32, DMA queues
inline constexpr uint32_t MAX_QUEUE_LOG2 = 0x01c; // u32, largest ring = 1 << this
inline constexpr uint32_t NUM_ATT = 0x020;        // u32, translation table entries
inline constexpr uint32_t FABRIC_INDEX = 0x024;   // u32, this device's index on the node fabric
inline constexpr uint32_t FABRIC_SIZE = 0x028;    // u32, devices on the node fabric
inline constexpr uint32_t NUM_MSIX = 0x02c;       // u32, MSI-X vectors (>= NUM_QUEUES)

// Control / status
inline constexpr uint32_t CONTROL = 0x040;        // RW, ctrl:: bits
inline constexpr uint32_t STATUS = 0x044;         // RO, status:: bits
inline constexpr uint32_t ERR_COUNT = 0x048;      // RO u64, error completions since reset
inline constexpr uint32_t ERR_LOG_CODE = 0x050;   // RO, CqStatus of the last error (0 = none)
inline constexpr uint32_t ERR_LOG_QUEUE = 0x054;  // RO, queue of the last error
inline constexpr uint32_t ERR_LOG_INDEX = 0x058;  // RO, SQ index of the last error
inline constexpr uint32_t ERR_CLEAR = 0x05c;      // W1C: write 1 clears ERR_LOG_* (not ERR_COUNT)
inline constexpr uint32_t ERR_LOG_ADDR = 0x060;   // RO u64, faulting IOVA (0 if n/a)
inline constexpr uint32_t SCRATCH = 0x068;        // RW, no side effect (self-test)
inline constexpr uint32_t COMPLETED = 0x070;      // RO u64, descriptors completed since reset

// Address translation table (ATT) programming window, §6.
inline constexpr uint32_t ATT_INDEX = 0x100;      // RW u32, entry to program
inline constexpr uint32_t ATT_CMD = 0x104;        // WO u32, att_cmd:: value; executes
inline constexpr uint32_t ATT_IOVA = 0x108;       // RW u64
inline constexpr uint32_t ATT_LEN = 0x110;        // RW u64, bytes (> 0)
inline constexpr uint32_t ATT_TARGET = 0x118;     // RW u64, bus address / HBM offset
inline constexpr uint32_t ATT_FLAGS = 0x120;      // RW u32, att:: bits
inline constexpr uint32_t ATT_STATUS = 0x124;     // RO u32, att_status:: result of last ATT_CMD

// Per-queue configuration blocks, §7: QUEUE_BASE + q * QUEUE_STRIDE.
inline constexpr uint32_t QUEUE_BASE = 0x400;
inline constexpr uint32_t QUEUE_STRIDE = 0x40;
inline constexpr uint32_t MAX_QUEUES = 16;
inline constexpr uint32_t Q_SQ_BASE = 0x00;       // RW u64, IOVA of the SQ entries
inline constexpr uint32_t Q_CQ_BASE = 0x08;       // RW u64, IOVA of the CQ entries
inline constexpr uint32_t Q_SHADOW = 0x10;        // RW u64, IOVA of the QueueShadow block
inline constexpr uint32_t Q_SIZE_LOG2 = 0x18;     // RW u32, entries = 1 << this (SQ and CQ)
inline constexpr uint32_t Q_MSIX = 0x1c;          // RW u32, MSI-X vector, or kNoVector
inline constexpr uint32_t Q_CTRL = 0x20;          // RW u32, qctrl:: bits
inline constexpr uint32_t Q_STATUS = 0x24;        // RO u32, qstatus:: bits + [15:8] QueueError
inline constexpr uint32_t Q_COMPLETED = 0x28;     // RO u64, descriptors completed on this queue

inline constexpr uint32_t queue(uint32_t q, uint32_t field) { return QUEUE_BASE + q * QUEUE_STRIDE + field; }

// Network engine (cap::ROCE, ABI >= 1.3), §15: the port, a command window
// for the memory-key table and the RC queue pairs, and the port counters.
inline constexpr uint32_t NET_MAC = 0x800;        // RO u64, the port's MAC in [47:0] (first octet in [47:40])
inline constexpr uint32_t NET_IP = 0x808;         // RW u32, the port's IPv4 address (its GID); 0 = none
inline constexpr uint32_t NET_LINK = 0x80c;       // RO u32, 1 = link up
inline constexpr uint32_t NET_MAX_MTU = 0x810;    // RO u32, largest path MTU in bytes (4096)
inline constexpr uint32_t NET_NUM_QP = 0x814;     // RO u32, queue-pair slots
inline constexpr uint32_t NET_NUM_MR = 0x818;     // RO u32, memory-key table entries
inline constexpr uint32_t NET_CMD = 0x81c;        // WO u32, net_cmd:: value; executes at once
inline constexpr uint32_t NET_CMD_STATUS = 0x820; // RO u32, net_status:: result of the last NET_CMD
inline constexpr uint32_t NET_CMD_RESULT = 0x824; // RO u32, its result (QP_CREATE: the QP number)
inline constexpr uint32_t NET_CMD_ARG = 0x840;    // RW, 128 bytes: the command's argument block
inline constexpr uint32_t kNetCmdArgSize = 128;
inline constexpr uint32_t NET_COUNTERS = 0x900;   // RO u64 each, net_counter:: index * 8
inline constexpr uint32_t kNetCounterCount = 16;

// Doorbells, §8: one 32-bit doorbell per queue in the doorbell page.
inline constexpr uint32_t DOORBELL_STRIDE = 8;
inline constexpr uint32_t doorbell(uint32_t q) {
  return static_cast<uint32_t>(kDoorbellPageOffset) + q * DOORBELL_STRIDE;
}
}  // namespace reg

// Register map self-check: no two registers overlap, 64-bit ones are 8-byte
// aligned, and the control page stays below the doorbell page.
namespace detail {
struct RegSpan {
  uint32_t off, width;
};
inline constexpr RegSpan kRegMap[] = {
    {reg::ID, 4}, {reg::ABI_VERSION, 4}, {reg::CAPS, 8}, {reg::HBM_SIZE, 8}, {reg::NUM_QUEUES, 4},
    {reg::MAX_QUEUE_LOG2, 4}, {reg::NUM_ATT, 4}, {reg::FABRIC_INDEX, 4}, {reg::FABRIC_SIZE, 4},
    {reg::NUM_MSIX, 4}, {reg::CONTROL, 4}, {reg::STATUS, 4}, {reg::ERR_COUNT, 8}, {reg::ERR_LOG_CODE, 4},
    {reg::ERR_LOG_QUEUE, 4}, {reg::ERR_LOG_INDEX, 4}, {reg::ERR_CLEAR, 4}, {reg::ERR_LOG_ADDR, 8},
    {reg::SCRATCH, 4}, {reg::COMPLETED, 8}, {reg::ATT_INDEX, 4}, {reg::ATT_CMD, 4}, {reg::ATT_IOVA, 8},
    {reg::ATT_LEN, 8}, {reg::ATT_TARGET, 8}, {reg::ATT_FLAGS, 4}, {reg::ATT_STATUS, 4},
    {reg::QUEUE_BASE + reg::Q_SQ_BASE, 8}, {reg::QUEUE_BASE + reg::Q_CQ_BASE, 8},
    {reg::QUEUE_BASE + reg::Q_SHADOW, 8}, {reg::QUEUE_BASE + reg::Q_SIZE_LOG2, 4},
    {reg::QUEUE_BASE + reg::Q_MSIX, 4}, {reg::QUEUE_BASE + reg::Q_CTRL, 4},
    {reg::QUEUE_BASE + reg::Q_STATUS, 4}, {reg::QUEUE_BASE + reg::Q_COMPLETED, 8},
    {reg::NET_MAC, 8}, {reg::NET_IP, 4}, {reg::NET_LINK, 4}, {reg::NET_MAX_MTU, 4}, {reg::NET_NUM_QP, 4},
    {reg::NET_NUM_MR, 4}, {reg::NET_CMD, 4}, {reg::NET_CMD_STATUS, 4}, {reg::NET_CMD_RESULT, 4},
    {reg::NET_CMD_ARG, reg::kNetCmdArgSize}, {reg::NET_COUNTERS, reg::kNetCounterCount * 8},
};
constexpr bool reg_map_ok() {
  for (const RegSpan& a : kRegMap) {
    if (a.off % (a.width > 8 ? 8 : a.width) != 0 || a.off + a.width > kControlPageSize) return false;
    for (const RegSpan& b : kRegMap)
      if (&a != &b && a.off < b.off + b.width && b.off < a.off + a.width) return false;
  }
  return reg::Q_COMPLETED + 8 <= reg::QUEUE_STRIDE &&
         reg::QUEUE_BASE + reg::MAX_QUEUES * reg::QUEUE_STRIDE <= kControlPageSize &&
         reg::doorbell(reg::MAX_QUEUES - 1) + 4 <= kBar0Size;
}
static_assert(reg_map_ok(), "BAR0 register map overlaps or is misaligned");
}  // namespace detail

inline constexpr uint32_t kNoVector = 0xffffffffu;

namespace cap {  // CAPS bits
inline constexpr uint64_t COPY = 1u << 0;
inline constexpr uint64_t FILL = 1u << 1;
inline constexpr uint64_t REDUCE = 1u << 2;
inline constexpr uint64_t NOTIFY = 1u << 3;
inline constexpr uint64_t FP16 = 1u << 4;     // REDUCE over fp16
inline constexpr uint64_t BF16 = 1u << 5;     // REDUCE over bf16
inline constexpr uint64_t PEER_DMA = 1u << 6; // ATT entries may target peer HBM
inline constexpr uint64_t MSIX = 1u << 7;
inline constexpr uint64_t WAKE_SUPPRESS = 1u << 8;  // QueueShadow::need_wakeup is maintained
inline constexpr uint64_t ATOMIC = 1u << 9;         // FETCH_ADD / CMP_SWAP (ABI >= 1.1)
inline constexpr uint64_t ATT_SPAN = 1u << 10;      // data operands may run through adjacent ATT entries (ABI >= 1.2, §6.4)
inline constexpr uint64_t ROCE = 1u << 11;          // the RoCEv2 network engine and its registers (ABI >= 1.3, §14-§16)
}  // namespace cap

namespace ctrl {  // CONTROL bits
inline constexpr uint32_t ENABLE = 1u << 0;  // device executes queues only while set
inline constexpr uint32_t RESET = 1u << 1;   // write 1: full reset; reads back 0 once done
}  // namespace ctrl

namespace status {  // STATUS bits
inline constexpr uint32_t READY = 1u << 0;   // reset done, registers usable
inline constexpr uint32_t ENABLED = 1u << 1; // mirrors CONTROL.ENABLE once effective
inline constexpr uint32_t FATAL = 1u << 2;   // device needs a reset
}  // namespace status

namespace att {  // ATT_FLAGS bits
inline constexpr uint32_t READ = 1u << 0;    // device may read through this entry
inline constexpr uint32_t WRITE = 1u << 1;   // device may write through this entry
inline constexpr uint32_t KIND_SHIFT = 4;    // [7:4] target kind
inline constexpr uint32_t KIND_MASK = 0xfu << KIND_SHIFT;
inline constexpr uint32_t KIND_HOST = 0u << KIND_SHIFT;      // TARGET = host bus address
inline constexpr uint32_t KIND_HBM = 1u << KIND_SHIFT;       // TARGET = offset in own HBM
inline constexpr uint32_t KIND_PEER_HBM = 2u << KIND_SHIFT;  // TARGET = offset in peer's HBM
inline constexpr uint32_t PEER_SHIFT = 8;    // [15:8] peer fabric index (KIND_PEER_HBM)
inline constexpr uint32_t PEER_MASK = 0xffu << PEER_SHIFT;
inline constexpr uint32_t kKnownBits = READ | WRITE | KIND_MASK | PEER_MASK;
}  // namespace att

namespace att_cmd {
inline constexpr uint32_t WRITE = 1;  // install entry ATT_INDEX from ATT_IOVA/LEN/TARGET/FLAGS
inline constexpr uint32_t CLEAR = 2;  // invalidate entry ATT_INDEX (waits for in-flight users)
}  // namespace att_cmd

namespace att_status {
inline constexpr uint32_t OK = 0;
inline constexpr uint32_t BAD_INDEX = 1;    // ATT_INDEX >= NUM_ATT
inline constexpr uint32_t BAD_RANGE = 2;    // zero length, wrap-around, or target outside HBM
inline constexpr uint32_t OVERLAP = 3;      // IOVA range overlaps another valid entry
inline constexpr uint32_t BAD_FLAGS = 4;    // unknown bits, unknown kind, no rights, bad peer
inline constexpr uint32_t NOT_MAPPED = 5;   // KIND_HOST target not backed by host DMA memory
inline constexpr uint32_t BAD_CMD = 6;
}  // namespace att_status

namespace net_cmd {  // NET_CMD values (§15.2); arguments in NET_CMD_ARG
inline constexpr uint32_t MR_SET = 1;         // arg: rdma::MrEntry (installs entry key_index(key))
inline constexpr uint32_t MR_INVALIDATE = 2;  // arg: u32 key
inline constexpr uint32_t QP_CREATE = 3;      // arg: rdma::QpCreate; result: the QP number
inline constexpr uint32_t QP_MODIFY = 4;      // arg: rdma::QpAttr, then u32 QP number at offset 64
inline constexpr uint32_t QP_DESTROY = 5;     // arg: u32 QP number
inline constexpr uint32_t QP_QUERY = 6;       // arg: u32 QP number; result: its rdma::QpState
}  // namespace net_cmd

namespace net_status {
inline constexpr uint32_t OK = 0;
inline constexpr uint32_t BAD_CMD = 1;     // unknown command
inline constexpr uint32_t BAD_ARG = 2;     // a field out of range (reserved bits, sizes, access bits, MTU, ...)
inline constexpr uint32_t NOT_FOUND = 3;   // no such key or QP
inline constexpr uint32_t IN_USE = 4;      // the key index is taken
inline constexpr uint32_t NO_SLOT = 5;     // every QP slot is in use
inline constexpr uint32_t BAD_STATE = 6;   // a state change the QP state machine does not allow
inline constexpr uint32_t UNMAPPED = 7;    // a ring or the shadow block not inside one ATT entry with the rights
}  // namespace net_status

namespace net_counter {  // NET_COUNTERS index
inline constexpr uint32_t TX_FRAMES = 0, RX_FRAMES = 1, RX_BAD_ICRC = 2, RX_MALFORMED = 3, RX_NOT_ROCE = 4,
                          RX_UNSUPPORTED = 5, RX_NO_QP = 6, RETRANSMITS = 7, TIMEOUTS = 8, SEQ_NAKS_SENT = 9,
                          SEQ_NAKS_RCVD = 10, RNR_NAKS_SENT = 11, RNR_NAKS_RCVD = 12, DUPLICATES = 13,
                          ACCESS_NAKS_SENT = 14, ARP_REPLIES = 15;
}  // namespace net_counter

namespace qctrl {
inline constexpr uint32_t ENABLE = 1u << 0;  // 0 -> 1 validates the config and starts the queue
}
namespace qstatus {
inline constexpr uint32_t ENABLED = 1u << 0;
inline constexpr uint32_t ERROR = 1u << 1;   // config rejected; code in [15:8]
inline constexpr uint32_t ERROR_SHIFT = 8;
}  // namespace qstatus

// Why a queue enable was refused (Q_STATUS[15:8]).
enum class QueueError : uint8_t {
  none = 0,
  bad_size = 1,       // Q_SIZE_LOG2 == 0 or > MAX_QUEUE_LOG2
  sq_unmapped = 2,    // SQ ring not inside one readable ATT entry
  cq_unmapped = 3,    // CQ ring not inside one writable ATT entry
  shadow_unmapped = 4,// shadow block not inside one read/write ATT entry
  bad_vector = 5,     // Q_MSIX >= NUM_MSIX and != kNoVector
  misaligned = 6,     // a base not 64-byte aligned
  dirty_shadow = 7,   // shadow sq_tail / cq_head not 0 at enable (driver must zero it)
  bad_tail = 8,       // while running: sq_tail more than one ring ahead of sq_head
  bad_cq_head = 9,    // while running: cq_head ahead of the device's CQ tail
};

}  // namespace hcomm::hal::abi
