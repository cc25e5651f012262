// The simulator's vfio-user server fed arbitrary byte streams by a client:
// it must never crash or hang, and must still serve a well-behaved client
// afterwards (checked every 64 inputs with the real driver link).
#include <poll.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <thread>

#include "driver/vfio_user_link.h"
#include "hal/abi/regs.h"
#include "hal/abi/vfio_user.h"
#include "sim/device.h"
#include "sim/vfio_user_server.h"
#include "tests/fuzz/fuzz.h"

namespace vu = hcomm::hal::abi::vfio_user;
namespace abi = hcomm::hal::abi;

namespace {

struct World {
  std::string dir, path;
  hcomm::sim::Fabric fabric;
  std::unique_ptr<hcomm::sim::VfioUserServer> server;
  World() {
    char tmpl[] = "/tmp/hcomm-fuzz-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) std::abort();
    dir = tmpl;
    path = dir + "/npu0.sock";
    hcomm::sim::DeviceConfig cfg;
    cfg.hbm_size = 1 << 20;
    cfg.num_queues = 2;
    cfg.num_att = 16;
    auto dev = std::make_unique<hcomm::sim::Device>(cfg, &fabric);
    if (!dev->init() || !fabric.add(std::move(dev))) std::abort();
    hcomm::sim::VfioUserServerOptions o;
    o.io_timeout_ms = 200;
    server = std::make_unique<hcomm::sim::VfioUserServer>(*fabric.device(0), path, o);
    if (!server->start()) std::abort();
  }
  ~World() {
    server->stop();
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
};

World& world() {
  static World w;
  return w;
}

int connect_to(const std::string& path) {
  for (int tries = 0; tries < 200; ++tries) {
    int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return fd;
    ::close(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return -1;
}

template <typename T>
void put(std::string* s, const T& v) {
  s->append(reinterpret_cast<const char*>(&v), sizeof v);
}
std::string msg(uint16_t id, vu::Command cmd, const std::string& payload) {
  vu::Header h{id, static_cast<uint16_t>(cmd), static_cast<uint32_t>(sizeof(vu::Header) + payload.size()),
               vu::msg_flag::TYPE_COMMAND, 0};
  std::string s;
  put(&s, h);
  return s + payload;
}
std::string version_msg() {
  std::string p;
  put(&p, vu::Version{0, 1});
  p += vu::caps_json({});
  p.push_back('\0');
  return msg(1, vu::Command::VERSION, p);
}

}  // namespace

std::vector<std::string> fuzz_seeds() {
  std::string v = version_msg();
  std::string info, region, read, write, reset;
  {
    std::string p;
    put(&p, vu::DeviceInfo{sizeof(vu::DeviceInfo), 0, 0, 0});
    info = msg(2, vu::Command::DEVICE_GET_INFO, p);
  }
  {
    std::string p;
    put(&p, vu::RegionInfo{sizeof(vu::RegionInfo), 0, vu::kRegionBar0, 0, 0, 0});
    region = msg(3, vu::Command::DEVICE_GET_REGION_INFO, p);
  }
  {
    std::string p;
    put(&p, vu::RegionAccess{abi::reg::ID, vu::kRegionBar0, 4});
    read = msg(4, vu::Command::REGION_READ, p);
  }
  {
    std::string p;
    put(&p, vu::RegionAccess{abi::reg::SCRATCH, vu::kRegionBar0, 4});
    put(&p, uint32_t{0x12345678});
    write = msg(5, vu::Command::REGION_WRITE, p);
  }
  reset = msg(6, vu::Command::DEVICE_RESET, "");
  return {v, v + info, v + region, v + read, v + write, v + reset, v + info + region + read + write + reset,
          info};
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static unsigned long runs = 0;
  World& w = world();
  int fd = connect_to(w.path);
  if (fd < 0) {
    std::fprintf(stderr, "fuzz: the server stopped accepting connections\n");
    std::abort();
  }
  size_t off = 0;
  while (off < size) {
    ssize_t n = ::send(fd, data + off, size - off, MSG_NOSIGNAL);
    if (n <= 0) break;  // the server dropped us: fine
    off += static_cast<size_t>(n);
  }
  ::shutdown(fd, SHUT_WR);
  // Drain replies until the server closes (it must: we sent EOF), bounded.
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                    until - std::chrono::steady_clock::now()).count());
    if (left <= 0) {
      std::fprintf(stderr, "fuzz: the server did not close a client that sent EOF within 5 s\n");
      std::abort();
    }
    if (::poll(&p, 1, left) <= 0) continue;
    char buf[4096];
    if (::read(fd, buf, sizeof buf) <= 0) break;
  }
  ::close(fd);
  if (++runs % 64 == 0) {
    // A well-behaved client still gets full service.
    std::unique_ptr<hcomm::driver::Link> link;
    hcomm::Status st = hcomm::driver::open_vfio_user(w.path, &link, 3000);
    uint32_t v = 0;
    if (st) st = link->write32(abi::reg::SCRATCH, 0xabcd);
    if (st) st = link->read32(abi::reg::SCRATCH, &v);
    if (!st || v != 0xabcd) {
      std::fprintf(stderr, "fuzz: a good client is no longer served: %s\n", st.to_string().c_str());
      std::abort();
    }
  }
  return 0;
}
