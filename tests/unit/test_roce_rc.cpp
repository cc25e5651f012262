// hcomm-sim's RoCEv2 reliable-connection engine (sim/roce/rc.h), two
// engines joined by an in-memory wire that can drop, duplicate, reorder and
// corrupt frames (seeded, so every run is the same): every operation's
// result is exact whatever the wire does, a corrupted frame is dropped by
// the ICRC check (the counter equals the corruptions injected), duplicates
// of non-idempotent requests (WRITE_REDUCE, atomics) are never applied
// twice, a silent peer ends in RETRY_EXC_ERR after retry_cnt timeouts, a
// receiver without receives answers RNR and the sender waits, and a bad key,
// range or right is refused with REM_ACCESS_ERR and the target untouched.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <random>
#include <vector>

#include "hal/abi/desc.h"
#include "sim/roce/rc.h"

namespace hcomm::sim::roce {
namespace {

using rdma::WcStatus;

constexpr uint64_t kBase = 0x100000;  // IOVA of each node's memory
constexpr size_t kMem = 1 << 20;

class FlatMemory : public MemoryAccess {
 public:
  std::vector<uint8_t> bytes = std::vector<uint8_t>(kMem);
  uint8_t* map(uint64_t iova, uint64_t len, bool) override {
    if (iova < kBase || len > kMem || iova - kBase > kMem - len) return nullptr;
    return bytes.data() + (iova - kBase);
  }
  uint8_t* at(uint64_t iova) { return bytes.data() + (iova - kBase); }
};

struct Faults {
  int drop = 0, dup = 0, reorder = 0, corrupt = 0;  // percent
  bool blackhole = false;                          // deliver nothing
};

struct Node {
  FlatMemory mem;
  std::unique_ptr<MrTable> mrs = std::make_unique<MrTable>(64);
  std::vector<rdma::Cqe> cq;
  std::unique_ptr<Engine> eng;
  uint32_t qpn = 0;
};

class Wire {
 public:
  explicit Wire(uint64_t seed) : rng(seed) {}
  std::mt19937_64 rng;
  Faults f;
  std::deque<std::vector<uint8_t>> q[2];  // q[i]: frames on their way to node i
  uint64_t corrupted = 0;
  std::function<bool(int to, const uint8_t* p, size_t n)> drop_if;  // a chosen frame lost
  void push(int to, const uint8_t* p, size_t n) {
    if (f.blackhole) return;
    if (drop_if && drop_if(to, p, n)) return;
    std::vector<uint8_t> v(p, p + n);
    if (pct(f.drop)) return;
    if (pct(f.corrupt) && n > 46 + 4) {
      // A bit flip in bytes the ICRC covers and nothing else checks (the
      // transport headers and payload; not the BTH byte it masks).
      size_t i;
      do {
        i = wire::kL2L4Len + rng() % (n - wire::kL2L4Len);
      } while (i == wire::kL2L4Len + wire::bth::kMaskedByte);
      v[i] ^= static_cast<uint8_t>(1u << (rng() % 8));
      ++corrupted;
    }
    const bool twice = pct(f.dup);
    if (pct(f.reorder) && !q[to].empty()) {
      q[to].insert(q[to].end() - 1, v);  // overtakes the frame before it
    } else {
      q[to].push_back(v);
    }
    if (twice) {
      q[to].push_back(v);
      if (v != std::vector<uint8_t>(p, p + n)) ++corrupted;  // the corrupted copy goes twice
    }
  }
  bool pct(int p) { return p > 0 && static_cast<int>(rng() % 100) < p; }
};

// The wire's seed: 42, or HCOMM_ROCE_SEED to try others (a failure names its seed).
uint64_t wire_seed() {
  const char* e = std::getenv("HCOMM_ROCE_SEED");
  return e != nullptr ? std::strtoull(e, nullptr, 0) : 42;
}

class RoceRc : public ::testing::Test {
 protected:
  Wire wire{wire_seed()};
  Node n[2];
  uint64_t now = 1'000'000;

  void SetUp() override { make_engines(); }

  void make_engines() {
    for (int i = 0; i < 2; ++i) {
      PortAddr a;
      const uint8_t mac[6] = {0x02, 0x4e, 0x50, 0x55, 0x00, static_cast<uint8_t>(i + 1)};
      std::memcpy(a.mac, mac, 6);
      a.ip = 0x0a000001 + static_cast<uint32_t>(i);
      n[i].eng = std::make_unique<Engine>(
          a, n[i].mem, *n[i].mrs, [this, i](const uint8_t* p, size_t len) { wire.push(1 - i, p, len); },
          [this, i](const rdma::Cqe& c) { n[i].cq.push_back(c); });
    }
  }

  // Registers [kBase, kBase + kMem) on both nodes under key (1 << 8 | 0x11) with `access`.
  void register_all(uint8_t access = rdma::access::ALL) {
    for (Node& x : n) {
      rdma::MrEntry e{};
      e.iova = kBase;
      e.length = kMem;
      e.key = rdma::make_key(1, 0x11);
      e.access = access;
      ASSERT_TRUE(x.mrs->set(e).is_ok());
    }
  }
  static constexpr uint32_t kKey = 1u << 8 | 0x11;

