// The hcomm NPU over QEMU's ivshmem-doorbell device: the transport that puts
// hcomm-sim inside a QEMU guest as a PCI function the guest binds to vfio-pci
// (docs/device-abi.md §11.3). QEMU 7.2 has no vfio-user client; ivshmem is
// the device it has for a model living outside QEMU.
//
// What the guest sees on the ivshmem function (vendor 0x1af4, device 0x1110):
//   BAR0  ivshmem registers (QEMU docs/specs/ivshmem-spec): IVPOSITION tells
//         the guest its peer id, DOORBELL = (peer << 16) | vector interrupts
//         that peer on that vector.
//   BAR1  ivshmem's MSI-X table: the NPU's MSI-X vectors (vector v of the NPU
//         is ivshmem vector v).
//   BAR2  the shared memory hcomm-sim creates, laid out below: a header, the
//         register mailbox, then the NPU's HBM (abi BAR2) at kHbmOffset.
//
// Registers go through the mailbox: the driver fills a request, bumps `seq`,
// rings the sim's vector kMailboxVector and waits (with a deadline) for
// `ack == seq`. That keeps register semantics exact (a write has taken
// effect when it returns, reads have no staleness) at the cost of one round
// trip per access, which only the cold path pays. Queue doorbells are
// ivshmem doorbells on vector kDoorbellVectorBase + q: QEMU turns the MMIO
// write into an eventfd signal that wakes the sim's engine directly.
//
// DMA: ivshmem does no DMA of its own, so guest RAM is a shared file
// (memory-backend-file,share=on) that hcomm-sim maps, guest-physical address
// = file offset. The driver runs in iova-mode=pa: a bus address is a
// guest-physical address, and the mailbox's DMA_MAP tells the model which
// ranges the driver mapped through VFIO (the model refuses everything else,
// as an IOMMU would).
#pragma once

#include <cstddef>
#include <cstdint>

namespace hcomm::hal::abi::ivshmem {

// PCI identity of QEMU's ivshmem (both ivshmem-plain and ivshmem-doorbell).
inline constexpr uint16_t kPciVendorId = 0x1af4;
inline constexpr uint16_t kPciDeviceId = 0x1110;

// ivshmem BAR0 registers.
inline constexpr uint32_t kRegIntrMask = 0x00;
inline constexpr uint32_t kRegIntrStatus = 0x04;
inline constexpr uint32_t kRegIvPosition = 0x08;
inline constexpr uint32_t kRegDoorbell = 0x0c;
inline constexpr uint32_t kRegsBar = 0;
inline constexpr uint32_t kSharedBar = 2;
inline constexpr uint32_t doorbell_value(uint32_t peer, uint32_t vector) { return (peer << 16) | (vector & 0xffff); }

// ivshmem server protocol (docs/specs/ivshmem-spec): little-endian int64
// messages over a UNIX stream socket, an fd riding on some.
inline constexpr int64_t kProtocolVersion = 0;
inline constexpr int64_t kShmMessage = -1;  // sent with the shared memory fd

// Peer ids hcomm-sim hands out: itself, and the one guest it serves.
inline constexpr uint32_t kSimPeer = 0;
inline constexpr uint32_t kGuestPeer = 1;

// Vectors on the sim's side (what the guest rings).
inline constexpr uint32_t kMailboxVector = 0;
inline constexpr uint32_t kDoorbellVectorBase = 1;  // + queue index
// ivshmem's `vectors=` must be this (one eventfd per vector per peer): the
// guest side uses [0, num_queues) as the NPU's MSI-X vectors.
inline constexpr uint32_t vectors_for(uint32_t num_queues) { return kDoorbellVectorBase + num_queues; }

// ---- shared memory layout (BAR2) ----
inline constexpr uint64_t kHeaderOffset = 0;
inline constexpr uint64_t kMailboxOffset = 0x1000;
inline constexpr uint64_t kHbmOffset = uint64_t{2} << 20;  // hugepage aligned
// A PCI BAR is a power of two: the shared file is kHbmOffset + HBM rounded up.
inline constexpr uint64_t shared_size_for(uint64_t hbm_size) {
  uint64_t need = kHbmOffset + hbm_size, s = 1;
  while (s < need) s <<= 1;
  return s;
}

inline constexpr uint64_t kMagic = 0x3156494d4d4f4348ull;  // "HCOMMIV1"
inline constexpr uint32_t kLayoutVersion = 2;  // 2: Liveness

struct Header {  // written once by the sim before the guest can see it; never read back
  uint64_t magic;
  uint32_t version;
  uint32_t sim_peer;
  uint64_t shared_size;
  uint64_t hbm_offset;
  uint64_t hbm_size;
  uint32_t num_queues;
  uint32_t vectors;
  uint32_t mailbox_vector;
  uint32_t doorbell_vector_base;
};
static_assert(sizeof(Header) == 56);

enum class MailboxOp : uint32_t {
  bar0_read = 1,     // offset, width -> value
  bar0_write = 2,    // offset, width, value
  config_write = 3,  // PCI config: offset, width (1/2/4), value (command register)
  dma_map = 4,       // offset = bus (guest-physical) address, len, prot (dma_prot bits)
  dma_unmap = 5,     // offset, len
  reset = 6,         // function-level reset of the NPU (Device::reset, as vfio-user DEVICE_RESET)
  new_driver = 7,    // a driver instance takes or leaves the function: reset, every DMA map
                     // dropped, PCI command cleared (as a vfio-user client connecting anew)
};

inline constexpr size_t kMailboxMessageLen = 192;

// One request in flight at a time (the driver serialises). The driver owns
// every field but `ack`, `status`, `value` (for reads) and `message` until it
// bumps `seq`; from then until `ack == seq` the sim owns them.
struct Mailbox {
  uint32_t seq;        // driver: bumped (release) after the request is filled
  uint32_t ack;        // sim: set to seq (release) once the request is done
  uint32_t op;         // MailboxOp
  uint32_t width;      // access width in bytes
  uint64_t offset;
  uint64_t value;
  uint64_t len;
  uint32_t prot;
  int32_t status;      // sim: hcomm::Code of the result (0 = ok)
  char message[kMailboxMessageLen];  // sim: NUL-terminated error text when status != 0
};
static_assert(sizeof(Mailbox) == 48 + kMailboxMessageLen);
static_assert(kMailboxOffset + sizeof(Mailbox) <= kHbmOffset);

// Liveness (layout 2), written by the sim only and read by the driver
// without a round trip (IvshmemLink::health, polled every peer_check_ms):
// a guest cannot otherwise tell that the model behind the function is gone,
// since QEMU keeps the function and its memory.
struct Liveness {
  uint64_t heartbeat;  // bumped at least every kHeartbeatMs while the sim serves a guest
  uint64_t resets;     // resets the device did on its own (hcomm-sim's control "reset"), not the driver's
};
inline constexpr uint64_t kLivenessOffset = kMailboxOffset + 0x800;
inline constexpr uint32_t kHeartbeatMs = 50;
// The driver declares the device gone when the heartbeat has not moved for this long.
inline constexpr uint32_t kHeartbeatStaleMs = 500;
static_assert(kMailboxOffset + sizeof(Mailbox) <= kLivenessOffset);
static_assert(kLivenessOffset + sizeof(Liveness) <= kHbmOffset);

}  // namespace hcomm::hal::abi::ivshmem
