// The transport seam seen through the public C API (API 0.2): which lanes
// serve each peer (hcomm_peer_transport), HCOMM_TRANSPORTS /
// hcomm_config_t.transports (allowed sets, refused ones, no silent
// fallback), ranks that look like two hosts with no transport between them,
// starting from a key-value store the job already has (hcomm_config_t.store),
// and the packed remote key v2 (what hcomm_rkey_import refuses).
//
// Every rank is a real process (tests/support/ranks.h); the NPU cases start
// their own hcomm-sim (tests/support/sim_process.h). Every wait is bounded.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <hcomm/hcomm.h>
#include <hcomm/hcomm.hpp>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "api/core/context.h"  // Context::on_am: a peer's message, forged below
#include "tests/support/keys.h"
#include "tests/support/ranks.h"
#include "tests/support/sim_process.h"

namespace hcomm {
namespace {

using test::run_ranks;

constexpr int T = 20000;  // ms: every wait in these tests is bounded
using Env = std::vector<std::pair<std::string, std::string>>;

// Variables of the parent's environment that would change what these tests
// ask for; each test sets what it needs in its ranks.
class CleanEnv : public ::testing::Environment {
 public:
  void SetUp() override {
    for (const char* v : {"HCOMM_TRANSPORTS", "HCOMM_ENGINE", "HCOMM_DEVICE", "HCOMM_HOST_ID", "HCOMM_SOCKET_ADDR",
                          "HCOMM_SOCKET_IFNAME", "HCOMM_KEEPALIVE_MS", "HCOMM_PEER_CHECK_MS"})
      ::unsetenv(v);
  }
};
const auto* const g_clean_env = ::testing::AddGlobalTestEnvironment(new CleanEnv);

bool contains(const char* haystack, const std::string& needle) {
  return haystack != nullptr && std::string(haystack).find(needle) != std::string::npos;
}

hcomm_config_t config(int bootstrap_timeout_ms = 10000) {
  hcomm_config_t c;
  hcomm_config_init(&c);
  c.bootstrap_timeout_ms = bootstrap_timeout_ms;
  return c;
}

// Everyone's key for `m`, by rank, shipped over two-sided messages with `tag`.
std::vector<hcomm_rkey_t*> exchange_keys(hcomm_context_t* ctx, hcomm_mem_t* m, uint64_t tag) {
  const int me = hcomm_rank(ctx), n = hcomm_size(ctx);
  uint8_t mine[HCOMM_RKEY_MAX];
  size_t len = sizeof mine;
  RCHECK_OK(hcomm_mem_rkey_pack(m, mine, &len));
  RCHECK(len <= HCOMM_RKEY_MAX) << len;
  std::vector<hcomm_request_t*> sends;
  for (int r = 0; r < n; ++r) {
    if (r == me) continue;
    hcomm_request_t* q = nullptr;
    RCHECK_OK(hcomm_isend(ctx, r, mine, len, tag, &q));
    sends.push_back(q);
  }
  std::vector<hcomm_rkey_t*> keys(static_cast<size_t>(n), nullptr);
  for (int r = 0; r < n; ++r) {
    uint8_t blob[HCOMM_RKEY_MAX];
    size_t blen = len;
    if (r == me) {
      std::memcpy(blob, mine, len);
    } else {
      hcomm_recv_info_t info;
      RCHECK_OK(hcomm_recv(ctx, r, blob, sizeof blob, tag, HCOMM_TAG_MASK_ALL, &info, T));
      blen = info.length;
    }
    RCHECK_OK(hcomm_rkey_import(ctx, r, blob, blen, &keys[static_cast<size_t>(r)]));
  }
  for (auto* q : sends) {
    RCHECK_OK(hcomm_wait(q, T));
    hcomm_request_free(q);
  }
  return keys;
}

void release_keys(std::vector<hcomm_rkey_t*>& keys) {
  for (auto* k : keys) RCHECK_OK(hcomm_rkey_release(k));
  keys.clear();
}

uint8_t pattern(int rank, size_t i) { return static_cast<uint8_t>(rank * 37 + i * 11 + (i >> 10)); }

// Rank me sends 1 MiB from a plain (unregistered) vector to the next rank
// (rendezvous: the receiver's raw read), and puts into the next rank's
// hcomm_mem_alloc memory; both checked byte by byte.
void sendrecv_and_put(hcomm_context_t* ctx, size_t msg) {
  const int me = hcomm_rank(ctx), n = hcomm_size(ctx);
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  std::vector<uint8_t> sbuf(msg), rbuf(msg, 0);
  for (size_t i = 0; i < msg; ++i) sbuf[i] = pattern(me, i);
  hcomm_recv_info_t info{};
  RCHECK_OK(hcomm_sendrecv(ctx, next, sbuf.data(), msg, 5, prev, rbuf.data(), msg, 5, HCOMM_TAG_MASK_ALL, &info, T));
  RCHECK(info.source == prev && info.length == msg) << info.source << " " << info.length;
  for (size_t i = 0; i < msg; ++i) RCHECK(rbuf[i] == pattern(prev, i)) << "byte " << i;

  constexpr size_t kWin = 64 * 1024;
  hcomm_mem_t* win = nullptr;
  hcomm_mem_t* src = nullptr;
  RCHECK_OK(hcomm_mem_alloc(ctx, kWin, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &win));
  RCHECK_OK(hcomm_mem_alloc(ctx, kWin, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &src));
  auto* s = static_cast<uint8_t*>(hcomm_mem_ptr(src));
  for (size_t i = 0; i < kWin; ++i) s[i] = pattern(me + 100, i);
  auto keys = exchange_keys(ctx, win, 77);
  RCHECK_OK(hcomm_put(ctx, s, kWin, keys[static_cast<size_t>(next)], 0, T));
  RCHECK_OK(hcomm_flush(ctx, -1, T));
  RCHECK_OK(hcomm_barrier(ctx, T));
  const auto* w = static_cast<const uint8_t*>(hcomm_mem_ptr(win));
  for (size_t i = 0; i < kWin; ++i) RCHECK(w[i] == pattern(prev + 100, i)) << "window byte " << i;
  // And back: get the next rank's window (which holds our data).
  std::memset(s, 0, kWin);
  RCHECK_OK(hcomm_get(ctx, s, kWin, keys[static_cast<size_t>(next)], 0, T));
  for (size_t i = 0; i < kWin; ++i) RCHECK(s[i] == pattern(me + 100, i)) << "get byte " << i;
  RCHECK_OK(hcomm_barrier(ctx, T));
  release_keys(keys);
  RCHECK_OK(hcomm_mem_release(src));
  RCHECK_OK(hcomm_mem_release(win));
}

// ---- lanes per peer --------------------------------------------------------------------------

class Lanes : public ::testing::TestWithParam<int> {};

TEST_P(Lanes, HostEngineServesEveryRankWithShmAndCma) {
  const int n = GetParam();
  std::string err = run_ranks(n, {{"HCOMM_ENGINE", "host"}}, [&](int rank) {
    hcomm_config_t cfg = config();
    hcomm_context_t* ctx = nullptr;
    RCHECK_OK(hcomm_init(&cfg, &ctx));
    RCHECK(hcomm_rank(ctx) == rank && hcomm_size(ctx) == n);
    RCHECK(std::string(hcomm_engine_name(ctx)) == "host") << hcomm_engine_name(ctx);
    for (int r = 0; r < n; ++r) {
      const char* t = hcomm_peer_transport(ctx, r);
      RCHECK(t != nullptr && std::string(t) == "shm,cma") << "rank " << r << ": " << (t ? t : "(null)");
    }
    RCHECK(hcomm_peer_transport(ctx, -1) == nullptr);
    RCHECK(hcomm_peer_transport(ctx, n) == nullptr);
    RCHECK(hcomm_peer_transport(nullptr, 0) == nullptr);
    RCHECK_OK(hcomm_finalize(ctx));
  }, 60);
  EXPECT_EQ(err, "");
}

INSTANTIATE_TEST_SUITE_P(Ranks, Lanes, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& i) { return std::to_string(i.param) + "ranks"; });

class NpuLanes : public ::testing::TestWithParam<int> {
 protected:
  static void SetUpTestSuite() {
    sim_ = new test::SimProcess();
    std::string err = sim_->start({"--devices", "3", "--hbm", "64M"});
    if (!err.empty()) {
      delete sim_;
      sim_ = nullptr;
      FAIL() << err;
    }
  }
  static void TearDownTestSuite() {
    delete sim_;
    sim_ = nullptr;
  }
  static test::SimProcess* sim_;
};
test::SimProcess* NpuLanes::sim_ = nullptr;

TEST_P(NpuLanes, NpuEngineServesEveryRankWithShmNpuCma) {
  ASSERT_NE(sim_, nullptr);
  const int n = GetParam();
  // All transports present, and all named (in another order: the list says
  // what is allowed, not the order of preference).
  for (const char* list : {"", "cma,npu,shm"}) {
    std::string err = run_ranks(n, {{"HCOMM_ENGINE", "npu"}, {"HCOMM_SIM_DIR", sim_->dir()}}, [&](int rank) {
      hcomm_config_t cfg = config();
      if (*list != '\0') cfg.transports = list;
      hcomm_context_t* ctx = nullptr;
      RCHECK_OK(hcomm_init(&cfg, &ctx));
      RCHECK(hcomm_rank(ctx) == rank);
      RCHECK(std::string(hcomm_engine_name(ctx)) == "npu") << hcomm_engine_name(ctx);
      for (int r = 0; r < n; ++r) {
        const char* t = hcomm_peer_transport(ctx, r);
        RCHECK(t != nullptr && std::string(t) == "shm,npu,cma") << "rank " << r << ": " << (t ? t : "(null)");
      }
      RCHECK(hcomm_peer_transport(ctx, -1) == nullptr);
      RCHECK(hcomm_peer_transport(ctx, n) == nullptr);
      // Packed keys of both kinds of memory fit HCOMM_RKEY_MAX (npu adds a section).
      for (unsigned kind : {HCOMM_MEM_HOST, HCOMM_MEM_DEVICE}) {
        hcomm_mem_t* m = nullptr;
        RCHECK_OK(hcomm_mem_alloc(ctx, 4096, kind, HCOMM_ACCESS_ALL, &m));
        uint8_t key[HCOMM_RKEY_MAX];
        size_t len = sizeof key;
        RCHECK_OK(hcomm_mem_rkey_pack(m, key, &len));
        RCHECK(len > 0 && len <= HCOMM_RKEY_MAX) << len;
        RCHECK_OK(hcomm_mem_release(m));
      }
      RCHECK_OK(hcomm_finalize(ctx));
    }, 60);
    EXPECT_EQ(err, "") << "transports '" << list << "'";
  }
}

// A device-memory key names the owner's NPU on the fabric in its npu
// section. Rank 1 takes rank 0's key and puts rank 2's fabric index into
// that section: the header still matches rank 0's live registration, but the
// key now points at rank 2's HBM. The import must refuse it (the section
// disagrees with the owner's registry entry) and nothing of rank 2's memory
// may be read. DISABLED: api/transport/npu/npu.cpp imports the fabric index
// unchecked today (see the report that came with this test).
TEST_P(NpuLanes, ForgedFabricIndexIsRefused) {
  ASSERT_NE(sim_, nullptr);
  if (GetParam() != 3) GTEST_SKIP() << "needs 3 ranks";
  std::string err = run_ranks(3, {{"HCOMM_ENGINE", "npu"}, {"HCOMM_SIM_DIR", sim_->dir()}}, [&](int rank) {
    hcomm_config_t cfg = config();
    hcomm_context_t* ctx = nullptr;
    RCHECK_OK(hcomm_init(&cfg, &ctx));
    constexpr size_t kWin = 4096;
    hcomm_mem_t* m = nullptr;
    RCHECK_OK(hcomm_mem_alloc(ctx, kWin, HCOMM_MEM_DEVICE, HCOMM_ACCESS_ALL, &m));
    auto* p = static_cast<uint8_t*>(hcomm_mem_ptr(m));
    RCHECK(p != nullptr);
    for (size_t i = 0; i < kWin; ++i) p[i] = pattern(rank, i);
    uint8_t key[HCOMM_RKEY_MAX];
    size_t len = sizeof key;
    RCHECK_OK(hcomm_mem_rkey_pack(m, key, &len));
    RCHECK(len == 48 + 2 + 4 && key[48] == 3 && key[49] == 4) << "expected one npu section, key of " << len;
    if (rank != 1) {
      RCHECK_OK(hcomm_send(ctx, 1, key, len, 3, T));
    } else {
      uint8_t k0[HCOMM_RKEY_MAX], k2[HCOMM_RKEY_MAX];
      RCHECK_OK(hcomm_recv(ctx, 0, k0, sizeof k0, 3, HCOMM_TAG_MASK_ALL, nullptr, T));
      RCHECK_OK(hcomm_recv(ctx, 2, k2, sizeof k2, 3, HCOMM_TAG_MASK_ALL, nullptr, T));
      std::memcpy(k0 + 50, k2 + 50, 4);  // rank 2's fabric index in rank 0's key
      hcomm_rkey_t* k = nullptr;
      hcomm_status_t st = hcomm_rkey_import(ctx, 0, k0, len, &k);
      if (st == HCOMM_OK) {
        std::vector<uint8_t> got(kWin, 0);
        hcomm_mem_t* local = nullptr;
        RCHECK_OK(hcomm_mem_alloc(ctx, kWin, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &local));
        hcomm_status_t g = hcomm_get(ctx, hcomm_mem_ptr(local), kWin, k, 0, T);
        std::memcpy(got.data(), hcomm_mem_ptr(local), kWin);
        bool rank2 = g == HCOMM_OK && got[1] == pattern(2, 1) && got[kWin - 1] == pattern(2, kWin - 1);
        RCHECK(false) << "forged fabric index imported; get " << hcomm_strerror(g)
                      << (rank2 ? " and read rank 2's memory" : "");
      }
      RCHECK(st == HCOMM_ERR_ACCESS || st == HCOMM_ERR_PROTOCOL) << hcomm_strerror(st) << ": " << hcomm_last_error();
    }
    RCHECK_OK(hcomm_barrier(ctx, T));
    RCHECK_OK(hcomm_mem_release(m));
    RCHECK_OK(hcomm_finalize(ctx));
  }, 60);
  EXPECT_EQ(err, "");
}

INSTANTIATE_TEST_SUITE_P(Ranks, NpuLanes, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& i) { return std::to_string(i.param) + "ranks"; });

