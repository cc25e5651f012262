// The context: what the user asked for, above the transport seam.
//
// It owns the bootstrap, the peers (liveness, the per-peer control socket of
// api/wireup/mesh.h), the transports opened for this job, the registrations
// and the requests. Per peer it picks a messaging lane and RMA lanes
// (api/transport/transport.h); the protocols, written once over that seam,
// are in api/proto (tag matching, eager and rendezvous: tag.cpp; one-sided:
// rma.cpp) and api/mem (registrations and packed keys: memory.cpp).
#pragma once

#include <poll.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "api/core/pool.h"
#include "api/include/hcomm/hcomm.h"
#include "api/mem/memory.h"
#include "api/transport/transport.h"
#include "api/wireup/bootstrap.h"
#include "api/wireup/mesh_wire.h"
#include "common/fd.h"
#include "common/status.h"
#include "common/time.h"

namespace hcomm::api {

class ShmTransport;
class NpuTransport;

hcomm_status_t to_hcomm(Code c);
Code from_hcomm(hcomm_status_t s);

// Rendezvous claim words (api/proto/tag.cpp): how many rendezvous sends a
// rank may have in flight, and what a word holds: the send's request id and
// its state.
inline constexpr uint32_t kClaimWords = 4096;
enum : uint64_t { kExposed = 1, kClaimed = 2, kRetracted = 3 };
// How many compare-swaps a receive sends for one claim whose word answers
// something that is none of the three states of that message.
inline constexpr unsigned kClaimAsks = 8;
// How long a cancel waits, past its bound, for a lane that finishes alone
// to end what it holds (Context::cancel).
inline constexpr int kFinishAloneMs = 60000;
constexpr uint64_t claim_token(uint64_t sreq, uint64_t state) { return (sreq << 2) | state; }
// The state a claim word's value gives message sreq (kExposed, kClaimed,
// kRetracted), or 0 when the value is none of that message's tokens.
constexpr uint64_t claim_state(uint64_t word, uint64_t sreq) { return (word >> 2) == sreq ? (word & 3) : 0; }

// ---- requests ---------------------------------------------------------------------------
struct Request {
  // User-provided (members keep their defaults): GCC stores the fields one
  // by one instead of clearing the whole object with `rep stos` (a third of
  // a small receive's time).
  Request() noexcept {}  // NOLINT(modernize-use-equals-default)
  enum class Kind { send, recv, rma };
  Kind kind = Kind::rma;
  hcomm_status_t status = HCOMM_IN_PROGRESS;
  std::string error;  // detail for a failure
  int peer = -1;
  uint64_t id = 0;
  // send
  const uint8_t* sbuf = nullptr;
  size_t slen = 0;
  uint64_t tag = 0;
  // recv
  uint8_t* rbuf = nullptr;
  size_t rlen = 0;
  uint64_t tag_mask = 0;
  hcomm_recv_info_t info{-1, 0, 0};
  // rma on an asynchronous lane: operations still outstanding; fetch result
  uint32_t outstanding = 0;
  uint64_t* result_out = nullptr;
  uint32_t result_slot = UINT32_MAX;
  // A lane that finishes alone (Transport::finishes_alone: the NPU's DMA
  // queue) holds its work: a cancel waits for that lane (see Context::cancel).
  const Transport* held_by = nullptr;
  // A fetch result kept with the request, for a caller whose frame may end
  // first (cancel_send's retraction: the lane writes it at completion).
  uint64_t fetched = 0;
  // rendezvous send: what the messaging lane exposed for the receiver's read
  void* exposed = nullptr;
  Transport* exposed_by = nullptr;
  uint32_t exposed_rkey = 0;
  uint64_t exposed_addr = 0;  // where the receiver reads (the lane may give another address than sbuf)
  uint32_t claim = UINT32_MAX;  // rendezvous send: index of its claim word (api/proto/tag.cpp)
  // receive: matched a rendezvous and waiting for the claim on the sender's
  // word to resolve; it keeps its place among the posted receives meanwhile
  bool claiming = false;
  // Set (release) once status and error are final: hcomm_wait / hcomm_test
  // read a finished request without the context lock.
  std::atomic<bool> settled{false};
  bool done() const { return status != HCOMM_IN_PROGRESS; }
  // What a failed request says: its detail, or its status's text.
  std::string why() const { return error.empty() ? hcomm_strerror(status) : error; }
  void complete(hcomm_status_t st) {  // error stays empty
    if (done()) return;
    status = st;
    settled.store(true, std::memory_order_release);
  }
  void complete(hcomm_status_t st, const std::string& why) {
    if (done()) return;
    status = st;
    error = why;
    settled.store(true, std::memory_order_release);
  }
};

// Requests come from the per-thread block caches (api/core/pool.h).
inline std::shared_ptr<Request> new_request() { return std::allocate_shared<Request>(PoolAlloc<Request>()); }

// A message that arrived before its receive was posted.
struct Unexpected {
  static constexpr size_t kInline = 64;
  int source = -1;
  MsgHdr hdr{};
  uint8_t small[kInline];       // an eager payload of at most kInline bytes (no allocation)
  std::vector<uint8_t> large;   // a larger one
  void keep(const uint8_t* p, size_t n) {
    if (n <= kInline) std::memcpy(small, p, n);
    else large.assign(p, p + n);
  }
  const uint8_t* payload() const { return hdr.len <= kInline ? small : large.data(); }
};
using PostedList = std::list<std::shared_ptr<Request>, PoolAlloc<std::shared_ptr<Request>>>;

// A flag the one-sided fast path reads without the context lock (written
// under it): acquire/release, copyable so that Peer stays a vector element.
class SharedFlag {
 public:
  SharedFlag(bool v = false) : _v(v) {}  // NOLINT(google-explicit-constructor)
  SharedFlag(const SharedFlag& o) : _v(o._v.load(std::memory_order_acquire)) {}
  SharedFlag& operator=(const SharedFlag& o) { return *this = static_cast<bool>(o); }
  SharedFlag& operator=(bool v) {
    _v.store(v, std::memory_order_release);
    return *this;
  }
  operator bool() const { return _v.load(std::memory_order_acquire); }  // NOLINT(google-explicit-constructor)

