#include "driver/pci.h"

#include <fcntl.h>
#include <limits.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <filesystem>
#include <limits>
#include <system_error>

#include "common/fd.h"
#include "hal/abi/regs.h"

namespace hcomm::driver {

namespace {

namespace fs = std::filesystem;

constexpr size_t kMaxSysfsFile = 64 * 1024;  // `resource` is < 1 KiB; cap garbage

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\n' || s.front() == '\r'))
    s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n' || s.back() == '\r'))
    s.remove_suffix(1);
  return s;
}

// Reads a whole (small) sysfs file. Returns 0 or an errno value.
int read_small_file(const std::string& path, std::string* out) {
  out->clear();
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return errno;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) break;
    out->append(buf, static_cast<size_t>(n));
    if (out->size() > kMaxSysfsFile) return EFBIG;
  }
  return 0;
}

// "0x1dea" / "1dea" (sysfs writes the 0x form) -> value, if it fits in `max`.
bool parse_hex(std::string_view s, uint64_t max, uint64_t* out) {
  s = trim(s);
  if (s.size() > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) s.remove_prefix(2);
  if (s.empty()) return false;
  uint64_t v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v, 16);
  if (ec != std::errc() || end != s.data() + s.size() || v > max) return false;
  *out = v;
  return true;
}

bool parse_dec(std::string_view s, int64_t min, int64_t max, int64_t* out) {
  s = trim(s);
  if (s.empty()) return false;
  int64_t v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v, 10);
  if (ec != std::errc() || end != s.data() + s.size() || v < min || v > max) return false;
  *out = v;
  return true;
}

std::string quoted_excerpt(std::string_view s) {
  s = trim(s);
  std::string q = "'";
  q.append(s.substr(0, 32));
  if (s.size() > 32) q += "...";
  q += "'";
  return q;
}

// Reads a hex attribute file into *out, or records why it could not.
template <typename T>
void read_hex_attr(const std::string& dir, const char* name, T* out, std::vector<std::string>* problems) {
  std::string text;
  if (int err = read_small_file(dir + "/" + name, &text); err != 0) {
    problems->push_back(Status::from_errno(err, std::string(name) + ": cannot read").message());
    return;
  }
  uint64_t v = 0;
  if (!parse_hex(text, uint64_t{std::numeric_limits<T>::max()}, &v)) {
    problems->push_back(std::string(name) + ": not a hex number of the expected width: " + quoted_excerpt(text));
    return;
  }
  *out = static_cast<T>(v);
}

// readlink(dir/name) -> basename of the target; 0 or errno.
int link_basename(const std::string& path, std::string* out) {
  char buf[PATH_MAX];
  ssize_t n = ::readlink(path.c_str(), buf, sizeof buf - 1);
  if (n < 0) return errno;
  std::string_view target(buf, static_cast<size_t>(n));
  size_t slash = target.find_last_of('/');
  *out = std::string(slash == std::string_view::npos ? target : target.substr(slash + 1));
  return 0;
}

// One line of `resource`: "0x<start> 0x<end> 0x<flags>".
bool parse_resource_line(std::string_view line, PciBar* bar, std::string* why) {
  uint64_t vals[3] = {};
  for (int i = 0; i < 3; ++i) {
    line = trim(line);
    size_t sp = line.find_first_of(" \t");
    std::string_view tok = line.substr(0, sp);
    if (tok.empty()) {
      *why = "expected 3 fields (start end flags)";
      return false;
    }
    if (!parse_hex(tok, UINT64_MAX, &vals[i])) {
      *why = "not a hex number: " + quoted_excerpt(tok);
      return false;
    }
    line = sp == std::string_view::npos ? std::string_view{} : line.substr(sp);
  }
  if (!trim(line).empty()) {
    *why = "trailing garbage: " + quoted_excerpt(line);
    return false;
  }
  const uint64_t start = vals[0], end = vals[1];
  bar->start = start;
  bar->flags = vals[2];
  bar->size = 0;
  if (start != 0 || end != 0) {
    if (end < start) {
      *why = "end below start";
      return false;
    }
    bar->size = end - start + 1;  // end == UINT64_MAX with start 0 is not a real BAR
  }
  return true;
}

