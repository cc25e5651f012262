// Integration: the HAL drives hcomm-sim (a separate process) through the
// vfio-user link, exactly as it would drive silicon through VFIO.
//
// HCOMM_TEST_DEVICES="A,B" runs the same suite against two devices that
// already exist instead of starting hcomm-sim: inside the QEMU guest of the
// `qemu` suite they are ivshmem functions bound to vfio-pci (tests/qemu/).
// Tests that need the simulator's control socket are skipped there.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <thread>

#include "common/time.h"
#include "driver/discover.h"
#include "driver/dma_memory.h"
#include "driver/vfio_user_link.h"
#include "hal/npu/device.h"
#include "hal/npu/dma_queue.h"
#include "tests/support/sim_process.h"

namespace hcomm {
namespace {

namespace abi = hal::abi;
namespace npu = hal::npu;
using abi::CqStatus;
using abi::DType;
using abi::RedOp;

class NpuDma : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (const char* e = std::getenv("HCOMM_TEST_DEVICES"); e != nullptr && *e != '\0') {
      std::string list = e;
      for (size_t pos = 0; pos <= list.size();) {
        size_t c = list.find(',', pos);
        if (c == std::string::npos) c = list.size();
        if (c > pos) external_.push_back(list.substr(pos, c - pos));
        pos = c + 1;
      }
      if (external_.size() < 2) FAIL() << "HCOMM_TEST_DEVICES needs two devices, got '" << list << "'";
      return;
    }
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
    if (external_.empty()) {
      ASSERT_NE(sim_, nullptr);
      ASSERT_TRUE(sim_->alive()) << "hcomm-sim died in an earlier test";
      ASSERT_EQ(sim_->control("clear 0"), "ok");
    }
    dev_ = open(0);
    ASSERT_NE(dev_, nullptr);
    Status st = dev_->create_queue(8, false, &q_);
    ASSERT_TRUE(st) << st.to_string();
  }
  void TearDown() override {
    for (auto& m : maps_)
      if (m.valid()) (void)dev_->unmap(&m);
    maps_.clear();
    q_.reset();
    bufs_.clear();
    dev_.reset();
  }

  // Device i's link: the simulator's vfio-user socket, or external device i.
  static Status open_link(unsigned i, std::unique_ptr<driver::Link>* link) {
    if (external_.empty()) return driver::open_vfio_user(sim_->socket(i), link, 2000);
    driver::DeviceRef ref;
    HCOMM_TRY(driver::parse_device_name(external_.at(i), "", &ref));
    return driver::open_link(ref, link, 2000);
  }