  void connect(uint32_t psn0 = 100, uint32_t psn1 = 5000, uint8_t mtu = 3, uint8_t retry = 7, uint8_t rnr_retry = 7,
               uint8_t timeout = 8) {
    for (Node& x : n) x.qpn = x.eng->create_qp();
    for (int i = 0; i < 2; ++i) {
      rdma::QpAttr a{};
      a.state = static_cast<uint8_t>(rdma::QpState::INIT);
      ASSERT_TRUE(n[i].eng->modify_qp(n[i].qpn, a).is_ok());
      a.state = static_cast<uint8_t>(rdma::QpState::RTR);
      a.path_mtu = mtu;
      a.dest_qpn = n[1 - i].qpn;
      a.rq_psn = i == 0 ? psn1 : psn0;
      a.remote_ip = n[1 - i].eng->addr().ip;
      std::memcpy(a.remote_mac, n[1 - i].eng->addr().mac, 6);
      a.min_rnr_timer = 1;  // 10 us
      ASSERT_TRUE(n[i].eng->modify_qp(n[i].qpn, a).is_ok());
      a.state = static_cast<uint8_t>(rdma::QpState::RTS);
      a.retry_cnt = retry;
      a.rnr_retry = rnr_retry;
      a.timeout = timeout;  // 4.096 us * 2^8 ~ 1 ms
      a.max_rd_atomic = 4;
      a.sq_psn = i == 0 ? psn0 : psn1;
      ASSERT_TRUE(n[i].eng->modify_qp(n[i].qpn, a).is_ok());
    }
  }

  // Runs both engines and the wire until both are idle and the wire is empty
  // (or a step limit passes). Time advances 1 us per step, faster when idle.
  void run(uint64_t max_steps = 2'000'000) {
    for (uint64_t step = 0; step < max_steps; ++step) {
      bool moved = false;
      for (Node& x : n) moved |= x.eng->poll(now);
      for (int i = 0; i < 2; ++i) {
        for (int k = 0; k < 4 && !wire.q[i].empty(); ++k) {
          std::vector<uint8_t> fr = std::move(wire.q[i].front());
          wire.q[i].pop_front();
          n[i].eng->rx(fr.data(), fr.size(), now);
          moved = true;
        }
      }
      if (!moved && !n[0].eng->busy() && !n[1].eng->busy()) return;
      now += moved ? 1000 : 50'000;
    }
    const Counters& c0 = n[0].eng->counters();
    const Counters& c1 = n[1].eng->counters();
    FAIL() << "the engines did not settle: timeouts " << c0.timeouts << "/" << c1.timeouts << ", retransmits "
           << c0.retransmits << "/" << c1.retransmits << ", tx " << c0.tx_frames << "/" << c1.tx_frames
           << ", wire " << wire.q[0].size() << "/" << wire.q[1].size() << "\n"
           << n[0].eng->describe() << n[1].eng->describe();
  }

  rdma::SendWqe wqe(rdma::WrOp op, uint64_t laddr, uint32_t len, uint64_t raddr, uint64_t id) {
    return rdma::make_wqe(op, laddr, kKey, len, raddr, kKey, id);
  }

  void post(int node, const rdma::SendWqe& w) { ASSERT_TRUE(n[node].eng->post_send(n[node].qpn, w).is_ok()); }
  void post_recv(int node, uint64_t laddr, uint32_t len, uint64_t id) {
    rdma::RecvWqe r{};
    r.wr_id = id;
    r.laddr = laddr;
    r.lkey = kKey;
    r.length = len;
    ASSERT_TRUE(n[node].eng->post_recv(n[node].qpn, r).is_ok());
  }

  void fill(int node, uint64_t iova, size_t len, uint8_t seed) {
    for (size_t i = 0; i < len; ++i) n[node].mem.at(iova)[i] = static_cast<uint8_t>(seed + i * 31 + (i >> 8));
  }

