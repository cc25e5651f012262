// C++ RAII wrappers over the C API (hcomm.h). Failures throw hcomm::Error,
// which carries the status and the library's detailed message.
#pragma once

#include <hcomm/hcomm.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace hcomm {

class Error : public std::runtime_error {
 public:
  Error(hcomm_status_t s, const std::string& what)
      : std::runtime_error(what + ": " + hcomm_strerror(s) + (*hcomm_last_error() ? std::string(" (") + hcomm_last_error() + ")" : "")),
        _status(s) {}
  hcomm_status_t status() const noexcept { return _status; }

 private:
  hcomm_status_t _status;
};

inline void check(hcomm_status_t s, const char* what) {
  if (s != HCOMM_OK) throw Error(s, what);
}

inline constexpr int kDefaultTimeoutMs = 60000;

// Handles made by a Context share its liveness flag: once the context is
// finalized their destructors do nothing (the C handles died with it), so
// destruction order and an explicit finalize() are both safe.
using Liveness = std::shared_ptr<bool>;

// One owned C handle; released unless its context is already gone.
template <typename H, void (*Release)(H*)>
class Handle {
 public:
  Handle() = default;
  Handle(H* h, Liveness alive) : _h(h), _alive(std::move(alive)) {}
  Handle(Handle&& o) noexcept : _h(std::exchange(o._h, nullptr)), _alive(std::move(o._alive)) {}
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      reset();
      _h = std::exchange(o._h, nullptr);
      _alive = std::move(o._alive);
    }
    return *this;
  }
  ~Handle() { reset(); }
  H* get() const { return _h; }
  // Gives up the C handle without releasing it (it was released elsewhere,
  // e.g. by hcomm_wait_all).
  H* release() noexcept { return std::exchange(_h, nullptr); }
  explicit operator bool() const noexcept { return _h != nullptr; }

 private:
  void reset() {
    if (_h != nullptr && _alive && *_alive) Release(_h);
    _h = nullptr;
  }
  H* _h = nullptr;
  Liveness _alive;
};

namespace detail {
inline void free_request(hcomm_request_t* r) { hcomm_request_free(r); }
inline void release_rkey(hcomm_rkey_t* k) { (void)hcomm_rkey_release(k); }
inline void release_mem(hcomm_mem_t* m) { (void)hcomm_mem_release(m); }
}  // namespace detail

class Request : public Handle<hcomm_request_t, detail::free_request> {
 public:
  using Handle::Handle;
  // true when done; throws on failure.
  bool test() {
    int done = 0;
    hcomm_status_t s = hcomm_test(get(), &done);
    if (s != HCOMM_OK && s != HCOMM_IN_PROGRESS) throw Error(s, "request");
    return done != 0;
  }
  void wait(int timeout_ms = kDefaultTimeoutMs) { check(hcomm_wait(get(), timeout_ms), "wait"); }
  // The cancel rule (hcomm.h): true when withdrawn, false when it ran to
  // its end; throws when it failed.
  bool cancel() {
    hcomm_status_t s = hcomm_request_cancel(get());
    if (s == HCOMM_ERR_CANCELLED) return true;
    check(s, "cancel");
    return false;
  }
  hcomm_recv_info_t recv_info() const {
    hcomm_recv_info_t i{};
    check(hcomm_request_recv_info(get(), &i), "recv_info");
    return i;
  }
};

// Waits for every request under one timeout (hcomm_wait_all). Each finished
// one is freed and left empty; throws on the first failure (its index in the
// message) or at the deadline, when the unfinished ones stay as they were.
// Empty requests are skipped.
inline void wait_all(std::vector<Request>& reqs, int timeout_ms = kDefaultTimeoutMs) {
  std::vector<hcomm_request_t*> raw(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) raw[i] = reqs[i].get();
  const hcomm_status_t s = hcomm_wait_all(raw.data(), raw.size(), nullptr, timeout_ms);
  for (size_t i = 0; i < reqs.size(); ++i)
    if (raw[i] == nullptr) (void)reqs[i].release();
  check(s, "wait_all");
}