// ---- HCOMM_TRANSPORTS / hcomm_config_t.transports ------------------------------------------

TEST(Transports, ShmCmaFromTheEnvironmentWorks) {
  std::string err = run_ranks(2, {{"HCOMM_TRANSPORTS", "shm,cma"}}, [&](int) {
    hcomm_config_t cfg = config();
    hcomm_context_t* ctx = nullptr;
    RCHECK_OK(hcomm_init(&cfg, &ctx));
    RCHECK(std::string(hcomm_engine_name(ctx)) == "host") << hcomm_engine_name(ctx);
    for (int r = 0; r < 2; ++r) RCHECK(std::string(hcomm_peer_transport(ctx, r)) == "shm,cma");
    sendrecv_and_put(ctx, 1 << 20);
    RCHECK_OK(hcomm_finalize(ctx));
  }, 60);
  EXPECT_EQ(err, "");
}

// The C++ wrapper of the cancel rule: true when withdrawn, false when the
// request ran to its end (the C cases are in the conformance suite).
TEST(CppApi, RequestCancelSaysWithdrawnOrCompleted) {
  std::string err = run_ranks(2, {{"HCOMM_ENGINE", "host"}}, [&](int rank) {
    hcomm_config_t cfg;
    hcomm_config_init(&cfg);
    cfg.transports = "shm,cma";
    hcomm::Context ctx(cfg);
    const int peer = 1 - rank;
    RCHECK(ctx.peer_transport(peer) == "shm,cma") << ctx.peer_transport(peer);
    std::vector<uint8_t> big(1 << 20, static_cast<uint8_t>(rank + 1));
    uint64_t small = 40 + static_cast<uint64_t>(rank), got = 0;
    hcomm::Request r = ctx.irecv(peer, &got, 8, 7);
    RCHECK(r.cancel()) << "an unmatched receive is withdrawn";
    hcomm::Request rendezvous = ctx.isend(peer, big.data(), big.size(), 8);
    RCHECK(rendezvous.cancel()) << "an unmatched rendezvous send is retracted";
    hcomm::Request eager = ctx.isend(peer, &small, 8, 9);
    RCHECK(!eager.cancel()) << "an eager send is complete once the lane took it";
    RCHECK(ctx.recv(peer, &got, 8, 9).length == 8);
    RCHECK(got == 40 + static_cast<uint64_t>(peer));
    ctx.barrier();
    int found = 1;
    RCHECK_OK(hcomm_probe(ctx.get(), peer, 8, HCOMM_TAG_MASK_ALL, &found, nullptr));
    RCHECK(found == 0) << "the retracted send is not visible";
    ctx.finalize();
  }, 60);
  EXPECT_EQ(err, "");
}

