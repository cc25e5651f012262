// One-sided operations: put, get, accumulate, put-with-notify, fetch atomics,
// flush and fence. The target takes no part in any of them.
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <thread>
#include <cstring>
#include <vector>

#include "api/internal.h"
#include "common/barrier.h"
#include "hal/abi/reduce.h"

namespace hcomm::api {

namespace abi = hal::abi;

namespace {

Code code_of_device(abi::CqStatus s) {
  switch (s) {
    case abi::CqStatus::OK: return Code::ok;
    case abi::CqStatus::SRC_FAULT:
    case abi::CqStatus::DST_FAULT: return Code::out_of_range;
    case abi::CqStatus::SRC_PERM:
    case abi::CqStatus::DST_PERM: return Code::access_denied;
    case abi::CqStatus::PEER_FAULT: return Code::peer_failure;
    default: return Code::device_error;
  }
}

}  // namespace

// process_vm_readv/writev of one contiguous range, all of it.
Status cma(pid_t pid, void* local, uint64_t remote, size_t len, bool write) {
  size_t done = 0;
  while (done < len) {
    iovec l{static_cast<uint8_t*>(local) + done, len - done};
    iovec r{reinterpret_cast<void*>(remote + done), len - done};
    ssize_t n = write ? ::process_vm_writev(pid, &l, 1, &r, 1, 0) : ::process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (n <= 0) {
      int err = errno;
      if (err == ESRCH) return Status::error(Code::peer_failure, "target process %d is gone", pid);
      return Status::from_errno(err, write ? "process_vm_writev to the target" : "process_vm_readv from the target");
    }
    done += static_cast<size_t>(n);
  }
  return Status::ok();
}

Status Context::lock_stripe(Peer& p, uint32_t slot, const Deadline& dl, pthread_mutex_t** out) {
  CtrlSegment* c = p.rank == _rank ? _ctrl : p.ctrl;
  pthread_mutex_t* m = &c->locks[slot % kLockStripes];
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  int64_t ns = ts.tv_nsec + int64_t{std::max(dl.remaining_ms(), 1)} * 1000000;
  ts.tv_sec += static_cast<time_t>(ns / 1000000000);
  ts.tv_nsec = static_cast<long>(ns % 1000000000);
  int rc = pthread_mutex_timedlock(m, &ts);
  if (rc == EOWNERDEAD) {
    // A rank died inside an accumulate: its partial update stays, the lock lives on.
    pthread_mutex_consistent(m);
    rc = 0;
  }
  if (rc == ETIMEDOUT) return Status::error(Code::timeout, "accumulate lock of rank %d busy until the deadline", p.rank);
  if (rc != 0) return Status::from_errno(rc, "pthread_mutex_timedlock");
  *out = m;
  return Status::ok();
}

// Read or write [off, off+len) of the key's memory from this CPU.
Status Context::remote_rw(Peer& p, hcomm_rkey* k, uint64_t off, void* buf, size_t len, bool write) {
  if (k->mapped != nullptr) {
    if (write) std::memcpy(k->mapped + off, buf, len);
    else std::memcpy(buf, k->mapped + off, len);
    return Status::ok();
  }
  return cma(p.pid, buf, k->w.addr + off, len, write);
}

uint64_t Context::npu_iova_local(const hcomm_mem* m, const void* p) const {
  return m->map.iova + static_cast<uint64_t>(static_cast<const uint8_t*>(p) - m->ptr);
}

Status Context::rma(const RmaArgs& a, std::shared_ptr<Request>* out) {
  unsigned need = 0;
  switch (a.op) {
    case Rma::put: need = HCOMM_ACCESS_REMOTE_WRITE; break;
    case Rma::get: need = HCOMM_ACCESS_REMOTE_READ; break;
    case Rma::acc: need = HCOMM_ACCESS_REMOTE_READ | HCOMM_ACCESS_REMOTE_WRITE; break;
    case Rma::fetch_add:
    case Rma::cswap: need = HCOMM_ACCESS_REMOTE_ATOMIC; break;
  }
  const bool atomic = a.op == Rma::fetch_add || a.op == Rma::cswap;
  const size_t len = atomic ? 8 : a.len;
  if (!atomic && (a.local == nullptr || len == 0))
    return Status::error(Code::invalid_argument, "null local buffer or zero length");
  if (atomic && a.old_value == nullptr) return Status::error(Code::invalid_argument, "null old_value");
  if (atomic && a.roff % 8 != 0) return Status::error(Code::invalid_argument, "atomic offset %lu not 8-byte aligned", static_cast<unsigned long>(a.roff));
  if (a.op == Rma::acc) {
    if (a.dtype > HCOMM_FP64 || a.redop > HCOMM_MIN) return Status::error(Code::invalid_argument, "unknown dtype or op");
    size_t es = abi::dtype_size(static_cast<abi::DType>(a.dtype));
    if (a.roff % es != 0) return Status::error(Code::invalid_argument, "accumulate offset not a multiple of the element size");
  }
  HCOMM_TRY(check_key(a.rkey, a.roff, len, need));
  if (a.notify_rkey != nullptr) {
    HCOMM_TRY(check_key(a.notify_rkey, a.notify_off, 8, HCOMM_ACCESS_REMOTE_WRITE));
    if (a.notify_off % 8 != 0) return Status::error(Code::invalid_argument, "notify offset not 8-byte aligned");
    if (a.notify_rkey->peer != a.rkey->peer)
      return Status::error(Code::invalid_argument, "data and notify keys belong to different ranks");
  }
  if (!atomic && find_local(a.local, len) == nullptr)
    return Status::error(Code::invalid_argument,
                         "local buffer [%p,+%zu) is not inside memory registered with this context", a.local, len);
  if (out == nullptr && !_dev) return rma_host(a);  // blocking host-engine call: no request needed
  auto r = std::make_shared<Request>();
  r->kind = Request::Kind::rma;
  r->peer = a.rkey->peer;
  r->id = _next_id++;
  if (out != nullptr) *out = r;
  if (_dev) return rma_npu(a, r);
  Status st = rma_host(a);
  complete(*r, st ? HCOMM_OK : to_hcomm(st.code()), st.message());
  return st;
}

// Host engine: the initiating CPU does the move, once, and the operation is
// complete (at the target) when this returns.
Status Context::rma_host(const RmaArgs& a) {
  Peer& p = _peers[a.rkey->peer];
  hcomm_rkey* k = a.rkey;
  switch (a.op) {
    case Rma::put:
      HCOMM_TRY(remote_rw(p, k, a.roff, a.local, a.len, true));
      break;
    case Rma::get:
      return remote_rw(p, k, a.roff, a.local, a.len, false);
    case Rma::acc: {
      const auto dt = static_cast<abi::DType>(a.dtype);
      const size_t es = abi::dtype_size(dt);
      pthread_mutex_t* lk = nullptr;
      HCOMM_TRY(lock_stripe(p, k->w.slot, Deadline::after_ms(30000), &lk));
      Status st;
      if (k->mapped != nullptr) {
        abi::reduce(dt, static_cast<abi::RedOp>(a.redop), k->mapped + a.roff, a.local, a.len / es);
      } else {
        // Registered user memory: fetch, combine, write back under the lock.
        std::vector<uint8_t> tmp(a.len);
        st = cma(p.pid, tmp.data(), k->w.addr + a.roff, a.len, false);
        if (st) {
          abi::reduce(dt, static_cast<abi::RedOp>(a.redop), tmp.data(), a.local, a.len / es);
          st = cma(p.pid, tmp.data(), k->w.addr + a.roff, a.len, true);
        }
      }
      pthread_mutex_unlock(lk);
      return st;
    }
    case Rma::fetch_add:
    case Rma::cswap: {
      // hcomm_mem_alloc memory is mapped by every rank: CPU atomics on it are
      // atomic across processes. Registered user memory is reached by peers
      // through process_vm_*, so every rank (the owner included) must take
      // the same lock instead, or a lock-free owner races a locked peer.
      if (k->mapped != nullptr && static_cast<MemKind>(k->w.kind) != MemKind::host_user) {
        std::atomic_ref<uint64_t> w(*reinterpret_cast<uint64_t*>(k->mapped + a.roff));
        if (a.op == Rma::fetch_add) {
          *a.old_value = w.fetch_add(a.operand, std::memory_order_acq_rel);
        } else {
          uint64_t expect = a.compare;
          w.compare_exchange_strong(expect, a.operand, std::memory_order_acq_rel);
          *a.old_value = expect;
        }
        return Status::ok();
      }
      pthread_mutex_t* lk = nullptr;
      HCOMM_TRY(lock_stripe(p, k->w.slot, Deadline::after_ms(30000), &lk));
      uint64_t v = 0;
      Status st = remote_rw(p, k, a.roff, &v, 8, false);
      if (st) {
        *a.old_value = v;
        uint64_t nv = a.op == Rma::fetch_add ? v + a.operand : (v == a.compare ? a.operand : v);
        if (nv != v) st = remote_rw(p, k, a.roff, &nv, 8, true);
      }
      pthread_mutex_unlock(lk);
      return st;
    }
  }
  if (a.notify_rkey != nullptr) {
    // The data above is in place (the copy returned); publish the flag with
    // release so a waiter that sees it sees the data.
    hcomm_rkey* nk = a.notify_rkey;
    if (nk->mapped != nullptr) {
      std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(nk->mapped + a.notify_off))
          .store(a.notify_value, std::memory_order_release);
    } else {
      uint64_t v = a.notify_value;
      HCOMM_TRY(cma(p.pid, &v, nk->w.addr + a.notify_off, 8, true));
    }
  }
  return Status::ok();
}