  static std::unique_ptr<npu::Device> open(unsigned i) {
    std::unique_ptr<driver::Link> link;
    std::unique_ptr<npu::Device> dev;
    // A previous test's client may still be leaving: retry briefly.
    Deadline dl = Deadline::after_ms(5000);
    for (;;) {
      Status st = open_link(i, &link);
      if (st) st = npu::Device::open(std::move(link), &dev);
      if (st) return dev;
      if (dl.expired()) {
        ADD_FAILURE() << "open sim:" << i << ": " << st.to_string();
        return nullptr;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  // A host buffer mapped for the device; returns its IOVA.
  uint8_t* host(size_t len, uint64_t* iova, uint32_t rights = npu::access::RW) {
    driver::DmaBuffer b;
    Status st = driver::DmaBuffer::allocate(len, -1, &b);
    EXPECT_TRUE(st) << st.to_string();
    npu::Mapping m;
    // Exactly len bytes, even where the buffer is rounded up (hugepages in
    // iova-mode=pa): the fault tests aim just past the end.
    st = dev_->map_host(b.data(), len, b.fd(), 0, rights, &m);
    EXPECT_TRUE(st) << st.to_string();
    *iova = m.iova;
    auto* p = static_cast<uint8_t*>(b.data());
    maps_.push_back(m);
    bufs_.push_back(std::move(b));
    return p;
  }
  uint64_t hbm(uint64_t off, uint64_t len, uint32_t rights = npu::access::RW) {
    npu::Mapping m;
    Status st = dev_->map_hbm(off, len, rights, &m);
    EXPECT_TRUE(st) << st.to_string();
    maps_.push_back(m);
    return m.iova;
  }
  // A raw ATT WRITE of entry `index` through the link (past the HAL); returns ATT_STATUS.
  uint32_t att_write(uint32_t index, uint64_t iova, uint64_t len, uint64_t target, uint32_t flags) {
    driver::Link& l = dev_->link();
    EXPECT_TRUE(l.write32(abi::reg::ATT_INDEX, index));
    EXPECT_TRUE(l.write64(abi::reg::ATT_IOVA, iova));
    EXPECT_TRUE(l.write64(abi::reg::ATT_LEN, len));
    EXPECT_TRUE(l.write64(abi::reg::ATT_TARGET, target));
    EXPECT_TRUE(l.write32(abi::reg::ATT_FLAGS, flags));
    EXPECT_TRUE(l.write32(abi::reg::ATT_CMD, abi::att_cmd::WRITE));
    uint32_t st = 99;
    EXPECT_TRUE(l.read32(abi::reg::ATT_STATUS, &st));
    return st;
  }
  // Submit everything and return the status of the one in-flight descriptor.
  CqStatus run_one() {
    q_->submit();
    npu::Completion c;
    Deadline dl = Deadline::after_ms(10000);
    while (q_->poll({&c, 1}) == 0) {
      if (q_->wait(dl) != Code::ok) {
        ADD_FAILURE() << "timeout";
        return CqStatus::ABORTED;
      }
    }
    return c.status;
  }
  void run_all_ok() {
    CqStatus e;
    Status st = q_->drain(Deadline::after_ms(20000), &e);
    ASSERT_TRUE(st) << st.to_string();
    ASSERT_EQ(e, CqStatus::OK) << abi::cq_status_name(e);
  }

  static test::SimProcess* sim_;
  static std::vector<std::string> external_;
  std::unique_ptr<npu::Device> dev_;
  std::unique_ptr<npu::DmaQueue> q_;
  std::vector<npu::Mapping> maps_;
  std::vector<driver::DmaBuffer> bufs_;
};

test::SimProcess* NpuDma::sim_ = nullptr;
std::vector<std::string> NpuDma::external_;

#define NEEDS_SIM_CONTROL() \
  if (sim_ == nullptr) GTEST_SKIP() << "needs hcomm-sim's control socket (not reachable with HCOMM_TEST_DEVICES)"


TEST_F(NpuDma, BringUpReadsIdentity) {
  const auto& in = dev_->info();
  EXPECT_EQ(in.vendor_id, abi::kPciVendorId);
  EXPECT_EQ(in.device_id, abi::kPciDeviceId);
  EXPECT_EQ(in.abi_version, abi::kAbiVersion);
  EXPECT_EQ(in.hbm_size, 64u << 20);
  EXPECT_EQ(in.num_queues, 4u);
  EXPECT_EQ(in.fabric_index, 0u);
  EXPECT_EQ(in.fabric_size, 2u);
  EXPECT_NE(in.caps & abi::cap::REDUCE, 0u);
  EXPECT_NE(dev_->hbm(), nullptr) << "BAR2 should be mmapable over vfio-user";
}

TEST_F(NpuDma, CopyEverySizeHostAndHbm) {
  const size_t max = (1u << 20) + 3;
  uint64_t ia, ib;
  uint8_t* a = host(max, &ia);
  uint8_t* b = host(max, &ib);
  uint64_t ih = hbm(0, max + 4096);
  std::mt19937 rng(1);
  for (size_t i = 0; i < max; ++i) a[i] = static_cast<uint8_t>(rng());
  for (size_t len : {size_t{1}, size_t{7}, size_t{64}, size_t{4095}, size_t{4096}, size_t{65537}, max}) {
    std::memset(b, 0, max);
    ASSERT_EQ(q_->copy(ia, ih + 1, len, 1), Code::ok);
    ASSERT_EQ(q_->copy(ih + 1, ib, len, 2, abi::desc_flag::FENCE), Code::ok);
    run_all_ok();
    ASSERT_EQ(std::memcmp(a, b, len), 0) << "len " << len;
    ASSERT_EQ(b[len], 0) << "copy of " << len << " wrote past its end";
    ASSERT_EQ(std::memcmp(dev_->hbm() + 1, a, len), 0) << "HBM view, len " << len;
  }
}

TEST_F(NpuDma, FillWritesPatternIncludingPartialTail) {
  uint64_t ib;
  uint8_t* b = host(8192, &ib);
  const uint64_t pat = 0x1122334455667788ull;
  ASSERT_EQ(q_->fill(ib + 3, 1001, pat, 1), Code::ok);
  run_all_ok();
  uint8_t p[8];
  std::memcpy(p, &pat, 8);
  EXPECT_EQ(b[2], 0);
  for (int i = 0; i < 1001; ++i) ASSERT_EQ(b[3 + i], p[i % 8]) << i;
  EXPECT_EQ(b[3 + 1001], 0);
}

// Reference values for REDUCE, computed independently of the simulator.
template <typename T>
T ref_op(RedOp op, T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;
    switch (op) {
      case RedOp::SUM: return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
      case RedOp::PROD: return static_cast<T>(static_cast<U>(a) * static_cast<U>(b));
      case RedOp::MAX: return std::max(a, b);
      case RedOp::MIN: return std::min(a, b);
    }
  } else {
    switch (op) {
      case RedOp::SUM: return a + b;
      case RedOp::PROD: return a * b;
      case RedOp::MAX: return std::max(a, b);
      case RedOp::MIN: return std::min(a, b);
    }
  }
  return a;
}

template <typename T>
void check_reduce(NpuDma* t, npu::DmaQueue& q, DType dt, uint8_t* a, uint64_t ia, uint8_t* b, uint64_t ib, size_t n,
                  std::mt19937& rng) {
  for (RedOp op : {RedOp::SUM, RedOp::PROD, RedOp::MAX, RedOp::MIN}) {
    std::vector<T> x(n), y(n);
    for (size_t i = 0; i < n; ++i) {
      if constexpr (std::is_integral_v<T>) {
        x[i] = static_cast<T>(rng());
        y[i] = static_cast<T>(rng());
      } else {
        x[i] = static_cast<T>(static_cast<int>(rng() % 2001) - 1000) / 8;
        y[i] = static_cast<T>(static_cast<int>(rng() % 2001) - 1000) / 8;
      }
    }
    std::memcpy(a, x.data(), n * sizeof(T));
    std::memcpy(b, y.data(), n * sizeof(T));
    ASSERT_EQ(q.reduce(ia, ib, n * sizeof(T), dt, op, 1), Code::ok);
    CqStatus e;
    ASSERT_TRUE(q.drain(Deadline::after_ms(10000), &e));
    ASSERT_EQ(e, CqStatus::OK);
    for (size_t i = 0; i < n; ++i) {
      T got;
      std::memcpy(&got, b + i * sizeof(T), sizeof(T));
      ASSERT_EQ(got, ref_op<T>(op, y[i], x[i])) << "dtype " << int(dt) << " op " << int(op) << " i " << i;
    }
  }
  (void)t;
}

TEST_F(NpuDma, ReduceEveryIntegerAndFloatTypeAndOp) {
  const size_t n = 1000;
  uint64_t ia, ib;
  uint8_t* a = host(n * 8, &ia);
  uint8_t* b = host(n * 8, &ib);
  std::mt19937 rng(7);
  check_reduce<int8_t>(this, *q_, DType::INT8, a, ia, b, ib, n, rng);
  check_reduce<int16_t>(this, *q_, DType::INT16, a, ia, b, ib, n, rng);
  check_reduce<int32_t>(this, *q_, DType::INT32, a, ia, b, ib, n, rng);
  check_reduce<int64_t>(this, *q_, DType::INT64, a, ia, b, ib, n, rng);
  check_reduce<uint8_t>(this, *q_, DType::UINT8, a, ia, b, ib, n, rng);
  check_reduce<uint16_t>(this, *q_, DType::UINT16, a, ia, b, ib, n, rng);
  check_reduce<uint32_t>(this, *q_, DType::UINT32, a, ia, b, ib, n, rng);
  check_reduce<uint64_t>(this, *q_, DType::UINT64, a, ia, b, ib, n, rng);
  check_reduce<float>(this, *q_, DType::FP32, a, ia, b, ib, n, rng);
  check_reduce<double>(this, *q_, DType::FP64, a, ia, b, ib, n, rng);
}

// fp16 and bf16: operands and results chosen exactly representable, encoded
// with the compiler's _Float16 and by truncating an exact float to bf16.
uint16_t bf16_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}
uint16_t fp16_of(float f) {
  _Float16 h = static_cast<_Float16>(f);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}

TEST_F(NpuDma, ReduceHalfPrecisionTypes) {
  const size_t n = 512;
  uint64_t ia, ib;
  uint8_t* a = host(n * 2, &ia);
  uint8_t* b = host(n * 2, &ib);
  std::mt19937 rng(3);
  for (DType dt : {DType::FP16, DType::BF16}) {
    auto enc = dt == DType::FP16 ? fp16_of : bf16_of;
    for (RedOp op : {RedOp::SUM, RedOp::PROD, RedOp::MAX, RedOp::MIN}) {
      std::vector<float> x(n), y(n);
      for (size_t i = 0; i < n; ++i) {
        x[i] = static_cast<float>(static_cast<int>(rng() % 17) - 8);  // small integers: exact in both
        y[i] = static_cast<float>(static_cast<int>(rng() % 17) - 8);
        uint16_t ex = enc(x[i]), ey = enc(y[i]);
        std::memcpy(a + 2 * i, &ex, 2);
        std::memcpy(b + 2 * i, &ey, 2);
      }
      ASSERT_EQ(q_->reduce(ia, ib, n * 2, dt, op, 1), Code::ok);
      run_all_ok();
      for (size_t i = 0; i < n; ++i) {
        uint16_t got;
        std::memcpy(&got, b + 2 * i, 2);
        ASSERT_EQ(got, enc(ref_op<float>(op, y[i], x[i]))) << "dtype " << int(dt) << " op " << int(op) << " i " << i;
      }
    }
  }
}

TEST_F(NpuDma, NotifyLandsAfterEarlierData) {
  const size_t len = 1 << 20;
  uint64_t ia, ib, iflag;
  uint8_t* a = host(len, &ia);
  uint8_t* b = host(len, &ib);
  auto* flag = reinterpret_cast<uint64_t*>(host(4096, &iflag));
  std::memset(a, 0xab, len);
  ASSERT_EQ(q_->copy(ia, ib, len, 1), Code::ok);
  ASSERT_EQ(q_->notify(iflag, 42, 2), Code::ok);
  q_->submit();
  Deadline dl = Deadline::after_ms(10000);
  while (std::atomic_ref<uint64_t>(*flag).load(std::memory_order_acquire) != 42) {
    ASSERT_FALSE(dl.expired()) << "notify never arrived";
    std::this_thread::yield();
  }
  // The flag is the only thing the waiter looked at: the data must be there.
  for (size_t i = 0; i < len; i += 4093) ASSERT_EQ(b[i], 0xab);
  run_all_ok();
}

TEST_F(NpuDma, EveryMalformedDescriptorGetsItsOwnErrorAndTheQueueGoesOn) {
  uint64_t ia, ib, iro, iwo;
  uint8_t* a = host(4096, &ia);
  uint8_t* b = host(4096, &ib);
  host(4096, &iro, npu::access::READ);
  host(4096, &iwo, npu::access::WRITE);
  std::memset(a, 1, 4096);
  std::memset(b, 0, 4096);
  auto desc = [](abi::Opcode op, uint64_t src, uint64_t dst, uint64_t len) {
    abi::SqEntry e{};
    e.opcode = static_cast<uint8_t>(op);
    e.src = src;
    e.dst = dst;
    e.length = len;
    return e;
  };
  struct Case {
    const char* what;
    abi::SqEntry e;
    CqStatus want;
  };
  std::vector<Case> cases;
  cases.push_back({"unknown opcode", desc(static_cast<abi::Opcode>(99), ia, ib, 8), CqStatus::BAD_OPCODE});
  cases.push_back({"zero-length copy", desc(abi::Opcode::COPY, ia, ib, 0), CqStatus::BAD_LENGTH});
  cases.push_back({"NOP with a length", desc(abi::Opcode::NOP, 0, 0, 8), CqStatus::BAD_LENGTH});
  cases.push_back({"NOTIFY of 4 bytes", desc(abi::Opcode::NOTIFY, 0, ib, 4), CqStatus::BAD_LENGTH});
  cases.push_back({"NOTIFY misaligned", desc(abi::Opcode::NOTIFY, 0, ib + 4, 8), CqStatus::BAD_ALIGN});
  {
    auto e = desc(abi::Opcode::REDUCE, ia, ib + 2, 64);
    e.dtype = static_cast<uint8_t>(DType::FP32);
    cases.push_back({"reduce misaligned dst", e, CqStatus::BAD_ALIGN});
    e = desc(abi::Opcode::REDUCE, ia, ib, 62);
    e.dtype = static_cast<uint8_t>(DType::FP32);
    cases.push_back({"reduce length not a multiple", e, CqStatus::BAD_ALIGN});
    e = desc(abi::Opcode::REDUCE, ia, ib, 64);
    e.dtype = 12;
    cases.push_back({"unknown dtype", e, CqStatus::BAD_DTYPE});
    e.dtype = static_cast<uint8_t>(DType::INT32);
    e.redop = 4;
    cases.push_back({"unknown redop", e, CqStatus::BAD_REDOP});
  }
  {
    auto e = desc(abi::Opcode::COPY, ia, ib, 8);
    e.rsvd0 = 1;
    cases.push_back({"reserved field", e, CqStatus::BAD_FIELD});
    e = desc(abi::Opcode::COPY, ia, ib, 8);
    e.flags = 0x80;
    cases.push_back({"unknown flag", e, CqStatus::BAD_FIELD});
    e = desc(abi::Opcode::COPY, ia, ib, 8);
    e.dtype = 1;
    cases.push_back({"dtype on a copy", e, CqStatus::BAD_FIELD});
  }
  cases.push_back({"src unmapped", desc(abi::Opcode::COPY, 0x1000, ib, 8), CqStatus::SRC_FAULT});
  cases.push_back({"dst unmapped", desc(abi::Opcode::COPY, ia, 0x1000, 8), CqStatus::DST_FAULT});
  cases.push_back({"src runs off its mapping", desc(abi::Opcode::COPY, ia + 4000, ib, 200), CqStatus::SRC_FAULT});
  cases.push_back({"dst runs off its mapping", desc(abi::Opcode::COPY, ia, ib + 4000, 200), CqStatus::DST_FAULT});
  cases.push_back({"src address wraps", desc(abi::Opcode::COPY, ~0ull - 3, ib, 8), CqStatus::SRC_FAULT});
  cases.push_back({"read from write-only", desc(abi::Opcode::COPY, iwo, ib, 8), CqStatus::SRC_PERM});
  cases.push_back({"write to read-only", desc(abi::Opcode::COPY, ia, iro, 8), CqStatus::DST_PERM});
  {
    auto e = desc(abi::Opcode::REDUCE, ia, iwo, 64);
    e.dtype = static_cast<uint8_t>(DType::INT32);
    cases.push_back({"reduce into write-only (dst is read too)", e, CqStatus::DST_PERM});
  }
  for (auto& c : cases) {
    npu::ErrorLog before, after;
    ASSERT_TRUE(dev_->error_log(&before));
    ASSERT_EQ(q_->enqueue(c.e), Code::ok);
    EXPECT_EQ(run_one(), c.want) << c.what;
    ASSERT_TRUE(dev_->error_log(&after));
    EXPECT_EQ(after.count, before.count + 1) << c.what;
    EXPECT_EQ(after.last_code, static_cast<uint32_t>(c.want)) << c.what;
    EXPECT_EQ(after.last_queue, q_->id());
  }
  // Nothing above moved a byte into b.
  for (int i = 0; i < 4096; ++i) ASSERT_EQ(b[i], 0) << i;
  ASSERT_EQ(q_->copy(ia, ib, 4096, 7), Code::ok);
  EXPECT_EQ(run_one(), CqStatus::OK);
  EXPECT_EQ(b[4095], 1);
}

TEST_F(NpuDma, RandomDescriptorsNeverTouchUnmappedMemory) {
  // Fuzz the device with garbage descriptors aimed around two small
  // mappings; a canary buffer that is DMA-mapped but not in the ATT must stay
  // untouched, and the device must stay healthy.
  uint64_t ia, ib;
  uint8_t* a = host(4096, &ia);
  uint8_t* b = host(4096, &ib);
  (void)a;
  (void)b;
  driver::DmaBuffer canary;
  ASSERT_TRUE(driver::DmaBuffer::allocate(4096, -1, &canary));
  std::memset(canary.data(), 0xcc, 4096);
  uint64_t bus = 0;
  ASSERT_TRUE(dev_->link().dma_map(canary.data(), 4096, canary.fd(), 0, driver::dma_prot::READ | driver::dma_prot::WRITE, &bus));
  std::mt19937_64 rng(11);
  const uint64_t bases[] = {ia, ib, bus, 0, ~0ull - 4096};
  npu::Completion c[64];
  uint32_t done = 0;
  const uint32_t total = 20000;
  uint32_t sent = 0;
  Deadline dl = Deadline::after_ms(60000);
  while (done < total) {
    while (sent < total) {
      abi::SqEntry e{};
      uint64_t r = rng();
      e.opcode = static_cast<uint8_t>(r % 6);
      e.flags = static_cast<uint8_t>((r >> 8) % 5 == 0 ? (r >> 16) : 0) & 0x03;
      e.dtype = e.opcode == 3 ? static_cast<uint8_t>((r >> 24) % 13) : 0;
      e.redop = e.opcode == 3 ? static_cast<uint8_t>((r >> 32) % 5) : 0;
      e.src = bases[(r >> 40) % 5] + rng() % 8192;
      e.dst = bases[(r >> 44) % 5] + rng() % 8192;
      e.length = rng() % 5000;
      e.value = rng();
      e.flags &= static_cast<uint8_t>(~abi::desc_flag::INTERRUPT);
      if (q_->enqueue(e) != Code::ok) break;
      ++sent;
    }
    q_->submit();
    ASSERT_EQ(q_->wait(dl), Code::ok) << "stuck after " << done;
    done += q_->poll(c);
  }
  auto* cp = static_cast<uint8_t*>(canary.data());
  for (int i = 0; i < 4096; ++i) ASSERT_EQ(cp[i], 0xcc) << "canary byte " << i << " was written";
  ASSERT_TRUE(dev_->link().dma_unmap(bus, 4096));
  ASSERT_EQ(q_->copy(ia, ib, 64, 1), Code::ok);
  EXPECT_EQ(run_one(), CqStatus::OK);
}

TEST_F(NpuDma, FetchAtomicsFromTwoDevicesAreAtomic) {
  // Device 0 and device 1 both fetch-add into one word of device 0's host
  // memory, reached by device 1 through a DMA map of the same memfd.
  auto peer = open(1);
  ASSERT_NE(peer, nullptr);
  std::unique_ptr<npu::DmaQueue> pq;
  ASSERT_TRUE(peer->create_queue(8, false, &pq));
  driver::DmaBuffer word;
  ASSERT_TRUE(driver::DmaBuffer::allocate(4096, -1, &word));
  npu::Mapping m0, m1;
  ASSERT_TRUE(dev_->map_buffer(word, npu::access::RW, &m0));
  ASSERT_TRUE(peer->map_buffer(word, npu::access::RW, &m1));
  uint64_t ires;
  auto* results = reinterpret_cast<uint64_t*>(host(4096, &ires));
  driver::DmaBuffer pres;
  ASSERT_TRUE(driver::DmaBuffer::allocate(4096, -1, &pres));
  npu::Mapping mp;
  ASSERT_TRUE(peer->map_buffer(pres, npu::access::RW, &mp));
  const uint32_t n = 200;
  for (uint32_t i = 0; i < n; ++i) {
    ASSERT_EQ(q_->fetch_add(m0.iova, ires + 8 * (i % 256), 1, i), Code::ok);
    ASSERT_EQ(pq->fetch_add(m1.iova, mp.iova + 8 * (i % 256), 1, i), Code::ok);
    if (q_->free_slots() == 0 || i == n - 1) {
      q_->submit();
      pq->submit();
      CqStatus e0, e1;
      ASSERT_TRUE(q_->drain(Deadline::after_ms(10000), &e0));
      ASSERT_TRUE(pq->drain(Deadline::after_ms(10000), &e1));
      ASSERT_EQ(e0, CqStatus::OK);
      ASSERT_EQ(e1, CqStatus::OK);
    }
  }
  EXPECT_EQ(*static_cast<uint64_t*>(word.data()), 2u * n) << "lost updates";
  (void)results;
  // CMP_SWAP: succeeds once, then reports the value it found.
  ASSERT_EQ(q_->cmp_swap(m0.iova, ires, 2 * n, 7, 1), Code::ok);
  ASSERT_EQ(q_->cmp_swap(m0.iova, ires + 8, 2 * n, 9, 2), Code::ok);
  run_all_ok();
  EXPECT_EQ(results[0], 2u * n);
  EXPECT_EQ(results[1], 7u);
  EXPECT_EQ(*static_cast<uint64_t*>(word.data()), 7u);
  // Misuse gets its own status.
  ASSERT_EQ(q_->fetch_add(m0.iova + 4, ires, 1, 3), Code::ok);
  EXPECT_EQ(run_one(), CqStatus::BAD_ALIGN);
  abi::SqEntry e{};
  e.opcode = static_cast<uint8_t>(abi::Opcode::COPY);
  e.src = ires;
  e.dst = ires + 64;
  e.length = 8;
  e.compare = 1;
  ASSERT_EQ(q_->enqueue(e), Code::ok);
  EXPECT_EQ(run_one(), CqStatus::BAD_FIELD) << "compare is reserved outside CMP_SWAP";
  ASSERT_TRUE(dev_->unmap(&m0));
  ASSERT_TRUE(peer->unmap(&m1));
  ASSERT_TRUE(peer->unmap(&mp));
}

TEST_F(NpuDma, RingRunsPast65536WrapArounds) {
  std::unique_ptr<npu::DmaQueue> q;
  ASSERT_TRUE(dev_->create_queue(2, false, &q));  // 4 entries
  const uint32_t total = 4 * 65536 + 1000;        // > 2^16 wraps
  uint32_t sent = 0, done = 0;
  npu::Completion c[4];
  Deadline dl = Deadline::after_ms(240000);
  while (done < total) {
    while (sent < total && q->nop(sent) == Code::ok) ++sent;
    q->submit();
    ASSERT_EQ(q->wait(dl), Code::ok) << "stuck at " << done;
    uint32_t n = q->poll(c);
    for (uint32_t i = 0; i < n; ++i, ++done) {
      ASSERT_EQ(c[i].status, CqStatus::OK);
      ASSERT_EQ(c[i].index, done);
      ASSERT_EQ(c[i].user_data, done);
    }
  }
  EXPECT_EQ(q->in_flight(), 0u);
}

TEST_F(NpuDma, PeerDeviceHbmOverTheFabric) {
  auto peer = open(1);
  ASSERT_NE(peer, nullptr);
  ASSERT_NE(peer->hbm(), nullptr);
  const size_t len = 256 * 1024;
  uint64_t ia;
  uint8_t* a = host(len, &ia);
  for (size_t i = 0; i < len; ++i) a[i] = static_cast<uint8_t>(i * 7);
  npu::Mapping mp;
  ASSERT_TRUE(dev_->map_peer_hbm(1, 4096, len, npu::access::RW, &mp));
  maps_.push_back(mp);
  ASSERT_EQ(q_->copy(ia, mp.iova, len, 1), Code::ok);
  run_all_ok();
  EXPECT_EQ(std::memcmp(peer->hbm() + 4096, a, len), 0) << "peer's BAR2 does not show the bytes";
}

TEST_F(NpuDma, InterruptDrivenWait) {
  std::unique_ptr<npu::DmaQueue> q;
  ASSERT_TRUE(dev_->create_queue(4, true, &q));
  uint64_t ia, ib;
  uint8_t* a = host(4096, &ia);
  uint8_t* b = host(4096, &ib);
  std::memset(a, 9, 4096);
  for (int round = 0; round < 20; ++round) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // let the engine fall asleep
    ASSERT_EQ(q->copy(ia, ib, 4096, round, abi::desc_flag::INTERRUPT), Code::ok);
    CqStatus e;
    ASSERT_TRUE(q->drain(Deadline::after_ms(10000), &e));
    ASSERT_EQ(e, CqStatus::OK);
  }
  EXPECT_EQ(b[100], 9);
  // Each round found the engine asleep (spin 50 us << 2 ms), so it rang.
  EXPECT_GE(q->doorbells(), 1u);
  // And the completions arrived as MSI-X interrupts, not only by the wait's
  // bounded re-poll.
  EXPECT_GE(q->interrupts(), 1u);
}

