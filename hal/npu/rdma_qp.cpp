#include "hal/npu/rdma_qp.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

namespace hcomm::hal::npu {

namespace reg = abi::reg;

namespace {

constexpr uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) & ~(a - 1); }

const char* net_status_name(uint32_t s) {
  switch (s) {
    case abi::net_status::OK: return "ok";
    case abi::net_status::BAD_CMD: return "unknown command";
    case abi::net_status::BAD_ARG: return "argument out of range";
    case abi::net_status::NOT_FOUND: return "no such key or QP";
    case abi::net_status::IN_USE: return "key index in use";
    case abi::net_status::NO_SLOT: return "every QP slot in use";
    case abi::net_status::BAD_STATE: return "state change not allowed";
    case abi::net_status::UNMAPPED: return "ring or shadow not mapped";
  }
  return "unknown status";
}

}  // namespace

// ---- the port, on Device --------------------------------------------------------------

Status Device::net_command(uint32_t cmd, const void* arg, size_t len, uint32_t* result) {
  if ((_info.caps & abi::cap::ROCE) == 0) return Status::error(Code::unsupported, "the device has no network engine");
  if (len > reg::kNetCmdArgSize || len % 4 != 0) return Status::error(Code::invalid_argument, "net command argument of %zu bytes", len);
  std::lock_guard lk(_net_mu);
  uint8_t block[reg::kNetCmdArgSize] = {};
  if (len > 0) std::memcpy(block, arg, len);
  for (uint32_t off = 0; off < reg::kNetCmdArgSize; off += 4) {
    uint32_t w;
    std::memcpy(&w, block + off, 4);
    HCOMM_TRY(_link->write32(reg::NET_CMD_ARG + off, w));
  }
  HCOMM_TRY(_link->write32(reg::NET_CMD, cmd));
  uint32_t st = 0, res = 0;
  HCOMM_TRY(_link->read32(reg::NET_CMD_STATUS, &st));
  HCOMM_TRY(_link->read32(reg::NET_CMD_RESULT, &res));
  if (st != abi::net_status::OK)
    return Status::error(st == abi::net_status::NO_SLOT ? Code::no_resource
                         : st == abi::net_status::NOT_FOUND ? Code::not_found
                                                            : Code::invalid_argument,
                         "net command %u: %s", cmd, net_status_name(st));
  if (result != nullptr) *result = res;
  return Status::ok();
}

Status Device::net_info(NetInfo* out) {
  if ((_info.caps & abi::cap::ROCE) == 0) return Status::error(Code::unsupported, "the device has no network engine");
  uint64_t mac = 0;
  uint32_t v = 0;
  HCOMM_TRY(_link->read64(reg::NET_MAC, &mac));
  for (int i = 0; i < 6; ++i) out->mac[i] = static_cast<uint8_t>(mac >> (8 * (5 - i)));
  HCOMM_TRY(_link->read32(reg::NET_IP, &out->ip));
  HCOMM_TRY(_link->read32(reg::NET_LINK, &v));
  out->link_up = v == 1;
  HCOMM_TRY(_link->read32(reg::NET_MAX_MTU, &out->max_mtu));
  HCOMM_TRY(_link->read32(reg::NET_NUM_QP, &out->num_qp));
  HCOMM_TRY(_link->read32(reg::NET_NUM_MR, &out->num_mr));
  for (uint32_t i = 0; i < reg::kNetCounterCount; ++i) HCOMM_TRY(_link->read64(reg::NET_COUNTERS + 8 * i, &out->counters[i]));
  return Status::ok();
}

Status Device::net_set_ip(uint32_t ip) {
  if ((_info.caps & abi::cap::ROCE) == 0) return Status::error(Code::unsupported, "the device has no network engine");
  return _link->write32(reg::NET_IP, ip);
}

