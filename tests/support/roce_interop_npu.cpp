// The NPU side of the Soft-RoCE interoperation test (tests/qemu/run-roce-interop.sh):
// an NPU of a running hcomm-sim (node 0: 10.0.0.1), driven through the HAL
// like the library drives it (hal/npu: its HBM mapped, a memory key, an RC
// queue pair on the device's rings), whose switch's uplink is a QEMU
// `-netdev dgram` link. This program sits on that link between the
// simulator and a guest's virtio NIC with Linux's rxe on it (10.0.0.2):
// it forwards every frame both ways, captures them (--pcap), and answers
// the text side channel on UDP port 18515 of the NPU's address itself (the
// NPU's port speaks RoCE and ARP only). The guest runs
// tests/qemu/roce/rxe_interop.cpp; the two exchange QP numbers, PSNs and
// keys over that side channel, then:
//   phase 1, the guest's verbs into the NPU's HBM: RDMA WRITE and READ (one
//     packet and ten), FETCH_ADD, CMP_SWAP, SEND (one and five packets); on
//     CHECK1 this side checks the HBM and the receive completions and
//     answers RESULT1;
//   phase 2, the NPU into the guest's registered memory: WRITE, READ,
//     FETCH_ADD, CMP_SWAP, SEND (one and six packets), WRITE_WITH_IMM,
//     posted on the NPU's send queue; this side checks what it read and
//     fetched and answers RESULT2; the guest checks its memory and says
//     CHECK2 ok.
// Exit 0 when both sides found every byte right.
//   roce_interop_npu --sim-dir DIR --guest LOCAL:REMOTE --sim LOCAL:REMOTE --pcap FILE [--timeout S]
// (--guest: the guest's link, --sim: the simulator's uplink, both as
// LOCAL:REMOTE UDP ports on 127.0.0.1.)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "driver/vfio_user_link.h"
#include "hal/abi/regs.h"
#include "hal/abi/roce.h"
#include "hal/npu/device.h"
#include "hal/npu/rdma_qp.h"
#include "sim/roce/port.h"

using namespace hcomm;
namespace wire = hal::abi::roce;
namespace rdma = hal::abi::rdma;
namespace npu = hal::npu;

namespace {

constexpr size_t kMem = 1 << 20;         // HBM the guest may reach
constexpr uint16_t kSidePort = 18515;
constexpr uint32_t kSqPsn = 0xffffe0;  // both directions cross the 24-bit PSN wrap

// The byte at index i of the test pattern `seed` (the guest has the same).
uint8_t pat(int seed, size_t i) { return static_cast<uint8_t>(seed * 131 + i * 7 + (i >> 8) * 13); }

struct Hbm {
  uint8_t* base = nullptr;  // the NPU's HBM, mapped into this process (BAR)
  uint64_t iova = 0;        // where the device sees it
  uint8_t* at(uint64_t off) const { return base + off; }
  void fill(uint64_t off, size_t n, int seed) const {
    for (size_t i = 0; i < n; ++i) base[off + i] = pat(seed, i);
  }
  // "" when [off, off + n) holds pattern seed, else what differs.
  std::string check(uint64_t off, size_t n, int seed, const char* what) const {
    for (size_t i = 0; i < n; ++i)
      if (base[off + i] != pat(seed, i))
        return std::string(what) + ": byte " + std::to_string(i) + " is " + std::to_string(base[off + i]) +
               ", want " + std::to_string(pat(seed, i)) + "; ";
    return "";
  }
};

uint64_t now_ns() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

bool parse_ports(const char* s, uint16_t* l, uint16_t* r) {
  unsigned a = 0, b = 0;
  if (std::sscanf(s, "%u:%u", &a, &b) != 2 || a == 0 || a > 65535 || b == 0 || b > 65535) return false;
  *l = static_cast<uint16_t>(a);
  *r = static_cast<uint16_t>(b);
  return true;
}

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "roce_interop_npu: %s\n", what.c_str());
  std::exit(1);
}

