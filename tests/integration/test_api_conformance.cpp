// The conformance suite of the primitives: every test runs on every engine
// present (host; the simulated NPU through hcomm-sim) across 2 and 4
// processes, and checks results element by element. The npu_roce cases run
// the NPU engine on two nodes: two hcomm-sim processes (--node 0 / 1, their
// uplinks joined), rank r on node r % 2 (HCOMM_HOST_ID), so every peer on
// the other node is served by the NPU's RoCE engine (npu_roce, asserted),
// with faults injected on both nodes' wires (HCOMM_TEST_ROCE_FAULTS, default
// 5% drop, 3% duplication, 5% reordering, 1% corruption: every recovery path
// runs in every case; the engine's own tests, test_roce_rc.cpp and
// test_npu_roce.cpp, take 10% drop and reordering).
//
// HCOMM_TEST_DEVICES="A,B[,...]" runs the NPU cases on existing devices
// (rank r on the r-th; the qemu suite's guest passes its vfio-pci functions)
// instead of starting hcomm-sim; fault injection is skipped there, and so is
// a case with more ranks than devices.
#include <gtest/gtest.h>
#include <hcomm/hcomm.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "tests/support/ranks.h"
#include "tests/support/sim_process.h"

namespace hcomm {
namespace {

using test::run_ranks;

struct Param {
  const char* engine;
  int ranks;
  bool nodes = false;  // two simulators as two nodes (npu_roce between them)
  // HCOMM_RNDV (npu_roce, whose default is by write from 128 KiB, by read
  // below): "get" (by the receiver's read at every size) or "put" (by the
  // sender's write at every size); only the two-sided cases run.
  const char* rndv = nullptr;
};
std::string param_name(const ::testing::TestParamInfo<Param>& i) {
  return std::string(i.param.engine) + (i.param.nodes ? "_roce" : "") + "_" + std::to_string(i.param.ranks) + "ranks" +
         (i.param.rndv != nullptr ? std::string("_rndv") + i.param.rndv : "");
}
// The cases whose rendezvous sends take one of the two ways.
bool two_sided_case(const std::string& name) {
  for (const char* c : {"SendRecv", "Tags", "Truncation", "Nonblocking", "TimedOutBlocking", "Cancel", "Killed"})
    if (name.rfind(c, 0) == 0) return true;
  return false;
}

test::SimProcess* g_sim = nullptr;
test::SimProcess* g_node[2] = {nullptr, nullptr};  // the two-node cases' simulators, started on first use
unsigned long long g_icrc_base = 0;                 // their ports' ICRC drops when the current case started
unsigned long long g_lost_base = 0;                 // and their uplinks' lost frames
unsigned long long g_resent_base = 0, g_timeouts_base = 0;  // and their ports' resent packets and ACK timeouts
unsigned long long g_tx_base = 0;                   // and the frames their ports sent
std::string g_devices;  // HCOMM_TEST_DEVICES

int device_count(const std::string& list) {
  return list.empty() ? 0 : 1 + static_cast<int>(std::count(list.begin(), list.end(), ','));
}

class Api : public ::testing::TestWithParam<Param> {
 protected:
  static void SetUpTestSuite() {
    if (const char* e = std::getenv("HCOMM_TEST_DEVICES"); e != nullptr && *e != '\0') {
      g_devices = e;
      return;
    }
    g_sim = new test::SimProcess();
    std::string err = g_sim->start({"--devices", "4", "--hbm", "128M"});
    if (!err.empty()) {
      delete g_sim;
      g_sim = nullptr;
      FAIL() << err;
    }
  }
  static void TearDownTestSuite() {
    delete g_sim;
    g_sim = nullptr;
    for (auto*& s : g_node) {
      delete s;
      s = nullptr;
    }
  }
  bool npu() const { return std::string(GetParam().engine) == "npu"; }
  bool nodes() const { return GetParam().nodes; }
  // The cases that stall the DMA engine through hcomm-sim's control socket:
  // why this instance cannot (empty: it can).
  std::string why_no_stall() const {
    if (!npu()) return "stalling the DMA engine is a simulator feature";
    if (nodes()) return "across nodes the data moves over RoCE, not the DMA queue (and the wire's faults are on)";
    if (g_sim == nullptr) return "needs hcomm-sim's control socket (not reachable with HCOMM_TEST_DEVICES)";
    return "";
  }
  void SetUp() override {
    if (GetParam().rndv != nullptr && !two_sided_case(::testing::UnitTest::GetInstance()->current_test_info()->name()))
      GTEST_SKIP() << "HCOMM_RNDV=" << GetParam().rndv << ": two-sided cases only";
    if (nodes()) {
      if (!g_devices.empty()) GTEST_SKIP() << "two simulated nodes; HCOMM_TEST_DEVICES names real devices";
      if (g_node[0] == nullptr) {
        g_node[0] = new test::SimProcess();
        g_node[1] = new test::SimProcess();
        ASSERT_EQ(test::start_two_nodes(*g_node[0], *g_node[1], {"--devices", "2", "--hbm", "128M"}), "");
      }
      const char* f = std::getenv("HCOMM_TEST_ROCE_FAULTS");
      const std::string faults = f != nullptr ? f : "drop=5 dup=3 reorder=5 corrupt=1";
      for (int i = 0; i < 2; ++i) {
        ASSERT_TRUE(g_node[i]->alive());
        for (int d = 0; d < 2; ++d) ASSERT_EQ(g_node[i]->control("clear " + std::to_string(d)), "ok");
        ASSERT_EQ(g_node[i]->control("net clear"), "ok");
        if (!faults.empty()) {
          ASSERT_EQ(g_node[i]->control("net faults " + faults + " seed=" + std::to_string(7 + i)), "ok");
        }
      }
      const std::vector<std::string> info = net_info();
      g_icrc_base = net_counter(info, "bad_icrc_total");
      ASSERT_NE(g_icrc_base, ~0ull) << "net info has no bad_icrc_total";
      g_lost_base = wire().lost;
      g_resent_base = net_counter(info, "retransmits_total");
      g_timeouts_base = net_counter(info, "timeouts_total");
      g_tx_base = net_counter(info, "tx");
      ASSERT_NE(g_lost_base, ~0ull) << "net stats unreadable";
      return;
    }
    if (npu() && !g_devices.empty()) {
      if (device_count(g_devices) < GetParam().ranks)
        GTEST_SKIP() << GetParam().ranks << " ranks need as many devices; HCOMM_TEST_DEVICES=" << g_devices;
      return;
    }
    if (npu()) {
      ASSERT_NE(g_sim, nullptr);
      ASSERT_TRUE(g_sim->alive());
      for (int d = 0; d < 4; ++d) ASSERT_EQ(g_sim->control("clear " + std::to_string(d)), "ok");
    }
  }
  // Two nodes: every frame the switches corrupted died at a port's ICRC
  // check, or was lost whole on the way (an uplink's socket buffer
  // overflowed: `uplink_lost`, the kernel's count); some may still be on
  // their way when the ranks are done (waited for, bounded). And the faults
  // were really there.
  static unsigned long long icrc_drops() { return net_counter(net_info(), "bad_icrc_total"); }
  // `net info` of the four ports, asked once for the counters read from it.
  static std::vector<std::string> net_info() {
    std::vector<std::string> info;
    for (auto* s : g_node)
      for (int dev = 0; dev < 2; ++dev) info.push_back(s->control("net info " + std::to_string(dev)));
    return info;
  }
  // A counter of `net info`, summed over the four ports (~0: unreadable).
  static unsigned long long net_counter(const std::vector<std::string>& info, const std::string& name) {
    unsigned long long n = 0;
    for (const std::string& i : info) {
      const size_t at = i.find(" " + name + "=");
      if (at == std::string::npos) return ~0ull;
      n += std::strtoull(i.c_str() + at + name.size() + 2, nullptr, 10);
    }
    return n;
  }
  struct Wire {
    unsigned long long dropped = 0, corrupted = 0, lost = 0;
  };
  static Wire wire() {
    Wire w;
    for (auto* s : g_node) {
      unsigned long long d = 0, u = 0, r = 0, c = 0, l = 0;
      const std::string st = s->control("net stats");
      if (std::sscanf(st.c_str(), "ok dropped=%llu duplicated=%llu reordered=%llu corrupted=%llu uplink_lost=%llu", &d,
                      &u, &r, &c, &l) != 5)
        return Wire{~0ull, ~0ull, ~0ull};
      w.dropped += d;
      w.corrupted += c;
      w.lost += l;
    }
    return w;
  }
  void TearDown() override {
    if (!nodes() || g_node[0] == nullptr || IsSkipped()) return;
    Wire w;
    unsigned long long bad_icrc = 0, lost = 0;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    do {
      w = wire();
      ASSERT_NE(w.corrupted, ~0ull) << "net stats unreadable";
      bad_icrc = icrc_drops() - g_icrc_base;
      lost = w.lost - g_lost_base;
      if (bad_icrc + lost >= w.corrupted) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    } while (std::chrono::steady_clock::now() < until);
    EXPECT_LE(bad_icrc, w.corrupted) << "more ICRC drops than frames corrupted";
    EXPECT_GE(bad_icrc + lost, w.corrupted) << "corrupted frames neither dropped by an ICRC check nor lost on the link ("
                                            << lost << " frames lost whole)";
    // The faults are on: with 5% drop, a case whose ports sent 400 frames
    // or more has dropped some (all but with probability 0.95^400 ~ 1e-9);
    // a shorter case may well drop nothing.
    const std::vector<std::string> info = net_info();
    const unsigned long long frames = net_counter(info, "tx") - g_tx_base;
    if (std::getenv("HCOMM_TEST_ROCE_FAULTS") == nullptr && frames >= 400) {
      EXPECT_GT(w.dropped, 0u) << "the default faults dropped none of " << frames << " frames";
    }
    std::fprintf(stderr,
                 "wire: %llu dropped, %llu corrupted (%llu ICRC drops), %llu lost on the uplinks; %llu packets resent, "
                 "%llu local ACK timeouts\n",
                 w.dropped, w.corrupted, bad_icrc, lost, net_counter(info, "retransmits_total") - g_resent_base,
                 net_counter(info, "timeouts_total") - g_timeouts_base);
  }
  void run(const std::function<void(hcomm_context_t*, int, int)>& body, int timeout_s = 120,
           std::vector<int> killed_ok = {}) {
    std::vector<std::pair<std::string, std::string>> env = {{"HCOMM_ENGINE", GetParam().engine}};
    if (g_sim != nullptr && !nodes()) env.emplace_back("HCOMM_SIM_DIR", g_sim->dir());
    if (npu() && !g_devices.empty()) env.emplace_back("HCOMM_DEVICE", g_devices);
    if (GetParam().rndv != nullptr) env.emplace_back("HCOMM_RNDV", GetParam().rndv);
    if (nodes()) {
      env.emplace_back("HCOMM_SOCKET_ADDR", "127.0.0.1");  // the TCP mesh between the "hosts"
      // Go-back-N on a wire that drops one packet in twenty moves a few MB/s:
      // transfers up to 1 MiB there (the loss-free rate: docs/performance.md).
      const char* f = std::getenv("HCOMM_TEST_ROCE_FAULTS");
      if ((f == nullptr || *f != '\0') && std::getenv("HCOMM_TEST_MAX_BYTES") == nullptr)
        env.emplace_back("HCOMM_TEST_MAX_BYTES", "1048576");
    }
    const bool two = nodes();
    std::string err = run_ranks(
        GetParam().ranks, env,
        [&](int rank) {
          if (two) {  // node rank % 2, its (rank / 2)-th device there
            ::setenv("HCOMM_HOST_ID", rank % 2 == 0 ? "node0" : "node1", 1);
            ::setenv("HCOMM_SIM_DIR", g_node[rank % 2]->dir().c_str(), 1);
            ::setenv("LOCAL_RANK", std::to_string(rank / 2).c_str(), 1);
          }
          hcomm_context_t* ctx = nullptr;
          RCHECK_OK(hcomm_init(nullptr, &ctx));
          RCHECK(std::string(hcomm_engine_name(ctx)) == GetParam().engine) << hcomm_engine_name(ctx);
          RCHECK(hcomm_rank(ctx) == rank);
          // HCOMM_TEST_EXPECT_TRANSPORT (the qemu suite's verbs runs): what
          // must serve every peer (in spread mode: every peer on another host).
          if (const char* want = std::getenv("HCOMM_TEST_EXPECT_TRANSPORT"); want != nullptr && *want != '\0') {
            const test::Spread sp = test::spread();
            for (int r = 0; r < hcomm_size(ctx); ++r) {
              if (sp.hosts > 1 && r % sp.hosts == rank % sp.hosts) continue;
              const char* t = hcomm_peer_transport(ctx, r);
              RCHECK(t != nullptr && std::string(t) == want) << "rank " << r << " served by " << (t ? t : "null");
            }
          }
          if (two) {
            for (int r = rank % 2 == 0 ? 1 : 0; r < hcomm_size(ctx); r += 2) {
              const char* t = hcomm_peer_transport(ctx, r);
              RCHECK(t != nullptr && std::string(t) == "npu_roce") << "rank " << r << " served by " << (t ? t : "null");
            }
          }
          body(ctx, rank, hcomm_size(ctx));
          RCHECK_OK(hcomm_finalize(ctx));
        },
        timeout_s, killed_ok);
    EXPECT_EQ(err, "");
  }
};

constexpr int T = 30000;  // ms: every wait in these tests is bounded

// Everyone's key for `m`, by rank (keys[rank] is our own, imported too).
std::vector<hcomm_rkey_t*> exchange_keys(hcomm_context_t* ctx, hcomm_mem_t* m, uint64_t tag) {
  const int me = hcomm_rank(ctx), n = hcomm_size(ctx);
  uint8_t mine[HCOMM_RKEY_MAX];
  size_t len = sizeof mine;
  RCHECK_OK(hcomm_mem_rkey_pack(m, mine, &len));
  std::vector<hcomm_request_t*> sends;
  for (int r = 0; r < n; ++r) {
    if (r == me) continue;
    hcomm_request_t* q = nullptr;
    RCHECK_OK(hcomm_isend(ctx, r, mine, len, tag, &q));
    sends.push_back(q);
  }
  std::vector<hcomm_rkey_t*> keys(n, nullptr);
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
    RCHECK_OK(hcomm_rkey_import(ctx, r, blob, blen, &keys[r]));
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

// HCOMM_TEST_MAX_BYTES caps the largest transfer (the qemu suite's run
// across two TCG guests moves a few MB/s; one guest and the host run all sizes).
size_t max_bytes() {
  const char* e = std::getenv("HCOMM_TEST_MAX_BYTES");
  return e != nullptr && *e != '\0' ? std::strtoull(e, nullptr, 10) : SIZE_MAX;
}

uint8_t pattern(int rank, size_t size, size_t i) { return static_cast<uint8_t>(rank * 31 + size * 7 + i * 13 + (i >> 9)); }

// pattern() a block at a time, for the 64 MiB cases (under TCG, and under the
// sanitizers, a loop over every byte costs seconds per rank). Byte i = 512 k + j
// is c + k + 13 j mod 256 with c = rank * 31 + size * 7 (512 * 13 is a multiple
// of 256): block k is row c + k of a 256 x 512 table.
const uint8_t* pattern_row(size_t c) {
  static const std::vector<uint8_t> table = [] {
    std::vector<uint8_t> t(256 * 512);
    for (size_t r = 0; r < 256; ++r)
      for (size_t j = 0; j < 512; ++j) t[r * 512 + j] = static_cast<uint8_t>(r + j * 13);
    return t;
  }();
  return table.data() + (c & 255) * 512;
}

// p[i] = pattern(rank, size, i) for i < n.
void fill_pattern(uint8_t* p, int rank, size_t size, size_t n) {
  const size_t c = static_cast<size_t>(rank) * 31 + size * 7;
  for (size_t k = 0; k * 512 < n; ++k) std::memcpy(p + k * 512, pattern_row(c + k), std::min<size_t>(512, n - k * 512));
}
void fill_pattern(std::vector<uint8_t>& v, int rank, size_t size, size_t n) { fill_pattern(v.data(), rank, size, n); }

// The first i < n with p[i] != pattern(rank, size, i); n if there is none.
size_t pattern_mismatch(const uint8_t* p, int rank, size_t size, size_t n) {
  const size_t c = static_cast<size_t>(rank) * 31 + size * 7;
  for (size_t k = 0; k * 512 < n; ++k) {
    const size_t len = std::min<size_t>(512, n - k * 512);
    const uint8_t* row = pattern_row(c + k);
    if (std::memcmp(p + k * 512, row, len) == 0) continue;
    for (size_t j = 0; j < len; ++j)
      if (p[k * 512 + j] != row[j]) return k * 512 + j;
  }
  return n;
}
size_t pattern_mismatch(const std::vector<uint8_t>& v, int rank, size_t size, size_t n) {
  return pattern_mismatch(v.data(), rank, size, n);
}

TEST(Pattern, BlockwiseFillAndCheckAreTheFormula) {
  for (int rank : {0, 3, 200})
    for (size_t size : {size_t{1}, size_t{4097}, (size_t{1} << 20) + 5, size_t{1} << 33})
      for (size_t n : {size_t{0}, size_t{1}, size_t{511}, size_t{512}, size_t{1025}, size_t{70000}}) {
        std::vector<uint8_t> v(n + 1, 0xee);
        fill_pattern(v, rank, size, n);
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(v[i], pattern(rank, size, i)) << rank << " " << size << " " << i;
        ASSERT_EQ(v[n], 0xee) << "wrote past n";
        ASSERT_EQ(pattern_mismatch(v, rank, size, n), n);
        for (size_t bad : {size_t{0}, n / 2, n - 1}) {
          if (n == 0) break;
          v[bad] ^= 1;
          ASSERT_EQ(pattern_mismatch(v, rank, size, n), bad);
          v[bad] ^= 1;
        }
      }
}

// ---- two-sided ----------------------------------------------------------------------------

TEST_P(Api, SendRecvEverySizeAroundTheRing) {
  run([](hcomm_context_t* ctx, int me, int n) {
    const int right = (me + 1) % n, left = (me + n - 1) % n;
    const std::vector<size_t> sizes = {0, 1, 7, 4031, 4032, 4033, 65536, (1u << 20) + 5, 64u << 20};
    const size_t cap = std::min<size_t>(64u << 20, max_bytes());
    std::vector<uint8_t> sbuf(cap), rbuf(cap);
    for (size_t s : sizes) {
      if (s > max_bytes()) continue;
      fill_pattern(sbuf, me, s, s);
      std::memset(rbuf.data(), 0, std::min<size_t>(s + 1, rbuf.size()));
      hcomm_recv_info_t info;
      RCHECK_OK(hcomm_sendrecv(ctx, right, sbuf.data(), s, 100 + s, left, rbuf.data(), s, 100 + s,
                               HCOMM_TAG_MASK_ALL, &info, T))
          << "size " << s;
      RCHECK(info.source == left && info.length == s && info.tag == 100 + s);
      RCHECK(pattern_mismatch(rbuf, left, s, s) == s) << "size " << s << " byte " << pattern_mismatch(rbuf, left, s, s);
    }
  });
}

TEST_P(Api, SendRecvFromRegisteredMemoryMovesThroughTheEngine) {
  run([](hcomm_context_t* ctx, int me, int n) {
    const int right = (me + 1) % n, left = (me + n - 1) % n;
    const size_t s = std::min<size_t>(8u << 20, max_bytes());
    // Memory peers may read and write, and memory they may not (local use
    // only): a rendezvous must not hand a peer a key without the right it
    // needs (over RDMA that access would be NAKed and break the pair).
    for (unsigned access : {unsigned{HCOMM_ACCESS_ALL}, 0u}) {
      hcomm_mem_t *sm, *rm;
      RCHECK_OK(hcomm_mem_alloc(ctx, s, HCOMM_MEM_HOST, access, &sm));
      RCHECK_OK(hcomm_mem_alloc(ctx, s, HCOMM_MEM_HOST, access, &rm));
      auto* sp = static_cast<uint8_t*>(hcomm_mem_ptr(sm));
      auto* rp = static_cast<uint8_t*>(hcomm_mem_ptr(rm));
      fill_pattern(sp, me + static_cast<int>(access), s, s);
      RCHECK_OK(hcomm_sendrecv(ctx, right, sp, s, 1, left, rp, s, 1, HCOMM_TAG_MASK_ALL, nullptr, T));
      const size_t bad = pattern_mismatch(rp, left + static_cast<int>(access), s, s);
      RCHECK(bad == s) << "byte " << bad << ", access " << access;
      RCHECK_OK(hcomm_barrier(ctx, T));
      RCHECK_OK(hcomm_mem_release(sm));
      RCHECK_OK(hcomm_mem_release(rm));
    }
  });
}

TEST_P(Api, TagsMasksAnySourceProbeAndUnexpectedOrder) {
  run([](hcomm_context_t* ctx, int me, int n) {
    const int msgs = 20;
    if (me != 0) {
      // Sent before rank 0 posts anything: they sit in its unexpected queue.
      for (int i = 0; i < msgs; ++i) {
        uint64_t v[2] = {static_cast<uint64_t>(me), static_cast<uint64_t>(i)};
        uint64_t tag = (uint64_t{0xab} << 56) | (static_cast<uint64_t>(i % 2) << 8) | static_cast<uint64_t>(me);
        RCHECK_OK(hcomm_send(ctx, 0, v, sizeof v, tag, T));
      }
      RCHECK_OK(hcomm_barrier(ctx, T));
    } else {
      RCHECK_OK(hcomm_barrier(ctx, T));
      int found = 0;
      hcomm_recv_info_t info;
      // The barrier does not wait for messages still on their way (over a
      // lossy RoCE wire an eager message may wait out a retransmission
      // after the barrier): probe until one is there, within T.
      const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(T);
      while (!found && std::chrono::steady_clock::now() < until)
        RCHECK_OK(hcomm_probe(ctx, HCOMM_ANY_SOURCE, 0, 0, &found, &info));
      RCHECK(found == 1 && info.length == 16);
      RCHECK_OK(hcomm_probe(ctx, 1, uint64_t{0xcd} << 56, uint64_t{0xff} << 56, &found, &info));
      RCHECK(found == 0) << "no message has top byte 0xcd";
      // Odd messages only (bit 8 set), from any source, in per-sender order.
      std::vector<int> next(n, 1);
      for (int k = 0; k < (n - 1) * msgs / 2; ++k) {
        uint64_t v[2];
        RCHECK_OK(hcomm_recv(ctx, HCOMM_ANY_SOURCE, v, sizeof v, uint64_t{1} << 8, uint64_t{1} << 8, &info, T));
        RCHECK(info.source >= 1 && info.source < n && v[0] == static_cast<uint64_t>(info.source));
        RCHECK(v[1] == static_cast<uint64_t>(next[info.source])) << "order from " << info.source;
        next[info.source] += 2;
        RCHECK((info.tag & 0xff) == static_cast<uint64_t>(info.source));
      }
      // Then the even ones, from each source explicitly, exact tag.
      for (int src = 1; src < n; ++src) {
        for (int i = 0; i < msgs; i += 2) {
          uint64_t v[2];
          uint64_t tag = (uint64_t{0xab} << 56) | static_cast<uint64_t>(src);
          RCHECK_OK(hcomm_recv(ctx, src, v, sizeof v, tag, HCOMM_TAG_MASK_ALL, &info, T));
          RCHECK(v[0] == static_cast<uint64_t>(src) && v[1] == static_cast<uint64_t>(i));
        }
      }
      RCHECK_OK(hcomm_probe(ctx, HCOMM_ANY_SOURCE, 0, 0, &found, &info));
      RCHECK(found == 0) << "everything was received";
    }
  });
}

TEST_P(Api, TruncationIsReportedWithTheFullLength) {
  run([](hcomm_context_t* ctx, int me, int n) {
    (void)n;
    for (size_t s : {size_t{100}, size_t{200000}}) {
      if (me == 1) {
        std::vector<uint8_t> b(s, 0x42);
        RCHECK_OK(hcomm_send(ctx, 0, b.data(), s, 9, T));
      } else if (me == 0) {
        std::vector<uint8_t> b(s / 2 + 1, 0);
        hcomm_recv_info_t info;
        RCHECK_EQ_STATUS(hcomm_recv(ctx, 1, b.data(), s / 2, 9, HCOMM_TAG_MASK_ALL, &info, T), HCOMM_ERR_TRUNCATED);
        RCHECK(info.length == s) << info.length;
        RCHECK(b[s / 2 - 1] == 0x42 && b[s / 2] == 0) << "wrote past the buffer";
      }
    }
  });
}

TEST_P(Api, NonblockingManyOutstanding) {
  run([](hcomm_context_t* ctx, int me, int n) {
    const int k = 200;  // more than the 64 channel slots
    const int right = (me + 1) % n, left = (me + n - 1) % n;
    std::vector<uint32_t> out(k), in(k, 0);
    std::vector<hcomm_request_t*> reqs;
    for (int i = 0; i < k; ++i) {
      out[i] = static_cast<uint32_t>(me * 100000 + i);
      hcomm_request_t* s;
      RCHECK_OK(hcomm_isend(ctx, right, &out[i], 4, static_cast<uint64_t>(i), &s));
      reqs.push_back(s);
    }
    for (int i = k - 1; i >= 0; --i) {  // posted in reverse order: tags still match the right ones
      hcomm_request_t* r;
      RCHECK_OK(hcomm_irecv(ctx, left, &in[i], 4, static_cast<uint64_t>(i), HCOMM_TAG_MASK_ALL, &r));
      reqs.push_back(r);
    }
    for (auto* r : reqs) {
      RCHECK_OK(hcomm_wait(r, T));
      hcomm_request_free(r);
    }
    for (int i = 0; i < k; ++i) RCHECK(in[i] == static_cast<uint32_t>(left * 100000 + i)) << i;
    // Rendezvous-sized sends beyond the channel's 64 slots queue and drain
    // in order; half come from registered memory (engine path), half not.
    const int big = 100;
    const size_t bs = 8192;
    hcomm_mem_t* sm;
    RCHECK_OK(hcomm_mem_alloc(ctx, big / 2 * bs, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &sm));
    std::vector<uint8_t> plain(big / 2 * bs), rb(big * bs, 0);
    reqs.clear();
    for (int i = 0; i < big; ++i) {
      uint8_t* src = i % 2 ? static_cast<uint8_t*>(hcomm_mem_ptr(sm)) + (i / 2) * bs : plain.data() + (i / 2) * bs;
      std::memset(src, (me * 37 + i) & 0xff, bs);
      hcomm_request_t* s;
      RCHECK_OK(hcomm_isend(ctx, right, src, bs, 1000 + i, &s));
      reqs.push_back(s);
    }
    for (int i = 0; i < big; ++i) {
      hcomm_request_t* r;
      RCHECK_OK(hcomm_irecv(ctx, left, rb.data() + i * bs, bs, 1000 + i, HCOMM_TAG_MASK_ALL, &r));
      reqs.push_back(r);
    }
    std::vector<hcomm_status_t> sts(reqs.size(), HCOMM_ERR_INVALID);
    RCHECK_OK(hcomm_wait_all(reqs.data(), reqs.size(), sts.data(), T));
    for (size_t i = 0; i < reqs.size(); ++i) RCHECK(reqs[i] == nullptr && sts[i] == HCOMM_OK) << i;
    for (int i = 0; i < big; ++i)
      RCHECK(rb[i * bs] == ((left * 37 + i) & 0xff) && rb[i * bs + bs - 1] == ((left * 37 + i) & 0xff)) << i;
    RCHECK_OK(hcomm_barrier(ctx, T));
    RCHECK_OK(hcomm_mem_release(sm));
  });
}

// hcomm_wait_all: a window under one deadline. Past it the unfinished
// requests stay in the array, pending, and the finished ones are freed; a
// failed one's status comes back with its index; a handle twice is refused.
TEST_P(Api, NonblockingWaitAllFreesWhatFinishedAndKeepsWhatDidNot) {
  run([](hcomm_context_t* ctx, int me, int n) {
    const int right = (me + 1) % n, left = (me + n - 1) % n;
    RCHECK_OK(hcomm_wait_all(nullptr, 0, nullptr, T));
    RCHECK_EQ_STATUS(hcomm_wait_all(nullptr, 3, nullptr, T), HCOMM_ERR_INVALID);
    uint64_t late = 0, early = 0, small = 0;
    const uint64_t mine = 1000 + static_cast<uint64_t>(me);
    std::vector<hcomm_request_t*> reqs(4, nullptr);
    hcomm_status_t st[4];
    RCHECK_OK(hcomm_irecv(ctx, left, &late, 8, 77, HCOMM_TAG_MASK_ALL, &reqs[0]));  // sent after the barrier
    RCHECK_OK(hcomm_isend(ctx, right, &mine, 8, 78, &reqs[2]));
    RCHECK_OK(hcomm_irecv(ctx, left, &early, 8, 78, HCOMM_TAG_MASK_ALL, &reqs[3]));
    // reqs[1] stays NULL: skipped. reqs[2], reqs[3] finish (waited for
    // without freeing); only tag 77 is still to come.
    RCHECK_OK(hcomm_wait(reqs[2], T));
    RCHECK_OK(hcomm_wait(reqs[3], T));
    RCHECK_EQ_STATUS(hcomm_wait_all(reqs.data(), reqs.size(), st, 200), HCOMM_ERR_TIMEOUT);
    RCHECK(reqs[0] != nullptr && st[0] == HCOMM_IN_PROGRESS) << st[0];
    for (int i = 1; i < 4; ++i) RCHECK(reqs[i] == nullptr && st[i] == HCOMM_OK) << i << ": " << st[i];
    RCHECK(early == 1000 + static_cast<uint64_t>(left)) << early;
    RCHECK_OK(hcomm_barrier(ctx, T));
    RCHECK_OK(hcomm_send(ctx, right, &mine, 8, 77, T));
    RCHECK_OK(hcomm_wait_all(reqs.data(), reqs.size(), st, T));
    for (int i = 0; i < 4; ++i) RCHECK(reqs[i] == nullptr && st[i] == HCOMM_OK) << i << ": " << st[i];
    RCHECK(late == 1000 + static_cast<uint64_t>(left)) << late;
    // A failure (a truncated receive) is returned with its index; the rest
    // of the window still completes and is freed.
    RCHECK_OK(hcomm_send(ctx, right, &mine, 8, 79, T));
    RCHECK_OK(hcomm_send(ctx, right, &mine, 8, 80, T));
    uint32_t half = 0;
    RCHECK_OK(hcomm_irecv(ctx, left, &small, 8, 79, HCOMM_TAG_MASK_ALL, &reqs[0]));
    RCHECK_OK(hcomm_irecv(ctx, left, &half, 4, 80, HCOMM_TAG_MASK_ALL, &reqs[1]));
    RCHECK_EQ_STATUS(hcomm_wait_all(reqs.data(), 2, st, T), HCOMM_ERR_TRUNCATED);
    RCHECK(std::string(hcomm_last_error()).find("request 1") != std::string::npos) << hcomm_last_error();
    RCHECK(reqs[0] == nullptr && reqs[1] == nullptr && st[0] == HCOMM_OK && st[1] == HCOMM_ERR_TRUNCATED);
    RCHECK(small == 1000 + static_cast<uint64_t>(left)) << small;
    // The same live handle twice: refused before anything is waited for or
    // freed (it would be freed twice); the array is left as it was.
    RCHECK_OK(hcomm_send(ctx, right, &mine, 8, 81, T));
    RCHECK_OK(hcomm_irecv(ctx, left, &small, 8, 81, HCOMM_TAG_MASK_ALL, &reqs[0]));
    reqs[1] = nullptr;
    reqs[2] = reqs[0];
    RCHECK_EQ_STATUS(hcomm_wait_all(reqs.data(), 3, st, T), HCOMM_ERR_INVALID);
    RCHECK(std::string(hcomm_last_error()).find("request 2 of 3 appears twice") != std::string::npos)
        << hcomm_last_error();
    RCHECK(reqs[0] != nullptr && reqs[2] == reqs[0]);
    RCHECK_OK(hcomm_wait_all(reqs.data(), 1, st, T));  // the lone entry still works
    RCHECK(reqs[0] == nullptr && st[0] == HCOMM_OK && small == 1000 + static_cast<uint64_t>(left));
    RCHECK_OK(hcomm_barrier(ctx, T));
  });
}

// ---- the cancel rule ----------------------------------------------------------------------
// A call that returned never touches the caller's memory again: a blocking
// call that timed out has withdrawn its operation, and hcomm_request_cancel
// withdraws or runs to the end, never half. ASan cannot see the kernel, a
// NIC or the simulator write late, so buffers get canaries after the call
// returns and are checked after the peer had every chance to write them.

constexpr uint8_t kCanary = 0xc5;
bool all_canary(const std::vector<uint8_t>& b) {
  return std::all_of(b.begin(), b.end(), [](uint8_t x) { return x == kCanary; });
}
// Drives progress for a while (the peer's late message arrives meanwhile).
void progress_for(hcomm_context_t* ctx, int ms) {
  auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (std::chrono::steady_clock::now() < end) RCHECK_OK(hcomm_progress(ctx));
}

TEST_P(Api, TimedOutBlockingCallsHaveWithdrawnTheirOperation) {
  run([](hcomm_context_t* ctx, int me, int n) {
    (void)n;
    hcomm_mem_t* reg;
    RCHECK_OK(hcomm_mem_alloc(ctx, size_t{1} << 20, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &reg));
    for (size_t s : {size_t{64}, size_t{1} << 20}) {
      // (a) a receive that timed out is unposted: the message that comes
      // later is not written into its buffer, and the next receive gets it.
      const uint64_t ta = 100 + s;
      if (me == 0) {
        std::vector<uint8_t> b(s, 0);
        RCHECK_EQ_STATUS(hcomm_recv(ctx, 1, b.data(), s, ta, HCOMM_TAG_MASK_ALL, nullptr, 100), HCOMM_ERR_TIMEOUT);
        RCHECK(std::strstr(hcomm_last_error(), "withdrawn") != nullptr) << hcomm_last_error();
        std::fill(b.begin(), b.end(), kCanary);
        RCHECK_OK(hcomm_barrier(ctx, T));  // rank 1 sends now
        progress_for(ctx, 50);
        RCHECK(all_canary(b)) << "size " << s << ": a timed-out receive's buffer was written";
        std::vector<uint8_t> c(s, 0);
        hcomm_recv_info_t info;
        RCHECK_OK(hcomm_recv(ctx, 1, c.data(), s, ta, HCOMM_TAG_MASK_ALL, &info, T));
        RCHECK(info.length == s);
        RCHECK(pattern_mismatch(c, 1, s, s) == s) << "size " << s << " byte " << pattern_mismatch(c, 1, s, s);
      } else if (me == 1) {
        std::vector<uint8_t> b(s);
        fill_pattern(b, 1, s, s);
        RCHECK_OK(hcomm_barrier(ctx, T));
        RCHECK_OK(hcomm_send(ctx, 0, b.data(), s, ta, T));
      } else {
        RCHECK_OK(hcomm_barrier(ctx, T));
      }
      RCHECK_OK(hcomm_barrier(ctx, T));
    }
    // (b) a rendezvous send that timed out is retracted: the receiver, which
    // posts later, never sees it, from a plain buffer or registered memory.
    const size_t s = size_t{1} << 20;
    for (int registered = 0; registered < 2; ++registered) {
      const uint64_t tb = 200 + static_cast<uint64_t>(registered);
      if (me == 1) {
        std::vector<uint8_t> plain(s);
        uint8_t* b = registered ? static_cast<uint8_t*>(hcomm_mem_ptr(reg)) : plain.data();
        fill_pattern(b, 7, s, s);
        RCHECK_EQ_STATUS(hcomm_send(ctx, 0, b, s, tb, 100), HCOMM_ERR_TIMEOUT);
        std::memset(b, kCanary, s);  // reused at once, as a caller may
        RCHECK_OK(hcomm_barrier(ctx, T));
        std::vector<uint8_t> second(s);
        fill_pattern(second, 8, s, s);
        RCHECK_OK(hcomm_send(ctx, 0, second.data(), s, tb, T));
      } else if (me == 0) {
        RCHECK_OK(hcomm_barrier(ctx, T));
        std::vector<uint8_t> c(s, 0);
        RCHECK_OK(hcomm_recv(ctx, 1, c.data(), s, tb, HCOMM_TAG_MASK_ALL, nullptr, T));
        const size_t bad = pattern_mismatch(c, 8, s, s);
        RCHECK(bad == s) << "registered=" << registered << " byte " << bad
                         << ": got the retracted send (or its reused buffer)";
        int found = 1;
        RCHECK_OK(hcomm_probe(ctx, 1, tb, HCOMM_TAG_MASK_ALL, &found, nullptr));
        RCHECK(found == 0) << "the retracted send is still visible";
      } else {
        RCHECK_OK(hcomm_barrier(ctx, T));
      }
      RCHECK_OK(hcomm_barrier(ctx, T));
    }
    // (c) sendrecv: both halves are withdrawn when it times out.
    if (me == 0) {
      std::vector<uint8_t> out(s, 1), in(64, 0);
      RCHECK_EQ_STATUS(hcomm_sendrecv(ctx, 1, out.data(), s, 300, 1, in.data(), in.size(), 301, HCOMM_TAG_MASK_ALL,
                                      nullptr, 100),
                       HCOMM_ERR_TIMEOUT);
      std::fill(in.begin(), in.end(), kCanary);
      // Messages to a peer arrive in order: this one comes after the
      // withdrawn send's RTS and its retraction, however slow the wire.
      uint64_t after = 1;
      RCHECK_OK(hcomm_send(ctx, 1, &after, 8, 302, T));
      RCHECK_OK(hcomm_barrier(ctx, T));
      progress_for(ctx, 50);
      RCHECK(all_canary(in)) << "a timed-out sendrecv's receive buffer was written";
      RCHECK_OK(hcomm_barrier(ctx, T));
    } else if (me == 1) {
      RCHECK_OK(hcomm_barrier(ctx, T));
      uint8_t v[64] = {9};
      RCHECK_OK(hcomm_send(ctx, 0, v, sizeof v, 301, T));  // arrives after the receive was withdrawn
      uint64_t after = 0;
      RCHECK_OK(hcomm_recv(ctx, 0, &after, 8, 302, HCOMM_TAG_MASK_ALL, nullptr, T));
      progress_for(ctx, 20);
      int found = 1;
      RCHECK_OK(hcomm_probe(ctx, 0, 300, HCOMM_TAG_MASK_ALL, &found, nullptr));
      RCHECK(found == 0) << "the send half of a timed-out sendrecv arrived";
      RCHECK_OK(hcomm_barrier(ctx, T));
    } else {
      RCHECK_OK(hcomm_barrier(ctx, T));
      RCHECK_OK(hcomm_barrier(ctx, T));
    }
    if (me == 0) {  // the late 64 bytes are a message like any other
      uint8_t v[64];
      RCHECK_OK(hcomm_recv(ctx, 1, v, sizeof v, 301, HCOMM_TAG_MASK_ALL, nullptr, T));
    }
    RCHECK_OK(hcomm_barrier(ctx, T));
    RCHECK_OK(hcomm_mem_release(reg));
  });
}

// Cancel races the peer at random moments: whichever side wins, the outcome
// is whole (cancelled: the peer never sees it, the buffer is untouched;
// completed: every byte right). The seed is printed so a failure replays.
TEST_P(Api, CancelIsCancelledOrCompletedNeverHalf) {
  run([](hcomm_context_t* ctx, int me, int n) {
    (void)n;
    const size_t s = size_t{256} << 10;
    const unsigned seed = 12345u + static_cast<unsigned>(me);
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> pause_us(0, 3000);
    int outcomes[2] = {};  // [completed]
    auto nap = [&] { std::this_thread::sleep_for(std::chrono::microseconds(pause_us(rng))); };
    if (me > 1) {
      RCHECK_OK(hcomm_barrier(ctx, T));
      return;
    }
    // Nonblocking forms first, with no peer: an unmatched receive and a
    // rendezvous send are withdrawn; an eager send has completed already.
    {
      std::vector<uint8_t> b(s, 0);
      hcomm_request_t* q;
      RCHECK_OK(hcomm_irecv(ctx, 1 - me, b.data(), s, 999, HCOMM_TAG_MASK_ALL, &q));
      RCHECK_EQ_STATUS(hcomm_request_cancel(q), HCOMM_ERR_CANCELLED);
      int done = 0;
      RCHECK_EQ_STATUS(hcomm_test(q, &done), HCOMM_ERR_CANCELLED);
      RCHECK(done == 1);
      RCHECK_EQ_STATUS(hcomm_request_cancel(q), HCOMM_ERR_CANCELLED);  // again: the same final status
      hcomm_request_free(q);
      uint64_t small = 5;
      RCHECK_OK(hcomm_isend(ctx, 1 - me, &small, 8, 998, &q));
      RCHECK_OK(hcomm_request_cancel(q));  // eager: already complete, delivered as sent
      hcomm_request_free(q);
      uint64_t got = 0;
      RCHECK_OK(hcomm_recv(ctx, 1 - me, &got, 8, 998, HCOMM_TAG_MASK_ALL, nullptr, T));
      RCHECK(got == 5);
    }
    for (int it = 0; it < 40; ++it) {
      const bool sender_cancels = it % 2 == 0;
      const uint64_t tag = 1000 + static_cast<uint64_t>(it), verdict_tag = 5000 + static_cast<uint64_t>(it);
      if (me == 1) {
        std::vector<uint8_t> b(s);
        fill_pattern(b, it, s, s);
        hcomm_request_t* q;
        RCHECK_OK(hcomm_isend(ctx, 0, b.data(), s, tag, &q));
        int32_t verdict;
        if (sender_cancels) {
          nap();
          hcomm_status_t st = hcomm_request_cancel(q);
          RCHECK(st == HCOMM_OK || st == HCOMM_ERR_CANCELLED) << hcomm_strerror(st) << ": " << hcomm_last_error();
          verdict = st;
          std::fill(b.begin(), b.end(), kCanary);
          RCHECK_OK(hcomm_send(ctx, 0, &verdict, 4, verdict_tag, T));
        } else {
          RCHECK_OK(hcomm_recv(ctx, 0, &verdict, 4, verdict_tag, HCOMM_TAG_MASK_ALL, nullptr, T));
          if (verdict == HCOMM_OK) {
            RCHECK_OK(hcomm_wait(q, T));
          } else {  // the receive was withdrawn: this send must be retractable
            RCHECK_EQ_STATUS(hcomm_request_cancel(q), HCOMM_ERR_CANCELLED);
          }
        }
        outcomes[verdict == HCOMM_OK] += 1;
        hcomm_request_free(q);
      } else {
        std::vector<uint8_t> b(s, kCanary);  // a cancelled receive leaves it so
        hcomm_request_t* q;
        int32_t verdict;
        if (sender_cancels) {
          nap();
          RCHECK_OK(hcomm_irecv(ctx, 1, b.data(), s, tag, HCOMM_TAG_MASK_ALL, &q));
          RCHECK_OK(hcomm_recv(ctx, 1, &verdict, 4, verdict_tag, HCOMM_TAG_MASK_ALL, nullptr, T));
          if (verdict == HCOMM_OK) {
            RCHECK_OK(hcomm_wait(q, T));
          } else {
            int done = 1;
            RCHECK_EQ_STATUS(hcomm_test(q, &done), HCOMM_IN_PROGRESS);
            RCHECK(done == 0) << "iteration " << it << ": received a send its sender cancelled";
            RCHECK_EQ_STATUS(hcomm_request_cancel(q), HCOMM_ERR_CANCELLED);
          }
        } else {
          RCHECK_OK(hcomm_irecv(ctx, 1, b.data(), s, tag, HCOMM_TAG_MASK_ALL, &q));
          nap();
          hcomm_status_t st = hcomm_request_cancel(q);
          RCHECK(st == HCOMM_OK || st == HCOMM_ERR_CANCELLED) << hcomm_strerror(st) << ": " << hcomm_last_error();
          verdict = st;
          if (st == HCOMM_ERR_CANCELLED) std::fill(b.begin(), b.end(), kCanary);
          RCHECK_OK(hcomm_send(ctx, 1, &verdict, 4, verdict_tag, T));
        }
        hcomm_request_free(q);
        if (verdict == HCOMM_OK) {
          RCHECK(pattern_mismatch(b, it, s, s) == s) << "iteration " << it << " byte " << pattern_mismatch(b, it, s, s);
        } else {
          progress_for(ctx, 5);
          RCHECK(all_canary(b)) << "iteration " << it << " (seed " << seed << "): a cancelled receive was written";
        }
        outcomes[verdict == HCOMM_OK] += 1;
      }
    }
    std::fprintf(stderr, "[rank %d] seed %u: cancelled %d, completed %d\n", me, seed, outcomes[0], outcomes[1]);
    RCHECK_OK(hcomm_barrier(ctx, T));
  });
}

// A blocking put whose DMA outlives the call's timeout cannot be withdrawn:
// the call waits (within the cancel bound) until the engine is done with the
// buffers, and then reports how it ended. The device is stalled past the
// timeout; the caller reuses its buffer at once after the call; the target
// must hold the bytes of before.
TEST_P(Api, TimedOutPutWaitsForItsDmaBeforeReturning) {
  if (std::string why = why_no_stall(); !why.empty()) GTEST_SKIP() << why;
  test::SimProcess* sim = g_sim;
  run([sim](hcomm_context_t* ctx, int me, int n) {
    const int right = (me + 1) % n, left = (me + n - 1) % n;
    const size_t s = size_t{1} << 20;
    hcomm_mem_t *w, *l;
    RCHECK_OK(hcomm_mem_alloc(ctx, s, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w));
    RCHECK_OK(hcomm_mem_alloc(ctx, s, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &l));
    auto keys = exchange_keys(ctx, w, 12);
    auto* lp = static_cast<uint8_t*>(hcomm_mem_ptr(l));
    auto* wp = static_cast<uint8_t*>(hcomm_mem_ptr(w));
    // A stall within the cancel bound (about 1 s here), then one past it:
    // giving up on the peer would not stop the engine, so the put still
    // waits for it.
    struct Round {
      const char* stall;
      long min_ms;
      size_t seed;
    };
    for (const Round& round : {Round{"stall 0 400", 300, s}, Round{"stall 0 2500", 2000, s + 1}}) {
      fill_pattern(lp, me, round.seed, s);
      RCHECK_OK(hcomm_barrier(ctx, T));
      if (me == 0) {
        RCHECK(sim->control(round.stall) == "ok");  // rank 0 drives device 0
        auto t0 = std::chrono::steady_clock::now();
        hcomm_status_t st = hcomm_put(ctx, lp, s, keys[right], 0, 50);
        const auto ms =
            std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
        RCHECK(st == HCOMM_OK) << round.stall << ": ran to its end after the timeout: " << hcomm_strerror(st) << " "
                               << hcomm_last_error();
        RCHECK(ms >= round.min_ms) << round.stall << ": returned after " << ms
                                   << " ms, before the stalled DMA could have finished";
      } else {
        RCHECK_OK(hcomm_put(ctx, lp, s, keys[right], 0, T));
      }
      std::memset(lp, kCanary, s);  // reused at once: the engine must be done with it
      RCHECK_OK(hcomm_barrier(ctx, T));
      RCHECK(pattern_mismatch(wp, left, round.seed, s) == s)
          << round.stall << ": byte " << pattern_mismatch(wp, left, round.seed, s);
      RCHECK_OK(hcomm_barrier(ctx, T));
    }
    release_keys(keys);
    RCHECK_OK(hcomm_mem_release(w));
    RCHECK_OK(hcomm_mem_release(l));
  });
}

// A sender that dies while its receiver's engine copies the message: the
// receive must not return while that copy can still write into its buffer.
// The receiver's device takes the claim's compare-swap and then stalls
// ("stall 0 MS 1") with the copy queued; the sender dies meanwhile, and the
// receiver notices it long before the stall ends. It returns when the copy
// is done (the message whole: it was claimed and read to the end), not at
// the failure; a canary written into the buffer right after the call stays.
TEST_P(Api, SenderDyingMidCopyLeavesTheReturnedReceiveAlone) {
  if (std::string why = why_no_stall(); !why.empty()) GTEST_SKIP() << why;
  test::SimProcess* sim = g_sim;
  run(
      [sim](hcomm_context_t* ctx, int me, int n) {
        const int sender = n - 1;
        const size_t s = size_t{4} << 20;
        hcomm_mem_t* m;
        RCHECK_OK(hcomm_mem_alloc(ctx, s, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &m));
        auto* p = static_cast<uint8_t*>(hcomm_mem_ptr(m));
        if (me == sender) fill_pattern(p, me, s, s);
        else std::memset(p, 0, s);
        constexpr int kStallMs = 800;
        RCHECK_OK(hcomm_barrier(ctx, T));
        // The next descriptor device 0 takes is rank 0's claim (rank 0 drives
        // device 0; the other ranks stay off their devices until rank 0 is done).
        if (me == 0) {
          RCHECK(sim->control("stall 0 " + std::to_string(kStallMs) + " 1") == "ok");
        }
        RCHECK_OK(hcomm_barrier(ctx, T));
        if (me == sender) {
          hcomm_request_t* q;
          RCHECK_OK(hcomm_isend(ctx, 0, p, s, 7, &q));
          std::this_thread::sleep_for(std::chrono::milliseconds(150));  // claimed; its copy waits on the stall
          ::kill(::getpid(), SIGKILL);
        }
        if (me == 0) {
          const auto t0 = std::chrono::steady_clock::now();
          hcomm_recv_info_t info;
          hcomm_status_t st = hcomm_recv(ctx, sender, p, s, 7, HCOMM_TAG_MASK_ALL, &info, 20000);
          const auto ms =
              std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
          const std::string why = hcomm_last_error();
          const bool whole = pattern_mismatch(p, sender, s, s) == s;
          std::memset(p, kCanary, s);  // the call returned: the buffer is the caller's again
          std::this_thread::sleep_for(std::chrono::milliseconds(kStallMs + 200));  // any late copy lands by now
          bool kept = true;
          for (size_t i = 0; i < s && kept; ++i) kept = p[i] == kCanary;
          RCHECK(kept) << "the receive returned (" << hcomm_strerror(st) << " after " << ms
                       << " ms) and its buffer was written afterwards";
          RCHECK(st == HCOMM_OK) << "the claimed message was read to its end, yet: " << hcomm_strerror(st) << " "
                                 << why << " after " << ms << " ms";
          RCHECK(whole) << "OK with a message that is not the one sent";
          RCHECK(ms >= kStallMs / 2) << "returned after " << ms << " ms, before the stalled copy could have run";
          RCHECK(sim->control("clear 0") == "ok");
          for (int r = 1; r < sender; ++r) RCHECK_OK(hcomm_send(ctx, r, &ms, sizeof ms, 8, T));
        } else {
          int64_t ms = 0;
          RCHECK_OK(hcomm_recv(ctx, 0, &ms, sizeof ms, 8, HCOMM_TAG_MASK_ALL, nullptr, 30000));
        }
        hcomm_status_t st = hcomm_finalize(ctx);  // its barrier cannot complete with a dead rank
        RCHECK(st != HCOMM_OK);
        ::_exit(0);
      },
      90, {GetParam().ranks - 1});
}

// A wildcard receive that matched a message and whose read is held up past
// the cancel bound (its device stalls): cancel declares the rank it matched
// failed, the one holding it up, though the receive names no rank, so that
// rank's transports stop touching this rank's memory, and that rank learns it
// (its send fails with PEER_FAILURE). (The stalled copy itself is a device
// that stalls without being lost: docs/api.md.)
TEST_P(Api, CancelOfAStuckWildcardReceiveClosesTheRankItMatched) {
  if (std::string why = why_no_stall(); !why.empty()) GTEST_SKIP() << why;
  test::SimProcess* sim = g_sim;
  run([sim](hcomm_context_t* ctx, int me, int n) {
    const int sender = n - 1;
    const size_t s = size_t{1} << 20;
    hcomm_mem_t* m;
    RCHECK_OK(hcomm_mem_alloc(ctx, s, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &m));
    auto* p = static_cast<uint8_t*>(hcomm_mem_ptr(m));
    std::memset(p, me, s);
    constexpr int kStallMs = 2500;  // past the cancel bound (1 s + peer_check_ms)
    RCHECK_OK(hcomm_barrier(ctx, T));
    if (me == 0) {
      RCHECK(sim->control("stall 0 " + std::to_string(kStallMs) + " 1") == "ok");  // after rank 0's claim
    }
    RCHECK_OK(hcomm_barrier(ctx, T));
    if (me == sender) {
      hcomm_request_t* q;
      RCHECK_OK(hcomm_isend(ctx, 0, p, s, 9, &q));
      // Rank 0 declares us failed and closes its connection: we learn it
      // at our next liveness check, not at this wait's timeout.
      const auto t0 = std::chrono::steady_clock::now();
      hcomm_status_t st = hcomm_wait(q, 20000);
      const auto ms =
          std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
      RCHECK(st == HCOMM_ERR_PEER_FAILURE) << hcomm_strerror(st) << " " << hcomm_last_error();
      RCHECK(ms < 10000) << "learned it only after " << ms << " ms";
      hcomm_request_free(q);
    } else if (me == 0) {
      hcomm_request_t* q;
      RCHECK_OK(hcomm_irecv(ctx, HCOMM_ANY_SOURCE, p, s, 9, HCOMM_TAG_MASK_ALL, &q));
      progress_for(ctx, 200);  // matched and claimed; the copy waits on the stall
      hcomm_status_t st = hcomm_request_cancel(q);
      const std::string why = hcomm_last_error();
      hcomm_request_free(q);
      RCHECK(st == HCOMM_ERR_PEER_FAILURE) << hcomm_strerror(st) << " " << why;
      RCHECK(why.find("rank " + std::to_string(sender) + ":") != std::string::npos) << why;
      uint64_t v = 0;
      RCHECK_EQ_STATUS(hcomm_send(ctx, sender, &v, 8, 10, T), HCOMM_ERR_PEER_FAILURE);  // closed
      std::this_thread::sleep_for(std::chrono::milliseconds(kStallMs));  // the stalled copy ends
      RCHECK(sim->control("clear 0") == "ok");
    }
    hcomm_status_t st = hcomm_finalize(ctx);  // rank 0 and the sender no longer talk: its barrier may fail
    (void)st;
    ::_exit(0);
  });
}

// An RMA cannot be called back: cancel waits until it is done at the target.
TEST_P(Api, CancelledOneSidedOperationsRunToTheirEnd) {
  run([](hcomm_context_t* ctx, int me, int n) {
    const size_t s = size_t{1} << 20;
    hcomm_mem_t *w, *l;
    RCHECK_OK(hcomm_mem_alloc(ctx, s, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w));
    RCHECK_OK(hcomm_mem_alloc(ctx, s, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &l));
    auto keys = exchange_keys(ctx, w, 1);
    const int right = (me + 1) % n, left = (me + n - 1) % n;
    auto* lp = static_cast<uint8_t*>(hcomm_mem_ptr(l));
    fill_pattern(lp, me, s, s);
    hcomm_request_t* q;
    RCHECK_OK(hcomm_iput(ctx, lp, s, keys[right], 0, &q));
    RCHECK_OK(hcomm_request_cancel(q));
    hcomm_request_free(q);
    std::memset(lp, kCanary, s);  // the put is over: reusing its source changes nothing
    RCHECK_OK(hcomm_barrier(ctx, T));
    auto* wp = static_cast<uint8_t*>(hcomm_mem_ptr(w));
    RCHECK(pattern_mismatch(wp, left, s, s) == s) << "byte " << pattern_mismatch(wp, left, s, s);
    RCHECK_OK(hcomm_barrier(ctx, T));
    for (auto* k : keys) RCHECK_OK(hcomm_rkey_release(k));
    RCHECK_OK(hcomm_mem_release(l));
    RCHECK_OK(hcomm_mem_release(w));
  });
}

// ---- one-sided ----------------------------------------------------------------------------

TEST_P(Api, PutGetEverySize) {
  run([](hcomm_context_t* ctx, int me, int n) {
    const size_t win = (64u << 20) + 64;
    hcomm_mem_t *w, *l;
    RCHECK_OK(hcomm_mem_alloc(ctx, win, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w));
    RCHECK_OK(hcomm_mem_alloc(ctx, win, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &l));
    auto keys = exchange_keys(ctx, w, 1);
    auto* lp = static_cast<uint8_t*>(hcomm_mem_ptr(l));
    auto* wp = static_cast<uint8_t*>(hcomm_mem_ptr(w));
    const int right = (me + 1) % n, left = (me + n - 1) % n;
    for (size_t s : {size_t{1}, size_t{8}, size_t{4097}, size_t{1} << 20, size_t{64} << 20}) {
      if (s > max_bytes()) continue;
      const size_t off = s % 64;
      fill_pattern(lp, me, s, s);
      RCHECK_OK(hcomm_put(ctx, lp, s, keys[right], off, T)) << "size " << s;
      RCHECK_OK(hcomm_barrier(ctx, T));
      RCHECK(pattern_mismatch(wp + off, left, s, s) == s)
          << "put size " << s << " byte " << pattern_mismatch(wp + off, left, s, s);
      std::memset(lp, 0, s);
      RCHECK_OK(hcomm_get(ctx, lp, s, keys[right], off, T));
      RCHECK(pattern_mismatch(lp, me, s, s) == s) << "get size " << s << " byte " << pattern_mismatch(lp, me, s, s);
      RCHECK_OK(hcomm_barrier(ctx, T));
    }
    release_keys(keys);
    RCHECK_OK(hcomm_mem_release(w));
    RCHECK_OK(hcomm_mem_release(l));
  });
}

// Implicit completion (_nbi): many puts then one flush; many gets then one
// flush; what a call can check is refused at once.
TEST_P(Api, ImplicitPutGetCompleteAtFlush) {
  run([](hcomm_context_t* ctx, int me, int n) {
    constexpr size_t kChunk = 4096, kChunks = 64;
    hcomm_mem_t *w, *l;
    RCHECK_OK(hcomm_mem_alloc(ctx, kChunk * kChunks, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w));
    RCHECK_OK(hcomm_mem_alloc(ctx, kChunk * kChunks, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &l));
    auto keys = exchange_keys(ctx, w, 3);
    auto* lp = static_cast<uint8_t*>(hcomm_mem_ptr(l));
    auto* wp = static_cast<uint8_t*>(hcomm_mem_ptr(w));
    const int right = (me + 1) % n, left = (me + n - 1) % n;
    fill_pattern(lp, me, 77, kChunk * kChunks);
    for (size_t c = 0; c < kChunks; ++c) RCHECK_OK(hcomm_put_nbi(ctx, lp + c * kChunk, kChunk, keys[right], c * kChunk));
    RCHECK_OK(hcomm_flush(ctx, right, T));
    RCHECK_OK(hcomm_flush(ctx, -1, T));  // nothing left: at once
    RCHECK_OK(hcomm_barrier(ctx, T));
    RCHECK(pattern_mismatch(wp, left, 77, kChunk * kChunks) == kChunk * kChunks)
        << "put_nbi byte " << pattern_mismatch(wp, left, 77, kChunk * kChunks);
    RCHECK_OK(hcomm_barrier(ctx, T));
    std::memset(lp, 0, kChunk * kChunks);
    for (size_t c = 0; c < kChunks; ++c) RCHECK_OK(hcomm_get_nbi(ctx, lp + c * kChunk, kChunk, keys[right], c * kChunk));
    RCHECK_OK(hcomm_flush(ctx, -1, T));
    RCHECK(pattern_mismatch(lp, me, 77, kChunk * kChunks) == kChunk * kChunks)
        << "get_nbi byte " << pattern_mismatch(lp, me, 77, kChunk * kChunks);
    // More small ones than a send queue holds (verbs: 255 entries, most of
    // them unsignalled, retired by the few that are), then one flush.
    constexpr size_t kSmall = 8, kMany = 700;
    static_assert(kSmall * kMany <= kChunk * kChunks);
    RCHECK_OK(hcomm_barrier(ctx, T));
    fill_pattern(lp, me, 91, kSmall * kMany);
    for (size_t j = 0; j < kMany; ++j) RCHECK_OK(hcomm_put_nbi(ctx, lp + j * kSmall, kSmall, keys[right], j * kSmall));
    RCHECK_OK(hcomm_flush(ctx, -1, T));
    RCHECK_OK(hcomm_barrier(ctx, T));
    RCHECK(pattern_mismatch(wp, left, 91, kSmall * kMany) == kSmall * kMany)
        << "small put_nbi byte " << pattern_mismatch(wp, left, 91, kSmall * kMany);
    std::memset(lp, 0, kSmall * kMany);
    for (size_t j = 0; j < kMany; ++j) RCHECK_OK(hcomm_get_nbi(ctx, lp + j * kSmall, kSmall, keys[right], j * kSmall));
    RCHECK_OK(hcomm_flush(ctx, right, T));
    RCHECK(pattern_mismatch(lp, me, 91, kSmall * kMany) == kSmall * kMany)
        << "small get_nbi byte " << pattern_mismatch(lp, me, 91, kSmall * kMany);
    RCHECK_OK(hcomm_barrier(ctx, T));
    RCHECK_EQ_STATUS(hcomm_put_nbi(ctx, lp, 16, keys[right], kChunk * kChunks - 8), HCOMM_ERR_OUT_OF_RANGE);
    RCHECK_EQ_STATUS(hcomm_get_nbi(ctx, lp, 8, nullptr, 0), HCOMM_ERR_INVALID);
    RCHECK_OK(hcomm_flush(ctx, right, T));
    RCHECK_OK(hcomm_barrier(ctx, T));
    release_keys(keys);
    RCHECK_OK(hcomm_mem_release(w));
    RCHECK_OK(hcomm_mem_release(l));
  });
}

template <typename V>
void fill_vals(std::vector<V>& v, int who, int salt) {
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<V>(static_cast<int>((i * 7 + who * 3 + salt) % 5) + 1);
}

// Accumulate from every rank into rank 0, concurrently, for every dtype and op.
TEST_P(Api, AccumulateEveryDtypeAndOpFromAllRanksAtOnce) {
  run([](hcomm_context_t* ctx, int me, int n) {
    const size_t count = 4096;
    hcomm_mem_t *w, *l;
    RCHECK_OK(hcomm_mem_alloc(ctx, count * 8, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w));
    RCHECK_OK(hcomm_mem_alloc(ctx, count * 8, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &l));
    auto keys = exchange_keys(ctx, w, 2);
    auto* wp = static_cast<uint8_t*>(hcomm_mem_ptr(w));
    auto* lp = static_cast<uint8_t*>(hcomm_mem_ptr(l));
    for (int dt = HCOMM_INT8; dt <= HCOMM_FP64; ++dt) {
      for (int op = HCOMM_SUM; op <= HCOMM_MIN; ++op) {
        const size_t es = hcomm_dtype_size(static_cast<hcomm_dtype_t>(dt));
        // Values 1..5 (exact in every type); expected results in double.
        auto val = [&](int who, size_t i) { return static_cast<double>((i * 7 + who * 3 + dt + op) % 5 + 1); };
        auto store = [&](uint8_t* p, size_t i, double v) {
          switch (dt) {
            case HCOMM_INT8: { int8_t x = static_cast<int8_t>(v); std::memcpy(p + i * es, &x, es); break; }
            case HCOMM_UINT8: { uint8_t x = static_cast<uint8_t>(v); std::memcpy(p + i * es, &x, es); break; }
            case HCOMM_INT16: { int16_t x = static_cast<int16_t>(v); std::memcpy(p + i * es, &x, es); break; }
            case HCOMM_UINT16: { uint16_t x = static_cast<uint16_t>(v); std::memcpy(p + i * es, &x, es); break; }
            case HCOMM_INT32: { int32_t x = static_cast<int32_t>(v); std::memcpy(p + i * es, &x, es); break; }
            case HCOMM_UINT32: { uint32_t x = static_cast<uint32_t>(v); std::memcpy(p + i * es, &x, es); break; }
            case HCOMM_INT64: { int64_t x = static_cast<int64_t>(v); std::memcpy(p + i * es, &x, es); break; }
            case HCOMM_UINT64: { uint64_t x = static_cast<uint64_t>(v); std::memcpy(p + i * es, &x, es); break; }
            case HCOMM_FP32: { float x = static_cast<float>(v); std::memcpy(p + i * es, &x, es); break; }
            case HCOMM_FP64: { double x = v; std::memcpy(p + i * es, &x, es); break; }
            case HCOMM_FP16: { _Float16 x = static_cast<_Float16>(v); std::memcpy(p + i * es, &x, es); break; }
            case HCOMM_BF16: { float f = static_cast<float>(v); uint32_t u; std::memcpy(&u, &f, 4);
                               uint16_t b = static_cast<uint16_t>(u >> 16); std::memcpy(p + i * es, &b, es); break; }
          }
        };
        auto load = [&](const uint8_t* p, size_t i) -> double {
          switch (dt) {
            case HCOMM_INT8: { int8_t x; std::memcpy(&x, p + i * es, es); return x; }
            case HCOMM_UINT8: { uint8_t x; std::memcpy(&x, p + i * es, es); return x; }
            case HCOMM_INT16: { int16_t x; std::memcpy(&x, p + i * es, es); return x; }
            case HCOMM_UINT16: { uint16_t x; std::memcpy(&x, p + i * es, es); return x; }
            case HCOMM_INT32: { int32_t x; std::memcpy(&x, p + i * es, es); return x; }
            case HCOMM_UINT32: { uint32_t x; std::memcpy(&x, p + i * es, es); return x; }
            case HCOMM_INT64: { int64_t x; std::memcpy(&x, p + i * es, es); return static_cast<double>(x); }
            case HCOMM_UINT64: { uint64_t x; std::memcpy(&x, p + i * es, es); return static_cast<double>(x); }
            case HCOMM_FP32: { float x; std::memcpy(&x, p + i * es, es); return x; }
            case HCOMM_FP64: { double x; std::memcpy(&x, p + i * es, es); return x; }
            case HCOMM_FP16: { _Float16 x; std::memcpy(&x, p + i * es, es); return static_cast<double>(x); }
            case HCOMM_BF16: { uint16_t b; std::memcpy(&b, p + i * es, es); uint32_t u = uint32_t{b} << 16; float f;
                               std::memcpy(&f, &u, 4); return f; }
          }
          return 0;
        };
        if (me == 0) for (size_t i = 0; i < count; ++i) store(wp, i, val(0, i));
        for (size_t i = 0; i < count; ++i) store(lp, i, val(me, i));
        RCHECK_OK(hcomm_barrier(ctx, T));
        if (me != 0) {
          RCHECK_OK(hcomm_accumulate(ctx, lp, count, static_cast<hcomm_dtype_t>(dt), static_cast<hcomm_op_t>(op),
                                     keys[0], 0, T))
              << "dtype " << dt << " op " << op;
        }
        RCHECK_OK(hcomm_barrier(ctx, T));
        if (me == 0) {
          for (size_t i = 0; i < count; ++i) {
            double want = val(0, i);
            for (int r = 1; r < n; ++r) {
              double v = val(r, i);
              want = op == HCOMM_SUM ? want + v : op == HCOMM_PROD ? want * v : op == HCOMM_MAX ? std::max(want, v) : std::min(want, v);
            }
            RCHECK(load(wp, i) == want) << "dtype " << dt << " op " << op << " i " << i << ": " << load(wp, i)
                                        << " != " << want;
          }
        }
        RCHECK_OK(hcomm_barrier(ctx, T));
      }
    }
    release_keys(keys);
    RCHECK_OK(hcomm_mem_release(w));
    RCHECK_OK(hcomm_mem_release(l));
  });
}

// Accumulate at every size class up to 64 MiB (HCOMM_TEST_MAX_BYTES caps it):
// one element, a page and one, a verbs chunk (1 MiB) and either side of it,
// 64 MiB; each rank into its right neighbour, fp32 sum, 4 bytes in.
TEST_P(Api, AccumulateEverySize) {
  run([](hcomm_context_t* ctx, int me, int n) {
    const size_t win = (64u << 20) + 64;
    hcomm_mem_t *w, *l;
    RCHECK_OK(hcomm_mem_alloc(ctx, win, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w));
    RCHECK_OK(hcomm_mem_alloc(ctx, win, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &l));
    auto keys = exchange_keys(ctx, w, 15);
    auto* wp = static_cast<float*>(hcomm_mem_ptr(w));
    auto* lp = static_cast<float*>(hcomm_mem_ptr(l));
    const int right = (me + 1) % n, left = (me + n - 1) % n;
    auto mine = [](int rank, size_t i) { return static_cast<float>((rank + 1) * (1 + i % 5)); };
    // The values repeat every 5 elements: filled and compared (bitwise: they
    // are small whole numbers) a block of 5 x 1024 at a time, as 64 MiB of
    // element loops cost seconds per rank under TCG and the sanitizers.
    static constexpr size_t kBlock = 5 * 1024;
    std::vector<float> fill(kBlock, 2.0f), ours(kBlock), want(kBlock);
    for (size_t i = 0; i < kBlock; ++i) {
      ours[i] = mine(me, i);
      want[i] = 2.0f + mine(left, i);
    }
    auto blocks = [](float* dst, const float* src, size_t count) {
      for (size_t b = 0; b < count; b += kBlock) std::memcpy(dst + b, src, std::min(kBlock, count - b) * 4);
    };
    for (size_t s : {size_t{4}, size_t{4100}, (size_t{1} << 20) - 4, size_t{1} << 20, (size_t{1} << 20) + 4,
                     size_t{64} << 20}) {
      if (s > max_bytes()) continue;
      const size_t count = s / 4;
      blocks(wp, fill.data(), count + 2);
      blocks(lp, ours.data(), count);
      RCHECK_OK(hcomm_barrier(ctx, T));
      RCHECK_OK(hcomm_accumulate(ctx, lp, count, HCOMM_FP32, HCOMM_SUM, keys[right], 4, T)) << "size " << s;
      RCHECK_OK(hcomm_barrier(ctx, T));
      RCHECK(wp[0] == 2.0f && wp[count + 1] == 2.0f) << "size " << s << ": a word outside the range changed";
      bool same = true;
      for (size_t b = 0; b < count && same; b += kBlock)
        same = std::memcmp(wp + 1 + b, want.data(), std::min(kBlock, count - b) * 4) == 0;
      size_t bad = 0, first = 0;
      for (size_t i = 0; i < count && !same; ++i)
        if (wp[1 + i] != 2.0f + mine(left, i) && bad++ == 0) first = i;
      RCHECK(same) << "size " << s << ": " << bad << " elements wrong, first " << first << ": " << wp[1 + first];
      RCHECK_OK(hcomm_barrier(ctx, T));
    }
    release_keys(keys);
    RCHECK_OK(hcomm_mem_release(w));
    RCHECK_OK(hcomm_mem_release(l));
  });
}

// Accumulates larger than one atomic step (verbs: 1 MiB chunks, each under
// the owner's lock word) from every rank at once, the owner included, at an
// offset that no chunk boundary lines up with: every element must see every
// rank's addition exactly once.
TEST_P(Api, LargeAccumulatesFromEveryRankAtOnceAreElementWiseAtomic) {
  run([](hcomm_context_t* ctx, int me, int n) {
    const size_t bytes = std::min<size_t>(max_bytes(), (5u << 19) + 12) & ~size_t{3};  // 2.5 MiB + 12 B
    const size_t count = bytes / 4 - 1;                                               // from offset 4
    hcomm_mem_t *w, *l;
    RCHECK_OK(hcomm_mem_alloc(ctx, bytes, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w));
    RCHECK_OK(hcomm_mem_alloc(ctx, bytes, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &l));
    auto keys = exchange_keys(ctx, w, 14);
    auto* wp = static_cast<float*>(hcomm_mem_ptr(w));
    auto* lp = static_cast<float*>(hcomm_mem_ptr(l));
    for (size_t i = 0; i < bytes / 4; ++i) wp[i] = 1.0f;
    for (size_t i = 0; i < count; ++i) lp[i] = static_cast<float>((me + 1) * (1 + i % 3));
    RCHECK_OK(hcomm_barrier(ctx, T));
    for (int round = 0; round < 2; ++round)
      RCHECK_OK(hcomm_accumulate(ctx, lp, count, HCOMM_FP32, HCOMM_SUM, keys[0], 4, T)) << "round " << round;
    RCHECK_OK(hcomm_barrier(ctx, T));
    if (me == 0) {
      const float ranks = static_cast<float>(n * (n + 1) / 2);  // sum of me + 1
      RCHECK(wp[0] == 1.0f) << "the word before the range changed: " << wp[0];
      size_t bad = 0, first = 0;
      for (size_t i = 0; i < count; ++i) {
        const float want = 1.0f + 2 * ranks * static_cast<float>(1 + i % 3);
        if (wp[1 + i] != want && bad++ == 0) first = i;
      }
      RCHECK(bad == 0) << bad << " of " << count << " elements wrong, first " << first << ": " << wp[1 + first];
    }
    RCHECK_OK(hcomm_barrier(ctx, T));
    release_keys(keys);
    RCHECK_OK(hcomm_mem_release(w));
    RCHECK_OK(hcomm_mem_release(l));
  });
}

TEST_P(Api, PutWithNotifyAndNonblockingFlushFence) {
  run([](hcomm_context_t* ctx, int me, int n) {
    const size_t s = 1u << 20;
    hcomm_mem_t *w, *l, *flag;
    RCHECK_OK(hcomm_mem_alloc(ctx, s, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w));
    RCHECK_OK(hcomm_mem_alloc(ctx, s, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &l));
    RCHECK_OK(hcomm_mem_alloc(ctx, 64, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &flag));
    auto wk = exchange_keys(ctx, w, 3);
    auto fk = exchange_keys(ctx, flag, 4);
    const int right = (me + 1) % n, left = (me + n - 1) % n;
    auto* lp = static_cast<uint8_t*>(hcomm_mem_ptr(l));
    auto* wp = static_cast<uint8_t*>(hcomm_mem_ptr(w));
    const size_t pn = std::min(s, max_bytes());  // what put_notify moves (the netem run caps it)
    for (uint64_t step = 1; step <= 5; ++step) {
      fill_pattern(lp, me, step, pn);
      RCHECK_OK(hcomm_put_notify(ctx, lp, pn, wk[right], 0, fk[right], 8, step, T));
      RCHECK_OK(hcomm_notify_wait(ctx, flag, 8, step, T)) << "step " << step;
      for (size_t i = 0; i < pn; i += 97) RCHECK(wp[i] == pattern(left, step, i)) << "data behind the notify, step " << step;
      RCHECK_OK(hcomm_barrier(ctx, T));  // the left neighbour may overwrite only after we checked
    }
    // Nonblocking puts into disjoint slices, a fence, an overlapping put, a flush.
    std::vector<hcomm_request_t*> reqs;
    for (int i = 0; i < 16; ++i) {
      std::memset(lp + i * 4096, i + 1, 4096);
      hcomm_request_t* r;
      RCHECK_OK(hcomm_iput(ctx, lp + i * 4096, 4096, wk[right], static_cast<uint64_t>(i) * 4096, &r));
      reqs.push_back(r);
    }
    RCHECK_OK(hcomm_fence(ctx));
    std::memset(lp + 65536, 0x77, 4096);
    RCHECK_OK(hcomm_put(ctx, lp + 65536, 4096, wk[right], 0, T));  // after the fence: lands last
    RCHECK_OK(hcomm_flush(ctx, -1, T));
    for (auto* r : reqs) {
      int done = 0;
      RCHECK_OK(hcomm_test(r, &done));
      RCHECK(done == 1) << "flush returned with a put still in flight";
      hcomm_request_free(r);
    }
    RCHECK_OK(hcomm_barrier(ctx, T));
    RCHECK(wp[0] == 0x77 && wp[4095] == 0x77) << "the fenced put did not land last";
    for (int i = 1; i < 16; ++i) RCHECK(wp[i * 4096] == i + 1 && wp[i * 4096 + 4095] == i + 1) << i;
    // Nonblocking get.
    hcomm_request_t* g;
    RCHECK_OK(hcomm_iget(ctx, lp, 4096, wk[right], 4096, &g));
    RCHECK_OK(hcomm_wait(g, T));
    hcomm_request_free(g);
    RCHECK(lp[0] == 2);
    RCHECK_OK(hcomm_barrier(ctx, T));
    // More put_notify in flight than a verbs send queue holds (each one's
    // word goes out as its data completes, taking the room that completion
    // freed), then an accumulate, whose lock and data wait for their own
    // completions: they must find theirs, not a notify word's. (The qemu
    // suite runs this with verbs pieces of 64 bytes: every put below is 4
    // pieces, and the queue is surely full when the accumulate posts.)
    {
      const int k = 300;
      const size_t at = 131072, acc_at = 262144;  // k slots of 256 bytes, then the accumulated word
      const double zero = 0.0;
      std::memcpy(wp + acc_at, &zero, sizeof zero);  // ours, which the left neighbour adds to
      // An atomic first: verbs self-tests the NIC's atomics at the first one,
      // and that test's wait would drain the queue before the accumulate.
      uint64_t seen = 0;
      RCHECK_OK(hcomm_fetch_add(ctx, fk[right], 24, 0, &seen, T));
      RCHECK_OK(hcomm_barrier(ctx, T));
      std::vector<hcomm_request_t*> pn_reqs;
      for (int i = 0; i < k; ++i) {
        uint8_t* src = lp + at + static_cast<size_t>(i) * 256;
        std::memset(src, i % 251 + 1, 256);
        hcomm_request_t* r;
        RCHECK_OK(hcomm_iput_notify(ctx, src, 256, wk[right], at + static_cast<uint64_t>(i) * 256, fk[right], 16,
                                    static_cast<uint64_t>(i) + 1, &r));
        pn_reqs.push_back(r);
      }
      const double one = 1.0;
      std::memcpy(lp + acc_at, &one, sizeof one);
      RCHECK_OK(hcomm_accumulate(ctx, lp + acc_at, 1, HCOMM_FP64, HCOMM_SUM, wk[right], acc_at, T));
      for (auto* r : pn_reqs) {
        RCHECK_OK(hcomm_wait(r, T));
        hcomm_request_free(r);
      }
      RCHECK_OK(hcomm_barrier(ctx, T));
      const uint64_t word = *reinterpret_cast<const uint64_t*>(static_cast<const uint8_t*>(hcomm_mem_ptr(flag)) + 16);
      RCHECK(word >= 1 && word <= static_cast<uint64_t>(k)) << word;
      for (int i = 0; i < k; ++i)
        RCHECK(wp[at + static_cast<size_t>(i) * 256] == i % 251 + 1 && wp[at + static_cast<size_t>(i) * 256 + 255] == i % 251 + 1)
            << i;
      double acc = 0;
      std::memcpy(&acc, wp + acc_at, sizeof acc);
      RCHECK(acc == 1.0) << acc;
      RCHECK_OK(hcomm_barrier(ctx, T));
    }
    release_keys(wk);
    release_keys(fk);
    RCHECK_OK(hcomm_mem_release(w));
    RCHECK_OK(hcomm_mem_release(l));
    RCHECK_OK(hcomm_mem_release(flag));
  });
}

TEST_P(Api, FetchAddAndCompareSwapAreAtomicAcrossRanks) {
  run([](hcomm_context_t* ctx, int me, int n) {
    hcomm_mem_t* w;
    RCHECK_OK(hcomm_mem_alloc(ctx, 4096, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w));
    auto keys = exchange_keys(ctx, w, 5);
    const int k = 300;
    std::vector<uint64_t> olds;
    for (int i = 0; i < k; ++i) {
      uint64_t old = 0;
      RCHECK_OK(hcomm_fetch_add(ctx, keys[0], 64, 1, &old, T));
      olds.push_back(old);
    }
    for (size_t i = 1; i < olds.size(); ++i) RCHECK(olds[i] > olds[i - 1]) << "fetch_add results not increasing";
    // A lock by compare-swap: each rank takes it once, increments a plain word, releases.
    for (;;) {
      uint64_t old = 0;
      RCHECK_OK(hcomm_compare_swap(ctx, keys[0], 128, 0, static_cast<uint64_t>(me) + 1, &old, T));
      if (old == 0) break;
    }
    uint64_t v = 0, old = 0;
    RCHECK_OK(hcomm_fetch_add(ctx, keys[0], 192, 0, &v, T));  // read
    RCHECK_OK(hcomm_compare_swap(ctx, keys[0], 192, v, v + 1, &old, T));
    RCHECK(old == v) << "the lock did not exclude others";
    RCHECK_OK(hcomm_compare_swap(ctx, keys[0], 128, static_cast<uint64_t>(me) + 1, 0, &old, T));
    RCHECK(old == static_cast<uint64_t>(me) + 1);
    // Nonblocking fetch_add.
    uint64_t nb_old = 0;
    hcomm_request_t* r;
    RCHECK_OK(hcomm_ifetch_add(ctx, keys[0], 256, 5, &nb_old, &r));
    RCHECK_OK(hcomm_wait(r, T));
    hcomm_request_free(r);
    RCHECK_OK(hcomm_barrier(ctx, T));
    if (me == 0) {
      auto* p = static_cast<uint64_t*>(hcomm_mem_ptr(w));
      RCHECK(p[8] == static_cast<uint64_t>(k) * n) << p[8];
      RCHECK(p[24] == static_cast<uint64_t>(n));
      RCHECK(p[16] == 0);
      RCHECK(p[32] == 5u * n);
    }
    RCHECK_OK(hcomm_barrier(ctx, T));
    release_keys(keys);
    RCHECK_OK(hcomm_mem_release(w));
  });
}

// ---- keys and misuse --------------------------------------------------------------------------

TEST_P(Api, RemoteKeysAreCheckedOnEveryAccess) {
  run([](hcomm_context_t* ctx, int me, int n) {
    const int right = (me + 1) % n;
    hcomm_mem_t *w, *ro, *l;
    RCHECK_OK(hcomm_mem_alloc(ctx, 65536, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w));
    RCHECK_OK(hcomm_mem_alloc(ctx, 65536, HCOMM_MEM_HOST, HCOMM_ACCESS_REMOTE_READ, &ro));
    RCHECK_OK(hcomm_mem_alloc(ctx, 65536, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &l));
    std::memset(hcomm_mem_ptr(w), 0x11, 65536);
    std::memset(hcomm_mem_ptr(ro), 0x22, 65536);
    auto wk = exchange_keys(ctx, w, 6);
    auto rk = exchange_keys(ctx, ro, 7);
    auto* lp = static_cast<uint8_t*>(hcomm_mem_ptr(l));
    // Out of bounds, missing right, unregistered local buffer, nulls, bad dtype.
    RCHECK_EQ_STATUS(hcomm_put(ctx, lp, 8, wk[right], 65536 - 4, T), HCOMM_ERR_OUT_OF_RANGE);
    RCHECK_EQ_STATUS(hcomm_get(ctx, lp, 65537, wk[right], 0, T), HCOMM_ERR_OUT_OF_RANGE);
    RCHECK_EQ_STATUS(hcomm_put(ctx, lp, 8, wk[right], UINT64_MAX - 2, T), HCOMM_ERR_OUT_OF_RANGE);
    RCHECK_EQ_STATUS(hcomm_put(ctx, lp, 8, rk[right], 0, T), HCOMM_ERR_ACCESS);
    RCHECK_OK(hcomm_get(ctx, lp, 8, rk[right], 0, T));
    RCHECK(lp[0] == 0x22);
    uint64_t old;
    RCHECK_EQ_STATUS(hcomm_fetch_add(ctx, rk[right], 0, 1, &old, T), HCOMM_ERR_ACCESS);
    RCHECK_EQ_STATUS(hcomm_fetch_add(ctx, wk[right], 4, 1, &old, T), HCOMM_ERR_INVALID) << "misaligned atomic";
    uint8_t stack[64];
    RCHECK_EQ_STATUS(hcomm_put(ctx, stack, 8, wk[right], 0, T), HCOMM_ERR_INVALID) << "unregistered local buffer";
    RCHECK_EQ_STATUS(hcomm_put(ctx, nullptr, 8, wk[right], 0, T), HCOMM_ERR_INVALID);
    RCHECK_EQ_STATUS(hcomm_put(ctx, lp, 0, wk[right], 0, T), HCOMM_ERR_INVALID);
    RCHECK_EQ_STATUS(hcomm_put(ctx, lp, 8, nullptr, 0, T), HCOMM_ERR_INVALID);
    RCHECK_EQ_STATUS(hcomm_accumulate(ctx, lp, 4, static_cast<hcomm_dtype_t>(42), HCOMM_SUM, wk[right], 0, T),
                     HCOMM_ERR_INVALID);
    RCHECK_EQ_STATUS(hcomm_accumulate(ctx, lp, 4, HCOMM_FP32, HCOMM_SUM, wk[right], 2, T), HCOMM_ERR_INVALID)
        << "accumulate offset not a multiple of the element size";
    RCHECK_EQ_STATUS(hcomm_send(ctx, n + 3, lp, 8, 0, T), HCOMM_ERR_INVALID);
    RCHECK_EQ_STATUS(hcomm_mem_alloc(ctx, 0, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &l), HCOMM_ERR_INVALID);
    // Forged and foreign keys.
    uint8_t blob[HCOMM_RKEY_MAX];
    size_t len = sizeof blob;
    RCHECK_OK(hcomm_mem_rkey_pack(w, blob, &len));
    hcomm_rkey_t* k = nullptr;
    RCHECK_EQ_STATUS(hcomm_rkey_import(ctx, right, blob, len, &k), HCOMM_ERR_ACCESS) << "our key presented as right's";
    RCHECK_EQ_STATUS(hcomm_rkey_import(ctx, me, blob, len - 1, &k), HCOMM_ERR_PROTOCOL);
    uint8_t bad[HCOMM_RKEY_MAX];
    std::memcpy(bad, blob, len);
    bad[0] ^= 0xff;
    RCHECK_EQ_STATUS(hcomm_rkey_import(ctx, me, bad, len, &k), HCOMM_ERR_PROTOCOL);
    std::memcpy(bad, blob, len);
    bad[16] ^= 0x01;  // generation
    RCHECK_EQ_STATUS(hcomm_rkey_import(ctx, me, bad, len, &k), HCOMM_ERR_ACCESS);
    std::memcpy(bad, blob, len);
    bad[24] ^= 0x40;  // size: claim more than registered
    RCHECK_EQ_STATUS(hcomm_rkey_import(ctx, me, bad, len, &k), HCOMM_ERR_ACCESS);
    // Revocation: everyone releases `w`; the others' keys for it stop working.
    RCHECK_OK(hcomm_barrier(ctx, T));
    RCHECK_OK(hcomm_mem_release(w));
    RCHECK_OK(hcomm_barrier(ctx, T));
    RCHECK_EQ_STATUS(hcomm_put(ctx, lp, 8, wk[right], 0, T), HCOMM_ERR_ACCESS) << "revoked key still works";
    RCHECK_EQ_STATUS(hcomm_get(ctx, lp, 8, wk[right], 0, T), HCOMM_ERR_ACCESS);
    RCHECK_OK(hcomm_barrier(ctx, T));
    const int left = (me + n - 1) % n;
    auto* lp64 = reinterpret_cast<uint64_t*>(lp);
    if (std::string(hcomm_engine_name(ctx)) != "npu") {  // registered user memory: not on the NPU engine
      // A revoked key on memory that lives on: the owner's bytes are untouched.
      std::vector<uint64_t> keep(8, 0xabababababababab);
      hcomm_mem_t* km = nullptr;
      RCHECK_OK(hcomm_mem_register(ctx, keep.data(), keep.size() * 8, HCOMM_ACCESS_ALL, &km));
      auto kk = exchange_keys(ctx, km, 76);
      RCHECK_OK(hcomm_barrier(ctx, T));
      RCHECK_OK(hcomm_mem_release(km));
      RCHECK_OK(hcomm_barrier(ctx, T));
      lp64[0] = 1;
      RCHECK_EQ_STATUS(hcomm_put(ctx, lp, 8, kk[right], 0, T), HCOMM_ERR_ACCESS) << "revoked key on live memory";
      uint64_t old_v = 0;
      RCHECK_EQ_STATUS(hcomm_fetch_add(ctx, kk[right], 8, 1, &old_v, T), HCOMM_ERR_ACCESS);
      RCHECK_OK(hcomm_barrier(ctx, T));
      for (uint64_t x : keep) RCHECK(x == 0xabababababababab) << "a revoked key changed the owner's memory";
      release_keys(kk);
    }
    // A refused key breaks nothing: the same pair still moves data both ways.
    hcomm_mem_t* w2 = nullptr;
    RCHECK_OK(hcomm_mem_alloc(ctx, 64, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w2));
    auto k2 = exchange_keys(ctx, w2, 77);
    lp64[0] = 1000u + static_cast<unsigned>(me);
    RCHECK_OK(hcomm_put(ctx, lp, 8, k2[right], 0, T)) << "put after a refused key";
    uint64_t out = static_cast<uint64_t>(me), in = 99;
    RCHECK_OK(hcomm_sendrecv(ctx, right, &out, 8, 78, left, &in, 8, 78, HCOMM_TAG_MASK_ALL, nullptr, T))
        << "send after a refused key";
    RCHECK(in == static_cast<uint64_t>(left));
    RCHECK_OK(hcomm_flush(ctx, -1, T));
    RCHECK_OK(hcomm_barrier(ctx, T));
    RCHECK(static_cast<uint64_t*>(hcomm_mem_ptr(w2))[0] == 1000u + static_cast<unsigned>(left));
    RCHECK_OK(hcomm_barrier(ctx, T));
    release_keys(k2);
    RCHECK_OK(hcomm_mem_release(w2));
    release_keys(wk);
    release_keys(rk);
    RCHECK_OK(hcomm_mem_release(ro));
    RCHECK_OK(hcomm_mem_release(l));
  });
}

// Releasing memory while the other ranks write to it and read from it,
// with nothing to separate them: every access either completes (it ran
// before the release returned) or is refused with HCOMM_ERR_ACCESS, the
// pair keeps working, and once the release returned no byte of the memory
// changes. Over verbs an access that passed the key check just before the
// owner deregistered used to reach the NIC after it: a remote access NAK,
// the queue pair in error, the peer failed (docs/api.md, "revocation").
TEST_P(Api, ReleaseRacingAccessesRefusesThemWithoutBreakingThePair) {
  const bool user_mem = !npu();  // registered user memory (not on the NPU engine): its bytes outlive the release
  run([user_mem](hcomm_context_t* ctx, int me, int n) {
    const int right = (me + 1) % n, left = (me + n - 1) % n;
    constexpr size_t kOp = 256, kDepth = 16, kRegion = kOp * kDepth;
    constexpr int kRounds = 12;
    hcomm_mem_t* l = nullptr;
    RCHECK_OK(hcomm_mem_alloc(ctx, 2 * kRegion, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &l));
    auto* lp = static_cast<uint8_t*>(hcomm_mem_ptr(l));
    std::mt19937 rng(static_cast<unsigned>(1234 + me));
    int completed = 0, refused_later = 0;
    for (int round = 0; round < kRounds; ++round) {
      std::vector<uint8_t> keep(kRegion, 0x11);
      hcomm_mem_t* w = nullptr;
      if (user_mem) RCHECK_OK(hcomm_mem_register(ctx, keep.data(), kRegion, HCOMM_ACCESS_ALL, &w));
      else RCHECK_OK(hcomm_mem_alloc(ctx, kRegion, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w));
      auto keys = exchange_keys(ctx, w, 900 + static_cast<uint64_t>(round));
      RCHECK_OK(hcomm_barrier(ctx, T));
      // Our own release comes after a random number of our accesses, while
      // they and the left rank's accesses to our memory are in flight.
      const size_t release_at = rng() % (3 * kDepth);
      std::vector<uint8_t> after;
      bool refused = false;
      std::vector<hcomm_request_t*> reqs;
      auto drain = [&] {
        std::vector<hcomm_status_t> st(reqs.size());
        const hcomm_status_t all = hcomm_wait_all(reqs.data(), reqs.size(), st.data(), T);
        RCHECK(all == HCOMM_OK || all == HCOMM_ERR_ACCESS) << hcomm_strerror(all) << ": " << hcomm_last_error();
        for (hcomm_status_t s : st) {
          RCHECK(s == HCOMM_OK || s == HCOMM_ERR_ACCESS) << "an access racing a release: " << hcomm_strerror(s);
          if (s == HCOMM_OK) ++completed;
          else ++refused_later;
        }
        reqs.clear();
      };
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      for (size_t i = 0; w != nullptr || !refused; ++i) {
        RCHECK(std::chrono::steady_clock::now() < give_up) << "round " << round << ": the right rank's release never "
                                                           << "refused an access";
        if (i == release_at) {
          RCHECK_OK(hcomm_mem_release(w));
          w = nullptr;
          if (user_mem) after = keep;
        }
        if (refused) continue;
        if (i % kDepth == 0) drain();  // each slot's previous access is done
        const size_t slot = i % kDepth;
        hcomm_request_t* q = nullptr;
        hcomm_status_t s;
        if (i % 2 == 0) {
          std::memset(lp + slot * kOp, static_cast<int>(i + round * 7), kOp);
          s = hcomm_iput(ctx, lp + slot * kOp, kOp, keys[right], slot * kOp, &q);
        } else {
          s = hcomm_iget(ctx, lp + kRegion + slot * kOp, kOp, keys[right], slot * kOp, &q);
        }
        if (s == HCOMM_ERR_ACCESS) {
          refused = true;
          continue;
        }
        RCHECK_OK(s) << "access " << i << " of round " << round;
        reqs.push_back(q);
      }
      drain();
      RCHECK_OK(hcomm_barrier(ctx, T));  // nobody accesses our memory any more
      if (user_mem) {
        RCHECK(keep == after) << "round " << round << ": the memory changed after its release returned";
      }
      release_keys(keys);
      // The pair still moves data both ways.
      uint64_t out = static_cast<uint64_t>(me * 100 + round), in = 0;
      RCHECK_OK(hcomm_sendrecv(ctx, right, &out, 8, 950, left, &in, 8, 950, HCOMM_TAG_MASK_ALL, nullptr, T))
          << "send after round " << round;
      RCHECK(in == static_cast<uint64_t>(left * 100 + round));
    }
    hcomm_mem_t* w2 = nullptr;
    RCHECK_OK(hcomm_mem_alloc(ctx, 64, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w2));
    auto k2 = exchange_keys(ctx, w2, 960);
    std::memset(lp, 0, 8);
    lp[0] = static_cast<uint8_t>(me + 1);
    RCHECK_OK(hcomm_put(ctx, lp, 8, k2[right], 0, T)) << "put after the races";
    RCHECK_OK(hcomm_flush(ctx, -1, T));
    RCHECK_OK(hcomm_barrier(ctx, T));
    RCHECK(static_cast<uint8_t*>(hcomm_mem_ptr(w2))[0] == left + 1);
    // Some access of the job ran before its release (one rank alone may have
    // found every release done: four ranks share two CPUs).
    uint64_t total = 0;
    {
      std::vector<uint64_t> counts(static_cast<size_t>(n), 0);  // everyone's, passed round the ring
      counts[static_cast<size_t>(me)] = static_cast<uint64_t>(completed);
      for (int step = 1; step < n; ++step) {
        const int from = (me + n - step) % n;
        uint64_t out = counts[static_cast<size_t>((me + n - step + 1) % n)], in = 0;
        RCHECK_OK(hcomm_sendrecv(ctx, right, &out, 8, 970, left, &in, 8, 970, HCOMM_TAG_MASK_ALL, nullptr, T));
        counts[static_cast<size_t>(from)] = in;
      }
      for (uint64_t c : counts) total += c;
    }
    RCHECK(total > 0) << "no access of the job ran before a release";
    std::printf("rank %d: %d accesses completed, %d refused after they were issued\n", me, completed, refused_later);
    // Over RDMA a request refused after it was posted is the remote access
    // NAK itself (the key check before the post refuses everything else).
    const std::string via = hcomm_peer_transport(ctx, right);
    if (via.find("verbs") != std::string::npos || via.find("npu_roce") != std::string::npos) {
      RCHECK(refused_later == 0) << refused_later << " accesses over " << via << " drew a remote access error";
    }
    RCHECK_OK(hcomm_barrier(ctx, T));
    release_keys(k2);
    RCHECK_OK(hcomm_mem_release(w2));
    RCHECK_OK(hcomm_mem_release(l));
  });
}

TEST_P(Api, RegisteredUserMemory) {
  // Over vfio-user (the simulator's own devices) the device can only DMA
  // fd-backed memory; through VFIO (HCOMM_TEST_DEVICES naming PCI functions,
  // as in the QEMU guest) any memory, in pieces where it is not physically
  // contiguous.
  const bool vfio_user = npu() && (g_devices.empty() || g_devices.rfind("sim:", 0) == 0);
  run([vfio_user](hcomm_context_t* ctx, int me, int n) {
    std::vector<uint64_t> mine(8192, 0);
    hcomm_mem_t* m = nullptr;
    hcomm_status_t st = hcomm_mem_register(ctx, mine.data(), mine.size() * 8, HCOMM_ACCESS_ALL, &m);
    if (vfio_user) {
      // A clear status.
      RCHECK(st == HCOMM_ERR_UNSUPPORTED) << hcomm_strerror(st);
      RCHECK(std::strstr(hcomm_last_error(), "hcomm_mem_alloc") != nullptr) << hcomm_last_error();
      return;
    }
    RCHECK_OK(st);
    hcomm_mem_t* l;
    RCHECK_OK(hcomm_mem_alloc(ctx, 8192 * 8, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &l));
    auto keys = exchange_keys(ctx, m, 8);
    const int right = (me + 1) % n, left = (me + n - 1) % n;
    auto* lp = static_cast<uint64_t*>(hcomm_mem_ptr(l));
    for (int i = 0; i < 8192; ++i) lp[i] = static_cast<uint64_t>(me) * 1000000 + i;
    RCHECK_OK(hcomm_put(ctx, lp, 8192 * 8, keys[right], 0, T));
    RCHECK_OK(hcomm_barrier(ctx, T));
    for (int i = 0; i < 8192; ++i) RCHECK(mine[i] == static_cast<uint64_t>(left) * 1000000 + i) << i;
    std::vector<uint64_t> back(8192);
    hcomm_mem_t* bm;
    RCHECK_OK(hcomm_mem_register(ctx, back.data(), back.size() * 8, HCOMM_ACCESS_ALL, &bm));
    RCHECK_OK(hcomm_get(ctx, back.data(), 8192 * 8, keys[right], 0, T));
    for (int i = 0; i < 8192; ++i) RCHECK(back[i] == static_cast<uint64_t>(me) * 1000000 + i) << "get " << i;
    RCHECK_OK(hcomm_mem_release(bm));
    RCHECK_OK(hcomm_barrier(ctx, T));
    for (int i = 0; i < 8192; ++i) lp[i] = 1;
    RCHECK_OK(hcomm_accumulate(ctx, lp, 8192, HCOMM_UINT64, HCOMM_SUM, keys[0], 0, T));
    // Accumulates and fetch atomics are each atomic among themselves, not
    // with each other: separate the two phases.
    RCHECK_OK(hcomm_barrier(ctx, T));
    uint64_t old;
    for (int i = 0; i < 50; ++i) RCHECK_OK(hcomm_fetch_add(ctx, keys[0], 8, 10, &old, T));
    RCHECK_OK(hcomm_barrier(ctx, T));
    if (me == 0) {
      RCHECK(mine[0] == static_cast<uint64_t>(n - 1) * 1000000 + n) << mine[0];
      RCHECK(mine[1] == static_cast<uint64_t>(n - 1) * 1000000 + 1 + n + 500u * n) << mine[1] << ": lost fetch_add";
    }
    RCHECK_OK(hcomm_barrier(ctx, T));
    release_keys(keys);
    RCHECK_OK(hcomm_mem_release(m));
    RCHECK_OK(hcomm_mem_release(l));
  });
}

TEST_P(Api, DeviceMemory) {
  const bool is_npu = npu();
  run([is_npu](hcomm_context_t* ctx, int me, int n) {
    hcomm_mem_t* d = nullptr;
    hcomm_status_t st = hcomm_mem_alloc(ctx, 1u << 20, HCOMM_MEM_DEVICE, HCOMM_ACCESS_ALL, &d);
    if (!is_npu) {
      RCHECK(st == HCOMM_ERR_UNSUPPORTED) << hcomm_strerror(st);
      return;
    }
    RCHECK_OK(st);
    RCHECK(hcomm_mem_ptr(d) != nullptr) << "HBM should be CPU-visible through BAR2";
    hcomm_mem_t* l;
    RCHECK_OK(hcomm_mem_alloc(ctx, 1u << 20, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &l));
    auto keys = exchange_keys(ctx, d, 9);
    const int right = (me + 1) % n, left = (me + n - 1) % n;
    auto* lp = static_cast<float*>(hcomm_mem_ptr(l));
    for (int i = 0; i < (1 << 18); ++i) lp[i] = static_cast<float>(me + 1);
    // Into the right neighbour's HBM over the fabric, then accumulate on top.
    RCHECK_OK(hcomm_put(ctx, lp, 1u << 20, keys[right], 0, T));
    RCHECK_OK(hcomm_barrier(ctx, T));
    RCHECK_OK(hcomm_accumulate(ctx, lp, 1u << 18, HCOMM_FP32, HCOMM_SUM, keys[right], 0, T));
    RCHECK_OK(hcomm_barrier(ctx, T));
    auto* dp = static_cast<float*>(hcomm_mem_ptr(d));
    for (int i = 0; i < (1 << 18); i += 101) RCHECK(dp[i] == 2.0f * (left + 1)) << i << ": " << dp[i];
    RCHECK_OK(hcomm_barrier(ctx, T));
    release_keys(keys);
    RCHECK_OK(hcomm_mem_release(d));
    RCHECK_OK(hcomm_mem_release(l));
  });
}

// ---- failure -------------------------------------------------------------------------------------

TEST_P(Api, KilledPeerFailsPendingRequestsInsteadOfHanging) {
  run(
      [](hcomm_context_t* ctx, int me, int n) {
        RCHECK_OK(hcomm_barrier(ctx, T));
        if (me == n - 1) {
          ::kill(::getpid(), SIGKILL);  // vanish mid-job, no finalize
        }
        // Everyone else waits for a message the dead rank will never send.
        uint64_t v;
        hcomm_recv_info_t info;
        RCHECK_EQ_STATUS(hcomm_recv(ctx, n - 1, &v, 8, 1, HCOMM_TAG_MASK_ALL, &info, 20000), HCOMM_ERR_PEER_FAILURE);
        RCHECK(std::strstr(hcomm_last_error(), "rank") != nullptr) << hcomm_last_error();
        RCHECK_EQ_STATUS(hcomm_send(ctx, n - 1, &v, 8, 1, T), HCOMM_ERR_PEER_FAILURE);
        // Survivors still talk to each other.
        if (n > 2) {
          const int m = n - 1;  // survivors 0..m-1
          const int right = (me + 1) % m, left = (me + m - 1) % m;
          uint64_t out = static_cast<uint64_t>(me), in = 99;
          RCHECK_OK(hcomm_sendrecv(ctx, right, &out, 8, 2, left, &in, 8, 2, HCOMM_TAG_MASK_ALL, nullptr, T));
          RCHECK(in == static_cast<uint64_t>(left));
        }
        // finalize's barrier cannot complete with a dead rank: it reports it.
        hcomm_status_t st = hcomm_finalize(ctx);
        RCHECK(st != HCOMM_OK);
        ::_exit(0);
      },
      90, {GetParam().ranks - 1});
}

// A peer that goes silent (its host stops answering: no FIN, no RST) is
// noticed by keepalive and the RDMA retry timers: PEER_FAILURE within a bound,
// not a hang and not the operation's own (long) timeout. Needs a second
// machine: spread mode with HCOMM_TEST_SILENCE_CMD, a command that makes the
// machine it runs on drop everything (the qemu suite: netem loss 100%).
TEST_P(Api, SilentPeerIsPeerFailureWithinTheBound) {
  const char* silence = std::getenv("HCOMM_TEST_SILENCE_CMD");
  if (silence == nullptr || test::spread().hosts < 2 || GetParam().ranks != 2)
    GTEST_SKIP() << "needs two machines (spread mode, 2 ranks) and HCOMM_TEST_SILENCE_CMD";
  const std::string cmd = silence;
  // The keepalive bound (HCOMM_KEEPALIVE_MS, default 5 s) + scheduling slack.
  const char* ka = std::getenv("HCOMM_KEEPALIVE_MS");
  const long limit_ms = (ka != nullptr && *ka != '\0' ? std::atol(ka) : 5000) + 5000;
  run(
      [&cmd, limit_ms](hcomm_context_t* ctx, int me, int) {
        RCHECK_OK(hcomm_barrier(ctx, T));
        uint64_t v = 0;
        if (me == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(200));  // rank 0 is waiting by now
          RCHECK(std::system(cmd.c_str()) == 0) << cmd;
          // Silent until rank 0 is surely done (noticed or past its limit).
          std::this_thread::sleep_for(std::chrono::milliseconds(limit_ms + 1000));
          ::_exit(0);  // never finalizes
        }
        auto t0 = std::chrono::steady_clock::now();
        RCHECK_EQ_STATUS(hcomm_recv(ctx, 1, &v, 8, 5, HCOMM_TAG_MASK_ALL, nullptr, 60000), HCOMM_ERR_PEER_FAILURE);
        const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
        std::fprintf(stderr, "[rank 0] silent peer noticed after %lld ms: %s\n", static_cast<long long>(ms),
                     hcomm_last_error());
        RCHECK(ms < limit_ms) << "noticed only after " << ms << " ms";
        ::_exit(0);  // finalize's barrier would wait for the silent rank
      },
      90);
}

// The other way a silent peer is noticed: an RDMA operation to it runs out of
// transport retries. With HCOMM_IB_TIMEOUT=t and HCOMM_IB_RETRY=r the queue
// pair gives up after 4.096 us x 2^t x (r+1); the keepalive is set far longer
// (HCOMM_KEEPALIVE_MS), and the bound plus slack is below what the default
// settings give, so only the configured queue pair can end the put in time.
// HCOMM_TEST_SILENT_BYTES=N (with a small HCOMM_IB_MAX_MSG): after one small
// put, the puts are N bytes and start well after the silence, so the first
// fills the send queue with pieces and fails while waiting for room: a
// message cut short, which fails the pair before its pieces' memory goes.
TEST_P(Api, SilentPeerUnderRdmaIsPeerFailureWithinTheQueuePairBound) {
  const char* silence = std::getenv("HCOMM_TEST_SILENCE_CMD");
  const char* to = std::getenv("HCOMM_IB_TIMEOUT");
  const char* re = std::getenv("HCOMM_IB_RETRY");
  const char* ka = std::getenv("HCOMM_KEEPALIVE_MS");
  if (silence == nullptr || to == nullptr || re == nullptr || ka == nullptr || test::spread().hosts < 2 ||
      GetParam().ranks != 2)
    GTEST_SKIP() << "needs two machines (spread mode, 2 ranks), HCOMM_TEST_SILENCE_CMD, HCOMM_IB_TIMEOUT, "
                    "HCOMM_IB_RETRY and HCOMM_KEEPALIVE_MS";
  auto qp_bound_ms = [](int t, int r) { return 4.096e-3 * std::ldexp(1.0, t) * (r + 1); };
  const double bound_ms = qp_bound_ms(std::atoi(to), std::atoi(re));
  const double slack_ms = 300;  // rxe's timer runs in jiffies, and TCG guests are slow
  // Meaningful only if neither the keepalive nor the default queue pair
  // settings (timeout 14, retry 7: 537 ms) could end the put in time.
  ASSERT_LT(bound_ms + slack_ms, std::atof(ka)) << "the keepalive would notice first";
  ASSERT_LT(bound_ms + slack_ms, qp_bound_ms(14, 7)) << "the default settings would pass too";
  const std::string cmd = silence;
  const char* bytes_env = std::getenv("HCOMM_TEST_SILENT_BYTES");
  const size_t big = bytes_env != nullptr ? std::strtoul(bytes_env, nullptr, 10) : 0;
  run(
      [&](hcomm_context_t* ctx, int me, int) {
        hcomm_mem_t* w;
        RCHECK_OK(hcomm_mem_alloc(ctx, std::max<size_t>(4096, big), HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w));
        auto keys = exchange_keys(ctx, w, 13);
        RCHECK_OK(hcomm_barrier(ctx, T));
        if (me == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
          RCHECK(std::system(cmd.c_str()) == 0) << cmd;
          // Silent until rank 0 is surely done (its last put fails within the bound).
          std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(bound_ms + slack_ms) + 2000));
          ::_exit(0);  // never finalizes
        }
        auto* src = static_cast<uint8_t*>(hcomm_mem_ptr(w));
        std::memset(src, 7, 64);
        // Put until a put fails: the ones before the silence succeed.
        // HCOMM_TEST_SILENT_NBI: hcomm_put_nbi then hcomm_flush (the WRITE
        // has no request; its error completion reaches the flush).
        const bool nbi = std::getenv("HCOMM_TEST_SILENT_NBI") != nullptr;
        const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        hcomm_status_t st = HCOMM_OK;
        long long ms = 0;
        int puts = 0;
        while (st == HCOMM_OK && std::chrono::steady_clock::now() < give_up) {
          auto t0 = std::chrono::steady_clock::now();
          const size_t len = big > 0 && puts > 0 ? big : 64;
          if (nbi) {
            st = hcomm_put_nbi(ctx, src, len, keys[1], 0);
            if (st == HCOMM_OK) st = hcomm_flush(ctx, 1, 60000);
          } else {
            st = hcomm_put(ctx, src, len, keys[1], 0, 60000);
          }
          ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
          ++puts;
          // (big: the first large put starts 1 s after the silence began)
          if (st == HCOMM_OK) std::this_thread::sleep_for(std::chrono::milliseconds(big > 0 && puts == 1 ? 1200 : 20));
        }
        const std::string why = hcomm_last_error();
        std::fprintf(stderr, "[rank 0] put %d failed after %lld ms (queue pair bound %.0f ms): %s\n", puts, ms, bound_ms,
                     why.c_str());
        RCHECK_EQ_STATUS(st, HCOMM_ERR_PEER_FAILURE);
        RCHECK(puts > 1) << "the first put failed: the peer was not silent yet";
        RCHECK(why.find("retry") != std::string::npos) << "not the queue pair's retries: " << why;
        if (nbi) {
          RCHECK(why.find("implicit") != std::string::npos) << "not the put_nbi's own failure: " << why;
        }
        if (big > 0) {
          RCHECK(why.find("cut short") != std::string::npos) << "not a message cut short: " << why;
        }
        RCHECK(ms < bound_ms + slack_ms) << "noticed only after " << ms << " ms";
        ::_exit(0);  // finalize's barrier would wait for the silent rank
      },
      90);
}