 private:
  std::atomic<bool> _v;
};

struct Peer {
  int rank = -1;
  SharedFlag alive = true;  // why_dead is written before alive turns false
  bool same_host = true;
  std::string host;  // host identity (api/wireup/host.h)
  std::string why_dead;
  UniqueFd sock;  // control socket (api/wireup/mesh.h): wire-up, adverts, liveness
  Transport* am = nullptr;          // messaging lane
  std::vector<Transport*> rma;      // RMA lanes, preferred first
  std::string lanes;                // "shm,cma": what hcomm_peer_transport reports
  std::deque<std::shared_ptr<Request>> backlog;  // sends waiting for room on the messaging lane
  SharedFlag queued = false;  // backlog is not empty (read by the unlocked eager path)
};

// Control-socket messages: api/wireup/mesh_wire.h.
using meshwire::CtrlMsg;
using meshwire::CtrlType;

// find_local_unlocked's per-thread cache: the last registration a local
// buffer was found in, valid while the context's _mem_epoch is `epoch`.
struct LocalHit {
  const Context* ctx = nullptr;
  uint64_t epoch = 0;
  uintptr_t base = 0;
  size_t size = 0;
  const hcomm_mem* m = nullptr;
};
// One thread-local block for the fast path (one TLS address per call).
struct ThreadCache {
  LocalHit hit;
  MarkSlot mark;  // this thread's index into access-mark tables (api/mem/access_mark.h)
};
extern constinit thread_local ThreadCache t_cache;

// The access mark of an access through k (AccessMark; none for a key whose
// data lane is not a CPU copy on this host).
[[gnu::always_inline]] inline AccessMark key_mark(const hcomm_rkey* k, ThreadCache& tc = t_cache) noexcept {
  if (k == nullptr) return AccessMark(nullptr, 0, tc.mark);
  return AccessMark(k->marks, k->mark_value, tc.mark);
}

class Context final : public AmSink {
 public:
  static Status create(const hcomm_config_t& cfg, std::unique_ptr<Context>* out);
  ~Context() override;

  int rank() const { return _rank; }
  int size() const { return _size; }
  bool npu() const { return _npu != nullptr; }
  const char* engine_name() const { return npu() ? "npu" : "host"; }
  const char* peer_transport(int peer) const;
  std::mutex& mu() { return _mu; }
  uint64_t job_hash() const { return _job_hash; }
  Peer& peer(int r) { return _peers[static_cast<size_t>(r)]; }
  // The context is being destroyed: transports release without telling peers.
  bool closing() const { return _closing; }

