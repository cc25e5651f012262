// VfioLink: driver::Link over Linux VFIO (vfio-pci), for silicon on bare
// metal and for hcomm-sim's QEMU front inside a guest.
//
// Bring-up follows the "VFIO Usage Example" of the kernel's
// Documentation/driver-api/vfio.rst (container -> group -> IOMMU -> device),
// then docs/device-abi.md §3 (BAR0 = registers + doorbell page) for what is
// mapped. Every system call goes through VfioSys so the unit tests run the
// whole sequence against a fake kernel.
//
// Ownership: the link owns the container, group and device fds, the BAR
// mappings and the IOVA space. Teardown order (destructor): clear bus
// mastering, DMA unmaps, BAR munmaps, device fd, group fd, container fd —
// the reverse of bring-up, so the device has stopped DMA before its
// mappings (and then the memory behind them) go away.
//
// Threading: cold-path object; callers serialise calls. The doorbell
// pointers it hands out are safe to use from any thread while the link lives.
#pragma once

#include <sys/types.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/range_alloc.h"
#include "driver/link.h"

namespace hcomm::driver {

// The system calls VFIO needs. Implementations follow the libc contract:
// return -1 (MAP_FAILED for mmap) and set errno on failure.
class VfioSys {
 public:
  virtual ~VfioSys() = default;
  virtual int open(const char* path, int flags) = 0;
  virtual int close(int fd) = 0;
  // `arg` is the ioctl's third argument: a pointer for struct ioctls, or an
  // integer value cast to a pointer (VFIO_CHECK_EXTENSION, VFIO_SET_IOMMU).
  virtual int ioctl(int fd, unsigned long request, void* arg) = 0;
  virtual void* mmap(void* addr, size_t len, int prot, int flags, int fd, off_t offset) = 0;
  virtual int munmap(void* addr, size_t len) = 0;
  virtual ssize_t pread(int fd, void* buf, size_t len, off_t offset) = 0;
  virtual ssize_t pwrite(int fd, const void* buf, size_t len, off_t offset) = 0;

  // The process-wide real implementation (plain libc calls).
  static VfioSys& real();
};

struct VfioOptions {
  std::string sysfs_root = "/sys";         // for the IOMMU group lookup (PciScanner)
  std::string vfio_dir = "/dev/vfio";      // container: <dir>/vfio, group: <dir>/<n>
  std::string pagemap_path = "/proc/self/pagemap";
  // DPDK's iova-mode=pa: the IOVA of a mapping is its physical address (from
  // pagemap; needs CAP_SYS_ADMIN and physically contiguous buffers, i.e.
  // hugepages beyond 4 KiB). Required in no-IOMMU mode, where the device sees
  // physical addresses; with an IOMMU it is still mapped through MAP_DMA.
  bool iova_mode_pa = false;
  // IOVA window the allocator hands out in iova-mode=va. Must exclude 0 and
  // be 4 KiB aligned; the default avoids the low 4 GiB (MSI doorbell window
  // on x86 sits at 0xfee00000).
  uint64_t iova_base = uint64_t{1} << 32;
  uint64_t iova_limit = uint64_t{1} << 39;  // exclusive; 39 bits fit every IOMMU
  // Set PCI_COMMAND memory space + bus master at open.
  bool enable_bus_master = true;
  VfioSys* sys = nullptr;  // nullptr: VfioSys::real(); not owned, must outlive the link
};

class VfioLink final : public Link {
 public:
  ~VfioLink() override;
  VfioLink(const VfioLink&) = delete;
  VfioLink& operator=(const VfioLink&) = delete;

  // Bring up `pci_addr` in IOMMU group `group` (open_vfio looks the group up).
  static Status open(const std::string& pci_addr, int group, const VfioOptions& opts,
                     std::unique_ptr<VfioLink>* out);

  const char* kind() const override { return "vfio"; }
  std::string location() const override { return _addr; }

  Status region_info(uint32_t region, RegionInfo* out) override;
  Status map_region(uint32_t region, void** out, uint64_t* size) override;
  Status read(uint32_t region, uint64_t offset, void* data, size_t len) override;
  Status write(uint32_t region, uint64_t offset, const void* data, size_t len) override;
  Status doorbell(uint64_t bar0_offset, Doorbell* out) override;
  Status set_msix(uint32_t first_vector, std::span<const int> eventfds) override;
  uint32_t msix_count() const override { return _msix_count; }
  Status dma_map(void* vaddr, uint64_t len, int fd, uint64_t fd_offset, uint32_t prot,
                 uint64_t* bus_addr) override;
  Status dma_unmap(uint64_t bus_addr, uint64_t len) override;
  Status dma_map_segments(void* vaddr, uint64_t len, int fd, uint64_t fd_offset, uint32_t prot,
                          std::vector<DmaSegment>* out) override;
  Status reset() override;

