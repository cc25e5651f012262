// One-sided operations: put, get, accumulate, put-with-notify, fetch atomics,
// flush and fence, written once over the lanes (api/transport/transport.h).
// The target takes no part in any of them. Every access is checked here
// (bounds, rights, the lane's own validity check, peer liveness) before the
// key's lane moves a byte.
#include <cstring>
#include <string>

#include "api/core/context.h"
#include "hal/abi/reduce.h"

namespace hcomm::api {

namespace abi = hal::abi;

namespace {
// Accumulate and fetch atomics go to the key's atomicity agent.
Transport* lane_of(const hcomm_rkey& k, Rma op) {
  return op == Rma::acc || op == Rma::fetch_add || op == Rma::cswap ? k.alane : k.lane;
}
}  // namespace

Status Context::rma_check(RmaArgs& a, bool locked, Transport** lanep, Transport** nlanep) {
  unsigned need = 0;
  switch (a.op) {
    case Rma::put: need = HCOMM_ACCESS_REMOTE_WRITE; break;
    case Rma::get: need = HCOMM_ACCESS_REMOTE_READ; break;
    case Rma::acc: need = HCOMM_ACCESS_REMOTE_READ | HCOMM_ACCESS_REMOTE_WRITE; break;
    case Rma::fetch_add:
    case Rma::cswap: need = HCOMM_ACCESS_REMOTE_ATOMIC; break;
    case Rma::notify: return Status::error(Code::invalid_argument, "notify is part of put_notify");
  }
  const bool atomic = a.op == Rma::fetch_add || a.op == Rma::cswap;
  if (atomic) a.len = 8;
  const size_t len = a.len;
  if (!atomic && (a.local == nullptr || len == 0))
    return Status::error(Code::invalid_argument, "null local buffer or zero length");
  if (atomic && a.old_value == nullptr) return Status::error(Code::invalid_argument, "null old_value");
  if (atomic && a.roff % 8 != 0)
    return Status::error(Code::invalid_argument, "atomic offset %lu not 8-byte aligned",
                         static_cast<unsigned long>(a.roff));
  if (a.op == Rma::acc) {
    if (a.dtype > HCOMM_FP64 || a.redop > HCOMM_MIN) return Status::error(Code::invalid_argument, "unknown dtype or op");
    size_t es = abi::dtype_size(static_cast<abi::DType>(a.dtype));
    if (a.roff % es != 0)
      return Status::error(Code::invalid_argument, "accumulate offset not a multiple of the element size");
  }
  HCOMM_TRY(check_key(a.rkey, a.roff, len, need));
  Transport* lane = lane_of(*a.rkey, a.op);
  Transport* nlane = nullptr;
  if (a.notify_rkey != nullptr) {
    HCOMM_TRY(check_key(a.notify_rkey, a.notify_off, 8, HCOMM_ACCESS_REMOTE_WRITE));
    if (a.notify_off % 8 != 0) return Status::error(Code::invalid_argument, "notify offset not 8-byte aligned");
    if (a.notify_rkey->peer != a.rkey->peer)
      return Status::error(Code::invalid_argument, "data and notify keys belong to different ranks");
    nlane = a.notify_rkey->lane;
    // Data then word: either one lane orders them itself, or the data lane is
    // synchronous (complete at the target when it returns) and the word is
    // stored after it.
    if (nlane != lane && !(lane->caps().sync && nlane->caps().sync))
      return Status::error(Code::unsupported, "put_notify: data (%s) and notify word (%s) on lanes that cannot order them",
                           lane->name(), nlane->name());
  }
  if (!atomic) {
    a.local_mem = locked ? find_local(a.local, len) : find_local_unlocked(a.local, len);
    if (a.local_mem == nullptr)
      return Status::error(Code::invalid_argument,
                           "local buffer [%p,+%zu) is not inside memory registered with this context",
                           static_cast<const void*>(a.local), len);
  }
  *lanep = lane;
  *nlanep = nlane;
  return Status::ok();
}

Status Context::rma_run_sync(const RmaArgs& a, Transport* lane, Transport* nlane) {
  // Complete at the target when each call returns: the data, then the word.
  Status st = lane->rma(a, nullptr);
  if (st && nlane != nullptr) {
    RmaOp w;
    w.op = Rma::notify;
    w.rkey = a.notify_rkey;
    w.roff = a.notify_off;
    w.operand = a.notify_value;
    st = nlane->rma(w, nullptr);
  }
  return st;
}

// A synchronous lane's copy, under the access mark from a second look at
// the owner's generation to the last byte (AccessMark): what came before it
// (a lookup that took the lock, a fence's wait) may have let a release
// through.
Status Context::rma_run_marked(const RmaArgs& a, Transport* lane, Transport* nlane) {
  const AccessMark mark = key_mark(a.rkey);
  HCOMM_TRY(check_live(*a.rkey));
  if (a.notify_rkey != nullptr) HCOMM_TRY(check_live(*a.notify_rkey));
  return rma_run_sync(a, lane, nlane);
}

Status Context::rma_unlocked(RmaArgs& a) {
  Transport* lane = nullptr;
  Transport* nlane = nullptr;
  HCOMM_TRY(rma_check(a, false, &lane, &nlane));
  return rma_run_marked(a, lane, nlane);
}

Status Context::rma(RmaArgs& a, std::shared_ptr<Request>* out) {
  Transport* lane = nullptr;
  Transport* nlane = nullptr;
  HCOMM_TRY(rma_check(a, true, &lane, &nlane));
  if (lane->caps().sync) {
    // hcomm_fence: what asynchronous lanes hold from before completes first.
    if (_fence_next.exchange(false, std::memory_order_acq_rel)) HCOMM_TRY(complete_all(Deadline::after_ms(30000)));
    if (out != nullptr) out->reset();  // complete on return: no request
    return rma_run_marked(a, lane, nlane);
  }
  // hcomm_fence orders across peers: the NPU's one queue serves every peer,
  // so its FENCE flag is context-wide; any other asynchronous lane (verbs:
  // IBV_SEND_FENCE orders one queue pair only) first completes everything
  // issued before, on every lane.
  const bool fence = _fence_next.exchange(false, std::memory_order_acq_rel);
  if (fence && lane->id() != TransportId::npu) HCOMM_TRY(complete_all(Deadline::after_ms(30000)));
  a.fence = fence;
  if (a.implicit && lane->caps().implicit && (a.op == Rma::put || a.op == Rma::get) && a.notify_rkey == nullptr) {
    // No request: the lane reports a failure (on_implicit_failed) and its
    // flush waits for these.
    if (out != nullptr) out->reset();
    return lane->rma(a, nullptr);
  }
  auto r = rma_request(a.rkey->peer);
  if (lane->finishes_alone()) r->held_by = lane;
  if (out != nullptr) *out = r;
  return lane->rma(a, r);
}

std::shared_ptr<Request> Context::rma_request(int peer) {
  auto r = new_request();
  r->kind = Request::Kind::rma;
  r->peer = peer;
  r->id = _next_id++;
  return r;
}

Status Context::flush(int peer, const Deadline& dl) {
  if (peer >= _size || peer < -1) return Status::error(Code::invalid_argument, "flush: rank %d of %d", peer, _size);
  if (peer >= 0 && peer != _rank && !_peers[static_cast<size_t>(peer)].alive)
    return Status(Code::peer_failure, _peers[static_cast<size_t>(peer)].why_dead);
  for (auto& t : _transports) HCOMM_TRY(t->flush(peer, dl));
  return reap_implicit(peer, dl, true);
}

// hcomm_fence: everything issued before is complete (implicit operations
// included), but their failures stay for the user's next flush to report.
Status Context::complete_all(const Deadline& dl) {
  for (auto& t : _transports) HCOMM_TRY(t->flush(-1, dl));
  return reap_implicit(-1, dl, false);
}

// A lane's implicit operation failed: kept as a failed request, so the
// next flush covering the peer reports it like any other.
void Context::on_implicit_failed(int peer, hcomm_status_t st, const std::string& why) {
  auto r = rma_request(peer);
  r->complete(st, why);
  keep_implicit(std::move(r));
}

void Context::keep_implicit(std::shared_ptr<Request> r) {
  // Bounded: what completed fine needs no flush to report it.
  if (_implicit.size() >= 1024)
    std::erase_if(_implicit, [](const std::shared_ptr<Request>& q) { return q->done() && q->status == HCOMM_OK; });
  _implicit.push_back(std::move(r));
}

Status Context::reap_implicit(int peer, const Deadline& dl, bool take) {
  if (_implicit.empty()) return Status::ok();
  auto covered = [peer](const Request& r) { return peer == -1 || r.peer == peer; };
  auto all_done = [&] {
    for (const auto& r : _implicit)
      if (covered(*r) && !r->done()) return false;
    return true;
  };
  if (!spin_wait(all_done, true, dl))
    return Status::error(Code::timeout, "flush: implicit (_nbi) operations still in flight at the deadline");
  if (!take) return Status::ok();
  Status first;
  std::erase_if(_implicit, [&](const std::shared_ptr<Request>& r) {
    if (!covered(*r)) return false;
    if (first && r->status != HCOMM_OK)
      first = Status(from_hcomm(r->status), "an implicit (_nbi) operation to rank " + std::to_string(r->peer) +
                                                " failed: " + r->why());
    return true;
  });
  return first;
}

Status Context::notify_wait(hcomm_mem* m, uint64_t off, uint64_t value, const Deadline& dl) {
  if (m == nullptr || m->ctx != this) return Status::error(Code::invalid_argument, "notify_wait: not memory of this context");
  if (off % 8 != 0 || off > m->size || m->size - off < 8)
    return Status::error(Code::out_of_range, "notify_wait: offset %lu not an aligned word inside %zu bytes",
                         static_cast<unsigned long>(off), m->size);
  if (m->ptr == nullptr) return Status::error(Code::unsupported, "notify_wait: memory not CPU-visible");
  std::atomic_ref<uint64_t> w(*reinterpret_cast<uint64_t*>(m->ptr + off));
  // The target side needs no progress to see the word; progress runs now and
  // then so this rank's peers are still served while it waits. Who would
  // write the word is not known here: a peer that fails during the wait ends
  // it (the word may never come), naming the peer; waiting again is the
  // caller's choice.
  const uint64_t failed_before = _peers_failed;
  if (spin_wait([&] { return w.load(std::memory_order_acquire) >= value || _peers_failed != failed_before; }, false,
                dl)) {
    if (w.load(std::memory_order_acquire) >= value) return Status::ok();
    return Status(Code::peer_failure, "notify_wait: " + _last_failure);
  }
  return Status::error(Code::timeout, "notify_wait: word is %lu, waiting for >= %lu",
                       static_cast<unsigned long>(w.load()), static_cast<unsigned long>(value));
}

}  // namespace hcomm::api
