// Unit: launch detection from the environment, Bootstrap's argument checks
// and single-rank path (no network), host identity and the mesh's listen
// address from the environment.
#include <arpa/inet.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "api/wireup/bootstrap.h"
#include "api/wireup/host.h"
#include "api/wireup/mesh.h"
#include "tests/support/kv_stores.h"

namespace hcomm::api {
namespace {

const char* kVars[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HCOMM_JOB_ID",
                       "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                       "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_MCA_ess_base_jobid", "PMIX_RANK", "PMIX_NAMESPACE",
                       "PMIX_SIZE"};

// Clears every launch variable for one test and restores them after.
class DetectLaunch : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : kVars) {
      const char* old = std::getenv(v);
      saved_.emplace_back(v, old ? std::optional<std::string>(old) : std::nullopt);
      ::unsetenv(v);
    }
  }
  void TearDown() override {
    for (auto& [k, v] : saved_) {
      if (v) ::setenv(k.c_str(), v->c_str(), 1);
      else ::unsetenv(k.c_str());
    }
  }
  static void set(const char* k, const char* v) { ::setenv(k, v, 1); }
  static Status detect(LaunchInfo* li) { return detect_launch(li); }

  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

TEST_F(DetectLaunch, NothingSetIsSingleRank) {
  LaunchInfo li;
  li.rank = 7;
  ASSERT_TRUE(detect(&li));
  EXPECT_EQ(li.source, "single");
  EXPECT_EQ(li.rank, 0);
  EXPECT_EQ(li.size, 1);
  EXPECT_TRUE(li.master_addr.empty());
}

TEST_F(DetectLaunch, Torchrun) {
  set("RANK", "3");
  set("WORLD_SIZE", "8");
  set("LOCAL_RANK", "1");
  set("MASTER_ADDR", "10.0.0.1");
  set("MASTER_PORT", "29500");
  set("TORCHELASTIC_RUN_ID", "run42");
  LaunchInfo li;
  Status st = detect(&li);
  ASSERT_TRUE(st) << st.to_string();
  EXPECT_EQ(li.source, "torchrun");
  EXPECT_EQ(li.rank, 3);
  EXPECT_EQ(li.size, 8);
  EXPECT_EQ(li.local_rank, 1);
  EXPECT_EQ(li.master_addr, "10.0.0.1");
  EXPECT_EQ(li.master_port, 29500);
  EXPECT_EQ(li.job_id, "run42");
}

TEST_F(DetectLaunch, HcommRunIsTorchrunPlusJobId) {
  set("RANK", "0");
  set("WORLD_SIZE", "2");
  set("MASTER_ADDR", "127.0.0.1");
  set("MASTER_PORT", "4000");
  set("HCOMM_JOB_ID", "job-x");
  LaunchInfo li;
  ASSERT_TRUE(detect(&li));
  EXPECT_EQ(li.source, "hcomm-run");
  EXPECT_EQ(li.job_id, "job-x");
}

TEST_F(DetectLaunch, TorchrunVariablesWinOverOpenMpi) {
  set("RANK", "1");
  set("WORLD_SIZE", "2");
  set("OMPI_COMM_WORLD_RANK", "0");
  set("OMPI_COMM_WORLD_SIZE", "4");
  LaunchInfo li;
  ASSERT_TRUE(detect(&li));
  EXPECT_EQ(li.source, "torchrun");
  EXPECT_EQ(li.rank, 1);
  EXPECT_EQ(li.size, 2);
}