class RemoteKey : public Handle<hcomm_rkey_t, detail::release_rkey> {
 public:
  using Handle::Handle;
  size_t size() const { return hcomm_rkey_size(get()); }
};

class Memory : public Handle<hcomm_mem_t, detail::release_mem> {
 public:
  using Handle::Handle;
  void* data() const { return hcomm_mem_ptr(get()); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data());
  }
  size_t size() const { return hcomm_mem_size(get()); }
  // The packed remote key, to ship to a peer.
  std::vector<uint8_t> rkey() const {
    std::vector<uint8_t> b(HCOMM_RKEY_MAX);
    size_t n = b.size();
    check(hcomm_mem_rkey_pack(get(), b.data(), &n), "rkey_pack");
    b.resize(n);
    return b;
  }
};

class Context {
 public:
  explicit Context(hcomm_engine_t engine = HCOMM_ENGINE_AUTO) {
    hcomm_config_t cfg;
    hcomm_config_init(&cfg);
    cfg.engine = engine;
    check(hcomm_init(&cfg, &_c), "init");
  }
  // Everything hcomm_config_t says: a job's key-value store (cfg.store,
  // with cfg.rank / cfg.size), the transports allowed, timeouts.
  explicit Context(const hcomm_config_t& cfg) { check(hcomm_init(&cfg, &_c), "init"); }
  ~Context() {
    *_alive = false;
    if (_c) hcomm_finalize(_c);
  }
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  // Collective; reports failures that the destructor would swallow.
  void finalize() {
    *_alive = false;
    hcomm_context_t* c = std::exchange(_c, nullptr);
    check(hcomm_finalize(c), "finalize");
  }

  int rank() const { return hcomm_rank(_c); }
  int size() const { return hcomm_size(_c); }
  const char* engine() const { return hcomm_engine_name(_c); }
  // What serves `peer`: "shm,cma", "verbs", ... (messaging transport first).
  std::string peer_transport(int peer) const {
    const char* t = hcomm_peer_transport(_c, peer);
    return t != nullptr ? t : "";
  }
  hcomm_context_t* get() const { return _c; }
  void barrier(int timeout_ms = kDefaultTimeoutMs) { check(hcomm_barrier(_c, timeout_ms), "barrier"); }

  Memory alloc(size_t bytes, unsigned kind = HCOMM_MEM_HOST, unsigned access = HCOMM_ACCESS_ALL) {
    hcomm_mem_t* m = nullptr;
    check(hcomm_mem_alloc(_c, bytes, kind, access, &m), "mem_alloc");
    return Memory(m, _alive);
  }
  Memory register_memory(void* p, size_t bytes, unsigned access = HCOMM_ACCESS_ALL) {
    hcomm_mem_t* m = nullptr;
    check(hcomm_mem_register(_c, p, bytes, access, &m), "mem_register");
    return Memory(m, _alive);
  }
  RemoteKey import_key(int peer, const std::vector<uint8_t>& blob) {
    hcomm_rkey_t* k = nullptr;
    check(hcomm_rkey_import(_c, peer, blob.data(), blob.size(), &k), "rkey_import");
    return RemoteKey(k, _alive);
  }

