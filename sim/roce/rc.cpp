#include "sim/roce/rc.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>

#include "hal/abi/reduce.h"

namespace hcomm::sim::roce {

using rdma::WcStatus;
using wire::Op;

// ---- memory keys ---------------------------------------------------------------------

Status MrTable::set(const rdma::MrEntry& e) {
  const uint32_t idx = rdma::key_index(e.key);
  if (idx >= _e.size()) return Status::error(Code::out_of_range, "memory key index %u outside the table (%zu entries)", idx, _e.size());
  if (e.length == 0 || e.iova + e.length < e.iova)
    return Status::error(Code::invalid_argument, "memory key 0x%x: empty or wrapping range", e.key);
  if ((e.access & ~rdma::access::ALL) != 0)
    return Status::error(Code::invalid_argument, "memory key 0x%x: unknown access bits 0x%x", e.key, e.access);
  std::lock_guard lk(_mu);
  if (_e[idx].valid) return Status::error(Code::invalid_argument, "memory key index %u is in use", idx);
  _e[idx] = e;
  _e[idx].valid = 1;
  return Status::ok();
}

Status MrTable::invalidate(uint32_t key) {
  const uint32_t idx = rdma::key_index(key);
  std::lock_guard lk(_mu);
  if (idx >= _e.size() || !_e[idx].valid || _e[idx].key != key)
    return Status::error(Code::not_found, "memory key 0x%x is not registered", key);
  _e[idx] = rdma::MrEntry{};
  return Status::ok();
}

MrTable::Check MrTable::check(uint32_t key, uint64_t va, uint64_t len, uint8_t need) const {
  const uint32_t idx = rdma::key_index(key);
  std::lock_guard lk(_mu);
  if (idx >= _e.size() || !_e[idx].valid || _e[idx].key != key) return Check::bad_key;
  const rdma::MrEntry& e = _e[idx];
  if (va < e.iova || len > e.length || va - e.iova > e.length - len) return Check::out_of_range;
  if ((e.access & need) != need) return Check::no_right;
  return Check::ok;
}

// ---- queue pairs -----------------------------------------------------------------------

namespace {

uint32_t wr_packets(const rdma::SendWqe& w, uint32_t mtu) {
  switch (static_cast<rdma::WrOp>(w.opcode)) {
    case rdma::WrOp::READ:
    case rdma::WrOp::CMP_SWAP:
    case rdma::WrOp::FETCH_ADD:
      return 1;
    default:
      return w.length == 0 ? 1 : (w.length + mtu - 1) / mtu;
  }
}

// PSNs a request occupies: a READ one per response packet.
uint32_t wr_psns(const rdma::SendWqe& w, uint32_t mtu) {
  if (static_cast<rdma::WrOp>(w.opcode) == rdma::WrOp::READ) return w.length == 0 ? 1 : (w.length + mtu - 1) / mtu;
  return wr_packets(w, mtu);
}

bool is_read_or_atomic(uint8_t op) {
  const auto o = static_cast<rdma::WrOp>(op);
  return o == rdma::WrOp::READ || o == rdma::WrOp::CMP_SWAP || o == rdma::WrOp::FETCH_ADD;
}

rdma::WcOp wc_op(uint8_t op) {
  switch (static_cast<rdma::WrOp>(op)) {
    case rdma::WrOp::WRITE:
    case rdma::WrOp::WRITE_IMM: return rdma::WcOp::WRITE;
    case rdma::WrOp::SEND:
    case rdma::WrOp::SEND_IMM: return rdma::WcOp::SEND;
    case rdma::WrOp::READ: return rdma::WcOp::READ;
    case rdma::WrOp::CMP_SWAP: return rdma::WcOp::CMP_SWAP;
    case rdma::WrOp::FETCH_ADD: return rdma::WcOp::FETCH_ADD;
    case rdma::WrOp::WRITE_REDUCE: return rdma::WcOp::WRITE_REDUCE;
  }
  return rdma::WcOp::SEND;
}

// The local ACK timeout, 4.096 us * 2^code.
uint64_t timeout_ns(uint8_t code) { return code == 0 ? 0 : 4096ull << code; }
// RNR NAK timer codes (IBA Table 45), in microseconds; code 0 = 655.36 ms.
uint64_t rnr_ns(uint8_t code) {
  static constexpr uint32_t us[32] = {655360, 10,  20,  30,  40,  60,   80,   120,  160,  240,  320,
                                      480,    640, 960, 1280, 1920, 2560, 3840, 5120, 7680, 10240, 15360,
                                      20480,  30720, 40960, 61440, 81920, 122880, 163840, 245760, 327680, 491520};
  return uint64_t{us[code & 31]} * 1000;
}

}  // namespace

struct Engine::Qp {
  uint32_t qpn = 0;
  rdma::QpState state = rdma::QpState::RESET;
  rdma::QpAttr a{};
  uint32_t mtu = 1024;
  // requester
  struct Slot {
    rdma::SendWqe w{};
    uint32_t first_psn = 0, npsn = 1, npkt = 1;
    uint32_t read_got = 0;  // READ: bytes arrived in order
    bool read_more = false; // READ: a piece's responses are in, the next piece's request is due
    bool done = false;      // acknowledged / result in
    WcStatus bad = WcStatus::SUCCESS;  // found malformed at post: fails when it reaches the front
  };
  std::deque<Slot> sq;
  size_t tx_idx = 0;     // next slot to (re)transmit
  uint32_t tx_pkt = 0;   // its next packet
  uint32_t next_psn = 0;  // the PSN the next posted request gets
  uint32_t una = 0;       // oldest unacknowledged PSN
  uint32_t sent_psn = 0;  // one past the highest PSN sent (what is below went before: a resend)
  uint32_t last_nak_psn = ~0u;  // the PSN of the last PSN-sequence NAK received
  uint64_t last_progress = 0;
  uint64_t last_answer = 0;  // when the peer's responder last sent anything (an ACK, NAK, response)
  int retries_left = 0, rnr_left = 0;
  uint64_t rnr_until = 0;       // no transmission before (an RNR wait)
  uint32_t read_gap_psn = ~0u;  // the READ response PSN a go-back was last started for
  // responder
  uint32_t epsn = 0, msn = 0;
  bool nak_sent = false;
  uint32_t nak_psn = 0;  // the packet that drew the last PSN-sequence NAK
  enum class In : uint8_t { none, send, write, reduce } in = In::none;
  uint64_t in_va = 0;
  uint32_t in_rkey = 0, in_len = 0, in_off = 0;
  uint8_t in_dtype = 0, in_redop = 0;
  bool in_has_rwqe = false;
  rdma::RecvWqe in_rwqe{};
  std::deque<rdma::RecvWqe> rq;
  struct AtomicSaved {
    uint32_t psn = 0;
    uint64_t orig = 0;
    bool valid = false;
  };
  std::array<AtomicSaved, kAtomicHistory> atomics{};
  size_t atomic_next = 0;
};

Engine::Engine(const PortAddr& addr, MemoryAccess& mem, MrTable& mrs, TxFn tx, CqFn cq)
    : _addr(addr), _mem(mem), _mrs(mrs), _tx(std::move(tx)), _cq(std::move(cq)), _frame(wire::kMaxFrame) {}

Engine::~Engine() = default;

Engine::Qp* Engine::find(uint32_t qpn) const {
  auto it = _qps.find(qpn);
  return it == _qps.end() ? nullptr : it->second.get();
}

uint32_t Engine::create_qp() {
  const uint32_t qpn = _next_qpn;
  _next_qpn = (_next_qpn + 1) & wire::kPsnMask;
  if (_next_qpn < 2) _next_qpn = 2;
  auto q = std::make_unique<Qp>();
  q->qpn = qpn;
  _qps[qpn] = std::move(q);
  return qpn;
}

uint32_t Engine::create_qp(uint32_t qpn) {
  if (qpn < 2 || qpn > wire::kPsnMask || _qps.count(qpn) != 0) return 0;
  auto q = std::make_unique<Qp>();
  q->qpn = qpn;
  _qps[qpn] = std::move(q);
  return qpn;
}

Status Engine::destroy_qp(uint32_t qpn) {
  if (_qps.erase(qpn) == 0) return Status::error(Code::not_found, "QP %u does not exist", qpn);
  return Status::ok();
}

rdma::QpState Engine::qp_state(uint32_t qpn) const {
  Qp* q = find(qpn);
  return q == nullptr ? rdma::QpState::RESET : q->state;
}

size_t Engine::held(uint32_t qpn, bool send) const {
  const Qp* q = find(qpn);
  if (q == nullptr) return 0;
  return send ? q->sq.size() : q->rq.size() + (q->in_has_rwqe ? 1 : 0);
}

Status Engine::modify_qp(uint32_t qpn, const rdma::QpAttr& a) {
  Qp* q = find(qpn);
  if (q == nullptr) return Status::error(Code::not_found, "QP %u does not exist", qpn);
  using S = rdma::QpState;
  const S to = static_cast<S>(a.state);
  const S from = q->state;
  switch (to) {
    case S::RESET: {
      const uint32_t n = q->qpn;
      *q = Qp{};
      q->qpn = n;
      return Status::ok();
    }
    case S::INIT:
      if (from != S::RESET && from != S::INIT) break;
      q->state = S::INIT;
      return Status::ok();
    case S::RTR:
      if (from != S::INIT) break;
      if (rdma::mtu_bytes(a.path_mtu) == 0) return Status::error(Code::invalid_argument, "QP %u: path MTU code %u", qpn, a.path_mtu);
      if (a.dest_qpn > wire::kPsnMask || a.rq_psn > wire::kPsnMask || a.min_rnr_timer > 31)
        return Status::error(Code::invalid_argument, "QP %u: a 24-bit field or the RNR timer out of range", qpn);
      q->a.path_mtu = a.path_mtu;
      q->a.dest_qpn = a.dest_qpn;
      q->a.rq_psn = a.rq_psn;
      q->a.min_rnr_timer = a.min_rnr_timer;
      q->a.remote_ip = a.remote_ip;
      std::memcpy(q->a.remote_mac, a.remote_mac, 6);
      q->a.udp_sport = a.udp_sport != 0 ? a.udp_sport : static_cast<uint16_t>(0xc000 | (qpn & 0x3fff));
      q->mtu = rdma::mtu_bytes(a.path_mtu);
      q->epsn = a.rq_psn;
      q->state = S::RTR;
      return Status::ok();
    case S::RTS:
      if (from != S::RTR) break;
      if (a.retry_cnt > 7 || a.rnr_retry > 7 || a.timeout > 31 || a.max_rd_atomic == 0 || a.max_rd_atomic > 16 ||
          a.sq_psn > wire::kPsnMask)
        return Status::error(Code::invalid_argument, "QP %u: retry, timeout, max_rd_atomic or sq_psn out of range", qpn);
      q->a.retry_cnt = a.retry_cnt;
      q->a.rnr_retry = a.rnr_retry;
      q->a.timeout = a.timeout;
      q->a.max_rd_atomic = a.max_rd_atomic;
      q->a.sq_psn = a.sq_psn;
      q->next_psn = q->una = q->sent_psn = a.sq_psn;
      q->retries_left = a.retry_cnt;
      q->rnr_left = a.rnr_retry;
      q->state = S::RTS;
      return Status::ok();
    case S::ERR:
      fail_qp(*q, WcStatus::WR_FLUSH_ERR, 0);
      return Status::ok();
  }
  return Status::error(Code::invalid_argument, "QP %u: no transition from state %u to %u", qpn,
                       static_cast<unsigned>(from), static_cast<unsigned>(a.state));
}

Status Engine::post_send(uint32_t qpn, const rdma::SendWqe& w) {
  Qp* q = find(qpn);
  if (q == nullptr) return Status::error(Code::not_found, "QP %u does not exist", qpn);
  if (q->state == rdma::QpState::ERR) {
    _cq(rdma::Cqe{w.wr_id, 0, 0, qpn, static_cast<uint8_t>(wc_op(w.opcode)),
                  static_cast<uint8_t>(WcStatus::WR_FLUSH_ERR), 0, 0, 0, 0});
    return Status::ok();
  }
  if (q->state != rdma::QpState::RTS) return Status::error(Code::invalid_argument, "QP %u is not ready to send", qpn);
  Qp::Slot s;
  s.w = w;
  // Validate: opcode, flags, reserved, atomics' shape, local key and right.
  WcStatus bad = WcStatus::SUCCESS;
  const auto op = static_cast<rdma::WrOp>(w.opcode);
  if (w.opcode >= rdma::kWrOpCount || (w.flags & ~rdma::wr_flag::KNOWN) != 0 || w.rsvd0 != 0) {
    bad = WcStatus::BAD_WQE;
  } else if ((op == rdma::WrOp::CMP_SWAP || op == rdma::WrOp::FETCH_ADD) &&
             (w.length != 8 || w.raddr % 8 != 0)) {
    bad = WcStatus::BAD_WQE;
  } else if (op == rdma::WrOp::WRITE_REDUCE &&
             (w.dtype >= hal::abi::kDTypeCount || w.redop >= hal::abi::kRedOpCount ||
              w.length % hal::abi::dtype_size(static_cast<hal::abi::DType>(w.dtype)) != 0)) {
    bad = WcStatus::BAD_WQE;
  } else if (w.length > 0) {
    const uint8_t need = is_read_or_atomic(w.opcode) ? rdma::access::LOCAL_WRITE : 0;
    if (_mrs.check(w.lkey, w.laddr, w.length, need) != MrTable::Check::ok ||
        _mem.map(w.laddr, w.length, need != 0) == nullptr)
      bad = WcStatus::LOC_PROT_ERR;
  }
  s.bad = bad;  // (it takes no PSN; tx_qp fails the QP with it once everything before it completed)
  if (bad != WcStatus::SUCCESS) {
    q->sq.push_back(s);
    return Status::ok();
  }
  s.first_psn = q->next_psn;
  s.npsn = wr_psns(w, q->mtu);
  s.npkt = wr_packets(w, q->mtu);
  q->next_psn = wire::psn_add(q->next_psn, s.npsn);
  q->sq.push_back(s);
  return Status::ok();
}

Status Engine::post_recv(uint32_t qpn, const rdma::RecvWqe& w) {
  Qp* q = find(qpn);
  if (q == nullptr) return Status::error(Code::not_found, "QP %u does not exist", qpn);
  if (q->state == rdma::QpState::RESET) return Status::error(Code::invalid_argument, "QP %u is in RESET", qpn);
  if (q->state == rdma::QpState::ERR) {
    recv_cqe(*q, w, WcStatus::WR_FLUSH_ERR, rdma::WcOp::RECV, 0, false, 0);
    return Status::ok();
  }
  if (w.rsvd != 0 || (w.length > 0 && (_mrs.check(w.lkey, w.laddr, w.length, rdma::access::LOCAL_WRITE) !=
                                           MrTable::Check::ok ||
                                       _mem.map(w.laddr, w.length, true) == nullptr))) {
    recv_cqe(*q, w, WcStatus::LOC_PROT_ERR, rdma::WcOp::RECV, 0, false, 0);
    fail_qp(*q, WcStatus::WR_FLUSH_ERR, 0);
    return Status::ok();
  }
  q->rq.push_back(w);
  return Status::ok();
}

bool Engine::busy() const {
  for (const auto& [n, q] : _qps)
    if (!q->sq.empty()) return true;
  return false;
}

std::string Engine::describe() const {
  static const char* const kState[] = {"RESET", "INIT", "RTR", "RTS", "ERR"};
  std::string out;
  for (const auto& [n, q] : _qps) {
    char line[256];
    std::snprintf(line, sizeof line,
                  "QP %u %s -> QP %u at %s: sq %zu (sent %zu+%u pkts), next PSN %u, unacked from %u, expected PSN %u, "
                  "rq %zu, retries left %d\n",
                  q->qpn, kState[static_cast<int>(q->state) % 5], q->a.dest_qpn, wire::ip_string(q->a.remote_ip).c_str(),
                  q->sq.size(), q->tx_idx, q->tx_pkt, q->next_psn, q->una, q->epsn, q->rq.size(), q->retries_left);
    out += line;
    if (!q->sq.empty()) {
      const Qp::Slot& s = q->sq.front();
      std::snprintf(line, sizeof line, "  front: op %u len %u PSN %u+%u read %u done %d\n", s.w.opcode, s.w.length,
                    s.first_psn, s.npsn, s.read_got, s.done ? 1 : 0);
      out += line;
    }
  }
  return out;
}

// ---- transmission ------------------------------------------------------------------

void Engine::send_frame(wire::Packet& p, const uint8_t* payload) {
  std::memcpy(p.src_mac, _addr.mac, 6);
  p.src_ip = _addr.ip;
  p.ip_id = _ip_id++;
  const size_t n = wire::build(p, payload, _frame.data(), _frame.size());
  if (n == 0) return;  // cannot happen for the packets built here (lengths bounded by the MTU)
  ++_c.tx_frames;
  _tx(_frame.data(), n);
}

namespace {

wire::Packet to_peer(const rdma::QpAttr& a, uint32_t dest_qpn) {
  wire::Packet p;
  std::memcpy(p.dst_mac, a.remote_mac, 6);
  p.dst_ip = a.remote_ip;
  p.udp_src = a.udp_sport;
  p.dest_qp = dest_qpn;
  return p;
}

}  // namespace

bool Engine::poll(uint64_t now) {
  bool sent = false;
  for (auto& [n, q] : _qps) {
    if (q->state != rdma::QpState::RTS) continue;
    // Local ACK timeout: nothing acknowledged for that long while PSNs are out.
    const bool outstanding = !q->sq.empty() && (q->tx_idx > 0 || q->tx_pkt > 0);
    const uint64_t to = timeout_ns(q->a.timeout);
    if (outstanding && to != 0 && now >= q->rnr_until && now - q->last_progress >= to) {
      ++_c.timeouts;
      if (q->retries_left-- == 0) {
        // Said once on stderr (the simulator's log): where the QP stood.
        const Qp::Slot& s = q->sq.front();
        std::fprintf(stderr,
                     "hcomm-sim: QP %u -> %s QP %u: RETRY_EXC_ERR after %d local ACK timeouts of %.1f ms: front "
                     "request op %u PSN %u+%u (%u bytes read), unacked from %u, next PSN %u, last NAK for %u, "
                     "peer last answered %.1f ms ago\n",
                     q->qpn, wire::ip_string(q->a.remote_ip).c_str(), q->a.dest_qpn, q->a.retry_cnt + 1, to / 1e6,
                     s.w.opcode, s.first_psn, s.npsn, s.read_got, q->una, q->next_psn, q->last_nak_psn,
                     q->last_answer == 0 ? -1.0 : static_cast<double>(now - q->last_answer) / 1e6);
        fail_qp(*q, WcStatus::RETRY_EXC_ERR, 0);
        continue;
      }
      go_back(*q, q->una);
      q->last_progress = now;
    }
    if (tx_qp(*q, now)) sent = true;
  }
  return sent;
}

// A READ asks for at most kReadPiece response packets at a time: the
// responder sends a request's responses in one burst, and a link without
// flow control (a UDP uplink, a TAP) drops what a longer burst overruns.
// The pieces take the PSNs the whole READ was given, so the wire sees
// ordinary READ requests, each a run of that PSN range.
void Engine::read_request(Qp& q, size_t slot) {
  const Qp::Slot& s = q.sq[slot];
  wire::Packet p = to_peer(q.a, q.a.dest_qpn);
  p.psn = wire::psn_add(s.first_psn, s.read_got / q.mtu);
  p.opcode = static_cast<uint8_t>(Op::READ_REQUEST);
  p.va = s.w.raddr + s.read_got;
  p.rkey = s.w.rkey;
  // Pieces have fixed bounds (every kReadPiece packets from the start): a piece
  // asked again after a loss never reaches into the next piece's PSNs, which
  // the responder has not seen yet.
  const uint32_t piece = kReadPiece * q.mtu;
  const uint64_t end = std::min<uint64_t>(s.w.length, (uint64_t{s.read_got} / piece + 1) * piece);
  p.dma_len = static_cast<uint32_t>(end - s.read_got);
  p.ack_req = true;
  count_tx(q, p.psn, std::max<uint32_t>(1, (p.dma_len + q.mtu - 1) / q.mtu));
  send_frame(p, nullptr);
}

// An earlier READ still being answered has pieces not yet asked for.
bool Engine::read_pieces_pending(const Qp& q) const {
  const uint64_t piece = uint64_t{kReadPiece} * q.mtu;
  for (size_t i = 0; i < q.tx_idx && i < q.sq.size(); ++i) {
    const Qp::Slot& s = q.sq[i];
    if (s.done || static_cast<rdma::WrOp>(s.w.opcode) != rdma::WrOp::READ) continue;
    if ((uint64_t{s.read_got} / piece + 1) * piece < s.w.length) return true;
  }
  return false;
}

bool Engine::tx_qp(Qp& q, uint64_t now) {
  if (now < q.rnr_until) return false;
  bool sent = false;
  for (size_t i = 0; i < q.tx_idx && i < q.sq.size(); ++i) {
    Qp::Slot& s = q.sq[i];
    if (!s.read_more) continue;
    s.read_more = false;
    read_request(q, i);
    sent = true;
  }
  while (q.tx_idx < q.sq.size()) {
    Qp::Slot& s = q.sq[q.tx_idx];
    if (s.bad != WcStatus::SUCCESS) {
      // A request found malformed at post: once everything before it has
      // completed it fails with its status, the rest are flushed.
      if (q.tx_idx == 0) fail_qp(q, s.bad, 0);
      return sent;
    }
    const rdma::SendWqe& w = s.w;
    const auto op = static_cast<rdma::WrOp>(w.opcode);
    const bool rd = is_read_or_atomic(w.opcode);
    uint32_t psn = wire::psn_add(s.first_psn, q.tx_pkt);
    uint32_t off = q.tx_pkt * q.mtu;
    if (op == rdma::WrOp::READ) {  // a READ resent resumes where its data stopped
      psn = wire::psn_add(s.first_psn, s.read_got / q.mtu);
      off = s.read_got;
    }
    // Packets acknowledged while this request was being sent again after a
    // go-back (a late ACK inside it) need not go again.
    if (!rd && wire::psn_diff(psn, q.una) < 0) {
      const int32_t d = wire::psn_diff(q.una, s.first_psn);
      if (d > 0 && static_cast<uint32_t>(d) < s.npkt) {
        q.tx_pkt = static_cast<uint32_t>(d);
        continue;
      }
    }
    // A READ asks for its pieces one after another, and the responder takes
    // PSNs only in order: nothing after a READ goes before its last piece
    // has been asked for (else it would overtake the pieces' PSNs).
    if (q.tx_pkt == 0 && read_pieces_pending(q)) break;
    // At most kWindow PSNs unacknowledged. (A READ is judged by its request:
    // one longer than the window still goes, and the PSNs its responses
    // take hold back what follows it.)
    if (wire::psn_diff(psn, q.una) >= static_cast<int32_t>(kWindow)) break;
    if (rd || (w.flags & rdma::wr_flag::FENCE)) {
      // At most max_rd_atomic READs/atomics in flight; a fenced request
      // waits for every earlier one to finish.
      uint32_t inflight = 0;
      for (size_t i = 0; i < q.tx_idx; ++i)
        if (is_read_or_atomic(q.sq[i].w.opcode) && !q.sq[i].done) ++inflight;
      if ((w.flags & rdma::wr_flag::FENCE) && inflight > 0) break;
      if (rd && inflight >= q.a.max_rd_atomic) break;
    }
    if (q.tx_idx == 0 && q.tx_pkt == 0) q.last_progress = now;  // the timer starts with the first packet out
    wire::Packet p = to_peer(q.a, q.a.dest_qpn);
    p.psn = psn;
    const bool first = q.tx_pkt == 0, last = q.tx_pkt + 1 == s.npkt;
    const uint32_t chunk = rd ? 0 : std::min(q.mtu, w.length - std::min(w.length, off));
    const uint8_t* src = chunk > 0 ? _mem.map(w.laddr + off, chunk, false) : nullptr;
    if (chunk > 0 && src == nullptr) {  // the local translation vanished after the post
      fail_qp(q, WcStatus::LOC_PROT_ERR, 0);
      return sent;
    }
    p.payload_len = chunk;
    p.ack_req = last || psn % kAckEvery == kAckEvery - 1;
    p.se = last && (w.flags & rdma::wr_flag::SOLICITED);
    auto seq = [&](Op f, Op m, Op l, Op o) { return first && last ? o : first ? f : last ? l : m; };
    switch (op) {
      case rdma::WrOp::WRITE:
      case rdma::WrOp::WRITE_IMM: {
        const bool imm = op == rdma::WrOp::WRITE_IMM;
        p.opcode = static_cast<uint8_t>(seq(Op::WRITE_FIRST, Op::WRITE_MIDDLE, imm ? Op::WRITE_LAST_IMM : Op::WRITE_LAST,
                                            imm ? Op::WRITE_ONLY_IMM : Op::WRITE_ONLY));
        p.va = w.raddr;
        p.rkey = w.rkey;
        p.dma_len = w.length;
        p.imm = w.imm;
        break;
      }
      case rdma::WrOp::SEND:
      case rdma::WrOp::SEND_IMM: {
        const bool imm = op == rdma::WrOp::SEND_IMM;
        p.opcode = static_cast<uint8_t>(seq(Op::SEND_FIRST, Op::SEND_MIDDLE, imm ? Op::SEND_LAST_IMM : Op::SEND_LAST,
                                            imm ? Op::SEND_ONLY_IMM : Op::SEND_ONLY));
        p.imm = w.imm;
        break;
      }
      case rdma::WrOp::WRITE_REDUCE:
        p.opcode = static_cast<uint8_t>(
            seq(Op::WRITE_REDUCE_FIRST, Op::WRITE_REDUCE_MIDDLE, Op::WRITE_REDUCE_LAST, Op::WRITE_REDUCE_ONLY));
        p.va = w.raddr;
        p.rkey = w.rkey;
        p.dma_len = w.length;
        p.dtype = w.dtype;
        p.redop = w.redop;
        break;
      case rdma::WrOp::READ:
        s.read_more = false;
        read_request(q, q.tx_idx);
        ++q.tx_idx;
        q.tx_pkt = 0;
        sent = true;
        continue;
      case rdma::WrOp::CMP_SWAP:
      case rdma::WrOp::FETCH_ADD:
        p.opcode = static_cast<uint8_t>(op == rdma::WrOp::CMP_SWAP ? Op::COMPARE_SWAP : Op::FETCH_ADD);
        p.va = w.raddr;
        p.rkey = w.rkey;
        p.swap_add = w.swap_add;
        p.compare = w.compare;
        p.ack_req = true;
        break;
    }
    count_tx(q, p.psn, 1);
    send_frame(p, src);
    sent = true;
    if (rd || last) {
      ++q.tx_idx;
      q.tx_pkt = 0;
    } else {
      ++q.tx_pkt;
    }
  }
  return sent;
}

// A request packet for PSNs [psn, psn + n) goes out: below sent_psn it was
// sent before and is counted as a retransmission.
void Engine::count_tx(Qp& q, uint32_t psn, uint32_t n) {
  if (wire::psn_diff(psn, q.sent_psn) < 0) ++_c.retransmits;
  const uint32_t end = wire::psn_add(psn, n);
  if (wire::psn_diff(end, q.sent_psn) > 0) q.sent_psn = end;
}

// Restarts transmission at the request holding `psn` (go-back-N).
void Engine::go_back(Qp& q, uint32_t psn) {
  if (wire::psn_diff(psn, q.una) < 0) psn = q.una;  // never before what is acknowledged
  for (size_t i = 0; i < q.sq.size(); ++i) {
    Qp::Slot& s = q.sq[i];
    const int32_t d = wire::psn_diff(psn, s.first_psn);
    if (d >= 0 && static_cast<uint32_t>(d) < s.npsn) {
      q.tx_idx = i;
      q.tx_pkt = is_read_or_atomic(s.w.opcode) ? 0 : static_cast<uint32_t>(d);
      return;
    }
  }
}

// Everything before `psn` is acknowledged (inclusive): SENDs, WRITEs and
// WRITE_REDUCEs up to it are done. A READ or atomic up to it that has no
// answer yet means the answer was lost: resend from it.
void Engine::ack_through(Qp& q, uint32_t psn, uint64_t now) {
  bool progress = false;
  // By PSN, not by the transmit cursor: the request being sent (an ACK
  // inside a message longer than the window) and requests sent before a
  // go-back count too.
  for (size_t i = 0; i < q.sq.size(); ++i) {
    Qp::Slot& s = q.sq[i];
    if (s.bad != WcStatus::SUCCESS || wire::psn_diff(s.first_psn, psn) > 0) break;
    const uint32_t last = wire::psn_add(s.first_psn, s.npsn - 1);
    if (wire::psn_diff(last, psn) > 0) {
      // An ACK inside a long SEND/WRITE (AckReq every kAckEvery PSNs): the
      // packets up to it are through.
      if (!is_read_or_atomic(s.w.opcode) && wire::psn_diff(psn, s.first_psn) >= 0 &&
          wire::psn_diff(wire::psn_add(psn, 1), q.una) > 0) {
        q.una = wire::psn_add(psn, 1);
        progress = true;
      }
      break;
    }
    if (s.done) continue;
    if (is_read_or_atomic(s.w.opcode)) {
      const uint32_t resume = static_cast<rdma::WrOp>(s.w.opcode) == rdma::WrOp::READ
                                  ? wire::psn_add(s.first_psn, s.read_got / q.mtu)
                                  : s.first_psn;
      if (wire::psn_diff(resume, q.una) > 0) {
        q.una = resume;
        progress = true;
      }
      if (q.read_gap_psn != resume) {
        q.read_gap_psn = resume;
        go_back(q, resume);
      }
      break;
    }
    s.done = true;
    q.una = wire::psn_add(last, 1);
    progress = true;
  }
  if (progress) {
    q.last_progress = now;
    q.retries_left = q.a.retry_cnt;
  }
  complete_front(q);
}

void Engine::complete_front(Qp& q) {
  while (!q.sq.empty() && q.sq.front().done) {
    const Qp::Slot& s = q.sq.front();
    if (s.w.flags & rdma::wr_flag::SIGNALED) {
      const uint32_t len = static_cast<rdma::WrOp>(s.w.opcode) == rdma::WrOp::READ ? s.w.length
                           : is_read_or_atomic(s.w.opcode)                          ? 8
                                                                                    : s.w.length;
      _cq(rdma::Cqe{s.w.wr_id, len, 0, q.qpn, static_cast<uint8_t>(wc_op(s.w.opcode)),
                    static_cast<uint8_t>(WcStatus::SUCCESS), 0, 0, 0, 0});
    }
    q.sq.pop_front();
    if (q.tx_idx > 0) {
      --q.tx_idx;
    } else {
      q.tx_pkt = 0;  // acknowledged while being sent again after a go-back: the rest need not go
    }
  }
}

// The QP goes to ERR: the request at the front (the one that failed, when
// front_status is an error) completes with front_status, every other
// posted request and receive with WR_FLUSH_ERR.
void Engine::fail_qp(Qp& q, WcStatus front_status, uint32_t syndrome) {
  q.state = rdma::QpState::ERR;
  bool first = true;
  for (const Qp::Slot& s : q.sq) {  // (completed requests were popped: none here is done)
    const WcStatus st = first ? front_status : WcStatus::WR_FLUSH_ERR;
    first = false;
    _cq(rdma::Cqe{s.w.wr_id, 0, 0, q.qpn, static_cast<uint8_t>(wc_op(s.w.opcode)), static_cast<uint8_t>(st), 0, 0,
                  st == WcStatus::WR_FLUSH_ERR ? 0 : syndrome, 0});
  }
  q.sq.clear();
  q.tx_idx = 0;
  q.tx_pkt = 0;
  if (q.in_has_rwqe) {
    recv_cqe(q, q.in_rwqe, WcStatus::WR_FLUSH_ERR, rdma::WcOp::RECV, 0, false, 0);
    q.in_has_rwqe = false;
  }
  for (const rdma::RecvWqe& r : q.rq) recv_cqe(q, r, WcStatus::WR_FLUSH_ERR, rdma::WcOp::RECV, 0, false, 0);
  q.rq.clear();
  q.in = Qp::In::none;
}

void Engine::recv_cqe(Qp& q, const rdma::RecvWqe& r, WcStatus st, rdma::WcOp op, uint32_t len, bool imm,
                      uint32_t immv) {
  _cq(rdma::Cqe{r.wr_id, len, imm ? immv : 0, q.qpn, static_cast<uint8_t>(op), static_cast<uint8_t>(st),
                imm ? rdma::wc_flag::IMM : uint8_t{0}, 0, 0, 0});
}

// ---- reception ----------------------------------------------------------------------

void Engine::rx(const uint8_t* f, size_t len, uint64_t now) {
  // The MAC filter, as on any NIC: a unicast frame for another station (a
  // switch floods those while it has not learnt where they go) never
  // reaches the RoCE checks or the counters.
  if (len >= 6 && (f[0] & 1) == 0 && std::memcmp(f, _addr.mac, 6) != 0) return;
  ++_c.rx_frames;
  if (len >= wire::kEthLen && wire::get16(f + 12) == wire::kEtherArp) {
    answer_arp(f, len);
    return;
  }
  wire::Packet p;
  switch (wire::parse(f, len, &p)) {
    case wire::ParseError::ok: break;
    case wire::ParseError::bad_icrc: ++_c.rx_bad_icrc; return;
    case wire::ParseError::not_roce: ++_c.rx_not_roce; return;
    case wire::ParseError::unsupported: ++_c.rx_unsupported; return;
    default: ++_c.rx_malformed; return;
  }
  if (p.dst_ip != _addr.ip || p.pkey != wire::kDefaultPKey) {
    ++_c.rx_no_qp;
    return;
  }
  Qp* q = find(p.dest_qp);
  // The peer must be the one the QP is connected to (address-vector check).
  if (q == nullptr || (q->state != rdma::QpState::RTR && q->state != rdma::QpState::RTS) ||
      p.src_ip != q->a.remote_ip) {
    ++_c.rx_no_qp;
    return;
  }
  if (wire::op_headers(p.opcode) & wire::hdr::RESPONSE) {
    if (q->state == rdma::QpState::RTS) {
      q->last_answer = now;
      requester_rx(*q, p, now);
    }
  } else {
    responder_rx(*q, p);
  }
}

void Engine::answer_arp(const uint8_t* f, size_t len) {
  // Ethernet ARP for IPv4 (RFC 826): htype 1, ptype 0x0800, hlen 6, plen 4, op 1 = request.
  if (len < wire::kEthLen + 28) return;
  const uint8_t* a = f + wire::kEthLen;
  if (wire::get16(a) != 1 || wire::get16(a + 2) != wire::kEtherIPv4 || a[4] != 6 || a[5] != 4 || wire::get16(a + 6) != 1)
    return;
  if (wire::get32(a + 24) != _addr.ip) return;
  uint8_t r[60] = {};
  std::memcpy(r, a + 8, 6);  // to the sender's MAC
  std::memcpy(r + 6, _addr.mac, 6);
  wire::put16(r + 12, wire::kEtherArp);
  uint8_t* b = r + wire::kEthLen;
  wire::put16(b, 1);
  wire::put16(b + 2, wire::kEtherIPv4);
  b[4] = 6;
  b[5] = 4;
  wire::put16(b + 6, 2);  // reply
  std::memcpy(b + 8, _addr.mac, 6);
  wire::put32(b + 14, _addr.ip);
  std::memcpy(b + 18, a + 8, 10);  // the asker's MAC and IP
  ++_c.arp_replies;
  ++_c.tx_frames;
  _tx(r, sizeof r);
}

void Engine::requester_rx(Qp& q, const wire::Packet& p, uint64_t now) {
  const auto op = static_cast<Op>(p.opcode);
  if (op == Op::ACKNOWLEDGE) {
    const uint8_t kind = p.syndrome & wire::aeth::KIND_MASK;
    // An ACK or NAK for a PSN before the first unacknowledged one is old
    // news overtaken on the wire: acting on it would resend what is through.
    if (wire::psn_diff(p.psn, q.una) < 0) return;
    if (kind == wire::aeth::ACK) {
      ack_through(q, p.psn, now);
      return;
    }
    if (kind == wire::aeth::RNR_NAK) {
      ++_c.rnr_naks_rcvd;
      ack_through(q, wire::psn_add(p.psn, wire::kPsnMask), now);  // psn - 1
      if (q.a.rnr_retry != 7 && q.rnr_left-- == 0) {
        fail_qp(q, WcStatus::RNR_RETRY_EXC_ERR, p.syndrome);
        return;
      }
      q.rnr_until = now + rnr_ns(p.syndrome & 0x1f);
      q.last_progress = q.rnr_until;
      go_back(q, p.psn);
      return;
    }
    // NAKs
    const uint32_t una_before = q.una;
    ack_through(q, wire::psn_add(p.psn, wire::kPsnMask), now);
    if (p.syndrome == wire::aeth::NAK_PSN_SEQ) {
      ++_c.seq_naks_rcvd;
      go_back(q, p.psn);
      // A NAK restarts the local ACK timer (the resend needs its round
      // trip) unless it repeats the last NAK's PSN with nothing newly
      // acknowledged: a packet the wire loses every time then still runs
      // the timer out, retry_cnt times, and ends in RETRY_EXC_ERR rather
      // than in resends forever.
      if (q.una != una_before || p.psn != q.last_nak_psn) q.last_progress = now;
      q.last_nak_psn = p.psn;
      return;
    }
    // The request at the NAK's PSN failed; it must be the oldest outstanding one.
    if (q.sq.empty() || wire::psn_diff(p.psn, q.sq.front().first_psn) < 0) return;
    const WcStatus st = p.syndrome == wire::aeth::NAK_REMOTE_ACCESS ? WcStatus::REM_ACCESS_ERR
                        : p.syndrome == wire::aeth::NAK_INVALID_REQ ? WcStatus::REM_INV_REQ_ERR
                                                                    : WcStatus::REM_OP_ERR;
    fail_qp(q, st, p.syndrome);
    return;
  }
  // READ responses and atomic acknowledgements: find the request by PSN.
  size_t i = 0;
  for (; i < q.sq.size() && q.sq[i].bad == WcStatus::SUCCESS; ++i) {
    const int32_t d = wire::psn_diff(p.psn, q.sq[i].first_psn);
    if (d >= 0 && static_cast<uint32_t>(d) < q.sq[i].npsn) break;
  }
  if (i == q.sq.size() || q.sq[i].bad != WcStatus::SUCCESS) return;  // not outstanding (a late duplicate)
  Qp::Slot& s = q.sq[i];
  if (s.done) return;
  if (op == Op::ATOMIC_ACKNOWLEDGE) {
    if (!is_read_or_atomic(s.w.opcode) || static_cast<rdma::WrOp>(s.w.opcode) == rdma::WrOp::READ) return;
    ack_through(q, wire::psn_add(p.psn, wire::kPsnMask), now);
    if (q.una != s.first_psn) return;  // something before it is still missing
    uint8_t* dst = _mem.map(s.w.laddr, 8, true);
    if (dst == nullptr) {
      fail_qp(q, WcStatus::LOC_PROT_ERR, 0);
      return;
    }
    std::memcpy(dst, &p.orig, 8);
    s.done = true;
    q.una = wire::psn_add(s.first_psn, 1);
    q.last_progress = now;
    q.retries_left = q.a.retry_cnt;
    complete_front(q);
    return;
  }
  if (static_cast<rdma::WrOp>(s.w.opcode) != rdma::WrOp::READ) return;
  ack_through(q, wire::psn_add(s.first_psn, wire::kPsnMask), now);
  if (q.una != wire::psn_add(s.first_psn, s.read_got / q.mtu)) return;  // an earlier request is still open
  const uint32_t want = wire::psn_add(s.first_psn, s.read_got / q.mtu);
  if (p.psn != want) {
    // A response ahead of the one due: one went missing. Ask again from the
    // gap, once per gap (the retry timer covers a lost re-request).
    if (wire::psn_diff(p.psn, want) > 0 && q.read_gap_psn != want) {
      q.read_gap_psn = want;
      go_back(q, want);
    }
    return;
  }
  const bool last = op == Op::READ_RESPONSE_LAST || op == Op::READ_RESPONSE_ONLY;
  const uint32_t remaining = s.w.length - s.read_got;
  // Full packets, but for the READ's very last one (a piece's last packet
  // is full: pieces are whole packets).
  if (p.payload_len > remaining || ((!last || p.payload_len < remaining) && p.payload_len != q.mtu)) {
    fail_qp(q, WcStatus::REM_INV_REQ_ERR, 0);  // a responder that does not follow the MTU rule
    return;
  }
  if (p.payload_len > 0) {
    uint8_t* dst = _mem.map(s.w.laddr + s.read_got, p.payload_len, true);
    if (dst == nullptr) {
      fail_qp(q, WcStatus::LOC_PROT_ERR, 0);
      return;
    }
    std::memcpy(dst, p.payload, p.payload_len);
  }
  s.read_got += p.payload_len;
  q.una = wire::psn_add(p.psn, 1);
  q.last_progress = now;
  q.retries_left = q.a.retry_cnt;
  if (last && s.read_got < s.w.length) {
    s.read_more = true;  // tx_qp asks for the next piece
  } else if (last) {
    s.done = true;
    q.una = wire::psn_add(s.first_psn, s.npsn);
    complete_front(q);
  }
}

void Engine::send_ack(Qp& q, uint8_t syndrome, uint32_t psn) {
  wire::Packet a = to_peer(q.a, q.a.dest_qpn);
  a.opcode = static_cast<uint8_t>(Op::ACKNOWLEDGE);
  a.psn = psn;
  a.syndrome = syndrome;
  a.msn = q.msn;
  send_frame(a, nullptr);
}

// The next posted receive for the request at `psn`, or an RNR NAK carrying
// this QP's RNR timer when none is posted (false: the request waits).
bool Engine::take_receive(Qp& q, uint32_t psn) {
  if (q.rq.empty()) {
    ++_c.rnr_naks_sent;
    send_ack(q, static_cast<uint8_t>(wire::aeth::RNR_NAK | (q.a.min_rnr_timer & 0x1f)), psn);
    return false;
  }
  q.in_rwqe = q.rq.front();
  q.rq.pop_front();
  q.in_has_rwqe = true;
  return true;
}

void Engine::read_responses(Qp& q, uint32_t psn, uint8_t* src, uint32_t len) {
  const uint32_t n = len == 0 ? 1 : (len + q.mtu - 1) / q.mtu;
  for (uint32_t i = 0; i < n; ++i) {
    wire::Packet r = to_peer(q.a, q.a.dest_qpn);
    const bool first = i == 0, last = i + 1 == n;
    r.opcode = static_cast<uint8_t>(first && last ? Op::READ_RESPONSE_ONLY
                                    : first       ? Op::READ_RESPONSE_FIRST
                                    : last        ? Op::READ_RESPONSE_LAST
                                                  : Op::READ_RESPONSE_MIDDLE);
    r.psn = wire::psn_add(psn, i);
    r.syndrome = wire::aeth::ACK | wire::aeth::CREDITS_INVALID;
    r.msn = q.msn;
    r.payload_len = std::min(q.mtu, len - i * q.mtu);
    send_frame(r, src == nullptr ? nullptr : src + static_cast<size_t>(i) * q.mtu);
  }
}

void Engine::responder_rx(Qp& q, const wire::Packet& p) {
  const auto op = static_cast<Op>(p.opcode);
  const uint16_t h = wire::op_headers(p.opcode);
  const int32_t d = wire::psn_diff(p.psn, q.epsn);
  if (d > 0) {  // ahead: a packet was lost
    // One NAK per gap, then silence until it fills (IBA; rxe does the same)
    // -- per round of the requester's: a packet no later than the one that
    // drew the NAK means the requester went back and the resend of the
    // expected PSN was lost too; without a second NAK only the local ACK
    // timeout would notice. (A duplicate on the wire can draw a needless
    // NAK, which costs a resend, never a result.)
    if (!q.nak_sent || wire::psn_diff(p.psn, q.nak_psn) <= 0) {
      q.nak_sent = true;
      q.nak_psn = p.psn;
      ++_c.seq_naks_sent;
      send_ack(q, wire::aeth::NAK_PSN_SEQ, q.epsn);
    }
    return;
  }
  auto remote_access_error = [&] {
    ++_c.access_naks_sent;
    send_ack(q, wire::aeth::NAK_REMOTE_ACCESS, p.psn);
    fail_qp(q, WcStatus::WR_FLUSH_ERR, 0);
  };
  auto invalid_request = [&] {
    send_ack(q, wire::aeth::NAK_INVALID_REQ, p.psn);
    fail_qp(q, WcStatus::WR_FLUSH_ERR, 0);
  };
  if (d < 0) {  // a duplicate: answer it, never execute it again
    ++_c.duplicates;
    if (op == Op::READ_REQUEST) {
      if (p.dma_len > 0 && _mrs.check(p.rkey, p.va, p.dma_len, rdma::access::REMOTE_READ) != MrTable::Check::ok)
        return;
      uint8_t* src = p.dma_len > 0 ? _mem.map(p.va, p.dma_len, false) : nullptr;
      if (p.dma_len > 0 && src == nullptr) return;
      read_responses(q, p.psn, src, p.dma_len);
      return;
    }
    if (op == Op::COMPARE_SWAP || op == Op::FETCH_ADD) {
      for (const Qp::AtomicSaved& s : q.atomics) {
        if (s.valid && s.psn == p.psn) {
          wire::Packet r = to_peer(q.a, q.a.dest_qpn);
          r.opcode = static_cast<uint8_t>(Op::ATOMIC_ACKNOWLEDGE);
          r.psn = p.psn;
          r.syndrome = wire::aeth::ACK | wire::aeth::CREDITS_INVALID;
          r.msn = q.msn;
          r.orig = s.orig;
          send_frame(r, nullptr);
          return;
        }
      }
      return;  // older than the history: the requester has its answer already
    }
    if (p.ack_req) send_ack(q, wire::aeth::ACK | wire::aeth::CREDITS_INVALID, wire::psn_add(q.epsn, wire::kPsnMask));
    return;
  }
  // The expected PSN.
  q.nak_sent = false;
  const bool first = h & wire::hdr::FIRST, last = h & wire::hdr::LAST;
  // Opcode sequence (IBA §9.8.3.1): a FIRST/ONLY while a message is open,
  // or a MIDDLE/LAST of another kind, is an invalid request.
  const Qp::In kind = (op <= Op::SEND_ONLY_IMM)                               ? Qp::In::send
                      : (op >= Op::WRITE_FIRST && op <= Op::WRITE_ONLY_IMM)   ? Qp::In::write
                      : (op >= Op::WRITE_REDUCE_FIRST && op <= Op::WRITE_REDUCE_ONLY) ? Qp::In::reduce
                                                                                     : Qp::In::none;
  if (kind != Qp::In::none) {
    if (first ? q.in != Qp::In::none : q.in != kind) {
      invalid_request();
      return;
    }
    if (first) {
      // RETH (WRITE, WRITE_REDUCE): the whole target range checked once.
      if (kind != Qp::In::send) {
        const uint8_t need = kind == Qp::In::write ? rdma::access::REMOTE_WRITE : rdma::access::REMOTE_REDUCE;
        if (p.dma_len > 0) {
          const MrTable::Check c = _mrs.check(p.rkey, p.va, p.dma_len, need);
          if (c != MrTable::Check::ok || _mem.map(p.va, p.dma_len, true) == nullptr) {
            remote_access_error();
            return;
          }
        }
        if (kind == Qp::In::reduce &&
            (p.dtype >= hal::abi::kDTypeCount || p.redop >= hal::abi::kRedOpCount ||
             p.dma_len % hal::abi::dtype_size(static_cast<hal::abi::DType>(p.dtype)) != 0)) {
          invalid_request();
          return;
        }
        q.in_va = p.va;
        q.in_rkey = p.rkey;
        q.in_len = p.dma_len;
        q.in_dtype = p.dtype;
        q.in_redop = p.redop;
      }
      // A receive is consumed by SEND and by WRITE with immediate.
      if ((kind == Qp::In::send || op == Op::WRITE_ONLY_IMM) && !take_receive(q, p.psn)) return;
      q.in = kind;
      q.in_off = 0;
    }
    // A multi-packet WRITE with immediate takes its receive at the end.
    if (op == Op::WRITE_LAST_IMM && !take_receive(q, p.psn)) return;
    // Payload length rule: FIRST and MIDDLE carry exactly one MTU.
    if (!last && p.payload_len != q.mtu) {
      invalid_request();
      return;
    }
    if (kind == Qp::In::send) {
      if (q.in_off + p.payload_len > q.in_rwqe.length) {
        recv_cqe(q, q.in_rwqe, WcStatus::LOC_LEN_ERR, rdma::WcOp::RECV, 0, false, 0);
        q.in_has_rwqe = false;
        invalid_request();
        return;
      }
      if (p.payload_len > 0) {
        uint8_t* dst = _mem.map(q.in_rwqe.laddr + q.in_off, p.payload_len, true);
        if (dst == nullptr) {
          send_ack(q, wire::aeth::NAK_REMOTE_OP, p.psn);
          fail_qp(q, WcStatus::WR_FLUSH_ERR, 0);
          return;
        }
        std::memcpy(dst, p.payload, p.payload_len);
      }
    } else {
      if (q.in_off + p.payload_len > q.in_len || (last && q.in_off + p.payload_len != q.in_len)) {
        invalid_request();
        return;
      }
      if (p.payload_len > 0) {
        uint8_t* dst = _mem.map(q.in_va + q.in_off, p.payload_len, true);
        if (dst == nullptr) {
          remote_access_error();
          return;
        }
        if (kind == Qp::In::write) {
          std::memcpy(dst, p.payload, p.payload_len);
        } else {
          const auto dt = static_cast<hal::abi::DType>(q.in_dtype);
          if (p.payload_len % hal::abi::dtype_size(dt) != 0) {
            invalid_request();
            return;
          }
          std::unique_lock<std::mutex> lk;
          if (std::mutex* mu = _mem.reduce_mutex(); mu != nullptr) lk = std::unique_lock(*mu);
          hal::abi::reduce(dt, static_cast<hal::abi::RedOp>(q.in_redop), dst, p.payload,
                           p.payload_len / hal::abi::dtype_size(dt));
        }
      }
    }
    q.in_off += p.payload_len;
    q.epsn = wire::psn_add(q.epsn, 1);
    if (last) {
      ++q.msn;
      if (q.in_has_rwqe) {
        const bool imm = h & wire::hdr::IMM;
        recv_cqe(q, q.in_rwqe, WcStatus::SUCCESS, kind == Qp::In::send ? rdma::WcOp::RECV : rdma::WcOp::RECV_WRITE_IMM,
                 kind == Qp::In::send ? q.in_off : q.in_len, imm, p.imm);
        q.in_has_rwqe = false;
      }
      q.in = Qp::In::none;
    }
    if (p.ack_req) send_ack(q, wire::aeth::ACK | wire::aeth::CREDITS_INVALID, p.psn);
    return;
  }
  if (q.in != Qp::In::none) {  // a READ or atomic inside an open message
    invalid_request();
    return;
  }
  if (op == Op::READ_REQUEST) {
    uint8_t* src = nullptr;
    if (p.dma_len > 0) {
      if (_mrs.check(p.rkey, p.va, p.dma_len, rdma::access::REMOTE_READ) != MrTable::Check::ok ||
          (src = _mem.map(p.va, p.dma_len, false)) == nullptr) {
        remote_access_error();
        return;
      }
    }
    const uint32_t n = p.dma_len == 0 ? 1 : (p.dma_len + q.mtu - 1) / q.mtu;
    ++q.msn;
    read_responses(q, p.psn, src, p.dma_len);
    q.epsn = wire::psn_add(q.epsn, n);
    return;
  }
  if (op == Op::COMPARE_SWAP || op == Op::FETCH_ADD) {
    if (p.va % 8 != 0) {
      invalid_request();
      return;
    }
    uint8_t* m = nullptr;
    if (_mrs.check(p.rkey, p.va, 8, rdma::access::REMOTE_ATOMIC) != MrTable::Check::ok ||
        (m = _mem.map(p.va, 8, true)) == nullptr) {
      remote_access_error();
      return;
    }
    if (reinterpret_cast<uintptr_t>(m) % 8 != 0) {  // the device's mapping must keep the alignment
      send_ack(q, wire::aeth::NAK_REMOTE_OP, p.psn);
      fail_qp(q, WcStatus::WR_FLUSH_ERR, 0);
      return;
    }
    // Atomic against the DMA engine's FETCH_ADD/CMP_SWAP on the same memory.
    std::atomic_ref<uint64_t> word(*reinterpret_cast<uint64_t*>(m));
    uint64_t orig;
    if (op == Op::FETCH_ADD) {
      orig = word.fetch_add(p.swap_add);
    } else {
      orig = p.compare;
      word.compare_exchange_strong(orig, p.swap_add);
    }
    q.atomics[q.atomic_next] = Qp::AtomicSaved{p.psn, orig, true};
    q.atomic_next = (q.atomic_next + 1) % kAtomicHistory;
    ++q.msn;
    q.epsn = wire::psn_add(q.epsn, 1);
    wire::Packet r = to_peer(q.a, q.a.dest_qpn);
    r.opcode = static_cast<uint8_t>(Op::ATOMIC_ACKNOWLEDGE);
    r.psn = p.psn;
    r.syndrome = wire::aeth::ACK | wire::aeth::CREDITS_INVALID;
    r.msn = q.msn;
    r.orig = orig;
    send_frame(r, nullptr);
    return;
  }
  invalid_request();  // a response opcode arriving as a request cannot happen (rx sorts them); anything else
}

}  // namespace hcomm::sim::roce
