// The simulator's control socket (sim/control.h): what any local process
// that can reach DIR/control.sock may send. The input is the byte stream of
// one client, cut into reads at the input's own 0xff bytes (each read at
// most 256 bytes, as the server reads), fed to a ControlSession over a
// fabric of two devices; every line is also run through control_command
// directly (the --fault command line path). Checked: every reply is one
// line starting "ok" or "error"; a session never holds more than a line's
// limit; a dropped client is only one that sent an over-long line.
#include <cstring>
#include <memory>

#include "sim/control.h"
#include "sim/device.h"
#include "tests/fuzz/fuzz.h"
#include "tests/fuzz/fuzz_io.h"

using hcomm::sim::ControlSession;
using hcomm::sim::Device;
using hcomm::sim::DeviceConfig;
using hcomm::sim::Fabric;

namespace {

Fabric& fabric() {
  static Fabric* f = [] {
    auto* fab = new Fabric;
    for (uint32_t i = 0; i < 2; ++i) {
      DeviceConfig cfg;
      cfg.fabric_index = i;
      // Not init()ed: no HBM and no engines; the control path only touches
      // the fault state and the counters.
      if (!fab->add(std::make_unique<Device>(cfg, fab))) fuzz_io::fail("Fabric::add");
    }
    return fab;
  }();
  return *f;
}

void check_replies(const std::string& r) {
  size_t start = 0;
  while (start < r.size()) {
    size_t nl = r.find('\n', start);
    if (nl == std::string::npos) fuzz_io::fail("a reply without its newline");
    std::string line = r.substr(start, nl - start);
    if (line.rfind("ok", 0) != 0 && line.rfind("error", 0) != 0) fuzz_io::fail("a reply neither ok nor error");
    start = nl + 1;
  }
}

}  // namespace

std::vector<std::string> fuzz_seeds() {
  return {"ping\n", "reset 1\nstats 1\n", "fail 0 3\nstats 0\n", "corrupt 1 1\xff\nclear 1\n",
          "stall 0 0\nstats 1\n", "stall 0 5 3\nclear 0\n", "stall 1 0 0\nstall 1 9 x\nstall 1 9 4000000000\n",
          "bogus 0 1\nfail 7 1\nfail 0 -1\nfail 0 99999999999\n", std::string(300, 'a') + "\n", "ping"};
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > (64 << 10)) return 0;
  Fabric& fab = fabric();
  ControlSession session(fab);
  size_t off = 0;
  while (off < size) {
    size_t end = off;
    while (end < size && end - off < 256 && data[end] != 0xff) ++end;
    bool drop = false;
    std::string replies = session.feed(reinterpret_cast<const char*>(data + off), end - off, &drop);
    check_replies(replies);
    if (drop) {
      if (replies.find("error: line too long\n") == std::string::npos) fuzz_io::fail("dropped without saying why");
      break;
    }
    off = end + (end < size && data[end] == 0xff ? 1 : 0);
  }
  // The --fault path: each line on its own.
  std::string all(reinterpret_cast<const char*>(data), size);
  size_t start = 0;
  for (int n = 0; n < 64 && start <= all.size(); ++n) {
    size_t nl = all.find('\n', start);
    std::string line = all.substr(start, nl == std::string::npos ? std::string::npos : nl - start);
    check_replies(hcomm::sim::control_command(fab, line) + "\n");
    if (nl == std::string::npos) break;
    start = nl + 1;
  }
  // Leave the devices as they were (no stall carried into the next input).
  for (uint32_t d = 0; d < fab.size(); ++d) (void)hcomm::sim::control_command(fab, "clear " + std::to_string(d));
  return 0;
}