  void send(int dest, const void* buf, size_t len, uint64_t tag, int timeout_ms = kDefaultTimeoutMs) {
    check(hcomm_send(_c, dest, buf, len, tag, timeout_ms), "send");
  }
  hcomm_recv_info_t recv(int src, void* buf, size_t len, uint64_t tag, uint64_t mask = HCOMM_TAG_MASK_ALL,
                         int timeout_ms = kDefaultTimeoutMs) {
    hcomm_recv_info_t i{};
    check(hcomm_recv(_c, src, buf, len, tag, mask, &i, timeout_ms), "recv");
    return i;
  }
  Request isend(int dest, const void* buf, size_t len, uint64_t tag) {
    hcomm_request_t* r = nullptr;
    check(hcomm_isend(_c, dest, buf, len, tag, &r), "isend");
    return Request(r, _alive);
  }
  Request irecv(int src, void* buf, size_t len, uint64_t tag, uint64_t mask = HCOMM_TAG_MASK_ALL) {
    hcomm_request_t* r = nullptr;
    check(hcomm_irecv(_c, src, buf, len, tag, mask, &r), "irecv");
    return Request(r, _alive);
  }
  hcomm_recv_info_t sendrecv(int dest, const void* sbuf, size_t slen, uint64_t stag, int src, void* rbuf, size_t rlen,
                             uint64_t rtag, int timeout_ms = kDefaultTimeoutMs) {
    hcomm_recv_info_t i{};
    check(hcomm_sendrecv(_c, dest, sbuf, slen, stag, src, rbuf, rlen, rtag, HCOMM_TAG_MASK_ALL, &i, timeout_ms),
          "sendrecv");
    return i;
  }
  // Ships a remote key to `peer` (a small send) / receives one from `peer`.
  void send_key(int peer, const Memory& m, uint64_t tag) {
    auto b = m.rkey();
    send(peer, b.data(), b.size(), tag);
  }
  RemoteKey recv_key(int peer, uint64_t tag) {
    std::vector<uint8_t> b(HCOMM_RKEY_MAX);
    auto i = recv(peer, b.data(), b.size(), tag);
    b.resize(i.length);
    return import_key(peer, b);
  }

  void put(const void* local, size_t len, const RemoteKey& k, uint64_t off, int timeout_ms = kDefaultTimeoutMs) {
    check(hcomm_put(_c, local, len, k.get(), off, timeout_ms), "put");
  }
  void get(void* local, size_t len, const RemoteKey& k, uint64_t off, int timeout_ms = kDefaultTimeoutMs) {
    check(hcomm_get(_c, local, len, k.get(), off, timeout_ms), "get");
  }
  void accumulate(const void* local, size_t count, hcomm_dtype_t dt, hcomm_op_t op, const RemoteKey& k, uint64_t off,
                  int timeout_ms = kDefaultTimeoutMs) {
    check(hcomm_accumulate(_c, local, count, dt, op, k.get(), off, timeout_ms), "accumulate");
  }
  void put_notify(const void* local, size_t len, const RemoteKey& k, uint64_t off, const RemoteKey& nk,
                  uint64_t noff, uint64_t value, int timeout_ms = kDefaultTimeoutMs) {
    check(hcomm_put_notify(_c, local, len, k.get(), off, nk.get(), noff, value, timeout_ms), "put_notify");
  }
  void notify_wait(const Memory& m, uint64_t off, uint64_t value, int timeout_ms = kDefaultTimeoutMs) {
    check(hcomm_notify_wait(_c, m.get(), off, value, timeout_ms), "notify_wait");
  }
  uint64_t fetch_add(const RemoteKey& k, uint64_t off, uint64_t add, int timeout_ms = kDefaultTimeoutMs) {
    uint64_t old = 0;
    check(hcomm_fetch_add(_c, k.get(), off, add, &old, timeout_ms), "fetch_add");
    return old;
  }
  uint64_t compare_swap(const RemoteKey& k, uint64_t off, uint64_t cmp, uint64_t swap,
                        int timeout_ms = kDefaultTimeoutMs) {
    uint64_t old = 0;
    check(hcomm_compare_swap(_c, k.get(), off, cmp, swap, &old, timeout_ms), "compare_swap");
    return old;
  }
  // Implicit completion: complete at the target after the next flush() covering the peer.
  void put_nbi(const void* local, size_t len, const RemoteKey& k, uint64_t off) {
    check(hcomm_put_nbi(_c, local, len, k.get(), off), "put_nbi");
  }
  void get_nbi(void* local, size_t len, const RemoteKey& k, uint64_t off) {
    check(hcomm_get_nbi(_c, local, len, k.get(), off), "get_nbi");
  }
  void flush(int peer = -1, int timeout_ms = kDefaultTimeoutMs) { check(hcomm_flush(_c, peer, timeout_ms), "flush"); }
  void fence() { check(hcomm_fence(_c), "fence"); }

 private:
  hcomm_context_t* _c = nullptr;
  Liveness _alive = std::make_shared<bool>(true);
};

}  // namespace hcomm
