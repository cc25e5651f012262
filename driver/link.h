// Link: how the process reaches one device. Everything above (hal/npu) is
// written against this interface and does not know whether the device is
// silicon behind Linux VFIO, hcomm-sim behind vfio-user, or hcomm-sim
// behind QEMU's ivshmem inside a guest (driver/ivshmem_link.h).
//
// Cold-path interface: virtual calls are fine here. The hot path (doorbells,
// ring writes) goes through the raw pointers and fds this interface hands out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"

namespace hcomm::driver {

struct RegionInfo {
  uint32_t index = 0;
  uint64_t size = 0;
  bool readable = false;
  bool writable = false;
  bool mmapable = false;
};

// A doorbell the HAL can ring without a virtual call: an MMIO word (BAR0
// mapped), an eventfd the device listens on (vfio-user ioeventfd), or, when
// VFIO cannot mmap the BAR, a 4-byte pwrite at `pwrite_offset` of a VFIO
// device fd (one system call per ring).
struct Doorbell {
  volatile uint32_t* mmio = nullptr;
  int eventfd = -1;
  int pwrite_fd = -1;
  uint64_t pwrite_offset = 0;
  // The word written is this instead of the caller's value (ivshmem's
  // DOORBELL register takes (peer << 16) | vector, not a ring index).
  bool fixed = false;
  uint32_t fixed_value = 0;
  void ring(uint32_t value) const;  // driver/link.cpp
};

// DMA access rights the device gets on a mapping.
namespace dma_prot {
inline constexpr uint32_t READ = 1u << 0;
inline constexpr uint32_t WRITE = 1u << 1;
}  // namespace dma_prot

class Link {
 public:
  virtual ~Link() = default;

  // "vfio-user" or "vfio" (for probe output and logs).
  virtual const char* kind() const = 0;
  // Human-readable location: socket path or PCI address.
  virtual std::string location() const = 0;

  virtual Status region_info(uint32_t region, RegionInfo* out) = 0;
  // Map a whole mmapable region into this process. The mapping lives as long
  // as the Link (repeated calls return the same pointer).
  virtual Status map_region(uint32_t region, void** out, uint64_t* size) = 0;

  // Trapped register access (BAR0 control page, PCI config space). Widths 4
  // and 8 only for BAR0 registers.
  virtual Status read(uint32_t region, uint64_t offset, void* data, size_t len) = 0;
  virtual Status write(uint32_t region, uint64_t offset, const void* data, size_t len) = 0;

  Status read32(uint64_t offset, uint32_t* v) { return read(0, offset, v, 4); }
  Status read64(uint64_t offset, uint64_t* v) { return read(0, offset, v, 8); }
  Status write32(uint64_t offset, uint32_t v) { return write(0, offset, &v, 4); }
  Status write64(uint64_t offset, uint64_t v) { return write(0, offset, &v, 8); }

  // The doorbell at `bar0_offset` (a doorbell-page offset).
  virtual Status doorbell(uint64_t bar0_offset, Doorbell* out) = 0;

  // MSI-X: vector i signals fds[i - first]; an fd of -1 disconnects that vector.
  virtual Status set_msix(uint32_t first_vector, std::span<const int> eventfds) = 0;
  virtual uint32_t msix_count() const = 0;

  // Make [vaddr, vaddr+len) of this process reachable by the device at a bus
  // address the link chooses (returned in *bus_addr). `fd`/`fd_offset` name
  // the same memory as a shareable file (memfd) for links whose device lives
  // in another process; links that do not need it ignore them.
  virtual Status dma_map(void* vaddr, uint64_t len, int fd, uint64_t fd_offset, uint32_t prot,
                         uint64_t* bus_addr) = 0;
  virtual Status dma_unmap(uint64_t bus_addr, uint64_t len) = 0;

  // The same, for devices that can use a buffer in pieces (ABI 1.2
  // cap::ATT_SPAN): *out gets one or more segments that together cover
  // [vaddr, vaddr+len) in order; each is unmapped on its own with
  // dma_unmap(seg.bus_addr, seg.len). Links whose bus addresses are
  // physical (VFIO iova-mode=pa) split where the memory is not physically
  // contiguous, so a buffer need not be; every other link maps one segment.
  struct DmaSegment {
    uint64_t bus_addr = 0;
    uint64_t len = 0;
  };
  virtual Status dma_map_segments(void* vaddr, uint64_t len, int fd, uint64_t fd_offset, uint32_t prot,
                                  std::vector<DmaSegment>* out) {
    DmaSegment seg{0, len};
    HCOMM_TRY(dma_map(vaddr, len, fd, fd_offset, prot, &seg.bus_addr));
    out->assign(1, seg);
    return Status::ok();
  }

  // Function-level reset through the transport (VFIO_DEVICE_RESET /
  // VFIO_USER_DEVICE_RESET). The HAL prefers the CONTROL.RESET register.
  virtual Status reset() = 0;

  // Whether the device is still there, without blocking: device_error once
  // it is gone for good (the vfio-user server hung up). Polled by progress
  // every peer_check_ms, so that work on a vanished device fails instead of
  // waiting for completions that will never come.
  virtual Status health() { return Status::ok(); }

  // Whether a register read is cheap enough to poll now and then (an MMIO
  // load, or one vfio-user round trip): the HAL then also reads STATUS to
  // notice a device that was reset under it (hal::npu::Device::health).
  // Links whose reads are slow or may block (ivshmem's mailbox) say no and
  // report resets through health().
  virtual bool cheap_register_reads() const { return true; }
};

}  // namespace hcomm::driver
