// Integration: the NPU's RoCEv2 network engine through the HAL (hal/npu/
// rdma_qp.h) over vfio-user, against a separate hcomm-sim: the port's
// registers and commands (docs/device-abi.md §15), RC queue pairs between
// the two NPUs of one simulator through its switch and on one port in
// loopback, every work request kind into HBM and into registered host
// memory, a wrong key, and the switch's fault injection (drop, duplicate,
// reorder, corrupt; a silent link ending in retry exceeded).
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/if_tun.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <thread>

#include "common/time.h"
#include "hcomm_config.h"
#include "driver/dma_memory.h"
#include "driver/vfio_user_link.h"
#include "hal/npu/device.h"
#include "hal/npu/rdma_qp.h"
#include "tests/support/sim_process.h"

namespace hcomm {
namespace {

namespace abi = hal::abi;
namespace npu = hal::npu;
namespace rdma = abi::rdma;
using rdma::WcStatus;

constexpr uint64_t kLen = 1 << 20;  // per node: 1 MiB of HBM and 1 MiB of host memory, one key each

struct Node {
  std::unique_ptr<npu::Device> dev;
  npu::NetInfo net;
  driver::DmaBuffer host;
  npu::Mapping host_map, hbm_map;
  uint32_t host_key = 0, hbm_key = 0;
  uint8_t* hbm = nullptr;  // BAR2: the device memory, as the CPU sees it
};

// Device `sock` brought up; a previous test's client may still be leaving: retries briefly.
std::unique_ptr<npu::Device> open_dev(const std::string& sock) {
  Deadline dl = Deadline::after_ms(5000);
  for (;;) {
    std::unique_ptr<driver::Link> link;
    std::unique_ptr<npu::Device> dev;
    Status st = driver::open_vfio_user(sock, &link, 2000);
    if (st) st = npu::Device::open(std::move(link), &dev);
    if (st) return dev;
    if (dl.expired()) {
      ADD_FAILURE() << sock << ": " << st.to_string();
      return nullptr;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

class NpuRoce : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    sim_ = new test::SimProcess();
    std::string err = sim_->start();
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

  void SetUp() override {
    ASSERT_NE(sim_, nullptr);
    ASSERT_TRUE(sim_->alive()) << "hcomm-sim died in an earlier test";
    ASSERT_EQ(sim_->control("net clear"), "ok");
    for (unsigned i = 0; i < 2; ++i) {
      Node& n = node_[i];
      n.dev = open_dev(sim_->socket(i));
      ASSERT_NE(n.dev, nullptr);
      ASSERT_TRUE(n.dev->info().caps & abi::cap::ROCE);
      ASSERT_TRUE(n.dev->net_info(&n.net));
      ASSERT_TRUE(driver::DmaBuffer::allocate(kLen, -1, &n.host));
      ASSERT_TRUE(n.dev->map_buffer(n.host, npu::access::RW, &n.host_map));
      ASSERT_TRUE(n.dev->map_hbm(0, kLen, npu::access::RW, &n.hbm_map));
      ASSERT_TRUE(n.dev->mr_register(n.host_map.iova, kLen, rdma::access::ALL, &n.host_key));
      ASSERT_TRUE(n.dev->mr_register(n.hbm_map.iova, kLen, rdma::access::ALL, &n.hbm_key));
      n.hbm = n.dev->hbm();
      ASSERT_NE(n.hbm, nullptr);
      std::memset(n.hbm, 0, kLen);
    }
  }
  void TearDown() override {
    qps_.clear();
    for (Node& n : node_) {
      if (!n.dev) continue;
      if (n.host_map.valid()) (void)n.dev->unmap(&n.host_map);
      if (n.hbm_map.valid()) (void)n.dev->unmap(&n.hbm_map);
      n.host = driver::DmaBuffer();
      n.dev.reset();
    }
  }

  uint8_t* host(int i) { return static_cast<uint8_t*>(node_[i].host.data()); }

  // A connected pair: a QP on device a and one on device b (a == b: two QPs on one port).
  std::pair<npu::RdmaQp*, npu::RdmaQp*> pair(int a, int b, uint8_t timeout = 12, uint8_t retry = 7) {
    npu::QpOptions oa, ob;
    oa.sq_psn = 0xfffff0;  // across the 24-bit wrap
    ob.sq_psn = 77;
    oa.timeout = ob.timeout = timeout;
    oa.retry_cnt = ob.retry_cnt = retry;
    std::unique_ptr<npu::RdmaQp> qa, qb;
    Status st = node_[a].dev->create_qp(oa, &qa);
    EXPECT_TRUE(st) << st.to_string();
    st = node_[b].dev->create_qp(ob, &qb);
    EXPECT_TRUE(st) << st.to_string();
    if (!qa || !qb) return {nullptr, nullptr};
    npu::QpPeer pa{qb->qpn(), node_[b].net.ip, {}, ob.sq_psn}, pb{qa->qpn(), node_[a].net.ip, {}, oa.sq_psn};
    std::memcpy(pa.mac, node_[b].net.mac, 6);
    std::memcpy(pb.mac, node_[a].net.mac, 6);
    st = qa->connect(pa);
    EXPECT_TRUE(st) << st.to_string();
    st = qb->connect(pb);
    EXPECT_TRUE(st) << st.to_string();
    qps_.push_back(std::move(qa));
    qps_.push_back(std::move(qb));
    return {qps_[qps_.size() - 2].get(), qps_.back().get()};
  }

  static rdma::SendWqe wqe(rdma::WrOp op, uint64_t laddr, uint32_t lkey, uint32_t len, uint64_t raddr, uint32_t rkey,
                           uint64_t id) {
    return rdma::make_wqe(op, laddr, lkey, len, raddr, rkey, id);
  }

  static std::vector<rdma::Cqe> wait(npu::RdmaQp* q, uint32_t n, int ms = 10000) {
    std::vector<rdma::Cqe> c(n);
    Status st = q->wait(n, c, Deadline::after_ms(ms));
    EXPECT_TRUE(st) << st.to_string();
    return c;
  }

  static void fill(uint8_t* p, size_t n, uint8_t seed) {
    for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(seed + i * 13 + (i >> 9));
  }

  static test::SimProcess* sim_;
  Node node_[2];
  std::vector<std::unique_ptr<npu::RdmaQp>> qps_;
};

test::SimProcess* NpuRoce::sim_ = nullptr;

TEST_F(NpuRoce, PortRegistersAndCommands) {
  for (unsigned i = 0; i < 2; ++i) {
    const npu::NetInfo& n = node_[i].net;
    const uint8_t mac[6] = {0x02, 0x4e, 0x50, 0x55, 0x00, static_cast<uint8_t>(i)};
    EXPECT_EQ(std::memcmp(n.mac, mac, 6), 0);
    EXPECT_EQ(n.ip, 0x0a000001u + i);  // 10.0.<node 0>.<i + 1>
    EXPECT_TRUE(n.link_up);
    EXPECT_EQ(n.max_mtu, 4096u);
    EXPECT_EQ(n.num_qp, 16u);
    EXPECT_EQ(n.num_mr, 256u);
    EXPECT_GE(node_[i].dev->info().abi_version, abi::abi_version(1, 3));
  }
  npu::Device& d = *node_[0].dev;
  // The address is the driver's to set; a device reset restores the default.
  ASSERT_TRUE(d.net_set_ip(0x0a0a0a0a));
  npu::NetInfo n;
  ASSERT_TRUE(d.net_info(&n));
  EXPECT_EQ(n.ip, 0x0a0a0a0au);
  ASSERT_TRUE(d.net_set_ip(node_[0].net.ip));
  // Commands refuse what they cannot do, naming why.
  uint32_t r = 0;
  Status st = d.net_command(99, nullptr, 0, &r);
  EXPECT_FALSE(st);
  EXPECT_NE(st.message().find("unknown command"), std::string::npos) << st.to_string();
  rdma::QpCreate c{};
  c.sq_iova = 0x10;  // misaligned
  c.sq_log2 = c.rq_log2 = c.cq_log2 = 4;
  st = d.net_command(abi::net_cmd::QP_CREATE, &c, sizeof c, &r);
  EXPECT_NE(st.message().find("out of range"), std::string::npos) << st.to_string();
  c.sq_iova = c.rq_iova = c.cq_iova = c.shadow_iova = 0x7000000000;  // not in the ATT
  st = d.net_command(abi::net_cmd::QP_CREATE, &c, sizeof c, &r);
  EXPECT_NE(st.message().find("not mapped"), std::string::npos) << st.to_string();
  uint32_t qpn = 0x1ff;
  st = d.net_command(abi::net_cmd::QP_DESTROY, &qpn, 4, nullptr);
  EXPECT_EQ(st.code(), Code::not_found) << st.to_string();
  rdma::MrEntry e{};
  e.iova = node_[0].hbm_map.iova;
  e.length = 4096;
  e.key = rdma::make_key(200, 1);
  e.access = 0x80;  // unknown right
  EXPECT_FALSE(d.net_command(abi::net_cmd::MR_SET, &e, sizeof e, nullptr));
  e.access = rdma::access::ALL;
  e.key = node_[0].hbm_key;  // index in use
  st = d.net_command(abi::net_cmd::MR_SET, &e, sizeof e, nullptr);
  EXPECT_NE(st.message().find("in use"), std::string::npos) << st.to_string();
  // A QP walks the state machine in order only.
  npu::QpOptions o;
  std::unique_ptr<npu::RdmaQp> q;
  ASSERT_TRUE(d.create_qp(o, &q));
  EXPECT_GE(q->qpn(), rdma::kQpnBase);
  rdma::QpAttr a{};
  a.state = static_cast<uint8_t>(rdma::QpState::RTS);
  st = q->modify(a);
  EXPECT_NE(st.message().find("not allowed"), std::string::npos) << st.to_string();
  rdma::QpState s;
  ASSERT_TRUE(q->state(&s));
  EXPECT_EQ(s, rdma::QpState::RESET);
}

// Every work request kind between the two NPUs through the switch, into HBM
// and into registered host memory, both directions across the PSN wrap.
TEST_F(NpuRoce, EveryOperationBetweenTwoNpus) {
  auto [a, b] = pair(0, 1);
  ASSERT_NE(a, nullptr);
  Node &na = node_[0], &nb = node_[1];
  // B receives two SENDs (one packet, three packets) and a WRITE_WITH_IMM.
  rdma::RecvWqe r{};
  for (uint32_t k = 0; k < 3; ++k) {
    r.wr_id = 100 + k;
    r.laddr = nb.hbm_map.iova + 0x80000 + k * 0x4000;
    r.lkey = nb.hbm_key;
    r.length = 0x4000;
    ASSERT_EQ(b->post_recv(r), Code::ok);
  }
  fill(host(0), 100000, 1);  // WRITE from A's host memory into B's HBM
  fill(nb.hbm + 0x20000, 70000, 2);  // A READs B's HBM into its host memory
  uint64_t word = 40;
  std::memcpy(host(1) + 0x40000, &word, 8);  // atomics on B's host memory
  std::vector<float> acc(3000), add(3000);
  for (size_t i = 0; i < acc.size(); ++i) {
    acc[i] = static_cast<float>(i) * 0.5f;
    add[i] = 1.0f + static_cast<float>(i % 7);
  }
  std::memcpy(host(1) + 0x50000, acc.data(), 12000);
  std::memcpy(na.hbm + 0x50000, add.data(), 12000);
  fill(na.hbm + 0x60000, 9000, 3);  // SENDs from A's HBM
  fill(host(0) + 0x70000, 5000, 4);  // WRITE_WITH_IMM from A's host memory
  std::vector<rdma::SendWqe> ws = {
      wqe(rdma::WrOp::WRITE, na.host_map.iova, na.host_key, 100000, nb.hbm_map.iova, nb.hbm_key, 1),
      wqe(rdma::WrOp::READ, na.host_map.iova + 0x20000, na.host_key, 70000, nb.hbm_map.iova + 0x20000, nb.hbm_key, 2),
      wqe(rdma::WrOp::FETCH_ADD, na.hbm_map.iova + 0x40000, na.hbm_key, 8, nb.host_map.iova + 0x40000, nb.host_key, 3),
      wqe(rdma::WrOp::CMP_SWAP, na.hbm_map.iova + 0x40008, na.hbm_key, 8, nb.host_map.iova + 0x40000, nb.host_key, 4),
      wqe(rdma::WrOp::WRITE_REDUCE, na.hbm_map.iova + 0x50000, na.hbm_key, 12000, nb.host_map.iova + 0x50000,
          nb.host_key, 5),
      wqe(rdma::WrOp::SEND, na.hbm_map.iova + 0x60000, na.hbm_key, 100, 0, 0, 6),
      wqe(rdma::WrOp::SEND, na.hbm_map.iova + 0x61000, na.hbm_key, 9000, 0, 0, 7),
      wqe(rdma::WrOp::WRITE_IMM, na.host_map.iova + 0x70000, na.host_key, 5000, nb.host_map.iova + 0x70000,
          nb.host_key, 8),
  };
  ws[2].swap_add = 2;
  ws[3].compare = 42;
  ws[3].swap_add = 1000;
  ws[4].dtype = static_cast<uint8_t>(abi::DType::FP32);
  ws[4].redop = static_cast<uint8_t>(abi::RedOp::SUM);
  ws[7].imm = 0xfeedbeef;
  for (const auto& w : ws) ASSERT_EQ(a->post_send(w), Code::ok);
  std::vector<rdma::Cqe> ca = wait(a, 8);
  for (size_t i = 0; i < ca.size(); ++i) {
    EXPECT_EQ(ca[i].wr_id, i + 1);
    EXPECT_EQ(ca[i].wqe_index, i);
    EXPECT_EQ(ca[i].status, static_cast<uint8_t>(WcStatus::SUCCESS))
        << "wr " << ca[i].wr_id << ": " << rdma::wc_status_name(static_cast<WcStatus>(ca[i].status));
  }
  std::vector<rdma::Cqe> cb = wait(b, 3);
  EXPECT_EQ(cb[0].wr_id, 100u);
  EXPECT_EQ(cb[0].byte_len, 100u);
  EXPECT_EQ(cb[1].wr_id, 101u);
  EXPECT_EQ(cb[1].byte_len, 9000u);
  EXPECT_EQ(cb[2].wr_id, 102u);
  EXPECT_EQ(cb[2].opcode, static_cast<uint8_t>(rdma::WcOp::RECV_WRITE_IMM));
  EXPECT_EQ(cb[2].imm, 0xfeedbeefu);
  EXPECT_EQ(std::memcmp(nb.hbm, host(0), 100000), 0);
  EXPECT_EQ(std::memcmp(host(0) + 0x20000, nb.hbm + 0x20000, 70000), 0);
  uint64_t res[2];
  std::memcpy(res, na.hbm + 0x40000, 16);
  EXPECT_EQ(res[0], 40u);
  EXPECT_EQ(res[1], 42u);
  std::memcpy(&word, host(1) + 0x40000, 8);
  EXPECT_EQ(word, 1000u);
  std::vector<float> got(3000);
  std::memcpy(got.data(), host(1) + 0x50000, 12000);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], acc[i] + add[i]) << i;
  EXPECT_EQ(std::memcmp(nb.hbm + 0x80000, na.hbm + 0x60000, 100), 0);
  EXPECT_EQ(std::memcmp(nb.hbm + 0x84000, na.hbm + 0x61000, 9000), 0);
  EXPECT_EQ(std::memcmp(host(1) + 0x70000, host(0) + 0x70000, 5000), 0);
  npu::NetInfo n;
  ASSERT_TRUE(na.dev->net_info(&n));
  EXPECT_GE(n.counters[abi::net_counter::TX_FRAMES], 37u);  // 25 + 1 + 2 + 3 + 1 + 3 + 2 packets at MTU 4096
  EXPECT_EQ(n.counters[abi::net_counter::RX_BAD_ICRC], 0u);
}

// Two QPs on one port: the switch hands the frames back to the port they came from.
TEST_F(NpuRoce, LoopbackThroughOnePort) {
  auto [a, b] = pair(0, 0);
  ASSERT_NE(a, nullptr);
  Node& n = node_[0];
  fill(host(0), 20000, 9);
  uint64_t word = 5;
  std::memcpy(n.hbm + 0x9000, &word, 8);
  ASSERT_EQ(a->post_send(wqe(rdma::WrOp::WRITE, n.host_map.iova, n.host_key, 20000, n.hbm_map.iova, n.hbm_key, 1)),
            Code::ok);
  ASSERT_EQ(a->post_send(wqe(rdma::WrOp::READ, n.host_map.iova + 0x10000, n.host_key, 20000, n.hbm_map.iova,
                             n.hbm_key, 2)),
            Code::ok);
  rdma::SendWqe fa = wqe(rdma::WrOp::FETCH_ADD, n.host_map.iova + 0x20000, n.host_key, 8, n.hbm_map.iova + 0x9000,
                         n.hbm_key, 3);
  fa.swap_add = 10;
  ASSERT_EQ(a->post_send(fa), Code::ok);
  std::vector<rdma::Cqe> c = wait(a, 3);
  for (const auto& x : c) EXPECT_EQ(x.status, static_cast<uint8_t>(WcStatus::SUCCESS)) << x.wr_id;
  EXPECT_EQ(std::memcmp(n.hbm, host(0), 20000), 0);
  EXPECT_EQ(std::memcmp(host(0) + 0x10000, host(0), 20000), 0);
  uint64_t old = 0;
  std::memcpy(&old, host(0) + 0x20000, 8);
  EXPECT_EQ(old, 5u);
  std::memcpy(&word, n.hbm + 0x9000, 8);
  EXPECT_EQ(word, 15u);
}

TEST_F(NpuRoce, AWrongOrRevokedKeyIsRefusedAndTouchesNothing) {
  auto [a, b] = pair(0, 1);
  ASSERT_NE(a, nullptr);
  Node &na = node_[0], &nb = node_[1];
  std::memset(nb.hbm, 0x5a, 8192);
  fill(host(0), 4096, 1);
  const uint32_t stale = rdma::make_key(rdma::key_index(nb.hbm_key), static_cast<uint8_t>(nb.hbm_key + 1));
  ASSERT_EQ(a->post_send(wqe(rdma::WrOp::WRITE, na.host_map.iova, na.host_key, 4096, nb.hbm_map.iova, stale, 1)),
            Code::ok);
  ASSERT_EQ(a->post_send(wqe(rdma::WrOp::WRITE, na.host_map.iova, na.host_key, 4096, nb.hbm_map.iova, nb.hbm_key, 2)),
            Code::ok);
  std::vector<rdma::Cqe> c = wait(a, 2);
  EXPECT_EQ(c[0].status, static_cast<uint8_t>(WcStatus::REM_ACCESS_ERR));
  EXPECT_EQ(c[1].status, static_cast<uint8_t>(WcStatus::WR_FLUSH_ERR));
  for (int i = 0; i < 8192; ++i) ASSERT_EQ(nb.hbm[i], 0x5a) << i;
  rdma::QpState s;
  ASSERT_TRUE(a->state(&s));
  EXPECT_EQ(s, rdma::QpState::ERR);
  // Revoked: the key that worked stops working.
  auto [a2, b2] = pair(0, 1);
  ASSERT_TRUE(nb.dev->mr_invalidate(nb.hbm_key));
  ASSERT_EQ(a2->post_send(wqe(rdma::WrOp::WRITE, na.host_map.iova, na.host_key, 64, nb.hbm_map.iova, nb.hbm_key, 3)),
            Code::ok);
  c = wait(a2, 1);
  EXPECT_EQ(c[0].status, static_cast<uint8_t>(WcStatus::REM_ACCESS_ERR));
  for (int i = 0; i < 8192; ++i) ASSERT_EQ(nb.hbm[i], 0x5a) << i;
  uint32_t k = 0;
  ASSERT_TRUE(nb.dev->mr_register(nb.hbm_map.iova, kLen, rdma::access::ALL, &k));
  EXPECT_NE(k, nb.hbm_key);  // the same index comes back under a new key byte
  nb.hbm_key = k;
}

// 10% drop, 5% duplication, 10% reordering and 1% corruption on every frame
// the NPUs send: every result exact, every corruption caught by an ICRC check.
TEST_F(NpuRoce, ExactUnderInjectedFaults) {
  ASSERT_EQ(sim_->control("net faults drop=10 dup=5 reorder=10 corrupt=1 seed=11"), "ok");
  // 8.4 ms: a lost tail costs one timeout; 8 timeouts in a row without progress (67 ms) would fail
  // the test, which a busy machine (sanitizers, 2 cores) does not reach.
  auto [a, b] = pair(0, 1, /*timeout=*/11);
  ASSERT_NE(a, nullptr);
  Node &na = node_[0], &nb = node_[1];
  std::mt19937_64 rng(5);
  constexpr int kOps = 120;
  uint64_t adds = 0;
  std::memset(nb.hbm + 0xf0000, 0, 8);
  std::vector<int64_t> red(128, 0);
  std::memset(host(1) + 0xe0000, 0, 1024);
  for (int i = 0; i < kOps; ++i) {
    const uint64_t off = static_cast<uint64_t>(i) * 0x1000;  // 4 KiB per op
    const uint32_t len = 1 + static_cast<uint32_t>(rng() % 4096);
    rdma::SendWqe w{};
    switch (i % 4) {
      case 0:
        fill(host(0) + off, len, static_cast<uint8_t>(i));
        w = wqe(rdma::WrOp::WRITE, na.host_map.iova + off, na.host_key, len, nb.hbm_map.iova + off, nb.hbm_key, i);
        break;
      case 1:
        fill(nb.hbm + off, len, static_cast<uint8_t>(i));
        w = wqe(rdma::WrOp::READ, na.host_map.iova + off, na.host_key, len, nb.hbm_map.iova + off, nb.hbm_key, i);
        break;
      case 2:
        w = wqe(rdma::WrOp::FETCH_ADD, na.host_map.iova + off, na.host_key, 8, nb.hbm_map.iova + 0xf0000, nb.hbm_key, i);
        w.swap_add = 1 + rng() % 100;
        adds += w.swap_add;
        break;
      default: {
        std::vector<int64_t> v(128);
        for (size_t k = 0; k < 128; ++k) {
          v[k] = static_cast<int64_t>(rng() % 1000) - 500;
          red[k] += v[k];
        }
        std::memcpy(na.hbm + off, v.data(), 1024);
        w = wqe(rdma::WrOp::WRITE_REDUCE, na.hbm_map.iova + off, na.hbm_key, 1024, nb.host_map.iova + 0xe0000,
                nb.host_key, i);
        w.dtype = static_cast<uint8_t>(abi::DType::INT64);
        break;
      }
    }
    while (a->post_send(w) == Code::no_resource) std::this_thread::sleep_for(std::chrono::microseconds(50));
    if (i % 32 == 31) {
      std::vector<rdma::Cqe> c = wait(a, 32, 60000);
      for (const auto& x : c)
        ASSERT_EQ(x.status, static_cast<uint8_t>(WcStatus::SUCCESS))
            << "wr " << x.wr_id << ": " << rdma::wc_status_name(static_cast<WcStatus>(x.status));
    }
  }
  std::vector<rdma::Cqe> c = wait(a, kOps % 32, 60000);
  for (const auto& x : c) ASSERT_EQ(x.status, static_cast<uint8_t>(WcStatus::SUCCESS)) << x.wr_id;
  for (int i = 0; i < kOps; i += 4) {
    const uint64_t off = static_cast<uint64_t>(i) * 0x1000;
    EXPECT_EQ(std::memcmp(nb.hbm + off, host(0) + off, 16), 0) << "write " << i;
  }
  for (int i = 1; i < kOps; i += 4) {
    const uint64_t off = static_cast<uint64_t>(i) * 0x1000;
    EXPECT_EQ(std::memcmp(host(0) + off, nb.hbm + off, 16), 0) << "read " << i;
  }
  uint64_t total = 0;
  std::memcpy(&total, nb.hbm + 0xf0000, 8);
  EXPECT_EQ(total, adds) << "a FETCH_ADD was lost or applied twice";
  std::vector<int64_t> got(128);
  std::memcpy(got.data(), host(1) + 0xe0000, 1024);
  for (size_t k = 0; k < 128; ++k) ASSERT_EQ(got[k], red[k]) << "a WRITE_REDUCE was lost or applied twice";
  // Every corrupted frame died at an ICRC check.
  std::string stats = sim_->control("net stats");
  unsigned long long dropped = 0, dup = 0, reord = 0, corrupted = 0;
  ASSERT_EQ(std::sscanf(stats.c_str(), "ok dropped=%llu duplicated=%llu reordered=%llu corrupted=%llu", &dropped, &dup,
                        &reord, &corrupted),
            4)
      << stats;
  npu::NetInfo i0, i1;
  ASSERT_TRUE(na.dev->net_info(&i0));
  ASSERT_TRUE(nb.dev->net_info(&i1));
  EXPECT_GT(dropped, 0u);
  EXPECT_GT(corrupted, 0u);
  EXPECT_EQ(i0.counters[abi::net_counter::RX_BAD_ICRC] + i1.counters[abi::net_counter::RX_BAD_ICRC], corrupted);
  EXPECT_GT(i0.counters[abi::net_counter::RETRANSMITS], 0u);
  std::printf("faults: %s; retransmits %llu, duplicates seen %llu\n", stats.c_str(),
              static_cast<unsigned long long>(i0.counters[abi::net_counter::RETRANSMITS] +
                                              i1.counters[abi::net_counter::RETRANSMITS]),
              static_cast<unsigned long long>(i0.counters[abi::net_counter::DUPLICATES] +
                                              i1.counters[abi::net_counter::DUPLICATES]));
  ASSERT_EQ(sim_->control("net clear"), "ok");
}

// A link that goes silent: RETRY_EXC_ERR after retry_cnt + 1 local ACK
// timeouts, within the bound the QP's attributes give.
TEST_F(NpuRoce, ASilentLinkEndsInRetryExceededWithinTheBound) {
  auto [a, b] = pair(0, 1, /*timeout=*/12, /*retry=*/3);  // 16.8 ms x 4
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(sim_->control("net drop-next 1000000"), "ok");
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(a->post_send(wqe(rdma::WrOp::WRITE, node_[0].host_map.iova, node_[0].host_key, 64,
                             node_[1].hbm_map.iova, node_[1].hbm_key, 1)),
            Code::ok);
  std::vector<rdma::Cqe> c = wait(a, 1, 5000);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(c[0].status, static_cast<uint8_t>(WcStatus::RETRY_EXC_ERR));
  const double bound = 4 * 4.096e-3 * (1 << 12);
  EXPECT_GE(ms, bound * 0.9);
  EXPECT_LE(ms, bound + 500) << "the bound is 4 timeouts of " << bound / 4 << " ms";
  ASSERT_EQ(sim_->control("net clear"), "ok");
}

}  // namespace
}  // namespace hcomm

