// hcomm-sim: models N NPUs on one node and serves each over vfio-user.
//
//   hcomm-sim [--devices N] [--hbm SIZE] [--queues Q] [--dir DIR]
//             [--fault "CMD"]... [--spin-us US]
//             [--front vfio-user|ivshmem] [--guest-ram FILE]
//             [--node N] [--uplink LOCAL:REMOTE | --uplink dpdk:DEVARGS] [--pcap FILE]
//
// Creates DIR/npu<i>.sock (vfio-user) or, with --front ivshmem, DIR/npu<i>.ivshmem
// (an ivshmem server socket for QEMU's ivshmem-doorbell), DIR/control.sock
// (fault injection, see sim/control.h) and, once everything listens,
// DIR/ready containing the pid. SIGINT/SIGTERM shut it down cleanly and
// remove the sockets.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "common/paths.h"
#include "sim/control.h"
#include "hcomm_config.h"
#include "sim/device.h"
#include "sim/ivshmem_front.h"
#include "sim/roce/port.h"
#include "sim/vfio_user_server.h"

namespace {

volatile sig_atomic_t g_stop = 0;
void on_signal(int) { g_stop = 1; }

bool parse_size(const char* s, uint64_t* out) {
  char* end = nullptr;
  errno = 0;
  unsigned long long v = std::strtoull(s, &end, 0);
  if (errno != 0 || end == s) return false;
  uint64_t mul = 1;
  if (*end == 'K' || *end == 'k') mul = 1ull << 10, ++end;
  else if (*end == 'M' || *end == 'm') mul = 1ull << 20, ++end;
  else if (*end == 'G' || *end == 'g') mul = 1ull << 30, ++end;
  if (*end != '\0') return false;
  if (v > (~0ull) / mul) return false;
  *out = v * mul;
  return true;
}

bool parse_u32(const char* s, uint32_t lo, uint32_t hi, uint32_t* out) {
  uint64_t v = 0;
  if (!parse_size(s, &v) || v < lo || v > hi) return false;
  *out = static_cast<uint32_t>(v);
  return true;
}

void usage() {
  std::fprintf(stderr,
               "usage: hcomm-sim [--devices N] [--hbm SIZE] [--queues Q] [--dir DIR]\n"
               "                 [--fault \"fail|corrupt|stall DEV N\"]... [--spin-us US]\n"
               "  --devices N   NPUs to model (1..16, default 2)\n"
               "  --hbm SIZE    HBM per device, e.g. 256M (default 256M)\n"
               "  --queues Q    DMA queues per device (1..16, default 4)\n"
               "  --dir DIR     socket directory (default $HCOMM_SIM_DIR or /tmp/hcomm-sim-$UID)\n"
               "  --fault CMD   a control command applied at start, e.g. \"fail 0 3\"\n"
               "  --spin-us US  engine busy-poll time before sleeping (default 50)\n"
               "  --front F     vfio-user (default: DIR/npuN.sock, for processes on this host) or\n"
               "                ivshmem (DIR/npuN.ivshmem, for QEMU guests: -device ivshmem-doorbell)\n"
               "  --guest-ram FILE  with --front ivshmem: the guest's RAM file (memory-backend-file,\n"
               "                share=on); the device DMAs into it\n"
               "  --node N      this simulator's node id (0..255): the NPUs' MACs 02:4e:50:55:N:i and\n"
               "                addresses 10.0.N.i+1 (docs/device-abi.md §16)\n"
               "  --uplink L:R  the switch's uplink: a QEMU -netdev dgram link, UDP 127.0.0.1 port L here\n"
               "                and R there (another hcomm-sim's uplink, or a guest's NIC)\n"
#if HCOMM_HAVE_DPDK
               "  --uplink dpdk:DEVARGS  the uplink on a DPDK ethdev: net_memif0,role=server|client,socket=NAME\n"
               "                (two simulators), net_tap0,iface=NAME (the kernel), or a NIC's PCI address;\n"
               "                HCOMM_SIM_DPDK_EAL adds EAL arguments\n"
#else
               "  (built without DPDK: no --uplink dpdk:DEVARGS)\n"
#endif
               "  --pcap FILE   capture every frame the switch forwards\n");
}

}  // namespace

