// PCI discovery from sysfs, and the bind helper that hands a function to
// vfio-pci.
//
// Everything goes through an injectable sysfs root (default "/sys") so the
// scanner is unit tested on a fake tree built in a temp dir. The scanner
// reads; only bind_to_driver() writes, and only the three files the kernel
// documents for that (Documentation/ABI/testing/sysfs-bus-pci):
// driver_override, drivers/<old>/unbind and drivers_probe.
//
// Robustness: sysfs files of a half-removed or odd device can be missing or
// hold garbage. A function whose identity files cannot be parsed is still
// listed, with a human-readable note per problem in PciFunction::problems,
// so `hcomm-probe` can say what is wrong instead of silently skipping it.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace hcomm::driver {

// Linux IORESOURCE_* bits as they appear in the third column of
// /sys/bus/pci/devices/*/resource (include/linux/ioport.h).
namespace ioresource {
inline constexpr uint64_t IO = 0x00000100;
inline constexpr uint64_t MEM = 0x00000200;
inline constexpr uint64_t PREFETCH = 0x00002000;
inline constexpr uint64_t MEM_64 = 0x00100000;
}  // namespace ioresource

// QEMU's inter-VM shared memory device (ivshmem), used by the QEMU front.
inline constexpr uint16_t kIvshmemVendorId = 0x1af4;
inline constexpr uint16_t kIvshmemDeviceId = 0x1110;

struct PciBar {
  uint64_t start = 0;  // host physical address (0 when hidden from non-root)
  uint64_t size = 0;   // 0 = BAR not implemented
  uint64_t flags = 0;  // ioresource:: bits
  bool present() const { return size != 0; }
  bool is_io() const { return (flags & ioresource::IO) != 0; }
  bool is_mem64() const { return (flags & ioresource::MEM_64) != 0; }
  bool prefetchable() const { return (flags & ioresource::PREFETCH) != 0; }
};

struct PciFunction {
  std::string address;  // "DDDD:BB:DD.F", the sysfs directory name
  uint16_t vendor = 0;
  uint16_t device = 0;
  uint32_t class_code = 0;  // 24 bits: class, subclass, prog-if
  uint16_t subsystem_vendor = 0;
  uint16_t subsystem_device = 0;
  std::string driver;    // bound driver's name, "" when unbound
  int iommu_group = -1;  // -1: no IOMMU group (no IOMMU, or not enabled)
  int numa_node = -1;    // -1: unknown / single node
  std::array<PciBar, 6> bars{};
  // One line per file that was missing or unparsable ("vendor: not a hex
  // number: 'zz'"). Empty for a healthy function.
  std::vector<std::string> problems;

  bool is_hcomm_npu() const;  // hal/abi/regs.h kPciVendorId:kPciDeviceId
  bool is_ivshmem() const;    // 0x1af4:0x1110
};

// True for a canonical sysfs PCI address "DDDD:BB:DD.F" (hex, lower or upper
// case; device <= 0x1f, function <= 7).
bool is_pci_address(std::string_view addr);

class PciScanner {
 public:
  explicit PciScanner(std::string sysfs_root = "/sys");

  const std::string& root() const { return _root; }

  // Every function under <root>/bus/pci/devices, sorted by address. Fails
  // only when the directory itself cannot be read; per-function trouble goes
  // to PciFunction::problems.
  Status scan(std::vector<PciFunction>* out) const;

  // One function by address; not_found when it does not exist.
  Status read_function(const std::string& addr, PciFunction* out) const;

  // Bind `addr` to `driver` (normally "vfio-pci"), the driverctl / dpdk-devbind
  // way: write driver_override, unbind from the current driver, then
  // drivers_probe. Already bound to `driver`: ok, nothing is written. With
  // `verify`, re-reads the driver link afterwards and fails with a clear
  // message if the kernel did not bind it (module not loaded, probe refused).
  Status bind_to_driver(const std::string& addr, const std::string& driver,
                        bool verify = true) const;

 private:
  std::string device_dir(const std::string& addr) const;

  std::string _root;
};

}  // namespace hcomm::driver