Status Device::mr_register(uint64_t iova, uint64_t len, uint8_t access, uint32_t* key) {
  if ((_info.caps & abi::cap::ROCE) == 0) return Status::error(Code::unsupported, "the device has no network engine");
  uint32_t idx = UINT32_MAX;
  uint8_t gen = 0;
  {
    std::lock_guard lk(_mu);
    if (_mr_used.empty()) {
      uint32_t n = 0;
      HCOMM_TRY(_link->read32(reg::NET_NUM_MR, &n));
      _mr_used.assign(n, false);
      _mr_gen.assign(n, 0);
      if (n > 0) _mr_used[0] = true;  // index 0 stays unused: key 0 is never valid
    }
    for (uint32_t i = 0; i < _mr_used.size(); ++i)
      if (!_mr_used[i]) {
        idx = i;
        _mr_used[i] = true;
        gen = ++_mr_gen[i];
        break;
      }
  }
  if (idx == UINT32_MAX) return Status::error(Code::no_resource, "every memory key of the device is in use");
  rdma::MrEntry e{};
  e.iova = iova;
  e.length = len;
  e.key = rdma::make_key(idx, gen);
  e.access = access;
  Status st = net_command(abi::net_cmd::MR_SET, &e, sizeof e, nullptr);
  if (!st) {
    std::lock_guard lk(_mu);
    _mr_used[idx] = false;
    return st;
  }
  *key = e.key;
  return Status::ok();
}

Status Device::mr_invalidate(uint32_t key) {
  HCOMM_TRY(net_command(abi::net_cmd::MR_INVALIDATE, &key, 4, nullptr));
  std::lock_guard lk(_mu);
  const uint32_t idx = rdma::key_index(key);
  if (idx < _mr_used.size()) _mr_used[idx] = false;
  return Status::ok();
}

Status Device::create_qp(const QpOptions& o, std::unique_ptr<RdmaQp>* out) {
  if ((_info.caps & abi::cap::ROCE) == 0) return Status::error(Code::unsupported, "the device has no network engine");
  auto bad = [](uint32_t l) { return l == 0 || l > rdma::kMaxRingLog2; };
  if (bad(o.sq_log2) || bad(o.rq_log2) || bad(o.cq_log2))
    return Status::error(Code::invalid_argument, "queue pair rings must be 2^1..2^%u entries", rdma::kMaxRingLog2);
  std::unique_ptr<RdmaQp> q(new RdmaQp(*this, o));
  HCOMM_TRY(q->init());
  *out = std::move(q);
  return Status::ok();
}

// ---- a queue pair ---------------------------------------------------------------------

Status RdmaQp::init() {
  const uint64_t sq_bytes = (1ull << _opt.sq_log2) * sizeof(rdma::SendWqe);
  const uint64_t rq_off = align_up(sq_bytes, 64);
  const uint64_t cq_off = align_up(rq_off + (1ull << _opt.rq_log2) * sizeof(rdma::RecvWqe), 64);
  const uint64_t sh_off = align_up(cq_off + (1ull << _opt.cq_log2) * sizeof(rdma::Cqe), 64);
  const uint64_t total = align_up(sh_off + sizeof(rdma::QpShadow), 4096);
  HCOMM_TRY(driver::DmaBuffer::allocate(total, -1, &_mem));  // zeroed: CQ phase 0, shadow 0
  HCOMM_TRY(_dev.map_buffer(_mem, access::RW, &_map));
  auto* base = static_cast<uint8_t*>(_mem.data());
  _sq = reinterpret_cast<rdma::SendWqe*>(base);
  _rq = reinterpret_cast<rdma::RecvWqe*>(base + rq_off);
  _cq = reinterpret_cast<rdma::Cqe*>(base + cq_off);
  _sh = reinterpret_cast<rdma::QpShadow*>(base + sh_off);
  rdma::QpCreate c{};
  c.sq_iova = _map.iova;
  c.rq_iova = _map.iova + rq_off;
  c.cq_iova = _map.iova + cq_off;
  c.shadow_iova = _map.iova + sh_off;
  c.sq_log2 = _opt.sq_log2;
  c.rq_log2 = _opt.rq_log2;
  c.cq_log2 = _opt.cq_log2;
  return _dev.net_command(abi::net_cmd::QP_CREATE, &c, sizeof c, &_qpn);
}

RdmaQp::~RdmaQp() {
  if (_qpn != 0) (void)_dev.net_command(abi::net_cmd::QP_DESTROY, &_qpn, 4, nullptr);
  if (_map.valid()) (void)_dev.unmap(&_map);
}

