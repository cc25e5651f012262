// The C API: argument checks, locking, status mapping, last-error text.
#include <algorithm>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "api/core/context.h"
#include "api/transport/shm/shm.h"
#include "hal/abi/desc.h"
#include "hcomm_config.h"

using hcomm::Code;
using hcomm::Deadline;
using hcomm::Status;
using hcomm::api::Context;
using hcomm::api::Request;
using hcomm::api::to_hcomm;

namespace {

thread_local std::string g_last_error;

hcomm_status_t ret(const Status& st) {
  if (st) return HCOMM_OK;
  g_last_error = st.to_string();
  return to_hcomm(st.code());
}
hcomm_status_t fail(hcomm_status_t s, const char* what) {
  g_last_error = what;
  return s;
}
Deadline deadline_of(int timeout_ms) { return Deadline::after_ms(timeout_ms < 0 ? 0 : timeout_ms); }

#define CTX_OR_FAIL(c)                                                  \
  if ((c) == nullptr || !(c)->impl) return fail(HCOMM_ERR_INVALID, "null context"); \
  Context& ctx = *(c)->impl;                                            \
  std::unique_lock lock(ctx.mu())

// Request handles are recycled through a small per-thread cache, so that a
// stream of nonblocking calls allocates nothing once it runs (a handle holds
// no context state: freeing one stays safe after hcomm_finalize).
// A handle freed after this thread's cache was destroyed (from another
// thread_local's destructor, say) is deleted instead.
// Trivially destructible (a plain TLS access on every call); a reaper armed
// by the first cached handle deletes the cached ones at thread exit.
struct HandleCache {
  static constexpr size_t kMax = 256;
  hcomm_request* items[kMax];
  size_t n;
  bool armed;
  bool dead;
};
constinit thread_local HandleCache t_handles{};
struct HandleReaper {
  bool on = false;
  ~HandleReaper() {
    for (size_t i = 0; i < t_handles.n; ++i) delete t_handles.items[i];
    t_handles.n = 0;
    t_handles.dead = true;
  }
};
thread_local HandleReaper t_handle_reaper;

// What a nonblocking call that completed at once hands out (a one-sided call
// on a synchronous lane): one static, completed handle shared by all of them,
// so that the call allocates nothing and counts no reference. hcomm_wait,
// test, cancel and free know it; freeing it (any number of times) is a no-op.
hcomm_request g_done_handle;

hcomm_status_t new_request(Context& ctx, std::shared_ptr<Request> r, hcomm_request_t** out) {
  hcomm_request* h = nullptr;
  if (!t_handles.dead && t_handles.n > 0) {
    h = t_handles.items[--t_handles.n];
    h->ctx = &ctx;
    h->r = std::move(r);
  } else {
    h = new (std::nothrow) hcomm_request{&ctx, std::move(r)};
    if (h == nullptr) return fail(HCOMM_ERR_NO_RESOURCE, "out of memory");
  }
  *out = h;
  return HCOMM_OK;
}

// Drops a live handle (not the completed one) into this thread's cache.
// The context keeps its own reference while the operation runs: freeing a
// pending request only drops the user's handle (an atomic count; no context
// access, so this is safe even after hcomm_finalize).
void release_handle(hcomm_request* req) {
  req->r.reset();
  req->ctx = nullptr;
  if (!t_handles.dead && t_handles.n < HandleCache::kMax) {
    if (!t_handles.armed) {
      t_handle_reaper.on = true;  // constructs it: its destructor runs at thread exit
      t_handles.armed = true;
    }
    t_handles.items[t_handles.n++] = req;
  } else {
    delete req;
  }
}

// The status a finished request hands back to its caller.
hcomm_status_t finished(const Request& r) {
  if (r.status != HCOMM_OK) g_last_error = r.why();
  return r.status;
}

// A blocking call whose timeout passed keeps the cancel rule: its operation
// is withdrawn (HCOMM_ERR_TIMEOUT), or it ran to its end meanwhile (that
// status), before the call returns.
hcomm_status_t timed_out(Context& ctx, const std::shared_ptr<Request>& r, int timeout_ms) {
  ctx.cancel(r);
  if (r->status != HCOMM_ERR_CANCELLED) return finished(*r);
  g_last_error = "timed out after " + std::to_string(timeout_ms) + " ms; the operation was withdrawn (" + r->error + ")";
  return HCOMM_ERR_TIMEOUT;
}

// Blocking form = nonblocking form + wait.
hcomm_status_t run_blocking(Context& ctx, const Status& posted, const std::shared_ptr<Request>& r, int timeout_ms) {
  if (!posted) return ret(posted);
  if (r->done()) return finished(*r);  // done in the call: no deadline, no clock read
  Status w = ctx.wait(*r, deadline_of(timeout_ms));
  if (!w) return timed_out(ctx, r, timeout_ms);
  return finished(*r);
}

}  // namespace

