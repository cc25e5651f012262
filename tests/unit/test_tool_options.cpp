// hcomm-run's and hcomm-probe's command lines (tools/options.h), and the
// simulator's control session (sim/control.h): what users and local
// processes type, parsed without exiting.
#include <gtest/gtest.h>

#include "sim/control.h"
#include "sim/device.h"
#include "tools/options.h"

namespace hcomm::tools {
namespace {

Parsed run(std::vector<std::string> a, RunOptions* o, std::string* why) { return parse_run_args(a, o, why); }

TEST(RunArgs, ParsesOptionsThenTheProgram) {
  RunOptions o;
  std::string why;
  ASSERT_EQ(run({"-n", "4", "--sim", "--sim-devices", "3", "--timeout", "2.5", "--grace", "0", "prog", "-n", "x"}, &o,
                &why),
            Parsed::run)
      << why;
  EXPECT_EQ(o.n, 4);
  EXPECT_TRUE(o.sim);
  EXPECT_EQ(o.sim_devices, 3);
  EXPECT_DOUBLE_EQ(o.timeout_s, 2.5);
  EXPECT_DOUBLE_EQ(o.grace_s, 0);
  EXPECT_EQ(o.argv, (std::vector<std::string>{"prog", "-n", "x"}));  // the program's own options stay its own
  ASSERT_EQ(run({"--np", "2", "--", "-dash-prog"}, &o, &why), Parsed::run);
  EXPECT_EQ(o.argv, (std::vector<std::string>{"-dash-prog"}));
}

TEST(RunArgs, RefusesWithAReason) {
  RunOptions o;
  const std::vector<std::pair<std::vector<std::string>, std::string>> bad = {
      {{}, "-n N is required"},
      {{"-n"}, "needs a value"},
      {{"-n", "0", "p"}, "1..4096"},
      {{"-n", "4097", "p"}, "1..4096"},
      {{"-n", "2.5", "p"}, "1..4096"},
      {{"-n", "2x", "p"}, "1..4096"},
      {{"-n", "", "p"}, "1..4096"},
      {{"-n", "nan", "p"}, "1..4096"},
      {{"-n", "2"}, "no program"},
      {{"-n", "2", "--"}, "no program"},
      {{"-n", "2", ""}, "program name is empty"},
      {{"-n", "2", "--timeout", "0", "p"}, "positive"},
      {{"-n", "2", "--grace", "-1", "p"}, "seconds"},
      {{"-n", "2", "--sim-devices", "257", "p"}, "1..256"},
      {{"-n", "2", "--bogus", "p"}, "unknown option --bogus"},
  };
  for (const auto& [args, want] : bad) {
    std::string why;
    EXPECT_EQ(run(args, &o, &why), Parsed::usage_error) << ::testing::PrintToString(args);
    EXPECT_NE(why.find(want), std::string::npos) << ::testing::PrintToString(args) << ": " << why;
  }
  std::string why;
  EXPECT_EQ(run({"-n", "2", "--help"}, &o, &why), Parsed::help);
}

TEST(ProbeArgs, Commands) {
  ProbeOptions o;
  std::string why;
  using C = ProbeOptions::Command;
  ASSERT_EQ(parse_probe_args({"--json", "--sim-dir", "/d", "info", "sim:2"}, true, &o, &why), Parsed::run) << why;
  EXPECT_TRUE(o.json);
  EXPECT_EQ(o.sim_dir, "/d");
  EXPECT_EQ(o.command, C::info);
  EXPECT_EQ(o.device, "sim:2");
  ASSERT_EQ(parse_probe_args({"selftest", "0000:00:04.0", "--json"}, true, &o, &why), Parsed::run);
  EXPECT_EQ(o.command, C::selftest);
  ASSERT_EQ(parse_probe_args({"list"}, false, &o, &why), Parsed::run);
  EXPECT_EQ(o.command, C::list);
  ASSERT_EQ(parse_probe_args({"rdma"}, true, &o, &why), Parsed::run);
  EXPECT_EQ(o.command, C::rdma);
  ASSERT_EQ(parse_probe_args({"--version", "junk"}, true, &o, &why), Parsed::run);
  EXPECT_EQ(o.command, C::version);
  EXPECT_EQ(parse_probe_args({"list", "-h"}, true, &o, &why), Parsed::help);
}

TEST(ProbeArgs, RefusesWithAReason) {
  ProbeOptions o;
  const std::vector<std::pair<std::vector<std::string>, std::string>> bad = {
      {{}, "no command"},
      {{"info"}, "wrong number of arguments to info"},
      {{"list", "x"}, "wrong number of arguments to list"},
      {{"rdma"}, "unknown command 'rdma'"},  // a build without verbs
      {{"--sim-dir"}, "needs a directory"},
      {{"--sim-dir", "", "list"}, "needs a directory"},
      {{"--frob", "list"}, "unknown option --frob"},
      {{"explode"}, "unknown command 'explode'"},
  };
  for (const auto& [args, want] : bad) {
    std::string why;
    EXPECT_EQ(parse_probe_args(args, false, &o, &why), Parsed::usage_error) << ::testing::PrintToString(args);
    EXPECT_NE(why.find(want), std::string::npos) << ::testing::PrintToString(args) << ": " << why;
  }
}

}  // namespace
}  // namespace hcomm::tools

namespace hcomm::sim {
namespace {

TEST(ControlSession, LinesSplitAcrossReadsAndTheLineLimit) {
  Fabric fabric;
  ASSERT_TRUE(fabric.add(std::make_unique<Device>(DeviceConfig{}, &fabric)));
  ControlSession s(fabric);
  bool drop = true;
  auto feed = [&](const std::string& bytes) { return s.feed(bytes.data(), bytes.size(), &drop); };
  EXPECT_EQ(feed("pi"), "");
  EXPECT_FALSE(drop);
  EXPECT_EQ(feed("ng\nfail 0 2\nstats 0\nfail 1"), "ok\nok\nok completed=0 errors=0\n");
  EXPECT_EQ(fabric.device(0)->faults().fail_next.load(), 2u);
  EXPECT_EQ(feed(" 1\n"), "error: usage: fail|corrupt|stale|stall|clear|stats|reset DEV [N]; DEV must be 0..0\n");
  EXPECT_EQ(feed("clear 0\n"), "ok\n");
  EXPECT_EQ(fabric.device(0)->faults().fail_next.load(), 0u);
  EXPECT_EQ(feed(std::string(ControlSession::kMaxLine + 1, 'x')), "error: line too long\n");
  EXPECT_TRUE(drop);
}

}  // namespace
}  // namespace hcomm::sim