void read_resources(const std::string& dir, PciFunction* fn) {
  std::string text;
  if (int err = read_small_file(dir + "/resource", &text); err != 0) {
    fn->problems.push_back(Status::from_errno(err, "resource: cannot read").message());
    return;
  }
  std::string_view rest = text;
  size_t lineno = 0;
  while (lineno < fn->bars.size() && !rest.empty()) {
    size_t nl = rest.find('\n');
    std::string_view line = rest.substr(0, nl);
    rest = nl == std::string_view::npos ? std::string_view{} : rest.substr(nl + 1);
    std::string why;
    PciBar bar;
    if (!parse_resource_line(line, &bar, &why)) {
      fn->problems.push_back("resource line " + std::to_string(lineno + 1) + " (BAR" +
                             std::to_string(lineno) + "): " + why);
    } else {
      fn->bars[lineno] = bar;
    }
    ++lineno;
  }
  if (lineno < fn->bars.size()) {
    fn->problems.push_back("resource: " + std::to_string(lineno) + " lines, expected at least " +
                           std::to_string(fn->bars.size()) + " (one per BAR)");
  }
}

int write_sysfs(const std::string& path, std::string_view value) {
  // No O_CREAT: a missing attribute (old kernel without driver_override, a
  // driver that is not loaded) must fail, not create a regular file.
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
  if (!fd.valid()) return errno;
  for (;;) {
    ssize_t n = ::write(fd.get(), value.data(), value.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    // sysfs stores one attribute per write(); a short write is a failure.
    return static_cast<size_t>(n) == value.size() ? 0 : EIO;
  }
}

bool is_driver_name(std::string_view s) {
  if (s.empty() || s.size() > 64 || s == "." || s == "..") return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '_' || c == '.';
  });
}

}  // namespace

bool PciFunction::is_hcomm_npu() const {
  return vendor == hal::abi::kPciVendorId && device == hal::abi::kPciDeviceId;
}

bool PciFunction::is_ivshmem() const { return vendor == kIvshmemVendorId && device == kIvshmemDeviceId; }

bool is_pci_address(std::string_view a) {
  // DDDD:BB:DD.F
  if (a.size() != 12 || a[4] != ':' || a[7] != ':' || a[10] != '.') return false;
  auto hex = [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); };
  for (size_t i : {0u, 1u, 2u, 3u, 5u, 6u, 8u, 9u})
    if (!hex(a[i])) return false;
  uint64_t dev = 0;
  if (!parse_hex(a.substr(8, 2), 0x1f, &dev)) return false;
  return a[11] >= '0' && a[11] <= '7';
}

PciScanner::PciScanner(std::string sysfs_root) : _root(std::move(sysfs_root)) {}

std::string PciScanner::device_dir(const std::string& addr) const {
  return _root + "/bus/pci/devices/" + addr;
}

Status PciScanner::read_function(const std::string& addr, PciFunction* out) const {
  if (!is_pci_address(addr))
    return Status::error(Code::invalid_argument, "'%s' is not a PCI address (DDDD:BB:DD.F)", addr.c_str());
  const std::string dir = device_dir(addr);
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    return Status::error(Code::not_found, "no PCI function %s (%s does not exist)", addr.c_str(), dir.c_str());

  PciFunction fn;
  fn.address = addr;
  read_hex_attr(dir, "vendor", &fn.vendor, &fn.problems);
  read_hex_attr(dir, "device", &fn.device, &fn.problems);
  uint32_t cls = 0;
  read_hex_attr(dir, "class", &cls, &fn.problems);
  if (cls > 0xffffff) {
    fn.problems.push_back("class: wider than 24 bits");
  } else {
    fn.class_code = cls;
  }
  read_hex_attr(dir, "subsystem_vendor", &fn.subsystem_vendor, &fn.problems);
  read_hex_attr(dir, "subsystem_device", &fn.subsystem_device, &fn.problems);

  // driver -> ../../../bus/pci/drivers/<name>; absent when unbound.
  if (int err = link_basename(dir + "/driver", &fn.driver); err != 0 && err != ENOENT)
    fn.problems.push_back(Status::from_errno(err, "driver: readlink").message());

  // iommu_group -> ../../../kernel/iommu_groups/<n>; absent without an IOMMU.
  std::string group;
  if (int err = link_basename(dir + "/iommu_group", &group); err == 0) {
    int64_t g = 0;
    if (parse_dec(group, 0, INT32_MAX, &g)) {
      fn.iommu_group = static_cast<int>(g);
    } else {
      fn.problems.push_back("iommu_group: link target is not a group number: " + quoted_excerpt(group));
    }
  } else if (err != ENOENT) {
    fn.problems.push_back(Status::from_errno(err, "iommu_group: readlink").message());
  }

  // numa_node is "-1" on single-node machines; absent on some architectures.
  std::string numa;
  if (int err = read_small_file(dir + "/numa_node", &numa); err == 0) {
    int64_t n = 0;
    if (parse_dec(numa, -1, 4095, &n)) {
      fn.numa_node = static_cast<int>(n);
    } else {
      fn.problems.push_back("numa_node: not a node number: " + quoted_excerpt(numa));
    }
  } else if (err != ENOENT) {
    fn.problems.push_back(Status::from_errno(err, "numa_node: cannot read").message());
  }

  read_resources(dir, &fn);
  *out = std::move(fn);
  return Status::ok();
}