// hcomm::wait_all: finished requests come back empty (freed once, by the C
// call); one still pending at the deadline stays and can be waited for again.
TEST(CppApi, WaitAllEmptiesWhatFinishedAndKeepsWhatDidNot) {
  std::string err = run_ranks(2, {{"HCOMM_ENGINE", "host"}}, [&](int rank) {
    hcomm::Context ctx;
    const int peer = 1 - rank;
    uint64_t mine[3] = {10u + static_cast<uint64_t>(rank), 20u + static_cast<uint64_t>(rank), 0};
    uint64_t got[3] = {0, 0, 0};
    std::vector<hcomm::Request> reqs;
    reqs.push_back(ctx.irecv(peer, &got[0], 8, 1));
    reqs.push_back(ctx.isend(peer, &mine[0], 8, 1));
    reqs.push_back(ctx.irecv(peer, &got[1], 8, 2));
    reqs.push_back(ctx.isend(peer, &mine[1], 8, 2));
    reqs.emplace_back();  // empty: skipped
    hcomm::wait_all(reqs);
    for (const hcomm::Request& r : reqs) RCHECK(!r) << "a finished request is left empty";
    RCHECK(got[0] == 10u + static_cast<uint64_t>(peer) && got[1] == 20u + static_cast<uint64_t>(peer));
    std::vector<hcomm::Request> late;
    late.push_back(ctx.irecv(peer, &got[2], 8, 3));  // sent after the barrier
    try {
      hcomm::wait_all(late, 100);
      RCHECK(false) << "nothing was sent yet";
    } catch (const hcomm::Error& e) {
      RCHECK(e.status() == HCOMM_ERR_TIMEOUT) << e.what();
    }
    RCHECK(static_cast<bool>(late[0])) << "still pending: kept";
    ctx.barrier();
    uint64_t v = 30u + static_cast<uint64_t>(rank);
    ctx.send(peer, &v, 8, 3);
    hcomm::wait_all(late);
    RCHECK(!late[0] && got[2] == 30u + static_cast<uint64_t>(peer));
    ctx.finalize();
  }, 60);
  EXPECT_EQ(err, "");
}

