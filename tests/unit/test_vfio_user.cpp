// vfio-user transport, both ends: an in-process sim::Device behind a
// VfioUserServer on a temp dir, reached by the driver's vfio-user Link, plus
// a raw-socket suite that sends malformed messages and checks that each gets
// the documented error reply or a dropped client, and that a fresh client
// still works afterwards.
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <linux/kcmp.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/fd.h"
#include "driver/link.h"
#include "driver/vfio_user_link.h"
#include "hal/abi/desc.h"
#include "hal/abi/regs.h"
#include "hal/abi/vfio_user.h"
#include "sim/device.h"
#include "sim/vfio_user_server.h"

namespace hcomm {
namespace {

namespace abi = hal::abi;
namespace vu = hal::abi::vfio_user;
namespace reg = hal::abi::reg;
using driver::Link;
using Ms = std::chrono::milliseconds;

constexpr int kServerIoTimeoutMs = 300;

std::string make_temp_dir() {
  char tmpl[] = "/tmp/hcomm-vu-XXXXXX";
  const char* d = ::mkdtemp(tmpl);
  return d != nullptr ? d : "";
}

size_t open_fd_count() {
  size_t n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return 0;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(d);
  return n - 1;  // the DIR's own fd
}

bool wait_until(const std::function<bool()>& pred, int timeout_ms) {
  auto end = std::chrono::steady_clock::now() + Ms(timeout_ms);
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(Ms(2));
  }
  return pred();
}

// True once every write end of the pipe whose read end is `rfd` is closed.
bool pipe_writers_closed(int rfd, int timeout_ms) {
  pollfd p{rfd, POLLIN, 0};
  if (::poll(&p, 1, timeout_ms) <= 0) return false;
  char c;
  return ::read(rfd, &c, 1) == 0;
}

struct Memfd {
  UniqueFd fd;
  uint8_t* p = nullptr;
  size_t len = 0;
  explicit Memfd(size_t n) : len(n) {
    fd.reset(::memfd_create("vu-test", MFD_CLOEXEC));
    if (!fd.valid() || ::ftruncate(fd.get(), static_cast<off_t>(n)) != 0) return;
    void* m = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (m != MAP_FAILED) p = static_cast<uint8_t*>(m);
  }
  ~Memfd() {
    if (p != nullptr) ::munmap(p, len);
  }
};

// ---- a raw vfio-user client for the wire tests ------------------------------------
class Raw {
 public:
  explicit Raw(const std::string& path) {
    _fd.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, path.c_str(), sizeof a.sun_path - 1);
    _connected = ::connect(_fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  }
  bool connected() const { return _connected; }
  int fd() const { return _fd.get(); }
  void close() { _fd.reset(); }

  bool send_bytes(const void* data, size_t len, const std::vector<int>& fds = {}) {
    iovec iov{const_cast<void*>(data), len};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    std::vector<uint8_t> cbuf;
    if (!fds.empty()) {
      cbuf.assign(CMSG_SPACE(sizeof(int) * fds.size()), 0);
      mh.msg_control = cbuf.data();
      mh.msg_controllen = cbuf.size();
      cmsghdr* c = CMSG_FIRSTHDR(&mh);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    return ::sendmsg(_fd.get(), &mh, MSG_NOSIGNAL) == static_cast<ssize_t>(len);
  }

  // A command with a correct header unless the caller overrides size/flags.
  bool send_cmd(uint16_t id, uint16_t cmd, const void* payload, size_t len, const std::vector<int>& fds = {},
                uint32_t flags = vu::msg_flag::TYPE_COMMAND, int64_t size_override = -1) {
    vu::Header h{};
    h.msg_id = id;
    h.command = cmd;
    h.msg_size = size_override >= 0 ? static_cast<uint32_t>(size_override)
                                     : static_cast<uint32_t>(sizeof h + len);
    h.flags = flags;
    std::vector<uint8_t> buf(sizeof h + len);
    std::memcpy(buf.data(), &h, sizeof h);
    if (len > 0) std::memcpy(buf.data() + sizeof h, payload, len);
    return send_bytes(buf.data(), buf.size(), fds);
  }
  template <typename T>
  bool send_cmd(uint16_t id, vu::Command cmd, const T& payload, const std::vector<int>& fds = {}) {
    return send_cmd(id, static_cast<uint16_t>(cmd), &payload, sizeof payload, fds);
  }

  enum class R { reply, eof, timeout };
  // One whole message from the server; fds it carried are owned by *fds.
  R recv(vu::Header* h, std::vector<uint8_t>* payload = nullptr, std::vector<UniqueFd>* fds = nullptr,
         int timeout_ms = 3000) {
    std::vector<uint8_t> all;
    size_t want = sizeof(vu::Header);
    auto end = std::chrono::steady_clock::now() + Ms(timeout_ms);
    while (all.size() < want) {
      int left = static_cast<int>(
          std::chrono::duration_cast<Ms>(end - std::chrono::steady_clock::now()).count());
      pollfd p{_fd.get(), POLLIN, 0};
      if (left <= 0 || ::poll(&p, 1, left) <= 0) return R::timeout;
      std::vector<uint8_t> chunk(want - all.size());
      uint8_t cbuf[CMSG_SPACE(sizeof(int) * 32)];
      iovec iov{chunk.data(), chunk.size()};
      msghdr mh{};
      mh.msg_iov = &iov;
      mh.msg_iovlen = 1;
      mh.msg_control = cbuf;
      mh.msg_controllen = sizeof cbuf;
      ssize_t n = ::recvmsg(_fd.get(), &mh, MSG_CMSG_CLOEXEC);
      if (n <= 0) return R::eof;
      for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c != nullptr; c = CMSG_NXTHDR(&mh, c)) {
        size_t cnt = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < cnt; ++i) {
          int f;
          std::memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof f);
          UniqueFd u(f);
          if (fds != nullptr) fds->push_back(std::move(u));
        }
      }
      all.insert(all.end(), chunk.begin(), chunk.begin() + n);
      if (all.size() == sizeof(vu::Header)) {
        std::memcpy(h, all.data(), sizeof *h);
        want = h->msg_size;
        if (want < sizeof(vu::Header)) return R::eof;
      }
    }
    if (payload != nullptr) payload->assign(all.begin() + sizeof(vu::Header), all.end());
    return R::reply;
  }

  // The server closed the connection (EOF) within timeout_ms.
  bool dropped(int timeout_ms = 3000) {
    auto end = std::chrono::steady_clock::now() + Ms(timeout_ms);
    for (;;) {
      int left = static_cast<int>(
          std::chrono::duration_cast<Ms>(end - std::chrono::steady_clock::now()).count());
      pollfd p{_fd.get(), POLLIN, 0};
      if (left <= 0 || ::poll(&p, 1, left) <= 0) return false;
      char buf[256];
      ssize_t n = ::recv(_fd.get(), buf, sizeof buf, 0);
      if (n <= 0) return true;  // EOF or reset
    }
  }

 private:
  UniqueFd _fd;
  bool _connected = false;
};