TEST_F(NpuDma, FaultInjectionFailCorruptStall) {
  NEEDS_SIM_CONTROL();
  uint64_t ia, ib;
  uint8_t* a = host(65536, &ia);
  uint8_t* b = host(65536, &ib);
  for (int i = 0; i < 65536; ++i) a[i] = static_cast<uint8_t>(i);
  ASSERT_EQ(sim_->control("fail 0 2"), "ok");
  for (CqStatus want : {CqStatus::INJECTED, CqStatus::INJECTED, CqStatus::OK}) {
    ASSERT_EQ(q_->copy(ia, ib, 65536, 1), Code::ok);
    EXPECT_EQ(run_one(), want);
  }
  ASSERT_EQ(sim_->control("corrupt 0 1"), "ok");
  std::memset(b, 0, 65536);
  ASSERT_EQ(q_->copy(ia, ib, 65536, 2), Code::ok);
  EXPECT_EQ(run_one(), CqStatus::OK) << "corruption is silent";
  EXPECT_NE(std::memcmp(a, b, 65536), 0) << "the corrupted copy must differ so tests can catch it";
  ASSERT_EQ(sim_->control("stall 0 400"), "ok");
  ASSERT_EQ(q_->copy(ia, ib, 65536, 3), Code::ok);
  q_->submit();
  EXPECT_EQ(q_->wait(Deadline::after_ms(50)), Code::timeout) << "a stalled engine must not complete";
  EXPECT_EQ(run_one(), CqStatus::OK) << "the stall ends";
  EXPECT_EQ(std::memcmp(a, b, 65536), 0);
  EXPECT_EQ(sim_->control("bogus 0 1").rfind("error", 0), 0u);
  EXPECT_EQ(sim_->control("fail 9 1").rfind("error", 0), 0u);
}