// Argument bundles of the one-sided calls (C++ types: outside extern "C").
namespace {
Context::RmaArgs put_args(const void* local, size_t len, hcomm_rkey_t* rkey, uint64_t off) {
  Context::RmaArgs a;
  a.op = hcomm::api::Rma::put;
  a.local = static_cast<uint8_t*>(const_cast<void*>(local));
  a.len = len;
  a.rkey = rkey;
  a.roff = off;
  return a;
}
Context::RmaArgs get_args(void* local, size_t len, hcomm_rkey_t* rkey, uint64_t off) {
  Context::RmaArgs a = put_args(local, len, rkey, off);
  a.op = hcomm::api::Rma::get;
  return a;
}
Context::RmaArgs acc_args(const void* local, size_t count, hcomm_dtype_t dt, hcomm_op_t op, hcomm_rkey_t* rkey,
                          uint64_t off, bool* ok) {
  size_t es = hcomm_dtype_size(dt);
  *ok = es != 0 && count <= SIZE_MAX / es;
  Context::RmaArgs a = put_args(local, count * (es ? es : 1), rkey, off);
  a.op = hcomm::api::Rma::acc;
  a.dtype = dt;
  a.redop = op;
  return a;
}
Context::RmaArgs notify_args(const void* local, size_t len, hcomm_rkey_t* rkey, uint64_t off, hcomm_rkey_t* nk,
                             uint64_t noff, uint64_t value) {
  Context::RmaArgs a = put_args(local, len, rkey, off);
  if (nk == nullptr) nk = reinterpret_cast<hcomm_rkey_t*>(1);  // rejected below as a bad key
  a.notify_rkey = nk;
  a.notify_off = noff;
  a.notify_value = value;
  return a;
}
Context::RmaArgs atomic_args(hcomm::api::Rma op, hcomm_rkey_t* rkey, uint64_t off, uint64_t operand, uint64_t compare,
                             uint64_t* old) {
  Context::RmaArgs a;
  a.op = op;
  a.rkey = rkey;
  a.roff = off;
  a.operand = operand;
  a.compare = compare;
  a.old_value = old;
  return a;
}

// The one-sided fast path: a call whose lanes are synchronous (shm, cma)
// runs without the context lock (Context::rma_unlocked) unless a fence is
// pending; a nonblocking one then hands out the completed handle. On a key
// whose lanes are shm the CPU does the operation right here (no virtual
// call, no Status).
[[gnu::always_inline]] inline hcomm_status_t rma_unlocked(Context& ctx, Context::RmaArgs& a) {
  {
    // From before the generation check to the last byte (AccessMark); the
    // fast checks take no lock.
    // One thread-local address per call (a TLS descriptor call each time
    // otherwise: GCC recomputes it on each path that uses it).
    hcomm::api::ThreadCache* tc = &hcomm::api::t_cache;
    asm("" : "+r"(tc));
    const hcomm::api::AccessMark mark = hcomm::api::key_mark(a.rkey, *tc);
    if (ctx.rma_fast_checks(a, *tc)) {
      if (uint8_t* t = a.rkey->direct; t != nullptr && hcomm::api::cpu_rma(t + a.roff, a)) return HCOMM_OK;
      const bool atomic = a.op == hcomm::api::Rma::fetch_add || a.op == hcomm::api::Rma::cswap;
      return ret((atomic ? a.rkey->alane : a.rkey->lane)->rma(a, nullptr));
    }
  }
  return ret(ctx.rma_unlocked(a));  // checks again, words the error; fills the lookup cache
}
[[gnu::always_inline]] inline hcomm_status_t rma_blocking(hcomm_context_t* c, Context::RmaArgs& a, int timeout_ms) {
  if (c == nullptr || !c->impl) return fail(HCOMM_ERR_INVALID, "null context");
  Context& ctx = *c->impl;
  if (a.notify_rkey == reinterpret_cast<hcomm_rkey_t*>(1)) return fail(HCOMM_ERR_INVALID, "null notify key");
  if (ctx.rma_sync(a) && !ctx.fence_pending()) return rma_unlocked(ctx, a);
  std::unique_lock lock(ctx.mu());
  std::shared_ptr<Request> r;
  Status st = ctx.rma(a, &r);
  if (!st || r == nullptr) return ret(st);  // failed, or complete on return
  return run_blocking(ctx, st, r, timeout_ms);
}
[[gnu::always_inline]] inline hcomm_status_t rma_nb(hcomm_context_t* c, Context::RmaArgs& a, hcomm_request_t** req) {
  if (c == nullptr || !c->impl) return fail(HCOMM_ERR_INVALID, "null context");
  Context& ctx = *c->impl;
  if (req == nullptr) return fail(HCOMM_ERR_INVALID, "null request pointer");
  if (a.notify_rkey == reinterpret_cast<hcomm_rkey_t*>(1)) return fail(HCOMM_ERR_INVALID, "null notify key");
  if (ctx.rma_sync(a) && !ctx.fence_pending()) {
    hcomm_status_t st = rma_unlocked(ctx, a);
    if (st != HCOMM_OK) return st;
    *req = &g_done_handle;
    return HCOMM_OK;
  }
  std::unique_lock lock(ctx.mu());
  std::shared_ptr<Request> r;
  Status st = ctx.rma(a, &r);
  if (!st) return ret(st);
  if (r == nullptr) {
    *req = &g_done_handle;
    return HCOMM_OK;
  }
  return new_request(ctx, std::move(r), req);
}
// Implicit completion: no request for the caller; an asynchronous lane's
// request is kept by the context until a flush covers it.
hcomm_status_t rma_nbi(hcomm_context_t* c, Context::RmaArgs& a) {
  if (c == nullptr || !c->impl) return fail(HCOMM_ERR_INVALID, "null context");
  Context& ctx = *c->impl;
  if (ctx.rma_sync(a) && !ctx.fence_pending()) return rma_unlocked(ctx, a);
  std::unique_lock lock(ctx.mu());
  std::shared_ptr<Request> r;
  a.implicit = true;
  Status st = ctx.rma(a, &r);
  if (!st) return ret(st);
  if (r != nullptr) ctx.keep_implicit(std::move(r));
  return HCOMM_OK;
}
}  // namespace