  Status barrier(const Deadline& dl);
  Status finalize(const Deadline& dl);

  // memory (api/mem/memory.cpp)
  Status mem_alloc(size_t size, unsigned kind, unsigned access, hcomm_mem** out);
  Status mem_register(void* addr, size_t size, unsigned access, hcomm_mem** out);
  Status mem_release(hcomm_mem* m);
  Status rkey_pack(const hcomm_mem* m, void* buf, size_t* len) const;
  Status rkey_import(int peer, const void* buf, size_t len, hcomm_rkey** out);
  Status rkey_release(hcomm_rkey* k);
  hcomm_mem* mem_at_slot(uint32_t slot) const { return slot < _mems.size() ? _mems[slot] : nullptr; }
  const hcomm_mem* find_local(const void* p, size_t len) const;
  // find_local without the caller holding the lock: a per-thread cache of the
  // last hit, valid while no registration changed since (_mem_epoch); a miss
  // takes the lock. Transports on the unlocked path never dereference the
  // result (it only proves the buffer was registered).
  const hcomm_mem* find_local_unlocked(const void* p, size_t len);
  // The per-thread cache alone: its registration when it covers [p, p+len)
  // and no registration changed since it was filled, else null.
  const hcomm_mem* cached_local(const void* p, size_t len, const ThreadCache& tc = t_cache) const;

  // one-sided (api/proto/rma.cpp); returns a request (maybe already
  // complete). out == nullptr: the caller blocks; on a synchronous lane the
  // operation then runs without a request and is complete when this returns.
  // A call's arguments are an RmaOp (api/transport/transport.h) the checks
  // complete in place (len of an atomic, local_mem).
  using RmaArgs = RmaOp;
  Status rma(RmaArgs& a, std::shared_ptr<Request>* out);
  // A new request of an RMA to `peer` (rma(), and a lane's implicit failure).
  std::shared_ptr<Request> rma_request(int peer);
  // Whether a call of a on its keys' lanes completes inside rma() (fixed
  // per key at import: hcomm_rkey::sync).
  bool rma_sync(const RmaArgs& a) const {
    return a.rkey != nullptr && a.rkey->ctx == this && a.rkey->sync &&
           (a.notify_rkey == nullptr || (a.notify_rkey->ctx == this && a.notify_rkey->sync));
  }
  // The fast path (docs/api.md, "Threads"): a on synchronous lanes (shm,
  // cma), checked and run WITHOUT the context lock, complete at the target
  // when it returns. Callers: rma_sync(a) && !fence_pending(). It reads only
  // what stays put after init (peers, lanes, mappings, the owners' tables),
  // the caller's key, atomics (peer liveness, the registration epoch) and a
  // per-thread cache; anything else takes the locked path.
  Status rma_unlocked(RmaArgs& a);
  Status rma_run_marked(const RmaArgs& a, Transport* lane, Transport* nlane);
  // The fast path's own checks, inline and with no message built: true when
  // a (put, get or a fetch atomic on a key whose lanes validate against the
  // node registry; no notify, no pending fence, the local buffer in this
  // thread's lookup cache) may run now on a.rkey's lane. False says nothing
  // about why: rma_unlocked checks again and words any error.
  // tc: this thread's cache (t_cache), passed in so that a call computes
  // its address once.
  bool rma_fast_checks(RmaArgs& a, const ThreadCache& tc) const;
  bool fence_pending() const { return _fence_next.load(std::memory_order_acquire); }
  // hcomm_flush with nothing to wait for, decided without the lock: every
  // transport of this context completes its operations inside the call
  // (shm, cma: no operation outlives it, and none is kept as implicit) and
  // `peer` is a live rank. False: the locked flush decides (and words errors).
  bool flush_trivial(int peer) const {
    return _sync_only && peer >= 0 && peer < _size && (peer == _rank || _peers[static_cast<size_t>(peer)].alive);
  }
  Status notify_wait(hcomm_mem* m, uint64_t off, uint64_t value, const Deadline& dl);
  Status flush(int peer, const Deadline& dl);
  // An implicit (_nbi) operation's request, on an asynchronous lane: the
  // next flush covering its peer waits for it and reports its failure.
  void keep_implicit(std::shared_ptr<Request> r);
  void fence() { _fence_next.store(true, std::memory_order_release); }