// The simulator's fault injection reaches the API as clear statuses (NPU only).
TEST_P(Api, InjectedDeviceFaultsSurfaceAndCorruptionIsCaught) {
  if (!npu()) GTEST_SKIP() << "fault injection is a simulator feature";
  if (nodes()) GTEST_SKIP() << "DMA-queue faults; the two-node cases inject the network's on every test";
  if (g_sim == nullptr) GTEST_SKIP() << "needs hcomm-sim's control socket (not reachable with HCOMM_TEST_DEVICES)";
  test::SimProcess* sim = g_sim;
  run([sim](hcomm_context_t* ctx, int me, int n) {
    const int right = (me + 1) % n, left = (me + n - 1) % n;
    hcomm_mem_t *w, *l;
    RCHECK_OK(hcomm_mem_alloc(ctx, 65536, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w));
    RCHECK_OK(hcomm_mem_alloc(ctx, 65536, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &l));
    auto keys = exchange_keys(ctx, w, 10);
    auto* lp = static_cast<uint8_t*>(hcomm_mem_ptr(l));
    auto* wp = static_cast<uint8_t*>(hcomm_mem_ptr(w));
    for (int i = 0; i < 65536; ++i) lp[i] = static_cast<uint8_t>(i * 3 + me);
    if (me == 0) {
      RCHECK(sim->control("fail 0 1") == "ok");  // rank 0 drives device 0
    }
    RCHECK_OK(hcomm_barrier(ctx, T));
    hcomm_status_t st = hcomm_put(ctx, lp, 65536, keys[right], 0, T);
    if (me == 0) {
      RCHECK(st == HCOMM_ERR_DEVICE) << hcomm_strerror(st);
      RCHECK(std::strstr(hcomm_last_error(), "INJECTED") != nullptr) << hcomm_last_error();
      RCHECK_OK(hcomm_put(ctx, lp, 65536, keys[right], 0, T)) << "the engine recovers";
    } else {
      RCHECK_OK(st);
    }
    RCHECK_OK(hcomm_barrier(ctx, T));
    for (int i = 0; i < 65536; ++i) RCHECK(wp[i] == static_cast<uint8_t>(i * 3 + left)) << i;
    // Silent corruption: the put "succeeds"; checking the data catches it.
    RCHECK_OK(hcomm_barrier(ctx, T));
    if (me == 0) {
      RCHECK(sim->control("corrupt 0 1") == "ok");
    }
    RCHECK_OK(hcomm_barrier(ctx, T));
    for (int i = 0; i < 65536; ++i) lp[i] = static_cast<uint8_t>(i * 5 + me);
    RCHECK_OK(hcomm_put(ctx, lp, 65536, keys[right], 0, T));
    RCHECK_OK(hcomm_barrier(ctx, T));
    int bad = 0;
    for (int i = 0; i < 65536; ++i) bad += wp[i] != static_cast<uint8_t>(i * 5 + left);
    RCHECK(bad == (left == 0 ? 1 : 0)) << bad << " corrupted bytes from rank " << left;
    RCHECK_OK(hcomm_barrier(ctx, T));
    // An implicit (_nbi) put that fails on the device: the call succeeds, the
    // next flush covering its peer reports the failure (once); a fence in
    // between waits for it but leaves the report to the flush.
    if (me == 0) {
      RCHECK(sim->control("fail 0 1") == "ok");
      RCHECK_OK(hcomm_put_nbi(ctx, lp, 65536, keys[right], 0));
      RCHECK_OK(hcomm_fence(ctx));
      RCHECK_OK(hcomm_put(ctx, lp, 8, keys[right], 0, T)) << "the fenced put after it";
      RCHECK_EQ_STATUS(hcomm_flush(ctx, right, T), HCOMM_ERR_DEVICE);
      RCHECK(std::strstr(hcomm_last_error(), "INJECTED") != nullptr) << hcomm_last_error();
      RCHECK(std::strstr(hcomm_last_error(), "implicit") != nullptr) << hcomm_last_error();
      RCHECK_OK(hcomm_flush(ctx, right, T)) << "reported once";
    }
    RCHECK_OK(hcomm_barrier(ctx, T));
    release_keys(keys);
    RCHECK_OK(hcomm_mem_release(w));
    RCHECK_OK(hcomm_mem_release(l));
  });
}