  static void expect_all_success(const std::vector<rdma::Cqe>& cq, size_t count) {
    ASSERT_EQ(cq.size(), count);
    for (size_t i = 0; i < cq.size(); ++i)
      EXPECT_EQ(cq[i].status, static_cast<uint8_t>(WcStatus::SUCCESS))
          << "wr " << cq[i].wr_id << ": " << rdma::wc_status_name(static_cast<WcStatus>(cq[i].status));
  }
};

// Every operation, single- and multi-packet, on a clean wire; completions
// in posting order.
TEST_F(RoceRc, EveryOperationOnACleanWire) {
  register_all();
  connect();
  const std::vector<uint32_t> sizes = {0, 1, 7, 1024, 1025, 3000, 65536};
  uint64_t id = 0;
  uint64_t off = 0;
  std::vector<std::pair<uint64_t, uint32_t>> writes, reads;
  for (uint32_t s : sizes) {  // WRITE 0 -> 1 at the same offsets
    fill(0, kBase + off, s, static_cast<uint8_t>(s));
    post(0, wqe(rdma::WrOp::WRITE, kBase + off, s, kBase + off, id++));
    writes.push_back({off, s});
    off += s + 64;
  }
  const uint64_t roff = 0x40000;
  off = roff;
  for (uint32_t s : sizes) {  // READ 1 -> 0
    fill(1, kBase + off, s, static_cast<uint8_t>(s + 3));
    post(0, wqe(rdma::WrOp::READ, kBase + off, s, kBase + off, id++));
    reads.push_back({off, s});
    off += s + 64;
  }
  run();
  expect_all_success(n[0].cq, sizes.size() * 2);
  for (size_t i = 0; i < n[0].cq.size(); ++i) EXPECT_EQ(n[0].cq[i].wr_id, i);
  for (auto [o, s] : writes) EXPECT_EQ(std::memcmp(n[0].mem.at(kBase + o), n[1].mem.at(kBase + o), s), 0) << s;
  for (auto [o, s] : reads) EXPECT_EQ(std::memcmp(n[0].mem.at(kBase + o), n[1].mem.at(kBase + o), s), 0) << s;
  EXPECT_EQ(n[0].cq[sizes.size() + 6].byte_len, 65536u);  // a READ reports its length
}

TEST_F(RoceRc, SendsImmediatesAtomicsAndReduce) {
  register_all();
  connect();
  // SEND (3 packets) and SEND_IMM into posted receives; WRITE_IMM consumes one too.
  post_recv(1, kBase + 0x1000, 4096, 501);
  post_recv(1, kBase + 0x3000, 64, 502);
  post_recv(1, kBase + 0x4000, 0, 503);
  fill(0, kBase + 0x1000, 2500, 9);
  fill(0, kBase + 0x3000, 10, 4);
  post(0, wqe(rdma::WrOp::SEND, kBase + 0x1000, 2500, 0, 1));
  rdma::SendWqe si = wqe(rdma::WrOp::SEND_IMM, kBase + 0x3000, 10, 0, 2);
  si.imm = 0xabcdef01;
  post(0, si);
  rdma::SendWqe wi = wqe(rdma::WrOp::WRITE_IMM, kBase + 0x8000, 3000, kBase + 0x8000, 3);
  wi.imm = 77;
  fill(0, kBase + 0x8000, 3000, 1);
  post(0, wi);
  // FETCH_ADD and CMP_SWAP on node 1's word; results land in node 0's memory.
  uint64_t word = 40;
  std::memcpy(n[1].mem.at(kBase + 0x10000), &word, 8);
  rdma::SendWqe fa = wqe(rdma::WrOp::FETCH_ADD, kBase + 0x20000, 8, kBase + 0x10000, 4);
  fa.swap_add = 2;
  post(0, fa);
  rdma::SendWqe cs = wqe(rdma::WrOp::CMP_SWAP, kBase + 0x20008, 8, kBase + 0x10000, 5);
  cs.compare = 42;
  cs.swap_add = 100;
  post(0, cs);
  rdma::SendWqe cs2 = wqe(rdma::WrOp::CMP_SWAP, kBase + 0x20010, 8, kBase + 0x10000, 6);
  cs2.compare = 42;  // no longer matches
  cs2.swap_add = 7;
  post(0, cs2);
  // WRITE_REDUCE int32 SUM over 3 packets, and fp32 MAX.
  std::vector<int32_t> dst(1000), src(1000);
  for (int i = 0; i < 1000; ++i) {
    dst[static_cast<size_t>(i)] = i * 3 - 500;
    src[static_cast<size_t>(i)] = 1000 - i * 7;
  }
  std::memcpy(n[1].mem.at(kBase + 0x30000), dst.data(), 4000);
  std::memcpy(n[0].mem.at(kBase + 0x30000), src.data(), 4000);
  rdma::SendWqe wr = wqe(rdma::WrOp::WRITE_REDUCE, kBase + 0x30000, 4000, kBase + 0x30000, 7);
  wr.dtype = static_cast<uint8_t>(hal::abi::DType::INT32);
  wr.redop = static_cast<uint8_t>(hal::abi::RedOp::SUM);
  post(0, wr);
  const float fd[3] = {1.5f, -2.0f, 8.0f}, fs[3] = {2.5f, -3.0f, 4.0f};
  std::memcpy(n[1].mem.at(kBase + 0x38000), fd, 12);
  std::memcpy(n[0].mem.at(kBase + 0x38000), fs, 12);
  rdma::SendWqe wm = wqe(rdma::WrOp::WRITE_REDUCE, kBase + 0x38000, 12, kBase + 0x38000, 8);
  wm.dtype = static_cast<uint8_t>(hal::abi::DType::FP32);
  wm.redop = static_cast<uint8_t>(hal::abi::RedOp::MAX);
  post(0, wm);
  run();
  expect_all_success(n[0].cq, 8);
  ASSERT_EQ(n[1].cq.size(), 3u);
  EXPECT_EQ(n[1].cq[0].wr_id, 501u);
  EXPECT_EQ(n[1].cq[0].byte_len, 2500u);
  EXPECT_EQ(n[1].cq[0].opcode, static_cast<uint8_t>(rdma::WcOp::RECV));
  EXPECT_EQ(n[1].cq[1].wr_id, 502u);
  EXPECT_EQ(n[1].cq[1].flags, rdma::wc_flag::IMM);
  EXPECT_EQ(n[1].cq[1].imm, 0xabcdef01u);
  EXPECT_EQ(n[1].cq[2].wr_id, 503u);
  EXPECT_EQ(n[1].cq[2].opcode, static_cast<uint8_t>(rdma::WcOp::RECV_WRITE_IMM));
  EXPECT_EQ(n[1].cq[2].imm, 77u);
  EXPECT_EQ(n[1].cq[2].byte_len, 3000u);
  EXPECT_EQ(std::memcmp(n[1].mem.at(kBase + 0x1000), n[0].mem.at(kBase + 0x1000), 2500), 0);
  EXPECT_EQ(std::memcmp(n[1].mem.at(kBase + 0x3000), n[0].mem.at(kBase + 0x3000), 10), 0);
  EXPECT_EQ(std::memcmp(n[1].mem.at(kBase + 0x8000), n[0].mem.at(kBase + 0x8000), 3000), 0);
  uint64_t r[3];
  std::memcpy(r, n[0].mem.at(kBase + 0x20000), 24);
  EXPECT_EQ(r[0], 40u);  // fetch_add's old value
  EXPECT_EQ(r[1], 42u);  // cmp_swap matched
  EXPECT_EQ(r[2], 100u);  // did not match: returns the current value
  std::memcpy(&word, n[1].mem.at(kBase + 0x10000), 8);
  EXPECT_EQ(word, 100u);
  std::vector<int32_t> got(1000);
  std::memcpy(got.data(), n[1].mem.at(kBase + 0x30000), 4000);
  for (size_t i = 0; i < 1000; ++i) ASSERT_EQ(got[i], dst[i] + src[i]) << i;
  float fm[3];
  std::memcpy(fm, n[1].mem.at(kBase + 0x38000), 12);
  EXPECT_EQ(fm[0], 2.5f);
  EXPECT_EQ(fm[1], -2.0f);
  EXPECT_EQ(fm[2], 8.0f);
}

// A lossy, duplicating, reordering, corrupting wire: writes, reads, sends,
// fetch-adds and integer reduces in both directions, every result exact,
// every non-idempotent request applied once, every corruption caught.
TEST_F(RoceRc, ExactResultsOnABadWire) {
  register_all();
  connect(0xffff00, 0xfffff0);  // both directions cross the 24-bit PSN wrap
  wire.f = Faults{10, 5, 10, 1, false};
  SCOPED_TRACE("HCOMM_ROCE_SEED=" + std::to_string(wire_seed()));
  std::mt19937_64 rng(wire_seed() + 7);
  constexpr int kOps = 300;
  std::vector<uint64_t> fa_total(2, 0);
  std::vector<int64_t> red(2 * 256, 0);  // expected int64 reduce targets (256 per node at 0x80000)
  std::vector<std::vector<uint8_t>> expect_region(2);
  size_t posted[2] = {0, 0}, recvs[2] = {0, 0};
  std::vector<std::pair<uint64_t, uint32_t>> copies;  // (slot, length) both nodes must agree on
  for (int i = 0; i < kOps; ++i) {
    const int from = static_cast<int>(rng() % 2), to = 1 - from;
    const uint64_t slot = static_cast<uint64_t>(i) * 0x800;  // 2 KiB per op, disjoint
    const uint32_t len = 1 + static_cast<uint32_t>(rng() % 2048);
    const uint64_t kind = rng() % 5;
    if (kind < 3) copies.push_back({slot, len});
    switch (kind) {
      case 0:
        fill(from, kBase + slot, len, static_cast<uint8_t>(i));
        post(from, wqe(rdma::WrOp::WRITE, kBase + slot, len, kBase + slot, static_cast<uint64_t>(i)));
        break;
      case 1:
        fill(to, kBase + slot, len, static_cast<uint8_t>(i));
        post(from, wqe(rdma::WrOp::READ, kBase + slot, len, kBase + slot, static_cast<uint64_t>(i)));
        break;
      case 2:
        fill(from, kBase + slot, len, static_cast<uint8_t>(i));
        post_recv(to, kBase + slot, 2048, static_cast<uint64_t>(i));
        ++recvs[to];
        post(from, wqe(rdma::WrOp::SEND, kBase + slot, len, 0, static_cast<uint64_t>(i)));
        break;
      case 3: {
        rdma::SendWqe w = wqe(rdma::WrOp::FETCH_ADD, kBase + slot, 8, kBase + 0xf0000, static_cast<uint64_t>(i));
        w.swap_add = 1 + rng() % 1000;
        fa_total[static_cast<size_t>(to)] += w.swap_add;
        post(from, w);
        break;
      }
      default: {  // int64 SUM of 256 elements (2 KiB, 2 packets at MTU 1024)
        std::vector<int64_t> v(256);
        for (size_t k = 0; k < 256; ++k) {
          v[k] = static_cast<int64_t>(rng() % 2001) - 1000;
          red[static_cast<size_t>(to) * 256 + k] += v[k];
        }
        std::memcpy(n[from].mem.at(kBase + slot), v.data(), 2048);
        rdma::SendWqe w = wqe(rdma::WrOp::WRITE_REDUCE, kBase + slot, 2048, kBase + 0xe0000, static_cast<uint64_t>(i));
        w.dtype = static_cast<uint8_t>(hal::abi::DType::INT64);
        w.redop = static_cast<uint8_t>(hal::abi::RedOp::SUM);
        post(from, w);
        break;
      }
    }
    ++posted[from];
    if (i % 16 == 15) run();  // let the windows drain now and then
  }
  run();
  for (int x = 0; x < 2; ++x) {
    SCOPED_TRACE("node " + std::to_string(x));
    size_t sends = 0;
    for (const rdma::Cqe& c : n[x].cq)
      if (c.opcode & 0x80) ++sends;
    EXPECT_EQ(sends, recvs[x]);
    expect_all_success(n[x].cq, posted[x] + recvs[x]);
    uint64_t w;
    std::memcpy(&w, n[x].mem.at(kBase + 0xf0000), 8);
    EXPECT_EQ(w, fa_total[static_cast<size_t>(x)]) << "a fetch-add was lost or applied twice";
    std::vector<int64_t> got(256);
    std::memcpy(got.data(), n[x].mem.at(kBase + 0xe0000), 2048);
    for (size_t k = 0; k < 256; ++k)
      ASSERT_EQ(got[k], red[static_cast<size_t>(x) * 256 + k]) << "a WRITE_REDUCE was lost or applied twice";
  }
  // Every op's bytes: the slot regions of both nodes agree (writes, reads, sends copy one to the other).
  ASSERT_GT(copies.size(), 100u);
  for (auto [slot, len] : copies)
    ASSERT_EQ(std::memcmp(n[0].mem.at(kBase + slot), n[1].mem.at(kBase + slot), len), 0) << "slot " << slot;
  const Counters& c0 = n[0].eng->counters();
  const Counters& c1 = n[1].eng->counters();
  EXPECT_EQ(c0.rx_bad_icrc + c1.rx_bad_icrc, wire.corrupted);
  EXPECT_GT(wire.corrupted, 0u);
  EXPECT_GT(c0.retransmits + c1.retransmits, 0u);
  EXPECT_GT(c0.duplicates + c1.duplicates, 0u);
  EXPECT_EQ(c0.rx_malformed + c1.rx_malformed, 0u);
  std::printf("bad wire: %llu corrupted, %llu retransmitted, %llu duplicates, %llu timeouts, %llu PSN-sequence NAKs\n",
              static_cast<unsigned long long>(wire.corrupted),
              static_cast<unsigned long long>(c0.retransmits + c1.retransmits),
              static_cast<unsigned long long>(c0.duplicates + c1.duplicates),
              static_cast<unsigned long long>(c0.timeouts + c1.timeouts),
              static_cast<unsigned long long>(c0.seq_naks_sent + c1.seq_naks_sent));
}

// Messages longer than the requester's window (200 packets of 1 KiB > 128
// unacknowledged PSNs): the coalesced ACKs inside a message move the window,
// and a READ longer than the window still goes. Clean, then on a bad wire.
TEST_F(RoceRc, MessagesLongerThanTheWindow) {
  register_all();
  connect();
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round == 0 ? "clean wire" : "bad wire");
    if (round == 1) wire.f = Faults{10, 5, 10, 1, false};
    n[0].cq.clear();
    n[1].cq.clear();
    constexpr uint32_t kBig = 200 * 1024;  // regions at 0, 256 K, 512 K, 768 K
    fill(0, kBase, kBig, static_cast<uint8_t>(11 + round));
    fill(1, kBase + 0x40000, kBig, static_cast<uint8_t>(22 + round));
    std::vector<int32_t> acc(kBig / 4, 3), add(kBig / 4);
    for (size_t i = 0; i < add.size(); ++i) add[i] = static_cast<int32_t>(i % 1000) - 500;
    std::memcpy(n[1].mem.at(kBase + 0x80000), acc.data(), kBig);
    std::memcpy(n[0].mem.at(kBase + 0x80000), add.data(), kBig);
    post(0, wqe(rdma::WrOp::WRITE, kBase, kBig, kBase, 1));
    post(0, wqe(rdma::WrOp::READ, kBase + 0x40000, kBig, kBase + 0x40000, 2));
    rdma::SendWqe r = wqe(rdma::WrOp::WRITE_REDUCE, kBase + 0x80000, kBig, kBase + 0x80000, 3);
    r.dtype = static_cast<uint8_t>(hal::abi::DType::INT32);
    post(0, r);
    post_recv(1, kBase + 0xc0000, kBig, 9);
    post(0, wqe(rdma::WrOp::SEND, kBase, kBig, 0, 4));
    run();
    expect_all_success(n[0].cq, 4);
    ASSERT_EQ(n[1].cq.size(), 1u);
    EXPECT_EQ(n[1].cq[0].byte_len, kBig);
    EXPECT_EQ(std::memcmp(n[1].mem.at(kBase), n[0].mem.at(kBase), kBig), 0);
    EXPECT_EQ(std::memcmp(n[0].mem.at(kBase + 0x40000), n[1].mem.at(kBase + 0x40000), kBig), 0);
    EXPECT_EQ(std::memcmp(n[1].mem.at(kBase + 0xc0000), n[0].mem.at(kBase), kBig), 0);
    std::vector<int32_t> got(kBig / 4);
    std::memcpy(got.data(), n[1].mem.at(kBase + 0x80000), kBig);
    for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], 3 + add[i]) << i;
  }
  EXPECT_GT(wire.corrupted, 0u);
  EXPECT_EQ(n[0].eng->counters().rx_bad_icrc + n[1].eng->counters().rx_bad_icrc, wire.corrupted);
}