TEST_F(DetectLaunch, OpenMpi) {
  set("OMPI_COMM_WORLD_RANK", "2");
  set("OMPI_COMM_WORLD_SIZE", "4");
  set("OMPI_COMM_WORLD_LOCAL_RANK", "2");
  set("OMPI_MCA_ess_base_jobid", "12345");
  set("PMIX_NAMESPACE", "prterun-x-1");
  LaunchInfo li;
  ASSERT_TRUE(detect(&li));
  EXPECT_EQ(li.source, "openmpi");
  EXPECT_EQ(li.rank, 2);
  EXPECT_EQ(li.size, 4);
  EXPECT_EQ(li.local_rank, 2);
  EXPECT_EQ(li.job_id, "12345");
  EXPECT_TRUE(li.master_addr.empty());
  ::unsetenv("OMPI_MCA_ess_base_jobid");
  ASSERT_TRUE(detect(&li));
  EXPECT_EQ(li.job_id, "prterun-x-1");
}

TEST_F(DetectLaunch, Pmix) {
  set("PMIX_RANK", "1");
  set("PMIX_NAMESPACE", "ns7");
  LaunchInfo li;
  Status st = detect(&li);
  EXPECT_EQ(st.code(), Code::invalid_argument) << "no size anywhere";
  EXPECT_NE(st.message().find("size"), std::string::npos) << st.message();
  set("PMIX_SIZE", "3");
  ASSERT_TRUE(detect(&li));
  EXPECT_EQ(li.source, "pmix");
  EXPECT_EQ(li.rank, 1);
  EXPECT_EQ(li.size, 3);
  EXPECT_EQ(li.job_id, "ns7");
  set("PMIX_RANK", "3");
  EXPECT_EQ(detect(&li).code(), Code::invalid_argument);
}

struct Bad {
  std::vector<std::pair<const char*, const char*>> env;
  const char* names;  // the variable the message must name
};

class DetectLaunchBad : public DetectLaunch, public ::testing::WithParamInterface<Bad> {};

TEST_P(DetectLaunchBad, IsAClearError) {
  for (auto& [k, v] : GetParam().env) set(k, v);
  LaunchInfo li;
  li.rank = 99;
  Status st = detect(&li);
  EXPECT_EQ(st.code(), Code::invalid_argument) << st.to_string();
  EXPECT_NE(st.message().find(GetParam().names), std::string::npos) << st.message();
  EXPECT_EQ(li.rank, 99) << "the output is untouched on error";
}

INSTANTIATE_TEST_SUITE_P(
    Malformed, DetectLaunchBad,
    ::testing::Values(Bad{{{"RANK", "1"}}, "WORLD_SIZE"}, Bad{{{"WORLD_SIZE", "2"}}, "RANK"},
                      Bad{{{"RANK", "x"}, {"WORLD_SIZE", "2"}}, "RANK"},
                      Bad{{{"RANK", "1x"}, {"WORLD_SIZE", "2"}}, "RANK"},
                      Bad{{{"RANK", "-1"}, {"WORLD_SIZE", "2"}}, "RANK"},
                      Bad{{{"RANK", "2"}, {"WORLD_SIZE", "2"}}, "RANK"},
                      Bad{{{"RANK", "0"}, {"WORLD_SIZE", "0"}}, "WORLD_SIZE"},
                      Bad{{{"RANK", "0"}, {"WORLD_SIZE", "99999999999999999999"}}, "WORLD_SIZE"},
                      Bad{{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "a"}}, "LOCAL_RANK"},
                      Bad{{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}}, "MASTER_PORT"},
                      Bad{{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "5"}}, "MASTER_ADDR"},
                      Bad{{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "0"}},
                          "MASTER_PORT"},
                      Bad{{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "65536"}},
                          "MASTER_PORT"},
                      Bad{{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "http"}},
                          "MASTER_PORT"},
                      Bad{{{"OMPI_COMM_WORLD_RANK", "4"}, {"OMPI_COMM_WORLD_SIZE", "4"}}, "OMPI_COMM_WORLD_RANK"},
                      Bad{{{"OMPI_COMM_WORLD_RANK", "0"}}, "OMPI_COMM_WORLD_SIZE"},
                      Bad{{{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "two"}}, "OMPI_COMM_WORLD_SIZE"}));