// ---- fixture: one device served on a temp dir ---------------------------------------
class VfioUserTest : public ::testing::Test {
 protected:
  void SetUp() override {
    _dir = make_temp_dir();
    ASSERT_FALSE(_dir.empty());
    _path = _dir + "/npu0.sock";
    sim::DeviceConfig cfg;
    cfg.hbm_size = 16ull << 20;
    cfg.num_queues = 4;
    auto dev = std::make_unique<sim::Device>(cfg, &_fabric);
    ASSERT_TRUE(dev->init().is_ok());
    _dev = dev.get();
    ASSERT_TRUE(_fabric.add(std::move(dev)).is_ok());
    sim::VfioUserServerOptions opts;
    opts.io_timeout_ms = kServerIoTimeoutMs;
    _server = std::make_unique<sim::VfioUserServer>(*_dev, _path, opts);
    Status st = _server->start();
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  void TearDown() override {
    if (_server) _server->stop();
    EXPECT_FALSE(std::filesystem::exists(_path)) << "stop() removes the socket";
    _server.reset();
    std::error_code ec;
    std::filesystem::remove_all(_dir, ec);
  }

  std::unique_ptr<Link> open_link(int timeout_ms = 5000) {
    std::unique_ptr<Link> l;
    Status st = driver::open_vfio_user(_path, &l, timeout_ms);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    return l;
  }

  // Program ATT entry `idx` and return ATT_STATUS.
  static uint32_t att_write(Link& l, uint32_t idx, uint64_t iova, uint64_t len, uint64_t target, uint32_t flags) {
    EXPECT_TRUE(l.write32(reg::ATT_INDEX, idx).is_ok());
    EXPECT_TRUE(l.write64(reg::ATT_IOVA, iova).is_ok());
    EXPECT_TRUE(l.write64(reg::ATT_LEN, len).is_ok());
    EXPECT_TRUE(l.write64(reg::ATT_TARGET, target).is_ok());
    EXPECT_TRUE(l.write32(reg::ATT_FLAGS, flags).is_ok());
    EXPECT_TRUE(l.write32(reg::ATT_CMD, abi::att_cmd::WRITE).is_ok());
    uint32_t st = 0xffffffff;
    EXPECT_TRUE(l.read32(reg::ATT_STATUS, &st).is_ok());
    return st;
  }

  // Wait until the server has finished with `n` clients.
  bool served(uint64_t n) {
    return wait_until([&] { return _server->clients_served() >= n; }, 5000);
  }

  std::string _dir, _path;
  sim::Fabric _fabric;  // owns the device; declared before the server so it outlives it
  sim::Device* _dev = nullptr;
  std::unique_ptr<sim::VfioUserServer> _server;
};

// ---- the Link end to end ------------------------------------------------------------

TEST_F(VfioUserTest, NegotiatesAndReportsRegions) {
  auto l = open_link();
  ASSERT_TRUE(l);
  EXPECT_STREQ(l->kind(), "vfio-user");
  EXPECT_EQ(l->location(), _path);
  EXPECT_EQ(_server->describe(), "vfio-user " + _path);

  driver::RegionInfo ri;
  ASSERT_TRUE(l->region_info(vu::kRegionBar0, &ri).is_ok());
  EXPECT_EQ(ri.size, abi::kBar0Size);
  EXPECT_TRUE(ri.readable && ri.writable);
  EXPECT_FALSE(ri.mmapable);  // trapped
  ASSERT_TRUE(l->region_info(vu::kRegionBar2, &ri).is_ok());
  EXPECT_EQ(ri.size, _dev->hbm_size());
  EXPECT_TRUE(ri.mmapable);
  ASSERT_TRUE(l->region_info(vu::kRegionConfig, &ri).is_ok());
  EXPECT_EQ(ri.size, 256u);
  EXPECT_FALSE(ri.mmapable);
  for (uint32_t i : {1u, 3u, 4u, 5u, 6u, 8u}) {
    ASSERT_TRUE(l->region_info(i, &ri).is_ok());
    EXPECT_EQ(ri.size, 0u) << "region " << i;
  }
  EXPECT_EQ(l->region_info(9, &ri).code(), Code::not_found);
  EXPECT_EQ(l->msix_count(), _dev->msix_count());

  void* p = nullptr;
  uint64_t sz = 0;
  EXPECT_EQ(l->map_region(vu::kRegionBar0, &p, &sz).code(), Code::unsupported);
}

TEST_F(VfioUserTest, ConfigSpaceIdentity) {
  auto l = open_link();
  ASSERT_TRUE(l);
  uint32_t id = 0;
  ASSERT_TRUE(l->read(vu::kRegionConfig, 0, &id, 4).is_ok());
  EXPECT_EQ(id, abi::kPciVendorId | (uint32_t{abi::kPciDeviceId} << 16));
  uint8_t all[256];
  ASSERT_TRUE(l->read(vu::kRegionConfig, 0, all, sizeof all).is_ok());
  EXPECT_EQ(std::memcmp(all, &id, 4), 0);
  EXPECT_EQ(l->read(vu::kRegionConfig, 255, all, 2).code(), Code::out_of_range);  // caught client-side
}

TEST_F(VfioUserTest, ScratchRegisterThroughBar0) {
  auto l = open_link();
  ASSERT_TRUE(l);
  ASSERT_TRUE(l->write32(reg::SCRATCH, 0xdeadbeef).is_ok());
  uint32_t v = 0;
  ASSERT_TRUE(l->read32(reg::SCRATCH, &v).is_ok());
  EXPECT_EQ(v, 0xdeadbeefu);
  uint32_t dv = 0;
  ASSERT_TRUE(_dev->bar0_read(reg::SCRATCH, &dv, 4).is_ok());
  EXPECT_EQ(dv, 0xdeadbeefu) << "the device itself holds the value";
  uint64_t hbm = 0;
  ASSERT_TRUE(l->read64(reg::HBM_SIZE, &hbm).is_ok());
  EXPECT_EQ(hbm, _dev->hbm_size());
  uint32_t ver = 0;
  ASSERT_TRUE(l->read32(reg::ABI_VERSION, &ver).is_ok());
  EXPECT_EQ(ver, abi::kAbiVersion);

  // A 2-byte BAR0 access is refused by the device: an error reply, and the
  // link stays usable.
  uint16_t half = 0;
  Status st = l->read(vu::kRegionBar0, reg::SCRATCH, &half, 2);
  EXPECT_EQ(st.code(), Code::invalid_argument) << st.to_string();
  ASSERT_TRUE(l->read32(reg::SCRATCH, &v).is_ok());
  EXPECT_EQ(v, 0xdeadbeefu);
}

TEST_F(VfioUserTest, HbmMmapIsTheDevicesMemory) {
  auto l = open_link();
  ASSERT_TRUE(l);
  void* p = nullptr;
  uint64_t sz = 0;
  ASSERT_TRUE(l->map_region(vu::kRegionBar2, &p, &sz).is_ok());
  ASSERT_NE(p, nullptr);
  ASSERT_EQ(sz, _dev->hbm_size());
  auto* hbm = static_cast<uint8_t*>(p);
  const uint64_t off = sz - 4096;
  for (int i = 0; i < 4096; ++i) hbm[off + i] = static_cast<uint8_t>(i * 7 + 1);
  EXPECT_EQ(std::memcmp(_dev->hbm() + off, hbm + off, 4096), 0);

  uint8_t pat[64];
  for (int i = 0; i < 64; ++i) pat[i] = static_cast<uint8_t>(0xa0 + i);
  ASSERT_TRUE(_dev->hbm_access(128, pat, sizeof pat, true).is_ok());
  EXPECT_EQ(std::memcmp(hbm + 128, pat, sizeof pat), 0);

  // The slow path (REGION_READ/WRITE on BAR2) sees the same bytes.
  uint8_t back[64] = {};
  ASSERT_TRUE(l->read(vu::kRegionBar2, 128, back, sizeof back).is_ok());
  EXPECT_EQ(std::memcmp(back, pat, sizeof pat), 0);
  uint8_t w[3] = {1, 2, 3};
  ASSERT_TRUE(l->write(vu::kRegionBar2, 1000, w, 3).is_ok());
  EXPECT_EQ(std::memcmp(_dev->hbm() + 1000, w, 3), 0);

  void* p2 = nullptr;
  ASSERT_TRUE(l->map_region(vu::kRegionBar2, &p2, &sz).is_ok());
  EXPECT_EQ(p2, p) << "one mapping per link";
}

TEST_F(VfioUserTest, DmaMapUnmapRoundTrip) {
  auto l = open_link();
  ASSERT_TRUE(l);
  Memfd mem(64 * 1024);
  ASSERT_NE(mem.p, nullptr);
  uint64_t bus = 0, bus2 = 0;
  ASSERT_TRUE(l->dma_map(mem.p, mem.len, mem.fd.get(), 0, driver::dma_prot::READ | driver::dma_prot::WRITE, &bus)
                  .is_ok());
  EXPECT_NE(bus, 0u);
  EXPECT_EQ(bus % 4096, 0u);
  // An odd length is mapped as whole pages; the next map does not overlap.
  ASSERT_TRUE(l->dma_map(mem.p, 100, mem.fd.get(), 4096, driver::dma_prot::READ, &bus2).is_ok());
  EXPECT_EQ(bus2 % 4096, 0u);
  EXPECT_TRUE(bus2 >= bus + mem.len || bus2 + 4096 <= bus);

  const uint32_t host_rw = abi::att::READ | abi::att::WRITE | abi::att::KIND_HOST;
  EXPECT_EQ(att_write(*l, 0, 0x100000, mem.len, bus, host_rw), abi::att_status::OK)
      << "the device sees the mapping";
  EXPECT_EQ(att_write(*l, 1, 0x200000, 4096, bus2, host_rw), abi::att_status::NOT_MAPPED)
      << "the second map is read-only";
  EXPECT_EQ(att_write(*l, 1, 0x200000, 4096, bus2, abi::att::READ | abi::att::KIND_HOST), abi::att_status::OK);

  ASSERT_TRUE(l->write32(reg::ATT_INDEX, 0).is_ok());
  ASSERT_TRUE(l->write32(reg::ATT_CMD, abi::att_cmd::CLEAR).is_ok());
  Status st = l->dma_unmap(bus, mem.len);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(att_write(*l, 0, 0x100000, mem.len, bus, host_rw), abi::att_status::NOT_MAPPED)
      << "unmapped memory is gone for the device";
  EXPECT_EQ(l->dma_unmap(bus, mem.len).code(), Code::not_found);
  EXPECT_EQ(l->dma_unmap(bus2, 8192).code(), Code::not_found) << "size must match the map";
  EXPECT_TRUE(l->dma_unmap(bus2, 100).is_ok());

  uint64_t b3;
  EXPECT_EQ(l->dma_map(mem.p, 4096, -1, 0, driver::dma_prot::READ, &b3).code(), Code::invalid_argument);
  EXPECT_EQ(l->dma_map(mem.p, 4096, mem.fd.get(), 100, driver::dma_prot::READ, &b3).code(), Code::invalid_argument);
  EXPECT_EQ(l->dma_map(mem.p, 4096, mem.fd.get(), 0, 0, &b3).code(), Code::invalid_argument);
  // The bus address space is reused after an unmap.
  ASSERT_TRUE(l->dma_map(mem.p, 4096, mem.fd.get(), 0, driver::dma_prot::READ, &b3).is_ok());
  EXPECT_EQ(b3, bus);
}

// Doorbell through the ioeventfd and completion interrupt through the MSI-X
// eventfd: one NOP descriptor end to end over the transport.
TEST_F(VfioUserTest, DoorbellIoeventfdAndMsixInterrupt) {
  auto l = open_link();
  ASSERT_TRUE(l);
  Memfd mem(64 * 1024);
  ASSERT_NE(mem.p, nullptr);
  uint64_t bus = 0;
  ASSERT_TRUE(l->dma_map(mem.p, mem.len, mem.fd.get(), 0, driver::dma_prot::READ | driver::dma_prot::WRITE, &bus)
                  .is_ok());
  const uint64_t iova = 0x40000000;
  ASSERT_EQ(att_write(*l, 0, iova, mem.len, bus, abi::att::READ | abi::att::WRITE | abi::att::KIND_HOST),
            abi::att_status::OK);
  auto* sq = reinterpret_cast<abi::SqEntry*>(mem.p);
  auto* cq = reinterpret_cast<abi::CqEntry*>(mem.p + 4096);
  auto* shadow = reinterpret_cast<abi::QueueShadow*>(mem.p + 8192);

  UniqueFd irq(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  ASSERT_TRUE(irq.valid());
  int fds[1] = {irq.get()};
  ASSERT_TRUE(l->set_msix(0, fds).is_ok());
  EXPECT_EQ(l->set_msix(l->msix_count(), fds).code(), Code::invalid_argument);

  ASSERT_TRUE(l->write64(reg::queue(0, reg::Q_SQ_BASE), iova).is_ok());
  ASSERT_TRUE(l->write64(reg::queue(0, reg::Q_CQ_BASE), iova + 4096).is_ok());
  ASSERT_TRUE(l->write64(reg::queue(0, reg::Q_SHADOW), iova + 8192).is_ok());
  ASSERT_TRUE(l->write32(reg::queue(0, reg::Q_SIZE_LOG2), 4).is_ok());
  ASSERT_TRUE(l->write32(reg::queue(0, reg::Q_MSIX), 0).is_ok());
  ASSERT_TRUE(l->write32(reg::CONTROL, abi::ctrl::ENABLE).is_ok());
  const uint16_t cmd = 0x0006;  // memory space + bus master: engines DMA only with bus mastering on
  ASSERT_TRUE(l->write(vu::kRegionConfig, 0x04, &cmd, sizeof cmd).is_ok());
  ASSERT_TRUE(l->write32(reg::queue(0, reg::Q_CTRL), abi::qctrl::ENABLE).is_ok());
  uint32_t qs = 0;
  ASSERT_TRUE(l->read32(reg::queue(0, reg::Q_STATUS), &qs).is_ok());
  ASSERT_EQ(qs & abi::qstatus::ENABLED, abi::qstatus::ENABLED) << "Q_STATUS " << qs;

  driver::Doorbell db;
  ASSERT_TRUE(l->doorbell(reg::doorbell(0), &db).is_ok());
  EXPECT_GE(db.eventfd, 0);
  EXPECT_EQ(db.mmio, nullptr);
  driver::Doorbell none;
  EXPECT_EQ(l->doorbell(reg::doorbell(0) + 4, &none).code(), Code::unsupported);

  auto submit_nop = [&](uint32_t index, uint64_t user_data) {
    abi::SqEntry e{};
    e.opcode = static_cast<uint8_t>(abi::Opcode::NOP);
    e.flags = abi::desc_flag::INTERRUPT;
    e.user_data = user_data;
    std::memcpy(&sq[index], &e, sizeof e);
    // seq_cst store = release + the full fence the §8 protocol asks for
    // (no bare fence: GCC's TSan rejects atomic_thread_fence).
    shadow->sq_tail.value.store(index + 1, std::memory_order_seq_cst);
    db.ring(index + 1);
  };
  auto wait_cqe = [&](uint32_t index) {
    return wait_until(
        [&] { return std::atomic_ref<uint16_t>(cq[index].info).load(std::memory_order_acquire) == abi::kCqPhase; },
        5000);
  };

  submit_nop(0, 0x1234);
  ASSERT_TRUE(wait_cqe(0));
  EXPECT_EQ(cq[0].user_data, 0x1234u);
  EXPECT_EQ(cq[0].status, static_cast<uint16_t>(abi::CqStatus::OK));
  pollfd p{irq.get(), POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 5000), 1) << "MSI-X vector 0 fired through the eventfd";
  uint64_t cnt = 0;
  ASSERT_EQ(::read(irq.get(), &cnt, sizeof cnt), static_cast<ssize_t>(sizeof cnt));
  EXPECT_GE(cnt, 1u);

  // Detach the vector: the next completion raises nothing.
  int detach[1] = {-1};
  ASSERT_TRUE(l->set_msix(0, detach).is_ok());
  shadow->cq_head.value.store(1, std::memory_order_release);
  submit_nop(1, 0x5678);
  ASSERT_TRUE(wait_cqe(1));
  EXPECT_EQ(cq[1].user_data, 0x5678u);
  EXPECT_EQ(::poll(&p, 1, 200), 0) << "detached vector stays quiet";
  EXPECT_EQ(_dev->completed(), 2u);
}

TEST_F(VfioUserTest, ResetThroughTransport) {
  auto l = open_link();
  ASSERT_TRUE(l);
  ASSERT_TRUE(l->write32(reg::SCRATCH, 77).is_ok());
  ASSERT_TRUE(l->reset().is_ok());
  uint32_t v = 1;
  ASSERT_TRUE(l->read32(reg::SCRATCH, &v).is_ok());
  EXPECT_EQ(v, 0u);
}

TEST_F(VfioUserTest, ClientGoneDropsItsResourcesAndNextClientWorks) {
  Memfd mem(8192);
  ASSERT_NE(mem.p, nullptr);
  uint64_t bus = 0;
  {
    auto l = open_link();
    ASSERT_TRUE(l);
    ASSERT_TRUE(l->write32(reg::SCRATCH, 5).is_ok());
    ASSERT_TRUE(l->dma_map(mem.p, mem.len, mem.fd.get(), 0, driver::dma_prot::READ, &bus).is_ok());
  }
  ASSERT_TRUE(served(1));
  EXPECT_EQ(_server->clients_dropped(), 0u) << "an orderly close is not a drop";
  auto l = open_link();
  ASSERT_TRUE(l);
  uint32_t v = 1;
  ASSERT_TRUE(l->read32(reg::SCRATCH, &v).is_ok());
  EXPECT_EQ(v, 0u) << "client_gone() reset the device";
  EXPECT_EQ(att_write(*l, 0, 0x100000, 4096, bus, abi::att::READ | abi::att::KIND_HOST), abi::att_status::NOT_MAPPED)
      << "the previous client's DMA map is gone";
}

TEST_F(VfioUserTest, ConcurrentCallersShareOneLink) {
  auto l = open_link();
  ASSERT_TRUE(l);
  std::atomic<int> bad{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        uint32_t id = 0;
        if (!l->read32(reg::ID, &id).is_ok() || id != (abi::kPciVendorId | (uint32_t{abi::kPciDeviceId} << 16)))
          bad.fetch_add(1);
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST_F(VfioUserTest, StopIsPromptWithAClientConnected) {
  auto l = open_link();
  ASSERT_TRUE(l);
  Raw stalled(_path);  // waits in the backlog behind `l`
  auto t0 = std::chrono::steady_clock::now();
  _server->stop();
  auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(took, Ms(1000));
  uint32_t v;
  Status st = l->read32(reg::ID, &v);
  EXPECT_EQ(st.code(), Code::peer_failure) << st.to_string();
  EXPECT_EQ(l->read32(reg::ID, &v).code(), Code::peer_failure) << "a broken link stays broken";
  _server.reset();
}

TEST_F(VfioUserTest, OneClientAtATime) {
  auto a = open_link();
  ASSERT_TRUE(a);
  std::unique_ptr<Link> b;
  Status st = driver::open_vfio_user(_path, &b, 300);
  EXPECT_EQ(st.code(), Code::timeout) << st.to_string();
  EXPECT_NE(st.message().find("one client at a time"), std::string::npos) << st.message();
  a.reset();
  auto c = open_link();
  ASSERT_TRUE(c) << "served once the first client left";
}

TEST_F(VfioUserTest, SocketPathSafety) {
  // A live server's socket is not stolen.
  sim::VfioUserServer twin(*_dev, _path);
  EXPECT_EQ(twin.start().code(), Code::invalid_argument);
  twin.stop();
  EXPECT_TRUE(std::filesystem::exists(_path)) << "the failed twin left the live socket alone";
  // A file that is not a socket is never deleted.
  const std::string plain = _dir + "/plain";
  { UniqueFd f(::open(plain.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600)); }
  sim::VfioUserServer on_file(*_dev, plain);
  EXPECT_EQ(on_file.start().code(), Code::invalid_argument);
  EXPECT_TRUE(std::filesystem::exists(plain));
  // A stale socket (its server died without unlinking) is replaced.
  const std::string stale = _dir + "/stale.sock";
  {
    UniqueFd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, stale.c_str(), sizeof a.sun_path - 1);
    ASSERT_EQ(::bind(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  }
  _server->stop();  // one server per device at a time
  sim::VfioUserServer fresh(*_dev, stale);
  Status st = fresh.start();
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  std::unique_ptr<Link> l;
  st = driver::open_vfio_user(stale, &l, 2000);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  l.reset();
  fresh.stop();
  EXPECT_FALSE(std::filesystem::exists(stale));
}

TEST_F(VfioUserTest, StopIsPromptWithAClientMidMessage) {
  Raw r(_path);
  ASSERT_TRUE(r.connected());
  vu::Header h{1, static_cast<uint16_t>(vu::Command::VERSION), 64, 0, 0};
  ASSERT_TRUE(r.send_bytes(&h, sizeof h));  // and never the rest
  std::this_thread::sleep_for(Ms(20));
  auto t0 = std::chrono::steady_clock::now();
  _server->stop();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, Ms(kServerIoTimeoutMs));
  EXPECT_TRUE(r.dropped(1000));
}

// ---- the client against misbehaving servers ---------------------------------------------

class FakeServer {
 public:
  FakeServer(const std::string& path, std::function<void(int)> body) : _path(path) {
    _lfd.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, path.c_str(), sizeof a.sun_path - 1);
    ok = ::bind(_lfd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && ::listen(_lfd.get(), 1) == 0;
    if (ok) {
      _t = std::thread([this, body] {
        pollfd p{_lfd.get(), POLLIN, 0};
        if (::poll(&p, 1, 5000) <= 0) return;
        UniqueFd c(::accept4(_lfd.get(), nullptr, nullptr, SOCK_CLOEXEC));
        if (c.valid()) body(c.get());
      });
    }
  }
  ~FakeServer() {
    if (_t.joinable()) _t.join();
    ::unlink(_path.c_str());
  }
  bool ok = false;

 private:
  std::string _path;
  UniqueFd _lfd;
  std::thread _t;
};

// Read one request header + payload (blocking, bounded).
bool read_request(int fd, vu::Header* h) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, 3000) <= 0) return false;
  if (::recv(fd, h, sizeof *h, MSG_WAITALL) != static_cast<ssize_t>(sizeof *h)) return false;
  std::vector<uint8_t> rest(h->msg_size - sizeof *h);
  return rest.empty() || ::recv(fd, rest.data(), rest.size(), MSG_WAITALL) == static_cast<ssize_t>(rest.size());
}

class VfioUserClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    _dir = make_temp_dir();
    ASSERT_FALSE(_dir.empty());
    _path = _dir + "/fake.sock";
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(_dir, ec);
  }
  std::string _dir, _path;
};

TEST_F(VfioUserClientTest, MissingSocketIsNotFound) {
  std::unique_ptr<Link> l;
  EXPECT_EQ(driver::open_vfio_user(_path, &l, 500).code(), Code::not_found);
  EXPECT_FALSE(l);
  EXPECT_EQ(driver::open_vfio_user("", &l, 500).code(), Code::invalid_argument);
}

TEST_F(VfioUserClientTest, SilentServerTimesOut) {
  FakeServer fs(_path, [](int fd) {
    vu::Header h;
    read_request(fd, &h);
    std::this_thread::sleep_for(Ms(600));  // never answers
  });
  ASSERT_TRUE(fs.ok);
  std::unique_ptr<Link> l;
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(driver::open_vfio_user(_path, &l, 200).code(), Code::timeout);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, Ms(550));
}

TEST_F(VfioUserClientTest, ServerHangupIsPeerFailure) {
  FakeServer fs(_path, [](int fd) {
    vu::Header h;
    read_request(fd, &h);
  });
  ASSERT_TRUE(fs.ok);
  std::unique_ptr<Link> l;
  EXPECT_EQ(driver::open_vfio_user(_path, &l, 2000).code(), Code::peer_failure);
}

