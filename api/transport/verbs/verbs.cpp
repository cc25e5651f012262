#include "api/transport/verbs/verbs.h"

#include "api/transport/verbs/gid_rule.h"

#include <arpa/inet.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <random>

#include "api/core/context.h"
#include "api/proto/am_check.h"
#include "api/proto/verbs_wire.h"
#include "api/transport/revocation.h"
#include "api/transport/shm/shm.h"
#include "common/barrier.h"
#include "common/env.h"
#include "hal/abi/reduce.h"

namespace hcomm::api {

namespace abi = hal::abi;

namespace {

std::string memlock_hint() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_MEMLOCK, &rl) != 0) return "";
  auto kib = [](rlim_t v) { return v == RLIM_INFINITY ? std::string("unlimited") : std::to_string(v / 1024) + " KiB"; };
  return " (RLIMIT_MEMLOCK is " + kib(rl.rlim_cur) + ", hard " + kib(rl.rlim_max) +
         ": registered memory is pinned; raise it with `ulimit -l unlimited`, the memlock line of "
         "/etc/security/limits.conf, or LimitMEMLOCK= in a systemd unit)";
}

std::string gid_text(const ibv_gid& g) {
  char buf[INET6_ADDRSTRLEN] = "?";
  const bool v4 = gid_rule::ipv4_mapped(g.raw);
  if (v4) ::inet_ntop(AF_INET, g.raw + 12, buf, sizeof buf);
  else ::inet_ntop(AF_INET6, g.raw, buf, sizeof buf);
  return v4 ? std::string("::ffff:") + buf : std::string(buf);
}

// An RDMA WRITE of one piece.
ibv_send_wr write_wr(ibv_sge& sge, uint64_t raddr, uint32_t rkey) {
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.wr.rdma.remote_addr = raddr;
  wr.wr.rdma.rkey = rkey;
  return wr;
}

Code code_of(ibv_wc_status s) {
  switch (s) {
    case IBV_WC_SUCCESS: return Code::ok;
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_LOC_PROT_ERR: return Code::access_denied;
    default: return Code::peer_failure;
  }
}

// Scratch words: 0..kFetchSlots-1 fetch results; then the import read of a
// table entry (4 words), the revoked generation being written, the result
// of a synchronous atomic, a notify value, an acknowledgement (where the NIC
// cannot send it inline), the revocation number being written.
constexpr int kFetchSlots = 1008;
constexpr int kEntryWord = 1008;
constexpr int kRevokeWord = 1012;
constexpr int kAtomicWord = 1013;
constexpr int kNotifyWord = 1014;
constexpr int kAckWord = 1015;
constexpr int kNoticeWord = 1016;
constexpr int kScratchWords = 1017;

}  // namespace

Status VerbsConfig::from_env(VerbsConfig* out) {
  VerbsConfig c;
  if (const char* d = env("HCOMM_IB_DEVICE")) {
    std::string v = d;
    if (auto colon = v.find(':'); colon != std::string::npos) {
      c.port = std::atoi(v.c_str() + colon + 1);
      v.resize(colon);
    }
    c.device = v;
  }
  long port = c.port, timeout = c.timeout, retry = c.retry, max_msg = 0;
  HCOMM_TRY(env_int("HCOMM_IB_PORT", 1, 255, &port));
  if (const char* g = env("HCOMM_IB_GID")) c.gid = g;
  HCOMM_TRY(env_int("HCOMM_IB_TIMEOUT", 1, 31, &timeout));
  HCOMM_TRY(env_int("HCOMM_IB_RETRY", 0, 7, &retry));
  HCOMM_TRY(env_int("HCOMM_IB_MAX_MSG", 64, 1L << 31, &max_msg));
  c.port = static_cast<int>(port);
  c.timeout = static_cast<int>(timeout);
  c.retry = static_cast<int>(retry);
  c.max_msg = static_cast<size_t>(max_msg);
  *out = c;
  return Status::ok();
}

VerbsTransport::VerbsTransport(Context& ctx, AmSink& sink)
    : _ctx(ctx), _sink(sink), _rank(ctx.rank()), _size(ctx.size()) {
  _peers.resize(static_cast<size_t>(_size));
  for (VPeer& p : _peers) p.ops.resize(kSqDepth);
}

Status VerbsTransport::open(Context& ctx, AmSink& sink, const VerbsConfig& cfg, std::unique_ptr<VerbsTransport>* out) {
  std::unique_ptr<VerbsTransport> t(new VerbsTransport(ctx, sink));
  HCOMM_TRY(t->setup(cfg));
  *out = std::move(t);
  return Status::ok();
}

Status VerbsTransport::reg(void* addr, size_t len, int access, ibv_mr** out, const char* what) {
  ibv_mr* mr = ::ibv_reg_mr(_pd, addr, len, access);
  if (mr == nullptr) {
    int err = errno;
    std::string hint = err == ENOMEM || err == EPERM || err == EAGAIN ? memlock_hint() : "";
    return Status::error(err == ENOMEM || err == EAGAIN ? Code::no_resource : Code::io_error,
                         "verbs: ibv_reg_mr(%s, %zu bytes): %s%s", what, len, std::strerror(err), hint.c_str());
  }
  *out = mr;
  return Status::ok();
}

