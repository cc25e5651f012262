// PciScanner on a fake sysfs tree built in a temp dir.
#include "driver/pci.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "hal/abi/regs.h"

namespace hcomm::driver {
namespace {

namespace fs = std::filesystem;

class FakeSysfs {
 public:
  FakeSysfs() {
    std::string tmpl = (fs::temp_directory_path() / "hcomm-sysfs-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) ADD_FAILURE() << "mkdtemp failed";
    _root = tmpl;
    fs::create_directories(_root / "bus/pci/devices");
    fs::create_directories(_root / "bus/pci/drivers");
    fs::create_directories(_root / "devices/pci0000:00");
    put("bus/pci/drivers_probe", "");
  }
  ~FakeSysfs() {
    std::error_code ec;
    fs::remove_all(_root, ec);
  }
  std::string root() const { return _root.string(); }

  void put(const std::string& rel, const std::string& text) {
    fs::create_directories((_root / rel).parent_path());
    std::ofstream(_root / rel) << text;
  }
  std::string get(const std::string& rel) const {
    std::ifstream in(_root / rel);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  void driver(const std::string& name) { fs::create_directories(_root / "bus/pci/drivers" / name); put("bus/pci/drivers/" + name + "/unbind", ""); }

  // A function laid out like the kernel does: the devices/ entry is a
  // symlink into the device tree; driver and iommu_group are symlinks.
  void function(const std::string& addr, uint16_t vendor, uint16_t device, const std::string& drv, int group,
                const std::string& numa, const std::string& resource) {
    const std::string dir = "devices/pci0000:00/" + addr;
    fs::create_directories(_root / dir);
    fs::create_symlink("../../../devices/pci0000:00/" + addr, _root / "bus/pci/devices" / addr);
    char buf[16];
    std::snprintf(buf, sizeof buf, "0x%04x\n", vendor);
    put(dir + "/vendor", buf);
    std::snprintf(buf, sizeof buf, "0x%04x\n", device);
    put(dir + "/device", buf);
    put(dir + "/class", "0x120000\n");
    put(dir + "/subsystem_vendor", "0x1af4\n");
    put(dir + "/subsystem_device", "0x1100\n");
    put(dir + "/numa_node", numa);
    put(dir + "/resource", resource);
    put(dir + "/driver_override", "");
    if (!drv.empty()) {
      driver(drv);
      fs::create_symlink("../../../bus/pci/drivers/" + drv, _root / dir / "driver");
    }
    if (group >= 0) {
      fs::create_directories(_root / "kernel/iommu_groups" / std::to_string(group));
      fs::create_symlink("../../../kernel/iommu_groups/" + std::to_string(group), _root / dir / "iommu_group");
    }
  }
  std::string dir(const std::string& addr) const { return "devices/pci0000:00/" + addr; }

 private:
  fs::path _root;
};

// 6 BARs + ROM, as the kernel prints them.
const char* kNpuResource =
    "0x00000000fe000000 0x00000000fe001fff 0x0000000000040200\n"  // BAR0 8 KiB mem
    "0x0000000000000000 0x0000000000000000 0x0000000000000000\n"
    "0x0000004000000000 0x000000403fffffff 0x000000000014220c\n"  // BAR2 1 GiB mem64 prefetch
    "0x0000000000000000 0x0000000000000000 0x0000000000000000\n"
    "0x00000000fe002000 0x00000000fe002fff 0x0000000000040200\n"  // BAR4 4 KiB
    "0x0000000000000000 0x0000000000000000 0x0000000000000000\n"
    "0x0000000000000000 0x0000000000000000 0x0000000000000000\n";

const char* kNicResource =
    "0x00000000fd000000 0x00000000fd01ffff 0x0000000000040200\n"
    "0x0000000000000000 0x0000000000000000 0x0000000000000000\n"
    "0x000000000000e000 0x000000000000e01f 0x0000000000040101\n"  // I/O BAR
    "0x0000000000000000 0x0000000000000000 0x0000000000000000\n"
    "0x0000000000000000 0x0000000000000000 0x0000000000000000\n"
    "0x0000000000000000 0x0000000000000000 0x0000000000000000\n";

class PciTest : public ::testing::Test {
 protected:
  void SetUp() override {
    sys.function("0000:00:03.0", 0x8086, 0x10d3, "e1000e", 3, "0\n", kNicResource);
    sys.function("0000:00:05.0", hal::abi::kPciVendorId, hal::abi::kPciDeviceId, "vfio-pci", 12, "1\n",
                 kNpuResource);
    sys.function("0000:00:04.0", kIvshmemVendorId, kIvshmemDeviceId, "", -1, "-1\n",
                 "0x00000000fe800000 0x00000000fe8000ff 0x0000000000040200\n"
                 "zz 0x1 0x2\n"
                 "0x0 0x0\n");
  }
  const PciFunction* find(const std::vector<PciFunction>& v, const std::string& a) {
    for (const auto& f : v)
      if (f.address == a) return &f;
    return nullptr;
  }
  static bool has_problem(const PciFunction& f, const std::string& needle) {
    for (const auto& p : f.problems)
      if (p.find(needle) != std::string::npos) return true;
    return false;
  }
  FakeSysfs sys;
};

TEST_F(PciTest, ScanListsEveryFunctionSortedWithIdentity) {
  std::vector<PciFunction> fns;
  ASSERT_TRUE(PciScanner(sys.root()).scan(&fns).is_ok());
  ASSERT_EQ(fns.size(), 3u);
  EXPECT_EQ(fns[0].address, "0000:00:03.0");
  EXPECT_EQ(fns[1].address, "0000:00:04.0");
  EXPECT_EQ(fns[2].address, "0000:00:05.0");

  const PciFunction& npu = fns[2];
  EXPECT_TRUE(npu.problems.empty()) << npu.problems.front();
  EXPECT_EQ(npu.vendor, hal::abi::kPciVendorId);
  EXPECT_EQ(npu.device, hal::abi::kPciDeviceId);
  EXPECT_EQ(npu.class_code, hal::abi::kPciClassCode);
  EXPECT_EQ(npu.subsystem_vendor, 0x1af4);
  EXPECT_EQ(npu.subsystem_device, 0x1100);
  EXPECT_EQ(npu.driver, "vfio-pci");
  EXPECT_EQ(npu.iommu_group, 12);
  EXPECT_EQ(npu.numa_node, 1);
  EXPECT_TRUE(npu.is_hcomm_npu());
  EXPECT_FALSE(npu.is_ivshmem());

  const PciFunction& nic = fns[0];
  EXPECT_EQ(nic.driver, "e1000e");
  EXPECT_EQ(nic.iommu_group, 3);
  EXPECT_EQ(nic.numa_node, 0);
  EXPECT_FALSE(nic.is_hcomm_npu());
}

TEST_F(PciTest, UnboundFunctionHasNoDriverNoGroup) {
  PciFunction f;
  ASSERT_TRUE(PciScanner(sys.root()).read_function("0000:00:04.0", &f).is_ok());
  EXPECT_EQ(f.driver, "");
  EXPECT_EQ(f.iommu_group, -1);
  EXPECT_EQ(f.numa_node, -1);
  EXPECT_TRUE(f.is_ivshmem());
  EXPECT_FALSE(f.is_hcomm_npu());
}

TEST_F(PciTest, BarSizesAndFlagsFromResource) {
  PciFunction f;
  ASSERT_TRUE(PciScanner(sys.root()).read_function("0000:00:05.0", &f).is_ok());
  EXPECT_EQ(f.bars[0].start, 0xfe000000u);
  EXPECT_EQ(f.bars[0].size, hal::abi::kBar0Size);
  EXPECT_FALSE(f.bars[0].is_io());
  EXPECT_FALSE(f.bars[0].is_mem64());
  EXPECT_FALSE(f.bars[1].present());
  EXPECT_EQ(f.bars[2].size, uint64_t{1} << 30);
  EXPECT_TRUE(f.bars[2].is_mem64());
  EXPECT_TRUE(f.bars[2].prefetchable());
  EXPECT_EQ(f.bars[4].size, 0x1000u);
  EXPECT_FALSE(f.bars[5].present());

  PciFunction nic;
  ASSERT_TRUE(PciScanner(sys.root()).read_function("0000:00:03.0", &nic).is_ok());
  EXPECT_TRUE(nic.bars[2].is_io());
  EXPECT_EQ(nic.bars[2].size, 0x20u);
}

TEST_F(PciTest, GarbledResourceIsReportedNotFatal) {
  PciFunction f;
  ASSERT_TRUE(PciScanner(sys.root()).read_function("0000:00:04.0", &f).is_ok());
  EXPECT_EQ(f.bars[0].size, 0x100u);  // the good line still counts
  EXPECT_FALSE(f.bars[1].present());
  EXPECT_TRUE(has_problem(f, "resource line 2 (BAR1): not a hex number: 'zz'"));
  EXPECT_TRUE(has_problem(f, "resource line 3 (BAR2): expected 3 fields"));
  EXPECT_TRUE(has_problem(f, "resource: 3 lines, expected at least 6"));
  EXPECT_EQ(f.vendor, kIvshmemVendorId);  // identity unaffected
}

TEST_F(PciTest, GarbledAndMissingIdentityFiles) {
  const std::string d = sys.dir("0000:00:03.0");
  sys.put(d + "/vendor", "zz\n");
  sys.put(d + "/class", "0x1234567\n");       // 28 bits
  sys.put(d + "/numa_node", "banana\n");
  sys.put(d + "/resource", "0x1 0x0 0x200\n");  // end < start
  std::filesystem::remove(sys.root() + "/" + d + "/device");
  PciFunction f;
  ASSERT_TRUE(PciScanner(sys.root()).read_function("0000:00:03.0", &f).is_ok());
  EXPECT_TRUE(has_problem(f, "vendor: not a hex number of the expected width: 'zz'"));
  EXPECT_TRUE(has_problem(f, "device: cannot read: No such file or directory"));
  EXPECT_TRUE(has_problem(f, "class: wider than 24 bits"));
  EXPECT_TRUE(has_problem(f, "numa_node: not a node number: 'banana'"));
  EXPECT_TRUE(has_problem(f, "end below start"));
  EXPECT_EQ(f.vendor, 0);
  EXPECT_EQ(f.numa_node, -1);
  EXPECT_EQ(f.driver, "e1000e");
}

TEST_F(PciTest, LookupErrors) {
  PciScanner s(sys.root());
  PciFunction f;
  Status st = s.read_function("0000:00:1f.7", &f);
  EXPECT_EQ(st.code(), Code::not_found);
  EXPECT_NE(st.message().find("no PCI function 0000:00:1f.7"), std::string::npos) << st.message();
  EXPECT_EQ(s.read_function("00:05.0", &f).code(), Code::invalid_argument);

  std::vector<PciFunction> fns;
  st = PciScanner(sys.root() + "/nope").scan(&fns);
  EXPECT_EQ(st.code(), Code::io_error);
  EXPECT_NE(st.message().find("/nope/bus/pci/devices"), std::string::npos) << st.message();
}

TEST(PciAddress, Validation) {
  EXPECT_TRUE(is_pci_address("0000:00:05.0"));
  EXPECT_TRUE(is_pci_address("10DE:af:1f.7"));
  EXPECT_FALSE(is_pci_address("0000:00:20.0"));  // device > 0x1f
  EXPECT_FALSE(is_pci_address("0000:00:05.8"));  // function > 7
  EXPECT_FALSE(is_pci_address("0000:00:05"));
  EXPECT_FALSE(is_pci_address("0000:0g:05.0"));
  EXPECT_FALSE(is_pci_address("0000-00:05.0"));
  EXPECT_FALSE(is_pci_address(""));
}

TEST_F(PciTest, BindFromOtherDriverWritesOverrideUnbindProbe) {
  PciScanner s(sys.root());
  const std::string a = "0000:00:03.0";
  Status st = s.bind_to_driver(a, "vfio-pci");
  // The fake kernel does not rebind, so verification must notice.
  EXPECT_EQ(st.code(), Code::not_found);
  EXPECT_NE(st.message().find("bound to 'e1000e'"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("'vfio-pci' module loaded"), std::string::npos) << st.message();
  EXPECT_EQ(sys.get(sys.dir(a) + "/driver_override"), "vfio-pci");
  EXPECT_EQ(sys.get("bus/pci/drivers/e1000e/unbind"), a);
  EXPECT_EQ(sys.get("bus/pci/drivers_probe"), a);
}

TEST_F(PciTest, BindWithoutVerifySucceedsAfterWrites) {
  PciScanner s(sys.root());
  ASSERT_TRUE(s.bind_to_driver("0000:00:03.0", "vfio-pci", /*verify=*/false).is_ok());
  EXPECT_EQ(sys.get("bus/pci/drivers_probe"), "0000:00:03.0");
}

TEST_F(PciTest, BindUnboundSkipsUnbind) {
  PciScanner s(sys.root());
  const std::string a = "0000:00:04.0";
  sys.driver("vfio-pci");
  Status st = s.bind_to_driver(a, "vfio-pci");
  EXPECT_NE(st.message().find("unbound"), std::string::npos) << st.message();
  EXPECT_EQ(sys.get(sys.dir(a) + "/driver_override"), "vfio-pci");
  EXPECT_EQ(sys.get("bus/pci/drivers_probe"), a);
  EXPECT_EQ(sys.get("bus/pci/drivers/vfio-pci/unbind"), "");
}

TEST_F(PciTest, BindAlreadyBoundWritesNothing) {
  PciScanner s(sys.root());
  ASSERT_TRUE(s.bind_to_driver("0000:00:05.0", "vfio-pci").is_ok());
  EXPECT_EQ(sys.get(sys.dir("0000:00:05.0") + "/driver_override"), "");
  EXPECT_EQ(sys.get("bus/pci/drivers_probe"), "");
  EXPECT_EQ(sys.get("bus/pci/drivers/vfio-pci/unbind"), "");
}

TEST_F(PciTest, BindErrorsAreClear) {
  PciScanner s(sys.root());
  std::filesystem::remove(sys.root() + "/" + sys.dir("0000:00:03.0") + "/driver_override");
  Status st = s.bind_to_driver("0000:00:03.0", "vfio-pci");
  EXPECT_EQ(st.code(), Code::io_error);
  EXPECT_NE(st.message().find("driver_override: No such file or directory"), std::string::npos) << st.message();
  EXPECT_EQ(sys.get("bus/pci/drivers/e1000e/unbind"), "");  // stopped before unbinding

  std::filesystem::remove(sys.root() + "/bus/pci/drivers_probe");
  st = s.bind_to_driver("0000:00:04.0", "vfio-pci");
  EXPECT_EQ(st.code(), Code::io_error);
  EXPECT_NE(st.message().find("drivers_probe"), std::string::npos) << st.message();

  EXPECT_EQ(s.bind_to_driver("0000:00:04.0", "../evil").code(), Code::invalid_argument);
  EXPECT_EQ(s.bind_to_driver("0000:00:04.0", "").code(), Code::invalid_argument);
  EXPECT_EQ(s.bind_to_driver("0000:00:1e.0", "vfio-pci").code(), Code::not_found);
}

}  // namespace
}  // namespace hcomm::driver
