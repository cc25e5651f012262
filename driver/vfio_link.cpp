#include "driver/vfio_link.h"

#include <fcntl.h>
#include <linux/pci_regs.h>
#include <linux/vfio.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "driver/pci.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14; older kernels answer EINVAL
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace hcomm::driver {

namespace {

// errno is read before the message is built: building it allocates, and
// the allocator may change errno.
#define ERRNO_STATUS(what)                         \
  [&]() -> Status {                                \
    const int err_ = errno;                        \
    return Status::from_errno(err_, (what));       \
  }()

constexpr uint64_t kPage = 4096;  // IOVA granule; VFIO_IOMMU_GET_INFO must allow it

class RealVfioSys final : public VfioSys {
 public:
  int open(const char* path, int flags) override { return ::open(path, flags); }
  int close(int fd) override { return ::close(fd); }
  int ioctl(int fd, unsigned long request, void* arg) override { return ::ioctl(fd, request, arg); }
  void* mmap(void* addr, size_t len, int prot, int flags, int fd, off_t offset) override {
    return ::mmap(addr, len, prot, flags, fd, offset);
  }
  int munmap(void* addr, size_t len) override { return ::munmap(addr, len); }
  ssize_t pread(int fd, void* buf, size_t len, off_t offset) override { return ::pread(fd, buf, len, offset); }
  ssize_t pwrite(int fd, const void* buf, size_t len, off_t offset) override {
    return ::pwrite(fd, buf, len, offset);
  }
};

void* int_arg(uintptr_t v) { return reinterpret_cast<void*>(v); }

// "<what>: <strerror>" plus the usual cause of that errno when opening a
// VFIO node.
Status open_error(int err, const std::string& what) {
  Status st = Status::from_errno(err, what);
  const char* hint = "";
  switch (err) {
    case ENOENT: hint = " (vfio / vfio-pci modules loaded? device bound to vfio-pci?)"; break;
    case EACCES:
    case EPERM: hint = " (no permission: run as root or chown the node to this user)"; break;
    case EBUSY: hint = " (already opened by another process or container)"; break;
    default: break;
  }
  return Status(st.code(), st.message() + hint);
}

const char* region_name(uint32_t r) {
  switch (r) {
    case VFIO_PCI_BAR0_REGION_INDEX: return "BAR0";
    case VFIO_PCI_BAR1_REGION_INDEX: return "BAR1";
    case VFIO_PCI_BAR2_REGION_INDEX: return "BAR2";
    case VFIO_PCI_BAR3_REGION_INDEX: return "BAR3";
    case VFIO_PCI_BAR4_REGION_INDEX: return "BAR4";
    case VFIO_PCI_BAR5_REGION_INDEX: return "BAR5";
    case VFIO_PCI_ROM_REGION_INDEX: return "ROM";
    case VFIO_PCI_CONFIG_REGION_INDEX: return "config";
    case VFIO_PCI_VGA_REGION_INDEX: return "VGA";
    default: return "?";
  }
}

}  // namespace

static_assert(VFIO_PCI_NUM_REGIONS == 9, "VfioLink::kNumRegions follows linux/vfio.h");

VfioSys& VfioSys::real() {
  static RealVfioSys sys;
  return sys;
}

VfioLink::VfioLink(VfioSys* sys, std::string addr, const VfioOptions& opts)
    : _sys(sys), _addr(std::move(addr)), _opts(opts) {
  _maps.fill(nullptr);
  _iova = RangeAllocator(opts.iova_base, opts.iova_limit - opts.iova_base);
}

VfioLink::~VfioLink() {
  // Reverse of bring-up. Errors are ignored: nothing useful can be done with
  // them here, and closing the fds releases everything anyway.
  // 1. Stop the device mastering the bus, so no DMA is in flight when
  // 2. the IOMMU mappings go (the caller frees those pages next; a straggler
  //    after the unmap faults in the IOMMU instead of landing in reused memory).
  if (_device >= 0 && _regions[VFIO_PCI_CONFIG_REGION_INDEX].present) {
    uint16_t cmd = 0;
    const off_t at = static_cast<off_t>(_regions[VFIO_PCI_CONFIG_REGION_INDEX].offset + PCI_COMMAND);
    if (_sys->pread(_device, &cmd, sizeof cmd, at) == sizeof cmd && (cmd & PCI_COMMAND_MASTER) != 0) {
      cmd = static_cast<uint16_t>(cmd & ~PCI_COMMAND_MASTER);
      _sys->pwrite(_device, &cmd, sizeof cmd, at);
    }
  }
  for (const auto& [bus, m] : _mappings) {
    if (!m.via_iommu) continue;
    vfio_iommu_type1_dma_unmap um{};
    um.argsz = sizeof um;
    um.iova = m.iova;
    um.size = m.len;
    _sys->ioctl(_container, VFIO_IOMMU_UNMAP_DMA, &um);
  }
  for (uint32_t i = 0; i < kNumRegions; ++i)
    if (_maps[i] != nullptr) _sys->munmap(_maps[i], _regions[i].size);
  // Closing the device fd disables its interrupts and releases it; the group
  // must go before the container it is attached to.
  if (_device >= 0) _sys->close(_device);
  if (_group >= 0) _sys->close(_group);
  if (_container >= 0) _sys->close(_container);
}

Status VfioLink::open(const std::string& pci_addr, int group, const VfioOptions& opts,
                      std::unique_ptr<VfioLink>* out) {
  if (!is_pci_address(pci_addr))
    return Status::error(Code::invalid_argument, "vfio: '%s' is not a PCI address (DDDD:BB:DD.F)", pci_addr.c_str());
  if (group < 0) return Status::error(Code::invalid_argument, "vfio %s: IOMMU group %d", pci_addr.c_str(), group);
  if (opts.iova_base == 0 || opts.iova_base % kPage != 0 || opts.iova_limit % kPage != 0 ||
      opts.iova_limit <= opts.iova_base)
    return Status::error(Code::invalid_argument,
                         "vfio %s: IOVA window [0x%llx, 0x%llx) must be non-empty, 4 KiB aligned and exclude 0",
                         pci_addr.c_str(), static_cast<unsigned long long>(opts.iova_base),
                         static_cast<unsigned long long>(opts.iova_limit));
  VfioSys* sys = opts.sys != nullptr ? opts.sys : &VfioSys::real();
  std::unique_ptr<VfioLink> link(new VfioLink(sys, pci_addr, opts));
  HCOMM_TRY(link->bring_up(group));
  *out = std::move(link);
  return Status::ok();
}

// The numbered steps are the "VFIO Usage Example" of
// Documentation/driver-api/vfio.rst; on failure the destructor unwinds
// whatever was set up.
Status VfioLink::bring_up(int group) {
  const char* a = _addr.c_str();

  // Step 1: a new container.
  const std::string cpath = _opts.vfio_dir + "/vfio";
  _container = _sys->open(cpath.c_str(), O_RDWR | O_CLOEXEC);
  if (_container < 0) {
    const int err = errno;
    return open_error(err, "vfio " + _addr + ": open " + cpath);
  }

  // Step 2: "Unknown API version" check.
  int ver = _sys->ioctl(_container, VFIO_GET_API_VERSION, nullptr);
  if (ver != VFIO_API_VERSION)
    return Status::error(Code::unsupported, "vfio %s: kernel VFIO API version %d, this driver speaks %d", a, ver,
                         VFIO_API_VERSION);

  // Step 3: open the group. Its node name decides the IOMMU model: a group
  // created by vfio's enable_unsafe_noiommu_mode is /dev/vfio/noiommu-<n>.
  // (vfio.rst checks the extension before this; the check only asks the
  // container what it supports, so doing it after is equivalent.)
  std::string gpath = _opts.vfio_dir + "/" + std::to_string(group);
  _group = _sys->open(gpath.c_str(), O_RDWR | O_CLOEXEC);
  int group_err = _group < 0 ? errno : 0;
  if (group_err == ENOENT) {
    std::string npath = _opts.vfio_dir + "/noiommu-" + std::to_string(group);
    _group = _sys->open(npath.c_str(), O_RDWR | O_CLOEXEC);
    const int noiommu_err = _group < 0 ? errno : 0;
    // Both missing: report the normal path; otherwise the one that answered.
    if (noiommu_err != ENOENT) {
      gpath = std::move(npath);
      group_err = noiommu_err;
      _noiommu = _group >= 0;
    }
  }
  if (_group < 0) return open_error(group_err, "vfio " + _addr + ": open group " + gpath);
  if (_noiommu && !_opts.iova_mode_pa)
    return Status::error(Code::unsupported,
                         "vfio %s: group %d is no-IOMMU (the device sees physical addresses); "
                         "set VfioOptions::iova_mode_pa",
                         a, group);

  // Step 4: "Doesn't support the IOMMU driver we want." Type1v2 (unmap
  // semantics without splitting) when present, else Type1.
  if (_noiommu) {
    if (_sys->ioctl(_container, VFIO_CHECK_EXTENSION, int_arg(VFIO_NOIOMMU_IOMMU)) <= 0)
      return Status::error(Code::unsupported, "vfio %s: container lacks VFIO_NOIOMMU_IOMMU", a);
    _iommu_type = VFIO_NOIOMMU_IOMMU;
  } else if (_sys->ioctl(_container, VFIO_CHECK_EXTENSION, int_arg(VFIO_TYPE1v2_IOMMU)) > 0) {
    _iommu_type = VFIO_TYPE1v2_IOMMU;
  } else if (_sys->ioctl(_container, VFIO_CHECK_EXTENSION, int_arg(VFIO_TYPE1_IOMMU)) > 0) {
    _iommu_type = VFIO_TYPE1_IOMMU;
  } else {
    return Status::error(Code::unsupported, "vfio %s: container supports neither Type1v2 nor Type1 IOMMU", a);
  }

  // Step 5: "Group is not viable (ie, not all devices bound for vfio)".
  vfio_group_status gs{};
  gs.argsz = sizeof gs;
  if (_sys->ioctl(_group, VFIO_GROUP_GET_STATUS, &gs) != 0)
    return ERRNO_STATUS("vfio " + _addr + ": VFIO_GROUP_GET_STATUS");
  if ((gs.flags & VFIO_GROUP_FLAGS_VIABLE) == 0)
    return Status::error(Code::unsupported,
                         "vfio %s: IOMMU group %d is not viable: every device in the group must be bound to "
                         "vfio-pci or unbound (see /sys/kernel/iommu_groups/%d/devices)",
                         a, group, group);

  // Step 6: add the group to the container.
  int cfd = _container;
  if (_sys->ioctl(_group, VFIO_GROUP_SET_CONTAINER, &cfd) != 0)
    return ERRNO_STATUS("vfio " + _addr + ": VFIO_GROUP_SET_CONTAINER");

  // Step 7: enable the IOMMU model (valid only once a group is attached).
  if (_sys->ioctl(_container, VFIO_SET_IOMMU, int_arg(static_cast<uintptr_t>(_iommu_type))) != 0)
    return ERRNO_STATUS("vfio " + _addr + ": VFIO_SET_IOMMU(" + std::to_string(_iommu_type) + ")");

  // Step 8: IOMMU info — the page sizes it can map; our allocator's granule
  // (4 KiB) must be one of them or the smallest.
  if (!_noiommu) {
    vfio_iommu_type1_info ii{};
    ii.argsz = sizeof ii;
    if (_sys->ioctl(_container, VFIO_IOMMU_GET_INFO, &ii) != 0)
      return ERRNO_STATUS("vfio " + _addr + ": VFIO_IOMMU_GET_INFO");
    if ((ii.flags & VFIO_IOMMU_INFO_PGSIZES) != 0 && ii.iova_pgsizes != 0) {
      uint64_t smallest = ii.iova_pgsizes & (~ii.iova_pgsizes + 1);
      if (smallest > kPage)
        return Status::error(Code::unsupported, "vfio %s: IOMMU's smallest page is %llu bytes, need 4096", a,
                             static_cast<unsigned long long>(smallest));
    }
  }

  // Step 9: the device fd, by its name in the group.
  _device = _sys->ioctl(_group, VFIO_GROUP_GET_DEVICE_FD, const_cast<char*>(_addr.c_str()));
  if (_device < 0)
    return ERRNO_STATUS("vfio " + _addr + ": VFIO_GROUP_GET_DEVICE_FD (device not in group " +
                                         std::to_string(group) + "?)");

  // Step 10: regions and interrupts.
  HCOMM_TRY(query_regions());

  // PCI command register: memory decoding for the BARs and bus mastering so
  // the device can DMA at all (docs/device-abi.md §3: BAR0 registers).
  if (_opts.enable_bus_master) HCOMM_TRY(enable_bus_master());

  // BAR0 (docs/device-abi.md §3, §4, §8): map it when VFIO allows, so that
  // register access and doorbells are plain loads and stores.
  const Region& bar0 = _regions[VFIO_PCI_BAR0_REGION_INDEX];
  if (bar0.present && (bar0.flags & VFIO_REGION_INFO_FLAG_MMAP) != 0) {
    void* p = nullptr;
    uint64_t size = 0;
    HCOMM_TRY(map_region(VFIO_PCI_BAR0_REGION_INDEX, &p, &size));
  }
  return Status::ok();
}

Status VfioLink::query_regions() {
  vfio_device_info di{};
  di.argsz = sizeof di;
  if (_sys->ioctl(_device, VFIO_DEVICE_GET_INFO, &di) != 0)
    return ERRNO_STATUS("vfio " + _addr + ": VFIO_DEVICE_GET_INFO");
  if ((di.flags & VFIO_DEVICE_FLAGS_PCI) == 0)
    return Status::error(Code::unsupported, "vfio %s: not a vfio-pci device (flags 0x%x)", _addr.c_str(), di.flags);
  _device_flags = di.flags;

  const uint32_t n = di.num_regions < kNumRegions ? di.num_regions : kNumRegions;
  for (uint32_t i = 0; i < n; ++i) {
    vfio_region_info ri{};
    ri.argsz = sizeof ri;  // capability chains (sparse mmap) are not requested
    ri.index = i;
    if (_sys->ioctl(_device, VFIO_DEVICE_GET_REGION_INFO, &ri) != 0) {
      // vfio-pci answers EINVAL for the VGA region of a non-VGA device.
      if (i == VFIO_PCI_VGA_REGION_INDEX) continue;
      return ERRNO_STATUS("vfio " + _addr + ": VFIO_DEVICE_GET_REGION_INFO(" + region_name(i) + ")");
    }
    Region& r = _regions[i];
    r.present = ri.size != 0;
    r.flags = ri.flags;
    r.size = ri.size;
    r.offset = ri.offset;
  }
  if (!_regions[VFIO_PCI_CONFIG_REGION_INDEX].present)
    return Status::error(Code::protocol_error, "vfio %s: no PCI config region", _addr.c_str());

  if (di.num_irqs > VFIO_PCI_MSIX_IRQ_INDEX) {
    vfio_irq_info ii{};
    ii.argsz = sizeof ii;
    ii.index = VFIO_PCI_MSIX_IRQ_INDEX;
    if (_sys->ioctl(_device, VFIO_DEVICE_GET_IRQ_INFO, &ii) != 0)
      return ERRNO_STATUS("vfio " + _addr + ": VFIO_DEVICE_GET_IRQ_INFO(MSI-X)");
    if ((ii.flags & VFIO_IRQ_INFO_EVENTFD) != 0) _msix_count = ii.count;
  }
  _msix_fds.assign(_msix_count, -1);
  return Status::ok();
}

Status VfioLink::enable_bus_master() {
  uint16_t cmd = 0;
  HCOMM_TRY(read(VFIO_PCI_CONFIG_REGION_INDEX, PCI_COMMAND, &cmd, sizeof cmd));
  const uint16_t want = PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER;
  if ((cmd & want) == want) return Status::ok();
  cmd = static_cast<uint16_t>(cmd | want);
  return write(VFIO_PCI_CONFIG_REGION_INDEX, PCI_COMMAND, &cmd, sizeof cmd);
}

Status VfioLink::region_check(uint32_t region, uint64_t offset, size_t len, const Region** out) const {
  if (region >= kNumRegions || !_regions[region].present)
    return Status::error(Code::not_found, "vfio %s: no region %u", _addr.c_str(), region);
  const Region& r = _regions[region];
  if (len == 0 || offset > r.size || len > r.size - offset)
    return Status::error(Code::out_of_range, "vfio %s: %s access [0x%llx, +%zu) outside its %llu bytes",
                         _addr.c_str(), region_name(region), static_cast<unsigned long long>(offset), len,
                         static_cast<unsigned long long>(r.size));
  *out = &r;
  return Status::ok();
}

Status VfioLink::region_info(uint32_t region, RegionInfo* out) {
  if (region >= kNumRegions || !_regions[region].present)
    return Status::error(Code::not_found, "vfio %s: no region %u", _addr.c_str(), region);
  const Region& r = _regions[region];
  out->index = region;
  out->size = r.size;
  out->readable = (r.flags & VFIO_REGION_INFO_FLAG_READ) != 0;
  out->writable = (r.flags & VFIO_REGION_INFO_FLAG_WRITE) != 0;
  out->mmapable = (r.flags & VFIO_REGION_INFO_FLAG_MMAP) != 0;
  return Status::ok();
}

Status VfioLink::map_region(uint32_t region, void** out, uint64_t* size) {
  const Region* r = nullptr;
  HCOMM_TRY(region_check(region, 0, 1, &r));
  if ((r->flags & VFIO_REGION_INFO_FLAG_MMAP) == 0)
    return Status::error(Code::unsupported, "vfio %s: %s is not mmapable", _addr.c_str(), region_name(region));
  if (_maps[region] == nullptr) {
    int prot = ((r->flags & VFIO_REGION_INFO_FLAG_READ) != 0 ? PROT_READ : 0) |
               ((r->flags & VFIO_REGION_INFO_FLAG_WRITE) != 0 ? PROT_WRITE : 0);
    void* p = _sys->mmap(nullptr, r->size, prot, MAP_SHARED, _device, static_cast<off_t>(r->offset));
    if (p == MAP_FAILED)
      return ERRNO_STATUS("vfio " + _addr + ": mmap " + region_name(region) + " (" +
                                           std::to_string(r->size) + " bytes)");
    _maps[region] = p;
  }
  *out = _maps[region];
  *size = r->size;
  return Status::ok();
}

Status VfioLink::read(uint32_t region, uint64_t offset, void* data, size_t len) {
  const Region* r = nullptr;
  HCOMM_TRY(region_check(region, offset, len, &r));
  if ((r->flags & VFIO_REGION_INFO_FLAG_READ) == 0)
    return Status::error(Code::access_denied, "vfio %s: %s is not readable", _addr.c_str(), region_name(region));
  if (region == VFIO_PCI_BAR0_REGION_INDEX) {
    // docs/device-abi.md: 32-bit registers take 32-bit accesses, 64-bit ones
    // a single 64-bit access; both naturally aligned.
    if ((len != 4 && len != 8) || offset % len != 0)
      return Status::error(Code::invalid_argument, "vfio %s: BAR0 read of %zu bytes at 0x%llx (4 or 8, aligned)",
                           _addr.c_str(), len, static_cast<unsigned long long>(offset));
    if (_maps[region] != nullptr) {
      auto* base = static_cast<volatile uint8_t*>(_maps[region]) + offset;
      if (len == 4) {
        uint32_t v = *reinterpret_cast<volatile uint32_t*>(base);
        std::memcpy(data, &v, 4);
      } else {
        uint64_t v = *reinterpret_cast<volatile uint64_t*>(base);
        std::memcpy(data, &v, 8);
      }
      return Status::ok();
    }
  }
  ssize_t n = _sys->pread(_device, data, len, static_cast<off_t>(r->offset + offset));
  if (n < 0) return ERRNO_STATUS("vfio " + _addr + ": read " + region_name(region));
  if (static_cast<size_t>(n) != len)
    return Status::error(Code::io_error, "vfio %s: short read of %s: %zd of %zu bytes", _addr.c_str(),
                         region_name(region), n, len);
  return Status::ok();
}

Status VfioLink::write(uint32_t region, uint64_t offset, const void* data, size_t len) {
  const Region* r = nullptr;
  HCOMM_TRY(region_check(region, offset, len, &r));
  if ((r->flags & VFIO_REGION_INFO_FLAG_WRITE) == 0)
    return Status::error(Code::access_denied, "vfio %s: %s is not writable", _addr.c_str(), region_name(region));
  if (region == VFIO_PCI_BAR0_REGION_INDEX) {
    if ((len != 4 && len != 8) || offset % len != 0)
      return Status::error(Code::invalid_argument, "vfio %s: BAR0 write of %zu bytes at 0x%llx (4 or 8, aligned)",
                           _addr.c_str(), len, static_cast<unsigned long long>(offset));
    if (_maps[region] != nullptr) {
      auto* base = static_cast<volatile uint8_t*>(_maps[region]) + offset;
      if (len == 4) {
        uint32_t v;
        std::memcpy(&v, data, 4);
        *reinterpret_cast<volatile uint32_t*>(base) = v;
      } else {
        uint64_t v;
        std::memcpy(&v, data, 8);
        *reinterpret_cast<volatile uint64_t*>(base) = v;
      }
      return Status::ok();
    }
  }
  ssize_t n = _sys->pwrite(_device, data, len, static_cast<off_t>(r->offset + offset));
  if (n < 0) return ERRNO_STATUS("vfio " + _addr + ": write " + region_name(region));
  if (static_cast<size_t>(n) != len)
    return Status::error(Code::io_error, "vfio %s: short write of %s: %zd of %zu bytes", _addr.c_str(),
                         region_name(region), n, len);
  return Status::ok();
}

Status VfioLink::doorbell(uint64_t bar0_offset, Doorbell* out) {
  // docs/device-abi.md §8: doorbells are 32-bit MMIO words in BAR0.
  const Region* r = nullptr;
  HCOMM_TRY(region_check(VFIO_PCI_BAR0_REGION_INDEX, bar0_offset, 4, &r));
  if (bar0_offset % 4 != 0)
    return Status::error(Code::invalid_argument, "vfio %s: doorbell offset 0x%llx not 4-byte aligned",
                         _addr.c_str(), static_cast<unsigned long long>(bar0_offset));
  *out = Doorbell{};
  if (_maps[VFIO_PCI_BAR0_REGION_INDEX] == nullptr) {
    // VFIO would not mmap BAR0 (e.g. a BAR smaller than a page that does not
    // start on one): the doorbell is a pwrite on the device fd.
    if ((r->flags & VFIO_REGION_INFO_FLAG_WRITE) == 0)
      return Status::error(Code::unsupported, "vfio %s: BAR0 is neither mapped nor writable", _addr.c_str());
    out->pwrite_fd = _device;
    out->pwrite_offset = r->offset + bar0_offset;
    return Status::ok();
  }
  out->mmio = reinterpret_cast<volatile uint32_t*>(static_cast<uint8_t*>(_maps[VFIO_PCI_BAR0_REGION_INDEX]) +
                                                   bar0_offset);
  out->eventfd = -1;
  return Status::ok();
}

Status VfioLink::issue_msix(uint32_t first, uint32_t count, const int* fds) {
  // struct vfio_irq_set is followed by `count` int32 eventfds. uint64_t
  // storage keeps the header aligned.
  const size_t bytes = sizeof(vfio_irq_set) + size_t{count} * sizeof(int32_t);
  std::vector<uint64_t> buf((bytes + 7) / 8, 0);
  auto* set = reinterpret_cast<vfio_irq_set*>(buf.data());
  set->argsz = static_cast<uint32_t>(bytes);
  set->flags = count == 0 ? (VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER)
                          : (VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER);
  set->index = VFIO_PCI_MSIX_IRQ_INDEX;
  set->start = first;
  set->count = count;
  if (count != 0) std::memcpy(set->data, fds, size_t{count} * sizeof(int32_t));
  if (_sys->ioctl(_device, VFIO_DEVICE_SET_IRQS, set) != 0)
    return ERRNO_STATUS("vfio " + _addr + ": VFIO_DEVICE_SET_IRQS(MSI-X " + std::to_string(first) +
                                         "+" + std::to_string(count) + ")");
  return Status::ok();
}

// An empty span disables MSI-X altogether. The eventfds stay owned by the
// caller; the kernel takes its own reference on each.
Status VfioLink::set_msix(uint32_t first_vector, std::span<const int> eventfds) {
  if (_msix_count == 0) return Status::error(Code::unsupported, "vfio %s: device has no MSI-X", _addr.c_str());
  if (eventfds.empty()) {
    if (_msix_enabled == 0) return Status::ok();
    HCOMM_TRY(issue_msix(0, 0, nullptr));
    _msix_enabled = 0;
    _msix_fds.assign(_msix_count, -1);
    return Status::ok();
  }
  if (first_vector >= _msix_count || eventfds.size() > _msix_count - first_vector)
    return Status::error(Code::out_of_range, "vfio %s: MSI-X vectors [%u, +%zu) beyond the device's %u",
                         _addr.c_str(), first_vector, eventfds.size(), _msix_count);
  const auto n = static_cast<uint32_t>(eventfds.size());
  for (uint32_t i = 0; i < n; ++i) _msix_fds[first_vector + i] = eventfds[i];
  const uint32_t end = first_vector + n;
  if (end <= _msix_enabled) return issue_msix(first_vector, n, eventfds.data());
  // Growing the enabled range: vfio-pci (before dynamic MSI-X, Linux 6.5)
  // cannot add vectors to an enabled range, so disable and re-enable
  // [0, end) with every remembered eventfd.
  if (_msix_enabled != 0) {
    HCOMM_TRY(issue_msix(0, 0, nullptr));
    _msix_enabled = 0;
  }
  HCOMM_TRY(issue_msix(0, end, _msix_fds.data()));
  _msix_enabled = end;
  return Status::ok();
}

Status VfioLink::physical_runs(const void* vaddr, uint64_t len, std::vector<PhysRun>* runs) {
  // /proc/self/pagemap: one u64 per 4 KiB virtual page; bit 63 = present,
  // bits 0-54 = PFN (reads as 0 without CAP_SYS_ADMIN).
  runs->clear();
  const int fd = _sys->open(_opts.pagemap_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ERRNO_STATUS("vfio " + _addr + ": iova-mode=pa: open " + _opts.pagemap_path);
  const uint64_t first_page = reinterpret_cast<uintptr_t>(vaddr) / kPage;
  const uint64_t pages = len / kPage;
  uint64_t entries[512];
  Status st;
  for (uint64_t done = 0; done < pages && st.is_ok();) {
    const uint64_t chunk = pages - done < 512 ? pages - done : 512;
    ssize_t n = _sys->pread(fd, entries, chunk * 8, static_cast<off_t>((first_page + done) * 8));
    if (n < 0) {
      st = ERRNO_STATUS("vfio " + _addr + ": iova-mode=pa: read " + _opts.pagemap_path);
      break;
    }
    if (static_cast<uint64_t>(n) != chunk * 8) {
      st = Status::error(Code::io_error, "vfio %s: iova-mode=pa: short read of %s", _addr.c_str(),
                         _opts.pagemap_path.c_str());
      break;
    }
    for (uint64_t i = 0; i < chunk; ++i) {
      const uint64_t e = entries[i];
      const uint64_t at = (done + i) * kPage;
      if ((e >> 63) == 0) {
        st = Status::error(Code::invalid_argument,
                           "vfio %s: iova-mode=pa: page at offset 0x%llx is not present (populate the buffer "
                           "before mapping it)",
                           _addr.c_str(), static_cast<unsigned long long>(at));
        break;
      }
      const uint64_t pfn = e & ((uint64_t{1} << 55) - 1);
      if (pfn == 0) {
        st = Status::error(Code::access_denied,
                           "vfio %s: iova-mode=pa: %s shows PFN 0; physical addresses need CAP_SYS_ADMIN",
                           _addr.c_str(), _opts.pagemap_path.c_str());
        break;
      }
      if (!runs->empty() && runs->back().pa + runs->back().len == pfn * kPage) {
        runs->back().len += kPage;
      } else {
        runs->push_back({at, kPage, pfn * kPage});
      }
    }
    done += chunk;
  }
  _sys->close(fd);
  return st;
}

Status VfioLink::physical_address(const void* vaddr, uint64_t len, uint64_t* pa) {
  std::vector<PhysRun> runs;
  HCOMM_TRY(physical_runs(vaddr, len, &runs));
  if (runs.size() != 1)
    return Status::error(Code::invalid_argument,
                         "vfio %s: iova-mode=pa: buffer is not physically contiguous at offset 0x%llx "
                         "(use a hugepage DmaBuffer, or a device with ATT_SPAN)",
                         _addr.c_str(), static_cast<unsigned long long>(runs.size() > 1 ? runs[1].off : 0));
  *pa = runs[0].pa;
  return Status::ok();
}

// pagemap shows only pages present in this process's page tables: a buffer
// mapped from another process's memfd may not be faulted in yet. Writable
// memory is faulted for write: a read fault on untouched private memory
// maps the shared zero page, whose address is no use.
void VfioLink::populate(uintptr_t start, uint64_t mlen, bool w) {
  if (::madvise(reinterpret_cast<void*>(start), mlen, w ? MADV_POPULATE_WRITE : MADV_POPULATE_READ) != 0) {
    for (uint64_t off = 0; off < mlen; off += kPage) {
      auto* b = reinterpret_cast<volatile uint8_t*>(start + off);
      if (w) *b = *b;
      else (void)*b;
    }
  }
}

Status VfioLink::dma_map_segments(void* vaddr, uint64_t len, int fd, uint64_t fd_offset, uint32_t prot,
                                  std::vector<DmaSegment>* out) {
  if (!_opts.iova_mode_pa || vaddr == nullptr || len == 0) return Link::dma_map_segments(vaddr, len, fd, fd_offset, prot, out);
  const uintptr_t va = reinterpret_cast<uintptr_t>(vaddr);
  if (len > UINTPTR_MAX - va - (kPage - 1))
    return Status::error(Code::invalid_argument, "vfio %s: dma_map range wraps the address space", _addr.c_str());
  const uintptr_t start = va & ~(kPage - 1);
  const uint64_t mlen = (va + len + kPage - 1) / kPage * kPage - start;
  populate(start, mlen, (prot & dma_prot::WRITE) != 0);
  std::vector<PhysRun> runs;
  HCOMM_TRY(physical_runs(reinterpret_cast<void*>(start), mlen, &runs));
  // One mapping per physically contiguous run (each its own IOVA = PA).
  out->clear();
  for (const PhysRun& r : runs) {
    const uintptr_t from = std::max<uintptr_t>(va, start + r.off);
    const uintptr_t to = std::min<uintptr_t>(va + len, start + r.off + r.len);
    DmaSegment seg{0, to - from};
    Status st = dma_map(reinterpret_cast<void*>(from), seg.len, fd, fd_offset + (from - va), prot, &seg.bus_addr);
    if (!st) {
      for (const DmaSegment& d : *out) (void)dma_unmap(d.bus_addr, d.len);
      out->clear();
      return st;
    }
    out->push_back(seg);
  }
  return Status::ok();
}

Status VfioLink::iova_alloc(uint64_t len, uint64_t* iova) {
  if (const std::optional<uint64_t> at = _iova.take(len)) {
    *iova = *at;
    return Status::ok();
  }
  return Status::error(Code::no_resource, "vfio %s: IOVA space exhausted (%llu bytes requested)", _addr.c_str(),
                       static_cast<unsigned long long>(len));
}

void VfioLink::iova_free(uint64_t iova, uint64_t len) {
  // A range given back twice is refused and leaves the free list intact.
  (void)_iova.give(iova, len);
}

// fd / fd_offset are not needed: the kernel pins the pages through vaddr.
Status VfioLink::dma_map(void* vaddr, uint64_t len, int /*fd*/, uint64_t /*fd_offset*/, uint32_t prot,
                         uint64_t* bus_addr) {
  if (vaddr == nullptr || len == 0)
    return Status::error(Code::invalid_argument, "vfio %s: dma_map of an empty range", _addr.c_str());
  if (prot == 0 || (prot & ~(dma_prot::READ | dma_prot::WRITE)) != 0)
    return Status::error(Code::invalid_argument, "vfio %s: dma_map prot 0x%x", _addr.c_str(), prot);
  const uintptr_t va = reinterpret_cast<uintptr_t>(vaddr);
  if (len > UINTPTR_MAX - va - (kPage - 1))
    return Status::error(Code::invalid_argument, "vfio %s: dma_map range wraps the address space", _addr.c_str());
  // The IOMMU maps whole pages: widen to page bounds, hand back the IOVA of
  // the caller's first byte.
  const uintptr_t start = va & ~(kPage - 1);
  const uint64_t mlen = (va + len + kPage - 1) / kPage * kPage - start;
  const uint64_t in_page = va - start;

  Mapping m;
  m.len = mlen;
  m.prot = prot;
  if (_opts.iova_mode_pa) {
    populate(start, mlen, (prot & dma_prot::WRITE) != 0);
    HCOMM_TRY(physical_address(reinterpret_cast<void*>(start), mlen, &m.iova));
    for (auto& [key, o] : _mappings) {
      if (o.iova <= m.iova && m.iova + mlen <= o.iova + o.len) {  // already reachable: a view
        if ((prot & ~o.prot) != 0)
          return Status::error(Code::access_denied,
                               "vfio %s: iova-mode=pa: memory at 0x%llx is already mapped with fewer rights "
                               "(0x%x, asked 0x%x); the same physical memory has one set of rights",
                               _addr.c_str(), static_cast<unsigned long long>(m.iova), o.prot, prot);
        ++o.refs;
        _views.emplace(m.iova + in_page, View{key, len});
        *bus_addr = m.iova + in_page;
        return Status::ok();
      }
      if (m.iova < o.iova + o.len && o.iova < m.iova + mlen)
        return Status::error(Code::invalid_argument,
                             "vfio %s: iova-mode=pa: [0x%llx,+0x%llx) partly overlaps a mapping of the same "
                             "physical memory; map the larger range first",
                             _addr.c_str(), static_cast<unsigned long long>(m.iova),
                             static_cast<unsigned long long>(mlen));
    }
  } else {
    HCOMM_TRY(iova_alloc(mlen, &m.iova));
    m.allocated = true;
  }
  const uint64_t bus = m.iova + in_page;
  if (_mappings.count(bus) != 0) {
    if (m.allocated) iova_free(m.iova, mlen);
    return Status::error(Code::invalid_argument, "vfio %s: bus address 0x%llx is already mapped", _addr.c_str(),
                         static_cast<unsigned long long>(bus));
  }

  if (!_noiommu) {
    // No-IOMMU containers have no MAP_DMA: the device uses the PA directly.
    vfio_iommu_type1_dma_map dm{};
    dm.argsz = sizeof dm;
    dm.flags = ((prot & dma_prot::READ) != 0 ? VFIO_DMA_MAP_FLAG_READ : 0u) |
               ((prot & dma_prot::WRITE) != 0 ? VFIO_DMA_MAP_FLAG_WRITE : 0u);
    dm.vaddr = start;
    dm.iova = m.iova;
    dm.size = mlen;
    if (_sys->ioctl(_container, VFIO_IOMMU_MAP_DMA, &dm) != 0) {
      int err = errno;
      if (m.allocated) iova_free(m.iova, mlen);
      return Status::from_errno(err, "vfio " + _addr + ": VFIO_IOMMU_MAP_DMA " + std::to_string(mlen) +
                                         " bytes" + (err == ENOMEM ? " (RLIMIT_MEMLOCK too low?)" : ""));
    }
    m.via_iommu = true;
  }
  _mappings.emplace(bus, m);
  *bus_addr = bus;
  return Status::ok();
}

Status VfioLink::dma_unmap(uint64_t bus_addr, uint64_t len) {
  for (auto [v, end] = _views.equal_range(bus_addr); v != end; ++v) {
    if (v->second.len != len) continue;
    auto owner = _mappings.find(v->second.owner);
    _views.erase(v);
    return owner != _mappings.end() ? release(owner) : Status::ok();
  }
  auto it = _mappings.find(bus_addr);
  if (it == _mappings.end() || it->second.released)
    return Status::error(Code::not_found, "vfio %s: no DMA mapping at bus address 0x%llx", _addr.c_str(),
                         static_cast<unsigned long long>(bus_addr));
  const Mapping m = it->second;
  const uint64_t in_page = bus_addr - m.iova;
  if (len == 0 || len > m.len - in_page || m.len - in_page - len >= kPage)
    return Status::error(Code::invalid_argument,
                         "vfio %s: dma_unmap of %llu bytes at 0x%llx does not match the mapping (%llu bytes)",
                         _addr.c_str(), static_cast<unsigned long long>(len),
                         static_cast<unsigned long long>(bus_addr), static_cast<unsigned long long>(m.len));
  it->second.released = true;
  return release(it);
}

Status VfioLink::release(std::map<uint64_t, Mapping>::iterator it) {
  if (--it->second.refs > 0) return Status::ok();  // views still use it
  const Mapping m = it->second;
  if (m.via_iommu) {
    vfio_iommu_type1_dma_unmap um{};
    um.argsz = sizeof um;
    um.iova = m.iova;
    um.size = m.len;
    if (_sys->ioctl(_container, VFIO_IOMMU_UNMAP_DMA, &um) != 0)
      return ERRNO_STATUS("vfio " + _addr + ": VFIO_IOMMU_UNMAP_DMA");
    // The kernel reports how much it unmapped; less means the mapping table
    // and ours disagree, and the pages may stay pinned.
    if (um.size != m.len)
      return Status::error(Code::io_error, "vfio %s: VFIO_IOMMU_UNMAP_DMA unmapped %llu of %llu bytes",
                           _addr.c_str(), static_cast<unsigned long long>(um.size),
                           static_cast<unsigned long long>(m.len));
  }
  if (m.allocated) iova_free(m.iova, m.len);
  _mappings.erase(it);
  return Status::ok();
}

Status VfioLink::reset() {
  if ((_device_flags & VFIO_DEVICE_FLAGS_RESET) == 0)
    return Status::error(Code::unsupported, "vfio %s: device does not support VFIO_DEVICE_RESET", _addr.c_str());
  if (_sys->ioctl(_device, VFIO_DEVICE_RESET, nullptr) != 0)
    return ERRNO_STATUS("vfio " + _addr + ": VFIO_DEVICE_RESET");
  return Status::ok();
}

Status open_vfio(const std::string& pci_addr, const VfioOptions& opts, std::unique_ptr<Link>* out) {
  PciFunction fn;
  HCOMM_TRY(PciScanner(opts.sysfs_root).read_function(pci_addr, &fn));
  if (fn.driver != "vfio-pci")
    return Status::error(Code::invalid_argument,
                         "vfio %s: function is %s%s%s, not bound to vfio-pci (PciScanner::bind_to_driver)",
                         pci_addr.c_str(), fn.driver.empty() ? "unbound" : "bound to '", fn.driver.c_str(),
                         fn.driver.empty() ? "" : "'");
  if (fn.iommu_group < 0)
    return Status::error(Code::not_found,
                         "vfio %s: no IOMMU group in sysfs (IOMMU disabled? intel_iommu=on / amd_iommu, or "
                         "vfio enable_unsafe_noiommu_mode with iova_mode_pa)",
                         pci_addr.c_str());
  std::unique_ptr<VfioLink> link;
  HCOMM_TRY(VfioLink::open(pci_addr, fn.iommu_group, opts, &link));
  *out = std::move(link);
  return Status::ok();
}

}  // namespace hcomm::driver
