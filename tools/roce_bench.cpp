// hcomm-roce-bench: the NPU RoCEv2 engine by itself, through the HAL: two
// NPUs of a running hcomm-sim, one RC queue pair each, connected through the
// simulator's switch. Measures, per size: RDMA WRITE bandwidth with a window
// of outstanding requests (MB/s = 1e6 B/s, packets/s from the port's
// TX_FRAMES counter), and 8-byte WRITE and READ latency (post, then poll the
// completion; median of the samples). With --loss P it runs everything
// again with P% of the frames the NPUs send dropped (the control socket's
// `net faults drop=P`), to show what go-back-N costs.
//
//   hcomm-sim --devices 2 --hbm 256M &
//   build/tools/hcomm-roce-bench [--sim-dir DIR] [--sizes 4K,64K,1M] [--window 16] [--iters N] [--loss 1]
//                        [--ack-timeout 12]
//
// The numbers are the simulator's (one network thread moving every frame
// with memcpy), not silicon's: compare them with each other, and with the
// DMA engine's numbers from hcomm-bench on the same machine.
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/paths.h"
#include "common/time.h"
#include "driver/discover.h"
#include "driver/vfio_user_link.h"
#include "driver/dma_memory.h"
#include "hal/npu/device.h"
#include "hal/abi/regs.h"
#include "hal/abi/roce.h"
#include "hal/npu/rdma_qp.h"

using namespace hcomm;
namespace npu = hal::npu;
namespace rdma = hal::abi::rdma;

namespace {

using Clock = std::chrono::steady_clock;

std::string control(const std::string& dir, const std::string& cmd) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "error: socket";
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const std::string p = dir + "/control.sock";
  if (p.size() >= sizeof a.sun_path) {
    ::close(fd);
    return "error: path too long";
  }
  std::memcpy(a.sun_path, p.c_str(), p.size() + 1);
  std::string reply;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
    const std::string line = cmd + "\n";
    if (::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size())) {
      timeval tv{5, 0};
      ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
      char c;
      while (::read(fd, &c, 1) == 1 && c != '\n') reply += c;
    }
  } else {
    reply = "error: connect " + p;
  }
  ::close(fd);
  return reply;
}

bool parse_sizes(const std::string& s, std::vector<uint32_t>* out) {
  size_t pos = 0;
  while (pos < s.size()) {
    size_t c = s.find(',', pos);
    if (c == std::string::npos) c = s.size();
    char* end = nullptr;
    unsigned long v = std::strtoul(s.c_str() + pos, &end, 10);
    if (end == s.c_str() + pos) return false;
    if (*end == 'K' || *end == 'k') v <<= 10, ++end;
    else if (*end == 'M' || *end == 'm') v <<= 20, ++end;
    if (end != s.c_str() + c || v == 0 || v > (16ul << 20)) return false;
    out->push_back(static_cast<uint32_t>(v));
    pos = c + 1;
  }
  return !out->empty();
}

struct Side {
  std::unique_ptr<npu::Device> dev;
  npu::NetInfo net;
  npu::Mapping hbm;
  uint32_t key = 0;
};

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "hcomm-roce-bench: %s\n", what.c_str());
  std::exit(1);
}