TEST(Transports, ConfigFieldWinsOverTheEnvironment) {
  // The config names the set; the (bogus) variable is not looked at.
  std::string err = run_ranks(2, {{"HCOMM_TRANSPORTS", "bogus"}}, [&](int) {
    hcomm_config_t cfg = config();
    cfg.transports = "shm,cma";
    hcomm_context_t* ctx = nullptr;
    RCHECK_OK(hcomm_init(&cfg, &ctx));
    for (int r = 0; r < 2; ++r) RCHECK(std::string(hcomm_peer_transport(ctx, r)) == "shm,cma");
    sendrecv_and_put(ctx, 1 << 20);
    RCHECK_OK(hcomm_finalize(ctx));
  }, 60);
  EXPECT_EQ(err, "");
}

struct Refusal {
  const char* name;
  const char* list;
  const char* engine;     // HCOMM_ENGINE, or null
  hcomm_status_t want;    // HCOMM_OK: any failure will do
  const char* mentions;   // hcomm_last_error() contains this
};

class Refused : public ::testing::TestWithParam<Refusal> {};

// Each refused set fails hcomm_init on every rank, from the environment and
// from the config field alike, with the status and a message naming the culprit.
TEST_P(Refused, InitFails) {
  const Refusal& p = GetParam();
  for (bool from_env : {true, false}) {
    Env env;
    if (from_env) env.emplace_back("HCOMM_TRANSPORTS", p.list);
    if (p.engine != nullptr) env.emplace_back("HCOMM_ENGINE", p.engine);
    auto start = std::chrono::steady_clock::now();
    std::string err = run_ranks(2, env, [&](int) {
      hcomm_config_t cfg = config(5000);
      if (!from_env) cfg.transports = p.list;
      hcomm_context_t* ctx = nullptr;
      hcomm_status_t st = hcomm_init(&cfg, &ctx);
      RCHECK(st != HCOMM_OK) << "init with transports '" << p.list << "' succeeded (lanes to 0: "
                             << hcomm_peer_transport(ctx, 0) << ")";
      if (p.want != HCOMM_OK) {
        RCHECK(st == p.want) << hcomm_strerror(st) << ", want " << hcomm_strerror(p.want) << ": " << hcomm_last_error();
      }
      RCHECK(contains(hcomm_last_error(), p.mentions))
          << "message does not mention '" << p.mentions << "': " << hcomm_last_error();
      RCHECK(ctx == nullptr);
    }, 30);
    EXPECT_EQ(err, "") << (from_env ? "HCOMM_TRANSPORTS" : "hcomm_config_t.transports") << "=" << p.list;
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Sets, Refused,
    ::testing::Values(Refusal{"bogus", "bogus", nullptr, HCOMM_ERR_INVALID, "bogus"},
                      Refusal{"bogus_in_list", "shm,cma,bogus", nullptr, HCOMM_ERR_INVALID, "bogus"},
                      Refusal{"shm_without_cma", "shm", nullptr, HCOMM_ERR_INVALID, "cma"},
                      Refusal{"cma_without_shm", "cma", nullptr, HCOMM_ERR_INVALID, "shm"},
                      // verbs (between hosts) is forced: never silently replaced by shm.
                      Refusal{"verbs", "verbs", "host", HCOMM_OK, "verbs"},
                      Refusal{"npu_on_host_engine", "npu", "host", HCOMM_ERR_INVALID, "npu"},
                      Refusal{"npu_shm_cma_on_host_engine", "shm,npu,cma", "host", HCOMM_ERR_INVALID, "npu"},
                      Refusal{"npu_engine_without_npu", "shm,cma", "npu", HCOMM_ERR_INVALID, "npu"}),
    [](const ::testing::TestParamInfo<Refusal>& i) { return std::string(i.param.name); });

// ---- two hosts, no transport between them ------------------------------------------------------

// Rank 0 says it is on host "a", rank 1 on host "b": the mesh links them by
// TCP, but shm, cma and npu reach only their own host, so with nothing that
// crosses hosts init fails on both ranks, promptly, naming the peer.
TEST(TwoHosts, NoCrossHostTransportFailsInitOnBoth) {
  bool have_rdma = std::filesystem::exists("/sys/class/infiniband") &&
                   !std::filesystem::is_empty("/sys/class/infiniband");
  for (const char* forced : {"shm,cma", ""}) {
    if (*forced == '\0' && have_rdma) continue;  // verbs might really connect the "hosts" here
    Env env = {{"HCOMM_ENGINE", "host"}, {"HCOMM_SOCKET_ADDR", "127.0.0.1"}};
    if (*forced != '\0') env.emplace_back("HCOMM_TRANSPORTS", forced);
    auto start = std::chrono::steady_clock::now();
    std::string err = run_ranks(2, env, [&](int rank) {
      ::setenv("HCOMM_HOST_ID", rank == 0 ? "a" : "b", 1);
      hcomm_config_t cfg = config(8000);
      hcomm_context_t* ctx = nullptr;
      hcomm_status_t st = hcomm_init(&cfg, &ctx);
      RCHECK(st != HCOMM_OK) << "init across two hosts without a cross-host transport succeeded";
      const std::string other = std::to_string(1 - rank);
      RCHECK(contains(hcomm_last_error(), "rank " + other) || contains(hcomm_last_error(), rank == 0 ? "\"b\"" : "\"a\""))
          << "message names neither rank " << other << " nor its host: " << hcomm_last_error();
    }, 30);
    EXPECT_EQ(err, "") << "HCOMM_TRANSPORTS=" << forced;
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15));
  }
}

// ---- starting from a store ---------------------------------------------------------------------

// A store the job "already has": one file per key in a directory. set writes
// a temporary file and renames it; get polls for the file until timeout_ms.
struct DirStore {
  std::string dir;
  std::atomic<int> sets{0}, gets{0};
  static constexpr size_t kMax = 64 * 1024;

