// hcomm-sim's ivshmem front and the driver's IvshmemLink, on the host and
// without QEMU: a FakeQemu speaks the client side of the ivshmem server
// protocol and maps the shared memory the way QEMU does, and a FakePci stands
// in for the ivshmem function behind vfio-pci (its BAR2 is that mapping, its
// DMA addresses are offsets in a memfd playing guest RAM, as guest-physical
// addresses are offsets in QEMU's memory-backend-file). The real thing, in
// a guest with vfio-pci, is the qemu suite (tests/qemu/).
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/time.h"
#include "common/unix_socket.h"
#include "driver/ivshmem_link.h"
#include "hal/abi/ivshmem.h"
#include "hal/npu/device.h"
#include "hal/npu/dma_queue.h"
#include "sim/device.h"
#include "sim/ivshmem_front.h"

namespace hcomm {
namespace {

namespace iv = hal::abi::ivshmem;
namespace abi = hal::abi;
namespace npu = hal::npu;
using unix_socket::Io;

constexpr uint64_t kHbm = 4 << 20;
constexpr uint32_t kQueues = 2;
constexpr uint64_t kRam = 8 << 20;

// The client half of the ivshmem server protocol, as QEMU's ivshmem does it.
struct FakeQemu {
  UniqueFd sock;
  int64_t version = -99, my_id = -99;
  UniqueFd shm;
  uint64_t shm_size = 0;
  uint8_t* shared = nullptr;
  std::vector<UniqueFd> peer_vectors;  // the sim's (peer 0): what the guest rings
  std::vector<UniqueFd> my_vectors;    // ours: what the sim interrupts us on

  ~FakeQemu() {
    if (shared != nullptr) ::munmap(shared, shm_size);
  }

  // One 8-byte message and the fd riding on it (-1 for none).
  std::string recv(int64_t* v, UniqueFd* fd) {
    std::vector<UniqueFd> fds;
    bool ctrunc = false;
    size_t got = 0;
    int err = 0;
    Io io = unix_socket::recv_exact(sock.get(), v, 8, Deadline::after_ms(3000), -1, 4, &fds, &ctrunc, &got, &err);
    if (io != Io::ok) return std::string("recv: ") + unix_socket::io_name(io);
    if (fds.size() > 1) return "more than one fd on a message";
    *fd = fds.empty() ? UniqueFd() : std::move(fds[0]);
    return "";
  }

