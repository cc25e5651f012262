#include "sim/roce/dpdk_port.h"

#include "hcomm_config.h"

#if HCOMM_HAVE_DPDK

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <rte_eal.h>
#include <rte_errno.h>
#include <rte_ethdev.h>
#include <rte_log.h>
#include <rte_mbuf.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "hal/abi/roce.h"

namespace hcomm::sim::roce {

namespace {

constexpr uint16_t kRingSize = 1024;
constexpr unsigned kPoolSize = 4095;  // 2^n - 1: the mempool's ring
constexpr uint16_t kBurst = 32;
// A frame in one mbuf: the engine's largest plus the mbuf headroom.
constexpr uint16_t kDataRoom = static_cast<uint16_t>((hal::abi::roce::kMaxFrame + 127) / 128 * 128 + RTE_PKTMBUF_HEADROOM);

std::mutex g_eal_mu;
bool g_eal_used = false;  // the EAL starts once per process, and never again after cleanup

class DpdkPort final : public Link {
 public:
  DpdkPort(uint16_t port, rte_mempool* pool, std::string name, std::string runtime, bool redial, bool started)
      : _port(port),
        _pool(pool),
        _name(std::move(name)),
        _runtime(std::move(runtime)),
        _redial(redial),
        _started(started) {
    rte_eth_dev_info info{};
    _driver = rte_eth_dev_info_get(_port, &info) == 0 && info.driver_name != nullptr ? info.driver_name : "?";
    rte_eth_link link{};
    _link_up = _started && rte_eth_link_get_nowait(_port, &link) == 0 && link.link_status != 0;
  }
  ~DpdkPort() override {
    for (uint16_t i = _next; i < _have; ++i) rte_pktmbuf_free(_stash[i]);
    // DPDK 22.11's memif server frees its listener's interrupt handle on
    // close without unregistering the handler: until rte_eal_cleanup stops
    // the interrupt thread, a peer's pending connection makes it log
    // "Failed to accept connection request on socket fd -1" in a loop
    // (thousands of lines per exit). The port is going away: keep the
    // driver quiet from here on.
    if (_memif_log >= 0) (void)rte_log_set_level(_memif_log, RTE_LOG_CRIT);
    if (_started) (void)rte_eth_dev_stop(_port);
    (void)rte_eth_dev_close(_port);
    rte_mempool_free(_pool);
    (void)rte_eal_cleanup();
    std::error_code ec;  // the EAL leaves its (empty) runtime directories behind
    std::filesystem::remove_all(_runtime, ec);
  }

  Status send(const uint8_t* frame, size_t len) override {
    if (!_started) return lost();  // a memif client still dialling
    rte_mbuf* m = rte_pktmbuf_alloc(_pool);
    if (m == nullptr) return lost();
    char* d = rte_pktmbuf_append(m, static_cast<uint16_t>(len));
    if (d == nullptr || len > UINT16_MAX) {
      rte_pktmbuf_free(m);
      return lost();
    }
    std::memcpy(d, frame, len);
    // A full ring is a busy wire for a moment: one more try, then the frame
    // is lost (the RC layer resends), never a wait on the peer.
    for (int t = 0; t < 2; ++t)
      if (rte_eth_tx_burst(_port, 0, &m, 1) == 1) return Status::ok();
    rte_pktmbuf_free(m);
    return lost();
  }

