// Naming and opening devices, whatever link reaches them.
//   "sim:N" or "N"      simulated NPU N: vfio-user socket DIR/npuN.sock
//   "DDDD:BB:DD.F"      a PCI function bound to vfio-pci (Linux VFIO)
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "driver/link.h"

namespace hcomm::driver {

struct DeviceRef {
  enum class Kind { sim, pci };
  Kind kind = Kind::sim;
  unsigned sim_index = 0;
  std::string path;  // socket path (sim) or PCI address (pci)
  std::string name() const;
};

Status parse_device_name(const std::string& name, const std::string& sim_dir, DeviceRef* out);
// Indices of the npuN.sock files in `dir`, ascending (empty if none / no dir).
std::vector<unsigned> list_sim_devices(const std::string& dir);
Status open_link(const DeviceRef& ref, std::unique_ptr<Link>* out, int timeout_ms = 5000);

}  // namespace hcomm::driver
