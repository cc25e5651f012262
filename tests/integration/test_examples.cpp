// Integration: the examples in examples/, run as a user would run them
// (under hcomm-run, on the host engine and on the simulated NPU engine with
// hcomm-run --sim; point_to_point also under Open MPI's mpirun), each checked
// for its exit status and for the exact result lines it prints. The expected
// numbers are worked out here from each example's closed form, not taken from
// the examples' own verdicts.
//
// Paths: HCOMM_PROBE_BIN is <build>/tools/hcomm-probe, so hcomm-run is
// <build>/tools/hcomm-run and the examples are <build>/examples/<name>.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/support/child.h"

namespace {

using hcomm::test::lines;
using hcomm::test::sorted;
using Result = hcomm::test::ChildResult;

std::filesystem::path tools_dir() {
  const char* p = std::getenv("HCOMM_PROBE_BIN");
  return p != nullptr ? std::filesystem::path(p).parent_path() : std::filesystem::path("tools");
}
std::string run_bin() { return (tools_dir() / "hcomm-run").string(); }
std::string example(const std::string& name) { return (tools_dir() / ".." / "examples" / name).lexically_normal().string(); }

// Runs args with `engine` as HCOMM_ENGINE, and without the variables that would make it think
// it is already a rank or point it at another simulator; kills it after limit_ms.
Result run(const std::vector<std::string>& args, const std::string& engine, int limit_ms) {
  hcomm::test::ChildEnv env;
  env.unset.insert(env.unset.end(), {"HCOMM_SIM_DIR", "HCOMM_ENGINE"});
  env.set = {{"HCOMM_ENGINE", engine}};
  return hcomm::test::run_child(args, limit_ms, env);
}

// hcomm-run -n N [--sim] --timeout 60 <build>/examples/<name> args... (each run takes
// well under a second on a plain build, and some 20 s at worst under TSan)
Result run_example(const std::string& engine, int n, const std::string& name, const std::vector<std::string>& args = {}) {
  std::vector<std::string> argv = {run_bin(), "-n", std::to_string(n), "--timeout", "60", "--grace", "2"};
  if (engine == "npu") argv.emplace_back("--sim");
  argv.push_back("--");
  argv.push_back(example(name));
  argv.insert(argv.end(), args.begin(), args.end());
  return run(argv, engine, 90000);
}

// The lines of rank output (those hcomm-run prefixed "[r] "; not the simulator's "[sim] "), sorted.
std::vector<std::string> rank_lines(const std::string& out) {
  std::vector<std::string> v;
  for (auto& l : lines(out))
    if (l.size() > 3 && l[0] == '[' && l[1] >= '0' && l[1] <= '9') v.push_back(l);
  std::sort(v.begin(), v.end());
  return v;
}

// ---- the expected numbers, from each example's closed form ----------------------------

// point_to_point: t[i] = (i % 1000) * 0.001f over 1024 x 1024 elements, summed in double.
std::string point_to_point_sum() {
  double s = 0;
  for (size_t i = 0; i < 1024 * 1024; ++i) s += static_cast<double>(static_cast<float>(i % 1000) * 0.001f);
  char b[64];
  std::snprintf(b, sizeof b, "%.3f", s);
  return b;
}

// parameter_server, --elems 2^18 weights w0 = j % 16, 10 steps, W workers: sum_j w_10(j)
// = N w* + (sum w0 - N w*) / 2^10 with w* = -(W+1)/2.
//   W = 1: -262144 + 8.5 * 262144 / 1024 = -259968;  W = 3: -524288 + 9.5 * 256 = -521856
// (2^18 rather than the default 2^20 keeps the TSan build well inside the timeouts.)
const std::vector<std::string> kServerArgs = {"--elems", "262144"};
const char* kServerChecksum2 = "-259968.000000";
const char* kServerChecksum4 = "-521856.000000";

// pipeline, 8 microbatches of 256 x 1024, N stages: (2^N * 31.5 + sum_i (i+1) 2^(N-1-i)) * 2^21.
//   N = 2: (126 + 4) * 2097152 = 272629760;  N = 3: (252 + 11) * 2097152 = 551550976
//   N = 4: (504 + 26) * 2097152 = 1111490560
const char* pipeline_checksum(int n) { return n == 2 ? "272629760.0" : n == 3 ? "551550976.0" : "1111490560.0"; }

class Examples : public testing::TestWithParam<std::string> {
 protected:
  const std::string& engine() const { return GetParam(); }
};

TEST_P(Examples, PointToPoint) {
  Result r = run_example(engine(), 2, "point_to_point");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_EQ(rank_lines(r.out),
            sorted({"[0] rank 0 sent a 1024x1024 fp32 tensor (4194304 bytes) over the " + engine() + " engine",
                    "[1] rank 1 received shape [1024, 1024] (4194304 bytes from rank 0), sum = " + point_to_point_sum()}))
      << r.err;
}

TEST_P(Examples, PutGet) {
  Result r = run_example(engine(), 2, "put_get");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  // sum(i % 1024) = 1024 * 523776; sum((i % 256) / 2) = 4096 * 16320
  EXPECT_EQ(rank_lines(r.out),
            sorted({"[0] rank 0 put a 1024x1024 fp32 tensor (4194304 bytes) into rank 1 over the " + engine() + " engine",
                    "[1] rank 1 received shape [1024, 1024] by put_notify, sum = 536346624.0",
                    "[1] rank 1 got shape [1024, 1024] from rank 0, sum = 66846720.0"}))
      << r.err;
}

TEST_P(Examples, PutGetIntoHbm) {
  if (engine() != "npu") GTEST_SKIP() << "device memory needs the npu engine";
  Result r = run_example(engine(), 2, "put_get", {"--hbm"});
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  auto v = rank_lines(r.out);
  EXPECT_NE(std::find(v.begin(), v.end(), "[1] rank 1 received shape [1024, 1024] by put_notify into HBM, sum = 536346624.0"),
            v.end())
      << r.out << r.err;
  EXPECT_NE(std::find(v.begin(), v.end(), "[1] rank 1 got shape [1024, 1024] from rank 0, sum = 66846720.0"), v.end())
      << r.out << r.err;
}

TEST_P(Examples, ParameterServerOneWorker) {
  Result r = run_example(engine(), 2, "parameter_server", kServerArgs);
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  std::string c = kServerChecksum2;
  EXPECT_EQ(rank_lines(r.out),
            sorted({"[0] server: 10 steps from 1 worker on 262144 fp32 weights over the " + engine() + " engine",
                    "[0] server: checksum " + c + ", analytic " + c + ": match",
                    "[1] worker 1: pulled the step-10 weights, checksum " + c + ": match"}))
      << r.err;
}

TEST_P(Examples, ParameterServerThreeWorkers) {
  Result r = run_example(engine(), 4, "parameter_server", kServerArgs);
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  std::string c = kServerChecksum4;
  EXPECT_EQ(rank_lines(r.out),
            sorted({"[0] server: 10 steps from 3 workers on 262144 fp32 weights over the " + engine() + " engine",
                    "[0] server: checksum " + c + ", analytic " + c + ": match",
                    "[1] worker 1: pulled the step-10 weights, checksum " + c + ": match",
                    "[2] worker 2: pulled the step-10 weights, checksum " + c + ": match",
                    "[3] worker 3: pulled the step-10 weights, checksum " + c + ": match"}))
      << r.err;
}

void expect_pipeline(const std::string& engine, int n, const std::vector<std::string>& args, const char* how) {
  Result r = run_example(engine, n, "pipeline", args);
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  std::string last = "[" + std::to_string(n - 1) + "] stage " + std::to_string(n - 1) + "/" + std::to_string(n) + ": ";
  std::string c = pipeline_checksum(n);
  EXPECT_EQ(rank_lines(r.out),
            sorted({last + "8 microbatches of [256, 1024] fp32 through " + std::to_string(n) + " stages by " + how +
                        " over the " + engine + " engine",
                    last + "checksum " + c + ", analytic " + c + ": match"}))
      << r.err;
}

TEST_P(Examples, PipelineSendRecvTwoStages) { expect_pipeline(engine(), 2, {}, "send/recv"); }
TEST_P(Examples, PipelineSendRecvFourStages) { expect_pipeline(engine(), 4, {}, "send/recv"); }
TEST_P(Examples, PipelinePutNotifyTwoStages) { expect_pipeline(engine(), 2, {"--notify"}, "put_notify"); }
TEST_P(Examples, PipelinePutNotifyFourStages) { expect_pipeline(engine(), 4, {"--notify"}, "put_notify"); }

// A slow last stage: the producers run ahead into the credits and must wait
// (without them they overwrite unread slots and the checksum breaks).
TEST_P(Examples, PipelinePutNotifyBackPressure) {
  expect_pipeline(engine(), 3, {"--notify", "--slow-last", "15"}, "put_notify");
}

INSTANTIATE_TEST_SUITE_P(Engines, Examples, testing::Values(std::string("host"), std::string("npu")),
                         [](const testing::TestParamInfo<std::string>& i) { return i.param; });

// Arguments outside what keeps the arithmetic exact are refused (status 2, passed on by hcomm-run).
TEST(ExamplesArguments, OutOfRangeIsStatus2) {
  EXPECT_EQ(run_example("host", 2, "pipeline", {"--rows", "0"}).status, 2);
  EXPECT_EQ(run_example("host", 2, "parameter_server", {"--steps", "13"}).status, 2);
  EXPECT_EQ(run_example("host", 2, "put_get", {"--bogus"}).status, 2);
}

TEST(ExamplesUnderMpirun, PointToPointOnTheHostEngine) {
  if (::access("/usr/bin/mpirun", X_OK) != 0) GTEST_SKIP() << "/usr/bin/mpirun not installed (openmpi-bin)";
  std::vector<std::string> args = {"/usr/bin/mpirun"};
  if (::getuid() == 0) args.emplace_back("--allow-run-as-root");
  for (const char* a : {"--oversubscribe", "--timeout", "60", "-n", "2"}) args.emplace_back(a);
  args.push_back(example("point_to_point"));
  Result r = run(args, "host", 90000);
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  auto v = lines(r.out);
  EXPECT_NE(std::find(v.begin(), v.end(), "rank 0 sent a 1024x1024 fp32 tensor (4194304 bytes) over the host engine"),
            v.end())
      << r.out << r.err;
  EXPECT_NE(std::find(v.begin(), v.end(),
                      "rank 1 received shape [1024, 1024] (4194304 bytes from rank 0), sum = " + point_to_point_sum()),
            v.end())
      << r.out << r.err;
}

}  // namespace
