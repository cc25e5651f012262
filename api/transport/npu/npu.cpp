#include "api/transport/npu/npu.h"

#include <cstring>

#include "api/core/context.h"
#include "common/barrier.h"
#include "common/paths.h"
#include "driver/discover.h"

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

// Device (ATT) rights an imported key needs: accumulate reads and writes the
// target; fetch atomics read and write it too.
uint32_t att_rights(unsigned key_rights) {
  uint32_t r = 0;
  if (key_rights & (HCOMM_ACCESS_REMOTE_READ | HCOMM_ACCESS_REMOTE_ATOMIC)) r |= hal::npu::access::READ;
  if (key_rights & (HCOMM_ACCESS_REMOTE_WRITE | HCOMM_ACCESS_REMOTE_ATOMIC)) r |= hal::npu::access::WRITE;
  return r;
}

}  // namespace

Status NpuTransport::open(const std::string& name, int rank, ShmTransport& node, std::unique_ptr<NpuTransport>* out) {
  std::unique_ptr<NpuTransport> t(new NpuTransport(rank, node));
  driver::DeviceRef ref;
  HCOMM_TRY(driver::parse_device_name(name, default_sim_dir(), &ref));
  std::unique_ptr<driver::Link> link;
  Status st = driver::open_link(ref, &link, 5000);
  if (!st)
    return Status(st.code(), "NPU engine: cannot open " + ref.name() + ": " + st.message() +
                                 " (start hcomm-sim, or run with HCOMM_ENGINE=host)");
  HCOMM_TRY(hal::npu::Device::open(std::move(link), &t->_dev));
  t->_software = ref.kind == driver::DeviceRef::Kind::sim;
  HCOMM_TRY(t->_dev->create_queue(std::min<uint32_t>(10, t->_dev->info().max_queue_log2), false, &t->_q));
  HCOMM_TRY(driver::DmaBuffer::allocate(4096, -1, &t->_scratch));
  HCOMM_TRY(t->_dev->map_buffer(t->_scratch, hal::npu::access::RW, &t->_scratch_map));
  for (uint32_t i = 0; i < 4096 / 8; ++i) t->_scratch_free.push_back(i);
  t->_hbm = RangeAllocator(0, t->_dev->info().hbm_size);
  t->_caps.put = t->_caps.get = t->_caps.atomic64 = t->_caps.reduce = t->_caps.notify = true;
  t->_caps.max_zcopy = 0;
  *out = std::move(t);
  return Status::ok();
}

NpuTransport::~NpuTransport() {
  _q.reset();
  if (_dev && _scratch_map.valid()) (void)_dev->unmap(&_scratch_map);
}

// ---- memory ---------------------------------------------------------------------------------

Status NpuTransport::alloc_hbm(hcomm_mem& m) {
  const uint64_t want = (m.size + 4095) & ~uint64_t{4095};
  const std::optional<uint64_t> at = _hbm.take(want);
  if (!at)
    return Status::error(Code::no_resource, "no %zu free bytes of device memory (HBM %lu bytes)", m.size,
                         static_cast<unsigned long>(_dev->info().hbm_size));
  m.hbm_offset = *at;
  m.ptr = _dev->hbm() != nullptr ? _dev->hbm() + m.hbm_offset : nullptr;
  if (m.ptr != nullptr) std::memset(m.ptr, 0, m.size);
  return Status::ok();
}

Status NpuTransport::mem_add(hcomm_mem& m) {
  switch (m.kind) {
    case MemKind::host_alloc: return _dev->map_buffer(m.buf, hal::npu::access::RW, &m.npu);
    case MemKind::device: return _dev->map_hbm(m.hbm_offset, m.size, hal::npu::access::RW, &m.npu);
    case MemKind::host_user: {
      // The device needs the memory pinned and mapped; over vfio-user that
      // takes an fd, which arbitrary user memory does not have.
      Status st = _dev->map_host(m.ptr, m.size, -1, 0, hal::npu::access::RW, &m.npu);
      if (!st)
        return Status(Code::unsupported, "the NPU engine cannot DMA this buffer (" + st.message() +
                                             "): allocate it with hcomm_mem_alloc instead");
      return st;
    }
  }
  return Status::error(Code::invalid_argument, "npu: unknown memory kind");
}