Status PciScanner::scan(std::vector<PciFunction>* out) const {
  out->clear();
  const std::string devices = _root + "/bus/pci/devices";
  std::error_code ec;
  fs::directory_iterator it(devices, ec);
  if (ec) return Status::from_errno(ec.value(), "cannot list " + devices);
  std::vector<std::string> addrs;
  for (const fs::directory_iterator end; it != end; it.increment(ec)) {
    if (ec) return Status::from_errno(ec.value(), "listing " + devices);
    std::string name = it->path().filename().string();
    // Only well-formed addresses; anything else in the directory is not a
    // PCI function and would make read_function() fail.
    if (is_pci_address(name)) addrs.push_back(std::move(name));
  }
  if (ec) return Status::from_errno(ec.value(), "listing " + devices);
  std::sort(addrs.begin(), addrs.end());
  for (const std::string& a : addrs) {
    PciFunction fn;
    Status st = read_function(a, &fn);
    if (st.code() == Code::not_found) continue;  // hot-removed while scanning
    if (!st.is_ok()) return st;
    out->push_back(std::move(fn));
  }
  return Status::ok();
}

Status PciScanner::bind_to_driver(const std::string& addr, const std::string& driver, bool verify) const {
  if (!is_driver_name(driver))
    return Status::error(Code::invalid_argument, "'%s' is not a driver name", driver.c_str());
  PciFunction fn;
  HCOMM_TRY(read_function(addr, &fn));
  if (fn.driver == driver) return Status::ok();

  const std::string dir = device_dir(addr);
  // 1. driver_override first, so that nothing but `driver` can claim the
  //    function between the unbind and the probe.
  std::string path = dir + "/driver_override";
  if (int err = write_sysfs(path, driver); err != 0)
    return Status::from_errno(err, "bind " + addr + ": write '" + driver + "' to " + path);

  // 2. Unbind from the current driver, if any.
  if (!fn.driver.empty()) {
    path = _root + "/bus/pci/drivers/" + fn.driver + "/unbind";
    if (int err = write_sysfs(path, addr); err != 0)
      return Status::from_errno(err, "bind " + addr + ": unbind from '" + fn.driver + "' via " + path);
  }

  // 3. Ask the PCI core to probe again; it honours driver_override.
  path = _root + "/bus/pci/drivers_probe";
  if (int err = write_sysfs(path, addr); err != 0)
    return Status::from_errno(err, "bind " + addr + ": write to " + path);

  if (!verify) return Status::ok();
  // drivers_probe runs the probe synchronously, so one re-read suffices.
  std::string now;
  int err = link_basename(dir + "/driver", &now);
  if (err == 0 && now == driver) return Status::ok();
  if (err != 0 && err != ENOENT) return Status::from_errno(err, "bind " + addr + ": readlink driver");
  return Status::error(Code::not_found,
                       "bind %s: after drivers_probe the function is %s%s%s (is the '%s' module loaded, "
                       "and does it accept this device?)",
                       addr.c_str(), now.empty() ? "unbound" : "bound to '", now.c_str(),
                       now.empty() ? "" : "'", driver.c_str());
}

}  // namespace hcomm::driver