namespace hcomm {
namespace {

// Two hcomm-sim processes are two nodes (--node 0 / --node 1) whose
// switches are joined by their uplinks: queue pairs between an NPU of each
// move data both ways, with faults injected on both sides; then one
// simulator is killed and the other's requests end in RETRY_EXC_ERR within
// the QP's bound. Over both links: UDP datagrams (dgram) and DPDK's
// net_memif.
class NpuRoceLinked : public ::testing::TestWithParam<const char*> {};

TEST_P(NpuRoceLinked, TwoSimulatorsAreTwoNodes) {
  test::SimProcess s0, s1;
  if (std::string(GetParam()) == "memif" && !HCOMM_HAVE_DPDK) GTEST_SKIP() << "built without DPDK";
  ASSERT_EQ(test::start_two_nodes(s0, s1, {"--devices", "1", "--hbm", "16M"}, GetParam()), "");
  if (std::string(GetParam()) == "memif") {  // the uplink really is DPDK's memif
    EXPECT_NE(s0.control("net stats").find(" uplink=dpdk:net_memif0(net_memif,"), std::string::npos)
        << s0.control("net stats");
  }
  std::unique_ptr<npu::Device> d0 = open_dev(s0.socket(0)), d1 = open_dev(s1.socket(0));
  ASSERT_TRUE(d0 && d1);
  npu::NetInfo n0, n1;
  ASSERT_TRUE(d0->net_info(&n0));
  ASSERT_TRUE(d1->net_info(&n1));
  EXPECT_EQ(n0.ip, 0x0a000001u);  // 10.0.0.1
  EXPECT_EQ(n1.ip, 0x0a000101u);  // 10.0.1.1: another node
  EXPECT_EQ(n1.mac[4], 1);
  npu::Mapping m0, m1;
  ASSERT_TRUE(d0->map_hbm(0, kLen, npu::access::RW, &m0));
  ASSERT_TRUE(d1->map_hbm(0, kLen, npu::access::RW, &m1));
  uint32_t k0 = 0, k1 = 0;
  ASSERT_TRUE(d0->mr_register(m0.iova, kLen, rdma::access::ALL, &k0));
  ASSERT_TRUE(d1->mr_register(m1.iova, kLen, rdma::access::ALL, &k1));
  uint8_t *h0 = d0->hbm(), *h1 = d1->hbm();
  npu::QpOptions o;
  o.timeout = 12;  // 16.8 ms
  o.retry_cnt = 7;
  std::unique_ptr<npu::RdmaQp> a, b;
  ASSERT_TRUE(d0->create_qp(o, &a));
  o.sq_psn = 1000;
  ASSERT_TRUE(d1->create_qp(o, &b));
  npu::QpPeer pa{b->qpn(), n1.ip, {}, 1000}, pb{a->qpn(), n0.ip, {}, 0};
  std::memcpy(pa.mac, n1.mac, 6);
  std::memcpy(pb.mac, n0.mac, 6);
  ASSERT_TRUE(a->connect(pa));
  ASSERT_TRUE(b->connect(pb));
  ASSERT_EQ(s0.control("net faults drop=5 dup=5 reorder=5 corrupt=1 seed=2"), "ok");
  ASSERT_EQ(s1.control("net faults drop=5 dup=5 reorder=5 corrupt=1 seed=3"), "ok");
  for (size_t i = 0; i < 200000; ++i) h0[i] = static_cast<uint8_t>(i * 5 + 1);
  for (size_t i = 0; i < 200000; ++i) h1[0x40000 + i] = static_cast<uint8_t>(i * 3 + 2);
  auto w = [](rdma::WrOp op, uint64_t l, uint32_t lk, uint32_t len, uint64_t r, uint32_t rk, uint64_t id) {
    rdma::SendWqe x = rdma::make_wqe(op, l, lk, len, r, rk, id);
    x.swap_add = 1;
    return x;
  };
  // Node 0 writes 200 KB to node 1 and reads 200 KB back from it; node 1
  // fetch-adds into node 0 (each side initiates).
  ASSERT_EQ(a->post_send(w(rdma::WrOp::WRITE, m0.iova, k0, 200000, m1.iova, k1, 1)), Code::ok);
  ASSERT_EQ(a->post_send(w(rdma::WrOp::READ, m0.iova + 0x40000, k0, 200000, m1.iova + 0x40000, k1, 2)), Code::ok);
  for (int i = 0; i < 20; ++i)
    ASSERT_EQ(b->post_send(w(rdma::WrOp::FETCH_ADD, m1.iova + 0x80000 + 8 * i, k1, 8, m0.iova + 0x90000, k0, 10 + i)),
              Code::ok);
  rdma::Cqe ca[2], cb[20];
  ASSERT_TRUE(a->wait(2, ca, Deadline::after_ms(30000)));
  ASSERT_TRUE(b->wait(20, cb, Deadline::after_ms(30000)));
  for (const auto& c : ca) EXPECT_EQ(c.status, 0) << rdma::wc_status_name(static_cast<WcStatus>(c.status));
  for (const auto& c : cb) EXPECT_EQ(c.status, 0) << rdma::wc_status_name(static_cast<WcStatus>(c.status));
  EXPECT_EQ(std::memcmp(h1, h0, 200000), 0);
  EXPECT_EQ(std::memcmp(h0 + 0x40000, h1 + 0x40000, 200000), 0);
  uint64_t word = 0;
  std::memcpy(&word, h0 + 0x90000, 8);
  EXPECT_EQ(word, 20u);
  for (uint64_t i = 0; i < 20; ++i) {  // each fetch-add saw the one before it
    uint64_t old = 99;
    std::memcpy(&old, h1 + 0x80000 + 8 * i, 8);
    EXPECT_EQ(old, i);
  }
  npu::NetInfo f0, f1;
  ASSERT_TRUE(d0->net_info(&f0));
  ASSERT_TRUE(d1->net_info(&f1));
  EXPECT_GT(f0.counters[abi::net_counter::RETRANSMITS] + f1.counters[abi::net_counter::RETRANSMITS], 0u);
  // The other node dies: retry exceeded within (retry_cnt + 1) timeouts.
  ASSERT_EQ(s0.control("net clear"), "ok");
  s1.stop();
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(a->post_send(w(rdma::WrOp::WRITE, m0.iova, k0, 64, m1.iova, k1, 3)), Code::ok);
  ASSERT_TRUE(a->wait(1, ca, Deadline::after_ms(5000)));
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(ca[0].status, static_cast<uint8_t>(WcStatus::RETRY_EXC_ERR));
  const double bound = 8 * 4.096e-3 * (1 << 12);
  EXPECT_LE(ms, bound + 500) << "bound " << bound << " ms";
  (void)d0->unmap(&m0);
}

// Why a tap interface cannot be made here ("" when it can).
std::string tap_unavailable() {
  const int fd = ::open("/dev/net/tun", O_RDWR | O_CLOEXEC);
  if (fd < 0) return std::string("no /dev/net/tun: ") + std::strerror(errno);
  ifreq r{};
  r.ifr_flags = IFF_TAP | IFF_NO_PI;
  const int rc = ::ioctl(fd, TUNSETIFF, &r);
  const int err = errno;
  ::close(fd);
  return rc == 0 ? "" : std::string("TUNSETIFF (CAP_NET_ADMIN needed): ") + std::strerror(err);
}

// Gives the kernel interface `ifname` the IPv4 address `ip`/24, up.
std::string kernel_if_up(const std::string& ifname, const char* ip) {
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return std::strerror(errno);
  ifreq r{};
  std::snprintf(r.ifr_name, sizeof r.ifr_name, "%s", ifname.c_str());
  auto* a = reinterpret_cast<sockaddr_in*>(&r.ifr_addr);
  a->sin_family = AF_INET;
  std::string err;
  if (::inet_pton(AF_INET, ip, &a->sin_addr) != 1 || ::ioctl(fd, SIOCSIFADDR, &r) != 0) err = "SIOCSIFADDR";
  a->sin_addr.s_addr = htonl(0xffffff00u);
  if (err.empty() && ::ioctl(fd, SIOCSIFNETMASK, &r) != 0) err = "SIOCSIFNETMASK";
  if (err.empty() && ::ioctl(fd, SIOCGIFFLAGS, &r) != 0) err = "SIOCGIFFLAGS";
  r.ifr_flags = static_cast<short>(r.ifr_flags | IFF_UP | IFF_RUNNING);
  if (err.empty() && ::ioctl(fd, SIOCSIFFLAGS, &r) != 0) err = "SIOCSIFFLAGS";
  if (!err.empty()) err += std::string(" ") + ifname + ": " + std::strerror(errno);
  ::close(fd);
  return err;
}

// The kernel's ARP entry for `ip` ("" while it has none complete).
std::string kernel_arp(const std::string& ip) {
  FILE* f = std::fopen("/proc/net/arp", "r");
  if (f == nullptr) return "";
  char line[256];
  std::string mac;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    char a[64], hw[64], m[64], dev[64];
    unsigned type = 0, flags = 0;
    if (std::sscanf(line, "%63s 0x%x 0x%x %63s %63s %63s", a, &type, &flags, hw, m, dev) == 6 && ip == a &&
        (flags & 0x2) != 0)
      mac = hw;
  }
  std::fclose(f);
  return mac;
}

INSTANTIATE_TEST_SUITE_P(Links, NpuRoceLinked, ::testing::Values("dgram", "memif"),
                         [](const ::testing::TestParamInfo<const char*>& i) { return std::string(i.param); });

// DPDK's net_tap puts the simulator's wire on a kernel interface: the
// host's own network stack (nothing hcomm wrote) resolves the NPU's IPv4
// address by ARP, which the engine answers, and a UDP datagram it sends to
// port 4791 reaches the engine, which parses it and drops it at the ICRC
// check (the kernel cannot compute RoCE's ICRC; the datagram carries a
// wrong one).
TEST(NpuRoceTap, TheKernelsStackReachesTheEngine) {
  if (!HCOMM_HAVE_DPDK) GTEST_SKIP() << "built without DPDK";
  if (std::string why = tap_unavailable(); !why.empty()) GTEST_SKIP() << why;
  const std::string ifname = "hcsim" + std::to_string(::getpid() % 1000000);
  test::SimProcess s;
  // Node 213: the NPU is 10.0.213.1, MAC 02:4e:50:55:d5:00.
  ASSERT_EQ(s.start({"--devices", "1", "--hbm", "16M", "--node", "213", "--uplink", "dpdk:net_tap0,iface=" + ifname}),
            "");
  EXPECT_NE(s.control("net stats").find(" uplink=dpdk:net_tap0(net_tap,"), std::string::npos) << s.control("net stats");
  ASSERT_EQ(kernel_if_up(ifname, "10.0.213.254"), "");
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(4791);
  ASSERT_EQ(::inet_pton(AF_INET, "10.0.213.1", &to.sin_addr), 1);
  // BTH: RC SEND_ONLY to QP 1, PSN 0; then 4 bytes where the ICRC goes.
  const uint8_t dgram[16] = {0x04, 0x40, 0xff, 0xff, 0, 0, 0, 1, 0x80, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef};
  std::string mac;
  unsigned long long bad = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < until) {
    // Sent until the engine has seen one (the first may wait on ARP, or
    // go out before the interface is fully up).
    (void)::sendto(fd, dgram, sizeof dgram, MSG_DONTWAIT, reinterpret_cast<sockaddr*>(&to), sizeof to);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    mac = kernel_arp("10.0.213.1");
    const std::string info = s.control("net info 0");
    const size_t at = info.find(" bad_icrc=");
    bad = at == std::string::npos ? 0 : std::strtoull(info.c_str() + at + 10, nullptr, 10);
    if (!mac.empty() && bad > 0) break;
  }
  ::close(fd);
  EXPECT_EQ(mac, "02:4e:50:55:d5:00") << "the kernel resolved the NPU's address by ARP";
  EXPECT_GT(bad, 0u) << "the kernel's datagram reached the engine's ICRC check: " << s.control("net info 0");
}

}  // namespace
}  // namespace hcomm