  std::string path(const char* key) const {
    std::string p = dir + "/";
    for (const char* c = key; *c != '\0'; ++c) {
      if (*c == '/') p += "%2F";
      else if (*c == '%') p += "%25";
      else p += *c;
    }
    return p;
  }
  static int set(void* arg, const char* key, const void* value, size_t len) {
    auto* s = static_cast<DirStore*>(arg);
    ++s->sets;
    if (len > kMax) return 2;
    static std::atomic<int> seq{0};
    std::string final_path = s->path(key);
    std::string tmp = final_path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(seq++);
    int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return 2;
    const auto* b = static_cast<const uint8_t*>(value);
    size_t done = 0;
    while (done < len) {
      ssize_t w = ::write(fd, b + done, len - done);
      if (w <= 0) {
        ::close(fd);
        ::unlink(tmp.c_str());
        return 2;
      }
      done += static_cast<size_t>(w);
    }
    ::close(fd);
    return ::rename(tmp.c_str(), final_path.c_str()) == 0 ? 0 : 2;
  }
  static int get(void* arg, const char* key, void* value, size_t cap, size_t* len, int timeout_ms) {
    auto* s = static_cast<DirStore*>(arg);
    ++s->gets;
    const std::string p = s->path(key);
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max(timeout_ms, 0));
    for (;;) {
      int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd >= 0) {
        std::vector<uint8_t> buf(kMax + 1);
        size_t n = 0;
        for (;;) {
          ssize_t r = ::read(fd, buf.data() + n, buf.size() - n);
          if (r < 0) {
            ::close(fd);
            return 2;
          }
          if (r == 0 || (n += static_cast<size_t>(r)) == buf.size()) break;
        }
        ::close(fd);
        if (n > kMax) return 2;
        std::memcpy(value, buf.data(), std::min(n, cap));
        *len = n;
        return 0;
      }
      if (errno != ENOENT) return 2;
      if (std::chrono::steady_clock::now() >= until) return 1;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
};

class FromStore : public ::testing::TestWithParam<int> {};

TEST_P(FromStore, RingAndPutGetWithoutLaunchVariables) {
  const int n = GetParam();
  char tmpl[] = "/tmp/hcomm-store-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  static int seq = 0;
  const std::string job = "tstore-" + std::to_string(::getpid()) + "-" + std::to_string(seq++);
  std::string err = run_ranks(n, {{"HCOMM_ENGINE", "host"}}, [&](int rank) {
    // What run_ranks set up as a launch is gone: only the store and the config say who we are.
    for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HCOMM_JOB_ID"})
      ::unsetenv(v);
    DirStore s;
    s.dir = dir;
    hcomm_kv_store_t kv{&s, &DirStore::set, &DirStore::get};
    hcomm_config_t cfg = config();
    cfg.rank = rank;
    cfg.size = n;
    cfg.local_rank = rank;
    cfg.store = &kv;
    cfg.job_id = job.c_str();
    hcomm_context_t* ctx = nullptr;
    RCHECK_OK(hcomm_init(&cfg, &ctx));
    RCHECK(hcomm_rank(ctx) == rank && hcomm_size(ctx) == n) << hcomm_rank(ctx) << "/" << hcomm_size(ctx);
    RCHECK(s.sets > 0 && s.gets > 0) << "the store was not used";
    for (int r = 0; r < n; ++r) RCHECK(std::string(hcomm_peer_transport(ctx, r)) == "shm,cma");
    sendrecv_and_put(ctx, 256 * 1024 + 3);
    // A small (eager) ring too.
    const int next = (rank + 1) % n, prev = (rank + n - 1) % n;
    int sv = rank, rv = -1;
    RCHECK_OK(hcomm_sendrecv(ctx, next, &sv, sizeof sv, 9, prev, &rv, sizeof rv, 9, HCOMM_TAG_MASK_ALL, nullptr, T));
    RCHECK(rv == prev) << rv;
    RCHECK_OK(hcomm_finalize(ctx));
  }, 60);
  EXPECT_EQ(err, "");
  // The documented key layout: hcomm/<job>/<collective>/<rank>, #0 being the join.
  std::set<std::string> keys;
  for (const auto& e : std::filesystem::directory_iterator(dir)) keys.insert(e.path().filename().string());
  const std::string prefix = "hcomm%2F" + job + "%2F";
  for (int r = 0; r < n; ++r)
    EXPECT_TRUE(keys.count(prefix + "0%2F" + std::to_string(r))) << "no join key of rank " << r;
  for (const std::string& k : keys) EXPECT_EQ(k.rfind(prefix, 0), 0u) << "key outside hcomm/<job>/: " << k;
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

INSTANTIATE_TEST_SUITE_P(Ranks, FromStore, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& i) { return std::to_string(i.param) + "ranks"; });

// Configurations refused before any exchange (checked in this process: no rank waits for another).
TEST(FromStoreConfig, BadConfigurationsAreInvalid) {
  DirStore s;
  s.dir = "/nonexistent-hcomm-store";
  hcomm_kv_store_t kv{&s, &DirStore::set, &DirStore::get};
  hcomm_context_t* ctx = nullptr;

  hcomm_config_t c = config(2000);
  c.rank = 0;
  c.size = 2;  // no store
  EXPECT_EQ(hcomm_init(&c, &ctx), HCOMM_ERR_INVALID) << hcomm_last_error();
  EXPECT_TRUE(contains(hcomm_last_error(), "store")) << hcomm_last_error();
  c = config(2000);
  c.size = 2;  // size alone
  EXPECT_EQ(hcomm_init(&c, &ctx), HCOMM_ERR_INVALID) << hcomm_last_error();
  c = config(2000);
  c.rank = 1;  // rank alone
  EXPECT_EQ(hcomm_init(&c, &ctx), HCOMM_ERR_INVALID) << hcomm_last_error();

  for (int rank : {2, 3, -1}) {
    c = config(2000);
    c.rank = rank;
    c.size = 2;
    c.store = &kv;
    EXPECT_EQ(hcomm_init(&c, &ctx), HCOMM_ERR_INVALID) << "rank " << rank << ": " << hcomm_last_error();
  }
  c = config(2000);
  c.rank = 0;
  c.size = 0;
  c.store = &kv;
  EXPECT_EQ(hcomm_init(&c, &ctx), HCOMM_ERR_INVALID) << hcomm_last_error();

  hcomm_kv_store_t no_get{&s, &DirStore::set, nullptr};
  c = config(2000);
  c.rank = 0;
  c.size = 2;
  c.store = &no_get;
  EXPECT_EQ(hcomm_init(&c, &ctx), HCOMM_ERR_INVALID) << hcomm_last_error();
  hcomm_kv_store_t no_set{&s, nullptr, &DirStore::get};
  c.store = &no_set;
  EXPECT_EQ(hcomm_init(&c, &ctx), HCOMM_ERR_INVALID) << hcomm_last_error();
  EXPECT_EQ(ctx, nullptr);
  EXPECT_EQ(s.sets.load() + s.gets.load(), 0) << "a refused config touched the store";
}

// ---- packed keys ---------------------------------------------------------------------------------