TEST(BootstrapArgs, RejectsNonsense) {
  std::unique_ptr<Bootstrap> b;
  LaunchInfo li;
  li.size = 0;
  EXPECT_EQ(Bootstrap::create(li, 1000, &b).code(), Code::invalid_argument);
  li.size = 2;
  li.rank = 2;
  EXPECT_EQ(Bootstrap::create(li, 1000, &b).code(), Code::invalid_argument);
  li.rank = 0;
  EXPECT_EQ(Bootstrap::create(li, 0, &b).code(), Code::invalid_argument);
  // Neither a master address nor a job id to name the port file by.
  Status st = Bootstrap::create(li, 1000, &b);
  EXPECT_EQ(st.code(), Code::invalid_argument);
  EXPECT_NE(st.message().find("MASTER_ADDR"), std::string::npos) << st.message();
  li.master_addr = "127.0.0.1";
  li.master_port = 0;
  EXPECT_EQ(Bootstrap::create(li, 1000, &b).code(), Code::invalid_argument);
  EXPECT_EQ(Bootstrap::create(li, 1000, nullptr).code(), Code::invalid_argument);
  EXPECT_EQ(b, nullptr);
}

TEST(BootstrapArgs, SingleRankNeedsNoNetwork) {
  std::unique_ptr<Bootstrap> b;
  LaunchInfo li;
  ASSERT_TRUE(Bootstrap::create(li, 1000, &b));
  EXPECT_EQ(b->rank(), 0);
  EXPECT_EQ(b->size(), 1);
  EXPECT_FALSE(b->job_id().empty());
  std::vector<std::string> all;
  ASSERT_TRUE(b->allgather("mine", &all, Deadline::after_ms(100)));
  EXPECT_EQ(all, std::vector<std::string>{"mine"});
  EXPECT_TRUE(b->barrier(Deadline::after_ms(100)));
  EXPECT_EQ(b->allgather(std::string(Bootstrap::kMaxBlob + 1, 'x'), &all, Deadline::after_ms(100)).code(),
            Code::invalid_argument);
  EXPECT_EQ(b->allgather("x", nullptr, Deadline::after_ms(100)).code(), Code::invalid_argument);
}


// ---- the idle hook's schedule (what a collective's wait wakes for) ----

// A bootstrap whose every collective "waits" through `slices` idle slices and
// records how long each would be.
class SliceRecorder : public Bootstrap {
 public:
  SliceRecorder() : Bootstrap(0, 2, "slices") {}
  int slices = 0;
  std::vector<int> seen;

 protected:
  Status exchange(uint32_t, Collective, const std::string& mine, std::vector<std::string>* all,
                  const Deadline&) override {
    for (int i = 0; i < slices; ++i) {
      seen.push_back(idle_slice_ms());
      idle();
    }
    all->assign(2, mine);
    return Status::ok();
  }
};

TEST(BootstrapIdle, SlicesDoubleWhileIdleShrinkOnWorkAndRestartEachCollective) {
  SliceRecorder b;
  int calls = 0;
  std::vector<bool> work;  // what the hook answers, call by call
  b.on_idle([&] { return calls < static_cast<int>(work.size()) && work[static_cast<size_t>(calls++)]; });
  b.slices = 8;
  work.assign(8, false);
  ASSERT_TRUE(b.barrier(Deadline::after_ms(1000)));
  EXPECT_EQ(b.seen, (std::vector<int>{2, 4, 8, 16, 32, 32, 32, 32}));
  EXPECT_EQ(calls, 8);
  // A notice answered (the hook found work): the next slice is short again.
  b.seen.clear();
  calls = 0;
  work = {false, false, false, true, false, false};
  b.slices = 6;
  ASSERT_TRUE(b.barrier(Deadline::after_ms(1000)));
  EXPECT_EQ(b.seen, (std::vector<int>{2, 4, 8, 16, 2, 4}));
  // A new collective starts short, whatever the last one ended at.
  b.seen.clear();
  calls = 0;
  work.assign(1, false);
  b.slices = 1;
  ASSERT_TRUE(b.barrier(Deadline::after_ms(1000)));
  EXPECT_EQ(b.seen, (std::vector<int>{2}));
}