// The packet lost, and then its resend lost too: the first packet after
// the resend (the requester went back) draws a second PSN-sequence NAK, so
// recovery takes two round trips and never the local ACK timeout.
TEST_F(RoceRc, ALostResendDrawsASecondNakNotATimeout) {
  register_all();
  connect(100, 5000, 3, 7, 7, /*timeout=*/20);  // ~4 s: a timeout would show in the counter
  constexpr uint32_t kLen = 8 * 1024;            // 8 packets of 1 KiB, PSNs 100..107
  int seen = 0;
  wire.drop_if = [&seen](int to, const uint8_t* p, size_t len) {
    if (to != 1 || len < wire::kL2L4Len + 12) return false;
    const uint8_t* bth = p + wire::kL2L4Len;
    const uint32_t psn = uint32_t{bth[9]} << 16 | uint32_t{bth[10]} << 8 | bth[11];
    return psn == 102 && ++seen <= 2;  // the first send and the first resend
  };
  fill(0, kBase, kLen, 7);
  post(0, wqe(rdma::WrOp::WRITE, kBase, kLen, kBase + 0x10000, 1));
  run();
  expect_all_success(n[0].cq, 1);
  EXPECT_EQ(std::memcmp(n[1].mem.at(kBase + 0x10000), n[0].mem.at(kBase), kLen), 0);
  EXPECT_EQ(seen, 3);
  EXPECT_EQ(n[1].eng->counters().seq_naks_sent, 2u);
  EXPECT_EQ(n[0].eng->counters().seq_naks_rcvd, 2u);
  EXPECT_EQ(n[0].eng->counters().timeouts, 0u);
  EXPECT_GE(n[0].eng->counters().retransmits, 2u);
}

