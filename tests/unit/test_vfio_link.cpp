// VfioLink against a fake kernel: the order and arguments of every VFIO
// ioctl, error paths, and BAR0 access through a fake mmap buffer.
#include "driver/vfio_link.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/pci_regs.h>
#include <linux/vfio.h>
#include <stdlib.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <vector>

#include "hal/abi/regs.h"

namespace hcomm::driver {
namespace {

namespace fs = std::filesystem;
namespace abi = hal::abi;

constexpr int kContainerFd = 10;
constexpr int kGroupFd = 11;
constexpr int kDeviceFd = 12;
constexpr int kPagemapFd = 13;
constexpr uint64_t kBar2Offset = uint64_t{2} << 40;
constexpr uint64_t kBar4Offset = uint64_t{4} << 40;
constexpr uint64_t kConfigOffset = uint64_t{7} << 40;
constexpr uint64_t kBar2Size = 1 << 20;
const char* kAddr = "0000:00:05.0";

struct IrqSet {
  uint32_t argsz, flags, index, start, count;
  std::vector<int> fds;
};

// A fake /dev/vfio: one container, group 12, one device with BAR0 (8 KiB,
// mmapable unless told otherwise), BAR2 (1 MiB, mmapable), BAR4 (4 KiB,
// trapped) and a 256-byte config space. Every call is logged.
class FakeKernel final : public VfioSys {
 public:
  // ---- knobs
  int api_version = VFIO_API_VERSION;
  std::set<uintptr_t> extensions = {VFIO_TYPE1_IOMMU, VFIO_TYPE1v2_IOMMU};
  bool viable = true;
  bool normal_group = true;   // /dev/vfio/12 exists
  bool noiommu_group = false; // /dev/vfio/noiommu-12 exists
  int group_errno = 0;        // open of the group fails with this
  bool bar0_mmapable = true;
  uint32_t msix = 16;
  uint32_t device_flags = VFIO_DEVICE_FLAGS_PCI | VFIO_DEVICE_FLAGS_RESET;
  uint64_t pgsizes = 0x40201000;  // 4 KiB | 2 MiB | 1 GiB
  unsigned long fail_request = 0;
  int fail_errno = 0;
  std::map<uint64_t, uint64_t> pagemap;  // virtual page number -> entry

  // ---- observed
  std::vector<std::string> calls;
  std::vector<vfio_iommu_type1_dma_map> maps;
  std::vector<vfio_iommu_type1_dma_unmap> unmaps;
  std::vector<IrqSet> irq_sets;
  int resets = 0;
  std::set<int> open_fds;
  alignas(64) uint8_t bar0[abi::kBar0Size] = {};
  alignas(64) uint8_t bar4[0x1000] = {};
  uint8_t config[256] = {};
  std::vector<uint8_t> hbm = std::vector<uint8_t>(kBar2Size);

