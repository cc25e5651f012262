#include "api/transport/cma/cma.h"

#include <sys/uio.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "api/core/context.h"
#include "hal/abi/reduce.h"

namespace hcomm::api {

namespace abi = hal::abi;

Status cma_copy(pid_t pid, void* local, uint64_t remote, size_t len, bool write) {
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

CmaTransport::CmaTransport(int rank, ShmTransport& node) : _rank(rank), _node(node) {
  _caps.put = _caps.get = _caps.atomic64 = _caps.reduce = true;
  _caps.sync = true;
}

bool CmaTransport::pack(const hcomm_mem& m, uint8_t* /*sec*/, size_t* len) const {
  *len = 0;  // the header's address is all process_vm_* needs
  return m.kind != MemKind::device;
}

Status CmaTransport::import(hcomm_rkey& k, const uint8_t* /*sec*/, size_t len) {
  if (len != 0) return Status::error(Code::protocol_error, "rkey_import: cma section of %zu bytes", len);
  if (static_cast<MemKind>(k.h.kind) == MemKind::device)
    return Status::error(Code::protocol_error, "rkey_import: cma section on device memory");
  if (k.peer == _rank) {
    // Our own registration: plain loads and stores, same lock discipline.
    const hcomm_mem* m = k.ctx->mem_at_slot(k.h.slot);
    if (m == nullptr) return Status::error(Code::access_denied, "rkey_import: own registration vanished");
    k.mapped = m->ptr;
  }
  return Status::ok();
}

Status CmaTransport::rw(const hcomm_rkey& k, uint64_t off, void* buf, size_t len, bool write) {
  if (k.mapped != nullptr) {
    if (write) std::memcpy(k.mapped + off, buf, len);
    else std::memcpy(buf, k.mapped + off, len);
    return Status::ok();
  }
  return cma_copy(_node.pid(k.peer), buf, k.h.addr + off, len, write);
}

Status CmaTransport::read_raw(int peer, void* local, uint64_t addr, uint32_t /*rkey*/, size_t len,
                              const std::shared_ptr<Request>& g) {
  Status st = cma_copy(_node.pid(peer), local, addr, len, false);
  g->complete(st ? HCOMM_OK : to_hcomm(st.code()), st.message());
  return st;
}

Status CmaTransport::rma(const RmaOp& a, const std::shared_ptr<Request>& /*r*/) {
  const hcomm_rkey& k = *a.rkey;
  switch (a.op) {
    case Rma::put: return rw(k, a.roff, a.local, a.len, true);
    case Rma::get: return rw(k, a.roff, a.local, a.len, false);
    case Rma::notify: {
      uint64_t v = a.operand;
      return rw(k, a.roff, &v, 8, true);
    }
    case Rma::acc: {
      // Fetch, combine, write back under the owner's lock.
      const auto dt = static_cast<abi::DType>(a.dtype);
      const size_t n = a.len / abi::dtype_size(dt);
      pthread_mutex_t* lk = nullptr;
      HCOMM_TRY(_node.lock_stripe(k.peer, k.h.slot, Deadline::after_ms(30000), &lk));
      Status st;
      if (k.mapped != nullptr) {
        abi::reduce(dt, static_cast<abi::RedOp>(a.redop), k.mapped + a.roff, a.local, n);
      } else {
        std::vector<uint8_t> tmp(a.len);
        st = rw(k, a.roff, tmp.data(), a.len, false);
        if (st) {
          abi::reduce(dt, static_cast<abi::RedOp>(a.redop), tmp.data(), a.local, n);
          st = rw(k, a.roff, tmp.data(), a.len, true);
        }
      }
      pthread_mutex_unlock(lk);
      return st;
    }
    case Rma::fetch_add:
    case Rma::cswap: {
      pthread_mutex_t* lk = nullptr;
      HCOMM_TRY(_node.lock_stripe(k.peer, k.h.slot, Deadline::after_ms(30000), &lk));
      uint64_t v = 0;
      Status st = rw(k, a.roff, &v, 8, false);
      if (st) {
        *a.old_value = v;
        uint64_t nv = a.op == Rma::fetch_add ? v + a.operand : (v == a.compare ? a.operand : v);
        if (nv != v) st = rw(k, a.roff, &nv, 8, true);
      }
      pthread_mutex_unlock(lk);
      return st;
    }
  }
  return Status::error(Code::invalid_argument, "cma: unknown operation");
}

}  // namespace hcomm::api