// A packet the wire loses every time: each round draws a NAK, but NAKs
// that repeat the PSN and acknowledge nothing new do not restart the local
// ACK timer, so it runs out retry_cnt + 1 times and the request ends in
// RETRY_EXC_ERR instead of being resent forever.
TEST_F(RoceRc, APacketLostEveryTimeEndsInRetryExceeded) {
  register_all();
  connect(100, 5000, 3, /*retry=*/3, 7, /*timeout=*/8);  // ~1 ms
  wire.drop_if = [](int to, const uint8_t* p, size_t len) {
    if (to != 1 || len < wire::kL2L4Len + 12) return false;
    const uint8_t* bth = p + wire::kL2L4Len;
    return (uint32_t{bth[9]} << 16 | uint32_t{bth[10]} << 8 | bth[11]) == 102;
  };
  fill(0, kBase, 8 * 1024, 7);
  post(0, wqe(rdma::WrOp::WRITE, kBase, 8 * 1024, kBase + 0x10000, 1));
  run(200'000);
  ASSERT_EQ(n[0].cq.size(), 1u);
  EXPECT_EQ(n[0].cq[0].status, static_cast<uint8_t>(WcStatus::RETRY_EXC_ERR))
      << rdma::wc_status_name(static_cast<WcStatus>(n[0].cq[0].status));
  EXPECT_EQ(n[0].eng->qp_state(n[0].qpn), rdma::QpState::ERR);
  EXPECT_EQ(n[0].eng->counters().timeouts, 4u);  // retry_cnt + 1
  EXPECT_GT(n[0].eng->counters().seq_naks_rcvd, 1u);
}

// A READ longer than one piece and a request after it, on a clean wire:
// the request waits until the READ's last piece has been asked for, so the
// responder never sees a PSN ahead (no NAK, nothing resent).
TEST_F(RoceRc, NothingOvertakesTheLastPieceOfARead) {
  register_all();
  connect();
  constexpr uint32_t kRead = (Engine::kReadPiece + 10) * 1024;  // one piece and 10 packets at MTU 1024
  fill(1, kBase + 0x40000, kRead, 5);
  fill(0, kBase, 4096, 6);
  post_recv(1, kBase + 0xc0000, 4096, 9);
  post(0, wqe(rdma::WrOp::READ, kBase + 0x40000, kRead, kBase + 0x40000, 1));
  post(0, wqe(rdma::WrOp::SEND, kBase, 4096, 0, 2));
  post(0, wqe(rdma::WrOp::WRITE, kBase, 4096, kBase + 0x20000, 3));
  run();
  expect_all_success(n[0].cq, 3);
  EXPECT_EQ(std::memcmp(n[0].mem.at(kBase + 0x40000), n[1].mem.at(kBase + 0x40000), kRead), 0);
  EXPECT_EQ(std::memcmp(n[1].mem.at(kBase + 0xc0000), n[0].mem.at(kBase), 4096), 0);
  EXPECT_EQ(n[1].eng->counters().seq_naks_sent, 0u);
  EXPECT_EQ(n[0].eng->counters().retransmits, 0u);
  EXPECT_EQ(n[1].eng->counters().duplicates, 0u);
}

// Duplicated on every hop: nothing non-idempotent runs twice.
TEST_F(RoceRc, DuplicatesAreNeverAppliedTwice) {
  register_all();
  connect();
  wire.f = Faults{0, 100, 0, 0, false};
  for (int i = 0; i < 50; ++i) {
    rdma::SendWqe w = wqe(rdma::WrOp::FETCH_ADD, kBase + 8 * static_cast<uint64_t>(i), 8, kBase + 0x9000, 100 + static_cast<uint64_t>(i));
    w.swap_add = 3;
    post(0, w);
    const int64_t one = 1;
    std::memcpy(n[0].mem.at(kBase + 0x5000), &one, 8);
    rdma::SendWqe r = wqe(rdma::WrOp::WRITE_REDUCE, kBase + 0x5000, 8, kBase + 0xa000, 200 + static_cast<uint64_t>(i));
    r.dtype = static_cast<uint8_t>(hal::abi::DType::INT64);
    post(0, r);
  }
  run();
  expect_all_success(n[0].cq, 100);
  uint64_t fa;
  int64_t red;
  std::memcpy(&fa, n[1].mem.at(kBase + 0x9000), 8);
  std::memcpy(&red, n[1].mem.at(kBase + 0xa000), 8);
  EXPECT_EQ(fa, 150u);
  EXPECT_EQ(red, 50);
  std::vector<uint64_t> olds(50);  // each fetch-add saw a distinct old value
  std::memcpy(olds.data(), n[0].mem.at(kBase), 400);
  for (size_t i = 0; i < 50; ++i) EXPECT_EQ(olds[i], 3 * i);
  EXPECT_GT(n[1].eng->counters().duplicates, 0u);
}

TEST_F(RoceRc, BadKeysRangesAndRightsAreRefusedAndTouchNothing) {
  register_all(rdma::access::LOCAL_WRITE | rdma::access::REMOTE_READ);  // no remote write, atomic or reduce
  connect();
  std::memset(n[1].mem.at(kBase), 0x5a, 0x1000);
  fill(0, kBase, 64, 1);
  post(0, wqe(rdma::WrOp::WRITE, kBase, 64, kBase, 1));  // no REMOTE_WRITE right
  post(0, wqe(rdma::WrOp::WRITE, kBase, 64, kBase, 2));  // flushed behind it
  run();
  ASSERT_EQ(n[0].cq.size(), 2u);
  EXPECT_EQ(n[0].cq[0].status, static_cast<uint8_t>(WcStatus::REM_ACCESS_ERR));
  EXPECT_EQ(n[0].cq[0].vendor_err, wire::aeth::NAK_REMOTE_ACCESS);
  EXPECT_EQ(n[0].cq[1].status, static_cast<uint8_t>(WcStatus::WR_FLUSH_ERR));
  EXPECT_EQ(n[0].eng->qp_state(n[0].qpn), rdma::QpState::ERR);
  EXPECT_EQ(n[1].eng->qp_state(n[1].qpn), rdma::QpState::ERR);
  for (int i = 0; i < 0x1000; ++i) ASSERT_EQ(n[1].mem.at(kBase)[i], 0x5a) << i;

  // Fresh engines and QPs for each further case.
  struct Case {
    const char* what;
    rdma::WrOp op;
    uint64_t raddr;
    uint32_t rkey;
    uint32_t len;
  };
  const Case cases[] = {
      {"wrong key byte (a stale key)", rdma::WrOp::READ, kBase, rdma::make_key(1, 0x12), 64},
      {"unknown index", rdma::WrOp::READ, kBase, rdma::make_key(9, 0x11), 64},
      {"index outside the table", rdma::WrOp::READ, kBase, rdma::make_key(1000, 0x11), 64},
      {"past the end", rdma::WrOp::READ, kBase + kMem - 32, kKey, 64},
      {"before the start", rdma::WrOp::READ, kBase - 8, kKey, 64},
      {"atomic without the right", rdma::WrOp::FETCH_ADD, kBase, kKey, 8},
      {"reduce without the right", rdma::WrOp::WRITE_REDUCE, kBase, kKey, 8},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    for (Node& x : n) {
      x.cq.clear();
      x.mrs = std::make_unique<MrTable>(64);
    }
    make_engines();
    register_all(rdma::access::LOCAL_WRITE | rdma::access::REMOTE_READ);
    connect();
    std::memset(n[0].mem.at(kBase), 0x33, 64);
    rdma::SendWqe w = wqe(c.op, kBase, c.len, c.raddr, 9);
    w.rkey = c.rkey;
    post(0, w);
    run();
    ASSERT_EQ(n[0].cq.size(), 1u);
    EXPECT_EQ(n[0].cq[0].status, static_cast<uint8_t>(WcStatus::REM_ACCESS_ERR));
    for (int i = 0; i < 64; ++i) ASSERT_EQ(n[0].mem.at(kBase)[i], 0x33) << "the initiator's buffer was written";
    for (int i = 0; i < 0x1000; ++i) ASSERT_EQ(n[1].mem.at(kBase)[i], 0x5a) << "the target was touched";
  }
}

TEST_F(RoceRc, AStaleKeyNeverMatchesALaterRegistration) {
  register_all();
  connect();
  ASSERT_TRUE(n[1].mrs->invalidate(kKey).is_ok());
  rdma::MrEntry e{};
  e.iova = kBase;
  e.length = kMem;
  e.key = rdma::make_key(1, 0x12);  // the same index, a new key byte
  e.access = rdma::access::ALL;
  ASSERT_TRUE(n[1].mrs->set(e).is_ok());
  EXPECT_FALSE(n[1].mrs->invalidate(kKey).is_ok());
  post(0, wqe(rdma::WrOp::WRITE, kBase, 16, kBase, 1));
  run();
  ASSERT_EQ(n[0].cq.size(), 1u);
  EXPECT_EQ(n[0].cq[0].status, static_cast<uint8_t>(WcStatus::REM_ACCESS_ERR));
  // Table commands refuse what they cannot hold.
  rdma::MrEntry bad = e;
  bad.key = rdma::make_key(64, 1);
  EXPECT_FALSE(n[1].mrs->set(bad).is_ok());  // index outside the table
  bad = e;
  EXPECT_FALSE(n[1].mrs->set(bad).is_ok());  // index in use
  bad.key = rdma::make_key(2, 1);
  bad.length = 0;
  EXPECT_FALSE(n[1].mrs->set(bad).is_ok());
  bad.length = 16;
  bad.access = 0x80;
  EXPECT_FALSE(n[1].mrs->set(bad).is_ok());
  bad.access = rdma::access::ALL;
  bad.iova = ~0ull - 4;
  EXPECT_FALSE(n[1].mrs->set(bad).is_ok());  // wraps
}

// A peer that answers nothing: RETRY_EXC_ERR after retry_cnt + 1 timeouts,
// within the bound the attributes give; the rest of the queue is flushed.
TEST_F(RoceRc, ASilentPeerEndsInRetryExceededWithinTheBound) {
  register_all();
  connect(100, 5000, 3, /*retry=*/3, 7, /*timeout=*/10);  // 4.096 us * 1024 = 4.19 ms
  wire.f.blackhole = true;
  const uint64_t t0 = now;
  post(0, wqe(rdma::WrOp::WRITE, kBase, 100, kBase, 1));
  post(0, wqe(rdma::WrOp::READ, kBase, 100, kBase, 2));
  run();
  ASSERT_EQ(n[0].cq.size(), 2u);
  EXPECT_EQ(n[0].cq[0].status, static_cast<uint8_t>(WcStatus::RETRY_EXC_ERR));
  EXPECT_EQ(n[0].cq[1].status, static_cast<uint8_t>(WcStatus::WR_FLUSH_ERR));
  EXPECT_EQ(n[0].eng->counters().timeouts, 4u);
  const uint64_t to = 4096ull << 10, elapsed = now - t0;
  EXPECT_GE(elapsed, 4 * to);
  EXPECT_LE(elapsed, 4 * to + 200'000);  // + the test loop's 50 us idle steps
}

TEST_F(RoceRc, ReceiverNotReadyMakesTheSenderWait) {
  register_all();
  connect();
  fill(0, kBase, 3000, 5);
  post(0, wqe(rdma::WrOp::SEND, kBase, 3000, 0, 1));
  for (int i = 0; i < 200; ++i) {  // no receive posted yet: RNR NAKs, retries
    for (Node& x : n) (void)x.eng->poll(now);
    for (int k = 0; k < 2; ++k)
      while (!wire.q[k].empty()) {
        auto fr = std::move(wire.q[k].front());
        wire.q[k].pop_front();
        n[k].eng->rx(fr.data(), fr.size(), now);
      }
    now += 5000;
  }
  EXPECT_TRUE(n[0].cq.empty());
  EXPECT_GT(n[1].eng->counters().rnr_naks_sent, 0u);
  post_recv(1, kBase + 0x10000, 4096, 77);
  run();
  expect_all_success(n[0].cq, 1);
  ASSERT_EQ(n[1].cq.size(), 1u);
  EXPECT_EQ(n[1].cq[0].byte_len, 3000u);
  EXPECT_EQ(std::memcmp(n[1].mem.at(kBase + 0x10000), n[0].mem.at(kBase), 3000), 0);
}

TEST_F(RoceRc, RnrRetriesRunOutAndASendLongerThanTheReceiveFails) {
  register_all();
  connect(100, 5000, 3, 7, /*rnr_retry=*/2);
  post(0, wqe(rdma::WrOp::SEND, kBase, 10, 0, 1));
  run();
  ASSERT_EQ(n[0].cq.size(), 1u);
  EXPECT_EQ(n[0].cq[0].status, static_cast<uint8_t>(WcStatus::RNR_RETRY_EXC_ERR));
  EXPECT_EQ(n[1].eng->counters().rnr_naks_sent, 3u);

  for (Node& x : n) {
    x.cq.clear();
    x.mrs = std::make_unique<MrTable>(64);
  }
  make_engines();
  register_all();
  connect();
  post_recv(1, kBase + 0x10000, 100, 5);
  post(0, wqe(rdma::WrOp::SEND, kBase, 2000, 0, 1));
  run();
  ASSERT_EQ(n[0].cq.size(), 1u);
  EXPECT_EQ(n[0].cq[0].status, static_cast<uint8_t>(WcStatus::REM_INV_REQ_ERR));
  ASSERT_GE(n[1].cq.size(), 1u);
  EXPECT_EQ(n[1].cq[0].status, static_cast<uint8_t>(WcStatus::LOC_LEN_ERR));
}

TEST_F(RoceRc, MalformedWorkRequestsFailInOrder) {
  register_all();
  connect();
  fill(0, kBase, 64, 2);
  post(0, wqe(rdma::WrOp::WRITE, kBase, 64, kBase, 1));  // fine: completes first
  rdma::SendWqe bad = wqe(rdma::WrOp::FETCH_ADD, kBase, 8, kBase + 4, 2);  // misaligned atomic
  post(0, bad);
  post(0, wqe(rdma::WrOp::WRITE, kBase, 64, kBase + 64, 3));  // flushed
  run();
  ASSERT_EQ(n[0].cq.size(), 3u);
  EXPECT_EQ(n[0].cq[0].status, static_cast<uint8_t>(WcStatus::SUCCESS));
  EXPECT_EQ(n[0].cq[1].status, static_cast<uint8_t>(WcStatus::BAD_WQE));
  EXPECT_EQ(n[0].cq[2].status, static_cast<uint8_t>(WcStatus::WR_FLUSH_ERR));
  EXPECT_EQ(std::memcmp(n[1].mem.at(kBase), n[0].mem.at(kBase), 64), 0);

  for (Node& x : n) {
    x.cq.clear();
    x.mrs = std::make_unique<MrTable>(64);
  }
  make_engines();
  register_all();
  connect();
  rdma::SendWqe w = wqe(rdma::WrOp::READ, kBase, 64, kBase, 1);
  w.lkey = rdma::make_key(1, 0x99);  // a local key that is not ours
  post(0, w);
  rdma::SendWqe u = wqe(rdma::WrOp::WRITE, kBase, 64, kBase, 2);
  u.opcode = 42;
  EXPECT_TRUE(n[0].eng->post_send(n[0].qpn, u).is_ok());  // the QP is in ERR by then: flushed
  run();
  ASSERT_EQ(n[0].cq.size(), 2u);
  EXPECT_EQ(n[0].cq[0].status, static_cast<uint8_t>(WcStatus::LOC_PROT_ERR));
  EXPECT_EQ(n[0].cq[1].status, static_cast<uint8_t>(WcStatus::WR_FLUSH_ERR));
}

TEST_F(RoceRc, QueuePairStatesFollowTheOrder) {
  const uint32_t q = n[0].eng->create_qp();
  rdma::QpAttr a{};
  a.state = static_cast<uint8_t>(rdma::QpState::RTS);
  EXPECT_FALSE(n[0].eng->modify_qp(q, a).is_ok());  // RESET -> RTS
  a.state = static_cast<uint8_t>(rdma::QpState::INIT);
  EXPECT_TRUE(n[0].eng->modify_qp(q, a).is_ok());
  a.state = static_cast<uint8_t>(rdma::QpState::RTR);
  a.path_mtu = 6;  // no such MTU
  EXPECT_FALSE(n[0].eng->modify_qp(q, a).is_ok());
  a.path_mtu = 5;
  a.dest_qpn = 1u << 24;  // more than 24 bits
  EXPECT_FALSE(n[0].eng->modify_qp(q, a).is_ok());
  a.dest_qpn = 3;
  EXPECT_TRUE(n[0].eng->modify_qp(q, a).is_ok());
  EXPECT_FALSE(n[0].eng->post_send(q, rdma::SendWqe{}).is_ok());  // RTR: not ready to send
  a.state = static_cast<uint8_t>(rdma::QpState::RTS);
  a.max_rd_atomic = 0;
  EXPECT_FALSE(n[0].eng->modify_qp(q, a).is_ok());
  a.max_rd_atomic = 1;
  EXPECT_TRUE(n[0].eng->modify_qp(q, a).is_ok());
  EXPECT_EQ(n[0].eng->qp_state(q), rdma::QpState::RTS);
  EXPECT_FALSE(n[0].eng->modify_qp(999, a).is_ok());
  EXPECT_FALSE(n[0].eng->destroy_qp(999).is_ok());
  EXPECT_TRUE(n[0].eng->destroy_qp(q).is_ok());
}

TEST_F(RoceRc, AnswersArpForItsAddress) {
  uint8_t req[42] = {};
  std::memset(req, 0xff, 6);
  const uint8_t asker[6] = {0x52, 0x54, 0, 0x12, 0x34, 0x56};
  std::memcpy(req + 6, asker, 6);
  wire::put16(req + 12, wire::kEtherArp);
  uint8_t* a = req + 14;
  wire::put16(a, 1);
  wire::put16(a + 2, wire::kEtherIPv4);
  a[4] = 6;
  a[5] = 4;
  wire::put16(a + 6, 1);
  std::memcpy(a + 8, asker, 6);
  wire::put32(a + 14, 0x0a0000fe);
  wire::put32(a + 24, 0x0a000002);  // node 1's address
  n[1].eng->rx(req, sizeof req, now);
  ASSERT_EQ(wire.q[0].size(), 1u);
  const std::vector<uint8_t>& r = wire.q[0].front();
  EXPECT_EQ(std::memcmp(r.data(), asker, 6), 0);
  EXPECT_EQ(wire::get16(&r[14 + 6]), 2);  // reply
  EXPECT_EQ(std::memcmp(&r[14 + 8], n[1].eng->addr().mac, 6), 0);
  EXPECT_EQ(wire::get32(&r[14 + 14]), 0x0a000002u);
  wire.q[0].clear();
  wire::put32(a + 24, 0x0a000009);  // someone else's
  n[1].eng->rx(req, sizeof req, now);
  EXPECT_TRUE(wire.q[0].empty());
}

}  // namespace
}  // namespace hcomm::sim::roce