TEST_F(VfioUserClientTest, MismatchedMsgIdIsProtocolError) {
  FakeServer fs(_path, [](int fd) {
    vu::Header h;
    if (!read_request(fd, &h)) return;
    vu::Header r{static_cast<uint16_t>(h.msg_id + 1), h.command, sizeof r, vu::msg_flag::TYPE_REPLY, 0};
    ssize_t n = ::send(fd, &r, sizeof r, MSG_NOSIGNAL);
    (void)n;
  });
  ASSERT_TRUE(fs.ok);
  std::unique_ptr<Link> l;
  Status st = driver::open_vfio_user(_path, &l, 2000);
  EXPECT_EQ(st.code(), Code::protocol_error);
  EXPECT_NE(st.message().find("msg_id"), std::string::npos) << st.message();
}

TEST_F(VfioUserClientTest, OversizedReplyIsProtocolError) {
  FakeServer fs(_path, [](int fd) {
    vu::Header h;
    if (!read_request(fd, &h)) return;
    vu::Header r{h.msg_id, h.command, vu::kMaxMsgSize + 1, vu::msg_flag::TYPE_REPLY, 0};
    ssize_t n = ::send(fd, &r, sizeof r, MSG_NOSIGNAL);
    (void)n;
  });
  ASSERT_TRUE(fs.ok);
  std::unique_ptr<Link> l;
  EXPECT_EQ(driver::open_vfio_user(_path, &l, 2000).code(), Code::protocol_error);
}

TEST_F(VfioUserClientTest, ErrorReplyCarriesErrno) {
  FakeServer fs(_path, [](int fd) {
    vu::Header h;
    if (!read_request(fd, &h)) return;
    vu::Header r{h.msg_id, h.command, sizeof r, vu::msg_flag::TYPE_REPLY | vu::msg_flag::ERROR, ENOTSUP};
    ssize_t n = ::send(fd, &r, sizeof r, MSG_NOSIGNAL);
    (void)n;
  });
  ASSERT_TRUE(fs.ok);
  std::unique_ptr<Link> l;
  Status st = driver::open_vfio_user(_path, &l, 2000);
  EXPECT_EQ(st.code(), Code::unsupported);
  EXPECT_NE(st.message().find("VERSION"), std::string::npos) << st.message();
}