void NpuTransport::mem_remove(hcomm_mem& m) {
  // Our own device may still run descriptors on it: let them finish.
  (void)flush(-1, Deadline::after_ms(30000));
  if (m.npu.valid()) (void)_dev->unmap(&m.npu);
  if (m.kind != MemKind::device || m.size == 0) return;
  // A range given back twice is refused and leaves the free list intact.
  (void)_hbm.give(m.hbm_offset, (m.size + 4095) & ~uint64_t{4095});
}

bool NpuTransport::pack(const hcomm_mem& m, uint8_t* sec, size_t* len) const {
  if (m.kind == MemKind::host_user) return false;  // peers' devices cannot map it (no fd)
  const uint32_t fi = fabric_index();
  std::memcpy(sec, &fi, sizeof fi);
  *len = sizeof fi;
  return true;
}

Status NpuTransport::import(hcomm_rkey& k, const uint8_t* sec, size_t len) {
  uint32_t fabric = 0;
  if (len != sizeof fabric) return Status::error(Code::protocol_error, "rkey_import: npu section of %zu bytes", len);
  std::memcpy(&fabric, sec, sizeof fabric);
  // The section repeats what the owner's registry holds; a different value
  // is a forged key aiming at another device's memory.
  if (fabric != _node.fabric_of(k.peer, k.h.slot))
    return Status::error(Code::access_denied, "rkey_import: key does not match rank %d's registration (fabric index)",
                         k.peer);
  const uint32_t rights = att_rights(k.h.rights);
  if (rights == 0) return Status::ok();  // a key with no remote right: every access fails the rights check first
  switch (static_cast<MemKind>(k.h.kind)) {
    case MemKind::device:
      // Own HBM: a separate ATT entry with exactly the key's rights.
      if (k.peer == _rank) return _dev->map_hbm(k.h.addr, k.h.size, rights, &k.npu);
      return _dev->map_peer_hbm(fabric, k.h.addr, k.h.size, rights, &k.npu);
    case MemKind::host_alloc: {
      int fd = -1;
      HCOMM_TRY(_node.attach(k, &fd));
      Status st = _dev->map_host(k.mapped, k.h.size, fd, 0, rights, &k.npu);
      if (!st) (void)_node.unimport(k);
      return st;
    }
    case MemKind::host_user: break;
  }
  return Status::error(Code::unsupported,
                       "rkey_import: rank %d registered user memory, which the NPU engine cannot reach", k.peer);
}

Status NpuTransport::unimport(hcomm_rkey& k) {
  if (k.npu.valid()) {
    HCOMM_TRY(flush(-1, Deadline::after_ms(30000)));
    HCOMM_TRY(_dev->unmap(&k.npu));
  }
  return _node.unimport(k);
}

// ---- one-sided: descriptors on our queue; a request completes when the device
// completed all of its descriptors (at the target: completions follow the data) ----