  int open(const char* path, int /*flags*/) override {
    std::string p(path);
    calls.push_back("open " + p);
    int fd = -1;
    if (p == "/fake/vfio/vfio") {
      fd = kContainerFd;
    } else if (p == "/fake/vfio/12" && group_errno != 0) {
      errno = group_errno;
      return -1;
    } else if ((p == "/fake/vfio/12" && normal_group) || (p == "/fake/vfio/noiommu-12" && noiommu_group)) {
      fd = kGroupFd;
    } else if (p == "/fake/pagemap") {
      fd = kPagemapFd;
    }
    if (fd < 0) {
      errno = ENOENT;
      return -1;
    }
    open_fds.insert(fd);
    return fd;
  }
  int close(int fd) override {
    calls.push_back("close " + std::to_string(fd));
    if (open_fds.erase(fd) == 0) {
      ADD_FAILURE() << "close of fd " << fd << " that is not open";
      errno = EBADF;
      return -1;
    }
    return 0;
  }
  int ioctl(int fd, unsigned long req, void* arg) override {
    std::string what = name(req, arg);
    calls.push_back("ioctl " + std::to_string(fd) + " " + what);
    if (open_fds.count(fd) == 0) ADD_FAILURE() << what << " on fd " << fd << " that is not open";
    if (req == fail_request) {
      errno = fail_errno;
      return -1;
    }
    switch (req) {
      case VFIO_GET_API_VERSION: return api_version;
      case VFIO_CHECK_EXTENSION: return extensions.count(reinterpret_cast<uintptr_t>(arg)) ? 1 : 0;
      case VFIO_GROUP_GET_STATUS:
        static_cast<vfio_group_status*>(arg)->flags = viable ? VFIO_GROUP_FLAGS_VIABLE : 0;
        return 0;
      case VFIO_GROUP_SET_CONTAINER:
      case VFIO_SET_IOMMU: return 0;
      case VFIO_IOMMU_GET_INFO: {
        auto* ii = static_cast<vfio_iommu_type1_info*>(arg);
        ii->flags = VFIO_IOMMU_INFO_PGSIZES;
        ii->iova_pgsizes = pgsizes;
        return 0;
      }
      case VFIO_GROUP_GET_DEVICE_FD:
        open_fds.insert(kDeviceFd);
        return kDeviceFd;
      case VFIO_DEVICE_GET_INFO: {
        auto* di = static_cast<vfio_device_info*>(arg);
        di->flags = device_flags;
        di->num_regions = VFIO_PCI_NUM_REGIONS;
        di->num_irqs = VFIO_PCI_NUM_IRQS;
        return 0;
      }
      case VFIO_DEVICE_GET_REGION_INFO: return region_info(static_cast<vfio_region_info*>(arg));
      case VFIO_DEVICE_GET_IRQ_INFO: {
        auto* ii = static_cast<vfio_irq_info*>(arg);
        ii->flags = VFIO_IRQ_INFO_EVENTFD;
        ii->count = ii->index == VFIO_PCI_MSIX_IRQ_INDEX ? msix : 1;
        return 0;
      }
      case VFIO_DEVICE_SET_IRQS: {
        auto* s = static_cast<vfio_irq_set*>(arg);
        IrqSet r{s->argsz, s->flags, s->index, s->start, s->count, {}};
        if ((s->flags & VFIO_IRQ_SET_DATA_EVENTFD) != 0) {
          r.fds.resize(s->count);
          std::memcpy(r.fds.data(), s->data, s->count * sizeof(int));
        }
        irq_sets.push_back(r);
        return 0;
      }
      case VFIO_IOMMU_MAP_DMA: maps.push_back(*static_cast<vfio_iommu_type1_dma_map*>(arg)); return 0;
      case VFIO_IOMMU_UNMAP_DMA: unmaps.push_back(*static_cast<vfio_iommu_type1_dma_unmap*>(arg)); return 0;
      case VFIO_DEVICE_RESET: ++resets; return 0;
    }
    errno = ENOTTY;
    return -1;
  }
  void* mmap(void*, size_t len, int prot, int flags, int fd, off_t off) override {
    calls.push_back("mmap " + std::to_string(fd) + " " + std::to_string(off) + " " + std::to_string(len));
    EXPECT_EQ(prot, PROT_READ | PROT_WRITE);
    EXPECT_EQ(flags, MAP_SHARED);
    if (fd == kDeviceFd && off == 0 && len == sizeof bar0) return bar0;
    if (fd == kDeviceFd && static_cast<uint64_t>(off) == kBar2Offset && len == kBar2Size) return hbm.data();
    errno = EINVAL;
    return MAP_FAILED;
  }
  int munmap(void* addr, size_t len) override {
    calls.push_back(std::string("munmap ") + (addr == bar0 ? "bar0" : addr == hbm.data() ? "hbm" : "?") + " " +
                    std::to_string(len));
    return 0;
  }
  ssize_t pread(int fd, void* buf, size_t len, off_t off) override {
    calls.push_back("pread " + std::to_string(fd) + " " + hex(off) + " " + std::to_string(len));
    if (fd == kPagemapFd) {
      auto* e = static_cast<uint64_t*>(buf);
      for (size_t i = 0; i < len / 8; ++i) {
        auto it = pagemap.find(static_cast<uint64_t>(off) / 8 + i);
        e[i] = it == pagemap.end() ? 0 : it->second;
      }
      return static_cast<ssize_t>(len);
    }
    uint8_t* p = backing(off, len);
    if (p == nullptr) {
      errno = EINVAL;
      return -1;
    }
    std::memcpy(buf, p, len);
    return static_cast<ssize_t>(len);
  }
  ssize_t pwrite(int fd, const void* buf, size_t len, off_t off) override {
    calls.push_back("pwrite " + std::to_string(fd) + " " + hex(off) + " " + std::to_string(len));
    uint8_t* p = backing(off, len);
    if (p == nullptr) {
      errno = EINVAL;
      return -1;
    }
    std::memcpy(p, buf, len);
    return static_cast<ssize_t>(len);
  }

  uint16_t command() const {
    uint16_t v;
    std::memcpy(&v, config + PCI_COMMAND, 2);
    return v;
  }
  size_t count(const std::string& prefix) const {
    size_t n = 0;
    for (const auto& c : calls) n += c.rfind(prefix, 0) == 0;
    return n;
  }

 private:
  static std::string hex(off_t v) {
    char b[32];
    std::snprintf(b, sizeof b, "0x%llx", static_cast<unsigned long long>(v));
    return b;
  }
  uint8_t* backing(off_t off, size_t len) {
    auto o = static_cast<uint64_t>(off);
    if (o >= kConfigOffset && o + len <= kConfigOffset + sizeof config) return config + (o - kConfigOffset);
    if (o + len <= sizeof bar0) return bar0 + o;
    if (o >= kBar4Offset && o + len <= kBar4Offset + sizeof bar4) return bar4 + (o - kBar4Offset);
    return nullptr;
  }
  int region_info(vfio_region_info* ri) {
    const uint32_t rw = VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE;
    ri->size = 0;
    ri->offset = uint64_t{ri->index} << 40;
    ri->flags = 0;
    switch (ri->index) {
      case VFIO_PCI_BAR0_REGION_INDEX:
        ri->size = sizeof bar0;
        ri->flags = rw | (bar0_mmapable ? VFIO_REGION_INFO_FLAG_MMAP : 0);
        break;
      case VFIO_PCI_BAR2_REGION_INDEX:
        ri->size = kBar2Size;
        ri->flags = rw | VFIO_REGION_INFO_FLAG_MMAP;
        break;
      case VFIO_PCI_BAR4_REGION_INDEX:
        ri->size = sizeof bar4;
        ri->flags = rw;
        break;
      case VFIO_PCI_CONFIG_REGION_INDEX:
        ri->size = sizeof config;
        ri->flags = rw;
        break;
      case VFIO_PCI_VGA_REGION_INDEX: errno = EINVAL; return -1;  // as vfio-pci without VGA
      default: break;
    }
    return 0;
  }
  static std::string name(unsigned long req, void* arg) {
    switch (req) {
      case VFIO_GET_API_VERSION: return "GET_API_VERSION";
      case VFIO_CHECK_EXTENSION: return "CHECK_EXTENSION " + std::to_string(reinterpret_cast<uintptr_t>(arg));
      case VFIO_GROUP_GET_STATUS: return "GROUP_GET_STATUS";
      case VFIO_GROUP_SET_CONTAINER: return "GROUP_SET_CONTAINER " + std::to_string(*static_cast<int*>(arg));
      case VFIO_SET_IOMMU: return "SET_IOMMU " + std::to_string(reinterpret_cast<uintptr_t>(arg));
      case VFIO_IOMMU_GET_INFO: return "IOMMU_GET_INFO";
      case VFIO_GROUP_GET_DEVICE_FD: return std::string("GROUP_GET_DEVICE_FD ") + static_cast<char*>(arg);
      case VFIO_DEVICE_GET_INFO: return "DEVICE_GET_INFO";
      case VFIO_DEVICE_GET_REGION_INFO:
        return "GET_REGION_INFO " + std::to_string(static_cast<vfio_region_info*>(arg)->index);
      case VFIO_DEVICE_GET_IRQ_INFO: return "GET_IRQ_INFO " + std::to_string(static_cast<vfio_irq_info*>(arg)->index);
      case VFIO_DEVICE_SET_IRQS: return "SET_IRQS";
      case VFIO_IOMMU_MAP_DMA: return "MAP_DMA";
      case VFIO_IOMMU_UNMAP_DMA: return "UNMAP_DMA";
      case VFIO_DEVICE_RESET: return "DEVICE_RESET";
    }
    return "unknown " + std::to_string(req);
  }
};

class VfioLinkTest : public ::testing::Test {
 protected:
  VfioOptions options() {
    VfioOptions o;
    o.vfio_dir = "/fake/vfio";
    o.pagemap_path = "/fake/pagemap";
    o.sys = &kernel;
    return o;
  }
  Status open(const VfioOptions& o) { return VfioLink::open(kAddr, 12, o, &link); }
  Status open() { return open(options()); }