  Status recv(uint8_t* buf, size_t cap, size_t* len, int timeout_ms) override {
    *len = 0;
    housekeeping();
    if (_next == _have) {
      _next = _have = 0;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
      while (!_started || (_have = rte_eth_rx_burst(_port, 0, _stash.data(), kBurst)) == 0) {
        housekeeping();
        if (std::chrono::steady_clock::now() >= deadline) return Status::ok();
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    rte_mbuf* m = _stash[_next++];
    const uint32_t n = rte_pktmbuf_pkt_len(m);
    if (n <= cap) {
      // Chained segments (a memif peer with small buffers) are gathered.
      const void* p = rte_pktmbuf_read(m, 0, n, buf);
      if (p != nullptr && p != buf) std::memcpy(buf, p, n);
      if (p != nullptr) *len = n;
    } else {
      _lost.fetch_add(1, std::memory_order_relaxed);  // larger than any frame the port takes
    }
    rte_pktmbuf_free(m);
    return Status::ok();
  }

  uint64_t overflow() const override { return _lost.load(std::memory_order_relaxed); }

  // From any thread: what the network thread last saw (DPDK's control
  // calls on a port are not safe against a concurrent stop/start).
  std::string describe() const override {
    return "dpdk:" + _name + "(" + _driver + ",link-" + (_link_up.load(std::memory_order_relaxed) ? "up" : "down") +
           ")";
  }

 private:
  // On the network thread, at most every 100 ms: the link state for
  // describe(), and for a memif client a new dial. A memif client connects
  // when its port starts and not again: started before its server, or
  // after the server went away, its link stays down; once a second while
  // it is down the port is restarted, which dials again.
  void housekeeping() {
    const auto now = std::chrono::steady_clock::now();
    if (now - _last_check < std::chrono::milliseconds(100)) return;
    _last_check = now;
    rte_eth_link link{};
    const bool up = _started && rte_eth_link_get_nowait(_port, &link) == 0 && link.link_status != 0;
    _link_up.store(up, std::memory_order_relaxed);
    if (!_redial || up || now - _last_dial < std::chrono::seconds(1)) return;
    _last_dial = now;
    // Quietly: the driver logs every refused connection.
    const int level = rte_log_get_level(_memif_log);
    if (_memif_log >= 0) (void)rte_log_set_level(_memif_log, RTE_LOG_CRIT);
    if (_started) (void)rte_eth_dev_stop(_port);
    _started = rte_eth_dev_start(_port) == 0;  // no burst calls on a port that did not start
    if (_memif_log >= 0) (void)rte_log_set_level(_memif_log, static_cast<uint32_t>(level));
    _last_check = {};  // look at the link again on the next call
  }

  Status lost() {
    _lost.fetch_add(1, std::memory_order_relaxed);
    return Status::ok();
  }

  uint16_t _port;
  rte_mempool* _pool;
  std::string _name, _runtime;
  std::array<rte_mbuf*, kBurst> _stash{};
  uint16_t _next = 0, _have = 0;
  std::atomic<uint64_t> _lost{0};
  bool _redial;
  bool _started;
  std::string _driver;
  std::atomic<bool> _link_up{false};
  std::chrono::steady_clock::time_point _last_check{};
  int _memif_log = rte_log_register("pmd.net.memif");  // the driver's log type (it registered it)
  std::chrono::steady_clock::time_point _last_dial = std::chrono::steady_clock::now();
};

Status eal_error(const char* what) {
  return Status::error(Code::io_error, "DPDK %s: %s", what, rte_strerror(rte_errno));
}

}  // namespace

#if defined(__SANITIZE_THREAD__)
// DPDK is not built for ThreadSanitizer: its EAL interrupt thread and the
// memif driver share a control socket and interrupt handles with the
// polling thread under their own rules, which TSan reports through its
// close/recvmsg/memcpy interceptors. Reports from inside the DPDK
// libraries are not ours to fix; the simulator's own code stays checked.
extern "C" const char* __tsan_default_suppressions() {
  // called_from_lib names one library each (a pattern that matches two is an error).
  return "called_from_lib:librte_eal.so\n"
         "called_from_lib:librte_ethdev.so\n"
         "called_from_lib:librte_net_memif.so\n"
         "called_from_lib:librte_net_tap.so\n"
         "race:librte_\n";
}
#endif

Status open_dpdk_link(const std::string& devargs, const std::string& run_dir, std::unique_ptr<Link>* out) {
  std::lock_guard<std::mutex> g(g_eal_mu);
  if (g_eal_used) return Status::error(Code::invalid_argument, "one DPDK uplink per simulator");
  if (devargs.empty()) return Status::error(Code::invalid_argument, "dpdk: DEVARGS missing (e.g. net_memif0,role=server,socket=/x)");
  g_eal_used = true;

  const std::string runtime = run_dir + "/dpdk";  // the EAL's, under $RUNTIME_DIRECTORY
  const std::string prefix = "hcomm-sim-" + std::to_string(::getpid());
  // The EAL puts its runtime files under $RUNTIME_DIRECTORY/dpdk: the
  // simulator's own directory, so nothing is left in /var/run.
  ::setenv("RUNTIME_DIRECTORY", run_dir.c_str(), 1);
  const bool vdev = devargs.rfind("net_", 0) == 0 || devargs.rfind("eth_", 0) == 0;
  const bool memif = devargs.rfind("net_memif", 0) == 0;
  std::vector<std::string> args = {"hcomm-sim", "--file-prefix=" + prefix, "--no-telemetry",
                                   "--log-level=lib.eal:warning", "--log-level=lib.ethdev:warning"};
  if (vdev) {
    for (const char* a : {"--no-huge", "-m", "128", "--no-shconf", "--no-pci"}) args.emplace_back(a);
    std::string dev = devargs;
    // memif's 2 KiB default buffers chain a full-size frame over two; with
    // DPDK 22.11 such frames arrived corrupted here (ICRC drops on every
    // large WRITE), so every frame gets one buffer unless the user says.
    if (memif && dev.find("bsize=") == std::string::npos) {
      uint32_t b = 2048;
      while (b < hal::abi::roce::kMaxFrame) b *= 2;
      dev += ",bsize=" + std::to_string(b);
    }
    args.push_back("--vdev=" + dev);
  } else {
    args.push_back("-a");
    args.push_back(devargs);
  }
  if (const char* e = std::getenv("HCOMM_SIM_DPDK_EAL"); e != nullptr) {
    std::istringstream in(e);
    for (std::string w; in >> w;) args.push_back(w);
  }
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  // The EAL pins the calling thread to its main lcore; the simulator's
  // threads (fronts, DMA engines, network) are created later and inherit
  // it, so the CPU set is put back afterwards.
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  const bool had = pthread_getaffinity_np(pthread_self(), sizeof cpus, &cpus) == 0;
  const int r = rte_eal_init(static_cast<int>(args.size()), argv.data());
  if (had) (void)pthread_setaffinity_np(pthread_self(), sizeof cpus, &cpus);
  if (r < 0) {
    Status st = eal_error("EAL did not start");
    std::error_code ec;
    std::filesystem::remove_all(runtime, ec);
    return st;
  }

  auto fail = [&](Status st) {
    (void)rte_eal_cleanup();
    std::error_code ec;
    std::filesystem::remove_all(runtime, ec);
    return st;
  };
  uint16_t port = RTE_MAX_ETHPORTS;
  uint16_t p = 0;
  RTE_ETH_FOREACH_DEV(p) {
    port = p;
    break;
  }
  if (port == RTE_MAX_ETHPORTS)
    return fail(Status::error(Code::not_found, "DPDK: no port for '%s' (driver missing or device not probed)",
                              devargs.c_str()));
  char name[RTE_ETH_NAME_MAX_LEN] = {};
  (void)rte_eth_dev_get_name_by_port(port, name);

  rte_mempool* pool = rte_pktmbuf_pool_create("hcomm_uplink", kPoolSize, 0, 0, kDataRoom, SOCKET_ID_ANY);
  if (pool == nullptr) return fail(eal_error("mbuf pool"));
  auto fail_pool = [&](Status st) {
    (void)rte_eth_dev_close(port);
    rte_mempool_free(pool);
    return fail(std::move(st));
  };
  rte_eth_conf conf{};
  if (int e = rte_eth_dev_configure(port, 1, 1, &conf); e != 0)
    return fail_pool(Status::error(Code::io_error, "DPDK configure %s: %s", name, rte_strerror(-e)));
  uint16_t nrx = kRingSize, ntx = kRingSize;
  (void)rte_eth_dev_adjust_nb_rx_tx_desc(port, &nrx, &ntx);
  if (int e = rte_eth_rx_queue_setup(port, 0, nrx, SOCKET_ID_ANY, nullptr, pool); e != 0)
    return fail_pool(Status::error(Code::io_error, "DPDK rx queue %s: %s", name, rte_strerror(-e)));
  if (int e = rte_eth_tx_queue_setup(port, 0, ntx, SOCKET_ID_ANY, nullptr); e != 0)
    return fail_pool(Status::error(Code::io_error, "DPDK tx queue %s: %s", name, rte_strerror(-e)));
  // Room for the engine's largest frame where the device has an MTU (tap,
  // a NIC); memif has none. Frames for the NPUs' MACs, not the port's own.
  (void)rte_eth_dev_set_mtu(port, static_cast<uint16_t>(hal::abi::roce::kMaxFrame - 14));
  (void)rte_eth_promiscuous_enable(port);
  const bool memif_client = memif && devargs.find("role=client") != std::string::npos;
  bool started = true;
  if (int e = rte_eth_dev_start(port); e != 0) {
    started = false;
    // A memif client whose server is not there yet keeps dialling (redial).
    if (!memif_client)
      return fail_pool(Status::error(Code::io_error, "DPDK start %s: %s", name, rte_strerror(-e)));
    std::fprintf(stderr, "hcomm-sim: uplink %s: no memif server yet, dialling again every second\n", name);
  }
  *out = std::make_unique<DpdkPort>(port, pool, name, runtime, memif_client, started);
  return Status::ok();
}

}  // namespace hcomm::sim::roce

#else  // !HCOMM_HAVE_DPDK

namespace hcomm::sim::roce {

Status open_dpdk_link(const std::string&, const std::string&, std::unique_ptr<Link>*) {
  return Status::error(Code::unsupported, "hcomm-sim was built without DPDK (libdpdk-dev): no dpdk: uplink");
}

}  // namespace hcomm::sim::roce

#endif