// A rendezvous claim whose compare-swap answers a value that is none of the
// message's states (exposed, claimed, retracted) is asked again, not read as
// a retraction: before, the receive stayed posted and the sender waited for
// its FIN until both timed out (found over Soft-RoCE, whose replay of a
// retransmitted compare-swap answered the previous compare-swap's old value;
// the simulator's `stale` fault does the same). NPU only: the claim
// compare-swaps of same-node ranks are the device's fetch atomics.
TEST_P(Api, ClaimAnsweredWithAnotherWordsValueIsAskedAgain) {
  if (!npu()) GTEST_SKIP() << "fault injection is a simulator feature";
  if (nodes()) GTEST_SKIP() << "DMA-queue faults; the two-node cases inject the network's on every test";
  if (g_sim == nullptr) GTEST_SKIP() << "needs hcomm-sim's control socket (not reachable with HCOMM_TEST_DEVICES)";
  test::SimProcess* sim = g_sim;
  run([sim](hcomm_context_t* ctx, int me, int n) {
    constexpr size_t kLen = 256 << 10;  // rendezvous
    constexpr int kWindow = 4;
    std::vector<uint8_t> sbuf(kLen), rbuf(kWindow * kLen);
    for (size_t i = 0; i < kLen; ++i) sbuf[i] = static_cast<uint8_t>(i * 7 + me);
    RCHECK_OK(hcomm_barrier(ctx, T));
    for (int round = 0; round < 3; ++round) {
      // Rank 1 does the claims (it receives); every fetch atomic of its
      // device answers the previous one's old value for a while.
      if (me == 1) {
        RCHECK(sim->control("stale 1 " + std::to_string(1 + round)) == "ok");
      }
      RCHECK_OK(hcomm_barrier(ctx, T));
      if (me == 0) {
        hcomm_request_t* r[kWindow];
        for (int k = 0; k < kWindow; ++k) RCHECK_OK(hcomm_isend(ctx, 1, sbuf.data(), kLen, 40 + k, &r[k]));
        for (auto* q : r) {
          RCHECK_OK(hcomm_wait(q, T)) << hcomm_last_error();
          hcomm_request_free(q);
        }
      } else if (me == 1) {
        hcomm_request_t* r[kWindow];
        std::fill(rbuf.begin(), rbuf.end(), 0);
        for (int k = 0; k < kWindow; ++k)
          RCHECK_OK(hcomm_irecv(ctx, 0, rbuf.data() + k * kLen, kLen, 40 + k, HCOMM_TAG_MASK_ALL, &r[k]));
        for (auto* q : r) {
          RCHECK_OK(hcomm_wait(q, T)) << hcomm_last_error();
          hcomm_request_free(q);
        }
        for (int k = 0; k < kWindow; ++k) {
          for (size_t i = 0; i < kLen; ++i) {
            RCHECK(rbuf[k * kLen + i] == static_cast<uint8_t>(i * 7)) << "message " << k << " byte " << i;
          }
        }
        RCHECK(sim->control("clear 1") == "ok");
      }
      RCHECK_OK(hcomm_barrier(ctx, T));
    }
    (void)n;
  });
}

INSTANTIATE_TEST_SUITE_P(Engines, Api,
                         ::testing::Values(Param{"host", 2}, Param{"host", 4}, Param{"npu", 2}, Param{"npu", 4},
                                           Param{"npu", 2, true}, Param{"npu", 4, true},
                                           Param{"npu", 2, true, "get"}, Param{"npu", 2, true, "put"}),
                         param_name);

}  // namespace
}  // namespace hcomm