  FakeKernel kernel;
  std::unique_ptr<VfioLink> link;
};

TEST_F(VfioLinkTest, BringUpFollowsVfioRstOrder) {
  ASSERT_TRUE(open().is_ok());
  const std::vector<std::string> want = {
      "open /fake/vfio/vfio",
      "ioctl 10 GET_API_VERSION",
      "open /fake/vfio/12",
      "ioctl 10 CHECK_EXTENSION 3",  // Type1v2
      "ioctl 11 GROUP_GET_STATUS",
      "ioctl 11 GROUP_SET_CONTAINER 10",
      "ioctl 10 SET_IOMMU 3",
      "ioctl 10 IOMMU_GET_INFO",
      "ioctl 11 GROUP_GET_DEVICE_FD 0000:00:05.0",
      "ioctl 12 DEVICE_GET_INFO",
      "ioctl 12 GET_REGION_INFO 0",
      "ioctl 12 GET_REGION_INFO 1",
      "ioctl 12 GET_REGION_INFO 2",
      "ioctl 12 GET_REGION_INFO 3",
      "ioctl 12 GET_REGION_INFO 4",
      "ioctl 12 GET_REGION_INFO 5",
      "ioctl 12 GET_REGION_INFO 6",
      "ioctl 12 GET_REGION_INFO 7",
      "ioctl 12 GET_REGION_INFO 8",
      "ioctl 12 GET_IRQ_INFO 2",  // MSI-X
      "pread 12 0x70000000004 2",  // PCI_COMMAND
      "pwrite 12 0x70000000004 2",
      "mmap 12 0 8192",  // BAR0
  };
  EXPECT_EQ(kernel.calls, want);
  EXPECT_EQ(kernel.command() & (PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER), PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER);
  EXPECT_EQ(link->iommu_type(), VFIO_TYPE1v2_IOMMU);
  EXPECT_FALSE(link->noiommu());
  EXPECT_TRUE(link->bar0_mmapped());
  EXPECT_EQ(link->msix_count(), 16u);
  EXPECT_STREQ(link->kind(), "vfio");
  EXPECT_EQ(link->location(), kAddr);

  kernel.calls.clear();
  link.reset();
  const std::vector<std::string> teardown = {"pread 12 0x70000000004 2", "pwrite 12 0x70000000004 2",
                                             "munmap bar0 8192", "close 12", "close 11", "close 10"};
  EXPECT_EQ(kernel.calls, teardown);
  EXPECT_EQ(kernel.command() & PCI_COMMAND_MASTER, 0);  // bus mastering off before anything is unmapped
  EXPECT_NE(kernel.command() & PCI_COMMAND_MEMORY, 0);
  EXPECT_TRUE(kernel.open_fds.empty());
}

TEST_F(VfioLinkTest, BusMasterAlreadySetIsNotRewritten) {
  uint16_t cmd = PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER | PCI_COMMAND_INTX_DISABLE;
  std::memcpy(kernel.config + PCI_COMMAND, &cmd, 2);
  ASSERT_TRUE(open().is_ok());
  EXPECT_EQ(kernel.count("pwrite"), 0u);
  EXPECT_EQ(kernel.command(), cmd);
}

TEST_F(VfioLinkTest, FallsBackToType1) {
  kernel.extensions = {VFIO_TYPE1_IOMMU};
  ASSERT_TRUE(open().is_ok());
  EXPECT_EQ(link->iommu_type(), VFIO_TYPE1_IOMMU);
  EXPECT_EQ(kernel.count("ioctl 10 SET_IOMMU 1"), 1u);
}

TEST_F(VfioLinkTest, NoTypeOneIommuIsUnsupported) {
  kernel.extensions = {};
  Status st = open();
  EXPECT_EQ(st.code(), Code::unsupported);
  EXPECT_NE(st.message().find("neither Type1v2 nor Type1"), std::string::npos) << st.message();
  EXPECT_TRUE(kernel.open_fds.empty());
}

TEST_F(VfioLinkTest, ApiVersionMismatch) {
  kernel.api_version = 1;
  Status st = open();
  EXPECT_EQ(st.code(), Code::unsupported);
  EXPECT_NE(st.message().find("kernel VFIO API version 1, this driver speaks 0"), std::string::npos)
      << st.message();
  EXPECT_EQ(kernel.count("open /fake/vfio/12"), 0u);  // stopped before touching the group
  EXPECT_TRUE(kernel.open_fds.empty());
  EXPECT_EQ(link, nullptr);
}

TEST_F(VfioLinkTest, GroupNotViable) {
  kernel.viable = false;
  Status st = open();
  EXPECT_EQ(st.code(), Code::unsupported);
  EXPECT_NE(st.message().find("IOMMU group 12 is not viable"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("/sys/kernel/iommu_groups/12/devices"), std::string::npos) << st.message();
  EXPECT_EQ(kernel.count("ioctl 11 GROUP_SET_CONTAINER"), 0u);
  EXPECT_TRUE(kernel.open_fds.empty());
}

TEST_F(VfioLinkTest, GroupOpenErrorsCarryErrnoAndHint) {
  kernel.group_errno = EBUSY;
  Status st = open();
  EXPECT_EQ(st.code(), Code::io_error);
  EXPECT_NE(st.message().find("open group /fake/vfio/12"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("Device or resource busy"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("another process"), std::string::npos) << st.message();

  kernel.group_errno = 0;
  kernel.normal_group = false;
  st = open();
  EXPECT_NE(st.message().find("open group /fake/vfio/12: No such file or directory"), std::string::npos)
      << st.message();
  EXPECT_TRUE(kernel.open_fds.empty());
}

TEST_F(VfioLinkTest, IoctlFailureSurfacesWithName) {
  kernel.fail_request = VFIO_GROUP_GET_DEVICE_FD;
  kernel.fail_errno = ENODEV;
  Status st = open();
  EXPECT_EQ(st.code(), Code::io_error);
  EXPECT_NE(st.message().find("VFIO_GROUP_GET_DEVICE_FD"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("No such device"), std::string::npos) << st.message();
  EXPECT_TRUE(kernel.open_fds.empty());
}

TEST_F(VfioLinkTest, IommuWithoutFourKPagesIsRefused) {
  kernel.pgsizes = 0x10000;  // 64 KiB only
  Status st = open();
  EXPECT_EQ(st.code(), Code::unsupported);
  EXPECT_NE(st.message().find("smallest page is 65536"), std::string::npos) << st.message();
}

TEST_F(VfioLinkTest, NonPciDeviceIsRefused) {
  kernel.device_flags = VFIO_DEVICE_FLAGS_PLATFORM;
  EXPECT_EQ(open().code(), Code::unsupported);
}

TEST_F(VfioLinkTest, Bar0RegistersThroughMmap) {
  ASSERT_TRUE(open().is_ok());
  kernel.calls.clear();
  ASSERT_TRUE(link->write32(abi::reg::SCRATCH, 0xdeadbeef).is_ok());
  uint32_t v32;
  std::memcpy(&v32, kernel.bar0 + abi::reg::SCRATCH, 4);
  EXPECT_EQ(v32, 0xdeadbeefu);

  const uint64_t hbm = uint64_t{16} << 30;
  std::memcpy(kernel.bar0 + abi::reg::HBM_SIZE, &hbm, 8);
  uint64_t v64 = 0;
  ASSERT_TRUE(link->read64(abi::reg::HBM_SIZE, &v64).is_ok());
  EXPECT_EQ(v64, hbm);
  ASSERT_TRUE(link->write64(abi::reg::ATT_IOVA, 0x1122334455667788ull).is_ok());
  std::memcpy(&v64, kernel.bar0 + abi::reg::ATT_IOVA, 8);
  EXPECT_EQ(v64, 0x1122334455667788ull);
  EXPECT_TRUE(kernel.calls.empty()) << "BAR0 access must not trap when mapped: " << kernel.calls.front();

  uint16_t v16;
  EXPECT_EQ(link->read(0, 0, &v16, 2).code(), Code::invalid_argument);
  EXPECT_EQ(link->read32(2, &v32).code(), Code::invalid_argument);
  EXPECT_EQ(link->read32(abi::kBar0Size, &v32).code(), Code::out_of_range);
  EXPECT_EQ(link->read64(abi::kBar0Size - 4, &v64).code(), Code::out_of_range);
  EXPECT_EQ(link->read32(UINT64_MAX - 1, &v32).code(), Code::out_of_range);
}

TEST_F(VfioLinkTest, Bar0TrappedWhenNotMmapable) {
  kernel.bar0_mmapable = false;
  ASSERT_TRUE(open().is_ok());
  EXPECT_FALSE(link->bar0_mmapped());
  EXPECT_EQ(kernel.count("mmap"), 0u);
  ASSERT_TRUE(link->write32(abi::reg::SCRATCH, 0x5a5a5a5a).is_ok());
  char want[64];
  std::snprintf(want, sizeof want, "pwrite 12 0x%x 4", abi::reg::SCRATCH);  // BAR0 region offset is 0
  EXPECT_EQ(kernel.calls.back(), want);
  uint32_t v = 0;
  ASSERT_TRUE(link->read32(abi::reg::SCRATCH, &v).is_ok());
  std::snprintf(want, sizeof want, "pread 12 0x%x 4", abi::reg::SCRATCH);
  EXPECT_EQ(kernel.calls.back(), want);
  EXPECT_EQ(v, 0x5a5a5a5au);
  // Without a mapping the doorbell is a pwrite on the device fd, at the
  // BAR0 region offset (0 here) plus the doorbell's.
  Doorbell db;
  ASSERT_TRUE(link->doorbell(abi::reg::doorbell(1), &db).is_ok());
  EXPECT_EQ(db.mmio, nullptr);
  EXPECT_EQ(db.pwrite_fd, 12);
  EXPECT_EQ(db.pwrite_offset, abi::reg::doorbell(1));
  EXPECT_EQ(link->doorbell(abi::reg::doorbell(0) + 2, &db).code(), Code::invalid_argument);
}

TEST_F(VfioLinkTest, OtherRegionsTrappedAndMapped) {
  ASSERT_TRUE(open().is_ok());
  uint32_t v = 0x01020304;
  ASSERT_TRUE(link->write(4, 0x10, &v, 4).is_ok());  // BAR4: pwrite at its region offset
  EXPECT_EQ(kernel.calls.back(), "pwrite 12 0x40000000010 4");
  EXPECT_EQ(kernel.bar4[0x10], 0x04);

  RegionInfo ri;
  ASSERT_TRUE(link->region_info(2, &ri).is_ok());
  EXPECT_EQ(ri.size, kBar2Size);
  EXPECT_TRUE(ri.mmapable && ri.readable && ri.writable);
  void* p = nullptr;
  uint64_t size = 0;
  ASSERT_TRUE(link->map_region(2, &p, &size).is_ok());
  EXPECT_EQ(p, kernel.hbm.data());
  EXPECT_EQ(size, kBar2Size);
  void* again = nullptr;
  ASSERT_TRUE(link->map_region(2, &again, &size).is_ok());
  EXPECT_EQ(again, p);
  EXPECT_EQ(kernel.count("mmap 12 " + std::to_string(kBar2Offset)), 1u);

  EXPECT_EQ(link->map_region(4, &p, &size).code(), Code::unsupported);
  EXPECT_EQ(link->region_info(1, &ri).code(), Code::not_found);  // BAR1 absent
  EXPECT_EQ(link->region_info(8, &ri).code(), Code::not_found);  // VGA: EINVAL tolerated
  EXPECT_EQ(link->region_info(99, &ri).code(), Code::not_found);
  link.reset();
  EXPECT_EQ(kernel.count("munmap hbm"), 1u);
}

TEST_F(VfioLinkTest, DoorbellWritesLandInBar0Mapping) {
  ASSERT_TRUE(open().is_ok());
  Doorbell db;
  ASSERT_TRUE(link->doorbell(abi::reg::doorbell(3), &db).is_ok());
  EXPECT_EQ(db.eventfd, -1);
  EXPECT_EQ(reinterpret_cast<uint8_t*>(const_cast<uint32_t*>(db.mmio)), kernel.bar0 + abi::reg::doorbell(3));
  db.ring(42);
  uint32_t v;
  std::memcpy(&v, kernel.bar0 + abi::reg::doorbell(3), 4);
  EXPECT_EQ(v, 42u);
  EXPECT_EQ(link->doorbell(abi::reg::doorbell(3) + 2, &db).code(), Code::invalid_argument);
  EXPECT_EQ(link->doorbell(abi::kBar0Size, &db).code(), Code::out_of_range);
}

TEST_F(VfioLinkTest, MapDmaArgumentsAndIovaAllocator) {
  VfioOptions o = options();
  o.iova_base = 0x100000;
  ASSERT_TRUE(open(o).is_ok());
  alignas(4096) static uint8_t buf[4 * 4096];

  uint64_t a = 0, b = 0, c = 0;
  ASSERT_TRUE(link->dma_map(buf, 8192, -1, 0, dma_prot::READ | dma_prot::WRITE, &a).is_ok());
  ASSERT_EQ(kernel.maps.size(), 1u);
  const vfio_iommu_type1_dma_map& m = kernel.maps[0];
  EXPECT_EQ(m.argsz, sizeof(vfio_iommu_type1_dma_map));
  EXPECT_EQ(m.flags, VFIO_DMA_MAP_FLAG_READ | VFIO_DMA_MAP_FLAG_WRITE);
  EXPECT_EQ(m.vaddr, reinterpret_cast<uintptr_t>(buf));
  EXPECT_EQ(m.iova, 0x100000u);
  EXPECT_EQ(m.size, 8192u);
  EXPECT_EQ(a, 0x100000u);
  EXPECT_EQ(kernel.calls.back(), "ioctl 10 MAP_DMA");

  // Unaligned: the whole page is mapped, the bus address keeps the offset.
  ASSERT_TRUE(link->dma_map(buf + 2 * 4096 + 100, 10, -1, 0, dma_prot::READ, &b).is_ok());
  EXPECT_EQ(kernel.maps[1].flags, VFIO_DMA_MAP_FLAG_READ);
  EXPECT_EQ(kernel.maps[1].vaddr, reinterpret_cast<uintptr_t>(buf + 2 * 4096));
  EXPECT_EQ(kernel.maps[1].size, 4096u);
  EXPECT_EQ(kernel.maps[1].iova, 0x102000u);
  EXPECT_EQ(b, 0x102000u + 100);

  // Unmap the first, and its IOVA is handed out again (first fit).
  ASSERT_TRUE(link->dma_unmap(a, 8192).is_ok());
  ASSERT_EQ(kernel.unmaps.size(), 1u);
  EXPECT_EQ(kernel.unmaps[0].argsz, sizeof(vfio_iommu_type1_dma_unmap));
  EXPECT_EQ(kernel.unmaps[0].iova, 0x100000u);
  EXPECT_EQ(kernel.unmaps[0].size, 8192u);
  ASSERT_TRUE(link->dma_map(buf, 4096, -1, 0, dma_prot::WRITE, &c).is_ok());
  EXPECT_EQ(c, 0x100000u);
  EXPECT_EQ(kernel.maps[2].flags, VFIO_DMA_MAP_FLAG_WRITE);

  EXPECT_EQ(link->dma_unmap(0xdead000, 4096).code(), Code::not_found);
  EXPECT_EQ(link->dma_unmap(b, 5000).code(), Code::invalid_argument);
  EXPECT_EQ(link->dma_map(buf, 4096, -1, 0, 0, &c).code(), Code::invalid_argument);
  EXPECT_EQ(link->dma_map(buf, 0, -1, 0, dma_prot::READ, &c).code(), Code::invalid_argument);
  EXPECT_EQ(link->dma_map(nullptr, 4096, -1, 0, dma_prot::READ, &c).code(), Code::invalid_argument);

  // Destructor stops bus mastering, then unmaps what is left (b and c).
  kernel.calls.clear();
  link.reset();
  EXPECT_EQ(kernel.unmaps.size(), 3u);
  ASSERT_GE(kernel.calls.size(), 4u);
  EXPECT_EQ(kernel.calls[1], "pwrite 12 0x70000000004 2");
  EXPECT_EQ(kernel.calls[2], "ioctl 10 UNMAP_DMA");
  EXPECT_EQ(kernel.calls[3], "ioctl 10 UNMAP_DMA");
}

TEST_F(VfioLinkTest, MapDmaFailureFreesIovaAndExplains) {
  ASSERT_TRUE(open().is_ok());
  alignas(4096) static uint8_t buf[4096];
  kernel.fail_request = VFIO_IOMMU_MAP_DMA;
  kernel.fail_errno = ENOMEM;
  uint64_t bus = 0;
  Status st = link->dma_map(buf, 4096, -1, 0, dma_prot::READ, &bus);
  EXPECT_EQ(st.code(), Code::io_error);
  EXPECT_NE(st.message().find("RLIMIT_MEMLOCK"), std::string::npos) << st.message();
  kernel.fail_request = 0;
  ASSERT_TRUE(link->dma_map(buf, 4096, -1, 0, dma_prot::READ, &bus).is_ok());
  EXPECT_EQ(bus, VfioOptions{}.iova_base);
}

TEST_F(VfioLinkTest, IovaExhaustionIsBackPressure) {
  VfioOptions o = options();
  o.iova_base = 0x10000;
  o.iova_limit = 0x12000;  // two pages
  ASSERT_TRUE(open(o).is_ok());
  alignas(4096) static uint8_t buf[3 * 4096];
  uint64_t a, b;
  ASSERT_TRUE(link->dma_map(buf, 8192, -1, 0, dma_prot::READ, &a).is_ok());
  EXPECT_EQ(link->dma_map(buf + 8192, 4096, -1, 0, dma_prot::READ, &b).code(), Code::no_resource);
  ASSERT_TRUE(link->dma_unmap(a, 8192).is_ok());
  ASSERT_TRUE(link->dma_map(buf + 8192, 4096, -1, 0, dma_prot::READ, &b).is_ok());
  EXPECT_EQ(b, 0x10000u);

  o.iova_base = 0;
  EXPECT_EQ(VfioLink::open(kAddr, 12, o, &link).code(), Code::invalid_argument);
}

TEST_F(VfioLinkTest, IovaModePaUsesPagemap) {
  VfioOptions o = options();
  o.iova_mode_pa = true;
  ASSERT_TRUE(open(o).is_ok());
  alignas(4096) static uint8_t buf[3 * 4096];
  const uint64_t vpn = reinterpret_cast<uintptr_t>(buf) / 4096;
  const uint64_t present = uint64_t{1} << 63;
  const uint64_t pfn = 0x7654300;
  for (uint64_t i = 0; i < 3; ++i) kernel.pagemap[vpn + i] = present | (pfn + i);

  uint64_t bus = 0;
  ASSERT_TRUE(link->dma_map(buf + 8, 3 * 4096 - 8, -1, 0, dma_prot::READ | dma_prot::WRITE, &bus).is_ok());
  EXPECT_EQ(bus, pfn * 4096 + 8);
  ASSERT_EQ(kernel.maps.size(), 1u);
  EXPECT_EQ(kernel.maps[0].iova, pfn * 4096);  // with an IOMMU, PA is mapped 1:1
  EXPECT_EQ(kernel.maps[0].size, 3u * 4096);
  EXPECT_EQ(kernel.count("pread 13 "), 1u);  // one chunked pagemap read
  EXPECT_EQ(kernel.count("close 13"), 1u);
  // The same memory mapped again (another view of a shared buffer) has the
  // same bus address: it shares the mapping, and the last unmap removes it.
  uint64_t bus2 = 0;
  ASSERT_TRUE(link->dma_map(buf + 8, 3 * 4096 - 8, -1, 0, dma_prot::READ, &bus2).is_ok());
  EXPECT_EQ(bus2, bus);
  EXPECT_EQ(kernel.maps.size(), 1u);
  // A sub-range shares it too, whichever is unmapped first.
  uint64_t bus3 = 0;
  ASSERT_TRUE(link->dma_map(buf + 4096, 100, -1, 0, dma_prot::READ, &bus3).is_ok());
  EXPECT_EQ(bus3, pfn * 4096 + 4096);
  EXPECT_EQ(kernel.maps.size(), 1u);
  ASSERT_TRUE(link->dma_unmap(bus, 3 * 4096 - 8).is_ok());
  ASSERT_TRUE(link->dma_unmap(bus, 3 * 4096 - 8).is_ok());
  EXPECT_TRUE(kernel.unmaps.empty()) << "the sub-range still needs the IOMMU mapping";
  EXPECT_EQ(link->dma_unmap(bus, 3 * 4096 - 8).code(), Code::not_found);
  ASSERT_TRUE(link->dma_unmap(bus3, 100).is_ok());
  EXPECT_EQ(kernel.unmaps.size(), 1u);

  kernel.pagemap[vpn + 2] = present | (pfn + 7);
  Status st = link->dma_map(buf, 3 * 4096, -1, 0, dma_prot::READ, &bus);
  EXPECT_EQ(st.code(), Code::invalid_argument);
  EXPECT_NE(st.message().find("not physically contiguous at offset 0x2000"), std::string::npos) << st.message();

  kernel.pagemap[vpn + 1] = present;  // PFN hidden
  st = link->dma_map(buf, 3 * 4096, -1, 0, dma_prot::READ, &bus);
  EXPECT_EQ(st.code(), Code::access_denied);
  EXPECT_NE(st.message().find("CAP_SYS_ADMIN"), std::string::npos) << st.message();

  kernel.pagemap.erase(vpn);
  st = link->dma_map(buf, 4096, -1, 0, dma_prot::READ, &bus);
  EXPECT_NE(st.message().find("not present"), std::string::npos) << st.message();
  EXPECT_EQ(kernel.maps.size(), 1u);
  EXPECT_EQ(kernel.open_fds.count(kPagemapFd), 0u);
}

TEST_F(VfioLinkTest, IovaModePaMapsMemoryThatIsNotContiguousInSegments) {
  VfioOptions o = options();
  o.iova_mode_pa = true;
  ASSERT_TRUE(open(o).is_ok());
  alignas(4096) static uint8_t buf[4 * 4096];
  const uint64_t vpn = reinterpret_cast<uintptr_t>(buf) / 4096;
  const uint64_t present = uint64_t{1} << 63;
  // Pages 0-1 contiguous, page 2 elsewhere, page 3 right after page 2.
  kernel.pagemap[vpn + 0] = present | 0x1000;
  kernel.pagemap[vpn + 1] = present | 0x1001;
  kernel.pagemap[vpn + 2] = present | 0x5000;
  kernel.pagemap[vpn + 3] = present | 0x5001;
  std::vector<Link::DmaSegment> segs;
  ASSERT_TRUE(link->dma_map_segments(buf + 100, 4 * 4096 - 200, -1, 0, dma_prot::READ, &segs).is_ok());
  ASSERT_EQ(segs.size(), 2u);
  EXPECT_EQ(segs[0].bus_addr, 0x1000u * 4096 + 100);
  EXPECT_EQ(segs[0].len, 2u * 4096 - 100);
  EXPECT_EQ(segs[1].bus_addr, 0x5000u * 4096);
  EXPECT_EQ(segs[1].len, 2u * 4096 - 100);
  ASSERT_EQ(kernel.maps.size(), 2u);
  EXPECT_EQ(kernel.maps[0].iova, 0x1000u * 4096);
  EXPECT_EQ(kernel.maps[1].iova, 0x5000u * 4096);
  for (const auto& sg : segs) ASSERT_TRUE(link->dma_unmap(sg.bus_addr, sg.len).is_ok());
  EXPECT_EQ(kernel.unmaps.size(), 2u);
  // A page that is not present: refused before anything is mapped.
  kernel.pagemap.erase(vpn + 3);
  EXPECT_FALSE(link->dma_map_segments(buf, 4 * 4096, -1, 0, dma_prot::READ, &segs).is_ok());
  EXPECT_EQ(kernel.maps.size(), 2u);
}

TEST_F(VfioLinkTest, NoIommuGroupNeedsPaModeAndSkipsMapDma) {
  kernel.normal_group = false;
  kernel.noiommu_group = true;
  kernel.extensions = {VFIO_NOIOMMU_IOMMU};
  Status st = open();
  EXPECT_EQ(st.code(), Code::unsupported);
  EXPECT_NE(st.message().find("iova_mode_pa"), std::string::npos) << st.message();
  EXPECT_TRUE(kernel.open_fds.empty());

  kernel.calls.clear();
  VfioOptions o = options();
  o.iova_mode_pa = true;
  ASSERT_TRUE(open(o).is_ok());
  EXPECT_TRUE(link->noiommu());
  EXPECT_EQ(link->iommu_type(), VFIO_NOIOMMU_IOMMU);
  EXPECT_EQ(kernel.count("open /fake/vfio/noiommu-12"), 1u);
  EXPECT_EQ(kernel.count("ioctl 10 SET_IOMMU 8"), 1u);
  EXPECT_EQ(kernel.count("ioctl 10 IOMMU_GET_INFO"), 0u);

  alignas(4096) static uint8_t buf[4096];
  kernel.pagemap[reinterpret_cast<uintptr_t>(buf) / 4096] = (uint64_t{1} << 63) | 0x1234;
  uint64_t bus = 0;
  ASSERT_TRUE(link->dma_map(buf, 4096, -1, 0, dma_prot::READ, &bus).is_ok());
  EXPECT_EQ(bus, 0x1234u * 4096);
  EXPECT_TRUE(kernel.maps.empty());
  ASSERT_TRUE(link->dma_unmap(bus, 4096).is_ok());
  EXPECT_TRUE(kernel.unmaps.empty());
}

TEST_F(VfioLinkTest, MsixSetIrqsArguments) {
  ASSERT_TRUE(open().is_ok());
  const int fds[] = {5, 6};
  ASSERT_TRUE(link->set_msix(0, fds).is_ok());
  ASSERT_EQ(kernel.irq_sets.size(), 1u);
  const IrqSet& s = kernel.irq_sets[0];
  EXPECT_EQ(s.argsz, sizeof(vfio_irq_set) + 2 * sizeof(int));
  EXPECT_EQ(s.flags, VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER);
  EXPECT_EQ(s.index, static_cast<uint32_t>(VFIO_PCI_MSIX_IRQ_INDEX));
  EXPECT_EQ(s.start, 0u);
  EXPECT_EQ(s.count, 2u);
  EXPECT_EQ(s.fds, (std::vector<int>{5, 6}));

  // Disconnect vector 1 inside the enabled range: one call, fd -1.
  const int off[] = {-1};
  ASSERT_TRUE(link->set_msix(1, off).is_ok());
  ASSERT_EQ(kernel.irq_sets.size(), 2u);
  EXPECT_EQ(kernel.irq_sets[1].start, 1u);
  EXPECT_EQ(kernel.irq_sets[1].count, 1u);
  EXPECT_EQ(kernel.irq_sets[1].fds, (std::vector<int>{-1}));

  // Growing past the enabled range: disable, then re-enable [0, 4) with the
  // remembered fds.
  const int more[] = {7};
  ASSERT_TRUE(link->set_msix(3, more).is_ok());
  ASSERT_EQ(kernel.irq_sets.size(), 4u);
  EXPECT_EQ(kernel.irq_sets[2].flags, VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER);
  EXPECT_EQ(kernel.irq_sets[2].count, 0u);
  EXPECT_EQ(kernel.irq_sets[3].start, 0u);
  EXPECT_EQ(kernel.irq_sets[3].fds, (std::vector<int>{5, -1, -1, 7}));

  const int too_many[] = {1, 2};
  Status st = link->set_msix(15, too_many);
  EXPECT_EQ(st.code(), Code::out_of_range);
  EXPECT_NE(st.message().find("beyond the device's 16"), std::string::npos) << st.message();

  ASSERT_TRUE(link->set_msix(0, {}).is_ok());  // disable all
  EXPECT_EQ(kernel.irq_sets.back().count, 0u);
  EXPECT_EQ(kernel.irq_sets.back().flags, VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER);

  kernel.fail_request = VFIO_DEVICE_SET_IRQS;
  kernel.fail_errno = EINVAL;
  st = link->set_msix(0, fds);
  EXPECT_NE(st.message().find("VFIO_DEVICE_SET_IRQS(MSI-X 0+2): Invalid argument"), std::string::npos)
      << st.message();
}

TEST_F(VfioLinkTest, NoMsixIsUnsupported) {
  kernel.msix = 0;
  ASSERT_TRUE(open().is_ok());
  const int fds[] = {5};
  EXPECT_EQ(link->set_msix(0, fds).code(), Code::unsupported);
}

TEST_F(VfioLinkTest, Reset) {
  ASSERT_TRUE(open().is_ok());
  ASSERT_TRUE(link->reset().is_ok());
  EXPECT_EQ(kernel.resets, 1);
  EXPECT_EQ(kernel.calls.back(), "ioctl 12 DEVICE_RESET");

  link.reset();  // the fake has one set of fds
  kernel.device_flags = VFIO_DEVICE_FLAGS_PCI;
  ASSERT_TRUE(open().is_ok());
  EXPECT_EQ(link->reset().code(), Code::unsupported);
}

// open_vfio: the IOMMU group comes from sysfs.
class OpenVfioTest : public VfioLinkTest {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "hcomm-vfio-XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    root = tmpl;
    dev = root / "bus/pci/devices" / kAddr;
    fs::create_directories(dev);
    fs::create_directories(root / "bus/pci/drivers/vfio-pci");
    fs::create_directories(root / "kernel/iommu_groups/12");
    std::ofstream(dev / "vendor") << "0x1dea\n";
    std::ofstream(dev / "device") << "0x0001\n";
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
  VfioOptions sys_options() {
    VfioOptions o = options();
    o.sysfs_root = root.string();
    return o;
  }
  fs::path root, dev;
};

TEST_F(OpenVfioTest, FindsGroupFromSysfs) {
  fs::create_symlink("../../../../bus/pci/drivers/vfio-pci", dev / "driver");
  fs::create_symlink("../../../../kernel/iommu_groups/12", dev / "iommu_group");
  std::unique_ptr<Link> l;
  ASSERT_TRUE(open_vfio(kAddr, sys_options(), &l).is_ok());
  EXPECT_EQ(kernel.count("open /fake/vfio/12"), 1u);
  EXPECT_EQ(l->location(), kAddr);
}

TEST_F(OpenVfioTest, RefusesUnboundOrGrouplessFunction) {
  std::unique_ptr<Link> l;
  Status st = open_vfio(kAddr, sys_options(), &l);
  EXPECT_NE(st.message().find("unbound, not bound to vfio-pci"), std::string::npos) << st.message();
  fs::create_symlink("../../../../bus/pci/drivers/vfio-pci", dev / "driver");
  st = open_vfio(kAddr, sys_options(), &l);
  EXPECT_EQ(st.code(), Code::not_found);
  EXPECT_NE(st.message().find("no IOMMU group"), std::string::npos) << st.message();
  EXPECT_EQ(open_vfio("0000:00:06.0", sys_options(), &l).code(), Code::not_found);
  EXPECT_TRUE(kernel.calls.empty());
}

}  // namespace
}  // namespace hcomm::driver