TEST_F(NpuDma, AttRejectsBadEntries) {
  auto att = [&](uint32_t index, uint64_t iova, uint64_t len, uint64_t target, uint32_t flags) {
    return att_write(index, iova, len, target, flags);
  };
  const uint32_t last = dev_->info().num_att - 1;  // the HAL allocates from 0 up
  using namespace abi;
  EXPECT_EQ(att(dev_->info().num_att, 0x1000, 4096, 0, att::READ | att::KIND_HBM), att_status::BAD_INDEX);
  EXPECT_EQ(att(last, 0x1000, 0, 0, att::READ | att::KIND_HBM), att_status::BAD_RANGE);
  EXPECT_EQ(att(last, 0x1000, 4096, dev_->info().hbm_size, att::READ | att::KIND_HBM), att_status::BAD_RANGE);
  EXPECT_EQ(att(last, 0x1000, 4096, 0, att::KIND_HBM), att_status::BAD_FLAGS) << "no rights";
  EXPECT_EQ(att(last, 0x1000, 4096, 0, att::READ | (7u << att::KIND_SHIFT)), att_status::BAD_FLAGS);
  EXPECT_EQ(att(last, 0x1000, 4096, 0, att::READ | att::KIND_PEER_HBM | (5u << att::PEER_SHIFT)),
            att_status::BAD_FLAGS) << "no such peer";
  EXPECT_EQ(att(last, 0x1000, 4096, 0xdead0000, att::READ | att::KIND_HOST), att_status::NOT_MAPPED);
  const uint64_t used = hbm(0, 4096);
  EXPECT_EQ(att(last, used, 4096, 0, att::READ | att::KIND_HBM), att_status::OVERLAP);
  EXPECT_EQ(att(last, 0x1000, 4096, 0, att::READ | att::KIND_HBM), att_status::OK);
  EXPECT_TRUE(dev_->link().write32(reg::ATT_CMD, att_cmd::CLEAR));
}