// ---- malformed messages on a raw socket -----------------------------------------------

class VfioUserWireTest : public VfioUserTest {
 protected:
  void TearDown() override {
    // Whatever the raw client did, a fresh client gets a working device.
    _raw.reset();
    if (_server) {
      auto l = open_link();
      ASSERT_TRUE(l) << "a fresh client still works";
      uint32_t id = 0;
      ASSERT_TRUE(l->read32(reg::ID, &id).is_ok());
      EXPECT_EQ(id, abi::kPciVendorId | (uint32_t{abi::kPciDeviceId} << 16));
    }
    VfioUserTest::TearDown();
  }

  Raw& raw() {
    if (!_raw) _raw = std::make_unique<Raw>(_path);
    return *_raw;
  }
  void negotiate() {
    std::string v("\0\0\1\0", 4);
    v += "{\"capabilities\":{\"max_msg_fds\":16,\"max_data_xfer_size\":1048576}}";
    v.push_back('\0');
    ASSERT_TRUE(raw().send_cmd(1, static_cast<uint16_t>(vu::Command::VERSION), v.data(), v.size()));
    vu::Header h;
    std::vector<uint8_t> pl;
    ASSERT_EQ(raw().recv(&h, &pl), Raw::R::reply);
    ASSERT_EQ(h.flags & vu::msg_flag::ERROR, 0u);
    ASSERT_GE(pl.size(), sizeof(vu::Version));
  }
  // Send a command; expect an error reply with `err` and no payload.
  void expect_error(uint16_t cmd, const void* payload, size_t len, uint32_t err, const std::vector<int>& fds = {}) {
    static uint16_t id = 100;
    const uint16_t my = id++;
    ASSERT_TRUE(raw().send_cmd(my, cmd, payload, len, fds));
    vu::Header h{};
    std::vector<uint8_t> pl;
    std::vector<UniqueFd> rfds;
    ASSERT_EQ(raw().recv(&h, &pl, &rfds), Raw::R::reply) << "command " << cmd;
    EXPECT_EQ(h.msg_id, my);
    EXPECT_EQ(h.command, cmd);
    EXPECT_EQ(h.flags & vu::msg_flag::TYPE_MASK, vu::msg_flag::TYPE_REPLY);
    EXPECT_NE(h.flags & vu::msg_flag::ERROR, 0u) << "command " << cmd;
    EXPECT_EQ(h.error_no, err) << "command " << cmd << ": " << std::strerror(static_cast<int>(h.error_no));
    EXPECT_TRUE(pl.empty());
    EXPECT_TRUE(rfds.empty());
  }
  template <typename T>
  void expect_error(vu::Command cmd, const T& payload, uint32_t err, const std::vector<int>& fds = {}) {
    expect_error(static_cast<uint16_t>(cmd), &payload, sizeof payload, err, fds);
  }
  // Send a command; expect success. Returns the payload.
  std::vector<uint8_t> expect_ok(uint16_t cmd, const void* payload, size_t len, const std::vector<int>& fds = {},
                                 std::vector<UniqueFd>* rfds = nullptr) {
    std::vector<uint8_t> pl;
    EXPECT_TRUE(raw().send_cmd(7, cmd, payload, len, fds));
    vu::Header h{};
    EXPECT_EQ(raw().recv(&h, &pl, rfds), Raw::R::reply) << "command " << cmd;
    EXPECT_EQ(h.flags & vu::msg_flag::ERROR, 0u) << "command " << cmd << " errno " << h.error_no;
    return pl;
  }
  template <typename T>
  std::vector<uint8_t> expect_ok(vu::Command cmd, const T& payload, const std::vector<int>& fds = {},
                                 std::vector<UniqueFd>* rfds = nullptr) {
    return expect_ok(static_cast<uint16_t>(cmd), &payload, sizeof payload, fds, rfds);
  }
  void expect_alive() {
    vu::DeviceInfo di{sizeof di, 0, 0, 0};
    auto pl = expect_ok(vu::Command::DEVICE_GET_INFO, di);
    ASSERT_EQ(pl.size(), sizeof di);
    std::memcpy(&di, pl.data(), sizeof di);
    EXPECT_EQ(di.num_regions, vu::kNumRegions);
    EXPECT_NE(di.flags & VFIO_DEVICE_FLAGS_PCI, 0u);
    EXPECT_NE(di.flags & VFIO_DEVICE_FLAGS_RESET, 0u);
  }
  void expect_dropped() {
    EXPECT_TRUE(raw().dropped()) << "the server drops the client";
    EXPECT_TRUE(wait_until([&] { return _server->clients_dropped() >= 1; }, 3000));
  }

  std::unique_ptr<Raw> _raw;
};

TEST_F(VfioUserWireTest, SizeSmallerThanHeaderDropsClient) {
  negotiate();
  ASSERT_TRUE(raw().send_cmd(2, static_cast<uint16_t>(vu::Command::DEVICE_GET_INFO), nullptr, 0, {},
                             vu::msg_flag::TYPE_COMMAND, 8));
  expect_dropped();
}

TEST_F(VfioUserWireTest, OversizedMessageDropsClient) {
  negotiate();
  ASSERT_TRUE(raw().send_cmd(2, static_cast<uint16_t>(vu::Command::REGION_WRITE), nullptr, 0, {},
                             vu::msg_flag::TYPE_COMMAND, int64_t{vu::kMaxMsgSize} + 1));
  expect_dropped();
}

TEST_F(VfioUserWireTest, ReplyTypeOrReservedFlagsFromClientDropsClient) {
  negotiate();
  vu::DeviceInfo di{sizeof di, 0, 0, 0};
  ASSERT_TRUE(raw().send_cmd(2, static_cast<uint16_t>(vu::Command::DEVICE_GET_INFO), &di, sizeof di, {},
                             vu::msg_flag::TYPE_REPLY));
  expect_dropped();
}

TEST_F(VfioUserWireTest, TruncatedMessageThenCloseDropsClient) {
  negotiate();
  vu::Header h{2, static_cast<uint16_t>(vu::Command::REGION_WRITE), 16 + 16 + 4, 0, 0};
  uint8_t partial[sizeof h + 10] = {};
  std::memcpy(partial, &h, sizeof h);
  ASSERT_TRUE(raw().send_bytes(partial, sizeof partial));
  ::shutdown(raw().fd(), SHUT_WR);
  expect_dropped();
}

TEST_F(VfioUserWireTest, TruncatedHeaderThenCloseDropsClient) {
  negotiate();
  uint8_t half[7] = {1, 0, 4, 0, 16, 0, 0};
  ASSERT_TRUE(raw().send_bytes(half, sizeof half));
  ::shutdown(raw().fd(), SHUT_WR);
  expect_dropped();
}

TEST_F(VfioUserWireTest, StallMidMessageIsDroppedAfterTimeout) {
  negotiate();
  vu::Header h{2, static_cast<uint16_t>(vu::Command::DEVICE_GET_INFO), 16 + 16, 0, 0};
  ASSERT_TRUE(raw().send_bytes(&h, sizeof h));  // payload never follows
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(raw().dropped(kServerIoTimeoutMs * 10));
  auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(took, Ms(kServerIoTimeoutMs / 2));
  EXPECT_LT(took, Ms(kServerIoTimeoutMs * 5));
  EXPECT_TRUE(wait_until([&] { return _server->clients_dropped() >= 1; }, 3000));
}

TEST_F(VfioUserWireTest, IdleClientIsNotDropped) {
  negotiate();
  std::this_thread::sleep_for(Ms(kServerIoTimeoutMs * 2));
  expect_alive();
}

TEST_F(VfioUserWireTest, UnknownCommandsGetEnosys) {
  negotiate();
  const uint16_t unknown[] = {0, 11, 12, 14, 15, 16, 99, 0xffff};
  for (uint16_t c : unknown) expect_error(c, nullptr, 0, ENOSYS);
  expect_alive();
}