// NPU engine: descriptors on our DMA queue; the request completes when the
// device completed all of them (at the target: the engine's completion is
// written after the data).
Status Context::rma_npu(const RmaArgs& a, const std::shared_ptr<Request>& r) {
  hcomm_rkey* k = a.rkey;
  if (!k->map.valid()) return Status::error(Code::access_denied, "the key grants no device access");
  const uint64_t remote = k->map.iova + a.roff;
  uint64_t local = 0;
  if (a.local != nullptr && a.op != Rma::fetch_add && a.op != Rma::cswap) {
    const hcomm_mem* m = find_local(a.local, a.len);
    if (m == nullptr || !m->map.valid())
      return Status::error(Code::invalid_argument, "local buffer is not device-mapped registered memory");
    local = npu_iova_local(m, a.local);
  }
  uint8_t flags = _fence_next ? abi::desc_flag::FENCE : 0;
  _fence_next = false;
  const uint32_t ndesc = a.notify_rkey != nullptr ? 2 : 1;
  Deadline dl = Deadline::after_ms(30000);
  // Back-pressure: reap completions until the ring has room.
  while (_q->free_slots() < ndesc) {
    reap_npu();
    if (dl.expired()) return Status::error(Code::no_resource, "DMA queue full until the deadline");
    cpu_relax();
  }
  Code c = Code::ok;
  switch (a.op) {
    case Rma::put: c = _q->copy(local, remote, a.len, r->id, flags); break;
    case Rma::get: c = _q->copy(remote, local, a.len, r->id, flags); break;
    case Rma::acc:
      c = _q->reduce(local, remote, a.len, static_cast<abi::DType>(a.dtype), static_cast<abi::RedOp>(a.redop), r->id,
                     flags);
      break;
    case Rma::fetch_add:
    case Rma::cswap: {
      if (_scratch_free.empty()) {
        while (_scratch_free.empty() && !dl.expired()) reap_npu();
        if (_scratch_free.empty()) return Status::error(Code::no_resource, "no free fetch-result slot");
      }
      r->result_slot = _scratch_free.back();
      _scratch_free.pop_back();
      r->result_out = a.old_value;
      uint64_t res = _scratch_map.iova + 8ull * r->result_slot;
      c = a.op == Rma::fetch_add ? _q->fetch_add(remote, res, a.operand, r->id, flags)
                                 : _q->cmp_swap(remote, res, a.compare, a.operand, r->id, flags);
      break;
    }
  }
  if (c != Code::ok) return Status::error(c, "DMA enqueue failed");
  if (a.notify_rkey != nullptr) {
    // NOTIFY runs after every earlier descriptor of the queue completed (ABI §9.1).
    c = _q->notify(a.notify_rkey->map.iova + a.notify_off, a.notify_value, r->id);
    if (c != Code::ok) return Status::error(c, "DMA enqueue of the notify failed");
  }
  r->outstanding = ndesc;
  _npu_pending[r->id] = r;
  _q->submit();
  return Status::ok();
}