Status VerbsTransport::setup(const VerbsConfig& cfg) {
  // Fork safety: only when rdma-core says the kernel needs it (it marks
  // registered pages MADV_DONTFORK, which breaks forked children that touch
  // them, e.g. data-loader workers). Current kernels answer UNNEEDED.
  if (::ibv_is_fork_initialized() == IBV_FORK_DISABLED) (void)::ibv_fork_init();
  int n = 0;
  ibv_device** list = ::ibv_get_device_list(&n);
  if (list == nullptr || n == 0) {
    if (list != nullptr) ::ibv_free_device_list(list);
    return Status::error(Code::not_found, "verbs: no RDMA device (ibv_get_device_list found none; for Soft-RoCE: "
                                          "modprobe rdma_rxe; rdma link add rxe0 type rxe netdev eth0)");
  }
  std::string seen;
  for (int i = 0; i < n && _dev == nullptr; ++i) {
    const char* name = ::ibv_get_device_name(list[i]);
    seen += std::string(seen.empty() ? "" : ", ") + name;
    if (!cfg.device.empty() && cfg.device != name) continue;
    ibv_context* c = ::ibv_open_device(list[i]);
    if (c == nullptr) continue;
    ibv_device_attr da{};
    if (::ibv_query_device(c, &da) != 0) {
      ::ibv_close_device(c);
      continue;
    }
    for (int p = 1; p <= da.phys_port_cnt; ++p) {
      if (cfg.port != 0 && cfg.port != p) continue;
      ibv_port_attr pa{};
      if (::ibv_query_port(c, static_cast<uint8_t>(p), &pa) == 0 && pa.state == IBV_PORT_ACTIVE) {
        _dev = c;
        _dev_attr = da;
        _port = static_cast<uint8_t>(p);
        _port_attr = pa;
        _dev_name = name;
        break;
      }
    }
    if (_dev == nullptr) ::ibv_close_device(c);
  }
  ::ibv_free_device_list(list);
  if (_dev == nullptr)
    return Status::error(Code::not_found, "verbs: no active port on %s (devices: %s; HCOMM_IB_DEVICE=%s HCOMM_IB_PORT=%d)",
                         cfg.device.empty() ? "any device" : cfg.device.c_str(), seen.c_str(),
                         cfg.device.empty() ? "unset" : cfg.device.c_str(), cfg.port);
  HCOMM_TRY(choose_gid(cfg));
  _timeout = cfg.timeout;
  _retry = cfg.retry;
  _pd = ::ibv_alloc_pd(_dev);
  if (_pd == nullptr) return Status::from_errno(errno, "verbs: ibv_alloc_pd");
  const int scqe = std::min(_dev_attr.max_cqe, _size * 256 + 64);
  const int rcqe = std::min(_dev_attr.max_cqe, _size * static_cast<int>(kRecvDepth) + 64);
  _scq = ::ibv_create_cq(_dev, scqe, nullptr, nullptr, 0);
  _rcq = _scq != nullptr ? ::ibv_create_cq(_dev, rcqe, nullptr, nullptr, 0) : nullptr;
  if (_rcq == nullptr)
    return Status::error(Code::no_resource, "verbs: ibv_create_cq: %s%s", std::strerror(errno), memlock_hint().c_str());
  _am_mem.assign(static_cast<size_t>(_size) * (kRecvDepth + kSendRing) * kSlot, 0);
  HCOMM_TRY(reg(_am_mem.data(), _am_mem.size(), IBV_ACCESS_LOCAL_WRITE, &_am_mr, "message buffers"));
  _table.assign(kMaxRegs, RegTableEntry{});
  HCOMM_TRY(reg(_table.data(), _table.size() * sizeof(RegTableEntry), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ,
                &_table_mr, "registration table"));
  _locks.assign(kLockStripes + 1, 0);  // + the atomics self-test's word
  HCOMM_TRY(reg(_locks.data(), _locks.size() * 8,
                IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_REMOTE_READ, &_locks_mr,
                "accumulate locks"));
  _mailbox.assign(RevocationMailbox::words(_size), 0);
  HCOMM_TRY(reg(_mailbox.data(), _mailbox.size() * 4, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE, &_mailbox_mr,
                "revocation mailboxes"));
  _scratch.assign(kScratchWords, 0);
  HCOMM_TRY(reg(_scratch.data(), _scratch.size() * 8, IBV_ACCESS_LOCAL_WRITE, &_scratch_mr, "scratch"));
  for (int i = kFetchSlots - 1; i >= 0; --i) _scratch_free.push_back(i);
  _bounce.assign(kAccChunk, 0);
  HCOMM_TRY(reg(_bounce.data(), _bounce.size(), IBV_ACCESS_LOCAL_WRITE, &_bounce_mr, "accumulate bounce buffer"));

  std::random_device rd;
  _psn = rd() & 0xffffff;
  for (int r = 0; r < _size; ++r) {
    ibv_qp_init_attr ia{};
    ia.send_cq = _scq;
    ia.recv_cq = _rcq;
    ia.qp_type = IBV_QPT_RC;
    ia.sq_sig_all = 0;
    ia.cap.max_send_wr = std::min<uint32_t>(256, static_cast<uint32_t>(_dev_attr.max_qp_wr));
    ia.cap.max_recv_wr = kRecvDepth + 4;
    ia.cap.max_send_sge = 1;
    ia.cap.max_recv_sge = 1;
    ia.cap.max_inline_data = 256;
    ibv_qp* qp = ::ibv_create_qp(_pd, &ia);
    if (qp == nullptr) {
      ia.cap.max_inline_data = 0;
      qp = ::ibv_create_qp(_pd, &ia);
    }
    if (qp == nullptr)
      return Status::error(Code::no_resource, "verbs: ibv_create_qp: %s%s", std::strerror(errno), memlock_hint().c_str());
    _peers[static_cast<size_t>(r)].qp = qp;
    _max_inline = ia.cap.max_inline_data;  // what the provider granted
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = _port;
    a.qp_access_flags = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC;
    if (int rc = ::ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS); rc != 0)
      return Status::from_errno(rc, "verbs: queue pair to INIT");
  }
  _max_msg = _port_attr.max_msg_sz > 0 ? _port_attr.max_msg_sz : (1u << 30);
  if (cfg.max_msg > 0 && cfg.max_msg < _max_msg) _max_msg = static_cast<uint32_t>(cfg.max_msg);
  _caps.max_short = kEagerMax;
  _caps.max_zcopy = _max_msg;
  _caps.put = _caps.get = _caps.atomic64 = _caps.reduce = _caps.notify = true;
  _caps.remote_hosts = true;
  _caps.sync = false;
  _caps.rndv_write = true;
  _caps.acknowledges = true;
  _caps.implicit = true;
  return Status::ok();
}

// The rule of gid_rule.h (RoCEv2 IPv4 first, then RoCEv2 global IPv6;
// link-local and RoCEv1 only when forced). InfiniBand ports route by LID with
// GID index 0.
Status VerbsTransport::choose_gid(const VerbsConfig& cfg) {
  if (_port_attr.link_layer == IBV_LINK_LAYER_INFINIBAND && cfg.gid.empty()) {
    _gid_index = 0;
    if (::ibv_query_gid(_dev, _port, 0, &_gid) != 0) return Status::from_errno(errno, "verbs: ibv_query_gid");
    return Status::ok();
  }
  std::vector<gid_rule::Entry> rows;
  std::string table;
  for (int i = 0; i < _port_attr.gid_tbl_len; ++i) {
    ibv_gid_entry e{};
    if (::ibv_query_gid_ex(_dev, _port, static_cast<uint32_t>(i), &e, 0) != 0) continue;
    bool zero = true;
    for (uint8_t b : e.gid.raw) zero &= b == 0;
    if (zero) continue;
    gid_rule::Entry g;
    g.index = static_cast<uint32_t>(i);
    std::memcpy(g.raw, e.gid.raw, sizeof g.raw);
    g.roce_v2 = e.gid_type == IBV_GID_TYPE_ROCE_V2;
    rows.push_back(g);
    // (Appended piece by piece: GCC 12's -Wrestrict misfires on a chain of
    // std::string operator+ in release builds.)
    table += ' ';
    table += std::to_string(i);
    table += g.roce_v2 ? "=v2:" : "=v1:";
    table += gid_text(e.gid);
  }
  const int pick = gid_rule::choose(rows, cfg.gid);
  if (pick < 0)
    return Status::error(Code::not_found, "verbs: %s:%u has no %s GID (table:%s)", _dev_name.c_str(), _port,
                         cfg.gid.empty() ? "RoCEv2 IPv4 or global IPv6" : ("HCOMM_IB_GID=" + cfg.gid).c_str(),
                         table.empty() ? " empty" : table.c_str());
  const gid_rule::Entry& best = rows[static_cast<size_t>(pick)];
  _gid_index = static_cast<int>(best.index);
  std::memcpy(_gid.raw, best.raw, sizeof _gid.raw);
  return Status::ok();
}

VerbsTransport::~VerbsTransport() {
  for (VPeer& p : _peers)
    for (Op& op : p.ops)
      if (op.live && op.own_mr != nullptr) ::ibv_dereg_mr(op.own_mr);
  for (VPeer& p : _peers)
    if (p.qp != nullptr) ::ibv_destroy_qp(p.qp);
  for (ibv_mr* mr : {_am_mr, _table_mr, _locks_mr, _mailbox_mr, _scratch_mr, _bounce_mr})
    if (mr != nullptr) ::ibv_dereg_mr(mr);
  if (_rcq != nullptr) ::ibv_destroy_cq(_rcq);
  if (_scq != nullptr) ::ibv_destroy_cq(_scq);
  if (_pd != nullptr) ::ibv_dealloc_pd(_pd);
  if (_dev != nullptr) ::ibv_close_device(_dev);
}

// ---- wire-up ------------------------------------------------------------------------------

