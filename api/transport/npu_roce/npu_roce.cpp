#include "api/transport/npu_roce/npu_roce.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>

#include "api/core/context.h"
#include "api/proto/am_check.h"
#include "api/transport/revocation.h"
#include "api/transport/shm/shm.h"
#include "common/barrier.h"
#include "common/env.h"
#include "hal/abi/reduce.h"

namespace hcomm::api {

namespace abi = hal::abi;
namespace rdma = hal::abi::rdma;
using rdma::WrOp;

namespace {

Code code_of(rdma::WcStatus s) {
  switch (s) {
    case rdma::WcStatus::SUCCESS: return Code::ok;
    case rdma::WcStatus::REM_ACCESS_ERR:
    case rdma::WcStatus::LOC_PROT_ERR: return Code::access_denied;
    default: return Code::peer_failure;
  }
}

std::string wc_text(uint8_t s) { return rdma::wc_status_name(static_cast<rdma::WcStatus>(s)); }

// Scratch words: 0..kFetchSlots-1 fetch results and notify values (one per
// operation in flight); then the import read of a table entry (4 words),
// the revoked generation being written and the revocation number.
constexpr int kFetchSlots = 1008;
constexpr int kEntryWord = 1008;
constexpr int kRevokeWord = 1012;
constexpr int kNoticeWord = 1013;
constexpr int kScratchWords = 1016;

// Receive work requests carry this bit in their wr_id.
constexpr uint64_t kRecvBit = uint64_t{1} << 39;

}  // namespace

Status NpuRoceConfig::from_env(NpuRoceConfig* out) {
  NpuRoceConfig c;
  long timeout = c.timeout, retry = c.retry;
  HCOMM_TRY(env_int("HCOMM_ROCE_TIMEOUT", 1, 31, &timeout));
  HCOMM_TRY(env_int("HCOMM_ROCE_RETRY", 0, 7, &retry));
  c.timeout = static_cast<int>(timeout);
  c.retry = static_cast<int>(retry);
  *out = c;
  return Status::ok();
}

NpuRoceTransport::NpuRoceTransport(Context& ctx, AmSink& sink, hal::npu::Device& dev)
    : _ctx(ctx), _sink(sink), _dev(dev), _rank(ctx.rank()), _size(ctx.size()) {
  _peers.resize(static_cast<size_t>(_size));
}

Status NpuRoceTransport::open(Context& ctx, AmSink& sink, hal::npu::Device& dev, const NpuRoceConfig& cfg,
                              const std::vector<bool>& same_host, std::unique_ptr<NpuRoceTransport>* out) {
  std::unique_ptr<NpuRoceTransport> t(new NpuRoceTransport(ctx, sink, dev));
  HCOMM_TRY(t->setup(cfg, same_host));
  *out = std::move(t);
  return Status::ok();
}

Status NpuRoceTransport::region(size_t len, uint8_t access, Region* out, const char* what) {
  const size_t bytes = (len + 4095) & ~size_t{4095};
  out->len = len;
  Status st = driver::DmaBuffer::allocate(bytes, -1, &out->buf);
  if (st) st = _dev.map_buffer(out->buf, hal::npu::access::RW, &out->map);
  if (st) st = _dev.mr_register(out->map.iova, len, access, &out->key);
  if (!st) return Status(st.code(), std::string("npu_roce: ") + what + ": " + st.message());
  return Status::ok();
}

void NpuRoceTransport::drop_region(Region& r) {
  if (r.key != 0) (void)_dev.mr_invalidate(r.key);
  r.key = 0;
  if (r.map.valid()) (void)_dev.unmap(&r.map);
}

Status NpuRoceTransport::setup(const NpuRoceConfig& cfg, const std::vector<bool>& same_host) {
  hal::npu::NetInfo ni;
  HCOMM_TRY(_dev.net_info(&ni));
  if (!ni.link_up) return Status::error(Code::not_found, "npu_roce: the NPU's port has no link");
  if (ni.ip == 0) return Status::error(Code::not_found, "npu_roce: the NPU's port has no IPv4 address");
  _ip = ni.ip;
  std::memcpy(_mac, ni.mac, 6);
  _mtu = 5;
  while (_mtu > 1 && rdma::mtu_bytes(_mtu) > ni.max_mtu) --_mtu;
  _timeout = cfg.timeout;
  _retry = cfg.retry;
  const auto n = static_cast<size_t>(_size);
  HCOMM_TRY(region(n * (kRecvDepth + kSendRing) * kSlot, rdma::access::LOCAL_WRITE, &_am, "message buffers"));
  HCOMM_TRY(region(kMaxRegs * sizeof(Entry), rdma::access::LOCAL_WRITE | rdma::access::REMOTE_READ, &_table,
                   "registration table"));
  HCOMM_TRY(region(RevocationMailbox::words(_size) * 4, rdma::access::LOCAL_WRITE | rdma::access::REMOTE_WRITE, &_mailbox,
                   "revocation mailboxes"));
  HCOMM_TRY(region(kScratchWords * 8, rdma::access::LOCAL_WRITE, &_scratch, "scratch"));
  for (int i = kFetchSlots - 1; i >= 0; --i) _scratch_free.push_back(i);
  std::random_device rd;
  _psn = rd() & 0xffffff;
  for (int r = 0; r < _size; ++r) {
    if (r == _rank || same_host[static_cast<size_t>(r)]) continue;
    hal::npu::QpOptions o;
    o.sq_log2 = 8;
    o.rq_log2 = 6;  // kRecvDepth receives, with room
    o.cq_log2 = 9;  // every send and receive completes here
    o.path_mtu = _mtu;
    o.timeout = static_cast<uint8_t>(_timeout);
    o.retry_cnt = static_cast<uint8_t>(_retry);
    o.rnr_retry = 7;
    o.sq_psn = _psn;
    HCOMM_TRY(_dev.create_qp(o, &_peers[static_cast<size_t>(r)].qp));
  }
  _caps.max_short = kEagerMax;
  _caps.max_zcopy = 0;
  _caps.put = _caps.get = _caps.atomic64 = _caps.reduce = _caps.notify = true;
  _caps.remote_hosts = true;
  _caps.acknowledges = true;
  _caps.sync = false;
  _caps.rndv_write = true;
  return Status::ok();
}

NpuRoceTransport::~NpuRoceTransport() {
  for (RPeer& p : _peers) p.qp.reset();  // QP_DESTROY: the engine stops touching the rings and buffers
  for (auto& [id, op] : _ops)
    if (op.staging) drop_region(*op.staging);
  for (Region* r : {&_am, &_table, &_mailbox, &_scratch}) drop_region(*r);
}

// ---- wire-up ------------------------------------------------------------------------------

Status NpuRoceTransport::connect(Bootstrap& boot, NpuRoceTransport* self, const std::string& absent,
                                 const Deadline& dl, std::vector<bool>* have) {
  std::string mine;
  if (self != nullptr) {
    NpuRoceWireHdr h{};
    h.ip = self->_ip;
    std::memcpy(h.mac, self->_mac, 6);
    h.mtu = self->_mtu;
    h.psn = self->_psn;
    h.table_iova = self->_table.map.iova;
    h.table_key = self->_table.key;
    h.mailbox_iova = self->_mailbox.map.iova;
    h.mailbox_key = self->_mailbox.key;
    std::vector<uint32_t> qpns;
    for (const RPeer& p : self->_peers) qpns.push_back(p.qp ? p.qp->qpn() : 0);
    mine = npu_roce_wire_blob(h, qpns);
  } else {
    mine = npu_roce_wire_absent(absent);
  }
  std::vector<std::string> all;
  HCOMM_TRY(boot.allgather(mine, &all, dl));
  const int n = boot.size();
  std::vector<NpuRoceWire> ws;
  HCOMM_TRY(parse_npu_roce_wire(all, n, boot.rank(), &ws));
  have->assign(static_cast<size_t>(n), false);
  for (int r = 0; r < n; ++r) (*have)[static_cast<size_t>(r)] = ws[static_cast<size_t>(r)].present;
  if (self == nullptr) return Status::ok();
  for (int r = 0; r < n; ++r) {
    const NpuRoceWire& w = ws[static_cast<size_t>(r)];
    if (!w.present || !self->_peers[static_cast<size_t>(r)].qp) continue;
    if (w.qpn == 0)
      return Status::error(Code::protocol_error, "npu_roce wire-up: rank %d has no queue pair for rank %d", r,
                           boot.rank());
    HCOMM_TRY(self->bring_up(r, w.h, w.qpn));
  }
  return Status::ok();
}

Status NpuRoceTransport::bring_up(int peer, const NpuRoceWireHdr& w, uint32_t qpn) {
  RPeer& p = _peers[static_cast<size_t>(peer)];
  hal::npu::QpPeer to;
  to.qpn = qpn;
  to.ip = w.ip;
  std::memcpy(to.mac, w.mac, 6);
  to.psn = w.psn;
  to.path_mtu = w.mtu;  // the smaller of the two ports' MTUs
  Status st = p.qp->connect(to);
  if (!st) return Status(st.code(), "npu_roce: queue pair to rank " + std::to_string(peer) + ": " + st.message());
  for (uint32_t i = 0; i < kRecvDepth; ++i)
    if (!post_recv_slot(peer, i)) return Status::error(Code::no_resource, "npu_roce: receive ring full");
  p.credits = kRecvDepth;
  p.table_iova = w.table_iova;
  p.table_key = w.table_key;
  p.mailbox_iova = w.mailbox_iova;
  p.mailbox_key = w.mailbox_key;
  p.up = true;
  return Status::ok();
}

// Receive buffer `slot` of `peer` (back) on its queue pair.
bool NpuRoceTransport::post_recv_slot(int peer, uint32_t slot) {
  rdma::RecvWqe rw{};
  rw.wr_id = wr_id(peer, slot) | kRecvBit;
  rw.laddr = recv_iova(peer, slot);
  rw.lkey = _am.key;
  rw.length = kSlot;
  return _peers[static_cast<size_t>(peer)].qp->post_recv(rw) == Code::ok;
}

uint8_t* NpuRoceTransport::recv_buf(int peer, uint32_t i) const {
  return _am.data() + (static_cast<size_t>(peer) * kRecvDepth + i) * kSlot;
}
uint64_t NpuRoceTransport::recv_iova(int peer, uint32_t i) const {
  return _am.map.iova + (static_cast<uint64_t>(peer) * kRecvDepth + i) * kSlot;
}
uint8_t* NpuRoceTransport::send_buf(int peer, uint32_t i) const {
  return _am.data() + (static_cast<size_t>(_size) * kRecvDepth + static_cast<size_t>(peer) * kSendRing + i) * kSlot;
}
uint64_t NpuRoceTransport::send_iova(int peer, uint32_t i) const {
  return _am.map.iova +
         (static_cast<uint64_t>(_size) * kRecvDepth + static_cast<uint64_t>(peer) * kSendRing + i) * kSlot;
}

// ---- posting and completions --------------------------------------------------------------

Status NpuRoceTransport::post(int peer, rdma::SendWqe w, Op op) {
  if (!_lost.is_ok()) return _lost;
  RPeer& p = _peers[static_cast<size_t>(peer)];
  if (!p.up) return Status::error(Code::peer_failure, "npu_roce: the queue pair to rank %d is down", peer);
  const uint64_t id = wr_id(peer, p.posted);
  w.wr_id = id;
  w.flags |= rdma::wr_flag::SIGNALED;
  Deadline dl = Deadline::after_ms(30000);
  while (p.qp->post_send(w) != Code::ok) {  // the ring is full: reap (receives wait in _rx)
    poll(peer);
    if (!p.up) return Status::error(Code::peer_failure, "npu_roce: the queue pair to rank %d is down", peer);
    if (!_lost.is_ok()) return _lost;
    if (dl.expired()) return Status::error(Code::no_resource, "npu_roce: send queue to rank %d full until the deadline", peer);
    cpu_relax();
  }
  ++p.posted;
  _ops.emplace(id, std::move(op));
  return Status::ok();
}

Status NpuRoceTransport::post_data(int peer, WrOp opc, uint64_t laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey,
                                   size_t len, const std::shared_ptr<Request>& r, uint8_t dtype, uint8_t redop,
                                   uint8_t flags) {
  uint64_t piece = kMaxMsg;
  if (opc == WrOp::WRITE_REDUCE) piece -= piece % abi::dtype_size(static_cast<abi::DType>(dtype));
  size_t off = 0;
  do {
    const size_t n = std::min<size_t>(len - off, piece);
    rdma::SendWqe w = rdma::make_wqe(opc, laddr + off, lkey, static_cast<uint32_t>(n), raddr + off, rkey, 0,
                                     off == 0 ? flags : 0);
    w.dtype = dtype;
    w.redop = redop;
    Op op;
    op.r = r;
    ++r->outstanding;
    Status st = post(peer, w, std::move(op));
    if (!st) {
      --r->outstanding;
      return cut_short(_sink, _peers[static_cast<size_t>(peer)].up, "npu_roce", peer, off, len, st);
    }
    off += n;
  } while (off < len);
  return Status::ok();
}

int NpuRoceTransport::take_scratch(const Deadline& dl) {
  while (_scratch_free.empty() && !dl.expired()) {
    for (int r = 0; r < _size; ++r)
      if (_peers[static_cast<size_t>(r)].up) poll(r);
    cpu_relax();
  }
  if (_scratch_free.empty()) return -1;
  const int s = _scratch_free.back();
  _scratch_free.pop_back();
  return s;
}

// Reaps one queue pair's completions: sends complete here, receives wait in
// _rx for progress() (a receive may start a protocol step that posts).
void NpuRoceTransport::poll(int peer) {
  RPeer& p = _peers[static_cast<size_t>(peer)];
  if (!p.qp) return;
  rdma::Cqe c[32];
  uint32_t n;
  while ((n = p.qp->poll(c)) > 0) {
    for (uint32_t i = 0; i < n; ++i) {
      if (c[i].wr_id & kRecvBit) _rx.emplace_back(peer, c[i]);
      else complete_op(peer, c[i]);
    }
  }
}

uint64_t NpuRoceTransport::progress_mark(int peer) {
  if (peer < 0 || peer >= _size) return 0;
  const RPeer& p = _peers[static_cast<size_t>(peer)];
  uint64_t m = p.completions;
  // The port's frames count only while this pair has work in flight (a long
  // transfer on a lossy wire): they also move with other pairs' traffic, which
  // would keep a cancel waiting on a stopped peer forever.
  if (p.posted == p.retired) return m;
  hal::npu::NetInfo ni;
  if (_lost.is_ok() && _dev.net_info(&ni))
    m += ni.counters[abi::net_counter::TX_FRAMES] + ni.counters[abi::net_counter::RX_FRAMES];
  return m;
}

void NpuRoceTransport::complete_op(int peer, const rdma::Cqe& c) {
  RPeer& p = _peers[static_cast<size_t>(peer)];
  ++p.completions;
  p.retired = std::max<uint64_t>(p.retired, (c.wr_id & (kRecvBit - 1)) + 1);
  auto it = _ops.find(c.wr_id);
  if (it == _ops.end()) return;
  Op op = std::move(it->second);
  _ops.erase(it);
  const auto st = static_cast<rdma::WcStatus>(c.status);
  if (op.sync) {
    if (_sync_abandoned.erase(c.wr_id) == 0) _sync_done[c.wr_id] = c.status;
    if (st != rdma::WcStatus::SUCCESS && p.up)
      _sink.on_peer_failed(peer, "npu_roce queue pair failed: " + wc_text(c.status));
    return;
  }
  if (op.scratch >= 0) {
    // (Not into a request already ended, as verbs.)
    if (st == rdma::WcStatus::SUCCESS && op.result != nullptr && (op.r == nullptr || !op.r->done()))
      *op.result = std::atomic_ref<uint64_t>(reinterpret_cast<uint64_t*>(_scratch.data())[op.scratch])
                       .load(std::memory_order_acquire);
    _scratch_free.push_back(op.scratch);
  }
  if (op.staging && op.copy_to != nullptr) {  // the last piece: the whole message is in
    if (st == rdma::WcStatus::SUCCESS && (op.r == nullptr || !op.r->done()))
      std::memcpy(op.copy_to, op.staging->data(), op.copy_len);
    drop_region(*op.staging);
  }
  Request* r = op.r.get();
  if (st != rdma::WcStatus::SUCCESS) {
    if (r != nullptr && !r->done())
      r->complete(to_hcomm(code_of(st)), "npu_roce: " + wc_text(c.status) + " on the queue pair to rank " +
                                             std::to_string(peer));
    // The queue pair is in ERR and flushes everything behind: the pair is gone.
    if (p.up) _sink.on_peer_failed(peer, "npu_roce queue pair failed: " + wc_text(c.status));
  }
  if (r != nullptr && r->outstanding > 0 && --r->outstanding == 0) r->complete(HCOMM_OK);
}

// One inbound message (a receive completion): credits, the header checked
// once, then the buffer back to the queue pair.
void NpuRoceTransport::deliver(int peer, const rdma::Cqe& c) {
  RPeer& p = _peers[static_cast<size_t>(peer)];
  const uint32_t slot = static_cast<uint32_t>(c.wr_id & 0xffffffffu);
  if (slot >= kRecvDepth || !p.up) return;
  if (c.status != static_cast<uint8_t>(rdma::WcStatus::SUCCESS)) {
    if (c.status != static_cast<uint8_t>(rdma::WcStatus::WR_FLUSH_ERR))
      _sink.on_peer_failed(peer, "npu_roce receive failed: " + wc_text(c.status));
    return;
  }
  if (c.flags & rdma::wc_flag::IMM) {
    // Never more than kRecvDepth in all: a larger grant would let us send
    // into buffers that are not there.
    if (c.imm > kRecvDepth - p.credits) {
      _sink.on_peer_failed(peer, "npu_roce: credit grant of " + std::to_string(c.imm) + " with " +
                                     std::to_string(p.credits) + " of " + std::to_string(kRecvDepth) + " held");
      return;
    }
    p.credits += c.imm;
  }
  const uint8_t* buf = recv_buf(peer, slot);
  if (c.byte_len > 0) {
    MsgHdr h;
    if (c.byte_len < sizeof h || c.byte_len > kSlot) {
      _sink.on_peer_failed(peer, "npu_roce: message of " + std::to_string(c.byte_len) + " bytes");
      return;
    }
    std::memcpy(&h, buf, sizeof h);  // copy once, then validate the copy
    if (std::string why; !am_header_ok(h, c.byte_len - sizeof h, kEagerMax, &why)) {
      _sink.on_peer_failed(peer, "garbled npu_roce message (" + why + ", " + std::to_string(c.byte_len) + " bytes)");
      return;
    }
    _sink.on_am(peer, h, buf + sizeof h);
  }
  if (!p.up) return;
  if (!post_recv_slot(peer, slot)) {
    _sink.on_peer_failed(peer, "npu_roce: receive ring full on repost");
    return;
  }
  ++p.grant_owed;
}

bool NpuRoceTransport::send_credit(int peer) {
  RPeer& p = _peers[static_cast<size_t>(peer)];
  if (p.credits < 1 || !p.up) return false;
  rdma::SendWqe w = rdma::make_wqe(WrOp::SEND_IMM, 0, 0, 0, 0, 0, 0);
  w.imm = p.grant_owed;
  if (!post(peer, w, Op{})) return false;
  --p.credits;
  p.grant_owed = 0;
  return true;
}

void NpuRoceTransport::progress() {
  if (!_lost.is_ok()) return;
  for (int r = 0; r < _size; ++r) poll(r);
  while (!_rx.empty()) {
    auto [peer, c] = _rx.front();
    _rx.pop_front();
    deliver(peer, c);
  }
  for (int r = 0; r < _size; ++r) {
    RPeer& p = _peers[static_cast<size_t>(r)];
    if (p.up && p.grant_owed >= kRecvDepth / 2) (void)send_credit(r);
  }
  acknowledge();
}

RevocationMailbox NpuRoceTransport::mb() const {
  return RevocationMailbox(reinterpret_cast<uint32_t*>(_mailbox.data()), _size);
}

// A revocation notice answered on our queue pair to its owner, behind what
// we posted before we saw it, and fenced (as verbs does: see verbs.h,
// "Keys"): a READ whose response was lost is asked again, and a duplicate
// READ after the key is gone would be refused, so the answer waits for our
// READs' responses.
bool NpuRoceTransport::acknowledge() {
  if (!_lost.is_ok()) return false;
  bool found = false;
  for (int r = 0; r < _size; ++r) {
    RPeer& p = _peers[static_cast<size_t>(r)];
    const uint32_t n = mb().load(mb().notice_word(r));
    if (n == p.notice_acked || !p.up || r == _rank) continue;
    found = true;
    const int s = take_scratch(Deadline::after_ms(5000));
    if (s < 0) return found;
    std::atomic_ref<uint64_t>(reinterpret_cast<uint64_t*>(_scratch.data())[s]).store(n, std::memory_order_release);
    Op op;
    op.scratch = s;  // held until the WRITE completes
    if (post(r,
             rdma::make_wqe(WrOp::WRITE, scratch_iova(s), _scratch.key, 4, p.mailbox_iova + mb().ack_word(_rank) * 4,
                            p.mailbox_key, 0, rdma::wr_flag::FENCE),
             std::move(op))) {
      p.notice_acked = n;
    } else {
      _scratch_free.push_back(s);
    }
  }
  return found;
}

Status NpuRoceTransport::sync_wait(int peer, uint64_t id, const Deadline& dl, const char* what) {
  for (;;) {
    poll(peer);
    if (auto it = _sync_done.find(id); it != _sync_done.end()) {
      const uint8_t s = it->second;
      _sync_done.erase(it);
      if (s == static_cast<uint8_t>(rdma::WcStatus::SUCCESS)) return Status::ok();
      return Status::error(code_of(static_cast<rdma::WcStatus>(s)), "npu_roce: %s: %s", what, wc_text(s).c_str());
    }
    if (!_lost.is_ok()) return _lost;
    if (dl.expired()) {
      _sync_abandoned.insert(id);  // its completion, when it comes, is nobody's
      return Status::error(Code::timeout, "npu_roce: %s still in flight at the deadline", what);
    }
    cpu_relax();
  }
}

void NpuRoceTransport::check_health() {
  if (_lost.is_ok())
    if (Status h = _dev.health(); !h) lose(h);
}

void NpuRoceTransport::lose(const Status& why) {
  _lost = Status::error(Code::device_error, "NPU device %s is unusable: %s", _dev.link().location().c_str(),
                        why.message().c_str());
  for (auto& [id, op] : _ops)
    if (op.r && !op.r->done()) op.r->complete(HCOMM_ERR_DEVICE, _lost.message());
  _ops.clear();
  // Every pair is gone with the engine, and with it the only way to those
  // ranks: the context fails them (their sends, pulls and queued control
  // messages would otherwise wait for a lane that never comes back, and a
  // FIN to one would hold up the control messages queued behind it).
  for (int r = 0; r < _size; ++r) {
    RPeer& p = _peers[static_cast<size_t>(r)];
    if (!p.up) continue;
    p.up = false;
    if (r != _rank) _sink.on_peer_failed(r, _lost.message());
  }
}

// ---- memory ---------------------------------------------------------------------------------

Status NpuRoceTransport::mem_add(hcomm_mem& m) {
  if (!m.npu.valid()) return Status::ok();  // the device cannot reach it: no key, no section
  uint8_t acc = rdma::access::LOCAL_WRITE;
  if (m.access & HCOMM_ACCESS_REMOTE_READ) acc |= rdma::access::REMOTE_READ;
  if (m.access & HCOMM_ACCESS_REMOTE_WRITE) acc |= rdma::access::REMOTE_WRITE;
  if (m.access & HCOMM_ACCESS_REMOTE_ATOMIC) acc |= rdma::access::REMOTE_ATOMIC;
  // Accumulate needs read and write (api/proto/rma.cpp): WRITE_REDUCE does both.
  if ((m.access & HCOMM_ACCESS_REMOTE_READ) && (m.access & HCOMM_ACCESS_REMOTE_WRITE))
    acc |= rdma::access::REMOTE_REDUCE;
  uint32_t key = 0;
  Status st = _dev.mr_register(m.npu.iova, m.size, acc, &key);
  if (!st) return Status(st.code(), "npu_roce: memory key: " + st.message());
  m.roce_key = key;
  Entry& e = reinterpret_cast<Entry*>(_table.data())[m.slot];
  e.addr = m.npu.iova;
  e.size = m.size;
  e.rights = m.access;
  e.key = key;
  std::atomic_ref<uint64_t>(e.gen).store(m.gen, std::memory_order_release);
  return Status::ok();
}

void NpuRoceTransport::mem_remove(hcomm_mem& m) {
  if (m.roce_key == 0) return;
  // Revoke: the table entry, our own mailbox, then every peer's mailbox by
  // an RDMA WRITE, waited for (bounded) before the engine forgets the key.
  auto* table = reinterpret_cast<Entry*>(_table.data());
  std::atomic_ref<uint64_t>(table[m.slot].gen).store(m.gen + 1, std::memory_order_release);
  mb().store(RevocationMailbox::slot_word(_rank, m.slot), m.gen);
  (void)flush(-1, Deadline::after_ms(30000));  // our own operations using it as a local buffer
  reinterpret_cast<uint64_t*>(_scratch.data())[kRevokeWord] = m.gen;
  std::vector<std::pair<int, uint64_t>> ids;
  for (int r = 0; r < _size; ++r) {
    RPeer& p = _peers[static_cast<size_t>(r)];
    // Tearing the context down: peers may be gone already (after finalize's
    // barrier); their keys die with ours.
    if (!p.up || _ctx.closing()) continue;
    rdma::SendWqe w = rdma::make_wqe(WrOp::WRITE, scratch_iova(kRevokeWord), _scratch.key, 4,
                                     p.mailbox_iova + RevocationMailbox::slot_word(_rank, m.slot) * 4,
                                     p.mailbox_key, 0);
    Op op;
    op.sync = true;
    const uint64_t id = wr_id(r, p.posted);
    if (post(r, w, std::move(op))) ids.emplace_back(r, id);
  }
  std::vector<int> told;  // the ranks whose mailbox write completed
  for (auto [r, id] : ids)
    if (sync_wait(r, id, Deadline::after_ms(5000), "revocation write")) told.push_back(r);
  if (!told.empty()) {
    // The mailbox writes are placed: now the notice, then its acknowledgement.
    const uint32_t n = ++_revocations;
    reinterpret_cast<uint64_t*>(_scratch.data())[kNoticeWord] = n;
    std::vector<std::pair<int, uint64_t>> notes;
    for (int r : told) {
      RPeer& p = _peers[static_cast<size_t>(r)];
      if (r == _rank || !p.up) continue;
      Op op;
      op.sync = true;
      const uint64_t nid = wr_id(r, p.posted);
      if (post(r,
               rdma::make_wqe(WrOp::WRITE, scratch_iova(kNoticeWord), _scratch.key, 4,
                              p.mailbox_iova + mb().notice_word(_rank) * 4, p.mailbox_key, 0),
               std::move(op)))
        notes.emplace_back(r, nid);
    }
    std::vector<int> waiting;
    for (auto [r, nid] : notes)
      if (sync_wait(r, nid, Deadline::after_ms(5000), "revocation notice")) waiting.push_back(r);
    mb().await_acks(
        waiting, n, stall_bound(),
        [&] {
          for (int r : waiting) poll(r);
          _ctx.acknowledge_all();  // a peer releasing memory at the same time waits for us
        },
        [this](int r) { return _lost.is_ok() && _peers[static_cast<size_t>(r)].up; });
  }
  (void)_dev.mr_invalidate(m.roce_key);
  m.roce_key = 0;
}

bool NpuRoceTransport::pack(const hcomm_mem& m, uint8_t* sec, size_t* len) const {
  if (m.roce_key == 0) return false;
  std::memcpy(sec, &m.roce_key, 4);
  std::memcpy(sec + 4, &m.npu.iova, 8);
  *len = 12;
  return true;
}

Status NpuRoceTransport::import(hcomm_rkey& k, const uint8_t* sec, size_t len) {
  uint32_t key = 0;
  uint64_t iova = 0;
  HCOMM_TRY(parse_npu_roce_key_section(sec, len, &key, &iova));
  RPeer& p = _peers[static_cast<size_t>(k.peer)];
  if (!p.up) return Status::error(Code::unsupported, "npu_roce: no queue pair to rank %d", k.peer);
  // The owner's registration as its table says now (the target takes no
  // part: an RDMA READ of the 32-byte entry).
  Op op;
  op.sync = true;
  const uint64_t id = wr_id(k.peer, p.posted);
  HCOMM_TRY(post(k.peer,
                 rdma::make_wqe(WrOp::READ, scratch_iova(kEntryWord), _scratch.key, sizeof(Entry),
                                p.table_iova + static_cast<uint64_t>(k.h.slot) * sizeof(Entry), p.table_key, 0),
                 std::move(op)));
  HCOMM_TRY(sync_wait(k.peer, id, Deadline::after_ms(30000), "reading the owner's registration table"));
  Entry e{};
  std::memcpy(&e, reinterpret_cast<uint64_t*>(_scratch.data()) + kEntryWord, sizeof e);
  HCOMM_TRY(check_reg_entry({.peer = k.peer, .slot = k.h.slot, .gen = k.h.gen, .addr = iova, .size = k.h.size,
                             .rights = k.h.rights, .key = key},
                            e));
  k.roce_key = key;
  k.roce_iova = iova;
  return validate(k);
}

Status NpuRoceTransport::validate(const hcomm_rkey& k) const {
  if (mb().revoked(k.peer, k.h.slot, k.h.gen))
    return Status::error(Code::access_denied, "the key was revoked by rank %d", k.peer);
  return Status::ok();
}

// ---- one-sided --------------------------------------------------------------------------------

Status NpuRoceTransport::rma(const RmaOp& a, const std::shared_ptr<Request>& r) {
  if (!_lost.is_ok()) return _lost;
  const hcomm_rkey& k = *a.rkey;
  // Checked again right before the post: no acknowledgement of a revocation
  // goes out between this check and the post.
  HCOMM_TRY(validate(k));
  if (a.notify_rkey != nullptr) HCOMM_TRY(validate(*a.notify_rkey));
  const uint64_t raddr = k.roce_iova + a.roff;
  uint64_t laddr = 0;
  uint32_t lkey = 0;
  if (a.op == Rma::put || a.op == Rma::get || a.op == Rma::acc) {
    if (a.local_mem == nullptr || a.local_mem->roce_key == 0)
      return Status::error(Code::invalid_argument, "local buffer is not device-mapped registered memory");
    laddr = a.local_mem->npu.iova + static_cast<uint64_t>(a.local - a.local_mem->ptr);
    lkey = a.local_mem->roce_key;
  }
  const uint8_t fence = a.fence ? rdma::wr_flag::FENCE : 0;
  Deadline dl = Deadline::after_ms(30000);
  // An 8-byte WRITE of `value` from a scratch word held until it completes.
  auto write_word = [&](uint64_t to, uint32_t key, uint64_t value, uint8_t flags) -> Status {
    const int s = take_scratch(dl);
    if (s < 0) return Status::error(Code::no_resource, "npu_roce: no free scratch word");
    std::atomic_ref<uint64_t>(reinterpret_cast<uint64_t*>(_scratch.data())[s]).store(value, std::memory_order_release);
    Op op;
    op.r = r;
    op.scratch = s;
    ++r->outstanding;
    Status st = post(k.peer, rdma::make_wqe(WrOp::WRITE, scratch_iova(s), _scratch.key, 8, to, key, 0,
                                            static_cast<uint8_t>(rdma::wr_flag::SIGNALED | flags)),
                     std::move(op));
    if (!st) {
      --r->outstanding;
      _scratch_free.push_back(s);
    }
    return st;
  };
  switch (a.op) {
    case Rma::put:
      HCOMM_TRY(post_data(k.peer, WrOp::WRITE, laddr, lkey, raddr, k.roce_key, a.len, r, 0, 0, fence));
      // Placed after the data: the responder runs a queue pair's WRITEs in PSN order.
      if (a.notify_rkey != nullptr) {
        Status st = write_word(a.notify_rkey->roce_iova + a.notify_off, a.notify_rkey->roce_key, a.notify_value, 0);
        // (The data is posted: the word is its last part.)
        const bool up = _peers[static_cast<size_t>(k.peer)].up;
        return st ? st : cut_short(_sink, up, "npu_roce", k.peer, a.len, a.len + 8, st);
      }
      return Status::ok();
    case Rma::get: return post_data(k.peer, WrOp::READ, laddr, lkey, raddr, k.roce_key, a.len, r, 0, 0, fence);
    case Rma::acc:
      return post_data(k.peer, WrOp::WRITE_REDUCE, laddr, lkey, raddr, k.roce_key, a.len, r,
                       static_cast<uint8_t>(a.dtype), static_cast<uint8_t>(a.redop), fence);
    case Rma::notify: return write_word(raddr, k.roce_key, a.operand, fence);
    case Rma::fetch_add:
    case Rma::cswap: {
      const int s = take_scratch(dl);
      if (s < 0) return Status::error(Code::no_resource, "npu_roce: no free fetch-result slot");
      rdma::SendWqe w = rdma::make_wqe(a.op == Rma::fetch_add ? WrOp::FETCH_ADD : WrOp::CMP_SWAP, scratch_iova(s),
                                       _scratch.key, 8, raddr, k.roce_key, 0,
                                       static_cast<uint8_t>(rdma::wr_flag::SIGNALED | fence));
      w.compare = a.compare;
      w.swap_add = a.operand;
      Op op;
      op.r = r;
      op.result = a.old_value;
      op.scratch = s;
      ++r->outstanding;
      Status st = post(k.peer, w, std::move(op));
      if (!st) {
        --r->outstanding;
        _scratch_free.push_back(s);
      }
      return st;
    }
  }
  return Status::error(Code::invalid_argument, "npu_roce: unknown operation");
}

Status NpuRoceTransport::flush(int peer, const Deadline& dl) {
  for (;;) {
    for (int r = 0; r < _size; ++r)
      if (peer < 0 || r == peer) poll(r);
    if (!_lost.is_ok()) return _lost;
    bool busy = false;
    for (auto& [id, op] : _ops) busy |= !op.sync && (peer < 0 || static_cast<int>(id >> 40) == peer);
    if (!busy) return Status::ok();
    if (dl.expired()) return Status::error(Code::timeout, "flush: RoCE operations still in flight at the deadline");
    cpu_relax();
  }
}

// ---- messaging --------------------------------------------------------------------------------

bool NpuRoceTransport::am_send(int peer, const MsgHdr& h, const void* payload, size_t len) {
  RPeer& p = _peers[static_cast<size_t>(peer)];
  if (!p.up || p.credits <= 1 || !_lost.is_ok()) return false;  // the last credit is for credit messages
  const uint32_t idx = static_cast<uint32_t>(p.am_posted % kSendRing);
  if (p.am_posted >= kSendRing && p.am_slot_seq[idx] >= p.retired) {
    poll(peer);
    if (p.am_slot_seq[idx] >= p.retired) return false;
  }
  uint8_t* slot = send_buf(peer, idx);
  std::memcpy(slot, &h, sizeof h);
  if (len > 0) std::memcpy(slot + sizeof h, payload, len);
  rdma::SendWqe w = rdma::make_wqe(WrOp::SEND_IMM, send_iova(peer, idx), _am.key,
                                   static_cast<uint32_t>(sizeof h + len), 0, 0, 0);
  w.imm = p.grant_owed;
  const uint64_t seq = p.posted;
  if (!post(peer, w, Op{})) return false;
  p.am_slot_seq[idx] = seq;
  ++p.am_posted;
  --p.credits;
  p.grant_owed = 0;
  return true;
}

// Rendezvous, sender side: registered memory the engine reaches is read in
// place; any other buffer is staged once into a DMA buffer of this message
// (released at FIN), since the device cannot DMA arbitrary user pages.
Status NpuRoceTransport::expose(Request& r, MsgHdr& h) {
  const hcomm_mem* m = _ctx.find_local(r.sbuf, r.slen);
  // (Registered without REMOTE_READ: the engine would NAK the peer's READ
  // and fail the pair, so that buffer is staged like a plain one.)
  if (m != nullptr && m->roce_key != 0 && (m->access & HCOMM_ACCESS_REMOTE_READ) != 0) {
    h.rkey = m->roce_key;
    h.addr = m->npu.iova + static_cast<uint64_t>(r.sbuf - m->ptr);
    return Status::ok();
  }
  auto* s = new Region;
  Status st = region(r.slen, rdma::access::REMOTE_READ, s, "staging a send buffer");
  if (!st) {
    drop_region(*s);
    delete s;
    return st;
  }
  std::memcpy(s->data(), r.sbuf, r.slen);
  h.rkey = s->key;
  h.addr = s->map.iova;
  r.exposed = s;
  return Status::ok();
}

void NpuRoceTransport::unexpose(Request& r) {
  auto* s = static_cast<Region*>(r.exposed);
  if (s != nullptr) {
    drop_region(*s);
    delete s;
  }
  r.exposed = nullptr;
}

// Rendezvous by write, receiver side: registered memory peers may write is
// written in place; any other buffer gets a DMA buffer of this message that
// the sender writes and that is copied out at WDONE.
Status NpuRoceTransport::expose_recv(int peer, Request& r, size_t len, uint64_t* addr, uint32_t* rkey) {
  if (!_peers[static_cast<size_t>(peer)].up)
    return Status::error(Code::peer_failure, "npu_roce: no queue pair to rank %d", peer);
  const hcomm_mem* m = _ctx.find_local(r.rbuf, len);
  if (m != nullptr && m->roce_key != 0 && (m->access & HCOMM_ACCESS_REMOTE_WRITE) != 0) {
    *rkey = m->roce_key;
    *addr = m->npu.iova + static_cast<uint64_t>(r.rbuf - m->ptr);
    return Status::ok();
  }
  auto* s = new Region;
  Status st = region(len, rdma::access::LOCAL_WRITE | rdma::access::REMOTE_WRITE, s, "staging a receive buffer");
  if (!st) {
    drop_region(*s);
    delete s;
    return st;
  }
  *rkey = s->key;
  *addr = s->map.iova;
  r.exposed = s;
  return Status::ok();
}

void NpuRoceTransport::unexpose_recv(Request& r, bool arrived) {
  auto* s = static_cast<Region*>(r.exposed);
  if (s == nullptr) return;
  if (arrived) std::memcpy(r.rbuf, s->data(), std::min(s->len, r.rlen));
  drop_region(*s);
  delete s;
  r.exposed = nullptr;
}

Status NpuRoceTransport::write_raw(int peer, const Request& s, size_t len, uint64_t addr, uint32_t rkey,
                                   const std::shared_ptr<Request>& g) {
  if (!_peers[static_cast<size_t>(peer)].up)
    return Status::error(Code::peer_failure, "npu_roce: no queue pair to rank %d", peer);
  // expose() made the send buffer reachable: staged, or registered memory.
  if (const auto* st = static_cast<const Region*>(s.exposed); st != nullptr)
    return post_data(peer, WrOp::WRITE, st->map.iova, st->key, addr, rkey, len, g);
  const hcomm_mem* m = _ctx.find_local(s.sbuf, len);
  if (m == nullptr || m->roce_key == 0)
    return Status::error(Code::invalid_argument, "npu_roce: the send buffer was not exposed");
  return post_data(peer, WrOp::WRITE, m->npu.iova + static_cast<uint64_t>(s.sbuf - m->ptr), m->roce_key, addr, rkey,
                   len, g);
}

Status NpuRoceTransport::read_raw(int peer, void* local, uint64_t addr, uint32_t rkey, size_t len,
                                  const std::shared_ptr<Request>& g) {
  if (!_peers[static_cast<size_t>(peer)].up)
    return Status::error(Code::unsupported, "npu_roce: no queue pair to rank %d", peer);
  const hcomm_mem* m = _ctx.find_local(local, len);
  if (m != nullptr && m->roce_key != 0)
    return post_data(peer, WrOp::READ, m->npu.iova + static_cast<uint64_t>(static_cast<uint8_t*>(local) - m->ptr),
                     m->roce_key, addr, rkey, len, g);
  // A plain buffer: READ into a staging buffer, copied out when it completes.
  auto s = std::make_shared<Region>();
  Status st = region(len, rdma::access::LOCAL_WRITE, s.get(), "staging a receive buffer");
  if (!st) {
    drop_region(*s);
    return st;
  }
  for (size_t off = 0; off < len;) {
    const size_t n = std::min<size_t>(len - off, kMaxMsg);
    Op op;
    op.r = g;
    op.staging = s;
    if (off + n == len) {  // the last piece copies the whole message out (completions come in order)
      op.copy_to = static_cast<uint8_t*>(local);
      op.copy_len = len;
    }
    ++g->outstanding;
    st = post(peer, rdma::make_wqe(WrOp::READ, s->map.iova + off, s->key, static_cast<uint32_t>(n), addr + off, rkey, 0),
              std::move(op));
    if (!st) {
      --g->outstanding;
      return st;
    }
    off += n;
  }
  return Status::ok();
}

void NpuRoceTransport::peer_failed(int peer, const std::string& why) {
  RPeer& p = _peers[static_cast<size_t>(peer)];
  if (!p.up) return;
  p.up = false;
  // Stop the engine touching anything for this pair before buffers are released.
  rdma::QpAttr a{};
  a.state = static_cast<uint8_t>(rdma::QpState::ERR);
  if (p.qp) (void)p.qp->modify(a);
  for (auto it = _ops.begin(); it != _ops.end();) {
    if (static_cast<int>(it->first >> 40) != peer || it->second.sync) {
      ++it;
      continue;
    }
    Op& op = it->second;
    if (op.scratch >= 0) _scratch_free.push_back(op.scratch);
    if (op.staging) drop_region(*op.staging);
    if (op.r && !op.r->done()) op.r->complete(HCOMM_ERR_PEER_FAILURE, why);
    it = _ops.erase(it);
  }
}

}  // namespace hcomm::api
