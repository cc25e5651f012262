// IvshmemLink: driver::Link to an hcomm NPU that reaches this (guest) kernel
// as QEMU's ivshmem-doorbell PCI function, served by hcomm-sim's ivshmem
// front (hal/abi/ivshmem.h, docs/device-abi.md §11.3).
//
// It sits on top of the ivshmem function's own link (a VfioLink in
// iova-mode=pa: vfio-pci owns the function, the IOMMU container, the MSI-X
// vectors) and presents the NPU's regions the HAL expects:
//   BAR0 (registers)  mailbox round trips in the shared BAR (exact register
//                     semantics; cold path only)
//   BAR2 (HBM)        mmapable: the shared BAR from kHbmOffset
//   doorbell(q)       ivshmem DOORBELL = (sim peer << 16) | (1 + q): an MMIO
//                     store (or a pwrite when VFIO cannot mmap ivshmem's BAR0)
//   MSI-X             ivshmem's MSI-X vectors, through VFIO_DEVICE_SET_IRQS
//   DMA               VFIO_IOMMU_MAP_DMA at IOVA = guest-physical address, then
//                     the mailbox's DMA_MAP so the model serves that range
//   config space      the ivshmem function's (through VFIO), with the command
//                     register mirrored to the model (it gates bus mastering)
//
// Open and close tell the model a new driver instance owns the function
// (mailbox new_driver): a driver never inherits the mappings or queues of a
// previous one. reset() is the function-level reset (Device::reset); the
// DMA mappings survive it, as with VFIO_DEVICE_RESET.
//
// Threading: as every Link, cold-path calls are serialised by the caller; the
// mailbox additionally takes a lock so concurrent register access is safe.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "driver/link.h"
#include "hal/abi/ivshmem.h"

namespace hcomm::driver {

struct IvshmemOptions {
  // One mailbox round trip may take this long (the model is a host process
  // and the guest may be emulated: generous).
  int mailbox_timeout_ms = 5000;
};

class IvshmemLink final : public Link {
 public:
  // `pci`: the ivshmem function's link; it must hand out bus addresses the
  // model can use (iova-mode=pa). Fails with unsupported when the shared BAR
  // does not carry an hcomm header (an ivshmem device of someone else).
  static Status open(std::unique_ptr<Link> pci, const IvshmemOptions& opts, std::unique_ptr<Link>* out);
  ~IvshmemLink() override;

  const char* kind() const override { return "vfio-ivshmem"; }
  std::string location() const override { return _pci->location(); }

  Status region_info(uint32_t region, RegionInfo* out) override;
  Status map_region(uint32_t region, void** out, uint64_t* size) override;
  Status read(uint32_t region, uint64_t offset, void* data, size_t len) override;
  Status write(uint32_t region, uint64_t offset, const void* data, size_t len) override;
  Status doorbell(uint64_t bar0_offset, Doorbell* out) override;
  Status set_msix(uint32_t first_vector, std::span<const int> eventfds) override;
  uint32_t msix_count() const override;
  Status dma_map(void* vaddr, uint64_t len, int fd, uint64_t fd_offset, uint32_t prot,
                 uint64_t* bus_addr) override;
  Status dma_unmap(uint64_t bus_addr, uint64_t len) override;
  // The model's heartbeat has not moved for iv::kHeartbeatStaleMs (hcomm-sim
  // killed or stopped), or the device reset itself since this link opened:
  // device_error. No round trip: two loads from the shared page.
  Status health() override;
  bool cheap_register_reads() const override { return false; }
  Status dma_map_segments(void* vaddr, uint64_t len, int fd, uint64_t fd_offset, uint32_t prot,
                          std::vector<DmaSegment>* out) override;
  Status reset() override;

  const hal::abi::ivshmem::Header& header() const { return _hdr; }

 private:
  IvshmemLink(std::unique_ptr<Link> pci, const IvshmemOptions& opts) : _pci(std::move(pci)), _opts(opts) {}
  Status init();
  Status call(hal::abi::ivshmem::MailboxOp op, uint32_t width, uint64_t offset, uint64_t value, uint64_t len,
              uint32_t prot, uint64_t* result);

  // After the VFIO mapping of [bus, +len): tell the model (or count one more
  // user of a range it can already reach).
  Status model_map(uint64_t bus, uint64_t len, uint32_t prot);
  std::unique_ptr<Link> _pci;
  const hal::abi::ivshmem::Liveness* _live = nullptr;
  uint64_t _resets_at_open = 0;
  std::mutex _health_mu;
  uint64_t _last_heartbeat = 0;
  std::chrono::steady_clock::time_point _heartbeat_seen;
  IvshmemOptions _opts;
  uint8_t* _shared = nullptr;
  uint64_t _shared_size = 0;
  hal::abi::ivshmem::Header _hdr{};
  hal::abi::ivshmem::Mailbox* _mb = nullptr;
  Doorbell _kick;  // the sim's mailbox vector
  std::mutex _mu;  // one mailbox request at a time
  // What the model was told: page-aligned ranges by start, each with the
  // number of dma_map calls it serves (in iova-mode=pa a second mapping of
  // the same memory, or of part of it, has the same bus addresses and
  // shares the range). _views: bus address handed out -> (range, length).
  struct DmaRange {
    uint64_t len = 0;
    uint32_t refs = 0;
    uint32_t prot = 0;  // dma_prot bits the model was given
  };
  std::map<uint64_t, DmaRange> _ranges;
  std::multimap<uint64_t, std::pair<uint64_t, uint64_t>> _views;
};

}  // namespace hcomm::driver