std::string VerbsTransport::wire_blob() const {
  VerbsWireHdr h{};
  std::memcpy(h.gid, _gid.raw, 16);
  h.lid = _port_attr.lid;
  h.mtu = static_cast<uint8_t>(_port_attr.active_mtu);
  h.psn = _psn;
  h.table_addr = reinterpret_cast<uint64_t>(_table.data());
  h.locks_addr = reinterpret_cast<uint64_t>(_locks.data());
  h.mailbox_addr = reinterpret_cast<uint64_t>(_mailbox.data());
  h.table_rkey = _table_mr->rkey;
  h.locks_rkey = _locks_mr->rkey;
  h.mailbox_rkey = _mailbox_mr->rkey;
  std::vector<uint32_t> qpns;
  for (const VPeer& p : _peers) qpns.push_back(p.qp->qp_num);
  return verbs_wire_blob(h, qpns);
}

Status VerbsTransport::connect(Bootstrap& boot, VerbsTransport* self, const std::string& absent, const Deadline& dl,
                               std::vector<bool>* have) {
  std::string mine = self != nullptr ? self->wire_blob() : verbs_wire_absent(absent);
  std::vector<std::string> all;
  HCOMM_TRY(boot.allgather(mine, &all, dl));
  const int n = boot.size();
  std::vector<VerbsPeerWire> ws;
  HCOMM_TRY(parse_verbs_wire(all, n, boot.rank(), &ws));
  have->assign(static_cast<size_t>(n), false);
  for (int r = 0; r < n; ++r) (*have)[static_cast<size_t>(r)] = ws[static_cast<size_t>(r)].present;
  if (self == nullptr) return Status::ok();
  for (int r = 0; r < n; ++r) {
    const VerbsPeerWire& w = ws[static_cast<size_t>(r)];
    if (!w.present) continue;
    ibv_gid g;
    std::memcpy(g.raw, w.h.gid, 16);
    VPeer& p = self->_peers[static_cast<size_t>(r)];
    p.table_addr = w.h.table_addr;
    p.locks_addr = w.h.locks_addr;
    p.mailbox_addr = w.h.mailbox_addr;
    p.table_rkey = w.h.table_rkey;
    p.locks_rkey = w.h.locks_rkey;
    p.mailbox_rkey = w.h.mailbox_rkey;
    HCOMM_TRY(self->bring_up(r, w.qpn, g, w.h.lid, static_cast<ibv_mtu>(w.h.mtu), w.h.psn));
  }
  return Status::ok();
}

// Drivers have misreported atomics: before the first operation that needs
// the NIC's atomics (a fetch atomic, an accumulate's lock), check them once
// per device and port in this process, on a word of our own through the
// loopback queue pair (0 -> +7 -> back to 0). The verdict is kept.
Status VerbsTransport::check_atomics() {
  static std::mutex mu;
  static std::map<std::string, Status> verdicts;  // "device:port" -> the self-test's result
  const std::string dev = _dev_name + ":" + std::to_string(_port);
  {
    std::lock_guard lk(mu);
    if (auto it = verdicts.find(dev); it != verdicts.end()) {
      _atomics = it->second;
      _atomics_tested = true;
      return _atomics;
    }
  }
  VPeer& me = _peers[static_cast<size_t>(_rank)];
  uint64_t& w = _locks[kLockStripes];  // after the stripes: no peer uses it
  const uint64_t word = me.locks_addr + kLockStripes * 8;
  std::atomic_ref<uint64_t>(w).store(0, std::memory_order_release);
  uint64_t old = 1, old2 = 0;
  Status st = sync_atomic(_rank, IBV_WR_ATOMIC_FETCH_AND_ADD, word, me.locks_rkey, 7, 0, &old);
  if (st) st = sync_atomic(_rank, IBV_WR_ATOMIC_CMP_AND_SWP, word, me.locks_rkey, 7, 0, &old2);
  if (!st) return st;  // the queue pair failed: not a verdict on the device
  const uint64_t now = std::atomic_ref<uint64_t>(w).load(std::memory_order_acquire);
  _atomics = old == 0 && old2 == 7 && now == 0
                 ? Status::ok()
                 : Status::error(Code::device_error,
                                 "verbs: %s failed the atomics self-test (fetch_add returned %lu, compare_swap %lu, "
                                 "word %lu)",
                                 _dev_name.c_str(), static_cast<unsigned long>(old), static_cast<unsigned long>(old2),
                                 static_cast<unsigned long>(now));
  _atomics_tested = true;
  std::lock_guard lk(mu);
  verdicts.emplace(dev, _atomics);
  return _atomics;
}