int main(int argc, char** argv) {
  using namespace hcomm;
  uint32_t devices = 2, queues = 4, spin_us = 50;
  uint64_t hbm = 256ull << 20;
  std::string dir = default_sim_dir();
  std::vector<std::string> faults;
  std::string front = "vfio-user", guest_ram, pcap;
  uint32_t node = 0;
  std::string uplink;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "hcomm-sim: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--devices") {
      if (!parse_u32(next(), 1, 16, &devices)) return usage(), 2;
    } else if (a == "--queues") {
      if (!parse_u32(next(), 1, hal::abi::reg::MAX_QUEUES, &queues)) return usage(), 2;
    } else if (a == "--hbm") {
      if (!parse_size(next(), &hbm) || hbm == 0 || hbm % 4096 != 0 || hbm > (64ull << 30)) {
        std::fprintf(stderr, "hcomm-sim: --hbm must be a multiple of 4K, at most 64G\n");
        return 2;
      }
    } else if (a == "--dir") {
      dir = next();
    } else if (a == "--fault") {
      faults.emplace_back(next());
    } else if (a == "--spin-us") {
      if (!parse_u32(next(), 0, 1000000, &spin_us)) return usage(), 2;
    } else if (a == "--front") {
      front = next();
      if (front != "vfio-user" && front != "ivshmem") return usage(), 2;
    } else if (a == "--guest-ram") {
      guest_ram = next();
    } else if (a == "--node") {
      if (!parse_u32(next(), 0, 255, &node)) return usage(), 2;
    } else if (a == "--uplink") {
      uplink = next();
      if (!sim::roce::valid_link_spec(uplink)) {
        std::fprintf(stderr, "hcomm-sim: --uplink LOCAL_PORT:REMOTE_PORT or dpdk:DEVARGS\n");
        return 2;
      }
    } else if (a == "--pcap") {
      pcap = next();
    } else if (a == "-h" || a == "--help") {
      usage();
      return 0;
    } else {
      std::fprintf(stderr, "hcomm-sim: unknown argument '%s'\n", a.c_str());
      usage();
      return 2;
    }
  }
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    std::fprintf(stderr, "hcomm-sim: cannot create %s: %s\n", dir.c_str(), std::strerror(errno));
    return 1;
  }
  ::unlink((dir + "/ready").c_str());

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);

  sim::Fabric fabric;
  for (uint32_t d = 0; d < devices; ++d) {
    sim::DeviceConfig cfg;
    cfg.fabric_index = d;
    cfg.node = node;
    cfg.hbm_size = hbm;
    cfg.num_queues = queues;
    cfg.spin_us = spin_us;
    if (front == "ivshmem") sim::ivshmem_device_config(&cfg);
    auto dev = std::make_unique<sim::Device>(cfg, &fabric);
    if (Status st = dev->init(); !st) {
      std::fprintf(stderr, "hcomm-sim: device %u: %s\n", d, st.to_string().c_str());
      return 1;
    }
    if (Status st = fabric.add(std::move(dev)); !st) {
      std::fprintf(stderr, "hcomm-sim: %s\n", st.to_string().c_str());
      return 1;
    }
  }
  sim::Fabric::NetOptions net;
  net.uplink = uplink;
  net.run_dir = dir;
  net.pcap = pcap;
  if (Status st = fabric.start_network(net); !st) {
    std::fprintf(stderr, "hcomm-sim: network: %s\n", st.to_string().c_str());
    return 1;
  }
  for (const auto& f : faults) {
    std::string r = sim::control_command(fabric, f);
    if (r.rfind("ok", 0) != 0) {
      std::fprintf(stderr, "hcomm-sim: --fault \"%s\": %s\n", f.c_str(), r.c_str());
      return 2;
    }
  }
  std::vector<std::unique_ptr<sim::Front>> fronts;
  for (uint32_t d = 0; d < devices; ++d) {
    std::unique_ptr<sim::Front> f;
    if (front == "ivshmem") {
      sim::IvshmemFrontOptions o;
      o.guest_ram_path = guest_ram;
      f = std::make_unique<sim::IvshmemFront>(*fabric.device(d), dir + "/npu" + std::to_string(d) + ".ivshmem", o);
    } else {
      f = std::make_unique<sim::VfioUserServer>(*fabric.device(d), sim_socket_path(dir, d));
    }
    if (Status st = f->start(); !st) {
      std::fprintf(stderr, "hcomm-sim: %s\n", st.to_string().c_str());
      return 1;
    }
    std::fprintf(stderr, "hcomm-sim: npu%u: %s, HBM %llu MiB, %u queues\n", d, f->describe().c_str(),
                 static_cast<unsigned long long>(hbm >> 20), queues);
    fronts.push_back(std::move(f));
  }
  sim::ControlServer control(fabric);
  if (Status st = control.start(dir + "/control.sock"); !st) {
    std::fprintf(stderr, "hcomm-sim: %s\n", st.to_string().c_str());
    return 1;
  }
  {
    std::string tmp = dir + "/ready.tmp";
    std::ofstream(tmp) << ::getpid() << "\n";
    std::rename(tmp.c_str(), (dir + "/ready").c_str());
  }
  std::fprintf(stderr, "hcomm-sim: ready (%u devices in %s)\n", devices, dir.c_str());
  while (!g_stop) ::usleep(100 * 1000);
  std::fprintf(stderr, "hcomm-sim: shutting down\n");
  ::unlink((dir + "/ready").c_str());
  control.stop();
  for (auto& f : fronts) f->stop();
  return 0;
}