  // two-sided (api/proto/tag.cpp)
  // *out: the send's request, or empty when the send completed in the call
  // (an eager message the lane took).
  Status isend(int dest, const void* buf, size_t len, uint64_t tag, std::shared_ptr<Request>* out);
  // The eager fast path, WITHOUT the context lock (docs/api.md, "Threads"):
  // a message of at most the lane's max_short to another live rank whose
  // messaging lane takes concurrent senders (Caps::am_concurrent), nothing
  // queued before it. True: sent, complete. False says nothing about why:
  // the caller takes the locked path, which checks again and words errors.
  bool isend_unlocked(int dest, const void* buf, size_t len, uint64_t tag);
  Status irecv(int source, void* buf, size_t len, uint64_t tag, uint64_t mask, std::shared_ptr<Request>* out);
  Status probe(int source, uint64_t tag, uint64_t mask, bool* found, hcomm_recv_info_t* info);

  // progress
  void progress();
  Status wait(Request& r, const Deadline& dl);
  uint64_t next_id() { return _next_id++; }

  // AmSink
  void on_am(int peer, const MsgHdr& h, const uint8_t* payload) override;
  void on_peer_failed(int peer, const std::string& why) override { peer_failed(_peers[peer], why); }
  void on_implicit_failed(int peer, hcomm_status_t st, const std::string& why) override;

  // The cancel rule (docs/api.md): withdraws r (it completes with
  // HCOMM_ERR_CANCELLED and no peer ever sees it), or waits until it
  // completed and no engine touches its buffers any more. Past the cancel
  // bound, the peer that holds it up is declared failed (which stops its
  // transports touching our memory) and r fails with HCOMM_ERR_PEER_FAILURE.
  void cancel(const std::shared_ptr<Request>& r);
  std::chrono::milliseconds cancel_bound() const { return _cancel_bound; }

  // Waits (bounded) for control messages from `peer` and dispatches them;
  // used by transports that wait for a peer's wire-up data.
  Status pump_control(Peer& p, const Deadline& dl);

  // Every transport's acknowledge() (revocation notices): release waits call
  // it so that two ranks releasing at once answer each other. Returns
  // whether any found a notice to answer.
  bool acknowledge_all() {
    bool found = false;
    for (auto& t : _transports) found |= t->acknowledge();
    return found;
  }
 private:
  Context() = default;
  Status init(const hcomm_config_t& cfg);
  void reserve_blocks();
  Status add_mem(std::unique_ptr<hcomm_mem> m, hcomm_mem** out);
  Status open_transports(const hcomm_config_t& cfg, const LaunchInfo& li, const Deadline& dl);
  Status choose_lanes(const std::vector<std::string>& forced, const std::string& why_not);
  Status open_claims(const Deadline& dl);
  void drain_socket(Peer& p);
  void check_peers(bool force);
  void peer_failed(Peer& p, const std::string& why);
  Status check_key(hcomm_rkey* k, uint64_t off, uint64_t len, unsigned need) const;
  // The owner's current generation (or the lanes' own validity checks):
  // check_key's last step, again under an access mark.
  Status check_live(const hcomm_rkey& k) const;
  // Argument and key checks of a one-sided call; fills op and the lanes.
  Status rma_check(RmaArgs& a, bool locked, Transport** lane, Transport** nlane);
  // Runs a checked call on synchronous lanes: the data, then the word.
  static Status rma_run_sync(const RmaArgs& a, Transport* lane, Transport* nlane);
  // Waits until done() with progress; false at the deadline. Releases _mu while napping.
  bool spin_wait(const std::function<bool()>& done, bool progress_each_round, const Deadline& dl);
  void flush_owed(const Deadline& dl);
  // Waits for the implicit operations to `peer` (-1: all); take: forget
  // them and return the first failure (hcomm_flush), else leave them.
  Status reap_implicit(int peer, const Deadline& dl, bool take);
  Status complete_all(const Deadline& dl);