void check(const Status& st, const char* what) {
  if (!st) die(std::string(what) + ": " + st.to_string());
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = default_sim_dir();
  std::vector<uint32_t> sizes;
  int window = 16, iters = 0, loss = 0, ack_timeout = 12;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) die(a + " needs a value");
      return argv[++i];
    };
    if (a == "--sim-dir") dir = next();
    else if (a == "--sizes") {
      if (!parse_sizes(next(), &sizes)) die("--sizes: e.g. 4K,64K,1M (at most 16M)");
    } else if (a == "--window") window = std::atoi(next().c_str());
    else if (a == "--iters") iters = std::atoi(next().c_str());
    else if (a == "--loss") loss = std::atoi(next().c_str());
    else if (a == "--ack-timeout") ack_timeout = std::atoi(next().c_str());
    else
      die("usage: hcomm-roce-bench [--sim-dir DIR] [--sizes 4K,64K,1M] [--window W] [--iters N] [--loss P] "
          "[--ack-timeout CODE]");
  }
  if (sizes.empty()) sizes = {4096, 65536, 1u << 20};
  if (window < 1 || window > 64) die("--window is 1..64");
  if (loss < 0 || loss > 50) die("--loss is 0..50 (percent)");
  if (ack_timeout < 1 || ack_timeout > 31) die("--ack-timeout is 1..31 (4.096 us x 2^CODE)");
  Side s[2];
  for (int k = 0; k < 2; ++k) {
    std::unique_ptr<driver::Link> link;
    check(driver::open_vfio_user(dir + "/npu" + std::to_string(k) + ".sock", &link, 3000), "open");
    check(npu::Device::open(std::move(link), &s[k].dev), "bring-up");
    check(s[k].dev->net_info(&s[k].net), "port");
    const uint64_t need = 2ull * window * sizes.back();
    if (s[k].dev->info().hbm_size < need) die("HBM too small for the window: start hcomm-sim with a larger --hbm");
    check(s[k].dev->map_hbm(0, need, npu::access::RW, &s[k].hbm), "map HBM");
    check(s[k].dev->mr_register(s[k].hbm.iova, need, rdma::access::ALL, &s[k].key), "key");
  }
  npu::QpOptions o;
  o.sq_log2 = 7;
  o.cq_log2 = 8;
  o.timeout = static_cast<uint8_t>(ack_timeout);
  std::unique_ptr<npu::RdmaQp> qa, qb;
  check(s[0].dev->create_qp(o, &qa), "QP");
  check(s[1].dev->create_qp(o, &qb), "QP");
  npu::QpPeer pa{qb->qpn(), s[1].net.ip, {}, 0}, pb{qa->qpn(), s[0].net.ip, {}, 0};
  std::memcpy(pa.mac, s[1].net.mac, 6);
  std::memcpy(pb.mac, s[0].net.mac, 6);
  check(qa->connect(pa), "connect");
  check(qb->connect(pb), "connect");

  auto wqe = [&](rdma::WrOp op, uint32_t len, uint64_t off) {
    return rdma::make_wqe(op, s[0].hbm.iova + off, s[0].key, len, s[1].hbm.iova + off, s[1].key, 0);
  };
  auto run = [&](const char* label) {
    std::printf("%s (window %d, path MTU 4096, local ACK timeout %.1f ms)\n", label, window,
                4.096e-3 * static_cast<double>(1u << ack_timeout));
    std::printf("  %10s %12s %14s %12s %9s %9s\n", "bytes", "WRITE MB/s", "packets/s", "retransmits", "seq NAKs",
                "timeouts");
    for (uint32_t size : sizes) {
      const int n = iters > 0 ? iters : std::max(8, static_cast<int>((256u << 20) / size / static_cast<uint32_t>(window)));
      npu::NetInfo before, after, rb, ra;
      check(s[0].dev->net_info(&before), "counters");
      check(s[1].dev->net_info(&rb), "counters");
      std::vector<rdma::Cqe> c(static_cast<size_t>(window));
      const auto t0 = Clock::now();
      for (int it = 0; it < n; ++it) {
        for (int k = 0; k < window; ++k)
          if (qa->post_send(wqe(rdma::WrOp::WRITE, size, static_cast<uint64_t>(k) * size)) != Code::ok) die("SQ full");
        check(qa->wait(static_cast<uint32_t>(window), c, Deadline::after_ms(60000)), "completions");
        for (const auto& x : c)
          if (x.status != 0) die(std::string("WRITE failed: ") + rdma::wc_status_name(static_cast<rdma::WcStatus>(x.status)));
      }
      const double sec = std::chrono::duration<double>(Clock::now() - t0).count();
      check(s[0].dev->net_info(&after), "counters");
      check(s[1].dev->net_info(&ra), "counters");
      const double bytes = static_cast<double>(size) * window * n;
      const uint64_t frames = (after.counters[0] - before.counters[0]) + (ra.counters[0] - rb.counters[0]);
      auto delta = [&](uint32_t i) {
        return static_cast<unsigned long long>((after.counters[i] - before.counters[i]) + (ra.counters[i] - rb.counters[i]));
      };
      namespace nc = hcomm::hal::abi::net_counter;
      std::printf("  %10u %12.1f %14.0f %12llu %9llu %9llu\n", size, bytes / sec / 1e6,
                  static_cast<double>(frames) / sec, delta(nc::RETRANSMITS), delta(nc::SEQ_NAKS_RCVD),
                  delta(nc::TIMEOUTS));
    }
    for (rdma::WrOp op : {rdma::WrOp::WRITE, rdma::WrOp::READ}) {
      std::vector<double> us;
      rdma::Cqe c;
      for (int it = 0; it < 2000; ++it) {
        const auto t0 = Clock::now();
        if (qa->post_send(wqe(op, 8, 0)) != Code::ok) die("SQ full");
        check(qa->wait(1, {&c, 1}, Deadline::after_ms(10000)), "completion");
        if (c.status != 0) die("8-byte operation failed");
        us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      }
      std::sort(us.begin(), us.end());
      std::printf("  8-byte %-5s latency: median %.1f us, p99 %.1f us (2000 samples)\n",
                  op == rdma::WrOp::WRITE ? "WRITE" : "READ", us[us.size() / 2], us[us.size() * 99 / 100]);
    }
  };
  std::printf("hcomm-roce-bench: %s -> %s, QP %u -> %u\n", hal::abi::roce::ip_string(s[0].net.ip).c_str(),
              hal::abi::roce::ip_string(s[1].net.ip).c_str(), qa->qpn(), qb->qpn());
  if (control(dir, "net clear") != "ok") die("control socket: " + dir + "/control.sock");
  run("clean link");
  if (loss > 0) {
    const std::string r = control(dir, "net faults drop=" + std::to_string(loss) + " seed=1");
    if (r != "ok") die("net faults: " + r);
    run((std::to_string(loss) + "% of frames dropped").c_str());
    std::printf("  %s\n", control(dir, "net stats").c_str());
    (void)control(dir, "net clear");
  }
  return 0;
}