  // VFIO_TYPE1v2_IOMMU, VFIO_TYPE1_IOMMU or VFIO_NOIOMMU_IOMMU.
  int iommu_type() const { return _iommu_type; }
  bool noiommu() const { return _noiommu; }
  bool bar0_mmapped() const { return _maps[0] != nullptr; }

 private:
  struct Region {
    bool present = false;
    uint32_t flags = 0;   // VFIO_REGION_INFO_FLAG_*
    uint64_t size = 0;
    uint64_t offset = 0;  // in the device fd
  };
  struct Mapping {
    uint64_t iova = 0;      // page-aligned start actually mapped
    uint64_t len = 0;       // page-aligned length actually mapped
    bool allocated = false; // IOVA came from the allocator (va mode)
    bool via_iommu = false; // MAP_DMA was issued (false in no-IOMMU mode)
    // iova-mode=pa: memory mapped again (another view of a shared buffer, a
    // sub-range of a mapped one) has the same physical, hence bus, address
    // and shares this IOMMU mapping: refs counts the mapping itself while
    // not unmapped (released = false) plus its views.
    uint32_t refs = 1;
    bool released = false;
    uint32_t prot = 0;  // dma_prot bits it was mapped with
  };
  struct View {
    uint64_t owner = 0;  // key in _mappings
    uint64_t len = 0;    // as the caller mapped it
  };
  Status release(std::map<uint64_t, Mapping>::iterator it);
  static constexpr uint32_t kNumRegions = 9;  // VFIO_PCI_NUM_REGIONS

  VfioLink(VfioSys* sys, std::string addr, const VfioOptions& opts);
  Status bring_up(int group);
  Status query_regions();
  Status enable_bus_master();
  Status region_check(uint32_t region, uint64_t offset, size_t len, const Region** out) const;
  Status physical_address(const void* vaddr, uint64_t len, uint64_t* pa);
  // iova-mode=pa: the physically contiguous runs of the page-aligned range
  // [vaddr, +len): byte offset, length, physical address of each.
  struct PhysRun {
    uint64_t off = 0, len = 0, pa = 0;
  };
  Status physical_runs(const void* vaddr, uint64_t len, std::vector<PhysRun>* runs);
  void populate(uintptr_t start, uint64_t mlen, bool write);
  Status iova_alloc(uint64_t len, uint64_t* iova);
  void iova_free(uint64_t iova, uint64_t len);
  Status issue_msix(uint32_t first, uint32_t count, const int* fds);

  VfioSys* _sys;
  std::string _addr;
  VfioOptions _opts;
  int _container = -1;
  int _group = -1;
  int _device = -1;
  int _iommu_type = 0;
  bool _noiommu = false;
  uint32_t _device_flags = 0;
  uint32_t _msix_count = 0;
  std::array<Region, kNumRegions> _regions{};
  std::array<void*, kNumRegions> _maps{};  // owned mmaps of BARs, size = region size
  // MSI-X: vectors [0, _msix_enabled) are enabled in the kernel; _msix_fds
  // remembers the (caller-owned) eventfd of each so the range can be
  // re-issued when it grows (vfio-pci cannot extend an enabled range).
  uint32_t _msix_enabled = 0;
  std::vector<int> _msix_fds;
  // Live DMA mappings, keyed by the bus address returned to the caller.
  std::map<uint64_t, Mapping> _mappings;
  // iova-mode=pa views sharing a mapping: bus address -> owner.
  std::multimap<uint64_t, View> _views;
  // Free IOVA ranges.
  RangeAllocator _iova;
};

// Finds the IOMMU group of `pci_addr` in sysfs (PciScanner on
// opts.sysfs_root), then VfioLink::open. The function must already be bound
// to vfio-pci (PciScanner::bind_to_driver).
Status open_vfio(const std::string& pci_addr, const VfioOptions& opts, std::unique_ptr<Link>* out);

}  // namespace hcomm::driver