Status VerbsTransport::bring_up(int peer, uint32_t qpn, const ibv_gid& gid, uint16_t lid, ibv_mtu mtu, uint32_t psn) {
  VPeer& p = _peers[static_cast<size_t>(peer)];
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = std::min(mtu, _port_attr.active_mtu);  // the smaller of the two ports'
  a.dest_qp_num = qpn;
  a.rq_psn = psn;
  a.max_dest_rd_atomic = static_cast<uint8_t>(std::min(16, _dev_attr.max_qp_rd_atom));
  a.min_rnr_timer = 12;
  a.ah_attr.port_num = _port;
  a.ah_attr.dlid = lid;
  if (_port_attr.link_layer != IBV_LINK_LAYER_INFINIBAND || _gid_index > 0) {
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = gid;
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(_gid_index);
    a.ah_attr.grh.hop_limit = 64;
  }
  if (int rc = ::ibv_modify_qp(p.qp, &a,
                               IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                   IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
      rc != 0)
    return Status::from_errno(rc, "verbs: queue pair to rank " + std::to_string(peer) + " to RTR");
  ibv_qp_attr s{};
  s.qp_state = IBV_QPS_RTS;
  s.timeout = static_cast<uint8_t>(_timeout);
  s.retry_cnt = static_cast<uint8_t>(_retry);
  s.rnr_retry = 7;
  s.sq_psn = _psn;
  s.max_rd_atomic = static_cast<uint8_t>(std::min(16, _dev_attr.max_qp_rd_atom));
  if (int rc = ::ibv_modify_qp(p.qp, &s,
                               IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                   IBV_QP_MAX_QP_RD_ATOMIC);
      rc != 0)
    return Status::from_errno(rc, "verbs: queue pair to rank " + std::to_string(peer) + " to RTS");
  for (uint32_t i = 0; i < kRecvDepth; ++i) {
    ibv_sge sge{reinterpret_cast<uint64_t>(recv_buf(peer, i)), kSlot, _am_mr->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = wr_id(peer, i);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    if (int rc = ::ibv_post_recv(p.qp, &wr, &bad); rc != 0) return Status::from_errno(rc, "verbs: ibv_post_recv");
  }
  p.credits = kRecvDepth;
  p.up = true;
  return Status::ok();
}

uint8_t* VerbsTransport::recv_buf(int peer, uint32_t i) const {
  return const_cast<uint8_t*>(_am_mem.data()) + (static_cast<size_t>(peer) * kRecvDepth + i) * kSlot;
}
uint8_t* VerbsTransport::send_buf(int peer, uint32_t i) const {
  return const_cast<uint8_t*>(_am_mem.data()) +
         (static_cast<size_t>(_size) * kRecvDepth + static_cast<size_t>(peer) * kSendRing + i) * kSlot;
}

// ---- posting and completions --------------------------------------------------------------

Status VerbsTransport::down(int peer) const {
  const VPeer& p = _peers[static_cast<size_t>(peer)];
  return Status::error(Code::peer_failure, "verbs: the queue pair to rank %d is down%s%s", peer, p.down.empty() ? "" : ": ",
                       p.down.c_str());
}

Status VerbsTransport::post(int peer, ibv_send_wr& wr, Op op, bool signalled, const Deadline* room) {
  VPeer& p = _peers[static_cast<size_t>(peer)];
  if (!p.up) return down(peer);
  // Room in the send queue: unsignalled requests hold their entries until a
  // later signalled one completes.
  auto full = [&p] { return p.sq_posted - p.sq_retired + 1 >= kSqRoom; };
  if (full()) {  // (the clock is read only when it has to wait)
    for (Deadline dl = room != nullptr ? *room : Deadline::after_ms(30000); full();) {
      poll_send();
      if (!p.up) return down(peer);
      if (dl.expired()) return Status::error(Code::no_resource, "verbs: send queue to rank %d full until the deadline", peer);
      cpu_relax();
    }
  }
  const uint64_t id = wr_id(peer, p.sq_posted);
  wr.wr_id = id;
  if (signalled) wr.send_flags |= IBV_SEND_SIGNALED;
  wr.next = nullptr;
  ibv_send_wr* bad = nullptr;
  if (int rc = ::ibv_post_send(p.qp, &wr, &bad); rc != 0)
    return Status::from_errno(rc, "verbs: ibv_post_send to rank " + std::to_string(peer));
  ++p.sq_posted;
  if (signalled) {
    Op& slot = p.ops[(p.sq_posted - 1) & (kSqDepth - 1)];
    slot = std::move(op);
    slot.live = true;
    if (!slot.sync) ++p.async_ops;
    p.unsignaled = 0;
    p.signalled_end = p.sq_posted;
  } else {
    ++p.unsignaled;
  }
  return Status::ok();
}

Status VerbsTransport::post_rdma(int peer, ibv_wr_opcode opc, void* local, uint32_t lkey, uint64_t raddr, uint32_t rkey,
                                 size_t len, const std::shared_ptr<Request>& r, ibv_mr* own_mr) {
  auto* l = static_cast<uint8_t*>(local);
  VPeer& p = _peers[static_cast<size_t>(peer)];
  const bool implicit = r == nullptr;
  size_t off = 0;
  do {
    const size_t n = std::min<size_t>(len - off, _max_msg);
    ibv_sge sge{reinterpret_cast<uint64_t>(l + off), static_cast<uint32_t>(n), lkey};
    ibv_send_wr wr{};
    wr.opcode = opc;
    wr.sg_list = &sge;
    wr.num_sge = n > 0 ? 1 : 0;
    wr.wr.rdma.remote_addr = raddr + off;
    wr.wr.rdma.rkey = rkey;
    if (opc == IBV_WR_RDMA_WRITE && n <= _max_inline) wr.send_flags |= IBV_SEND_INLINE;
    Op op;
    op.r = r;
    off += n;
    if (off == len) op.own_mr = own_mr;  // released with the last piece (completions come in order)
    // Implicit: signalled only when no signalled request to this peer is in
    // flight (so a flush right after one put_nbi finds it covered and posts
    // nothing), to retire send-queue entries, or to release a registration
    // of its own.
    const bool sig = !implicit || op.own_mr != nullptr || p.async_ops == 0 || p.unsignaled + 1 >= kSignalEvery;
    if (!implicit) ++r->outstanding;
    Status st = post(peer, wr, std::move(op), sig);
    if (!st) {
      if (!implicit) --r->outstanding;
      // Earlier pieces (a message longer than _max_msg) may still read or
      // write through `own_mr`: their pair fails before it is released.
      st = cut_short(_sink, p.up, "verbs", peer, off - n, len, st);
      if (own_mr != nullptr) ::ibv_dereg_mr(own_mr);
      return st;
    }
    if (implicit) p.implicit_end = p.sq_posted;
  } while (off < len);
  return Status::ok();
}

void VerbsTransport::implicit_lost(int peer, uint64_t seq, hcomm_status_t st, const std::string& why) {
  VPeer& p = _peers[static_cast<size_t>(peer)];
  if (p.implicit_end <= seq) return;
  p.implicit_end = 0;
  _sink.on_implicit_failed(peer, st, why);
}

void VerbsTransport::complete_op(uint64_t id, const ibv_wc& wc) {
  const int peer = static_cast<int>(id >> 40);
  VPeer& p = _peers[static_cast<size_t>(peer)];
  const uint64_t seq = id & ((1ull << 40) - 1);
  const bool failed = wc.status != IBV_WC_SUCCESS;
  // What a failed request reports, and what fails its peer.
  auto what = [&] {
    return std::string("verbs: ") + ::ibv_wc_status_str(wc.status) + " on the queue pair to rank " +
           std::to_string(peer);
  };
  auto fail_pair = [&] {
    if (p.up) _sink.on_peer_failed(peer, std::string("verbs queue pair failed: ") + ::ibv_wc_status_str(wc.status));
  };
  // This request and every one behind it on the pair is lost: implicit ones
  // among them have no request to fail.
  if (failed && p.up) implicit_lost(peer, seq, to_hcomm(code_of(wc.status)), what());
  p.sq_retired = std::max<uint64_t>(p.sq_retired, seq + 1);  // in order: every earlier one is done
  Op& slot = p.ops[id & (kSqDepth - 1)];
  if (!slot.live) {
    // An unsignalled request that failed (the NIC reports those too), or
    // one whose peer failed meanwhile (already completed).
    if (failed) fail_pair();
    return;
  }
  Op op = std::move(slot);
  slot = Op{};
  if (!op.sync) --p.async_ops;
  if (op.sync) {
    if (_sync_abandoned.erase(id) == 0) _sync_done[id] = wc;
    if (failed) fail_pair();
    return;
  }
  if (op.own_mr != nullptr) ::ibv_dereg_mr(op.own_mr);
  if (op.scratch >= 0) {
    // (Not into a request already ended: a cancel gave up on it, and its
    // caller may have returned.)
    if (!failed && op.result != nullptr && (op.r == nullptr || !op.r->done()))
      *op.result = std::atomic_ref<uint64_t>(_scratch[static_cast<size_t>(op.scratch)]).load(std::memory_order_acquire);
    _scratch_free.push_back(op.scratch);
  }
  Request* r = op.r.get();
  if (failed) {
    if (r != nullptr) r->complete(to_hcomm(code_of(wc.status)), what());
    // The queue pair is in error and flushes everything behind: the pair is
    // gone (see "refused keys" in verbs.h: the NIC never sees one).
    fail_pair();
  } else if (op.notify_addr != 0 && r != nullptr && !r->done() && mb().revoked(peer, op.notify_slot, op.notify_gen)) {
    // The word's memory was released while the data was in flight.
    r->complete(HCOMM_ERR_ACCESS, "put_notify: the notify word's key was revoked by rank " + std::to_string(peer) +
                                      " before the data completed");
  } else if (op.notify_addr != 0 && r != nullptr && !r->done()) {
    // The data is acknowledged, so placed at the target: now the word.
    uint64_t v = op.notify_value;
    ibv_sge sge{reinterpret_cast<uint64_t>(&v), 8, 0};
    ibv_send_wr wr = write_wr(sge, op.notify_addr, op.notify_rkey);
    Op nop;
    nop.r = op.r;
    if (_max_inline >= 8) {
      wr.send_flags |= IBV_SEND_INLINE;
    } else {
      _scratch[kNotifyWord] = v;
      sge.addr = reinterpret_cast<uint64_t>(&_scratch[kNotifyWord]);
      sge.lkey = _scratch_mr->lkey;
    }
    ++r->outstanding;
    Status st = post(peer, wr, std::move(nop), true);
    if (!st) {
      --r->outstanding;
      r->complete(to_hcomm(st.code()), st.message());
    }
  }
  if (r != nullptr && r->outstanding > 0 && --r->outstanding == 0) r->complete(HCOMM_OK);
}

void VerbsTransport::poll_send() {
  ibv_wc wc[32];
  int n;
  while ((n = ::ibv_poll_cq(_scq, 32, wc)) > 0)
    for (int i = 0; i < n; ++i) complete_op(wc[i].wr_id, wc[i]);
}

void VerbsTransport::poll_recv() {
  ibv_wc wc[32];
  int n;
  while ((n = ::ibv_poll_cq(_rcq, 32, wc)) > 0) {
    for (int i = 0; i < n; ++i) {
      const int peer = static_cast<int>(wc[i].wr_id >> 40);
      const uint32_t slot = static_cast<uint32_t>(wc[i].wr_id & 0xffffffffu);
      if (peer < 0 || peer >= _size || slot >= kRecvDepth) continue;
      VPeer& p = _peers[static_cast<size_t>(peer)];
      if (wc[i].status != IBV_WC_SUCCESS) {
        if (p.up && wc[i].status != IBV_WC_WR_FLUSH_ERR)
          _sink.on_peer_failed(peer, std::string("verbs receive failed: ") + ::ibv_wc_status_str(wc[i].status));
        continue;
      }
      if (wc[i].wc_flags & IBV_WC_WITH_IMM) {
        // The peer grants only buffers it reposted after our SENDs used
        // them: never more than kRecvDepth in all (a larger grant would let
        // us send into buffers that are not there).
        const uint32_t grant = ntohl(wc[i].imm_data);
        if (p.up && grant > kRecvDepth - p.credits) {
          _sink.on_peer_failed(peer, "verbs: credit grant of " + std::to_string(grant) + " with " +
                                         std::to_string(p.credits) + " of " + std::to_string(kRecvDepth) + " held");
          continue;
        }
        p.credits += grant;
      }
      const uint8_t* buf = recv_buf(peer, slot);
      if (wc[i].byte_len > 0 && p.up) {
        MsgHdr h;
        if (wc[i].byte_len < sizeof h) {
          _sink.on_peer_failed(peer, "verbs: short message (" + std::to_string(wc[i].byte_len) + " bytes)");
          continue;
        }
        std::memcpy(&h, buf, sizeof h);  // copy once, then validate the copy
        if (std::string why; !am_header_ok(h, wc[i].byte_len - sizeof h, kEagerMax, &why)) {
          _sink.on_peer_failed(peer, "garbled verbs message (" + why + ", " + std::to_string(wc[i].byte_len) +
                                         " bytes)");
          continue;
        }
        _sink.on_am(peer, h, buf + sizeof h);
      }
      if (!p.up) continue;
      // Give the buffer back to the queue pair, and the credit to the peer.
      ibv_sge sge{reinterpret_cast<uint64_t>(buf), kSlot, _am_mr->lkey};
      ibv_recv_wr wr{};
      wr.wr_id = wc[i].wr_id;
      wr.sg_list = &sge;
      wr.num_sge = 1;
      ibv_recv_wr* bad = nullptr;
      if (int rc = ::ibv_post_recv(p.qp, &wr, &bad); rc != 0) {
        _sink.on_peer_failed(peer, std::string("verbs: ibv_post_recv: ") + std::strerror(rc));
        continue;
      }
      ++p.grant_owed;
    }
  }
}

bool VerbsTransport::send_credit(int peer) {
  VPeer& p = _peers[static_cast<size_t>(peer)];
  if (p.credits < 1 || !p.up) return false;
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_SEND_WITH_IMM;
  wr.num_sge = 0;
  wr.imm_data = htonl(p.grant_owed);
  const bool sig = p.unsignaled + 1 >= kSignalEvery;
  if (!post(peer, wr, Op{}, sig)) return false;
  --p.credits;
  p.grant_owed = 0;
  return true;
}

void VerbsTransport::progress() {
  poll_send();
  poll_recv();
  for (int r = 0; r < _size; ++r) {
    VPeer& p = _peers[static_cast<size_t>(r)];
    if (p.up && p.grant_owed >= kRecvDepth / 2) (void)send_credit(r);
  }
  acknowledge();
}

bool VerbsTransport::acknowledge() {
  bool found = false;
  for (int r = 0; r < _size; ++r) {
    VPeer& p = _peers[static_cast<size_t>(r)];
    const uint32_t n = mb().load(mb().notice_word(r));
    if (n == p.notice_acked || !p.up || r == _rank) continue;
    found = true;
    // Behind everything we posted to r before we saw the notice; everything
    // after it checks the mailbox, which the notice's owner wrote first.
    ibv_sge sge{reinterpret_cast<uint64_t>(&n), 4, 0};
    ibv_send_wr wr = write_wr(sge, p.mailbox_addr + mb().ack_word(_rank) * 4, p.mailbox_rkey);
    // Fenced: it leaves once our earlier READs and atomics have their
    // responses. One whose response is lost is asked again, and a duplicate
    // READ that finds the memory deregistered draws a remote access NAK.
    wr.send_flags = IBV_SEND_FENCE;
    if (_max_inline >= 4) {
      wr.send_flags |= IBV_SEND_INLINE;
      if (post(r, wr, Op{}, p.unsignaled + 1 >= kSignalEvery)) p.notice_acked = n;
    } else {  // the source must outlive the post: wait for it
      _scratch[kAckWord] = n;
      sge.addr = reinterpret_cast<uint64_t>(&_scratch[kAckWord]);
      sge.lkey = _scratch_mr->lkey;
      Op op;
      op.sync = true;
      // (its sequence number is known once posted: waiting for room can post
      // a notify word first, from complete_op)
      if (post(r, wr, std::move(op), true) &&
          sync_wait(wr.wr_id, Deadline::after_ms(5000), "revocation acknowledgement"))
        p.notice_acked = n;
    }
  }
  return found;
}

RevocationMailbox VerbsTransport::mb() const {
  return RevocationMailbox(const_cast<uint32_t*>(_mailbox.data()), _size);  // (peers write it: never const)
}

Status VerbsTransport::sync_wait(uint64_t id, const Deadline& dl, const char* what) {
  for (;;) {
    poll_send();
    if (auto it = _sync_done.find(id); it != _sync_done.end()) {
      ibv_wc wc = it->second;
      _sync_done.erase(it);
      if (wc.status == IBV_WC_SUCCESS) return Status::ok();
      return Status::error(code_of(wc.status), "verbs: %s: %s", what, ::ibv_wc_status_str(wc.status));
    }
    if (dl.expired()) {
      _sync_abandoned.insert(id);  // its completion, when it comes, is nobody's
      return Status::error(Code::timeout, "verbs: %s still in flight at the deadline", what);
    }
    cpu_relax();
  }
}

Status VerbsTransport::sync_rdma(int peer, ibv_wr_opcode opc, void* local, uint32_t lkey, uint64_t raddr, uint32_t rkey,
                                 size_t len, const char* what) {
  auto* l = static_cast<uint8_t*>(local);
  for (size_t off = 0; off < len;) {
    const size_t n = std::min<size_t>(len - off, _max_msg);
    ibv_sge sge{reinterpret_cast<uint64_t>(l + off), static_cast<uint32_t>(n), lkey};
    ibv_send_wr wr{};
    wr.opcode = opc;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.wr.rdma.remote_addr = raddr + off;
    wr.wr.rdma.rkey = rkey;
    Op op;
    op.sync = true;
    HCOMM_TRY(post(peer, wr, std::move(op), true));
    HCOMM_TRY(sync_wait(wr.wr_id, Deadline::after_ms(30000), what));  // (set by post: see acknowledge)
    off += n;
  }
  return Status::ok();
}

Status VerbsTransport::sync_atomic(int peer, ibv_wr_opcode opc, uint64_t raddr, uint32_t rkey, uint64_t compare_add,
                                   uint64_t swap, uint64_t* old) {
  uint64_t* slot = &_scratch[kAtomicWord];
  ibv_sge sge{reinterpret_cast<uint64_t>(slot), 8, _scratch_mr->lkey};
  ibv_send_wr wr{};
  wr.opcode = opc;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.wr.atomic.remote_addr = raddr;
  wr.wr.atomic.rkey = rkey;
  wr.wr.atomic.compare_add = compare_add;
  wr.wr.atomic.swap = swap;
  Op op;
  op.sync = true;
  HCOMM_TRY(post(peer, wr, std::move(op), true));
  HCOMM_TRY(sync_wait(wr.wr_id, Deadline::after_ms(30000), "atomic"));
  *old = std::atomic_ref<uint64_t>(*slot).load(std::memory_order_acquire);
  return Status::ok();
}

// ---- memory ---------------------------------------------------------------------------------

Status VerbsTransport::mem_add(hcomm_mem& m) {
  if (m.kind == MemKind::device) return Status::ok();  // HBM is not host memory the NIC can pin
  int acc = IBV_ACCESS_LOCAL_WRITE;
  if (m.access & HCOMM_ACCESS_REMOTE_READ) acc |= IBV_ACCESS_REMOTE_READ;
  if (m.access & HCOMM_ACCESS_REMOTE_WRITE) acc |= IBV_ACCESS_REMOTE_WRITE;
  if (m.access & HCOMM_ACCESS_REMOTE_ATOMIC) acc |= IBV_ACCESS_REMOTE_ATOMIC;
  ibv_mr* mr = nullptr;
  HCOMM_TRY(reg(m.ptr, m.size, acc, &mr, "registered memory"));
  m.verbs_mr = mr;
  RegTableEntry& e = _table[m.slot];
  e.addr = reinterpret_cast<uint64_t>(m.ptr);
  e.size = m.size;
  e.rights = m.access;
  e.key = mr->rkey;
  std::atomic_ref<uint64_t>(e.gen).store(m.gen, std::memory_order_release);
  return Status::ok();
}

void VerbsTransport::mem_remove(hcomm_mem& m) {
  if (m.verbs_mr == nullptr) return;
  // Revoke: the table entry, our own mailbox, then every peer's mailbox by an
  // RDMA WRITE, waited for (bounded) before the NIC forgets the memory.
  std::atomic_ref<uint64_t>(_table[m.slot].gen).store(m.gen + 1, std::memory_order_release);
  mb().store(RevocationMailbox::slot_word(_rank, m.slot), m.gen);
  (void)flush(-1, Deadline::after_ms(30000));  // our own operations using it as a local buffer
  // Tearing the context down: peers may have destroyed their queue pairs
  // already (after finalize's barrier); their keys die with ours.
  if (!_ctx.closing()) {
    std::vector<int> all;
    for (int r = 0; r < _size; ++r) all.push_back(r);
    const std::vector<int> told =
        write_peers(all, kRevokeWord, m.gen, RevocationMailbox::slot_word(_rank, m.slot), "revocation write");
    if (!told.empty()) await_acks(told);
  }
  ::ibv_dereg_mr(static_cast<ibv_mr*>(m.verbs_mr));
  m.verbs_mr = nullptr;
}

std::vector<int> VerbsTransport::write_peers(const std::vector<int>& peers, int from, uint32_t value, size_t word,
                                             const char* what) {
  _scratch[static_cast<size_t>(from)] = value;
  std::vector<std::pair<int, uint64_t>> posted;
  for (int r : peers) {
    VPeer& p = _peers[static_cast<size_t>(r)];
    if (r == _rank || !p.up) continue;
    ibv_sge sge{reinterpret_cast<uint64_t>(&_scratch[static_cast<size_t>(from)]), 4, _scratch_mr->lkey};
    ibv_send_wr wr = write_wr(sge, p.mailbox_addr + word * 4, p.mailbox_rkey);
    Op op;
    op.sync = true;
    if (post(r, wr, std::move(op), true)) posted.emplace_back(r, wr.wr_id);
  }
  std::vector<int> done;
  for (auto [r, id] : posted)
    if (sync_wait(id, Deadline::after_ms(5000), what)) done.push_back(r);
  return done;
}

void VerbsTransport::await_acks(const std::vector<int>& told) {
  // The mailbox writes are placed: now the notice, then its acknowledgement.
  const uint32_t n = ++_revocations;
  mb().await_acks(
      write_peers(told, kNoticeWord, n, mb().notice_word(_rank), "revocation notice"), n, stall_bound(),
      [this] {
        poll_send();
        _ctx.acknowledge_all();  // a peer releasing memory at the same time waits for us
      },
      [this](int r) { return _peers[static_cast<size_t>(r)].up; });
}

bool VerbsTransport::pack(const hcomm_mem& m, uint8_t* sec, size_t* len) const {
  if (m.verbs_mr == nullptr) return false;
  const uint32_t rkey = static_cast<ibv_mr*>(m.verbs_mr)->rkey;
  std::memcpy(sec, &rkey, 4);
  *len = 4;
  return true;
}

Status VerbsTransport::import(hcomm_rkey& k, const uint8_t* sec, size_t len) {
  uint32_t rkey = 0;
  HCOMM_TRY(parse_verbs_key_section(sec, len, static_cast<MemKind>(k.h.kind) == MemKind::device, &rkey));
  // The owner's registration as its table says now (the target takes no part:
  // an RDMA READ of the 32-byte entry).
  RegTableEntry e{};
  if (k.peer == _rank) {
    e = _table[k.h.slot];
  } else {
    VPeer& p = _peers[static_cast<size_t>(k.peer)];
    if (!p.up) return Status::error(Code::unsupported, "verbs: no queue pair to rank %d", k.peer);
    HCOMM_TRY(sync_rdma(k.peer, IBV_WR_RDMA_READ, &_scratch[kEntryWord], _scratch_mr->lkey,
                        p.table_addr + static_cast<uint64_t>(k.h.slot) * sizeof(RegTableEntry), p.table_rkey,
                        sizeof(RegTableEntry), "reading the owner's registration table"));
    std::memcpy(&e, &_scratch[kEntryWord], sizeof e);
  }
  HCOMM_TRY(check_reg_entry({.peer = k.peer, .slot = k.h.slot, .gen = k.h.gen, .addr = k.h.addr, .size = k.h.size,
                             .rights = k.h.rights, .key = rkey},
                            e));
  k.vrkey = rkey;
  return validate(k);
}

Status VerbsTransport::validate(const hcomm_rkey& k) const {
  if (mb().revoked(k.peer, k.h.slot, k.h.gen))
    return Status::error(Code::access_denied, "the key was revoked by rank %d", k.peer);
  return Status::ok();
}

Status VerbsTransport::lkey_of(const void* p, size_t len, uint32_t* lkey, ibv_mr** own, const hcomm_mem* known) {
  *own = nullptr;
  const hcomm_mem* m = known != nullptr ? known : _ctx.find_local(p, len);
  if (m != nullptr && m->verbs_mr != nullptr) {
    *lkey = static_cast<ibv_mr*>(m->verbs_mr)->lkey;
    return Status::ok();
  }
  HCOMM_TRY(reg(const_cast<void*>(p), len, IBV_ACCESS_LOCAL_WRITE, own, "a local buffer"));
  *lkey = (*own)->lkey;
  return Status::ok();
}

// ---- one-sided --------------------------------------------------------------------------------

Status VerbsTransport::rma(const RmaOp& a, const std::shared_ptr<Request>& r) {
  if (r == nullptr && ((a.op != Rma::put && a.op != Rma::get) || a.notify_rkey != nullptr))
    return Status::error(Code::invalid_argument, "verbs: only put and get run without a request");
  hcomm_rkey& k = *a.rkey;
  const uint64_t raddr = k.h.addr + a.roff;
  // Checked again here, right before the post: no acknowledgement of a
  // revocation goes out between this check and the post (see verbs.h).
  HCOMM_TRY(validate(k));
  if (a.notify_rkey != nullptr) HCOMM_TRY(validate(*a.notify_rkey));
  switch (a.op) {
    case Rma::put:
    case Rma::get: {
      uint32_t lkey = 0;
      ibv_mr* own = nullptr;
      HCOMM_TRY(lkey_of(a.local, a.len, &lkey, &own, a.local_mem));  // (found by the context's checks)
      if (a.op == Rma::get) return post_rdma(k.peer, IBV_WR_RDMA_READ, a.local, lkey, raddr, k.vrkey, a.len, r, own);
      HCOMM_TRY(post_rdma(k.peer, IBV_WR_RDMA_WRITE, a.local, lkey, raddr, k.vrkey, a.len, r, own));
      if (a.notify_rkey != nullptr && r != nullptr) {
        // The word goes out when the last data WRITE completed (complete_op).
        VPeer& p = _peers[static_cast<size_t>(k.peer)];
        if (Op& op = p.ops[(p.sq_posted - 1) & (kSqDepth - 1)]; op.live) {
          op.notify_addr = a.notify_rkey->h.addr + a.notify_off;
          op.notify_rkey = a.notify_rkey->vrkey;
          op.notify_value = a.notify_value;
          op.notify_slot = a.notify_rkey->h.slot;
          op.notify_gen = a.notify_rkey->h.gen;
        }
      }
      return Status::ok();
    }
    case Rma::notify: {
      uint64_t v = a.operand;
      _scratch[kNotifyWord] = v;
      return post_rdma(k.peer, IBV_WR_RDMA_WRITE, &_scratch[kNotifyWord], _scratch_mr->lkey, raddr, k.vrkey, 8,
                       r, nullptr);
    }
    case Rma::acc: {
      Status st = atomics_ok();
      if (st) st = accumulate(a);
      r->complete(st ? HCOMM_OK : to_hcomm(st.code()), st.message());
      return st;
    }
    case Rma::fetch_add:
    case Rma::cswap: {
      HCOMM_TRY(atomics_ok());
      if (_scratch_free.empty()) {
        Deadline dl = Deadline::after_ms(30000);
        while (_scratch_free.empty() && !dl.expired()) poll_send();
        if (_scratch_free.empty()) return Status::error(Code::no_resource, "verbs: no free fetch-result slot");
      }
      const int slot = _scratch_free.back();
      _scratch_free.pop_back();
      ibv_sge sge{reinterpret_cast<uint64_t>(&_scratch[static_cast<size_t>(slot)]), 8, _scratch_mr->lkey};
      ibv_send_wr wr{};
      wr.opcode = a.op == Rma::fetch_add ? IBV_WR_ATOMIC_FETCH_AND_ADD : IBV_WR_ATOMIC_CMP_AND_SWP;
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.wr.atomic.remote_addr = raddr;
      wr.wr.atomic.rkey = k.vrkey;
      wr.wr.atomic.compare_add = a.op == Rma::fetch_add ? a.operand : a.compare;
      wr.wr.atomic.swap = a.operand;
      if (a.fence) wr.send_flags |= IBV_SEND_FENCE;
      Op op;
      op.r = r;
      op.result = a.old_value;
      op.scratch = slot;
      ++r->outstanding;
      Status st = post(k.peer, wr, std::move(op), true);
      if (!st) {
        --r->outstanding;
        _scratch_free.push_back(slot);
      }
      return st;
    }
  }
  return Status::error(Code::invalid_argument, "verbs: unknown operation");
}

// remote[i] = remote[i] op local[i] without a NIC reduce: under the owner's
// lock word for the registration's stripe (NIC compare-swap 0 -> rank+1),
// READ the range into the bounce buffer, reduce, WRITE it back, release
// (compare-swap rank+1 -> 0); each step waits for its completion, so the
// release is ordered after the data. Every rank's accumulate on this memory,
// the owner's included, takes the same lock word through the NIC.
Status VerbsTransport::accumulate(const RmaOp& a) {
  const hcomm_rkey& k = *a.rkey;
  VPeer& p = _peers[static_cast<size_t>(k.peer)];
  const auto dt = static_cast<abi::DType>(a.dtype);
  const size_t es = abi::dtype_size(dt);
  const uint64_t lock = p.locks_addr + (k.h.slot % kLockStripes) * 8;
  const uint64_t me = static_cast<uint64_t>(_rank) + 1;
  Deadline dl = Deadline::after_ms(30000);
  for (size_t off = 0; off < a.len;) {
    const size_t n = std::min(a.len - off, kAccChunk - kAccChunk % es);
    for (uint64_t old = 1;;) {
      HCOMM_TRY(sync_atomic(k.peer, IBV_WR_ATOMIC_CMP_AND_SWP, lock, p.locks_rkey, 0, me, &old));
      if (old == 0) break;
      if (dl.expired())
        return Status::error(Code::timeout, "accumulate lock of rank %d held by rank %lu until the deadline", k.peer,
                             static_cast<unsigned long>(old - 1));
      poll_recv();  // keep our own inbound traffic moving while we wait
      _ctx.acknowledge_all();
    }
    // Checked again under the lock: the wait may have acknowledged a
    // revocation of this memory.
    Status st = validate(k);
    const uint64_t raddr = k.h.addr + a.roff + off;
    if (st) st = sync_rdma(k.peer, IBV_WR_RDMA_READ, _bounce.data(), _bounce_mr->lkey, raddr, k.vrkey, n,
                          "accumulate read");
    if (st) {
      abi::reduce(dt, static_cast<abi::RedOp>(a.redop), _bounce.data(), a.local + off, n / es);
      st = sync_rdma(k.peer, IBV_WR_RDMA_WRITE, _bounce.data(), _bounce_mr->lkey, raddr, k.vrkey, n,
                     "accumulate write");
    }
    uint64_t was = 0;
    Status rel = sync_atomic(k.peer, IBV_WR_ATOMIC_CMP_AND_SWP, lock, p.locks_rkey, me, 0, &was);
    HCOMM_TRY(st);
    HCOMM_TRY(rel);
    if (was != me)
      return Status::error(Code::protocol_error, "accumulate lock of rank %d was %lu, not ours (%lu)", k.peer,
                           static_cast<unsigned long>(was), static_cast<unsigned long>(me));
    off += n;
  }
  return Status::ok();
}

Status VerbsTransport::flush(int peer, const Deadline& dl) {
  // Implicit requests after the last signalled one: a signalled zero-byte
  // WRITE behind them (into our mailbox there, a key every pair holds)
  // completes only after they did.
  for (int q = 0; q < _size; ++q) {
    VPeer& p = _peers[static_cast<size_t>(q)];
    if ((peer >= 0 && q != peer) || !p.up || p.implicit_end <= p.signalled_end || p.implicit_end <= p.sq_retired)
      continue;
    ibv_send_wr wr{};
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.wr.rdma.remote_addr = p.mailbox_addr;
    wr.wr.rdma.rkey = p.mailbox_rkey;
    if (Status st = post(q, wr, Op{}, true, &dl); !st && p.up) {
      if (dl.expired()) return Status::error(Code::timeout, "flush: send queue to rank %d still full at the deadline", q);
      return st;
    }
  }
  for (;;) {
    poll_send();
    bool busy = false;
    for (int q = 0; q < _size; ++q) {
      const VPeer& p = _peers[static_cast<size_t>(q)];
      // (An implicit request can also be covered by a synchronous one that a
      // timed-out wait left in flight: that is not in async_ops.)
      busy |= (peer < 0 || q == peer) && (p.async_ops > 0 || (p.up && p.implicit_end > p.sq_retired));
    }
    if (!busy) return Status::ok();
    if (dl.expired()) return Status::error(Code::timeout, "flush: RDMA operations still in flight at the deadline");
    cpu_relax();
  }
}

// ---- messaging --------------------------------------------------------------------------------

bool VerbsTransport::am_send(int peer, const MsgHdr& h, const void* payload, size_t len) {
  VPeer& p = _peers[static_cast<size_t>(peer)];
  if (!p.up || p.credits <= 1) return false;  // the last credit is for credit messages
  const uint32_t idx = static_cast<uint32_t>(p.am_posted % kSendRing);
  if (p.am_posted >= kSendRing && p.am_slot_seq[idx] >= p.sq_retired) {
    poll_send();
    if (p.am_slot_seq[idx] >= p.sq_retired) return false;
  }
  uint8_t* slot = send_buf(peer, idx);
  std::memcpy(slot, &h, sizeof h);
  if (len > 0) std::memcpy(slot + sizeof h, payload, len);
  const uint32_t total = static_cast<uint32_t>(sizeof h + len);
  ibv_sge sge{reinterpret_cast<uint64_t>(slot), total, _am_mr->lkey};
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_SEND_WITH_IMM;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.imm_data = htonl(p.grant_owed);
  if (total <= _max_inline) wr.send_flags |= IBV_SEND_INLINE;
  // Signal every kSignalEvery-th send, and when the ring is about to wrap
  // onto slots no completion has retired yet.
  const bool sig = p.unsignaled + 1 >= kSignalEvery;
  const uint64_t seq = p.sq_posted;
  if (!post(peer, wr, Op{}, sig)) return false;
  p.am_slot_seq[idx] = seq;
  ++p.am_posted;
  --p.credits;
  p.grant_owed = 0;
  return true;
}

Status VerbsTransport::expose(Request& r, MsgHdr& h) {
  const hcomm_mem* m = _ctx.find_local(r.sbuf, r.slen);
  // (Registered without REMOTE_READ: a receiver's READ through that key
  // would be NAKed and break the pair, so it is registered like a plain one.)
  if (m != nullptr && m->verbs_mr != nullptr && (m->access & HCOMM_ACCESS_REMOTE_READ) != 0) {
    h.rkey = static_cast<ibv_mr*>(m->verbs_mr)->rkey;
    return Status::ok();
  }
  // Any other buffer: registered for this message, deregistered at FIN.
  ibv_mr* mr = nullptr;
  HCOMM_TRY(reg(const_cast<uint8_t*>(r.sbuf), r.slen, IBV_ACCESS_REMOTE_READ, &mr, "a send buffer"));
  h.rkey = mr->rkey;
  r.exposed = mr;
  return Status::ok();
}

void VerbsTransport::unexpose(Request& r) {
  if (r.exposed != nullptr) ::ibv_dereg_mr(static_cast<ibv_mr*>(r.exposed));
  r.exposed = nullptr;
}

Status VerbsTransport::read_raw(int peer, void* local, uint64_t addr, uint32_t rkey, size_t len,
                                const std::shared_ptr<Request>& g) {
  if (!_peers[static_cast<size_t>(peer)].up) return Status::error(Code::unsupported, "verbs: no queue pair to rank %d", peer);
  uint32_t lkey = 0;
  ibv_mr* own = nullptr;
  HCOMM_TRY(lkey_of(local, len, &lkey, &own));
  return post_rdma(peer, IBV_WR_RDMA_READ, local, lkey, addr, rkey, len, g, own);
}

Status VerbsTransport::expose_recv(int peer, Request& r, size_t len, uint64_t* addr, uint32_t* rkey) {
  if (!_peers[static_cast<size_t>(peer)].up) return Status::error(Code::peer_failure, "verbs: no queue pair to rank %d", peer);
  *addr = reinterpret_cast<uint64_t>(r.rbuf);
  const hcomm_mem* m = _ctx.find_local(r.rbuf, len);
  if (m != nullptr && m->verbs_mr != nullptr && (m->access & HCOMM_ACCESS_REMOTE_WRITE) != 0) {
    *rkey = static_cast<ibv_mr*>(m->verbs_mr)->rkey;
    return Status::ok();
  }
  // Any other buffer (or memory peers may not write): registered for this
  // message, writable by the peer only there, deregistered at WDONE.
  ibv_mr* mr = nullptr;
  HCOMM_TRY(reg(r.rbuf, len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE, &mr, "a receive buffer"));
  *rkey = mr->rkey;
  r.exposed = mr;
  return Status::ok();
}

void VerbsTransport::unexpose_recv(Request& r, bool /*arrived*/) {
  if (r.exposed != nullptr) ::ibv_dereg_mr(static_cast<ibv_mr*>(r.exposed));
  r.exposed = nullptr;
}

Status VerbsTransport::write_raw(int peer, const Request& s, size_t len, uint64_t addr, uint32_t rkey,
                                 const std::shared_ptr<Request>& g) {
  if (!_peers[static_cast<size_t>(peer)].up) return Status::error(Code::peer_failure, "verbs: no queue pair to rank %d", peer);
  // The send buffer's exposure (its own registration, or its hcomm memory's)
  // gives the local key; it stays registered until the send completes.
  uint32_t lkey = 0;
  ibv_mr* own = nullptr;
  if (s.exposed != nullptr) lkey = static_cast<ibv_mr*>(s.exposed)->lkey;
  else HCOMM_TRY(lkey_of(s.sbuf, len, &lkey, &own));
  return post_rdma(peer, IBV_WR_RDMA_WRITE, const_cast<uint8_t*>(s.sbuf), lkey, addr, rkey, len, g, own);
}

void VerbsTransport::peer_failed(int peer, const std::string& why) {
  VPeer& p = _peers[static_cast<size_t>(peer)];
  if (!p.up) return;
  implicit_lost(peer, p.sq_retired, HCOMM_ERR_PEER_FAILURE, why);
  p.up = false;
  p.down = why;
  // Stop the NIC touching anything for this pair before buffers are released.
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_ERR;
  (void)::ibv_modify_qp(p.qp, &a, IBV_QP_STATE);
  for (Op& slot : p.ops) {
    if (!slot.live || slot.sync) continue;
    Op op = std::move(slot);
    slot = Op{};
    --p.async_ops;
    if (op.own_mr != nullptr) ::ibv_dereg_mr(op.own_mr);
    if (op.scratch >= 0) _scratch_free.push_back(op.scratch);
    if (op.r) op.r->complete(HCOMM_ERR_PEER_FAILURE, why);
  }
}

}  // namespace hcomm::api