TEST_F(VfioUserWireTest, VersionRules) {
  // Anything before VERSION is refused, and the connection stays.
  vu::DeviceInfo di{sizeof di, 0, 0, 0};
  expect_error(vu::Command::DEVICE_GET_INFO, di, EINVAL);
  expect_error(static_cast<uint16_t>(vu::Command::VERSION), "\0", 1, EINVAL);  // shorter than Version
  vu::Version major1{1, 0};
  expect_error(vu::Command::VERSION, major1, ENOTSUP);
  std::string no_nul("\0\0\1\0{}", 6);
  expect_error(static_cast<uint16_t>(vu::Command::VERSION), no_nul.data(), no_nul.size(), EINVAL);
  for (const char* bad : {"{", "{\"capabilities\":{\"max_msg_fds\":-1}}", "{\"capabilities\":{\"max_msg_fds\":1.5}}",
                          "{\"capabilities\":{\"max_msg_fds\":\"8\"}}", "[]", "{} x", "{\"a\":tru}"}) {
    std::string v("\0\0\1\0", 4);
    v += bad;
    v.push_back('\0');
    expect_error(static_cast<uint16_t>(vu::Command::VERSION), v.data(), v.size(), EINVAL);
  }
  std::string embedded("\0\0\1\0{}\0{}\0", 10);
  expect_error(static_cast<uint16_t>(vu::Command::VERSION), embedded.data(), embedded.size(), EINVAL);

  // QEMU-style capabilities (with objects we do not use) are accepted; the
  // reply never claims a newer minor than proposed.
  std::string q("\0\0\0\0", 4);
  q += "{\"capabilities\":{\"max_msg_fds\":8,\"max_data_xfer_size\":1048576,\"pgsizes\":4096,"
       "\"migration\":{\"pgsize\":4096,\"max_bitmap_size\":134217728},\"twin_socket\":{\"supported\":false}}}";
  q.push_back('\0');
  auto pl = expect_ok(static_cast<uint16_t>(vu::Command::VERSION), q.data(), q.size());
  ASSERT_GT(pl.size(), sizeof(vu::Version));
  vu::Version sv;
  std::memcpy(&sv, pl.data(), sizeof sv);
  EXPECT_EQ(sv.major, 0);
  EXPECT_EQ(sv.minor, 0);
  EXPECT_EQ(pl.back(), 0) << "JSON is NUL-terminated";
  vu::Caps caps;
  std::string_view json(reinterpret_cast<const char*>(pl.data()) + 4, pl.size() - 5);
  ASSERT_TRUE(vu::CapsParser::parse(json, &caps)) << json;
  EXPECT_EQ(caps.max_msg_fds, vu::kMaxMsgFds);
  EXPECT_EQ(caps.max_data_xfer_size, vu::kMaxDataXferSize);

  // Only once per connection.
  expect_error(static_cast<uint16_t>(vu::Command::VERSION), q.data(), q.size(), EINVAL);
  expect_alive();
}

TEST_F(VfioUserWireTest, WrongArgszOrPayloadSize) {
  negotiate();
  vu::DeviceInfo di{4, 0, 0, 0};
  expect_error(vu::Command::DEVICE_GET_INFO, di, EINVAL);
  uint8_t di_long[20] = {16};
  expect_error(static_cast<uint16_t>(vu::Command::DEVICE_GET_INFO), di_long, sizeof di_long, EINVAL);
  vu::RegionInfo ri{8, 0, 0, 0, 0, 0};
  expect_error(vu::Command::DEVICE_GET_REGION_INFO, ri, EINVAL);
  expect_error(static_cast<uint16_t>(vu::Command::DEVICE_GET_REGION_INFO), &ri, 16, EINVAL);  // short payload
  vu::IrqInfo ii{0, 0, vu::kIrqMsix, 0};
  expect_error(vu::Command::DEVICE_GET_IRQ_INFO, ii, EINVAL);
  vu::IrqSet is{24, VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER, vu::kIrqMsix, 0, 0};
  expect_error(vu::Command::DEVICE_SET_IRQS, is, EINVAL);
  vu::DmaUnmap du{8, 0, 0x100000, 4096};
  expect_error(vu::Command::DMA_UNMAP, du, EINVAL);
  vu::RegionIoFds io{8, 0, vu::kRegionBar0, 0};
  expect_error(vu::Command::DEVICE_GET_REGION_IO_FDS, io, EINVAL);
  uint32_t junk = 0;
  expect_error(static_cast<uint16_t>(vu::Command::DEVICE_RESET), &junk, sizeof junk, EINVAL);

  Memfd mem(4096);
  ASSERT_TRUE(mem.fd.valid());
  vu::DmaMap dm{40, vu::dma_flag::READ, 0, 0x100000, 4096};
  expect_error(vu::Command::DMA_MAP, dm, EINVAL, {mem.fd.get()});
  expect_alive();
}

TEST_F(VfioUserWireTest, RegionAccessBounds) {
  negotiate();
  struct Case {
    uint64_t offset;
    uint32_t region, count;
  };
  const Case reads[] = {
      {abi::kBar0Size - 4, vu::kRegionBar0, 8},  // runs past the end
      {abi::kBar0Size, vu::kRegionBar0, 4},
      {UINT64_MAX - 2, vu::kRegionBar0, 4},      // offset + count wraps
      {0, vu::kRegionBar0, 0},                   // empty
      {0, 1, 4},                                 // BAR1: size 0
      {0, 6, 4},                                 // ROM
      {0, vu::kNumRegions, 4},                   // no such region
      {0, 0xffffffff, 4},
      {250, vu::kRegionConfig, 8},
      {0, vu::kRegionBar2, vu::kMaxDataXferSize + 1},  // more than max_data_xfer_size
  };
  for (const Case& c : reads) {
    vu::RegionAccess ra{c.offset, c.region, c.count};
    expect_error(vu::Command::REGION_READ, ra, EINVAL);
  }
  // BAR0 wants aligned 4/8-byte accesses: the device refuses, the server
  // passes the refusal on.
  vu::RegionAccess odd{reg::SCRATCH + 1, vu::kRegionBar0, 4};
  expect_error(vu::Command::REGION_READ, odd, EINVAL);
  // The HBM end is reachable, one byte past it is not.
  vu::RegionAccess last{_dev->hbm_size() - 1, vu::kRegionBar2, 1};
  auto pl = expect_ok(vu::Command::REGION_READ, last);
  EXPECT_EQ(pl.size(), sizeof last + 1);
  vu::RegionAccess past{_dev->hbm_size(), vu::kRegionBar2, 1};
  expect_error(vu::Command::REGION_READ, past, EINVAL);

  // A READ with data, a WRITE whose data does not match count.
  uint8_t rd_extra[sizeof(vu::RegionAccess) + 4] = {};
  vu::RegionAccess r4{reg::SCRATCH, vu::kRegionBar0, 4};
  std::memcpy(rd_extra, &r4, sizeof r4);
  expect_error(static_cast<uint16_t>(vu::Command::REGION_READ), rd_extra, sizeof rd_extra, EINVAL);
  vu::RegionAccess w8{reg::SCRATCH, vu::kRegionBar0, 8};
  uint8_t wr_short[sizeof(vu::RegionAccess) + 4] = {};
  std::memcpy(wr_short, &w8, sizeof w8);
  expect_error(static_cast<uint16_t>(vu::Command::REGION_WRITE), wr_short, sizeof wr_short, EINVAL);
  expect_error(static_cast<uint16_t>(vu::Command::REGION_READ), &r4, 8, EINVAL);  // short header
  expect_alive();
}

