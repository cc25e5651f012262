// Command-line parsing of hcomm-run and hcomm-probe, apart from their mains
// so that it is unit-tested and fuzzed (tests/fuzz/fuzz_tool_args.cpp) as
// the tools run it. Parsing never exits or prints: it returns what to do,
// or why the command line is wrong.
#pragma once

#include <string>
#include <vector>

namespace hcomm::tools {

// hcomm-run -n N [--sim] [--sim-devices K] [--timeout SEC] [--grace SEC] [--] prog args...
struct RunOptions {
  int n = 0;
  bool sim = false;
  int sim_devices = 0;
  double timeout_s = 0;
  double grace_s = 10;
  std::vector<std::string> argv;  // the program and its arguments
};
enum class Parsed { run, help, usage_error };
// args: argv[1..]. usage_error sets *why.
Parsed parse_run_args(const std::vector<std::string>& args, RunOptions* out, std::string* why);

// hcomm-probe [--json] [--sim-dir DIR] (list | info DEV | selftest DEV | rdma)
struct ProbeOptions {
  bool json = false;
  std::string sim_dir;  // empty: the default simulator directory
  enum class Command { none, list, info, selftest, rdma, version, help } command = Command::none;
  std::string device;  // DEV of info and selftest
};
// have_rdma: whether this build has the verbs transport (the rdma command).
// usage_error sets *why.
Parsed parse_probe_args(const std::vector<std::string>& args, bool have_rdma, ProbeOptions* out, std::string* why);

}  // namespace hcomm::tools