  std::string connect(const std::string& path, uint32_t vectors) {
    sock.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::snprintf(a.sun_path, sizeof a.sun_path, "%s", path.c_str());
    if (::connect(sock.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return "connect failed";
    int64_t v;
    UniqueFd fd;
    if (auto e = recv(&version, &fd); !e.empty()) return e;
    if (fd.valid()) return "fd on the version message";
    if (auto e = recv(&my_id, &fd); !e.empty()) return e;
    if (fd.valid()) return "fd on the id message";
    if (auto e = recv(&v, &shm); !e.empty()) return e;
    if (v != -1 || !shm.valid()) return "third message is not the shared memory";
    struct stat sb {};
    ::fstat(shm.get(), &sb);
    shm_size = static_cast<uint64_t>(sb.st_size);
    void* p = ::mmap(nullptr, shm_size, PROT_READ | PROT_WRITE, MAP_SHARED, shm.get(), 0);
    if (p == MAP_FAILED) return "mmap shared memory";
    shared = static_cast<uint8_t*>(p);
    for (uint32_t i = 0; i < 2 * vectors; ++i) {
      if (auto e = recv(&v, &fd); !e.empty()) return e;
      if (!fd.valid()) return "vector message without an eventfd";
      if (i < vectors) {
        if (v != iv::kSimPeer) return "expected the sim's vectors first";
        peer_vectors.push_back(std::move(fd));
      } else {
        if (v != my_id) return "expected our own vectors";
        my_vectors.push_back(std::move(fd));
      }
    }
    return "";
  }
};

// The ivshmem PCI function as vfio-pci presents it, for IvshmemLink.
class FakePci : public driver::Link {
 public:
  FakePci(FakeQemu& q, uint8_t* ram, uint64_t ram_size, int ram_fd)
      : _q(q), _ram(ram), _ram_size(ram_size), _ram_fd(ram_fd) {}
  const char* kind() const override { return "fake-ivshmem"; }
  std::string location() const override { return "0000:00:03.0"; }
  Status region_info(uint32_t region, driver::RegionInfo* out) override {
    *out = driver::RegionInfo{region, region == 7 ? 256u : 0u, true, true, false};
    return Status::ok();
  }
  Status map_region(uint32_t region, void** out, uint64_t* size) override {
    if (region != iv::kSharedBar) return Status::error(Code::unsupported, "not mmapable");
    *out = _q.shared;
    *size = _q.shm_size;
    return Status::ok();
  }
  Status read(uint32_t region, uint64_t offset, void* data, size_t len) override {
    if (region != 7 || offset + len > sizeof _config) return Status::error(Code::unsupported, "fake read");
    std::memcpy(data, _config + offset, len);
    return Status::ok();
  }
  Status write(uint32_t region, uint64_t offset, const void* data, size_t len) override {
    if (region != 7 || offset + len > sizeof _config) return Status::error(Code::unsupported, "fake write");
    std::memcpy(_config + offset, data, len);
    return Status::ok();
  }
  // QEMU would route DOORBELL by its vector; a plain eventfd cannot, so every
  // ring here kicks the mailbox vector. Queue engines then run on their
  // bounded sleep instead of a wake-up, which is slower but the same.
  Status doorbell(uint64_t, driver::Doorbell* out) override {
    *out = driver::Doorbell{};
    out->eventfd = _q.peer_vectors.at(iv::kMailboxVector).get();
    return Status::ok();
  }
  Status set_msix(uint32_t, std::span<const int>) override { return Status::error(Code::unsupported, "no MSI-X"); }
  uint32_t msix_count() const override { return 0; }
  // Bus address = "physical address" = offset in the RAM file. In a guest all
  // memory is guest RAM; here a buffer from elsewhere (the HAL's own rings)
  // is moved into it: its pages are replaced, at the same virtual address, by
  // pages of the RAM file holding the same bytes.
  Status dma_map(void* vaddr, uint64_t len, int, uint64_t, uint32_t, uint64_t* bus) override {
    auto* p = static_cast<uint8_t*>(vaddr);
    if (p >= _ram && p + len <= _ram + _ram_size) {
      *bus = static_cast<uint64_t>(p - _ram);
    } else {
      auto start = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{4095};
      uint64_t mlen = (reinterpret_cast<uintptr_t>(p) + len + 4095) / 4096 * 4096 - start;
      if (_next + mlen > _ram_size) return Status::error(Code::no_resource, "fake guest RAM exhausted");
      std::vector<uint8_t> keep(mlen);
      std::memcpy(keep.data(), reinterpret_cast<void*>(start), mlen);
      void* m = ::mmap(reinterpret_cast<void*>(start), mlen, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, _ram_fd,
                       static_cast<off_t>(_next));
      if (m == MAP_FAILED) return Status::from_errno(errno, "fake: remap into guest RAM");
      std::memcpy(m, keep.data(), mlen);
      *bus = _next + (reinterpret_cast<uintptr_t>(p) - start);
      _next += mlen;
    }
    ++maps;
    return Status::ok();
  }
  Status dma_unmap(uint64_t, uint64_t) override {
    ++unmaps;
    return Status::ok();
  }
  Status reset() override { return Status::ok(); }
  int maps = 0, unmaps = 0;

 private:
  FakeQemu& _q;
  uint8_t* _ram;
  uint64_t _ram_size;
  int _ram_fd;
  uint64_t _next = kRam / 2;  // where moved buffers go
  uint8_t _config[256] = {};
};

class Ivshmem : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/hcomm-ivshmem-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    ram_path_ = dir_ + "/guest-ram";
    ram_fd_.reset(::open(ram_path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
    ASSERT_TRUE(ram_fd_.valid());
    ASSERT_EQ(::ftruncate(ram_fd_.get(), kRam), 0);
    void* p = ::mmap(nullptr, kRam, PROT_READ | PROT_WRITE, MAP_SHARED, ram_fd_.get(), 0);
    ASSERT_NE(p, MAP_FAILED);
    ram_ = static_cast<uint8_t*>(p);
    sim::DeviceConfig cfg;
    cfg.hbm_size = kHbm;
    cfg.num_queues = kQueues;
    sim::ivshmem_device_config(&cfg);
    fabric_ = std::make_unique<sim::Fabric>();
    auto dev = std::make_unique<sim::Device>(cfg, fabric_.get());
    ASSERT_TRUE(dev->init());
    dev_ = dev.get();
    ASSERT_TRUE(fabric_->add(std::move(dev)));
    start_front(ram_path_);
  }
  void TearDown() override {
    link_.reset();
    if (front_) front_->stop();
    front_.reset();
    fabric_.reset();
    if (ram_ != nullptr) ::munmap(ram_, kRam);
    ::unlink(ram_path_.c_str());
    ::rmdir(dir_.c_str());
  }
  void start_front(const std::string& ram) {
    if (front_) front_->stop();
    sim::IvshmemFrontOptions o;
    o.guest_ram_path = ram;
    sock_ = dir_ + "/npu0.ivshmem";
    front_ = std::make_unique<sim::IvshmemFront>(*dev_, sock_, o);
    Status st = front_->start();
    ASSERT_TRUE(st) << st.to_string();
  }
  // Connect as QEMU and open the link the way discovery does in a guest.
  void open_link(FakeQemu* q, int mailbox_timeout_ms = 5000) {
    ASSERT_EQ(q->connect(sock_, front_->vectors()), "");
    auto pci = std::make_unique<FakePci>(*q, ram_, kRam, ram_fd_.get());
    pci_ = pci.get();
    driver::IvshmemOptions o;
    o.mailbox_timeout_ms = mailbox_timeout_ms;
    Status st = driver::IvshmemLink::open(std::move(pci), o, &link_);
    ASSERT_TRUE(st) << st.to_string();
  }
  // A raw mailbox request, as a buggy or hostile guest could write it.
  int32_t raw_call(FakeQemu& q, uint32_t op, uint32_t width, uint64_t offset, uint64_t len, std::string* msg) {
    auto* mb = reinterpret_cast<iv::Mailbox*>(q.shared + iv::kMailboxOffset);
    mb->op = op;
    mb->width = width;
    mb->offset = offset;
    mb->len = len;
    mb->value = 0;
    mb->prot = 3;
    uint32_t s = __atomic_load_n(&mb->seq, __ATOMIC_ACQUIRE) + 1;
    __atomic_store_n(&mb->seq, s, __ATOMIC_RELEASE);
    uint64_t one = 1;
    EXPECT_EQ(::write(q.peer_vectors[iv::kMailboxVector].get(), &one, 8), 8);
    Deadline dl = Deadline::after_ms(3000);
    while (__atomic_load_n(&mb->ack, __ATOMIC_ACQUIRE) != s) {
      if (dl.expired()) {
        ADD_FAILURE() << "mailbox not answered";
        return -1;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    *msg = std::string(mb->message, strnlen(mb->message, sizeof mb->message));
    return mb->status;
  }

  std::string dir_, ram_path_, sock_;
  FakeQemu q_;  // declared before link_: destroyed after it
  uint8_t* ram_ = nullptr;
  UniqueFd ram_fd_;
  std::unique_ptr<sim::Fabric> fabric_;
  sim::Device* dev_ = nullptr;
  std::unique_ptr<sim::IvshmemFront> front_;
  std::unique_ptr<driver::Link> link_;
  FakePci* pci_ = nullptr;
};

TEST_F(Ivshmem, ServerProtocolAndSharedLayout) {
  FakeQemu q;
  ASSERT_EQ(q.connect(sock_, front_->vectors()), "");
  EXPECT_EQ(q.version, iv::kProtocolVersion);
  EXPECT_EQ(q.my_id, iv::kGuestPeer);
  EXPECT_EQ(q.shm_size, iv::shared_size_for(kHbm));
  EXPECT_EQ(q.shm_size & (q.shm_size - 1), 0u) << "a BAR is a power of two";
  EXPECT_EQ(q.peer_vectors.size(), iv::vectors_for(kQueues));
  iv::Header h;
  std::memcpy(&h, q.shared, sizeof h);
  EXPECT_EQ(h.magic, iv::kMagic);
  EXPECT_EQ(h.hbm_offset, iv::kHbmOffset);
  EXPECT_EQ(h.hbm_size, kHbm);
  EXPECT_EQ(h.num_queues, kQueues);
  // HBM in the shared memory is the device's HBM.
  dev_->hbm()[123] = 0x5a;
  EXPECT_EQ(q.shared[iv::kHbmOffset + 123], 0x5a);
}

TEST_F(Ivshmem, HalRunsOverTheLink) {
  FakeQemu q;
  ASSERT_NO_FATAL_FAILURE(open_link(&q));
  EXPECT_STREQ(link_->kind(), "vfio-ivshmem");
  // Queue q's doorbell rings the sim (peer 0) on vector 1 + q.
  driver::Doorbell db;
  ASSERT_TRUE(link_->doorbell(abi::reg::doorbell(1), &db));
  EXPECT_TRUE(db.fixed);
  EXPECT_EQ(db.fixed_value, iv::doorbell_value(iv::kSimPeer, iv::kDoorbellVectorBase + 1));
  EXPECT_EQ(link_->doorbell(abi::reg::doorbell(kQueues), &db).code(), Code::invalid_argument);
  std::unique_ptr<npu::Device> dev;
  Status st = npu::Device::open(std::move(link_), &dev);
  ASSERT_TRUE(st) << st.to_string();
  EXPECT_EQ(dev->info().hbm_size, kHbm);
  EXPECT_EQ(dev->info().num_queues, kQueues);
  ASSERT_NE(dev->hbm(), nullptr) << "HBM aperture is mmapable";
  // Host (guest RAM) -> HBM -> host.
  uint8_t* a = ram_ + 0x10000;
  uint8_t* b = ram_ + 0x20000;
  for (int i = 0; i < 4096; ++i) a[i] = static_cast<uint8_t>(i * 7 + 1);
  npu::Mapping ma, mb, mh;
  ASSERT_TRUE(dev->map_host(a, 4096, -1, 0, npu::access::RW, &ma));
  ASSERT_TRUE(dev->map_host(b, 4096, -1, 0, npu::access::RW, &mb));
  ASSERT_TRUE(dev->map_hbm(8192, 4096, npu::access::RW, &mh));
  std::unique_ptr<npu::DmaQueue> dq;
  ASSERT_TRUE(dev->create_queue(4, false, &dq));
  ASSERT_EQ(dq->copy(ma.iova, mh.iova, 4096, 1), Code::ok);
  ASSERT_EQ(dq->copy(mh.iova, mb.iova, 4096, 2, abi::desc_flag::FENCE), Code::ok);
  abi::CqStatus e;
  ASSERT_TRUE(dq->drain(Deadline::after_ms(10000), &e));
  EXPECT_EQ(e, abi::CqStatus::OK);
  EXPECT_EQ(std::memcmp(a, b, 4096), 0);
  EXPECT_EQ(std::memcmp(dev->hbm() + 8192, a, 4096), 0);
  // A descriptor aimed past its mapping fails with an error completion.
  ASSERT_EQ(dq->copy(ma.iova, mb.iova + 4000, 200, 3), Code::ok);
  ASSERT_TRUE(dq->drain(Deadline::after_ms(10000), &e));
  EXPECT_EQ(e, abi::CqStatus::DST_FAULT);
  npu::ErrorLog el;
  ASSERT_TRUE(dev->error_log(&el));
  EXPECT_EQ(el.last_code, static_cast<uint32_t>(abi::CqStatus::DST_FAULT));
  dq.reset();
  EXPECT_TRUE(dev->unmap(&ma));
  EXPECT_TRUE(dev->unmap(&mb));
  EXPECT_TRUE(dev->unmap(&mh));
}

// Device loss as the guest's driver sees it, with no round trip: the
// device resetting itself shows in the shared liveness words at once, and
// a model that stops (hcomm-sim killed) within iv::kHeartbeatStaleMs.
TEST_F(Ivshmem, ADeviceResetIsSeenByHealth) {
  FakeQemu& q = q_;
  ASSERT_NO_FATAL_FAILURE(open_link(&q));
  std::unique_ptr<npu::Device> dev;
  Status st = npu::Device::open(std::move(link_), &dev);
  ASSERT_TRUE(st) << st.to_string();
  // Alive: the heartbeat moves, and health stays ok across several stale periods' worth of polls.
  const Deadline alive = Deadline::after_ms(3 * iv::kHeartbeatStaleMs / 2);
  while (!alive.expired()) {
    ASSERT_TRUE(dev->health()) << dev->health().to_string();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  dev_->self_reset();  // hcomm-sim's control "reset"
  Deadline dl = Deadline::after_ms(1000);
  while ((st = dev->health()).is_ok() && !dl.expired()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(st.code(), Code::device_error);
  EXPECT_NE(st.message().find("reset itself"), std::string::npos) << st.to_string();
}

TEST_F(Ivshmem, AStoppedModelIsSeenByHealthWithinTheStaleBound) {
  FakeQemu& q = q_;
  ASSERT_NO_FATAL_FAILURE(open_link(&q));
  auto* link = link_.get();
  ASSERT_TRUE(link->health());
  const auto t0 = std::chrono::steady_clock::now();
  front_->stop();  // the heartbeat stops, as when hcomm-sim is killed
  Status st;
  while ((st = link->health()).is_ok()) {
    ASSERT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2)) << "a stopped model went unnoticed";
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(st.code(), Code::device_error);
  EXPECT_NE(st.message().find("no heartbeat"), std::string::npos) << st.to_string();
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(iv::kHeartbeatStaleMs - 60))
      << "a live model's heartbeat is not that slow";
  link_.reset();
}

TEST_F(Ivshmem, DmaOutsideGuestRamIsRefusedByTheModel) {
  FakeQemu& q = q_;  // outlives link_ (its BAR mapping is the link's)
  ASSERT_NO_FATAL_FAILURE(open_link(&q));
  std::string msg;
  EXPECT_EQ(raw_call(q, static_cast<uint32_t>(iv::MailboxOp::dma_map), 0, kRam - 4096, 8192, &msg),
            static_cast<int32_t>(Code::out_of_range));
  EXPECT_NE(msg.find("outside the guest"), std::string::npos) << msg;
  EXPECT_EQ(raw_call(q, static_cast<uint32_t>(iv::MailboxOp::dma_map), 0, 0, 4096, &msg), 0) << msg;
  EXPECT_EQ(raw_call(q, static_cast<uint32_t>(iv::MailboxOp::dma_map), 0, 0, 4096, &msg),
            static_cast<int32_t>(Code::invalid_argument))
      << "overlapping map";
  EXPECT_EQ(raw_call(q, static_cast<uint32_t>(iv::MailboxOp::dma_unmap), 0, 0, 4096, &msg), 0) << msg;
}

TEST_F(Ivshmem, SharedMappingsKeepOneSetOfRightsAndSurviveReset) {
  FakeQemu& q = q_;
  ASSERT_NO_FATAL_FAILURE(open_link(&q));
  uint64_t b1 = 0, b2 = 0, b3 = 0;
  ASSERT_TRUE(link_->dma_map(ram_, 8192, -1, 0, driver::dma_prot::READ, &b1));
  // The same pages again, with more rights: refused, not silently shared.
  Status st = link_->dma_map(ram_ + 4096, 100, -1, 0, driver::dma_prot::READ | driver::dma_prot::WRITE, &b2);
  EXPECT_EQ(st.code(), Code::access_denied) << st.to_string();
  ASSERT_TRUE(link_->dma_map(ram_ + 4096, 100, -1, 0, driver::dma_prot::READ, &b3));
  EXPECT_EQ(b3, b1 + 4096);
  // A function-level reset keeps the DMA mappings (as VFIO_DEVICE_RESET).
  ASSERT_TRUE(link_->reset());
  std::string msg;
  EXPECT_EQ(raw_call(q, static_cast<uint32_t>(iv::MailboxOp::dma_map), 0, 0, 4096, &msg),
            static_cast<int32_t>(Code::invalid_argument))
      << "the model still has the range";
  ASSERT_TRUE(link_->dma_unmap(b1, 8192));
  ASSERT_TRUE(link_->dma_unmap(b3, 100));
  EXPECT_EQ(raw_call(q, static_cast<uint32_t>(iv::MailboxOp::dma_map), 0, 0, 4096, &msg), 0)
      << "the last unmap released it: " << msg;
}

TEST_F(Ivshmem, GarbageMailboxRequestsGetErrorsAndTheFrontGoesOn) {
  FakeQemu& q = q_;  // outlives link_ (its BAR mapping is the link's)
  ASSERT_NO_FATAL_FAILURE(open_link(&q));
  std::string msg;
  EXPECT_EQ(raw_call(q, 77, 4, 0, 0, &msg), static_cast<int32_t>(Code::invalid_argument));
  EXPECT_NE(msg.find("unknown mailbox op"), std::string::npos) << msg;
  EXPECT_NE(raw_call(q, static_cast<uint32_t>(iv::MailboxOp::bar0_read), 3, 0, 0, &msg), 0) << "width 3";
  EXPECT_NE(raw_call(q, static_cast<uint32_t>(iv::MailboxOp::bar0_read), 4, 2, 0, &msg), 0) << "misaligned";
  EXPECT_NE(raw_call(q, static_cast<uint32_t>(iv::MailboxOp::bar0_write), 8, ~0ull - 7, 0, &msg), 0);
  EXPECT_NE(raw_call(q, static_cast<uint32_t>(iv::MailboxOp::config_write), 8, 4, 0, &msg), 0);
  EXPECT_NE(raw_call(q, static_cast<uint32_t>(iv::MailboxOp::dma_unmap), 0, 0x123000, 4096, &msg), 0);
  // The link still works afterwards.
  uint32_t id = 0;
  ASSERT_TRUE(link_->read32(abi::reg::ID, &id));
  EXPECT_EQ(id, abi::kPciVendorId | (uint32_t{abi::kPciDeviceId} << 16));
  ASSERT_TRUE(link_->write32(abi::reg::SCRATCH, 0xfeedbeef));
  uint32_t v = 0;
  ASSERT_TRUE(link_->read32(abi::reg::SCRATCH, &v));
  EXPECT_EQ(v, 0xfeedbeefu);
}

TEST_F(Ivshmem, WithoutGuestRamDmaMapExplains) {
  start_front("");
  FakeQemu& q = q_;  // outlives link_ (its BAR mapping is the link's)
  ASSERT_NO_FATAL_FAILURE(open_link(&q));
  uint64_t bus = 0;
  Status st = link_->dma_map(ram_, 4096, -1, 0, driver::dma_prot::READ, &bus);
  EXPECT_EQ(st.code(), Code::unsupported);
  EXPECT_NE(st.message().find("--guest-ram"), std::string::npos) << st.to_string();
  EXPECT_EQ(pci_->unmaps, 1) << "the IOMMU mapping is undone when the model refuses";
}

TEST_F(Ivshmem, ForeignSharedMemoryIsNotAnNpu) {
  FakeQemu q;
  ASSERT_EQ(q.connect(sock_, front_->vectors()), "");
  std::memset(q.shared, 0, sizeof(iv::Header));  // someone else's ivshmem
  auto pci = std::make_unique<FakePci>(q, ram_, kRam, ram_fd_.get());
  Status st = driver::IvshmemLink::open(std::move(pci), driver::IvshmemOptions{}, &link_);
  EXPECT_EQ(st.code(), Code::unsupported);
  EXPECT_NE(st.message().find("no hcomm header"), std::string::npos) << st.to_string();
}

TEST_F(Ivshmem, GuestGoneResetsTheDeviceAndTheNextOneIsServed) {
  FakeQemu q;
  ASSERT_NO_FATAL_FAILURE(open_link(&q, 300));
  ASSERT_TRUE(link_->write32(abi::reg::SCRATCH, 42));
  uint64_t bus = 0;
  ASSERT_TRUE(link_->dma_map(ram_, 4096, -1, 0, driver::dma_prot::READ | driver::dma_prot::WRITE, &bus));
  // QEMU exits with the driver still open: only the socket tells the model.
  q.sock.reset();
  Deadline dl = Deadline::after_ms(3000);
  while (front_->clients_served() < 1 && !dl.expired()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(front_->clients_served(), 1u);
  uint32_t v = 1;
  ASSERT_TRUE(dev_->bar0_read(abi::reg::SCRATCH, &v, 4));
  EXPECT_EQ(v, 0u) << "registers reset when the guest went";
  link_.reset();  // its last mailbox request finds no model behind it: a bounded wait, then gone
  FakeQemu& q2 = q_;
  ASSERT_NO_FATAL_FAILURE(open_link(&q2));
  v = 1;
  ASSERT_TRUE(link_->read32(abi::reg::SCRATCH, &v));
  EXPECT_EQ(v, 0u) << "registers reset for the new guest";
  // The old DMA mapping is gone: mapping the same range again works.
  EXPECT_TRUE(link_->dma_map(ram_, 4096, -1, 0, driver::dma_prot::READ, &bus));
}

TEST_F(Ivshmem, DeadModelTimesOutWithAClearError) {
  FakeQemu q;
  ASSERT_NO_FATAL_FAILURE(open_link(&q));
  link_.reset();
  front_->stop();  // the model vanishes; the guest still has its mapping
  auto pci = std::make_unique<FakePci>(q, ram_, kRam, ram_fd_.get());
  driver::IvshmemOptions o;
  o.mailbox_timeout_ms = 200;
  Deadline dl = Deadline::after_ms(5000);
  Status st = driver::IvshmemLink::open(std::move(pci), o, &link_);
  EXPECT_FALSE(dl.expired());
  EXPECT_EQ(st.code(), Code::timeout);
  EXPECT_NE(st.message().find("hcomm-sim gone"), std::string::npos) << st.to_string();
}

}  // namespace
}  // namespace hcomm