Status RdmaQp::modify(const rdma::QpAttr& a) {
  uint8_t arg[68];
  std::memcpy(arg, &a, 64);
  std::memcpy(arg + 64, &_qpn, 4);
  return _dev.net_command(abi::net_cmd::QP_MODIFY, arg, sizeof arg, nullptr);
}

Status RdmaQp::state(rdma::QpState* out) {
  uint32_t s = 0;
  HCOMM_TRY(_dev.net_command(abi::net_cmd::QP_QUERY, &_qpn, 4, &s));
  *out = static_cast<rdma::QpState>(s);
  return Status::ok();
}

Status RdmaQp::connect(const QpPeer& peer) {
  rdma::QpAttr a{};
  a.state = static_cast<uint8_t>(rdma::QpState::INIT);
  HCOMM_TRY(modify(a));
  a.state = static_cast<uint8_t>(rdma::QpState::RTR);
  a.path_mtu = peer.path_mtu != 0 ? std::min(peer.path_mtu, _opt.path_mtu) : _opt.path_mtu;
  a.dest_qpn = peer.qpn;
  a.rq_psn = peer.psn;
  a.remote_ip = peer.ip;
  std::memcpy(a.remote_mac, peer.mac, 6);
  a.min_rnr_timer = _opt.min_rnr_timer;
  HCOMM_TRY(modify(a));
  a.state = static_cast<uint8_t>(rdma::QpState::RTS);
  a.retry_cnt = _opt.retry_cnt;
  a.rnr_retry = _opt.rnr_retry;
  a.timeout = _opt.timeout;
  a.max_rd_atomic = _opt.max_rd_atomic;
  a.sq_psn = _opt.sq_psn;
  return modify(a);
}

uint32_t RdmaQp::sq_free() const {
  const uint32_t head = std::atomic_ref<uint32_t>(_sh->sq_head).load(std::memory_order_acquire);
  return (1u << _opt.sq_log2) - (_sq_tail - head);
}

Code RdmaQp::post_send(const rdma::SendWqe& w) {
  if (sq_free() == 0) return Code::no_resource;
  _sq[_sq_tail & ((1u << _opt.sq_log2) - 1)] = w;
  ++_sq_tail;
  std::atomic_ref<uint32_t>(_sh->sq_tail).store(_sq_tail, std::memory_order_release);
  return Code::ok;
}

Code RdmaQp::post_recv(const rdma::RecvWqe& w) {
  const uint32_t head = std::atomic_ref<uint32_t>(_sh->rq_head).load(std::memory_order_acquire);
  if (_rq_tail - head >= (1u << _opt.rq_log2)) return Code::no_resource;
  _rq[_rq_tail & ((1u << _opt.rq_log2) - 1)] = w;
  ++_rq_tail;
  std::atomic_ref<uint32_t>(_sh->rq_tail).store(_rq_tail, std::memory_order_release);
  return Code::ok;
}

uint32_t RdmaQp::poll(std::span<rdma::Cqe> out) {
  uint32_t n = 0;
  const uint32_t mask = (1u << _opt.cq_log2) - 1;
  while (n < out.size()) {
    rdma::Cqe& c = _cq[_cq_head & mask];
    const uint8_t want = static_cast<uint8_t>(((_cq_head >> _opt.cq_log2) & 1) ^ 1);
    if (std::atomic_ref<uint8_t>(c.phase).load(std::memory_order_acquire) != want) break;
    out[n++] = c;
    ++_cq_head;
  }
  if (n > 0) std::atomic_ref<uint32_t>(_sh->cq_head).store(_cq_head, std::memory_order_release);
  return n;
}

Status RdmaQp::wait(uint32_t n, std::span<rdma::Cqe> out, const Deadline& deadline) {
  uint32_t got = 0;
  // Polls (yielding) for the first 200 us, then naps 20 us between polls.
  const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
  while (got < n) {
    got += poll(out.subspan(got, n - got));
    if (got < n) {
      if (deadline.expired())
        return Status::error(Code::timeout, "QP %u: %u of %u completions before the deadline", _qpn, got, n);
      if (std::chrono::steady_clock::now() < spin_until) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
  }
  return Status::ok();
}

}  // namespace hcomm::hal::npu