void check(const Status& st, const char* what) {
  if (!st) die(std::string(what) + ": " + st.to_string());
}

struct Guest {
  uint8_t mac[6] = {};
  uint32_t ip = 0;
  uint16_t port = 0;
};

}  // namespace

int main(int argc, char** argv) {
  std::string sim_dir, pcap;
  uint16_t gl = 0, gr = 0, sl = 0, sr = 0;
  int timeout_s = 150;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has = i + 1 < argc;
    if (a == "--sim-dir" && has) {
      sim_dir = argv[++i];
    } else if (a == "--guest" && has) {
      if (!parse_ports(argv[++i], &gl, &gr)) die("--guest LOCAL:REMOTE");
    } else if (a == "--sim" && has) {
      if (!parse_ports(argv[++i], &sl, &sr)) die("--sim LOCAL:REMOTE");
    } else if (a == "--pcap" && has) {
      pcap = argv[++i];
    } else if (a == "--timeout" && has) {
      timeout_s = std::atoi(argv[++i]);
    } else {
      die("usage: roce_interop_npu --sim-dir DIR --guest LOCAL:REMOTE --sim LOCAL:REMOTE --pcap FILE [--timeout S]");
    }
  }
  if (sim_dir.empty() || gl == 0 || sl == 0) die("--sim-dir, --guest and --sim are required");

  sim::roce::DgramPort to_guest, to_sim;
  sim::roce::PcapWriter cap;
  check(to_guest.open(gl, gr), "the guest's link");
  check(to_sim.open(sl, sr), "the simulator's uplink");
  if (!pcap.empty()) check(cap.open(pcap), "capture");

  // The NPU, through the HAL: HBM mapped for the device and this process,
  // one key over it, one RC queue pair.
  std::unique_ptr<driver::Link> link;
  std::unique_ptr<npu::Device> dev;
  check(driver::open_vfio_user(sim_dir + "/npu0.sock", &link, 5000), "open npu0");
  check(npu::Device::open(std::move(link), &dev), "bring-up");
  npu::NetInfo net;
  check(dev->net_info(&net), "port");
  if (!net.link_up) die("the NPU's port is down");
  if (dev->info().hbm_size < kMem) die("HBM smaller than 1 MiB");
  if (dev->hbm() == nullptr) die("the link cannot map the HBM into this process");
  npu::Mapping map;
  check(dev->map_hbm(0, kMem, npu::access::RW, &map), "map HBM");
  uint32_t key = 0;
  check(dev->mr_register(map.iova, kMem, rdma::access::ALL, &key), "memory key");
  const Hbm hbm{dev->hbm(), map.iova};
  std::memset(hbm.base, 0, kMem);
  npu::QpOptions qo;
  qo.path_mtu = 3;  // 1024: rxe's active MTU on a 1500-byte netdev
  qo.timeout = 14;  // 67 ms: a TCG guest answers slowly
  qo.max_rd_atomic = 4;
  qo.sq_psn = kSqPsn;
  std::unique_ptr<npu::RdmaQp> qp;
  check(dev->create_qp(qo, &qp), "queue pair");
  std::printf("roce_interop_npu: NPU %s (%s), QP %u, key 0x%x over HBM IOVA 0x%llx\n",
              wire::ip_string(net.ip).c_str(), wire::mac_string(net.mac).c_str(), qp->qpn(), key,
              static_cast<unsigned long long>(hbm.iova));

  // Phase 1 data: what the guest reads, the word it updates.
  hbm.fill(0x10000, 100, 2);
  hbm.fill(0x11000, 10000, 2);
  const uint64_t word0 = 1000;
  std::memcpy(hbm.at(0x20000), &word0, 8);
  // Phase 2 data: what the NPU writes and sends.
  hbm.fill(0x40000, 100, 3);
  hbm.fill(0x41000, 10000, 3);
  hbm.fill(0x70000, 300, 5);
  hbm.fill(0x71000, 6000, 6);
  hbm.fill(0x78000, 4000, 7);

  Guest guest;
  bool have_guest = false, phase2_posted = false, guest_ok = false, phase1_checked = false;
  uint32_t g_rkey = 0;
  uint64_t g_va = 0;
  std::string result1, result2;
  std::vector<rdma::Cqe> cqes;
  uint64_t t = now_ns(), bye_at = 0;

  auto reply = [&](const std::string& text) {
    std::vector<uint8_t> f(wire::kL2L4Len + text.size());
    std::memcpy(f.data(), guest.mac, 6);
    std::memcpy(f.data() + 6, net.mac, 6);
    wire::put16(&f[12], wire::kEtherIPv4);
    uint8_t* ip = &f[14];
    ip[0] = 0x45;
    wire::put16(ip + 2, static_cast<uint16_t>(20 + 8 + text.size()));
    wire::put16(ip + 6, 0x4000);
    ip[8] = 64;
    ip[9] = 17;
    wire::put32(ip + 12, net.ip);
    wire::put32(ip + 16, guest.ip);
    wire::put16(ip + 10, wire::ipv4_checksum(ip));
    uint8_t* udp = ip + 20;
    wire::put16(udp, kSidePort);
    wire::put16(udp + 2, guest.port);
    wire::put16(udp + 4, static_cast<uint16_t>(8 + text.size()));
    std::memcpy(udp + 8, text.data(), text.size());
    cap.write(f.data(), f.size(), t);
    (void)to_guest.send(f.data(), f.size());
  };

  auto wqe = [&](rdma::WrOp op, uint64_t loff, uint32_t len, uint64_t raddr, uint64_t id) {
    return rdma::make_wqe(op, hbm.iova + loff, key, len, raddr, g_rkey, id);
  };
  auto post_recv = [&](uint64_t id, uint64_t off, uint32_t len) {
    rdma::RecvWqe r{};
    r.wr_id = id;
    r.laddr = hbm.iova + off;
    r.lkey = key;
    r.length = len;
    if (qp->post_recv(r) != Code::ok) die("receive queue full");
  };

  // A frame from the guest for the side channel (UDP to the NPU's address,
  // port 18515): handled here and not forwarded.
  auto handle_side = [&](const uint8_t* f, size_t n) -> bool {
    if (n < wire::kL2L4Len || wire::get16(f + 12) != wire::kEtherIPv4) return false;
    const uint8_t* ip = f + 14;
    if (ip[0] != 0x45 || ip[9] != 17 || wire::get32(ip + 16) != net.ip) return false;
    const uint8_t* udp = ip + 20;
    if (wire::get16(udp + 2) != kSidePort) return false;
    const size_t ulen = wire::get16(udp + 4);
    if (ulen < 8 || 14 + 20 + ulen > n) return true;
    const std::string msg(reinterpret_cast<const char*>(udp + 8), ulen - 8);
    std::memcpy(guest.mac, f + 6, 6);
    guest.ip = wire::get32(ip + 12);
    guest.port = wire::get16(udp);
    unsigned g_qpn = 0, g_psn = 0, rk = 0;
    unsigned long long va = 0;
    if (std::sscanf(msg.c_str(), "HELLO %u %u %u %llu", &g_qpn, &g_psn, &rk, &va) == 4) {
      if (!have_guest) {
        have_guest = true;
        g_rkey = rk;
        g_va = va;
        npu::QpPeer peer;
        peer.qpn = g_qpn;
        peer.ip = guest.ip;
        std::memcpy(peer.mac, guest.mac, 6);
        peer.psn = g_psn;
        peer.path_mtu = 3;
        check(qp->connect(peer), "connect");
        post_recv(901, 0x30000, 4096);
        post_recv(902, 0x32000, 8192);
        std::printf("roce_interop_npu: guest %s (%s) QP %u PSN %u rkey 0x%x va 0x%llx; NPU QP %u PSN %u\n",
                    wire::ip_string(guest.ip).c_str(), wire::mac_string(guest.mac).c_str(), g_qpn, g_psn, rk, va,
                    qp->qpn(), kSqPsn);
      }
      reply("HELLO " + std::to_string(qp->qpn()) + " " + std::to_string(kSqPsn) + " " + std::to_string(key) + " " +
            std::to_string(hbm.iova));
    } else if (msg.rfind("CHECK1", 0) == 0) {
      if (!phase1_checked) {
        phase1_checked = true;
        std::printf("roce_interop_npu: guest phase 1: %s\n", msg.c_str());
        std::string bad = msg == "CHECK1 ok" ? "" : "the guest's own checks failed; ";
        bad += hbm.check(0x0, 100, 1, "guest WRITE 100 B");
        bad += hbm.check(0x1000, 10000, 1, "guest WRITE 10000 B");
        uint64_t w;
        std::memcpy(&w, hbm.at(0x20000), 8);
        if (w != 77) bad += "atomic word " + std::to_string(w) + ", want 77; ";
        std::vector<rdma::Cqe> recvs;
        for (const rdma::Cqe& c : cqes)
          if (c.opcode & 0x80) recvs.push_back(c);
        if (recvs.size() != 2 || recvs[0].wr_id != 901 || recvs[0].byte_len != 200 || recvs[1].wr_id != 902 ||
            recvs[1].byte_len != 5000 || recvs[0].status != 0 || recvs[1].status != 0)
          bad += "receive completions wrong (" + std::to_string(recvs.size()) + "); ";
        bad += hbm.check(0x30000, 200, 8, "SEND 200 B");
        bad += hbm.check(0x32000, 5000, 9, "SEND 5000 B");
        result1 = bad.empty() ? "RESULT1 ok" : "RESULT1 fail: " + bad;
        std::printf("roce_interop_npu: phase 1 (guest -> NPU): %s\n", result1.c_str());
      }
      reply(result1);
    } else if (msg.rfind("GO2", 0) == 0) {
      if (have_guest && !phase2_posted) {
        phase2_posted = true;
        cqes.clear();
        const uint64_t g = g_va;
        std::vector<rdma::SendWqe> ws = {
            wqe(rdma::WrOp::WRITE, 0x40000, 100, g + 0x40000, 1),
            wqe(rdma::WrOp::WRITE, 0x41000, 10000, g + 0x41000, 2),
            wqe(rdma::WrOp::READ, 0x50000, 100, g + 0x50000, 3),
            wqe(rdma::WrOp::READ, 0x51000, 10000, g + 0x51000, 4),
            wqe(rdma::WrOp::FETCH_ADD, 0x60000, 8, g + 0x60000, 5),
            wqe(rdma::WrOp::CMP_SWAP, 0x60008, 8, g + 0x60000, 6),
            wqe(rdma::WrOp::SEND, 0x70000, 300, 0, 7),
            wqe(rdma::WrOp::SEND, 0x71000, 6000, 0, 8),
            wqe(rdma::WrOp::WRITE_IMM, 0x78000, 4000, g + 0x78000, 9),
        };
        ws[4].swap_add = 7;
        ws[5].compare = 2007;
        ws[5].swap_add = 42;
        ws[8].imm = 0x12345678;
        for (const rdma::SendWqe& w : ws)
          if (qp->post_send(w) != Code::ok) die("send queue full");
      }
      reply(result2.empty() ? "WAIT2" : result2);
    } else if (msg.rfind("CHECK2", 0) == 0) {
      std::printf("roce_interop_npu: guest phase 2: %s\n", msg.c_str());
      guest_ok = msg == "CHECK2 ok";
      reply("BYE");
      if (bye_at == 0) bye_at = t;
    }
    return true;
  };

  std::vector<uint8_t> buf(wire::kMaxFrame + 64);
  const uint64_t deadline = t + static_cast<uint64_t>(timeout_s) * 1'000'000'000ull;
  bool failed_qp = false;
  // Up to 32 frames from one link to the other, each captured; frames the
  // side channel takes (guest -> NPU only) stop here. True when any came.
  auto relay = [&](sim::roce::DgramPort& from, const char* from_name, sim::roce::DgramPort& to, const char* to_name,
                   bool side) {
    bool any = false;
    for (int k = 0; k < 32; ++k) {
      size_t n = 0;
      check(from.recv(buf.data(), buf.size(), &n, 0), from_name);
      if (n == 0) break;
      any = true;
      t = now_ns();
      cap.write(buf.data(), n, t);
      if (!(side && handle_side(buf.data(), n))) check(to.send(buf.data(), n), to_name);
    }
    return any;
  };
  while (t < deadline) {
    bool moved = relay(to_guest, "the guest's link", to_sim, "the simulator's uplink", true);
    moved |= relay(to_sim, "the simulator's uplink", to_guest, "the guest's link", false);
    rdma::Cqe c[16];
    const uint32_t got = qp->poll(c);
    for (uint32_t i = 0; i < got; ++i) cqes.push_back(c[i]);
    t = now_ns();
    if (phase2_posted && result2.empty()) {
      size_t sends = 0;
      for (const rdma::Cqe& x : cqes)
        if ((x.opcode & 0x80) == 0) ++sends;
      if (sends >= 9) {
        std::string bad;
        for (const rdma::Cqe& x : cqes)
          if (x.status != 0)
            bad += "wr " + std::to_string(x.wr_id) + ": " +
                   rdma::wc_status_name(static_cast<rdma::WcStatus>(x.status)) + "; ";
        bad += hbm.check(0x50000, 100, 4, "READ 100 B");
        bad += hbm.check(0x51000, 10000, 4, "READ 10000 B");
        uint64_t r[2];
        std::memcpy(r, hbm.at(0x60000), 16);
        if (r[0] != 2000) bad += "FETCH_ADD returned " + std::to_string(r[0]) + ", want 2000; ";
        if (r[1] != 2007) bad += "CMP_SWAP returned " + std::to_string(r[1]) + ", want 2007; ";
        result2 = bad.empty() ? "RESULT2 ok" : "RESULT2 fail: " + bad;
        std::printf("roce_interop_npu: phase 2 (NPU -> guest): %s\n", result2.c_str());
      }
    }
    if (bye_at != 0 && t - bye_at > 2'000'000'000ull) break;  // lingers to answer a repeated CHECK2
    if (have_guest && bye_at == 0 && got == 0 && !moved) {
      rdma::QpState st{};
      if (qp->state(&st) && st == rdma::QpState::ERR) {
        std::printf("roce_interop_npu: the NPU's QP went to ERR\n");
        failed_qp = true;
        break;
      }
    }
    if (!moved && got == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  (void)cap.close();
  npu::NetInfo end;
  if (dev->net_info(&end)) {
    namespace nc = hal::abi::net_counter;
    auto ctr = [&](uint32_t i) { return static_cast<unsigned long long>(end.counters[i]); };
    std::printf("roce_interop_npu: NPU port frames tx %llu rx %llu, bad ICRC %llu, malformed %llu, unsupported %llu, "
                "no QP %llu, not RoCE %llu, retransmits %llu, timeouts %llu, duplicates %llu, RNR NAKs sent %llu, "
                "ARP replies %llu\n",
                ctr(nc::TX_FRAMES), ctr(nc::RX_FRAMES), ctr(nc::RX_BAD_ICRC), ctr(nc::RX_MALFORMED),
                ctr(nc::RX_UNSUPPORTED), ctr(nc::RX_NO_QP), ctr(nc::RX_NOT_ROCE), ctr(nc::RETRANSMITS),
                ctr(nc::TIMEOUTS), ctr(nc::DUPLICATES), ctr(nc::RNR_NAKS_SENT), ctr(nc::ARP_REPLIES));
  }
  const bool ok = !failed_qp && result1 == "RESULT1 ok" && result2 == "RESULT2 ok" && guest_ok;
  std::printf("roce_interop_npu: %s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
