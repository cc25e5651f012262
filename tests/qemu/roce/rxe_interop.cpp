// The guest side of the Soft-RoCE interoperation test (tests/qemu/run-roce-interop.sh):
// a plain rdma-core program on Linux's rxe that connects an RC QP to a queue
// pair of hcomm-sim's RoCEv2 engine (tests/support/roce_interop_npu.cpp) on
// the other end of the guest's NIC. QP numbers, PSNs, keys and addresses go
// as text over UDP to the engine's address, port 18515 (the same wire).
//   phase 1: RDMA WRITE (100 B, 10000 B), READ (100 B, 10000 B), FETCH_ADD,
//            CMP_SWAP and SEND (200 B, 5000 B) into the engine's memory;
//            READ data and atomic results checked here, the rest there;
//   phase 2: the engine WRITEs, READs, FETCH_ADDs, CMP_SWAPs, SENDs and
//            WRITE_WITH_IMMs into this program's registered memory; checked here.
//   rxe_interop DEVICE GID_INDEX ENGINE_IP
// Exit 0 when every byte on both sides is right.
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>

namespace {

constexpr size_t kMem = 1 << 20;
constexpr uint16_t kSidePort = 18515;
constexpr uint32_t kPsn = 0xfffff0;  // crosses the 24-bit PSN wrap

uint8_t pat(int seed, size_t i) { return static_cast<uint8_t>(seed * 131 + i * 7 + (i >> 8) * 13); }

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "rxe_interop: %s\n", what);
  std::exit(1);
}

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

struct Side {
  int fd = -1;
  sockaddr_in to{};
  // Sends `msg` until a reply starting with one of the prefixes arrives
  // (every 200 ms, for at most `secs`); returns the reply.
  std::string ask(const std::string& msg, const char* prefix, double secs, const char* also = nullptr) {
    const double end = now_s() + secs;
    while (now_s() < end) {
      (void)sendto(fd, msg.data(), msg.size(), 0, reinterpret_cast<sockaddr*>(&to), sizeof to);
      pollfd p{fd, POLLIN, 0};
      if (poll(&p, 1, 200) == 1) {
        char buf[2048];
        const ssize_t n = recv(fd, buf, sizeof buf - 1, 0);
        if (n > 0) {
          std::string r(buf, static_cast<size_t>(n));
          if (r.rfind(prefix, 0) == 0 || (also != nullptr && r.rfind(also, 0) == 0)) return r;
        }
      }
    }
    std::fprintf(stderr, "rxe_interop: no answer to '%s' in %.0f s\n", msg.c_str(), secs);
    std::exit(1);
  }
};

struct Verbs {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_mr* mr = nullptr;
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;
  uint8_t* mem = nullptr;

  void post_send(ibv_wr_opcode op, uint64_t off, uint32_t len, uint64_t raddr, uint32_t rkey, uint64_t id,
                 uint64_t add_or_compare = 0, uint64_t swap = 0) {
    ibv_sge sge{reinterpret_cast<uintptr_t>(mem + off), len, mr->lkey};
    ibv_send_wr wr{};
    ibv_send_wr* bad = nullptr;
    wr.wr_id = id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = op;
    wr.send_flags = IBV_SEND_SIGNALED;
    if (op == IBV_WR_ATOMIC_FETCH_AND_ADD || op == IBV_WR_ATOMIC_CMP_AND_SWP) {
      wr.wr.atomic.remote_addr = raddr;
      wr.wr.atomic.rkey = rkey;
      wr.wr.atomic.compare_add = add_or_compare;
      wr.wr.atomic.swap = swap;
    } else {
      wr.wr.rdma.remote_addr = raddr;
      wr.wr.rdma.rkey = rkey;
    }
    if (ibv_post_send(qp, &wr, &bad) != 0) die("ibv_post_send");
  }
  void post_recv(uint64_t off, uint32_t len, uint64_t id) {
    ibv_sge sge{reinterpret_cast<uintptr_t>(mem + off), len, mr->lkey};
    ibv_recv_wr wr{};
    ibv_recv_wr* bad = nullptr;
    wr.wr_id = id;
    wr.sg_list = &sge;
    wr.num_sge = len > 0 ? 1 : 0;
    if (ibv_post_recv(qp, &wr, &bad) != 0) die("ibv_post_recv");
  }
  // Waits for n completions (60 s at most); returns how many failed.
  int wait(int n, ibv_wc* out = nullptr) {
    int got = 0, bad = 0;
    const double end = now_s() + 60;
    while (got < n) {
      ibv_wc wc{};
      const int r = ibv_poll_cq(cq, 1, &wc);
      if (r < 0) die("ibv_poll_cq");
      if (r == 0) {
        if (now_s() > end) {
          std::fprintf(stderr, "rxe_interop: %d of %d completions after 60 s\n", got, n);
          std::exit(1);
        }
        usleep(100);
        continue;
      }
      if (wc.status != IBV_WC_SUCCESS) {
        std::fprintf(stderr, "rxe_interop: wr %llu: %s (vendor_err 0x%x)\n", static_cast<unsigned long long>(wc.wr_id),
                     ibv_wc_status_str(wc.status), wc.vendor_err);
        ++bad;
      }
      if (out != nullptr) out[got] = wc;
      ++got;
    }
    return bad;
  }
};

