// Integration: the hcomm-run launcher (prefixing, exit statuses, grace,
// --timeout, signal cleanup, --sim) and bootstrap under real launchers
// (hcomm-run and, where installed, Open MPI's mpirun).
#include <gtest/gtest.h>

#include <chrono>
#include <signal.h>
#include <unistd.h>

#include <set>
#include <string>
#include <vector>

#include "tests/support/child.h"

namespace {

using hcomm::test::env_or;
using hcomm::test::lines;
using hcomm::test::sorted_lines;
using hcomm::test::words;
using Result = hcomm::test::ChildResult;

std::string run_bin() { return env_or("HCOMM_RUN_BIN", "hcomm-run"); }
std::string check_bin() { return env_or("HCOMM_BOOT_CHECK_BIN", "boot_check"); }

Result run(const std::vector<std::string>& args, int limit_ms = 60000) {
  int o = -1, e = -1;
  pid_t pid = hcomm::test::start_child(args, &o, &e);
  EXPECT_GT(pid, 0);
  return hcomm::test::finish_child(pid, o, e, limit_ms);
}

TEST(HcommRun, PrefixesEveryLineByRank) {
  Result r = run({run_bin(), "-n", "3", "sh", "-c", "echo hi from $RANK"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(sorted_lines(r.out), (std::vector<std::string>{"[0] hi from 0", "[1] hi from 1", "[2] hi from 2"}));
}

TEST(HcommRun, KeepsStdoutAndStderrApart) {
  Result r = run({run_bin(), "-n", "2", "--", "sh", "-c", "echo out $RANK; echo err $RANK >&2; printf tail"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(sorted_lines(r.out), (std::vector<std::string>{"[0] out 0", "[0] tail", "[1] out 1", "[1] tail"}));
  EXPECT_EQ(sorted_lines(r.err), (std::vector<std::string>{"[0] err 0", "[1] err 1"}));
}

TEST(HcommRun, SetsTheLaunchEnvironment) {
  Result r = run({run_bin(), "-n", "2", "sh", "-c",
                  "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $HCOMM_JOB_ID"});
  ASSERT_EQ(r.status, 0) << r.err;
  auto v = sorted_lines(r.out);
  ASSERT_EQ(v.size(), 2u) << r.out;
  // [r] RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT HCOMM_JOB_ID
  auto w0 = words(v[0]), w1 = words(v[1]);
  ASSERT_EQ(w0.size(), 8u) << v[0];
  ASSERT_EQ(w1.size(), 8u) << v[1];
  EXPECT_EQ(std::vector<std::string>(w0.begin(), w0.begin() + 6),
            (std::vector<std::string>{"[0]", "0", "2", "0", "2", "127.0.0.1"}));
  EXPECT_EQ(std::vector<std::string>(w1.begin(), w1.begin() + 6),
            (std::vector<std::string>{"[1]", "1", "2", "1", "2", "127.0.0.1"}));
  EXPECT_GT(std::stoi(w0[6]), 0);
  EXPECT_EQ(w0[6], w1[6]) << "one port for the job";
  EXPECT_EQ(w0[7], w1[7]) << "one job id for the job";
  Result again = run({run_bin(), "-n", "1", "sh", "-c", "echo $HCOMM_JOB_ID"});
  EXPECT_NE(again.out, "[0] " + w0[7] + "\n") << "job ids are unique per run";
}

TEST(HcommRun, LinesNeverMix) {
  // 3 ranks x 2000 lines of 300 bytes race through the pipes.
  std::string script =
      "x=$(printf '%0300d' 0); i=0; while [ $i -lt 2000 ]; do echo \"r$RANK-$i-$x\"; i=$((i+1)); done";
  Result r = run({run_bin(), "-n", "3", "sh", "-c", script});
  ASSERT_EQ(r.status, 0) << r.err;
  // Every line must be exactly "[r] r<r>-<i>-<300 zeros>", i counting up per rank.
  int next[3] = {0, 0, 0};
  for (const auto& l : lines(r.out)) {
    ASSERT_GE(l.size(), 8u) << "mangled line: " << l;
    int rank = l[1] - '0';
    ASSERT_TRUE(rank >= 0 && rank < 3) << "mangled line: " << l.substr(0, 80);
    std::string expect = "[" + std::to_string(rank) + "] r" + std::to_string(rank) + "-" +
                         std::to_string(next[rank]) + "-" + std::string(300, '0');
    ASSERT_EQ(l, expect) << "mangled or out-of-order line";
    ++next[rank];
  }
  for (int n : next) EXPECT_EQ(n, 2000);
}

TEST(HcommRun, ReturnsTheWorstExitStatus) {
  EXPECT_EQ(run({run_bin(), "-n", "3", "sh", "-c", "exit $((RANK * 2))"}).status, 4);
  EXPECT_EQ(run({run_bin(), "-n", "3", "sh", "-c", "[ $RANK = 1 ] && kill -9 $$; exit 0"}).status, 128 + SIGKILL);
  EXPECT_EQ(run({run_bin(), "-n", "1", "/nonexistent/program"}).status, 127);
}

TEST(HcommRun, StopsTheOthersAfterTheGracePeriod) {
  Result r = run({run_bin(), "-n", "3", "--grace", "0.5", "sh", "-c", "[ $RANK = 1 ] && exit 5; exec sleep 60"});
  EXPECT_EQ(r.status, 5) << "the failing rank's status, not that of the ranks stopped for it; " << r.err;
  EXPECT_LT(r.ms, 5000);
  EXPECT_NE(r.err.find("rank 1 failed"), std::string::npos) << r.err;
}

TEST(HcommRun, TimeoutKillsEverythingWith124) {
  Result r = run({run_bin(), "-n", "2", "--timeout", "1", "sh", "-c", "trap '' TERM; sleep 60"});
  EXPECT_EQ(r.status, 124) << r.err;
  EXPECT_GE(r.ms, 900);
  EXPECT_LT(r.ms, 6000) << "SIGTERM ignored: SIGKILL follows 2 s later";
}

TEST(HcommRun, SigtermStopsEveryRank) {
  int o = -1, e = -1;
  pid_t pid = hcomm::test::start_child({run_bin(), "-n", "2", "sh", "-c", "echo pid $$; exec sleep 60"}, &o, &e);
  ASSERT_GT(pid, 0);
  std::vector<pid_t> kids;
  bool signalled = false;
  Result r = hcomm::test::finish_child(pid, o, e, 20000, [&](const std::string& out) {
    if (signalled) return;
    kids.clear();
    for (const auto& l : lines(out)) {
      auto w = words(l);
      if (w.size() == 3 && w[1] == "pid") kids.push_back(std::stoi(w[2]));
    }
    if (kids.size() == 2) {
      signalled = true;
      ::kill(pid, SIGTERM);
    }
  });
  ASSERT_TRUE(signalled) << r.out << r.err;
  EXPECT_EQ(r.status, 128 + SIGTERM) << r.err;
  EXPECT_LT(r.ms, 10000);
  for (pid_t k : kids) EXPECT_NE(::kill(k, 0), 0) << "rank process " << k << " outlived hcomm-run";
}

TEST(HcommRun, StartsTheSimulatorWhenAsked) {
  Result r = run({run_bin(), "--sim", "-n", "3", "sh", "-c", "[ -S $HCOMM_SIM_DIR/npu2.sock ] && echo found"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(sorted_lines(r.out), (std::vector<std::string>{"[0] found", "[1] found", "[2] found"})) << r.err;
  // ... and stops it: its directory is gone.
  Result d = run({run_bin(), "--sim", "--sim-devices", "1", "-n", "1", "sh", "-c", "echo $HCOMM_SIM_DIR"});
  ASSERT_EQ(d.status, 0) << d.err;
  ASSERT_EQ(d.out.rfind("[0] /", 0), 0u) << d.out;
  std::string dir = d.out.substr(4, d.out.size() - 5);
  EXPECT_NE(::access(dir.c_str(), F_OK), 0) << dir << " survived";
}

// The simulator it started dies mid-run (the new user killed it):
// hcomm-run says so and stops the ranks within its 2 s, not at --timeout.
TEST(HcommRun, StopsTheRanksWhenItsSimulatorDies) {
  auto t0 = std::chrono::steady_clock::now();
  Result r = run({run_bin(), "--sim", "--sim-devices", "2", "-n", "2", "--timeout", "60", "sh", "-c",
                  "if [ $RANK = 0 ]; then sleep 0.5; kill -9 $(cat $HCOMM_SIM_DIR/ready); fi; sleep 30"});
  const auto s = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.status, 0) << r.err;
  EXPECT_NE(r.status, 124) << "stopped by --timeout, not by the simulator's death: " << r.err;
  EXPECT_NE(r.err.find("hcomm-sim exited early"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("NPUs are gone"), std::string::npos) << r.err;
  EXPECT_LT(s, 15) << r.err;
}

// HCOMM_ENGINE=npu and no simulator where the driver would look: hcomm-run starts one.
TEST(HcommRun, StartsTheSimulatorWhenTheProgramWantsADeviceAndNoneExists) {
  Result r = run({"/usr/bin/env", "HCOMM_ENGINE=npu", "HCOMM_SIM_DIR=/nonexistent/hcomm-sim", run_bin(), "-n", "2",
                  "sh", "-c", "[ -S $HCOMM_SIM_DIR/npu1.sock ] && echo found $HCOMM_SIM_DIR"});
  EXPECT_EQ(r.status, 0) << r.err;
  auto v = sorted_lines(r.out);
  ASSERT_EQ(v.size(), 2u) << r.out << r.err;
  EXPECT_EQ(v[0].rfind("[0] found /tmp/", 0), 0u) << v[0];
  // Without HCOMM_ENGINE=npu nothing is started.
  Result plain = run({"/usr/bin/env", "HCOMM_SIM_DIR=/nonexistent/hcomm-sim", run_bin(), "-n", "1", "sh", "-c",
                      "echo $HCOMM_SIM_DIR"});
  EXPECT_EQ(plain.out, "[0] /nonexistent/hcomm-sim\n");
}

TEST(HcommRun, UsageErrorsAreStatus2) {
  EXPECT_EQ(run({run_bin(), "sh"}).status, 2);
  EXPECT_EQ(run({run_bin(), "-n", "0", "sh"}).status, 2);
  EXPECT_EQ(run({run_bin(), "-n", "2"}).status, 2);
  EXPECT_EQ(run({run_bin(), "-n", "2", "--timeout", "x", "sh"}).status, 2);
}

TEST(Launchers, BootstrapUnderHcommRun) {
  Result r = run({run_bin(), "-n", "4", "--timeout", "60", check_bin()});
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_EQ(sorted_lines(r.out),
            (std::vector<std::string>{"[0] boot_check rank 0/4 source=hcomm-run ok",
                                      "[1] boot_check rank 1/4 source=hcomm-run ok",
                                      "[2] boot_check rank 2/4 source=hcomm-run ok",
                                      "[3] boot_check rank 3/4 source=hcomm-run ok"}))
      << r.err;
}

TEST(Launchers, BootstrapUnderMpirun) {
  if (::access("/usr/bin/mpirun", X_OK) != 0) GTEST_SKIP() << "/usr/bin/mpirun not installed (openmpi-bin)";
  std::vector<std::string> args = {"/usr/bin/mpirun"};
  if (::getuid() == 0) args.push_back("--allow-run-as-root");
  for (const char* a : {"--oversubscribe", "-n", "2"}) args.emplace_back(a);
  args.push_back(check_bin());
  Result r = run(args, 120000);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  std::set<std::string> got;
  for (const auto& l : lines(r.out)) got.insert(l);
  EXPECT_TRUE(got.count("boot_check rank 0/2 source=openmpi ok")) << r.out << r.err;
  EXPECT_TRUE(got.count("boot_check rank 1/2 source=openmpi ok")) << r.out << r.err;
}

}  // namespace