TEST_F(VfioUserWireTest, UnexpectedFdsAreRefusedAndClosed) {
  negotiate();
  int p[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  UniqueFd rd(p[0]), wr(p[1]);
  // An fd on a command that takes none: EINVAL, and the server closes it.
  vu::DeviceInfo di{sizeof di, 0, 0, 0};
  expect_error(vu::Command::DEVICE_GET_INFO, di, EINVAL, {wr.get()});
  vu::RegionAccess ra{reg::SCRATCH, vu::kRegionBar0, 4};
  expect_error(vu::Command::REGION_READ, ra, EINVAL, {wr.get(), wr.get()});
  // DMA_MAP takes exactly one.
  vu::DmaMap dm{sizeof dm, vu::dma_flag::READ, 0, 0x100000, 4096};
  expect_error(vu::Command::DMA_MAP, dm, EINVAL);
  expect_error(vu::Command::DMA_MAP, dm, EINVAL, {wr.get(), wr.get()});
  // More fds than we advertise (16).
  std::vector<int> many(vu::kMaxMsgFds + 1, wr.get());
  expect_error(vu::Command::DEVICE_GET_INFO, di, EINVAL, many);
  // SET_IRQS with fewer fds than count.
  vu::IrqSet is{sizeof is, VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER, vu::kIrqMsix, 0, 2};
  expect_error(vu::Command::DEVICE_SET_IRQS, is, EINVAL, {wr.get()});
  wr.reset();
  EXPECT_TRUE(pipe_writers_closed(rd.get(), 2000)) << "every fd the server was sent is closed";
  expect_alive();
}

TEST_F(VfioUserWireTest, DmaMapValidation) {
  negotiate();
  Memfd mem(8192);
  ASSERT_TRUE(mem.fd.valid());
  const std::vector<int> fd{mem.fd.get()};
  vu::DmaMap noflags{sizeof(vu::DmaMap), 0, 0, 0x100000, 4096};
  expect_error(vu::Command::DMA_MAP, noflags, EINVAL, fd);
  vu::DmaMap badflags{sizeof(vu::DmaMap), vu::dma_flag::READ | (1u << 2), 0, 0x100000, 4096};
  expect_error(vu::Command::DMA_MAP, badflags, EINVAL, fd);
  vu::DmaMap zero{sizeof(vu::DmaMap), vu::dma_flag::READ, 0, 0x100000, 0};
  expect_error(vu::Command::DMA_MAP, zero, EINVAL, fd);
  vu::DmaMap wrap{sizeof(vu::DmaMap), vu::dma_flag::READ, 0, UINT64_MAX - 4095, 8192};
  expect_error(vu::Command::DMA_MAP, wrap, EINVAL, fd);
  vu::DmaMap unaligned{sizeof(vu::DmaMap), vu::dma_flag::READ, 0, 0x100100, 4096};
  expect_error(vu::Command::DMA_MAP, unaligned, EINVAL, fd);  // refused by the device

  vu::DmaMap good{sizeof(vu::DmaMap), vu::dma_flag::READ | vu::dma_flag::WRITE, 0, 0x100000, 8192};
  expect_ok(vu::Command::DMA_MAP, good, fd);
  expect_error(vu::Command::DMA_MAP, good, EINVAL, fd);  // overlaps
  vu::DmaUnmap wrong{sizeof(vu::DmaUnmap), 0, 0x100000, 4096};
  expect_error(vu::Command::DMA_UNMAP, wrong, ENOENT);
  vu::DmaUnmap dirty{sizeof(vu::DmaUnmap), 1, 0x100000, 8192};
  expect_error(vu::Command::DMA_UNMAP, dirty, ENOTSUP);
  vu::DmaUnmap right{sizeof(vu::DmaUnmap), 0, 0x100000, 8192};
  auto pl = expect_ok(vu::Command::DMA_UNMAP, right);
  ASSERT_EQ(pl.size(), sizeof(vu::DmaUnmap));
  vu::DmaUnmap echo;
  std::memcpy(&echo, pl.data(), sizeof echo);
  EXPECT_EQ(echo.addr, right.addr);
  EXPECT_EQ(echo.size, right.size);
  expect_error(vu::Command::DMA_UNMAP, right, ENOENT);
}

TEST_F(VfioUserWireTest, SetIrqsValidation) {
  negotiate();
  UniqueFd e(::eventfd(0, EFD_CLOEXEC));
  const uint32_t trig = VFIO_IRQ_SET_ACTION_TRIGGER;
  const uint32_t n = _dev->msix_count();
  vu::IrqSet intx{sizeof(vu::IrqSet), VFIO_IRQ_SET_DATA_EVENTFD | trig, VFIO_PCI_INTX_IRQ_INDEX, 0, 1};
  expect_error(vu::Command::DEVICE_SET_IRQS, intx, EINVAL, {e.get()});
  vu::IrqSet past{sizeof(vu::IrqSet), VFIO_IRQ_SET_DATA_EVENTFD | trig, vu::kIrqMsix, n, 1};
  expect_error(vu::Command::DEVICE_SET_IRQS, past, EINVAL, {e.get()});
  vu::IrqSet wrap{sizeof(vu::IrqSet), VFIO_IRQ_SET_DATA_EVENTFD | trig, vu::kIrqMsix, 1, 0xffffffff};
  expect_error(vu::Command::DEVICE_SET_IRQS, wrap, EINVAL, {e.get()});
  vu::IrqSet mask{sizeof(vu::IrqSet), VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_MASK, vu::kIrqMsix, 0, 1};
  expect_error(vu::Command::DEVICE_SET_IRQS, mask, EINVAL, {e.get()});
  vu::IrqSet two_data{sizeof(vu::IrqSet), VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_DATA_NONE | trig, vu::kIrqMsix,
                      0, 1};
  expect_error(vu::Command::DEVICE_SET_IRQS, two_data, EINVAL, {e.get()});
  vu::IrqSet unknown{sizeof(vu::IrqSet), VFIO_IRQ_SET_DATA_EVENTFD | trig | (1u << 9), vu::kIrqMsix, 0, 1};
  expect_error(vu::Command::DEVICE_SET_IRQS, unknown, EINVAL, {e.get()});
  vu::IrqSet boolean{sizeof(vu::IrqSet), VFIO_IRQ_SET_DATA_BOOL | trig, vu::kIrqMsix, 0, 1};
  expect_error(vu::Command::DEVICE_SET_IRQS, boolean, ENOTSUP);
  vu::IrqSet fire{sizeof(vu::IrqSet), VFIO_IRQ_SET_DATA_NONE | trig, vu::kIrqMsix, 0, 1};
  expect_error(vu::Command::DEVICE_SET_IRQS, fire, ENOTSUP);

  vu::IrqSet attach{sizeof(vu::IrqSet), VFIO_IRQ_SET_DATA_EVENTFD | trig, vu::kIrqMsix, n - 1, 1};
  expect_ok(vu::Command::DEVICE_SET_IRQS, attach, {e.get()});
  vu::IrqSet detach{sizeof(vu::IrqSet), VFIO_IRQ_SET_DATA_EVENTFD | trig, vu::kIrqMsix, 0, n};
  expect_ok(vu::Command::DEVICE_SET_IRQS, detach);
  vu::IrqSet all_off{sizeof(vu::IrqSet), VFIO_IRQ_SET_DATA_NONE | trig, vu::kIrqMsix, 0, 0};
  expect_ok(vu::Command::DEVICE_SET_IRQS, all_off);
}

TEST_F(VfioUserWireTest, RegionAndIrqInfo) {
  negotiate();
  vu::RegionInfo bad{sizeof(vu::RegionInfo), 0, vu::kNumRegions, 0, 0, 0};
  expect_error(vu::Command::DEVICE_GET_REGION_INFO, bad, EINVAL);
  vu::RegionInfo bar2{sizeof(vu::RegionInfo), 0, vu::kRegionBar2, 0, 0, 0};
  std::vector<UniqueFd> fds;
  auto pl = expect_ok(vu::Command::DEVICE_GET_REGION_INFO, bar2, {}, &fds);
  ASSERT_EQ(pl.size(), sizeof(vu::RegionInfo));
  vu::RegionInfo out;
  std::memcpy(&out, pl.data(), sizeof out);
  EXPECT_EQ(out.argsz, sizeof out);
  EXPECT_EQ(out.index, vu::kRegionBar2);
  EXPECT_EQ(out.size, _dev->hbm_size());
  EXPECT_EQ(out.flags, VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE | VFIO_REGION_INFO_FLAG_MMAP);
  EXPECT_EQ(fds.size(), 1u) << "the HBM fd comes with the reply";
  fds.clear();
  vu::RegionInfo bar0{sizeof(vu::RegionInfo), 0, vu::kRegionBar0, 0, 0, 0};
  expect_ok(vu::Command::DEVICE_GET_REGION_INFO, bar0, {}, &fds);
  EXPECT_TRUE(fds.empty()) << "BAR0 is trapped";

  vu::IrqInfo bad_irq{sizeof(vu::IrqInfo), 0, vu::kNumIrqs, 0};
  expect_error(vu::Command::DEVICE_GET_IRQ_INFO, bad_irq, EINVAL);
  vu::IrqInfo msix{sizeof(vu::IrqInfo), 0, vu::kIrqMsix, 0};
  pl = expect_ok(vu::Command::DEVICE_GET_IRQ_INFO, msix);
  ASSERT_EQ(pl.size(), sizeof(vu::IrqInfo));
  vu::IrqInfo ii;
  std::memcpy(&ii, pl.data(), sizeof ii);
  EXPECT_EQ(ii.count, _dev->msix_count());
  EXPECT_NE(ii.flags & VFIO_IRQ_INFO_EVENTFD, 0u);
}

TEST_F(VfioUserWireTest, RegionIoFds) {
  negotiate();
  const uint32_t nq = _dev->config().num_queues;
  // Too small: the needed size and count, no fds.
  vu::RegionIoFds small{sizeof(vu::RegionIoFds), 0, vu::kRegionBar0, 0};
  std::vector<UniqueFd> fds;
  auto pl = expect_ok(vu::Command::DEVICE_GET_REGION_IO_FDS, small, {}, &fds);
  ASSERT_EQ(pl.size(), sizeof(vu::RegionIoFds));
  vu::RegionIoFds hdr;
  std::memcpy(&hdr, pl.data(), sizeof hdr);
  EXPECT_EQ(hdr.count, nq);
  EXPECT_EQ(hdr.argsz, sizeof(vu::RegionIoFds) + nq * sizeof(vu::IoFdSubRegion));
  EXPECT_TRUE(fds.empty());

  vu::RegionIoFds full{hdr.argsz, 0, vu::kRegionBar0, 0};
  pl = expect_ok(vu::Command::DEVICE_GET_REGION_IO_FDS, full, {}, &fds);
  ASSERT_EQ(pl.size(), hdr.argsz);
  ASSERT_EQ(fds.size(), nq);
  for (uint32_t q = 0; q < nq; ++q) {
    vu::IoFdSubRegion s;
    std::memcpy(&s, pl.data() + sizeof hdr + q * sizeof s, sizeof s);
    EXPECT_EQ(s.offset, reg::doorbell(q));
    EXPECT_EQ(s.size, 4u);
    EXPECT_EQ(s.type, vu::kIoFdTypeIoeventfd);
    EXPECT_EQ(s.fd_index, q);
    // The fd is the device's own doorbell eventfd (same open file), so a
    // write to it is a doorbell write. kcmp may be compiled out or denied.
    long same = ::syscall(SYS_kcmp, ::getpid(), ::getpid(), KCMP_FILE, fds[q].get(), _dev->doorbell_eventfd(q));
    if (same >= 0) {
      EXPECT_EQ(same, 0) << "queue " << q;
    }
  }
  vu::RegionIoFds cfg{1024, 0, vu::kRegionConfig, 0};
  pl = expect_ok(vu::Command::DEVICE_GET_REGION_IO_FDS, cfg);
  ASSERT_EQ(pl.size(), sizeof(vu::RegionIoFds));
  std::memcpy(&hdr, pl.data(), sizeof hdr);
  EXPECT_EQ(hdr.count, 0u);
  vu::RegionIoFds flags{1024, 1, vu::kRegionBar0, 0};
  expect_error(vu::Command::DEVICE_GET_REGION_IO_FDS, flags, EINVAL);
  vu::RegionIoFds idx{1024, 0, vu::kNumRegions, 0};
  expect_error(vu::Command::DEVICE_GET_REGION_IO_FDS, idx, EINVAL);
}

TEST_F(VfioUserWireTest, MsgIdsAreEchoedWhateverTheyAre) {
  negotiate();
  vu::DeviceInfo di{sizeof di, 0, 0, 0};
  for (uint16_t id : {uint16_t{0}, uint16_t{0xffff}, uint16_t{42}, uint16_t{42}}) {
    ASSERT_TRUE(raw().send_cmd(id, vu::Command::DEVICE_GET_INFO, di));
    vu::Header h;
    ASSERT_EQ(raw().recv(&h), Raw::R::reply);
    EXPECT_EQ(h.msg_id, id);
    EXPECT_EQ(h.command, static_cast<uint16_t>(vu::Command::DEVICE_GET_INFO));
  }
}

TEST_F(VfioUserWireTest, NoReplyFlagSuppressesTheReply) {
  negotiate();
  uint8_t w[sizeof(vu::RegionAccess) + 4];
  vu::RegionAccess ra{reg::SCRATCH, vu::kRegionBar0, 4};
  uint32_t v = 0x5eed;
  std::memcpy(w, &ra, sizeof ra);
  std::memcpy(w + sizeof ra, &v, 4);
  ASSERT_TRUE(raw().send_cmd(9, static_cast<uint16_t>(vu::Command::REGION_WRITE), w, sizeof w, {},
                             vu::msg_flag::TYPE_COMMAND | vu::msg_flag::NO_REPLY));
  auto pl = expect_ok(vu::Command::REGION_READ, ra);  // the first reply is this read's
  ASSERT_EQ(pl.size(), sizeof ra + 4);
  std::memcpy(&v, pl.data() + sizeof ra, 4);
  EXPECT_EQ(v, 0x5eedu);
}

TEST_F(VfioUserWireTest, DisconnectWithResourcesHeldResetsTheDevice) {
  negotiate();
  Memfd mem(4096);
  ASSERT_TRUE(mem.fd.valid());
  vu::DmaMap dm{sizeof dm, vu::dma_flag::READ, 0, 0x100000, 4096};
  expect_ok(vu::Command::DMA_MAP, dm, {mem.fd.get()});
  int p[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  UniqueFd rd(p[0]), wr(p[1]);
  vu::IrqSet is{sizeof is, VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER, vu::kIrqMsix, 0, 1};
  expect_ok(vu::Command::DEVICE_SET_IRQS, is, {wr.get()});
  wr.reset();
  // Vanish in the middle of a message.
  vu::Header h{3, static_cast<uint16_t>(vu::Command::REGION_WRITE), 64, 0, 0};
  ASSERT_TRUE(raw().send_bytes(&h, sizeof h));
  raw().close();
  EXPECT_TRUE(pipe_writers_closed(rd.get(), 3000)) << "the device dropped the client's irq fd";
  ASSERT_TRUE(served(1));
  auto l = open_link();
  ASSERT_TRUE(l);
  EXPECT_EQ(att_write(*l, 0, 0x100000, 4096, 0x100000, abi::att::READ | abi::att::KIND_HOST),
            abi::att_status::NOT_MAPPED);
}

TEST_F(VfioUserWireTest, NoFdLeaksAcrossMalformedClients) {
  const size_t before = open_fd_count();
  for (int round = 0; round < 3; ++round) {
    Raw r(_path);
    ASSERT_TRUE(r.connected());
    std::string v("\0\0\1\0{}", 6);
    v.push_back('\0');
    ASSERT_TRUE(r.send_cmd(1, static_cast<uint16_t>(vu::Command::VERSION), v.data(), v.size()));
    vu::Header h;
    ASSERT_EQ(r.recv(&h), Raw::R::reply);
    Memfd mem(4096);
    vu::DeviceInfo di{sizeof di, 0, 0, 0};
    ASSERT_TRUE(r.send_cmd(2, vu::Command::DEVICE_GET_INFO, di, {mem.fd.get(), mem.fd.get()}));
    ASSERT_EQ(r.recv(&h), Raw::R::reply);
    vu::DmaMap dm{sizeof dm, vu::dma_flag::READ, 0, 0x100000, 4096};
    ASSERT_TRUE(r.send_cmd(3, vu::Command::DMA_MAP, dm, {mem.fd.get()}));
    ASSERT_EQ(r.recv(&h), Raw::R::reply);
    // The client takes at most max_msg_fds from us: it said nothing, so 1.
    vu::RegionIoFds io{4096, 0, vu::kRegionBar0, 0};
    std::vector<UniqueFd> got;
    std::vector<uint8_t> pl;
    ASSERT_TRUE(r.send_cmd(4, vu::Command::DEVICE_GET_REGION_IO_FDS, io));
    ASSERT_EQ(r.recv(&h, &pl, &got), Raw::R::reply);
    EXPECT_EQ(got.size(), 1u);
    // ... and a bad header with fds attached.
    vu::Header bad{5, 4, 3, 0, 0};
    ASSERT_TRUE(r.send_bytes(&bad, sizeof bad, {mem.fd.get()}));
    EXPECT_TRUE(r.dropped());
    ASSERT_TRUE(served(static_cast<uint64_t>(round) + 1));
  }
  EXPECT_EQ(open_fd_count(), before);
  _raw.reset();
}

}  // namespace
}  // namespace hcomm