// ABI 1.2 (cap::ATT_SPAN, §6.4): a data operand may run through adjacent
// entries whose boundary is 4 KiB-aligned, translated piece by piece; a
// boundary elsewhere, a hole or a piece without the right faults, nothing moved.
TEST_F(NpuDma, OperandsRunThroughAdjacentAttEntries) {
  if ((dev_->info().caps & abi::cap::ATT_SPAN) == 0) GTEST_SKIP() << "device without ATT_SPAN";
  driver::Link& l = dev_->link();
  const uint32_t last = dev_->info().num_att - 1;  // the HAL allocates from 0 up
  auto att = [&](uint32_t index, uint64_t iova, uint64_t len, uint64_t target, uint32_t flags) {
    EXPECT_EQ(att_write(index, iova, len, target, flags), abi::att_status::OK);
  };
  using namespace abi;
  const uint32_t rw = att::READ | att::WRITE | att::KIND_HBM;
  // X: two 8 KiB entries over HBM pieces far apart.
  const uint64_t X = uint64_t{1} << 44, A = 0x10000, B = 0x40000;
  att(last, X, 8192, A, rw);
  att(last - 1, X + 8192, 8192, B, rw);
  // Y: a boundary that is not 4 KiB-aligned. Z: a hole. W: the second piece read-only.
  const uint64_t Y = X + (1ull << 30), Z = Y + (1ull << 30), W = Z + (1ull << 30);
  att(last - 2, Y, 6000, 0x80000, rw);
  att(last - 3, Y + 6000, 6000, 0x90000, rw);
  att(last - 4, Z, 4096, 0xa0000, rw);
  att(last - 5, Z + 8192, 4096, 0xa2000, rw);
  att(last - 6, W, 4096, 0xb0000, rw);
  att(last - 7, W + 4096, 4096, 0xb1000, att::READ | att::KIND_HBM);
  constexpr uint8_t F = abi::desc_flag::FENCE;  // each waits for the one before
  uint64_t src_iova = 0, dst_iova = 0;
  constexpr size_t kLen = 8192;
  uint8_t* src = host(kLen, &src_iova);
  uint8_t* dst = host(kLen, &dst_iova);
  for (size_t i = 0; i < kLen; ++i) src[i] = static_cast<uint8_t>(i * 13 + 5);
  // COPY host -> X+4096 (4 KiB in A's second page, 4 KiB in B's first) and back.
  ASSERT_EQ(q_->copy(src_iova, X + 4096, kLen, 1), Code::ok);
  ASSERT_EQ(q_->copy(X + 4096, dst_iova, kLen, 2, F), Code::ok);
  run_all_ok();
  EXPECT_EQ(std::memcmp(dst, src, kLen), 0);
  EXPECT_EQ(std::memcmp(dev_->hbm() + A + 4096, src, 4096), 0) << "first half in piece A";
  EXPECT_EQ(std::memcmp(dev_->hbm() + B, src + 4096, 4096), 0) << "second half in piece B";
  // FILL across the boundary keeps the pattern's phase.
  ASSERT_EQ(q_->fill(X + 8192 - 5, 11, 0x0807060504030201ull, 3), Code::ok);
  run_all_ok();
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(dev_->hbm()[A + 8192 - 5 + i], 1 + i) << i;
  for (size_t i = 5; i < 11; ++i) EXPECT_EQ(dev_->hbm()[B + i - 5], 1 + i % 8) << i;
  // REDUCE (fp32 sum) across it.
  auto* f = reinterpret_cast<float*>(src);
  for (size_t i = 0; i < kLen / 4; ++i) f[i] = 1.5f;
  ASSERT_EQ(q_->copy(src_iova, X + 4096, kLen, 4), Code::ok);
  ASSERT_EQ(q_->reduce(src_iova, X + 4096, kLen, DType::FP32, RedOp::SUM, 5, F), Code::ok);
  ASSERT_EQ(q_->copy(X + 4096, dst_iova, kLen, 6, F), Code::ok);
  run_all_ok();
  auto* g = reinterpret_cast<const float*>(dst);
  for (size_t i = 0; i < kLen / 4; ++i) ASSERT_EQ(g[i], 3.0f) << i;
  // Refused, nothing moved.
  std::memset(dev_->hbm() + 0x80000, 0xee, 0x20000);
  ASSERT_EQ(q_->copy(src_iova, Y + 4000, 4000, 7), Code::ok);
  EXPECT_EQ(run_one(), CqStatus::DST_FAULT) << "a boundary that is not 4 KiB-aligned";
  ASSERT_EQ(q_->copy(Z + 2048, dst_iova, 4096, 8), Code::ok);
  EXPECT_EQ(run_one(), CqStatus::SRC_FAULT) << "a hole between the entries";
  ASSERT_EQ(q_->copy(src_iova, W + 2048, 4096, 9), Code::ok);
  EXPECT_EQ(run_one(), CqStatus::DST_PERM) << "the second piece is read-only";
  for (size_t i = 0; i < 0x20000; ++i) ASSERT_EQ(dev_->hbm()[0x80000 + i], 0xee) << "moved by a refused descriptor";
  ASSERT_EQ(q_->copy(W + 2048, dst_iova, 4096, 10), Code::ok);
  EXPECT_EQ(run_one(), CqStatus::OK) << "reading through it is allowed";
  for (uint32_t i = last - 7; i <= last; ++i) {
    EXPECT_TRUE(l.write32(reg::ATT_INDEX, i));
    EXPECT_TRUE(l.write32(reg::ATT_CMD, att_cmd::CLEAR));
  }
}

