// The NPU side of the Soft-RoCE interoperation test (tests/qemu/run-roce-interop.sh):
// hcomm-sim's RoCEv2 engine (sim/roce/rc.h) with 1 MiB of "HBM", on a QEMU
// `-netdev dgram` link (sim/roce/port.h) whose other end is a guest's
// virtio NIC with Linux's rxe on it. The guest runs tests/qemu/roce/
// rxe_interop.cpp; the two exchange QP numbers, PSNs and keys as text over
// UDP on the same wire (port 18515 of the engine's address), then:
//   phase 1, the guest's verbs into the engine's memory: RDMA WRITE and READ
//     (one packet and ten), FETCH_ADD, CMP_SWAP, SEND (one and five packets);
//     on CHECK1 this side checks its memory and receives and answers RESULT1;
//   phase 2, the engine into the guest's registered memory: WRITE, READ,
//     FETCH_ADD, CMP_SWAP, SEND (one and six packets), WRITE_WITH_IMM; this
//     side checks what it read and fetched and answers RESULT2; the guest
//     checks its memory and says CHECK2 ok.
// Every frame that crosses the link goes to the capture (--pcap). Exit 0
// when both sides found every byte right.
//   roce_interop_npu --port LOCAL:REMOTE --pcap FILE [--timeout S]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "hal/abi/desc.h"
#include "sim/roce/port.h"
#include "sim/roce/rc.h"

using namespace hcomm::sim::roce;
namespace wire = hcomm::hal::abi::roce;
namespace rdma = hcomm::hal::abi::rdma;

namespace {

constexpr uint64_t kBase = 0x100000;  // IOVA of the engine's memory
constexpr size_t kMem = 1 << 20;
constexpr uint32_t kKey = rdma::make_key(1, 0x11);
constexpr uint32_t kIp = 0x0a000001;  // 10.0.0.1 (the guest is 10.0.0.2)
constexpr uint16_t kSidePort = 18515;
constexpr uint32_t kSqPsn = 0xffffe0;  // both directions cross the 24-bit PSN wrap

// The byte at index i of the test pattern `seed` (the guest has the same).
uint8_t pat(int seed, size_t i) { return static_cast<uint8_t>(seed * 131 + i * 7 + (i >> 8) * 13); }

class Hbm : public MemoryAccess {
 public:
  std::vector<uint8_t> bytes = std::vector<uint8_t>(kMem);
  uint8_t* map(uint64_t iova, uint64_t len, bool) override {
    if (iova < kBase || len > kMem || iova - kBase > kMem - len) return nullptr;
    return bytes.data() + (iova - kBase);
  }
  uint8_t* at(uint64_t off) { return bytes.data() + off; }
  void fill(uint64_t off, size_t n, int seed) {
    for (size_t i = 0; i < n; ++i) bytes[off + i] = pat(seed, i);
  }
  // "" when [off, off + n) holds pattern seed, else what differs.
  std::string check(uint64_t off, size_t n, int seed, const char* what) const {
    for (size_t i = 0; i < n; ++i)
      if (bytes[off + i] != pat(seed, i))
        return std::string(what) + ": byte " + std::to_string(i) + " is " + std::to_string(bytes[off + i]) +
               ", want " + std::to_string(pat(seed, i)) + "; ";
    return "";
  }
};

uint64_t now_ns() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

struct Side {
  uint8_t mac[6] = {};
  uint32_t ip = 0;
  uint16_t port = 0;
};

}  // namespace