// ---- host identity and the mesh's listen address ----

class HostEnv : public DetectLaunch {
 protected:
  void SetUp() override {
    DetectLaunch::SetUp();
    for (const char* v : {"HCOMM_HOST_ID", "HCOMM_SOCKET_ADDR", "HCOMM_SOCKET_IFNAME", "HCOMM_KEEPALIVE_MS"}) {
      const char* old = std::getenv(v);
      saved_.emplace_back(v, old ? std::optional<std::string>(old) : std::nullopt);
      ::unsetenv(v);
    }
  }
};

TEST_F(HostEnv, HostIdIsTheOverrideElseHostnameAndBootId) {
  std::string dflt = host_id();
  EXPECT_NE(dflt.find('/'), std::string::npos) << dflt << ": hostname/boot_id";
  EXPECT_EQ(dflt, host_id()) << "stable";
  set("HCOMM_HOST_ID", "rack7-node3");
  EXPECT_EQ(host_id(), "rack7-node3");
}

TEST_F(HostEnv, ListenAddressOverridesAndDefault) {
  std::string a;
  set("HCOMM_SOCKET_ADDR", "10.1.2.3");
  ASSERT_TRUE(mesh_listen_address(&a));
  EXPECT_EQ(a, "10.1.2.3");
  set("HCOMM_SOCKET_ADDR", "::1");
  ASSERT_TRUE(mesh_listen_address(&a));
  EXPECT_EQ(a, "::1");
  set("HCOMM_SOCKET_ADDR", "node7");
  EXPECT_EQ(mesh_listen_address(&a).code(), Code::invalid_argument);
  ::unsetenv("HCOMM_SOCKET_ADDR");
  set("HCOMM_SOCKET_IFNAME", "lo");
  ASSERT_TRUE(mesh_listen_address(&a));
  EXPECT_EQ(a, "127.0.0.1");
  set("HCOMM_SOCKET_IFNAME", "no-such-if0");
  Status st = mesh_listen_address(&a);
  EXPECT_EQ(st.code(), Code::not_found) << st.to_string();
  EXPECT_NE(st.message().find("no such interface"), std::string::npos) << st.message();
  ::unsetenv("HCOMM_SOCKET_IFNAME");
  set("MASTER_ADDR", "127.0.0.1");
  ASSERT_TRUE(mesh_listen_address(&a));
  EXPECT_EQ(a, "127.0.0.1") << "the route to MASTER_ADDR";
  ::unsetenv("MASTER_ADDR");
  ASSERT_TRUE(mesh_listen_address(&a));
  in6_addr buf;
  EXPECT_EQ(::inet_pton(AF_INET, a.c_str(), &buf), 1) << a << ": an IPv4 address of an interface, else 127.0.0.1";
}

TEST_F(HostEnv, BadKeepaliveIsInvalidArgumentBeforeAnyExchange) {
  test::MemStore store;
  std::vector<std::unique_ptr<Bootstrap>> b(2);
  std::thread t([&] { ASSERT_TRUE(Bootstrap::from_store(1, 2, "ka", kv_store_from_c(store.c()), 5000, &b[1])); });
  ASSERT_TRUE(Bootstrap::from_store(0, 2, "ka", kv_store_from_c(store.c()), 5000, &b[0]));
  t.join();
  for (const char* bad : {"5s", "999", "3600001"}) {
    set("HCOMM_KEEPALIVE_MS", bad);
    std::vector<MeshLink> links;
    Status st = connect_mesh(*b[0], Deadline::after_ms(1000), &links);
    EXPECT_EQ(st.code(), Code::invalid_argument) << bad << ": " << st.to_string();
    EXPECT_NE(st.message().find("HCOMM_KEEPALIVE_MS"), std::string::npos) << st.message();
  }
  ::unsetenv("HCOMM_KEEPALIVE_MS");
}

}  // namespace
}  // namespace hcomm::api