extern "C" {

uint32_t hcomm_api_version(void) { return HCOMM_API_VERSION; }

const char* hcomm_strerror(hcomm_status_t s) {
  switch (s) {
    case HCOMM_OK: return "success";
    case HCOMM_IN_PROGRESS: return "in progress";
    case HCOMM_ERR_NO_RESOURCE: return "out of resources";
    case HCOMM_ERR_INVALID: return "invalid argument";
    case HCOMM_ERR_NOT_FOUND: return "not found";
    case HCOMM_ERR_IO: return "I/O error";
    case HCOMM_ERR_PROTOCOL: return "protocol error";
    case HCOMM_ERR_TIMEOUT: return "timed out";
    case HCOMM_ERR_DEVICE: return "device error";
    case HCOMM_ERR_ACCESS: return "access denied (remote key)";
    case HCOMM_ERR_OUT_OF_RANGE: return "out of range";
    case HCOMM_ERR_UNSUPPORTED: return "unsupported";
    case HCOMM_ERR_PEER_FAILURE: return "peer failure";
    case HCOMM_ERR_CLOSED: return "closed";
    case HCOMM_ERR_TRUNCATED: return "message truncated";
    case HCOMM_ERR_CANCELLED: return "cancelled";
  }
  return "unknown status";
}

const char* hcomm_last_error(void) { return g_last_error.c_str(); }

void hcomm_config_init(hcomm_config_t* c) {
  if (c == nullptr) return;
  std::memset(c, 0, sizeof *c);
  c->struct_size = sizeof *c;
  c->engine = HCOMM_ENGINE_AUTO;
  c->bootstrap_timeout_ms = 30000;
  c->device = nullptr;
  c->peer_check_ms = 1;
  c->rank = -1;
  c->size = 0;
  c->local_rank = -1;
  c->store = nullptr;
  c->job_id = nullptr;
  c->transports = nullptr;
}

hcomm_status_t hcomm_init(const hcomm_config_t* config, hcomm_context_t** out) {
  if (out == nullptr) return fail(HCOMM_ERR_INVALID, "null context pointer");
  hcomm_config_t cfg;
  hcomm_config_init(&cfg);
  if (config != nullptr) {
    if (config->struct_size < sizeof(size_t) || config->struct_size > sizeof cfg)
      return fail(HCOMM_ERR_INVALID, "hcomm_config_t.struct_size is not sizeof(hcomm_config_t)");
    std::memcpy(&cfg, config, config->struct_size);
  }
  if (cfg.engine < HCOMM_ENGINE_AUTO || cfg.engine > HCOMM_ENGINE_NPU) return fail(HCOMM_ERR_INVALID, "unknown engine");
  std::unique_ptr<Context> impl;
  Status st = Context::create(cfg, &impl);
  if (!st) return ret(st);
  *out = new hcomm_context{std::move(impl)};
  return HCOMM_OK;
}

hcomm_status_t hcomm_finalize(hcomm_context_t* c) {
  if (c == nullptr || !c->impl) return fail(HCOMM_ERR_INVALID, "null context");
  Status st;
  {
    std::unique_lock lock(c->impl->mu());
    st = c->impl->finalize(Deadline::after_ms(30000));
  }
  delete c;
  return ret(st);
}

int hcomm_rank(const hcomm_context_t* c) { return c != nullptr && c->impl ? c->impl->rank() : -1; }
int hcomm_size(const hcomm_context_t* c) { return c != nullptr && c->impl ? c->impl->size() : -1; }
const char* hcomm_engine_name(const hcomm_context_t* c) {
  return c != nullptr && c->impl ? c->impl->engine_name() : "none";
}

const char* hcomm_peer_transport(const hcomm_context_t* c, int peer) {
  return c != nullptr && c->impl ? c->impl->peer_transport(peer) : nullptr;
}

hcomm_status_t hcomm_barrier(hcomm_context_t* c, int timeout_ms) {
  CTX_OR_FAIL(c);
  return ret(ctx.barrier(deadline_of(timeout_ms)));
}

hcomm_status_t hcomm_progress(hcomm_context_t* c) {
  CTX_OR_FAIL(c);
  ctx.progress();
  return HCOMM_OK;
}

size_t hcomm_dtype_size(hcomm_dtype_t t) {
  return t >= HCOMM_INT8 && t <= HCOMM_FP64 ? hcomm::hal::abi::dtype_size(static_cast<hcomm::hal::abi::DType>(t)) : 0;
}

// ---- memory ----

hcomm_status_t hcomm_mem_alloc(hcomm_context_t* c, size_t size, unsigned kind, unsigned access, hcomm_mem_t** mem) {
  CTX_OR_FAIL(c);
  return ret(ctx.mem_alloc(size, kind, access, mem));
}

hcomm_status_t hcomm_mem_register(hcomm_context_t* c, void* addr, size_t size, unsigned access, hcomm_mem_t** mem) {
  CTX_OR_FAIL(c);
  return ret(ctx.mem_register(addr, size, access, mem));
}

hcomm_status_t hcomm_mem_release(hcomm_mem_t* mem) {
  if (mem == nullptr || mem->ctx == nullptr) return fail(HCOMM_ERR_INVALID, "null memory handle");
  Context& ctx = *mem->ctx;
  std::unique_lock lock(ctx.mu());
  return ret(ctx.mem_release(mem));
}

void* hcomm_mem_ptr(const hcomm_mem_t* mem) { return mem != nullptr ? mem->ptr : nullptr; }
size_t hcomm_mem_size(const hcomm_mem_t* mem) { return mem != nullptr ? mem->size : 0; }

hcomm_status_t hcomm_mem_rkey_pack(const hcomm_mem_t* mem, void* buf, size_t* len) {
  if (mem == nullptr || mem->ctx == nullptr) return fail(HCOMM_ERR_INVALID, "null memory handle");
  Context& ctx = *mem->ctx;
  std::unique_lock lock(ctx.mu());
  return ret(ctx.rkey_pack(mem, buf, len));
}

hcomm_status_t hcomm_rkey_import(hcomm_context_t* c, int peer, const void* buf, size_t len, hcomm_rkey_t** rkey) {
  CTX_OR_FAIL(c);
  return ret(ctx.rkey_import(peer, buf, len, rkey));
}

size_t hcomm_rkey_size(const hcomm_rkey_t* k) { return k != nullptr ? k->h.size : 0; }

hcomm_status_t hcomm_rkey_release(hcomm_rkey_t* k) {
  if (k == nullptr || k->ctx == nullptr) return fail(HCOMM_ERR_INVALID, "null remote key");
  Context& ctx = *k->ctx;
  std::unique_lock lock(ctx.mu());
  return ret(ctx.rkey_release(k));
}

// ---- requests ----

hcomm_status_t hcomm_test(hcomm_request_t* req, int* done) {
  if (req == &g_done_handle && done != nullptr) {
    *done = 1;
    return HCOMM_OK;
  }
  if (req == nullptr || !req->r || done == nullptr) return fail(HCOMM_ERR_INVALID, "null request or done pointer");
  if (req->r->settled.load(std::memory_order_acquire)) {  // finished: no lock
    *done = 1;
    return finished(*req->r);
  }
  std::unique_lock lock(req->ctx->mu());
  if (!req->r->done()) req->ctx->progress();
  *done = req->r->done() ? 1 : 0;
  if (!*done) return HCOMM_IN_PROGRESS;
  if (req->r->status != HCOMM_OK) g_last_error = req->r->error;
  return req->r->status;
}

hcomm_status_t hcomm_wait(hcomm_request_t* req, int timeout_ms) {
  if (req == &g_done_handle) return HCOMM_OK;
  if (req == nullptr || !req->r) return fail(HCOMM_ERR_INVALID, "null request");
  if (req->r->settled.load(std::memory_order_acquire)) return finished(*req->r);  // no lock, no clock
  std::unique_lock lock(req->ctx->mu());
  Status st = req->ctx->wait(*req->r, deadline_of(timeout_ms));
  if (!st) return ret(st);
  if (req->r->status != HCOMM_OK) g_last_error = req->r->error;
  return req->r->status;
}

hcomm_status_t hcomm_request_cancel(hcomm_request_t* req) {
  if (req == &g_done_handle) return HCOMM_OK;  // completed: nothing to withdraw
  if (req == nullptr || !req->r) return fail(HCOMM_ERR_INVALID, "null request");
  std::unique_lock lock(req->ctx->mu());
  req->ctx->cancel(req->r);
  return finished(*req->r);
}

void hcomm_request_free(hcomm_request_t* req) {
  if (req == nullptr || req == &g_done_handle) return;
  if (req->ctx == nullptr) return;  // already freed (and cached): a second free must not cache it twice
  release_handle(req);
}

hcomm_status_t hcomm_wait_all(hcomm_request_t** reqs, size_t count, hcomm_status_t* statuses, int timeout_ms) {
  if (count == 0) return HCOMM_OK;
  if (reqs == nullptr) return fail(HCOMM_ERR_INVALID, "null request array");
  auto live = [](const hcomm_request_t* q) { return q != nullptr && q != &g_done_handle; };
  // Every handle is checked before any is waited for or freed: a freed one,
  // or one listed twice (it would be freed twice), refuses the whole call.
  size_t bad = count, first_live = count;
  std::string why;
  for (size_t i = 0; i < count && bad == count; ++i) {
    hcomm_request_t* q = reqs[i];
    if (!live(q)) continue;
    if (first_live == count) first_live = i;
    if (q->ctx == nullptr || !q->r) {
      bad = i;
      why = " is not a live request";
    } else if (q->listed) {
      bad = i;
      why = " appears twice in the array";
    } else {
      q->listed = true;
    }
  }
  if (first_live == count) {  // all complete on return (synchronous lanes): nothing to wait for
    std::fill_n(reqs, count, nullptr);
    if (statuses != nullptr) std::fill_n(statuses, count, HCOMM_OK);
    return HCOMM_OK;
  }
  for (size_t i = first_live; i < count; ++i)
    if (live(reqs[i]) && reqs[i]->ctx != nullptr) reqs[i]->listed = false;
  if (bad != count) {
    g_last_error = "request " + std::to_string(bad) + " of " + std::to_string(count) + why;
    return HCOMM_ERR_INVALID;
  }
  // One deadline for the whole set. Waits in order (every one has to
  // finish); once the deadline passed, the rest are only looked at.
  const Deadline dl = deadline_of(timeout_ms);
  bool late = false;
  hcomm_status_t first = HCOMM_OK;
  std::string first_error;
  for (size_t i = 0; i < count; ++i) {
    hcomm_request_t* q = reqs[i];
    hcomm_status_t s = HCOMM_OK;
    if (live(q)) {
      Request& r = *q->r;
      if (!r.settled.load(std::memory_order_acquire)) {  // finished: no lock
        std::unique_lock lock(q->ctx->mu());
        if (!r.done()) {
          if (late) q->ctx->progress();
          else late = !q->ctx->wait(r, dl);
        }
        if (!r.done()) {
          if (statuses != nullptr) statuses[i] = HCOMM_IN_PROGRESS;
          continue;  // stays the caller's, pending
        }
      }
      s = r.status;
      if (s != HCOMM_OK && first == HCOMM_OK) {
        first = s;
        first_error = "request " + std::to_string(i) + ": " + r.why();
      }
      release_handle(q);
    }
    reqs[i] = nullptr;
    if (statuses != nullptr) statuses[i] = s;
  }
  if (late) {
    g_last_error = "requests still in progress after " + std::to_string(timeout_ms) +
                   " ms (left in the array; the finished ones were freed)";
    return HCOMM_ERR_TIMEOUT;
  }
  if (first != HCOMM_OK) g_last_error = first_error;
  return first;
}

hcomm_status_t hcomm_request_recv_info(const hcomm_request_t* req, hcomm_recv_info_t* info) {
  if (req == &g_done_handle) return fail(HCOMM_ERR_INVALID, "not a receive request");
  if (req == nullptr || !req->r || info == nullptr) return fail(HCOMM_ERR_INVALID, "null request or info");
  if (req->r->kind != Request::Kind::recv) return fail(HCOMM_ERR_INVALID, "not a receive request");
  std::unique_lock lock(req->ctx->mu());
  if (!req->r->done()) return HCOMM_IN_PROGRESS;
  *info = req->r->info;
  return HCOMM_OK;
}

// ---- one-sided ----


hcomm_status_t hcomm_put(hcomm_context_t* c, const void* local, size_t len, hcomm_rkey_t* rkey, uint64_t off,
                         int timeout_ms) {
  Context::RmaArgs a = put_args(local, len, rkey, off);
  return rma_blocking(c, a, timeout_ms);
}
hcomm_status_t hcomm_get(hcomm_context_t* c, void* local, size_t len, hcomm_rkey_t* rkey, uint64_t off,
                         int timeout_ms) {
  Context::RmaArgs a = get_args(local, len, rkey, off);
  return rma_blocking(c, a, timeout_ms);
}
hcomm_status_t hcomm_accumulate(hcomm_context_t* c, const void* local, size_t count, hcomm_dtype_t dt, hcomm_op_t op,
                                hcomm_rkey_t* rkey, uint64_t off, int timeout_ms) {
  bool ok;
  Context::RmaArgs a = acc_args(local, count, dt, op, rkey, off, &ok);
  if (!ok) return fail(HCOMM_ERR_INVALID, "unknown dtype or count overflow");
  return rma_blocking(c, a, timeout_ms);
}
hcomm_status_t hcomm_put_notify(hcomm_context_t* c, const void* local, size_t len, hcomm_rkey_t* rkey, uint64_t off,
                                hcomm_rkey_t* nk, uint64_t noff, uint64_t value, int timeout_ms) {
  Context::RmaArgs a = notify_args(local, len, rkey, off, nk, noff, value);
  return rma_blocking(c, a, timeout_ms);
}
hcomm_status_t hcomm_fetch_add(hcomm_context_t* c, hcomm_rkey_t* rkey, uint64_t off, uint64_t add, uint64_t* old,
                               int timeout_ms) {
  Context::RmaArgs a = atomic_args(hcomm::api::Rma::fetch_add, rkey, off, add, 0, old);
  return rma_blocking(c, a, timeout_ms);
}
hcomm_status_t hcomm_compare_swap(hcomm_context_t* c, hcomm_rkey_t* rkey, uint64_t off, uint64_t compare,
                                  uint64_t swap, uint64_t* old, int timeout_ms) {
  Context::RmaArgs a = atomic_args(hcomm::api::Rma::cswap, rkey, off, swap, compare, old);
  return rma_blocking(c, a, timeout_ms);
}
hcomm_status_t hcomm_put_nbi(hcomm_context_t* c, const void* local, size_t len, hcomm_rkey_t* rkey, uint64_t off) {
  Context::RmaArgs a = put_args(local, len, rkey, off);
  return rma_nbi(c, a);
}
hcomm_status_t hcomm_get_nbi(hcomm_context_t* c, void* local, size_t len, hcomm_rkey_t* rkey, uint64_t off) {
  Context::RmaArgs a = get_args(local, len, rkey, off);
  return rma_nbi(c, a);
}
hcomm_status_t hcomm_iput(hcomm_context_t* c, const void* local, size_t len, hcomm_rkey_t* rkey, uint64_t off,
                          hcomm_request_t** req) {
  Context::RmaArgs a = put_args(local, len, rkey, off);
  return rma_nb(c, a, req);
}
hcomm_status_t hcomm_iget(hcomm_context_t* c, void* local, size_t len, hcomm_rkey_t* rkey, uint64_t off,
                          hcomm_request_t** req) {
  Context::RmaArgs a = get_args(local, len, rkey, off);
  return rma_nb(c, a, req);
}
hcomm_status_t hcomm_iaccumulate(hcomm_context_t* c, const void* local, size_t count, hcomm_dtype_t dt, hcomm_op_t op,
                                 hcomm_rkey_t* rkey, uint64_t off, hcomm_request_t** req) {
  bool ok;
  Context::RmaArgs a = acc_args(local, count, dt, op, rkey, off, &ok);
  if (!ok) return fail(HCOMM_ERR_INVALID, "unknown dtype or count overflow");
  return rma_nb(c, a, req);
}
hcomm_status_t hcomm_iput_notify(hcomm_context_t* c, const void* local, size_t len, hcomm_rkey_t* rkey, uint64_t off,
                                 hcomm_rkey_t* nk, uint64_t noff, uint64_t value, hcomm_request_t** req) {
  Context::RmaArgs a = notify_args(local, len, rkey, off, nk, noff, value);
  return rma_nb(c, a, req);
}
hcomm_status_t hcomm_ifetch_add(hcomm_context_t* c, hcomm_rkey_t* rkey, uint64_t off, uint64_t add, uint64_t* old,
                                hcomm_request_t** req) {
  Context::RmaArgs a = atomic_args(hcomm::api::Rma::fetch_add, rkey, off, add, 0, old);
  return rma_nb(c, a, req);
}
hcomm_status_t hcomm_icompare_swap(hcomm_context_t* c, hcomm_rkey_t* rkey, uint64_t off, uint64_t compare,
                                   uint64_t swap, uint64_t* old, hcomm_request_t** req) {
  Context::RmaArgs a = atomic_args(hcomm::api::Rma::cswap, rkey, off, swap, compare, old);
  return rma_nb(c, a, req);
}

hcomm_status_t hcomm_notify_wait(hcomm_context_t* c, hcomm_mem_t* mem, uint64_t off, uint64_t value, int timeout_ms) {
  CTX_OR_FAIL(c);
  return ret(ctx.notify_wait(mem, off, value, deadline_of(timeout_ms)));
}

hcomm_status_t hcomm_flush(hcomm_context_t* c, int peer, int timeout_ms) {
  if (c != nullptr && c->impl && c->impl->flush_trivial(peer)) return HCOMM_OK;  // no lock
  CTX_OR_FAIL(c);
  return ret(ctx.flush(peer, deadline_of(timeout_ms)));
}

hcomm_status_t hcomm_fence(hcomm_context_t* c) {
  CTX_OR_FAIL(c);
  ctx.fence();
  return HCOMM_OK;
}

// ---- two-sided ----

hcomm_status_t hcomm_isend(hcomm_context_t* c, int dest, const void* buf, size_t len, uint64_t tag,
                           hcomm_request_t** req) {
  if (c != nullptr && c->impl && req != nullptr && c->impl->isend_unlocked(dest, buf, len, tag)) {
    *req = &g_done_handle;  // an eager message the lane took, without the lock
    return HCOMM_OK;
  }
  CTX_OR_FAIL(c);
  if (req == nullptr) return fail(HCOMM_ERR_INVALID, "null request pointer");
  std::shared_ptr<Request> r;
  Status st = ctx.isend(dest, buf, len, tag, &r);
  if (!st) return ret(st);
  if (r == nullptr) {
    *req = &g_done_handle;  // complete in the call
    return HCOMM_OK;
  }
  return new_request(ctx, std::move(r), req);
}

hcomm_status_t hcomm_irecv(hcomm_context_t* c, int source, void* buf, size_t len, uint64_t tag, uint64_t mask,
                           hcomm_request_t** req) {
  CTX_OR_FAIL(c);
  if (req == nullptr) return fail(HCOMM_ERR_INVALID, "null request pointer");
  std::shared_ptr<Request> r;
  Status st = ctx.irecv(source, buf, len, tag, mask, &r);
  if (!st) return ret(st);
  return new_request(ctx, std::move(r), req);
}

hcomm_status_t hcomm_send(hcomm_context_t* c, int dest, const void* buf, size_t len, uint64_t tag, int timeout_ms) {
  if (c != nullptr && c->impl && c->impl->isend_unlocked(dest, buf, len, tag)) return HCOMM_OK;
  CTX_OR_FAIL(c);
  std::shared_ptr<Request> r;
  Status st = ctx.isend(dest, buf, len, tag, &r);
  if (st && r == nullptr) return HCOMM_OK;  // complete in the call
  return run_blocking(ctx, st, r, timeout_ms);
}

hcomm_status_t hcomm_recv(hcomm_context_t* c, int source, void* buf, size_t len, uint64_t tag, uint64_t mask,
                          hcomm_recv_info_t* info, int timeout_ms) {
  CTX_OR_FAIL(c);
  std::shared_ptr<Request> r;
  Status st = ctx.irecv(source, buf, len, tag, mask, &r);
  hcomm_status_t s = run_blocking(ctx, st, r, timeout_ms);
  if (info != nullptr && r && r->done()) *info = r->info;
  return s;
}

hcomm_status_t hcomm_probe(hcomm_context_t* c, int source, uint64_t tag, uint64_t mask, int* found,
                           hcomm_recv_info_t* info) {
  CTX_OR_FAIL(c);
  if (found == nullptr) return fail(HCOMM_ERR_INVALID, "null found pointer");
  bool f = false;
  Status st = ctx.probe(source, tag, mask, &f, info);
  *found = f ? 1 : 0;
  return ret(st);
}

hcomm_status_t hcomm_sendrecv(hcomm_context_t* c, int dest, const void* sbuf, size_t slen, uint64_t stag, int source,
                              void* rbuf, size_t rlen, uint64_t rtag, uint64_t rmask, hcomm_recv_info_t* info,
                              int timeout_ms) {
  CTX_OR_FAIL(c);
  Deadline dl = deadline_of(timeout_ms);
  // Receive first, then send, then wait for both: no ordering between ranks
  // can make this block.
  std::shared_ptr<Request> rr, sr;
  Status st = ctx.irecv(source, rbuf, rlen, rtag, rmask, &rr);
  if (!st) return ret(st);
  st = ctx.isend(dest, sbuf, slen, stag, &sr);
  if (!st) {
    ctx.cancel(rr);  // the cancel rule: the receive half is withdrawn (or ran to its end) before we return
    return ret(st);
  }
  if (sr != nullptr) st = ctx.wait(*sr, dl);  // (none: the send completed in the call)
  if (st) st = ctx.wait(*rr, dl);
  if (!st) {
    // Past the timeout: both halves keep the cancel rule.
    hcomm_status_t s1 = sr == nullptr ? HCOMM_OK : sr->done() ? finished(*sr) : timed_out(ctx, sr, timeout_ms);
    hcomm_status_t s2 = rr->done() ? finished(*rr) : timed_out(ctx, rr, timeout_ms);
    if (info != nullptr && rr->status == HCOMM_OK) *info = rr->info;
    return s1 != HCOMM_OK ? s1 : s2;
  }
  if (info != nullptr) *info = rr->info;
  if (sr != nullptr && sr->status != HCOMM_OK) {
    g_last_error = sr->error;
    return sr->status;
  }
  if (rr->status != HCOMM_OK) g_last_error = rr->error;
  return rr->status;
}

}  // extern "C"