void Context::reap_npu() {
  hal::npu::Completion c[32];
  uint32_t n;
  while ((n = _q->poll(c)) > 0) {
    for (uint32_t i = 0; i < n; ++i) {
      auto it = _npu_pending.find(c[i].user_data);
      if (it == _npu_pending.end()) continue;
      Request& r = *it->second;
      if (c[i].status != abi::CqStatus::OK && !r.done())
        complete(r, to_hcomm(code_of_device(c[i].status)),
                 std::string("device completion ") + abi::cq_status_name(c[i].status));
      if (--r.outstanding == 0) {
        if (r.result_slot != UINT32_MAX) {
          if (!r.done()) {
            *r.result_out = std::atomic_ref<uint64_t>(
                                static_cast<uint64_t*>(_scratch.data())[r.result_slot]).load(std::memory_order_acquire);
          }
          _scratch_free.push_back(r.result_slot);
          r.result_slot = UINT32_MAX;
        }
        complete(r, HCOMM_OK);
        _npu_pending.erase(it);
      }
    }
  }
}

Status Context::flush(int peer, const Deadline& dl) {
  if (peer >= _size || peer < -1) return Status::error(Code::invalid_argument, "flush: rank %d of %d", peer, _size);
  if (peer >= 0 && peer != _rank && !_peers[peer].alive) return Status(Code::peer_failure, _peers[peer].why_dead);
  if (!_dev) return Status::ok();  // host engine operations complete at the target before they return
  for (;;) {
    reap_npu();
    bool busy = false;
    for (auto& [id, r] : _npu_pending) busy |= peer < 0 || r->peer == peer;
    if (!busy) return Status::ok();
    if (dl.expired()) return Status::error(Code::timeout, "flush: operations still in flight at the deadline");
    cpu_relax();
  }
}

Status Context::notify_wait(hcomm_mem* m, uint64_t off, uint64_t value, const Deadline& dl) {
  if (m == nullptr || m->ctx != this) return Status::error(Code::invalid_argument, "notify_wait: not memory of this context");
  if (off % 8 != 0 || off > m->size || m->size - off < 8)
    return Status::error(Code::out_of_range, "notify_wait: offset %lu not an aligned word inside %zu bytes",
                         static_cast<unsigned long>(off), m->size);
  if (m->ptr == nullptr) return Status::error(Code::unsupported, "notify_wait: memory not CPU-visible");
  std::atomic_ref<uint64_t> w(*reinterpret_cast<uint64_t*>(m->ptr + off));
  // The target side needs no progress to see the word; progress runs now and
  // then so this rank's peers are still served while it waits.
  if (spin_wait([&] { return w.load(std::memory_order_acquire) >= value; }, false, dl)) return Status::ok();
  return Status::error(Code::timeout, "notify_wait: word is %lu, waiting for >= %lu",
                       static_cast<unsigned long>(w.load()), static_cast<unsigned long>(value));
}

}  // namespace hcomm::api