Status NpuTransport::rma(const RmaOp& a, const std::shared_ptr<Request>& r) {
  if (!_lost.is_ok()) return _lost;
  hcomm_rkey& k = *a.rkey;
  if (!k.npu.valid()) return Status::error(Code::access_denied, "the key grants no device access");
  const uint64_t remote = k.npu.iova + a.roff;
  uint64_t local = 0;
  if (a.op == Rma::put || a.op == Rma::get || a.op == Rma::acc) {
    if (a.local_mem == nullptr || !a.local_mem->npu.valid())
      return Status::error(Code::invalid_argument, "local buffer is not device-mapped registered memory");
    local = a.local_mem->npu.iova + static_cast<uint64_t>(a.local - a.local_mem->ptr);
  }
  uint8_t flags = a.fence ? abi::desc_flag::FENCE : 0;
  const uint32_t ndesc = a.notify_rkey != nullptr ? 2 : 1;
  Deadline dl = Deadline::after_ms(30000);
  // Back-pressure: reap completions until the ring has room.
  while (_q->free_slots() < ndesc) {
    progress();
    if (dl.expired()) return Status::error(Code::no_resource, "DMA queue full until the deadline");
    relax();
  }
  Code c = Code::ok;
  switch (a.op) {
    case Rma::put: c = _q->copy(local, remote, a.len, r->id, flags); break;
    case Rma::get: c = _q->copy(remote, local, a.len, r->id, flags); break;
    case Rma::notify: c = _q->notify(remote, a.operand, r->id); break;
    case Rma::acc:
      c = _q->reduce(local, remote, a.len, static_cast<abi::DType>(a.dtype), static_cast<abi::RedOp>(a.redop), r->id,
                     flags);
      break;
    case Rma::fetch_add:
    case Rma::cswap: {
      while (_scratch_free.empty() && !dl.expired()) {
        progress();
        relax();
      }
      if (_scratch_free.empty()) return Status::error(Code::no_resource, "no free fetch-result slot");
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
    if (!a.notify_rkey->npu.valid()) return Status::error(Code::access_denied, "the notify key grants no device access");
    // NOTIFY runs after every earlier descriptor of the queue completed (ABI §9.1).
    c = _q->notify(a.notify_rkey->npu.iova + a.notify_off, a.notify_value, r->id);
    if (c != Code::ok) return Status::error(c, "DMA enqueue of the notify failed");
  }
  r->outstanding = ndesc;
  _pending[r->id] = r;
  _q->submit();
  return Status::ok();
}

void NpuTransport::lose(const Status& why) {
  _lost = Status::error(Code::device_error, "NPU device %s is unusable: %s", _dev->link().location().c_str(),
                        why.message().c_str());
  for (auto& [id, r] : _pending) r->complete(HCOMM_ERR_DEVICE, _lost.message());
  _pending.clear();
}

void NpuTransport::progress() {
  if (!_lost.is_ok()) return;
  hal::npu::Completion c[32];
  uint32_t n;
  while ((n = _q->poll(c)) > 0) {
    for (uint32_t i = 0; i < n; ++i) {
      // Aborted: the queue was stopped under us. If the device was reset or
      // is gone, say so (every pending and later operation fails with why).
      if (c[i].status == abi::CqStatus::ABORTED)
        if (Status h = _dev->health(true); !h) return lose(h);
      auto it = _pending.find(c[i].user_data);
      if (it == _pending.end()) continue;
      Request& r = *it->second;
      if (c[i].status != abi::CqStatus::OK && !r.done())
        r.complete(to_hcomm(code_of_device(c[i].status)),
                   std::string("device completion ") + abi::cq_status_name(c[i].status));
      if (--r.outstanding == 0) {
        if (r.result_slot != UINT32_MAX) {
          if (!r.done()) {
            *r.result_out = std::atomic_ref<uint64_t>(static_cast<uint64_t*>(_scratch.data())[r.result_slot])
                                .load(std::memory_order_acquire);
          }
          _scratch_free.push_back(r.result_slot);
          r.result_slot = UINT32_MAX;
        }
        r.complete(HCOMM_OK);
        _pending.erase(it);
      }
    }
  }
}

Status NpuTransport::flush(int peer, const Deadline& dl) {
  for (;;) {
    progress();
    if (!_lost.is_ok()) return _lost;
    bool busy = false;
    for (auto& [id, r] : _pending) busy |= peer < 0 || r->peer == peer;
    if (!busy) return Status::ok();
    if (dl.expired()) return Status::error(Code::timeout, "flush: operations still in flight at the deadline");
    relax();
  }
}

}  // namespace hcomm::api