int main(int argc, char** argv) {
  uint16_t lport = 0, rport = 0;
  std::string pcap;
  int timeout_s = 150;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--port" && i + 1 < argc) {
      unsigned l = 0, r = 0;
      if (std::sscanf(argv[++i], "%u:%u", &l, &r) != 2 || l == 0 || l > 65535 || r == 0 || r > 65535) {
        std::fprintf(stderr, "roce_interop_npu: --port LOCAL:REMOTE\n");
        return 2;
      }
      lport = static_cast<uint16_t>(l);
      rport = static_cast<uint16_t>(r);
    } else if (a == "--pcap" && i + 1 < argc) {
      pcap = argv[++i];
    } else if (a == "--timeout" && i + 1 < argc) {
      timeout_s = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: roce_interop_npu --port LOCAL:REMOTE --pcap FILE [--timeout S]\n");
      return 2;
    }
  }
  if (lport == 0) {
    std::fprintf(stderr, "roce_interop_npu: --port is required\n");
    return 2;
  }
  DgramPort port;
  PcapWriter cap;
  if (hcomm::Status st = port.open(lport, rport); !st.is_ok()) {
    std::fprintf(stderr, "roce_interop_npu: %s\n", st.to_string().c_str());
    return 1;
  }
  if (!pcap.empty()) {
    if (hcomm::Status st = cap.open(pcap); !st.is_ok()) {
      std::fprintf(stderr, "roce_interop_npu: %s\n", st.to_string().c_str());
      return 1;
    }
  }
  Hbm hbm;
  MrTable mrs(16);
  rdma::MrEntry e{};
  e.iova = kBase;
  e.length = kMem;
  e.key = kKey;
  e.access = rdma::access::ALL;
  if (!mrs.set(e).is_ok()) return 1;
  PortAddr addr;
  const uint8_t mac[6] = {0x02, 0x4e, 0x50, 0x55, 0x00, 0x01};
  std::memcpy(addr.mac, mac, 6);
  addr.ip = kIp;
  std::vector<rdma::Cqe> cqes;
  uint64_t t = now_ns();
  Engine eng(
      addr, hbm, mrs,
      [&](const uint8_t* f, size_t n) {
        cap.write(f, n, t);
        if (hcomm::Status st = port.send(f, n); !st.is_ok())
          std::fprintf(stderr, "roce_interop_npu: %s\n", st.to_string().c_str());
      },
      [&](const rdma::Cqe& c) { cqes.push_back(c); });

  // Phase 1 data: what the guest reads, the word it updates, receive buffers.
  hbm.fill(0x10000, 100, 2);
  hbm.fill(0x11000, 10000, 2);
  const uint64_t word0 = 1000;
  std::memcpy(hbm.at(0x20000), &word0, 8);
  // Phase 2 data: what the engine writes and sends.
  hbm.fill(0x40000, 100, 3);
  hbm.fill(0x41000, 10000, 3);
  hbm.fill(0x70000, 300, 5);
  hbm.fill(0x71000, 6000, 6);
  hbm.fill(0x78000, 4000, 7);

  uint32_t qpn = 0;
  Side guest;
  bool have_guest = false, phase2_posted = false, guest_ok = false;
  uint32_t g_rkey = 0;
  uint64_t g_va = 0;
  std::string result1, result2;
  bool phase1_checked = false;
  uint64_t bye_at = 0;

  auto reply = [&](const std::string& text) {
    std::vector<uint8_t> f(wire::kL2L4Len + text.size());
    std::memcpy(f.data(), guest.mac, 6);
    std::memcpy(f.data() + 6, mac, 6);
    wire::put16(&f[12], wire::kEtherIPv4);
    uint8_t* ip = &f[14];
    ip[0] = 0x45;
    wire::put16(ip + 2, static_cast<uint16_t>(20 + 8 + text.size()));
    wire::put16(ip + 6, 0x4000);
    ip[8] = 64;
    ip[9] = 17;
    wire::put32(ip + 12, kIp);
    wire::put32(ip + 16, guest.ip);
    wire::put16(ip + 10, wire::ipv4_checksum(ip));
    uint8_t* udp = ip + 20;
    wire::put16(udp, kSidePort);
    wire::put16(udp + 2, guest.port);
    wire::put16(udp + 4, static_cast<uint16_t>(8 + text.size()));
    std::memcpy(udp + 8, text.data(), text.size());
    cap.write(f.data(), f.size(), t);
    (void)port.send(f.data(), f.size());
  };

  auto post = [&](rdma::WrOp op, uint64_t loff, uint32_t len, uint64_t raddr, uint64_t id) {
    return rdma::make_wqe(op, kBase + loff, kKey, len, raddr, g_rkey, id);
  };

  auto handle_side = [&](const uint8_t* f, size_t n) -> bool {
    // IPv4/UDP to our address and side-channel port?
    if (n < wire::kL2L4Len || wire::get16(f + 12) != wire::kEtherIPv4) return false;
    const uint8_t* ip = f + 14;
    if (ip[0] != 0x45 || ip[9] != 17 || wire::get32(ip + 16) != kIp) return false;
    const uint8_t* udp = ip + 20;
    if (wire::get16(udp + 2) != kSidePort) return false;
    const size_t ulen = wire::get16(udp + 4);
    if (ulen < 8 || 14 + 20 + ulen > n) return true;
    std::string msg(reinterpret_cast<const char*>(udp + 8), ulen - 8);
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
        qpn = eng.create_qp();
        rdma::QpAttr a{};
        a.state = static_cast<uint8_t>(rdma::QpState::INIT);
        (void)eng.modify_qp(qpn, a);
        a.state = static_cast<uint8_t>(rdma::QpState::RTR);
        a.path_mtu = 3;  // 1024: rxe's active MTU on a 1500-byte netdev
        a.dest_qpn = g_qpn;
        a.rq_psn = g_psn;
        a.remote_ip = guest.ip;
        std::memcpy(a.remote_mac, guest.mac, 6);
        a.min_rnr_timer = 12;  // 0.64 ms
        hcomm::Status st = eng.modify_qp(qpn, a);
        a.state = static_cast<uint8_t>(rdma::QpState::RTS);
        a.retry_cnt = 7;
        a.rnr_retry = 7;
        a.timeout = 14;  // 67 ms: a TCG guest answers slowly
        a.max_rd_atomic = 4;
        a.sq_psn = kSqPsn;
        if (st.is_ok()) st = eng.modify_qp(qpn, a);
        if (!st.is_ok()) {
          std::fprintf(stderr, "roce_interop_npu: connect: %s\n", st.to_string().c_str());
          std::exit(1);
        }
        rdma::RecvWqe r{};
        r.wr_id = 901;
        r.laddr = kBase + 0x30000;
        r.lkey = kKey;
        r.length = 4096;
        (void)eng.post_recv(qpn, r);
        r.wr_id = 902;
        r.laddr = kBase + 0x32000;
        r.length = 8192;
        (void)eng.post_recv(qpn, r);
        std::printf("roce_interop_npu: guest %s (%s) QP %u PSN %u rkey 0x%x va 0x%llx; our QP %u PSN %u\n",
                    wire::ip_string(guest.ip).c_str(), wire::mac_string(guest.mac).c_str(), g_qpn, g_psn, rk, va,
                    qpn, kSqPsn);
      }
      reply("HELLO " + std::to_string(qpn) + " " + std::to_string(kSqPsn) + " " + std::to_string(kKey) + " " +
            std::to_string(kBase));
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
        std::printf("roce_interop_npu: phase 1 (guest -> engine): %s\n", result1.c_str());
      }
      reply(result1);
    } else if (msg.rfind("GO2", 0) == 0) {
      if (have_guest && !phase2_posted) {
        phase2_posted = true;
        cqes.clear();
        const uint64_t g = g_va;
        std::vector<rdma::SendWqe> ws = {
            post(rdma::WrOp::WRITE, 0x40000, 100, g + 0x40000, 1),
            post(rdma::WrOp::WRITE, 0x41000, 10000, g + 0x41000, 2),
            post(rdma::WrOp::READ, 0x50000, 100, g + 0x50000, 3),
            post(rdma::WrOp::READ, 0x51000, 10000, g + 0x51000, 4),
            post(rdma::WrOp::FETCH_ADD, 0x60000, 8, g + 0x60000, 5),
            post(rdma::WrOp::CMP_SWAP, 0x60008, 8, g + 0x60000, 6),
            post(rdma::WrOp::SEND, 0x70000, 300, 0, 7),
            post(rdma::WrOp::SEND, 0x71000, 6000, 0, 8),
            post(rdma::WrOp::WRITE_IMM, 0x78000, 4000, g + 0x78000, 9),
        };
        ws[4].swap_add = 7;
        ws[5].compare = 2007;
        ws[5].swap_add = 42;
        ws[8].imm = 0x12345678;
        for (const rdma::SendWqe& w : ws) (void)eng.post_send(qpn, w);
      }
      if (!result2.empty()) {
        reply(result2);
      } else {
        reply("WAIT2");
      }
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
  while (t < deadline) {
    size_t n = 0;
    if (hcomm::Status st = port.recv(buf.data(), buf.size(), &n, eng.busy() ? 1 : 20); !st.is_ok()) {
      std::fprintf(stderr, "roce_interop_npu: %s\n", st.to_string().c_str());
      return 1;
    }
    t = now_ns();
    if (n > 0) {
      cap.write(buf.data(), n, t);
      if (!handle_side(buf.data(), n)) eng.rx(buf.data(), n, t);
    }
    (void)eng.poll(t);
    if (phase2_posted && result2.empty() && cqes.size() >= 9) {
      std::string bad;
      for (const rdma::Cqe& c : cqes)
        if (c.status != 0)
          bad += "wr " + std::to_string(c.wr_id) + ": " + rdma::wc_status_name(static_cast<rdma::WcStatus>(c.status)) +
                 "; ";
      bad += hbm.check(0x50000, 100, 4, "READ 100 B");
      bad += hbm.check(0x51000, 10000, 4, "READ 10000 B");
      uint64_t r[2];
      std::memcpy(r, hbm.at(0x60000), 16);
      if (r[0] != 2000) bad += "FETCH_ADD returned " + std::to_string(r[0]) + ", want 2000; ";
      if (r[1] != 2007) bad += "CMP_SWAP returned " + std::to_string(r[1]) + ", want 2007; ";
      result2 = bad.empty() ? "RESULT2 ok" : "RESULT2 fail: " + bad;
      std::printf("roce_interop_npu: phase 2 (engine -> guest): %s\n", result2.c_str());
    }
    if (bye_at != 0 && t - bye_at > 2'000'000'000ull) break;  // lingers to answer a repeated CHECK2
    if (!eng.busy() && n == 0 && bye_at == 0 && eng.qp_state(qpn) == rdma::QpState::ERR) {
      std::printf("roce_interop_npu: the QP went to ERR:\n%s", eng.describe().c_str());
      break;
    }
  }
  (void)cap.close();
  const Counters& c = eng.counters();
  std::printf("roce_interop_npu: frames tx %llu rx %llu, bad ICRC %llu, malformed %llu, unsupported %llu, no QP %llu, "
              "retransmits %llu, timeouts %llu, duplicates %llu, RNR NAKs sent %llu, ARP replies %llu\n",
              static_cast<unsigned long long>(c.tx_frames), static_cast<unsigned long long>(c.rx_frames),
              static_cast<unsigned long long>(c.rx_bad_icrc), static_cast<unsigned long long>(c.rx_malformed),
              static_cast<unsigned long long>(c.rx_unsupported), static_cast<unsigned long long>(c.rx_no_qp),
              static_cast<unsigned long long>(c.retransmits), static_cast<unsigned long long>(c.timeouts),
              static_cast<unsigned long long>(c.duplicates), static_cast<unsigned long long>(c.rnr_naks_sent),
              static_cast<unsigned long long>(c.arp_replies));
  std::printf("%s", eng.describe().c_str());
  const bool ok = result1 == "RESULT1 ok" && result2 == "RESULT2 ok" && guest_ok;
  std::printf("roce_interop_npu: %s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