  // two-sided internals (api/proto/tag.cpp)
  bool try_send(Peer& p, const std::shared_ptr<Request>& r);
  hcomm_rkey* rendezvous_key(int source, uint32_t slot, uint32_t gen);
  PostedList::iterator find_posted(int source, uint64_t tag);
  std::shared_ptr<Request> take_posted(int source, uint64_t tag);
  bool match_deferred() const { return !_claims.empty(); }
  // A message meets the posted receive at `it`: eager payloads are copied
  // and the receive completes; a rendezvous starts the claim on the sender's
  // word. True when the receive took the message (false: the sender had
  // retracted it).
  bool match(PostedList::iterator it, int source, const MsgHdr& h, const uint8_t* payload);
  void deliver_eager(Request& r, int source, const MsgHdr& h, const uint8_t* payload);
  void start_claim(const std::shared_ptr<Request>& r, int source, const MsgHdr& h, unsigned asks = 0);
  bool took_rendezvous(const std::shared_ptr<Request>& r) const;
  // A claim won and its receive taken off the posted list, its read not yet
  // started (finish_claims starts it after matching resumes).
  struct Won {
    std::shared_ptr<Request> recv;
    int source;
    MsgHdr h;
  };
  // `later` null: the read starts at once.
  void claim_resolved(const std::shared_ptr<Request>& r, int source, const MsgHdr& h, const Request& op, uint64_t old,
                      unsigned asks, std::vector<Won>* later = nullptr);
  void finish_claims();
  void rematch();
  Status claim_cas(hcomm_rkey* k, uint32_t idx, uint64_t compare, uint64_t swap, uint64_t* old,
                   const std::shared_ptr<Request>& g);
  void cancel_send(const std::shared_ptr<Request>& r, const Deadline& dl);
  void cancel_stuck(Request& r, const char* what);
  void pull(const std::shared_ptr<Request>& r, int source, const MsgHdr& h);
  void finish_pulls();
  void on_cts(Peer& p, const MsgHdr& h);
  void finish_pushes();
  void send_done(Request& r, hcomm_status_t st, const std::string& why);
  // Control messages (FIN, RETRACT) go out now or wait in _ctl_backlog;
  // they may overtake queued sends.
  void post_ctl(int peer, const MsgHdr& h);
  bool try_ctl(int peer, const MsgHdr& h);