// Rank 0 owns a window and ships its key; ranks 1 and 2 import damaged
// copies (each refused with HCOMM_ERR_PROTOCOL), and the intact key as the
// wrong rank (HCOMM_ERR_ACCESS); the owner's memory is untouched, and the
// intact key still works afterwards.
TEST(PackedKey, DamagedAndMisattributedKeysAreRefused) {
  std::string err = run_ranks(3, {{"HCOMM_ENGINE", "host"}}, [&](int rank) {
    hcomm_config_t cfg = config();
    hcomm_context_t* ctx = nullptr;
    RCHECK_OK(hcomm_init(&cfg, &ctx));
    constexpr size_t kWin = 4096;
    hcomm_mem_t* win = nullptr;
    RCHECK_OK(hcomm_mem_alloc(ctx, kWin, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &win));
    auto* w = static_cast<uint8_t*>(hcomm_mem_ptr(win));
    for (size_t i = 0; i < kWin; ++i) w[i] = pattern(rank, i);
    uint8_t key[HCOMM_RKEY_MAX];
    size_t len = sizeof key;
    if (rank == 0) {
      size_t small = 8;
      RCHECK_EQ_STATUS(hcomm_mem_rkey_pack(win, key, &small), HCOMM_ERR_INVALID);
      RCHECK_OK(hcomm_mem_rkey_pack(win, key, &len));
      RCHECK(len >= 48 && len <= HCOMM_RKEY_MAX) << len;
      for (int r = 1; r < 3; ++r) RCHECK_OK(hcomm_send(ctx, r, key, len, 1, T));
    } else {
      hcomm_recv_info_t info{};
      RCHECK_OK(hcomm_recv(ctx, 0, key, sizeof key, 1, HCOMM_TAG_MASK_ALL, &info, T));
      len = info.length;
      RCHECK(len >= 48 && len <= HCOMM_RKEY_MAX) << len;
      // v2 layout: 48-byte header (magic u32, version u16, kind u8, nsections u8, ...), then
      // nsections x {u8 transport, u8 length, bytes}.
      const uint8_t nsec = key[7];
      RCHECK(nsec >= 1) << "a host key with no section";
      auto refused = [&](const std::vector<uint8_t>& bad, size_t blen, const char* what) {
        hcomm_rkey_t* k = nullptr;
        hcomm_status_t st = hcomm_rkey_import(ctx, 0, bad.data(), blen, &k);
        RCHECK(st == HCOMM_ERR_PROTOCOL) << what << ": " << hcomm_strerror(st) << " (" << hcomm_last_error() << ")";
        RCHECK(k == nullptr) << what;
      };
      std::vector<uint8_t> good(key, key + len);
      refused(good, len - 1, "truncated by one byte");
      refused(good, 47, "header only in part");
      {
        std::vector<uint8_t> b = good;
        b[48 + 1] = static_cast<uint8_t>(len - 48);  // the first section claims more than the blob holds
        refused(b, len, "section overrunning the blob");
      }
      {
        std::vector<uint8_t> b = good;
        b[7] = static_cast<uint8_t>(nsec + 1);
        refused(b, len, "nsections one too many");
        b[7] = static_cast<uint8_t>(nsec - 1);
        refused(b, len, "nsections one too few");
      }
      {
        std::vector<uint8_t> b = good;
        b.push_back(0);  // a trailing byte: half a section header
        refused(b, len + 1, "trailing garbage");
      }
      {
        std::vector<uint8_t> b = good;
        uint16_t v;
        std::memcpy(&v, b.data() + 4, 2);
        for (uint16_t other : {static_cast<uint16_t>(v - 1), static_cast<uint16_t>(v + 1)}) {
          std::memcpy(b.data() + 4, &other, 2);
          refused(b, len, "version changed");
        }
      }
      {
        std::vector<uint8_t> b = good;
        b[0] ^= 0xff;
        refused(b, len, "magic changed");
      }
      {
        // The first section once more (a second section for one transport: which would count?).
        std::vector<uint8_t> b = good;
        const size_t slen = 2 + b[49];
        b.insert(b.end(), good.begin() + 48, good.begin() + 48 + static_cast<long>(slen));
        b[7] = static_cast<uint8_t>(nsec + 1);
        RCHECK(b.size() <= HCOMM_RKEY_MAX) << b.size();
        refused(b, b.size(), "a transport's section twice");
      }
      // The intact key, said to come from another rank (the other importer, or ourselves).
      for (int claimed : {3 - rank, rank}) {
        hcomm_rkey_t* k = nullptr;
        RCHECK_EQ_STATUS(hcomm_rkey_import(ctx, claimed, key, len, &k), HCOMM_ERR_ACCESS) << "as rank " << claimed;
        RCHECK(k == nullptr);
      }
      // The intact key as rank 0's: works, and reads the owner's untouched pattern.
      hcomm_rkey_t* k = nullptr;
      RCHECK_OK(hcomm_rkey_import(ctx, 0, key, len, &k));
      RCHECK(hcomm_rkey_size(k) == kWin);
      RCHECK_OK(hcomm_get(ctx, w, kWin, k, 0, T));
      for (size_t i = 0; i < kWin; ++i) RCHECK(w[i] == pattern(0, i)) << "byte " << i;
      RCHECK_OK(hcomm_rkey_release(k));
    }
    RCHECK_OK(hcomm_barrier(ctx, T));
    if (rank == 0) {
      for (size_t i = 0; i < kWin; ++i) RCHECK(w[i] == pattern(0, i)) << "owner's byte " << i << " changed";
    }
    RCHECK_OK(hcomm_mem_release(win));
    RCHECK_OK(hcomm_finalize(ctx));
  }, 60);
  EXPECT_EQ(err, "");
}

}  // namespace
}  // namespace hcomm