TEST_F(NpuDma, QueueEnableRefusesBadConfig) {
  driver::Link& l = dev_->link();
  const uint32_t qi = dev_->info().num_queues - 1;  // not handed out by the HAL here
  auto enable = [&](uint64_t sq, uint64_t cq, uint64_t sh, uint32_t log2, uint32_t vec) {
    using namespace abi::reg;
    EXPECT_TRUE(l.write32(queue(qi, Q_CTRL), 0));
    EXPECT_TRUE(l.write64(queue(qi, Q_SQ_BASE), sq));
    EXPECT_TRUE(l.write64(queue(qi, Q_CQ_BASE), cq));
    EXPECT_TRUE(l.write64(queue(qi, Q_SHADOW), sh));
    EXPECT_TRUE(l.write32(queue(qi, Q_SIZE_LOG2), log2));
    EXPECT_TRUE(l.write32(queue(qi, Q_MSIX), vec));
    EXPECT_TRUE(l.write32(queue(qi, Q_CTRL), abi::qctrl::ENABLE));
    uint32_t st = 0;
    EXPECT_TRUE(l.read32(queue(qi, Q_STATUS), &st));
    if (st & abi::qstatus::ENABLED) return abi::QueueError::none;
    EXPECT_NE(st & abi::qstatus::ERROR, 0u);
    return static_cast<abi::QueueError>((st >> abi::qstatus::ERROR_SHIFT) & 0xff);
  };
  uint64_t io;
  uint8_t* mem = host(65536, &io);
  const uint64_t sq = io, cq = io + 16384, sh = io + 32768;
  auto* shadow = reinterpret_cast<abi::QueueShadow*>(mem + 32768);
  using QE = abi::QueueError;
  EXPECT_EQ(enable(sq, cq, sh, 0, abi::kNoVector), QE::bad_size);
  EXPECT_EQ(enable(sq, cq, sh, 30, abi::kNoVector), QE::bad_size);
  EXPECT_EQ(enable(sq + 8, cq, sh, 4, abi::kNoVector), QE::misaligned);
  EXPECT_EQ(enable(0x40000, cq, sh, 4, abi::kNoVector), QE::sq_unmapped);
  EXPECT_EQ(enable(sq, 0x40000, sh, 4, abi::kNoVector), QE::cq_unmapped);
  EXPECT_EQ(enable(sq, cq, io + 65536 - 64, 4, abi::kNoVector), QE::shadow_unmapped);
  EXPECT_EQ(enable(sq, cq, sh, 4, 1000), QE::bad_vector);
  shadow->sq_tail.value.store(5);
  EXPECT_EQ(enable(sq, cq, sh, 4, abi::kNoVector), QE::dirty_shadow);
  shadow->sq_tail.value.store(0);
  EXPECT_EQ(enable(sq, cq, sh, 4, abi::kNoVector), QE::none);
  // A tail more than one ring ahead stops the queue and says why.
  shadow->sq_tail.value.store(1000, std::memory_order_seq_cst);
  (void)l.write32(abi::reg::doorbell(qi), 1000);
  Deadline dl = Deadline::after_ms(5000);
  uint32_t st = 0;
  do {
    ASSERT_TRUE(l.read32(abi::reg::queue(qi, abi::reg::Q_STATUS), &st));
    ASSERT_FALSE(dl.expired()) << "bad tail not detected";
  } while (st & abi::qstatus::ENABLED);
  EXPECT_EQ((st >> abi::qstatus::ERROR_SHIFT) & 0xff, static_cast<uint32_t>(QE::bad_tail));
  npu::ErrorLog el;
  ASSERT_TRUE(dev_->error_log(&el));
  EXPECT_EQ(el.last_queue, qi);
  EXPECT_EQ(el.last_addr, 1000u) << "ERR_LOG_ADDR holds the bad tail";
  EXPECT_TRUE(l.write32(abi::reg::queue(qi, abi::reg::Q_CTRL), 0));
}

