#include "driver/discover.h"

#include <dirent.h>

#include <algorithm>
#include <cstdlib>

#include "common/paths.h"
#include "driver/dma_memory.h"
#include "driver/ivshmem_link.h"
#include "driver/pci.h"
#include "driver/vfio_link.h"
#include "driver/vfio_user_link.h"

namespace hcomm::driver {

std::string DeviceRef::name() const {
  return kind == Kind::sim ? "sim:" + std::to_string(sim_index) : path;
}

namespace {
bool parse_index(const std::string& s, unsigned* out) {
  if (s.empty() || s.size() > 4) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  *out = static_cast<unsigned>(std::stoul(s));
  return true;
}
}  // namespace

Status parse_device_name(const std::string& name, const std::string& sim_dir, DeviceRef* out) {
  DeviceRef r;
  std::string idx = name.rfind("sim:", 0) == 0 ? name.substr(4) : name;
  if (parse_index(idx, &r.sim_index)) {
    r.kind = DeviceRef::Kind::sim;
    r.path = sim_socket_path(sim_dir, r.sim_index);
  } else if (is_pci_address(name)) {
    r.kind = DeviceRef::Kind::pci;
    r.path = name;
  } else {
    return Status::error(Code::invalid_argument,
                         "'%s' is not a device name: use sim:N (simulated NPU N) or a PCI address DDDD:BB:DD.F",
                         name.c_str());
  }
  *out = r;
  return Status::ok();
}

std::vector<unsigned> list_sim_devices(const std::string& dir) {
  std::vector<unsigned> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n.size() > 8 && n.rfind("npu", 0) == 0 && n.substr(n.size() - 5) == ".sock") {
      unsigned i;
      if (parse_index(n.substr(3, n.size() - 8), &i)) out.push_back(i);
    }
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

Status open_link(const DeviceRef& ref, std::unique_ptr<Link>* out, int timeout_ms) {
  if (ref.kind == DeviceRef::Kind::sim) return open_vfio_user(ref.path, out, timeout_ms);
  PciFunction fn;
  HCOMM_TRY(PciScanner().read_function(ref.path, &fn));
  if (!fn.is_ivshmem()) return open_vfio(ref.path, VfioOptions{}, out);
  // hcomm-sim inside a QEMU guest: the model reaches guest RAM by physical
  // address, so bus addresses are physical (iova-mode=pa) and DMA buffers
  // must be contiguous.
  VfioOptions o;
  o.iova_mode_pa = true;
  std::unique_ptr<Link> pci;
  HCOMM_TRY(open_vfio(ref.path, o, &pci));
  HCOMM_TRY(IvshmemLink::open(std::move(pci), IvshmemOptions{}, out));
  DmaBuffer::set_physically_contiguous(true);  // process-wide from here on, like DPDK's EAL
  return Status::ok();
}

}  // namespace hcomm::driver