namespace hcomm {
namespace {

// Registered memory is pinned: with RLIMIT_MEMLOCK too low for verbs'
// registrations, init fails and names the limit. Runs as a non-root user
// (root has CAP_IPC_LOCK and ignores the limit); needs an RDMA device the
// user may open (the qemu suite's guest runs it after chmod of
// /dev/infiniband/*).
TEST(Verbs, MemlockTooLowIsNamedAtInit) {
  if (!std::filesystem::exists("/sys/class/infiniband") || std::filesystem::is_empty("/sys/class/infiniband"))
    GTEST_SKIP() << "no RDMA device";
  std::string err = test::run_ranks(1, {{"HCOMM_TRANSPORTS", "verbs"}}, [](int) {
    rlimit rl{64 * 1024, 64 * 1024};
    RCHECK(::setrlimit(RLIMIT_MEMLOCK, &rl) == 0) << std::strerror(errno);
    if (::geteuid() == 0) {
      RCHECK(::setgid(65534) == 0 && ::setuid(65534) == 0) << "drop root: " << std::strerror(errno);
    }
    hcomm_context_t* ctx = nullptr;
    hcomm_status_t st = hcomm_init(nullptr, &ctx);
    RCHECK(st != HCOMM_OK) << "init succeeded with a 64 KiB memlock limit";
    RCHECK(std::strstr(hcomm_last_error(), "RLIMIT_MEMLOCK") != nullptr) << hcomm_strerror(st) << ": "
                                                                          << hcomm_last_error();
    std::fprintf(stderr, "memlock: %s: %s\n", hcomm_strerror(st), hcomm_last_error());
  });
  EXPECT_EQ(err, "");
}

}  // namespace

// ---- device loss: the simulator (the device's vfio-user server) is killed mid-job ----

// The device goes away under a pending put (its engine stalled so the put
// stays pending) by `how` ("kill": hcomm-sim is SIGKILLed; "reset": the
// device resets itself, hcomm-sim's control "reset"): the pending put and
// every later operation fail with HCOMM_ERR_DEVICE, the message naming the
// device and `why`, within 1 s (peer_check_ms is 1 here; the STATUS poll
// adds at most hal::npu::Device::kStatusCheckMs).
void device_loss(const std::string& how, const char* why) {
  test::SimProcess sim;
  ASSERT_EQ(sim.start({"--devices", "2", "--hbm", "16M"}), "");
  const pid_t sim_pid = sim.pid();
  std::string err = run_ranks(2, {{"HCOMM_ENGINE", "npu"}, {"HCOMM_SIM_DIR", sim.dir()}}, [&](int rank) {
    hcomm_config_t cfg = config();
    hcomm_context_t* ctx = nullptr;
    RCHECK_OK(hcomm_init(&cfg, &ctx));
    const int peer = 1 - rank;
    const size_t s = 1 << 20;
    hcomm_mem_t *w, *l;
    RCHECK_OK(hcomm_mem_alloc(ctx, s, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w));
    RCHECK_OK(hcomm_mem_alloc(ctx, s, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &l));
    hcomm_rkey_t* k = test::swap_keys(ctx, peer, w, 1, T);
    auto* lp = static_cast<uint8_t*>(hcomm_mem_ptr(l));
    RCHECK_OK(hcomm_put(ctx, lp, s, k, 0, T)) << "the device works before";
    // A put that stays pending: our device takes no descriptor for 5 s.
    RCHECK(sim.control("stall " + std::to_string(rank) + " 5000") == "ok");
    hcomm_request_t* q = nullptr;
    RCHECK_OK(hcomm_iput(ctx, lp, s, k, 0, &q));
    RCHECK_OK(hcomm_barrier(ctx, T));
    if (how == "kill") {
      if (rank == 0) ::kill(sim_pid, SIGKILL);
    } else {
      RCHECK(sim.control("reset " + std::to_string(rank)) == "ok");
    }
    const auto t0 = std::chrono::steady_clock::now();
    RCHECK_EQ_STATUS(hcomm_wait(q, T), HCOMM_ERR_DEVICE);
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
    RCHECK(std::strstr(hcomm_last_error(), "NPU device") != nullptr && std::strstr(hcomm_last_error(), why) != nullptr)
        << hcomm_last_error();
    RCHECK(ms < 1000) << "the pending put failed only after " << ms << " ms";
    hcomm_request_free(q);
    RCHECK_EQ_STATUS(hcomm_put(ctx, lp, s, k, 0, T), HCOMM_ERR_DEVICE) << "later operations fail at once";
    RCHECK_EQ_STATUS(hcomm_flush(ctx, -1, T), HCOMM_ERR_DEVICE);
    (void)hcomm_rkey_release(k);
    (void)hcomm_finalize(ctx);  // reports the lost device; must not hang
  }, 60);
  EXPECT_EQ(err, "");
}

// notify_wait watches local memory, and who would write the word is not
// A rendezvous control message that answers nothing (the protocol is in
// api/proto/tag.cpp) is a protocol error of its sender: that peer is failed,
// with a message that says why, and nothing is written anywhere. The
// messages are handed to the context as its messaging lane would (the
// lane has checked their form; these are well-formed and wrong):
// rank 0 gets a CTS for a send it never made, rank 1 a WDONE for a receive
// it never exposed; then a real 1 MiB send is pending at rank 0 (rank 1 posts
// no receive) and a CTS asks it for one byte more than the message.
TEST(Rendezvous, ForgedCtsAndWdoneFailTheirSender) {
  std::string err = run_ranks(2, {{"HCOMM_ENGINE", "host"}}, [&](int rank) {
    hcomm_config_t cfg = config();
    hcomm_context_t* ctx = nullptr;
    RCHECK_OK(hcomm_init(&cfg, &ctx));
    const int peer = 1 - rank;
    hcomm::api::Context& c = *ctx->impl;
    auto forge = [&](hcomm::api::MsgType type, uint64_t sreq, uint64_t total) {
      hcomm::api::MsgHdr h{};
      h.type = static_cast<uint32_t>(type);
      h.sreq = sreq;
      h.total = total;
      h.addr = 4096;
      h.rkey = 1;
      std::lock_guard lock(c.mu());
      c.on_am(peer, h, nullptr);
    };
    uint64_t word = 7;
    if (rank == 0) {
      std::vector<uint8_t> big(1 << 20, 0x5a);
      hcomm_request_t* q = nullptr;
      RCHECK_OK(hcomm_isend(ctx, peer, big.data(), big.size(), 3, &q));
      int done = 0;
      RCHECK_EQ_STATUS(hcomm_test(q, &done), HCOMM_IN_PROGRESS);  // progress: the RTS is out
      RCHECK(done == 0);
      forge(hcomm::api::MsgType::cts, q->r->id, big.size() + 1);
      RCHECK_EQ_STATUS(hcomm_wait(q, T), HCOMM_ERR_PEER_FAILURE);
      RCHECK(std::strstr(hcomm_last_error(), "CTS asks for 1048577 bytes of a message of 1048576") != nullptr)
          << hcomm_last_error();
      hcomm_request_free(q);
      RCHECK(std::all_of(big.begin(), big.end(), [](uint8_t b) { return b == 0x5a; }));
      forge(hcomm::api::MsgType::cts, 123456789, 64);  // (the peer is failed already: ignored, no crash)
    } else {
      forge(hcomm::api::MsgType::wdone, 123456789, 0);
      RCHECK_EQ_STATUS(hcomm_send(ctx, peer, &word, 8, 1, T), HCOMM_ERR_PEER_FAILURE);
      RCHECK(std::strstr(hcomm_last_error(), "WDONE for message 123456789") != nullptr) << hcomm_last_error();
    }
    (void)hcomm_finalize(ctx);
  }, 60);
  EXPECT_EQ(err, "");
}

// A CTS for a send that does not exist fails its sender too.
TEST(Rendezvous, CtsForAnUnknownSendFailsItsSender) {
  std::string err = run_ranks(2, {{"HCOMM_ENGINE", "host"}}, [&](int rank) {
    hcomm_config_t cfg = config();
    hcomm_context_t* ctx = nullptr;
    RCHECK_OK(hcomm_init(&cfg, &ctx));
    const int peer = 1 - rank;
    hcomm::api::MsgHdr h{};
    h.type = static_cast<uint32_t>(hcomm::api::MsgType::cts);
    h.sreq = 987654321;
    h.total = 64;
    {
      std::lock_guard lock(ctx->impl->mu());
      ctx->impl->on_am(peer, h, nullptr);
    }
    uint64_t word = 7;
    RCHECK_EQ_STATUS(hcomm_send(ctx, peer, &word, 8, 1, T), HCOMM_ERR_PEER_FAILURE);
    RCHECK(std::strstr(hcomm_last_error(), "CTS for message 987654321") != nullptr) << hcomm_last_error();
    (void)hcomm_finalize(ctx);
  }, 60);
  EXPECT_EQ(err, "");
}

// known: a peer that fails during the wait ends it (found by the chaos
// suite: a parameter server waited out its full timeout for a dead worker).
TEST(PeerFailure, EndsANotifyWait) {
  std::string err = run_ranks(2, {{"HCOMM_ENGINE", "host"}}, [&](int rank) {
    hcomm_config_t cfg = config();
    hcomm_context_t* ctx = nullptr;
    RCHECK_OK(hcomm_init(&cfg, &ctx));
    hcomm_mem_t* w = nullptr;
    RCHECK_OK(hcomm_mem_alloc(ctx, 64, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w));
    RCHECK_OK(hcomm_barrier(ctx, T));
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // rank 0 is waiting by then
      ::_exit(0);  // gone without a word
    }
    const auto t0 = std::chrono::steady_clock::now();
    RCHECK_EQ_STATUS(hcomm_notify_wait(ctx, w, 0, 1, 20000), HCOMM_ERR_PEER_FAILURE);
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
    RCHECK(ms < 2000) << "the wait ended only after " << ms << " ms";
    RCHECK(std::strstr(hcomm_last_error(), "rank 1") != nullptr) << hcomm_last_error();
    // Called again, it keeps waiting (until its own timeout here).
    RCHECK_EQ_STATUS(hcomm_notify_wait(ctx, w, 0, 1, 50), HCOMM_ERR_TIMEOUT);
    (void)hcomm_finalize(ctx);
  }, 60);
  EXPECT_EQ(err, "");
}

