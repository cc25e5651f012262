#include "sim/roce/net.h"

#include <atomic>
#include <cstdio>
#include <cstring>

namespace hcomm::sim::roce {

namespace reg = hal::abi::reg;
namespace net_cmd = hal::abi::net_cmd;
namespace net_status = hal::abi::net_status;

// ---- the switch ---------------------------------------------------------------------

namespace {

uint64_t mac_key(const uint8_t* m) {
  uint64_t k = 0;
  for (int i = 0; i < 6; ++i) k = k << 8 | m[i];
  return k;
}

bool is_roce(const uint8_t* f, size_t n) {
  return n >= wire::kL2L4Len + wire::kBthLen + wire::kIcrcLen && wire::get16(f + 12) == wire::kEtherIPv4 &&
         f[wire::kEthLen + 9] == 17 && wire::get16(f + wire::kEthLen + wire::kIpv4Len + 2) == wire::kUdpPort;
}

}  // namespace

uint32_t NetSwitch::add_port(Deliver deliver, bool faulty) {
  std::lock_guard lk(_mu);
  _ports.push_back(std::move(deliver));
  _faulty.push_back(faulty);
  return static_cast<uint32_t>(_ports.size() - 1);
}

void NetSwitch::set_faults(const NetFaultConfig& f) {
  std::lock_guard lk(_mu);
  _f = f;
  _fc = NetFaultCounters{};  // counted from here
  _rng.seed(f.seed);
}

NetFaultConfig NetSwitch::faults() const {
  std::lock_guard lk(_mu);
  return _f;
}

NetFaultCounters NetSwitch::fault_counters() const {
  std::lock_guard lk(_mu);
  return _fc;
}

Status NetSwitch::capture(const std::string& path) {
  std::lock_guard lk(_mu);
  return _pcap.open(path);
}

void NetSwitch::ingress(uint32_t port, const uint8_t* frame, size_t len, uint64_t now) {
  if (len < wire::kEthLen) return;
  std::unique_lock lk(_mu);
  if (port >= _ports.size()) return;
  std::vector<uint8_t> f(frame, frame + len);
  _macs[mac_key(f.data() + 6)] = port;  // learn
  auto pct = [&](uint32_t p) { return p > 0 && _rng() % 100 < p; };
  if (_faulty[port]) {
    if (_f.drop_next > 0) {
      --_f.drop_next;
      ++_fc.dropped;
      return;
    }
    if (pct(_f.drop_pct)) {
      ++_fc.dropped;
      return;
    }
    bool bad = false;
    // Corruption goes where only the ICRC can see it: the transport headers
    // and payload of a RoCE frame, never the BTH byte the ICRC masks.
    if (is_roce(f.data(), f.size()) && (_f.corrupt_next > 0 || pct(_f.corrupt_pct))) {
      if (_f.corrupt_next > 0) --_f.corrupt_next;
      size_t i;
      do {
        i = wire::kL2L4Len + _rng() % (f.size() - wire::kL2L4Len);
      } while (i == wire::kL2L4Len + wire::bth::kMaskedByte);
      f[i] ^= static_cast<uint8_t>(1u << (_rng() % 8));
      ++_fc.corrupted;
      bad = true;
    }
    const bool twice = pct(_f.dup_pct);
    if (pct(_f.reorder_pct) && _held.empty()) {
      _held = f;  // overtaken by the next frame
      _held_port = port;
      _held_at = now;
      ++_fc.reordered;
      return;
    }
    forward(port, f, now);
    if (twice) {
      ++_fc.duplicated;
      if (bad) ++_fc.corrupted;  // counted per corrupted frame on the wire
      forward(port, f, now);
    }
  } else {
    forward(port, f, now);
  }
  if (!_held.empty()) {
    std::vector<uint8_t> h;
    h.swap(_held);
    forward(_held_port, h, now);
  }
}

void NetSwitch::tick(uint64_t now) {
  std::lock_guard lk(_mu);
  if (!_held.empty() && now - _held_at > 1'000'000) {
    std::vector<uint8_t> h;
    h.swap(_held);
    forward(_held_port, h, now);
  }
}

// Holds _mu. A deliver callback only queues (NetPort::deliver) or sends on a socket.
void NetSwitch::forward(uint32_t in, const std::vector<uint8_t>& f, uint64_t now) {
  _pcap.write(f.data(), f.size(), now);
  const bool bcast = f[0] & 1;  // broadcast and multicast
  auto it = bcast ? _macs.end() : _macs.find(mac_key(f.data()));
  if (it != _macs.end()) {
    _ports[it->second](f.data(), f.size());  // (a frame to its own sender's MAC goes back: loopback)
    return;
  }
  for (uint32_t p = 0; p < _ports.size(); ++p)
    if (p != in) _ports[p](f.data(), f.size());
}

// ---- one NPU's port ---------------------------------------------------------------

struct NetPort::Slot {
  uint32_t qpn = 0;
  rdma::QpCreate c{};
  uint8_t* sq = nullptr;
  uint8_t* rq = nullptr;
  uint8_t* cq = nullptr;
  rdma::QpShadow* sh = nullptr;
  uint32_t sq_head = 0, rq_head = 0, cq_tail = 0;
  std::vector<uint64_t> sq_wrid, rq_wrid;  // the driver's wr_id by ring slot
  std::deque<rdma::Cqe> backlog;            // completions waiting for CQ room
};

NetPort::NetPort(uint32_t node, uint32_t index, MemoryAccess& mem, NetSwitch& sw)
    : _mem(mem), _sw(sw) {
  const uint8_t mac[6] = {0x02, 0x4e, 0x50, 0x55, static_cast<uint8_t>(node), static_cast<uint8_t>(index)};
  std::memcpy(_addr.mac, mac, 6);
  _default_ip = 0x0a000000u | (node & 0xff) << 8 | ((index + 1) & 0xff);
  _addr.ip = _default_ip;
  _slots.resize(kNumQp);
  make_engine();
  _sw_port = _sw.add_port([this](const uint8_t* f, size_t n) { deliver(f, n); }, true);
}

NetPort::~NetPort() = default;

void NetPort::make_engine() {
  _mrs = std::make_unique<MrTable>(kNumMr);
  _eng = std::make_unique<Engine>(
      _addr, _mem, *_mrs, [this](const uint8_t* f, size_t n) { _sw.ingress(_sw_port, f, n, _now); },
      [this](const rdma::Cqe& c) { on_cqe(c); });
}

void NetPort::reset() {
  std::lock_guard lk(_mu);
  for (auto& s : _slots) s.reset();
  _before = with(_before, _eng->counters());
  _addr.ip = _default_ip;
  make_engine();
  std::memset(_arg, 0, sizeof _arg);
  _cmd_status = _cmd_result = 0;
}

void NetPort::forget(const uint8_t* p, size_t len) {
  std::lock_guard lk(_mu);
  auto in = [&](const void* x) {
    const auto* b = static_cast<const uint8_t*>(x);
    return b >= p && b < p + len;
  };
  for (auto& s : _slots) {
    if (s && (in(s->sq) || in(s->rq) || in(s->cq) || in(s->sh))) {
      (void)_eng->destroy_qp(s->qpn);
      s.reset();
    }
  }
}

Counters NetPort::counters() const {
  std::lock_guard lk(_mu);
  return _eng->counters();
}

NetPort::Totals NetPort::totals() const {
  std::lock_guard lk(_mu);
  return with(_before, _eng->counters());
}

NetPort::Totals NetPort::with(const Totals& t, const Counters& c) {
  return Totals{t.bad_icrc + c.rx_bad_icrc, t.retransmits + c.retransmits, t.timeouts + c.timeouts};
}

std::string NetPort::describe() const {
  std::lock_guard lk(_mu);
  std::string s = "port " + wire::mac_string(_addr.mac) + " " + wire::ip_string(_addr.ip) + " link up mtu 4096\n";
  s += _eng->describe();
  return s;
}

void NetPort::deliver(const uint8_t* f, size_t n) {
  std::lock_guard lk(_rx_mu);
  if (_rx.size() < 4096) _rx.emplace_back(f, f + n);  // a full receive buffer drops, as a NIC's would
}

Status NetPort::reg_read(uint64_t off, void* data, size_t len) {
  std::lock_guard lk(_mu);
  uint64_t v = 0;
  if (off >= reg::NET_CMD_ARG && off + len <= reg::NET_CMD_ARG + reg::kNetCmdArgSize) {
    std::memcpy(data, _arg + (off - reg::NET_CMD_ARG), len);
    return Status::ok();
  }
  if (off >= reg::NET_COUNTERS && off < reg::NET_COUNTERS + reg::kNetCounterCount * 8) {
    if (len != 8 || off % 8 != 0) return Status::error(Code::invalid_argument, "net counter read needs 8 bytes");
    const Counters& c = _eng->counters();
    const uint64_t vals[reg::kNetCounterCount] = {c.tx_frames,      c.rx_frames,     c.rx_bad_icrc,   c.rx_malformed,
                                                  c.rx_not_roce,    c.rx_unsupported, c.rx_no_qp,     c.retransmits,
                                                  c.timeouts,       c.seq_naks_sent, c.seq_naks_rcvd, c.rnr_naks_sent,
                                                  c.rnr_naks_rcvd,  c.duplicates,    c.access_naks_sent, c.arp_replies};
    v = vals[(off - reg::NET_COUNTERS) / 8];
    std::memcpy(data, &v, 8);
    return Status::ok();
  }
  switch (off) {
    case reg::NET_MAC:
      for (int i = 0; i < 6; ++i) v = v << 8 | _addr.mac[i];
      break;
    case reg::NET_IP: v = _addr.ip; break;
    case reg::NET_LINK: v = 1; break;
    case reg::NET_MAX_MTU: v = 4096; break;
    case reg::NET_NUM_QP: v = kNumQp; break;
    case reg::NET_NUM_MR: v = kNumMr; break;
    case reg::NET_CMD_STATUS: v = _cmd_status; break;
    case reg::NET_CMD_RESULT: v = _cmd_result; break;
    default: v = 0; break;  // reserved and write-only offsets read 0
  }
  std::memcpy(data, &v, len);
  return Status::ok();
}

Status NetPort::reg_write(uint64_t off, const void* data, size_t len) {
  std::lock_guard lk(_mu);
  if (off >= reg::NET_CMD_ARG && off + len <= reg::NET_CMD_ARG + reg::kNetCmdArgSize) {
    std::memcpy(_arg + (off - reg::NET_CMD_ARG), data, len);
    return Status::ok();
  }
  uint32_t v = 0;
  std::memcpy(&v, data, len < 4 ? len : 4);
  switch (off) {
    case reg::NET_IP:
      _addr.ip = v;
      _eng->set_ip(v);
      break;
    case reg::NET_CMD:
      _cmd_result = 0;
      _cmd_status = execute(v, &_cmd_result);
      break;
    default: break;  // RO registers ignore writes (§1.2)
  }
  return Status::ok();
}

uint32_t NetPort::execute(uint32_t cmd, uint32_t* result) {
  uint32_t u32 = 0;
  std::memcpy(&u32, _arg, 4);
  switch (cmd) {
    case net_cmd::MR_SET: {
      rdma::MrEntry e;
      std::memcpy(&e, _arg, sizeof e);
      if (e.rsvd0 != 0 || e.rsvd1 != 0) return net_status::BAD_ARG;
      Status st = _mrs->set(e);
      if (st.is_ok()) return net_status::OK;
      return st.code() == Code::invalid_argument && st.message().find("in use") != std::string::npos
                 ? net_status::IN_USE
                 : net_status::BAD_ARG;
    }
    case net_cmd::MR_INVALIDATE:
      return _mrs->invalidate(u32).is_ok() ? net_status::OK : net_status::NOT_FOUND;
    case net_cmd::QP_CREATE: {
      rdma::QpCreate c;
      std::memcpy(&c, _arg, sizeof c);
      for (uint32_t r : c.rsvd)
        if (r != 0) return net_status::BAD_ARG;
      auto bad_log2 = [](uint32_t l) { return l == 0 || l > rdma::kMaxRingLog2; };
      if (bad_log2(c.sq_log2) || bad_log2(c.rq_log2) || bad_log2(c.cq_log2) || c.sq_iova % 64 != 0 ||
          c.rq_iova % 64 != 0 || c.cq_iova % 64 != 0 || c.shadow_iova % 64 != 0)
        return net_status::BAD_ARG;
      uint32_t s = 0;
      while (s < kNumQp && _slots[s]) ++s;
      if (s == kNumQp) return net_status::NO_SLOT;
      auto slot = std::make_unique<Slot>();
      slot->c = c;
      // Ring translations are latched here, as a DMA queue's are at enable (§7.4).
      slot->sq = _mem.map(c.sq_iova, (1ull << c.sq_log2) * sizeof(rdma::SendWqe), false);
      slot->rq = _mem.map(c.rq_iova, (1ull << c.rq_log2) * sizeof(rdma::RecvWqe), false);
      slot->cq = _mem.map(c.cq_iova, (1ull << c.cq_log2) * sizeof(rdma::Cqe), true);
      slot->sh = reinterpret_cast<rdma::QpShadow*>(_mem.map(c.shadow_iova, sizeof(rdma::QpShadow), true));
      if (slot->sq == nullptr || slot->rq == nullptr || slot->cq == nullptr || slot->sh == nullptr)
        return net_status::UNMAPPED;
      slot->qpn = _eng->create_qp(rdma::kQpnBase + s);
      if (slot->qpn == 0) return net_status::NO_SLOT;
      slot->sq_wrid.resize(1u << c.sq_log2);
      slot->rq_wrid.resize(1u << c.rq_log2);
      std::atomic_ref<uint32_t>(slot->sh->sq_head).store(0, std::memory_order_release);
      std::atomic_ref<uint32_t>(slot->sh->rq_head).store(0, std::memory_order_release);
      *result = slot->qpn;
      _slots[s] = std::move(slot);
      return net_status::OK;
    }
    case net_cmd::QP_MODIFY: {
      rdma::QpAttr a;
      std::memcpy(&a, _arg, sizeof a);
      uint32_t qpn;
      std::memcpy(&qpn, _arg + 64, 4);
      const uint32_t s = qpn - rdma::kQpnBase;
      if (qpn < rdma::kQpnBase || s >= kNumQp || !_slots[s]) return net_status::NOT_FOUND;
      if (a.state > static_cast<uint8_t>(rdma::QpState::ERR)) return net_status::BAD_ARG;
      Status st = _eng->modify_qp(qpn, a);
      if (st.is_ok()) return net_status::OK;
      return st.message().find("no transition") != std::string::npos ? net_status::BAD_STATE : net_status::BAD_ARG;
    }
    case net_cmd::QP_DESTROY: {
      const uint32_t s = u32 - rdma::kQpnBase;
      if (u32 < rdma::kQpnBase || s >= kNumQp || !_slots[s]) return net_status::NOT_FOUND;
      (void)_eng->destroy_qp(u32);
      _slots[s].reset();
      return net_status::OK;
    }
    case net_cmd::QP_QUERY: {
      const uint32_t s = u32 - rdma::kQpnBase;
      if (u32 < rdma::kQpnBase || s >= kNumQp || !_slots[s]) return net_status::NOT_FOUND;
      *result = static_cast<uint32_t>(_eng->qp_state(u32));
      return net_status::OK;
    }
    default:
      return net_status::BAD_CMD;
  }
}

// Completions from the engine: wr_id is the ring index the request was
// posted under (service() puts it there); the driver's wr_id goes back.
void NetPort::on_cqe(const rdma::Cqe& c) {
  const uint32_t s = c.qpn - rdma::kQpnBase;
  if (c.qpn < rdma::kQpnBase || s >= kNumQp || !_slots[s]) return;
  Slot& sl = *_slots[s];
  rdma::Cqe out = c;
  const auto idx = static_cast<uint32_t>(c.wr_id);
  out.wqe_index = idx;
  if (c.opcode & 0x80) {
    out.wr_id = sl.rq_wrid[idx & (sl.rq_wrid.size() - 1)];
  } else {
    out.wr_id = sl.sq_wrid[idx & (sl.sq_wrid.size() - 1)];
  }
  sl.backlog.push_back(out);
  (void)flush_cqes(sl);
}

bool NetPort::flush_cqes(Slot& s) {
  bool moved = false;
  const uint32_t n = 1u << s.c.cq_log2;
  while (!s.backlog.empty()) {
    const uint32_t head = std::atomic_ref<uint32_t>(s.sh->cq_head).load(std::memory_order_acquire);
    if (s.cq_tail - head >= n) break;  // full: the rest waits for room
    rdma::Cqe c = s.backlog.front();
    s.backlog.pop_front();
    auto* slot = reinterpret_cast<rdma::Cqe*>(s.cq) + (s.cq_tail & (n - 1));
    c.phase = static_cast<uint8_t>(((s.cq_tail >> s.c.cq_log2) & 1) ^ 1);  // 1 on the first pass (§8.7)
    const uint8_t phase = c.phase;
    c.phase = static_cast<uint8_t>(phase ^ 1);  // the body first, with the old phase
    std::memcpy(slot, &c, sizeof c);
    std::atomic_ref<uint8_t>(slot->phase).store(phase, std::memory_order_release);
    ++s.cq_tail;
    moved = true;
  }
  return moved;
}

bool NetPort::service(uint64_t now) {
  std::deque<std::vector<uint8_t>> rx;
  {
    std::lock_guard lk(_rx_mu);
    rx.swap(_rx);
  }
  std::lock_guard lk(_mu);
  _now = now;
  bool moved = !rx.empty();
  // New work requests: the driver's tails, acquire (the entries before them are written).
  for (auto& sp : _slots) {
    if (!sp) continue;
    Slot& s = *sp;
    const uint32_t sq_n = 1u << s.c.sq_log2, rq_n = 1u << s.c.rq_log2;
    const uint32_t rq_tail = std::atomic_ref<uint32_t>(s.sh->rq_tail).load(std::memory_order_acquire);
    // An entry is taken only while the engine holds fewer than a ring's
    // worth: its slot of rq_wrid / sq_wrid then belongs to no request the
    // engine still holds (the driver, seeing the head move, reuses the
    // ring entry at once).
    while (s.rq_head != rq_tail && rq_tail - s.rq_head <= rq_n && _eng->held(s.qpn, false) < rq_n) {
      rdma::RecvWqe w;
      std::memcpy(&w, s.rq + (s.rq_head & (rq_n - 1)) * sizeof w, sizeof w);
      s.rq_wrid[s.rq_head & (rq_n - 1)] = w.wr_id;
      w.wr_id = s.rq_head;
      ++s.rq_head;
      (void)_eng->post_recv(s.qpn, w);  // (a QP not yet ready refuses: the request is dropped, as verbs would refuse the post)
      moved = true;
    }
    const uint32_t sq_tail = std::atomic_ref<uint32_t>(s.sh->sq_tail).load(std::memory_order_acquire);
    while (s.sq_head != sq_tail && sq_tail - s.sq_head <= sq_n && _eng->held(s.qpn, true) < sq_n) {
      rdma::SendWqe w;
      std::memcpy(&w, s.sq + (s.sq_head & (sq_n - 1)) * sizeof w, sizeof w);
      s.sq_wrid[s.sq_head & (sq_n - 1)] = w.wr_id;
      w.wr_id = s.sq_head;
      ++s.sq_head;
      if (!_eng->post_send(s.qpn, w).is_ok()) {  // not in RTS: completes as flushed
        on_cqe(rdma::Cqe{w.wr_id, 0, 0, s.qpn, 0, static_cast<uint8_t>(rdma::WcStatus::WR_FLUSH_ERR), 0, 0, 0, 0});
      }
      moved = true;
    }
    std::atomic_ref<uint32_t>(s.sh->sq_head).store(s.sq_head, std::memory_order_release);
    std::atomic_ref<uint32_t>(s.sh->rq_head).store(s.rq_head, std::memory_order_release);
  }
  for (const auto& f : rx) _eng->rx(f.data(), f.size(), now);
  if (_eng->poll(now)) moved = true;
  for (auto& sp : _slots)
    if (sp && flush_cqes(*sp)) moved = true;
  return moved;
}

}  // namespace hcomm::sim::roce