TEST_F(NpuDma, DisablingAQueueAbortsWhatTheEngineHasNotTaken) {
  NEEDS_SIM_CONTROL();
  uint64_t ia, ib;
  host(4096, &ia);
  host(4096, &ib);
  ASSERT_EQ(sim_->control("stall 0 2000"), "ok");
  std::this_thread::sleep_for(std::chrono::milliseconds(30));  // the engine sees the stall first
  for (uint64_t i = 0; i < 5; ++i) ASSERT_EQ(q_->copy(ia, ib, 64, 100 + i), Code::ok);
  q_->submit();
  ASSERT_TRUE(dev_->link().write32(abi::reg::queue(q_->id(), abi::reg::Q_CTRL), 0));
  npu::Completion c[8];
  uint32_t n = 0;
  Deadline dl = Deadline::after_ms(1000);
  while (n < 5 && !dl.expired()) n += q_->poll({c + n, 8 - n});
  ASSERT_EQ(n, 5u) << "every pending descriptor completes when its queue is disabled";
  for (uint32_t i = 0; i < 5; ++i) {
    EXPECT_EQ(c[i].status, CqStatus::ABORTED);
    EXPECT_EQ(c[i].user_data, 100 + i);
  }
  ASSERT_EQ(sim_->control("clear 0"), "ok");
}