// ---- the NPU's RoCE engine between two nodes ------------------------------------------------------

// Two simulators are two nodes (rank 0 on node 0, rank 1 on node 1): the
// peer is served by npu_roce. Then node 1's simulator is SIGKILLed while
// rank 1 lives on, silent (its control link stays up): rank 0's next put
// ends in HCOMM_ERR_PEER_FAILURE from its queue pair's retry limit, within
// the configured bound (4.096 us x 2^12 x 8 = 134 ms here), not a hang.
TEST(NpuRoceNodes, KilledRemoteSimulatorIsPeerFailureWithinTheBound) {
  test::SimProcess n0, n1;
  ASSERT_EQ(test::start_two_nodes(n0, n1, {"--devices", "1", "--hbm", "16M"}), "");
  const pid_t victim = n1.pid();
  const std::string dirs[2] = {n0.dir(), n1.dir()};
  Env env = {{"HCOMM_ENGINE", "npu"}, {"HCOMM_SOCKET_ADDR", "127.0.0.1"}, {"HCOMM_ROCE_TIMEOUT", "12"}};
  std::string err = run_ranks(2, env, [&](int rank) {
    ::setenv("HCOMM_HOST_ID", rank == 0 ? "node0" : "node1", 1);
    ::setenv("HCOMM_SIM_DIR", dirs[rank].c_str(), 1);
    ::setenv("LOCAL_RANK", "0", 1);
    hcomm_config_t cfg = config();
    hcomm_context_t* ctx = nullptr;
    RCHECK_OK(hcomm_init(&cfg, &ctx));
    const int peer = 1 - rank;
    RCHECK(std::string(hcomm_peer_transport(ctx, peer)) == "npu_roce") << hcomm_peer_transport(ctx, peer);
    const size_t s = 1 << 20;
    hcomm_mem_t *w, *l;
    RCHECK_OK(hcomm_mem_alloc(ctx, s, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w));
    RCHECK_OK(hcomm_mem_alloc(ctx, s, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &l));
    hcomm_rkey_t* k = test::swap_keys(ctx, peer, w, 1, T);
    auto* lp = static_cast<uint8_t*>(hcomm_mem_ptr(l));
    RCHECK_OK(hcomm_put(ctx, lp, s, k, 0, T)) << "the wire works before";
    RCHECK_OK(hcomm_barrier(ctx, T));
    if (rank == 1) {
      ::kill(victim, SIGKILL);  // our node's simulator: its port, and the uplink, are gone
      std::this_thread::sleep_for(std::chrono::seconds(3));  // silent, the control link up
      ::_exit(0);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the simulator is dead by then
    const auto t0 = std::chrono::steady_clock::now();
    RCHECK_EQ_STATUS(hcomm_put(ctx, lp, s, k, 0, T), HCOMM_ERR_PEER_FAILURE);
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
    RCHECK(std::strstr(hcomm_last_error(), "retry") != nullptr) << hcomm_last_error();
    RCHECK(ms < 1500) << "the put failed only after " << ms << " ms";
    RCHECK_EQ_STATUS(hcomm_put(ctx, lp, 8, k, 0, T), HCOMM_ERR_PEER_FAILURE) << "later operations fail at once";
    (void)hcomm_rkey_release(k);
    (void)hcomm_finalize(ctx);  // reports the lost peer; must not hang
  }, 60);
  EXPECT_EQ(err, "");
}

TEST(DeviceLoss, KilledSimulatorFailsPendingAndLaterOperationsWithDeviceError) { device_loss("kill", "hung up"); }

TEST(DeviceLoss, DeviceResetUnderTheDriverFailsPendingAndLaterOperationsWithDeviceError) {
  device_loss("reset", "was reset");
}

}  // namespace hcomm