  std::mutex _mu;
  int _rank = 0, _size = 1, _local_rank = 0;
  uint64_t _job_hash = 0;
  std::unique_ptr<Bootstrap> _boot;
  std::vector<Peer> _peers;
  // transports, in the order of preference; _shm/_npu: typed views of two of them
  std::vector<std::unique_ptr<Transport>> _transports;
  ShmTransport* _shm = nullptr;
  NpuTransport* _npu = nullptr;
  Transport* _verbs = nullptr;
  bool _cross_host = false;  // some peer is on another host
  bool _yield_early = false; // waits yield after 3 us, not 50 (the NPU is hcomm-sim on this host)
  bool _nap_early = false;   // waits nap instead of yielding (verbs on a software RDMA device)
  // registrations
  std::vector<hcomm_mem*> _mems;              // by slot
  std::vector<uint32_t> _slot_gen;            // generation per slot: odd while registered
  std::map<uintptr_t, hcomm_mem*> _by_addr;   // CPU-visible registrations by start address
  // Changes (to a value no context used before) whenever a registration
  // comes or goes: find_local_unlocked's per-thread cache is valid while it
  // holds the value it was filled under.
  std::atomic<uint64_t> _mem_epoch{0};
  void mem_changed();
  // requests
  uint64_t _next_id = 1;
  uint64_t _peers_failed = 0;  // peers declared failed so far (notify_wait ends on a new one)
  std::string _last_failure;    // the latest one's why_dead
  std::vector<pollfd> _check_pfds;  // check_peers, reused
  std::vector<Peer*> _check_who;
  std::vector<std::shared_ptr<Request>> _implicit;               // _nbi operations on asynchronous lanes
  std::map<uint64_t, std::shared_ptr<Request>> _pending_sends;  // rendezvous awaiting FIN
  PostedList _posted;                                            // receives
  std::list<Unexpected, PoolAlloc<Unexpected>> _unexpected;
  std::deque<std::pair<int, MsgHdr>> _ctl_backlog;               // FIN/RETRACT waiting for room
  // Rendezvous claims (api/proto/tag.cpp): one word per rendezvous send in
  // our claim memory; every rank holds every rank's key for it.
  hcomm_mem* _claim_mem = nullptr;
  std::vector<hcomm_rkey*> _claim_keys;  // by rank, self included
  std::vector<uint32_t> _claim_free;
  struct Claim {
    std::shared_ptr<Request> recv, op;
    uint64_t old = 0;
    int source = -1;
    MsgHdr h{};
    unsigned asks = 0;  // compare-swaps sent for this claim before this one
  };
  std::list<Claim> _claims;  // claims in flight on asynchronous lanes
  std::chrono::milliseconds _cancel_bound{1000};
  // Rendezvous reads in flight: the receive completes, and the FIN goes out,
  // when the read does.
  // By write (Caps::rndv_write): `read` completes at the sender's WDONE and
  // no FIN goes back.
  struct Pull {
    std::shared_ptr<Request> recv, read;
    int source;
    uint64_t sreq, total;
    bool by_write = false;  // a CTS went out: the sender writes
    const Transport* lane = nullptr;  // what moves the bytes, when asynchronous
  };
  std::list<Pull> _pulls;
  // Rendezvous sends the receiver asked to write (CTS): the send completes,
  // and WDONE goes out, when the write does.
  struct Push {
    std::shared_ptr<Request> send, write;
    int dest;
  };
  std::list<Push> _pushes;
  // HCOMM_RNDV: rendezvous by the sender's write where the messaging lane can
  // (Caps::rndv_write) for messages of at least _rndv_write_min bytes (auto:
  // kRndvWriteMin; put: every size), else by the receiver's read (get: always).
  static constexpr uint64_t kRndvWriteMin = 128 << 10;
  bool _rndv_write = true;
  uint64_t _rndv_write_min = kRndvWriteMin;
  std::map<uint64_t, hcomm_rkey*> _rndv_keys;                    // (peer << 32 | slot) -> cached import
  Clock::time_point _last_check{};
  std::chrono::milliseconds _peer_check{1};
  uint32_t _progress_calls = 0;
  std::atomic<bool> _fence_next{false};
  bool _sync_only = false;  // every transport is synchronous (fixed at init)
  bool _finalized = false;
  bool _closing = false;
};

[[gnu::always_inline]] inline bool Context::rma_fast_checks(RmaArgs& a, const ThreadCache& tc) const {
  const hcomm_rkey& k = *a.rkey;
  if (a.notify_rkey != nullptr || k.live_gen == nullptr || fence_pending()) return false;
  unsigned need = 0;
  switch (a.op) {
    case Rma::put: need = HCOMM_ACCESS_REMOTE_WRITE; break;
    case Rma::get: need = HCOMM_ACCESS_REMOTE_READ; break;
    case Rma::fetch_add:
    case Rma::cswap:
      if (a.old_value == nullptr || a.roff % 8 != 0) return false;
      a.len = 8;
      need = HCOMM_ACCESS_REMOTE_ATOMIC;
      break;
    default: return false;
  }
  if (a.roff > k.h.size || a.len > k.h.size - a.roff || (k.h.rights & need) != need) return false;
  if (k.live_gen->load(std::memory_order_seq_cst) != k.h.gen) return false;  // revoked (after the access mark)
  if (k.peer != _rank && !_peers[static_cast<size_t>(k.peer)].alive) return false;
  if (need == HCOMM_ACCESS_REMOTE_ATOMIC) return true;
  if (a.local == nullptr || a.len == 0) return false;
  a.local_mem = cached_local(a.local, a.len, tc);
  return a.local_mem != nullptr;
}

[[gnu::always_inline]] inline const hcomm_mem* Context::cached_local(const void* p, size_t len,
                                                                    const ThreadCache& tc) const {
  const LocalHit& h = tc.hit;
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (h.ctx != this || h.epoch != _mem_epoch.load(std::memory_order_acquire) || a - h.base > h.size ||
      len > h.size - (a - h.base))
    return nullptr;
  return h.m;
}

}  // namespace hcomm::api

// The C handle of a request: shares the request with the context.
struct hcomm_request {
  hcomm::api::Context* ctx = nullptr;
  std::shared_ptr<hcomm::api::Request> r;
  bool listed = false;  // set only while hcomm_wait_all checks its array for repeats
};
struct hcomm_context {
  std::unique_ptr<hcomm::api::Context> impl;
};