TEST_F(NpuDma, NoDmaWithoutBusMastering) {
  uint64_t ia, ib;
  uint8_t* a = host(4096, &ia);
  uint8_t* b = host(4096, &ib);
  std::memset(a, 5, 4096);
  const uint16_t off = 0x0002, on = 0x0006;
  ASSERT_TRUE(dev_->link().write(7, 0x04, &off, 2));
  ASSERT_EQ(q_->copy(ia, ib, 4096, 1), Code::ok);
  q_->submit();
  EXPECT_EQ(q_->wait(Deadline::after_ms(100)), Code::timeout) << "the engine moved data with bus mastering off";
  EXPECT_EQ(b[0], 0);
  ASSERT_TRUE(dev_->link().write(7, 0x04, &on, 2));
  ASSERT_EQ(q_->wait(Deadline::after_ms(5000)), Code::ok);
  npu::Completion c;
  ASSERT_EQ(q_->poll({&c, 1}), 1u);
  EXPECT_EQ(c.status, CqStatus::OK);
  EXPECT_EQ(b[4095], 5);
}

TEST_F(NpuDma, ClientKilledMidOperationLeavesTheSimHealthy) {
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // Child: open device 1, start a pile of 1 MiB copies, die without cleanup.
    std::unique_ptr<driver::Link> link;
    std::unique_ptr<npu::Device> dev;
    if (!open_link(1, &link) || !npu::Device::open(std::move(link), &dev)) ::_exit(3);
    std::unique_ptr<npu::DmaQueue> q;
    driver::DmaBuffer buf;
    npu::Mapping m;
    if (!dev->create_queue(6, false, &q) || !driver::DmaBuffer::allocate(2 << 20, -1, &buf) ||
        !dev->map_buffer(buf, npu::access::RW, &m))
      ::_exit(4);
    for (int i = 0; i < 64; ++i) (void)q->copy(m.iova, m.iova + (1 << 20), 1 << 20, i);
    q->submit();
    ::kill(::getpid(), SIGKILL);
    ::_exit(5);
  }
  int st = 0;
  ASSERT_EQ(::waitpid(pid, &st, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(st)) << "child failed before it could die mid-operation: exit " << WEXITSTATUS(st);
  auto again = open(1);
  ASSERT_NE(again, nullptr) << "device 1 unusable after its client was killed";
  std::unique_ptr<npu::DmaQueue> q;
  ASSERT_TRUE(again->create_queue(4, false, &q));
  if (sim_ != nullptr) {
    EXPECT_TRUE(sim_->alive());
    EXPECT_EQ(sim_->control("ping"), "ok");
  }
}

}  // namespace
}  // namespace hcomm
