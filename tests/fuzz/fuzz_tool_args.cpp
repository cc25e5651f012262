// Command lines of hcomm-run and hcomm-probe (tools/options.h), and the
// device names hcomm-probe takes (driver::parse_device_name). The input is
// the argument list, arguments separated by NUL bytes. Checked: a command
// line is either run with options in their stated ranges, help, or refused
// with a reason; a device name is a simulator index or a PCI address, or
// refused with a reason.
#include <cmath>

#include "driver/discover.h"
#include "tests/fuzz/fuzz.h"
#include "tests/fuzz/fuzz_io.h"
#include "tools/options.h"

using namespace hcomm::tools;

namespace {

std::string args(std::initializer_list<const char*> a) {
  std::string s;
  for (const char* x : a) s += std::string(x) + '\0';
  return s;
}

}  // namespace

std::vector<std::string> fuzz_seeds() {
  return {args({"-n", "4", "--sim", "--timeout", "30", "--", "examples/pipeline", "-x"}),
          args({"--np", "2", "--sim-devices", "3", "--grace", "0.5", "prog"}),
          args({"-n", "1e3", "prog"}),
          args({"--json", "--sim-dir", "/tmp/s", "info", "sim:1"}),
          args({"selftest", "0000:00:04.0"}),
          args({"list"}),
          args({"rdma"}),
          args({"--version"})};
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 4096) return 0;
  std::vector<std::string> argv;
  std::string cur;
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == 0) {
      argv.push_back(cur);
      cur.clear();
    } else {
      cur += static_cast<char>(data[i]);
    }
  }
  if (!cur.empty()) argv.push_back(cur);

  RunOptions ro;
  std::string why;
  switch (parse_run_args(argv, &ro, &why)) {
    case Parsed::run:
      if (ro.n < 1 || ro.n > 4096 || ro.argv.empty() || ro.argv[0].empty() || ro.sim_devices < 0 ||
          ro.sim_devices > 256 || !(ro.timeout_s == 0 || (ro.timeout_s >= 0.001 && ro.timeout_s <= 1e7)) ||
          !(ro.grace_s >= 0 && ro.grace_s <= 1e7))
        fuzz_io::fail("parse_run_args accepted options out of range");
      break;
    case Parsed::help:
      break;
    case Parsed::usage_error:
      if (why.empty()) fuzz_io::fail("a refused hcomm-run command line without a reason");
      break;
  }
  for (bool rdma : {false, true}) {
    ProbeOptions po;
    why.clear();
    Parsed p = parse_probe_args(argv, rdma, &po, &why);
    if (p == Parsed::usage_error && why.empty()) fuzz_io::fail("a refused hcomm-probe command line without a reason");
    if (p != Parsed::run) continue;
    using C = ProbeOptions::Command;
    if (po.command == C::rdma && !rdma) fuzz_io::fail("rdma accepted without verbs");
    if (po.command == C::info || po.command == C::selftest) {
      hcomm::driver::DeviceRef ref;
      hcomm::Status st = hcomm::driver::parse_device_name(po.device, po.sim_dir.empty() ? "/tmp/s" : po.sim_dir, &ref);
      if (!st && st.message().empty()) fuzz_io::fail("a refused device name without a reason");
      if (st && ref.kind == hcomm::driver::DeviceRef::Kind::pci && ref.path != po.device)
        fuzz_io::fail("a PCI device name changed on the way");
    }
  }
  return 0;
}