std::string check(const uint8_t* p, size_t n, int seed, const char* what) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != pat(seed, i))
      return std::string(what) + ": byte " + std::to_string(i) + " is " + std::to_string(p[i]) + ", want " +
             std::to_string(pat(seed, i)) + "; ";
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: rxe_interop DEVICE GID_INDEX ENGINE_IP\n");
    return 2;
  }
  const int gid_index = std::atoi(argv[2]);
  Verbs v;
  int num = 0;
  ibv_device** devs = ibv_get_device_list(&num);
  for (int i = 0; i < num && v.ctx == nullptr; ++i)
    if (std::strcmp(ibv_get_device_name(devs[i]), argv[1]) == 0) v.ctx = ibv_open_device(devs[i]);
  if (v.ctx == nullptr) die("no such RDMA device");
  v.pd = ibv_alloc_pd(v.ctx);
  if (v.pd == nullptr) die("ibv_alloc_pd");
  if (posix_memalign(reinterpret_cast<void**>(&v.mem), 4096, kMem) != 0) die("posix_memalign");
  std::memset(v.mem, 0, kMem);
  v.mr = ibv_reg_mr(v.pd, v.mem, kMem,
                    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC);
  if (v.mr == nullptr) die("ibv_reg_mr");
  v.cq = ibv_create_cq(v.ctx, 64, nullptr, nullptr, 0);
  if (v.cq == nullptr) die("ibv_create_cq");
  ibv_qp_init_attr ia{};
  ia.send_cq = v.cq;
  ia.recv_cq = v.cq;
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = 32;
  ia.cap.max_recv_wr = 32;
  ia.cap.max_send_sge = 1;
  ia.cap.max_recv_sge = 1;
  v.qp = ibv_create_qp(v.pd, &ia);
  if (v.qp == nullptr) die("ibv_create_qp");
  ibv_gid gid{};
  if (ibv_query_gid(v.ctx, 1, gid_index, &gid) != 0) die("ibv_query_gid");

  // Phase-1 data and the phase-2 targets.
  for (size_t i = 0; i < 100; ++i) v.mem[0x0 + i] = pat(1, i);
  for (size_t i = 0; i < 10000; ++i) v.mem[0x1000 + i] = pat(1, i);
  for (size_t i = 0; i < 200; ++i) v.mem[0x30000 + i] = pat(8, i);
  for (size_t i = 0; i < 5000; ++i) v.mem[0x31000 + i] = pat(9, i);
  for (size_t i = 0; i < 100; ++i) v.mem[0x50000 + i] = pat(4, i);
  for (size_t i = 0; i < 10000; ++i) v.mem[0x51000 + i] = pat(4, i);
  const uint64_t word = 2000;
  std::memcpy(v.mem + 0x60000, &word, 8);

  Side side;
  side.fd = socket(AF_INET, SOCK_DGRAM, 0);
  side.to.sin_family = AF_INET;
  side.to.sin_port = htons(kSidePort);
  if (inet_pton(AF_INET, argv[3], &side.to.sin_addr) != 1) die("ENGINE_IP");
  const std::string hello = "HELLO " + std::to_string(v.qp->qp_num) + " " + std::to_string(kPsn) + " " +
                            std::to_string(v.mr->rkey) + " " + std::to_string(reinterpret_cast<uintptr_t>(v.mem));
  const std::string h = side.ask(hello, "HELLO", 60);
  unsigned e_qpn = 0, e_psn = 0, e_rkey = 0;
  unsigned long long e_va = 0;
  if (std::sscanf(h.c_str(), "HELLO %u %u %u %llu", &e_qpn, &e_psn, &e_rkey, &e_va) != 4) die("bad HELLO reply");
  std::printf("rxe_interop: our QP %u PSN %u rkey 0x%x; engine QP %u PSN %u rkey 0x%x va 0x%llx\n", v.qp->qp_num,
              kPsn, v.mr->rkey, e_qpn, e_psn, e_rkey, e_va);

  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = 1;
  a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
  if (ibv_modify_qp(v.qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) != 0) die("INIT");
  std::memset(&a, 0, sizeof a);
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_1024;
  a.dest_qp_num = e_qpn;
  a.rq_psn = e_psn;
  a.max_dest_rd_atomic = 4;
  a.min_rnr_timer = 12;
  a.ah_attr.is_global = 1;
  a.ah_attr.port_num = 1;
  a.ah_attr.grh.sgid_index = static_cast<uint8_t>(gid_index);
  a.ah_attr.grh.hop_limit = 64;
  uint8_t* d = a.ah_attr.grh.dgid.raw;  // ::ffff:ENGINE_IP
  d[10] = d[11] = 0xff;
  std::memcpy(d + 12, &side.to.sin_addr, 4);
  if (ibv_modify_qp(v.qp, &a,
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) != 0)
    die("RTR");
  std::memset(&a, 0, sizeof a);
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.sq_psn = kPsn;
  a.max_rd_atomic = 4;
  if (ibv_modify_qp(v.qp, &a,
                    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                        IBV_QP_MAX_QP_RD_ATOMIC) != 0)
    die("RTS");

  // ---- phase 1: this guest into the engine's memory ----
  v.post_send(IBV_WR_RDMA_WRITE, 0x0, 100, e_va + 0x0, e_rkey, 1);
  v.post_send(IBV_WR_RDMA_WRITE, 0x1000, 10000, e_va + 0x1000, e_rkey, 2);
  v.post_send(IBV_WR_RDMA_READ, 0x10000, 100, e_va + 0x10000, e_rkey, 3);
  v.post_send(IBV_WR_RDMA_READ, 0x11000, 10000, e_va + 0x11000, e_rkey, 4);
  v.post_send(IBV_WR_ATOMIC_FETCH_AND_ADD, 0x20000, 8, e_va + 0x20000, e_rkey, 5, 5);
  v.post_send(IBV_WR_ATOMIC_CMP_AND_SWP, 0x20008, 8, e_va + 0x20000, e_rkey, 6, 1005, 77);
  v.post_send(IBV_WR_SEND, 0x30000, 200, 0, 0, 7);
  v.post_send(IBV_WR_SEND, 0x31000, 5000, 0, 0, 8);
  std::string bad;
  if (v.wait(8) != 0) bad += "phase-1 completions failed; ";
  bad += check(v.mem + 0x10000, 100, 2, "READ 100 B");
  bad += check(v.mem + 0x11000, 10000, 2, "READ 10000 B");
  uint64_t r[2];
  std::memcpy(r, v.mem + 0x20000, 16);
  if (r[0] != 1000) bad += "FETCH_ADD returned " + std::to_string(r[0]) + ", want 1000; ";
  if (r[1] != 1005) bad += "CMP_SWAP returned " + std::to_string(r[1]) + ", want 1005; ";
  std::printf("rxe_interop: phase 1 here: %s\n", bad.empty() ? "ok" : bad.c_str());
  const std::string r1 = side.ask(bad.empty() ? "CHECK1 ok" : "CHECK1 fail: " + bad, "RESULT1", 30);
  std::printf("rxe_interop: phase 1 at the engine: %s\n", r1.c_str());
  bool ok = bad.empty() && r1 == "RESULT1 ok";

  // ---- phase 2: the engine into this guest's memory ----
  v.post_recv(0x70000, 4096, 11);
  v.post_recv(0x71000, 8192, 12);
  v.post_recv(0x7f000, 0, 13);  // consumed by the WRITE_WITH_IMM
  std::string r2 = side.ask("GO2", "RESULT2", 5, "WAIT2");
  const double end = now_s() + 60;
  while (r2 == "WAIT2" && now_s() < end) {
    usleep(200000);
    r2 = side.ask("GO2", "RESULT2", 5, "WAIT2");
  }
  std::printf("rxe_interop: phase 2 at the engine: %s\n", r2.c_str());
  ok = ok && r2 == "RESULT2 ok";
  ibv_wc wc[3];
  bad.clear();
  if (v.wait(3, wc) != 0) bad += "receive completions failed; ";
  if (wc[0].wr_id != 11 || wc[0].byte_len != 300 || wc[0].opcode != IBV_WC_RECV) bad += "first receive wrong; ";
  if (wc[1].wr_id != 12 || wc[1].byte_len != 6000 || wc[1].opcode != IBV_WC_RECV) bad += "second receive wrong; ";
  if (wc[2].wr_id != 13 || wc[2].opcode != IBV_WC_RECV_RDMA_WITH_IMM || !(wc[2].wc_flags & IBV_WC_WITH_IMM) ||
      ntohl(wc[2].imm_data) != 0x12345678)
    bad += "WRITE_WITH_IMM completion wrong; ";
  bad += check(v.mem + 0x40000, 100, 3, "engine WRITE 100 B");
  bad += check(v.mem + 0x41000, 10000, 3, "engine WRITE 10000 B");
  bad += check(v.mem + 0x70000, 300, 5, "engine SEND 300 B");
  bad += check(v.mem + 0x71000, 6000, 6, "engine SEND 6000 B");
  bad += check(v.mem + 0x78000, 4000, 7, "engine WRITE_WITH_IMM 4000 B");
  uint64_t w;
  std::memcpy(&w, v.mem + 0x60000, 8);
  if (w != 42) bad += "atomic word " + std::to_string(w) + ", want 42; ";
  std::printf("rxe_interop: phase 2 here: %s\n", bad.empty() ? "ok" : bad.c_str());
  (void)side.ask(bad.empty() ? "CHECK2 ok" : "CHECK2 fail: " + bad, "BYE", 10);
  ok = ok && bad.empty();
  std::printf("rxe_interop: %s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
