// Two-sided messaging over each peer's messaging lane: tag matching, eager
// and rendezvous, written once for every transport.
//
//  - eager (payload <= the lane's max_short): header and payload in one
//    active message; the send completes when the lane took it.
//  - rendezvous: an RTS names the sender's buffer (and its registration when
//    it is shareable hcomm memory); once a receive matches (and won the
//    sender's claim word), the payload moves once, straight into the receive
//    buffer, one of two ways:
//     * by read: the receiver reads it with the best RMA lane that reaches
//       the sender's memory (a read through the key, else a raw read of the
//       sender's address space), then answers FIN; the send completes at FIN.
//     * by write, where the messaging lane can (Caps::rndv_write: verbs,
//       npu_roce) and the message has at least 128 KiB (HCOMM_RNDV=put:
//       any size; get: never): the receiver exposes its buffer and answers
//       CTS naming it; the sender writes the payload there and, once the
//       write is acknowledged (placed), completes and sends WDONE; the
//       receive completes at WDONE. On RDMA a READ is the slow direction
//       for bulk (rxe here: 2.4-7x slower than a WRITE; NICs bound
//       outstanding READs by max_rd_atomic), so large send/recv runs at
//       put's speed; below 128 KiB the read's one hop less wins (measured
//       over Soft-RoCE: docs/performance.md).
#include <algorithm>
#include <atomic>
#include <cstring>

#include "api/core/context.h"
#include "api/transport/shm/shm.h"
#include "common/barrier.h"

namespace hcomm::api {

namespace {
bool tag_match(uint64_t msg_tag, uint64_t tag, uint64_t mask) { return (msg_tag & mask) == (tag & mask); }
}  // namespace

bool Context::try_send(Peer& p, const std::shared_ptr<Request>& rp) {
  Request& r = *rp;
  MsgHdr h{};
  h.tag = r.tag;
  h.total = r.slen;
  h.sreq = r.id;
  if (r.slen <= p.am->caps().max_short) {
    h.type = static_cast<uint32_t>(MsgType::eager);
    h.len = static_cast<uint32_t>(r.slen);
    if (!p.am->am_send(p.rank, h, r.sbuf, r.slen)) return false;
    r.complete(HCOMM_OK);
    return true;
  }
  // Rendezvous: the receiver pulls the payload once from our buffer; we tell
  // it where, and whether the buffer is shareable registered memory. It
  // reads only after winning the claim word; we retract by winning it first.
  if (r.claim == kNoSlot) {
    if (_claim_free.empty()) return false;  // every word is in use: wait for a FIN
    r.claim = _claim_free.back();
    _claim_free.pop_back();
    std::atomic_ref<uint64_t>(reinterpret_cast<uint64_t*>(_claim_mem->ptr)[r.claim])
        .store(claim_token(r.id, kExposed), std::memory_order_release);
  }
  h.type = static_cast<uint32_t>(MsgType::rts);
  h.addr = reinterpret_cast<uint64_t>(r.sbuf);
  h.status = r.claim;
  h.src_slot = kNoSlot;
  if (const hcomm_mem* m = find_local(r.sbuf, r.slen); m != nullptr && m->kind == MemKind::host_alloc) {
    h.src_slot = m->slot;
    h.src_gen = m->gen;
    h.src_off = static_cast<uint64_t>(r.sbuf - m->ptr);
  }
  if (r.exposed_by == nullptr) {
    Status st = p.am->expose(r, h);
    if (!st) {
      send_done(r, to_hcomm(st.code()), "rendezvous: " + st.message());
      return true;  // consumed: failed
    }
    r.exposed_by = p.am;
    r.exposed_rkey = h.rkey;
    r.exposed_addr = h.addr;
  }
  h.rkey = r.exposed_rkey;  // a retry (no room the first time) carries the same exposure
  h.addr = r.exposed_addr;
  if (!p.am->am_send(p.rank, h, nullptr, 0)) return false;
  _pending_sends[r.id] = rp;  // completes when the receiver's FIN arrives
  return true;
}

bool Context::try_ctl(int peer, const MsgHdr& h) {
  Peer& p = _peers[static_cast<size_t>(peer)];
  return !p.alive || p.am->am_send(peer, h, nullptr, 0);
}

void Context::post_ctl(int peer, const MsgHdr& h) {
  if (!_ctl_backlog.empty() || !try_ctl(peer, h)) _ctl_backlog.emplace_back(peer, h);
}

// The first posted receive (in posting order) that a message from `source`
// with `tag` matches; end() if none, or if the first that matches is
// waiting on a claim (the message must wait: it belongs to that receive if
// the claim is lost).
PostedList::iterator Context::find_posted(int source, uint64_t tag) {
  for (auto it = _posted.begin(); it != _posted.end(); ++it) {
    const Request& r = **it;
    if ((r.peer == HCOMM_ANY_SOURCE || r.peer == source) && tag_match(tag, r.tag, r.tag_mask))
      return r.claiming ? _posted.end() : it;
  }
  return _posted.end();
}

std::shared_ptr<Request> Context::take_posted(int source, uint64_t tag) {
  auto it = find_posted(source, tag);
  if (it == _posted.end()) return nullptr;
  std::shared_ptr<Request> keep = std::move(*it);
  _posted.erase(it);
  return keep;
}

void Context::on_am(int peer, const MsgHdr& h, const uint8_t* payload) {
  Peer& p = _peers[static_cast<size_t>(peer)];
  if (h.type == static_cast<uint32_t>(MsgType::fin)) {
    auto it = _pending_sends.find(h.sreq);
    if (it == _pending_sends.end() || it->second->peer != peer) {
      // An error FIN may answer a send we have retracted meanwhile.
      if (h.status != HCOMM_OK && it == _pending_sends.end()) return;
      return peer_failed(p, "FIN for an unknown send");
    }
    hcomm_status_t st = static_cast<hcomm_status_t>(h.status);
    send_done(*it->second, st == HCOMM_OK ? HCOMM_OK : HCOMM_ERR_PEER_FAILURE,
              st == HCOMM_OK ? "" : "receiver could not pull the payload: " + std::string(hcomm_strerror(st)));
    _pending_sends.erase(it);
    return;
  }
  if (h.type == static_cast<uint32_t>(MsgType::cts)) return on_cts(p, h);
  if (h.type == static_cast<uint32_t>(MsgType::wdone)) {
    for (Pull& u : _pulls) {
      if (u.source == peer && u.sreq == h.sreq && u.by_write && !u.read->done()) {
        const auto st = static_cast<hcomm_status_t>(h.status);
        u.read->complete(st == HCOMM_OK ? HCOMM_OK : HCOMM_ERR_PEER_FAILURE,
                         st == HCOMM_OK ? "" : "the sender could not write the payload: " + std::string(hcomm_strerror(st)));
        finish_pulls();
        return;
      }
    }
    return peer_failed(p, "WDONE for message " + std::to_string(h.sreq) + ", which it was not asked to write");
  }
  if (h.type == static_cast<uint32_t>(MsgType::retract)) {
    // The sender won its claim word back: drop its RTS if it still waits
    // here (a receive that matched it meanwhile loses the claim instead).
    for (auto it = _unexpected.begin(); it != _unexpected.end(); ++it) {
      if (it->source == peer && it->hdr.type == static_cast<uint32_t>(MsgType::rts) && it->hdr.sreq == h.sreq) {
        _unexpected.erase(it);
        break;
      }
    }
    return;
  }
  if (!match_deferred()) {
    if (auto it = find_posted(peer, h.tag); it != _posted.end() && match(it, peer, h, payload)) return;
  }
  Unexpected& u = _unexpected.emplace_back();
  u.source = peer;
  u.hdr = h;
  if (h.type == static_cast<uint32_t>(MsgType::eager)) u.keep(payload, h.len);
}

// A rendezvous send is over: release what its lane exposed and its claim
// word, complete it.
void Context::send_done(Request& r, hcomm_status_t st, const std::string& why) {
  if (r.exposed_by != nullptr) r.exposed_by->unexpose(r);
  r.exposed_by = nullptr;
  if (r.claim != kNoSlot) _claim_free.push_back(r.claim);
  r.claim = kNoSlot;
  r.complete(st, why);
}

void Context::deliver_eager(Request& r, int source, const MsgHdr& h, const uint8_t* payload) {
  r.info = {source, h.tag, static_cast<size_t>(h.total)};
  size_t n = std::min<size_t>(h.len, r.rlen);
  if (n > 0) std::memcpy(r.rbuf, payload, n);
  if (h.total <= r.rlen) return r.complete(HCOMM_OK);
  r.complete(HCOMM_ERR_TRUNCATED,
             "message of " + std::to_string(h.total) + " bytes, buffer of " + std::to_string(r.rlen));
}

bool Context::match(PostedList::iterator it, int source, const MsgHdr& h,
                    const uint8_t* payload) {
  if (h.type == static_cast<uint32_t>(MsgType::eager)) {
    std::shared_ptr<Request> r = std::move(*it);  // no count: the node goes
    _posted.erase(it);
    deliver_eager(*r, source, h, payload);
    return true;
  }
  std::shared_ptr<Request> r = *it;
  start_claim(r, source, h);
  return took_rendezvous(r);
}

// After start_claim: the receive took the message (won, so no longer posted;
// or still claiming), or the sender had retracted it (posted again).
bool Context::took_rendezvous(const std::shared_ptr<Request>& r) const {
  return r->claiming || r->done() || std::find(_posted.begin(), _posted.end(), r) == _posted.end();
}

// Rendezvous claims. Every rendezvous send owns a word in its sender's claim
// memory, set to (id, exposed) before the RTS goes out. A receive that
// matches the RTS compare-swaps it to (id, claimed) on the word's atomicity
// agent before it reads a byte; a sender that cancels compare-swaps it to
// (id, retracted). Exactly one wins: a retracted send is never read and its
// receiver behaves as if it never arrived; a claimed send is read to the
// end and FINned. On a synchronous lane (shm) the claim resolves inside the
// call; on an asynchronous one (verbs, npu) the receive keeps its place in
// the posted list while the claim is in flight, and matching waits for it
// (messages queue as unexpected and are matched, in arrival order, when no
// claim is left).
Status Context::claim_cas(hcomm_rkey* k, uint32_t idx, uint64_t compare, uint64_t swap, uint64_t* old,
                          const std::shared_ptr<Request>& g) {
  RmaOp op;
  op.op = Rma::cswap;
  op.rkey = k;
  op.roff = uint64_t{idx} * 8;
  op.len = 8;
  op.compare = compare;
  op.operand = swap;
  op.old_value = old;
  Status st = k->alane->caps().sync ? k->alane->rma(op, nullptr) : k->alane->rma(op, g);
  if (k->alane->caps().sync || !st) g->complete(st ? HCOMM_OK : to_hcomm(st.code()), st.message());
  return st;
}

void Context::start_claim(const std::shared_ptr<Request>& rp, int source, const MsgHdr& h, unsigned asks) {
  Peer& p = _peers[static_cast<size_t>(source)];
  hcomm_rkey* k = _claim_keys.empty() ? nullptr : _claim_keys[static_cast<size_t>(source)];
  if (k == nullptr || h.status == kNoSlot || uint64_t{h.status} >= k->h.size / 8) {
    // Every sender of this build names a word: a missing or wild one is a
    // malformed RTS. The receive stays posted.
    peer_failed(p, "RTS names claim word " + std::to_string(h.status) + ", not one of its " +
                       std::to_string(k != nullptr ? k->h.size / 8 : 0));
    return;
  }
  rp->claiming = true;
  _claims.push_back({rp, new_request(), 0, source, h, asks});
  Claim& c = _claims.back();
  c.op->peer = source;
  c.op->id = next_id();
  (void)claim_cas(k, h.status, claim_token(h.sreq, kExposed), claim_token(h.sreq, kClaimed), &c.old, c.op);
  if (!c.op->done()) return;
  // Resolved at once (synchronous lane, or the lane refused).
  Claim done = std::move(c);
  _claims.pop_back();
  claim_resolved(done.recv, source, h, *done.op, done.old, done.asks);
}

void Context::claim_resolved(const std::shared_ptr<Request>& rp, int source, const MsgHdr& h, const Request& op,
                             uint64_t old, unsigned asks, std::vector<Won>* later) {
  rp->claiming = false;
  if (rp->done()) return;  // failed meanwhile (its peer failed)
  if (op.status != HCOMM_OK && op.status != HCOMM_ERR_PEER_FAILURE) {
    // The word could not be reached (a lost device): neither side can move
    // the message; both fail, the sender through an error FIN.
    _posted.remove(rp);
    rp->complete(op.status, "claiming rank " + std::to_string(source) + "'s message: " + op.error);
    MsgHdr f{};
    f.type = static_cast<uint32_t>(MsgType::fin);
    f.sreq = h.sreq;
    f.status = static_cast<uint32_t>(op.status);
    post_ctl(source, f);
    return;
  }
  // The word answers (sreq, exposed): ours now; (sreq, claimed): ours
  // already (a compare-swap of ours ran before, its answer was lost);
  // (sreq, retracted): the sender took it back. Any other answer is asked
  // again (a compare-swap that only swaps (sreq, exposed) changes nothing
  // else), a bounded number of times: a later message's token, answered
  // every time, means the word was retracted and reused (lost); an earlier
  // message's token or no state at all cannot be (the sender wrote (sreq,
  // exposed) before the RTS left, and its ids only grow). Reading such an
  // answer as a retraction left the sender waiting for its FIN forever:
  // over Soft-RoCE under load, a compare-swap whose response was lost came
  // back, retransmitted, with the old value of the previous compare-swap.
  const uint64_t state = claim_state(old, h.sreq);
  if (op.status == HCOMM_OK && state == 0) {
    if (asks + 1 < kClaimAsks) return start_claim(rp, source, h, asks + 1);
    if ((old >> 2) <= h.sreq)
      return peer_failed(_peers[static_cast<size_t>(source)],
                         "claim word " + std::to_string(h.status) + " answered " + std::to_string(old) + " to " +
                             std::to_string(kClaimAsks) + " compare-swaps for message " + std::to_string(h.sreq));
  }
  const bool won = op.status == HCOMM_OK && (state == kExposed || state == kClaimed);
  if (!won) return;  // retracted (or its sender is gone): as if never sent; the receive stays posted
  _posted.remove(rp);
  rp->info = {source, h.tag, static_cast<size_t>(h.total)};
  if (later != nullptr) return later->push_back({rp, source, h});
  pull(rp, source, h);
}

// The reads of the messages won here start after matching has resumed: on
// an asynchronous lane whose operations run in order (the NPU's DMA queue)
// the next message's claim then sits ahead of this message's copy, and is
// answered while the copy runs, so the queue never waits for this rank
// between two copies (claim k+1, copy k, claim k+2, copy k+1, ...). Pulled
// first, every claim queued behind the copy before it, and the engine idled
// for a round trip to this rank per message. (Nothing rematch reaches
// releases _mu, so the won receive, already off the posted list, cannot be
// completed or cancelled before its read starts.)
void Context::finish_claims() {
  bool resolved = false;
  std::vector<Won> won;
  for (auto it = _claims.begin(); it != _claims.end();) {
    if (!it->op->done()) {
      ++it;
      continue;
    }
    Claim c = std::move(*it);
    it = _claims.erase(it);
    claim_resolved(c.recv, c.source, c.h, *c.op, c.old, c.asks, &won);
    resolved = true;
  }
  if (resolved && _claims.empty()) rematch();
  for (Won& w : won) pull(w.recv, w.source, w.h);
}

// Matching resumes: unexpected messages, in arrival order, meet the posted
// receives, as if every receive had been posted before they arrived.
void Context::rematch() {
  for (auto it = _unexpected.begin(); it != _unexpected.end() && !match_deferred();) {
    auto pit = find_posted(it->source, it->hdr.tag);
    if (pit == _posted.end()) {
      ++it;
      continue;
    }
    Unexpected u = std::move(*it);
    it = _unexpected.erase(it);
    (void)match(pit, u.source, u.hdr, u.payload());
  }
}

// The sender's registration, imported once and cached while its generation
// stays the same (a rendezvous per message must not pay an mmap / ATT write).
hcomm_rkey* Context::rendezvous_key(int source, uint32_t slot, uint32_t gen) {
  if (_shm == nullptr || !_peers[static_cast<size_t>(source)].same_host) return nullptr;
  const uint64_t key = (uint64_t{static_cast<uint32_t>(source)} << 32) | slot;
  if (auto it = _rndv_keys.find(key); it != _rndv_keys.end()) {
    if (it->second->h.gen == gen && _shm->live(source, slot, gen)) return it->second;
    (void)rkey_release(it->second);  // the sender re-registered the slot
    _rndv_keys.erase(it);
  }
  std::vector<uint8_t> wire;
  if (!_shm->synth_key(source, slot, gen, &wire)) return nullptr;
  hcomm_rkey* k = nullptr;
  if (!rkey_import(source, wire.data(), wire.size(), &k)) return nullptr;
  _rndv_keys[key] = k;
  return k;
}

// Rendezvous: move the payload once, straight from the sender's buffer into
// the receive buffer; when the read is done, FIN to the sender.
void Context::pull(const std::shared_ptr<Request>& rp, int source, const MsgHdr& h) {
  Request& r = *rp;
  Peer& p = _peers[static_cast<size_t>(source)];
  const size_t n = std::min<size_t>(h.total, r.rlen);
  auto g = new_request();
  g->peer = source;
  g->id = next_id();
  bool started = n == 0;
  const Transport* lane = nullptr;  // an asynchronous lane the read went to
  if (n == 0) g->complete(HCOMM_OK);
  if (!started && _rndv_write && h.total >= _rndv_write_min && p.am->caps().rndv_write) {
    // By write: name our buffer in a CTS; the sender's WDONE completes g.
    MsgHdr c{};
    c.type = static_cast<uint32_t>(MsgType::cts);
    c.sreq = h.sreq;
    c.total = n;
    Status es = p.am->expose_recv(source, r, n, &c.addr, &c.rkey);
    if (es) {
      r.exposed_by = p.am;
      // Listed first: posting the CTS may find the source failed, and
      // peer_failed finishes the pulls it lists.
      _pulls.push_back({rp, g, source, h.sreq, h.total, true});
      post_ctl(source, c);
      return;
    }
    // Not exposable: fail it; the sender learns it from an error FIN.
    g->complete(es.code() == Code::peer_failure ? HCOMM_ERR_PEER_FAILURE : to_hcomm(es.code()), es.message());
    started = true;
  }
  if (!started && h.src_slot != kNoSlot) {
    // The sender's buffer is registered shareable memory: read it through
    // its key's lane.
    hcomm_rkey* k = rendezvous_key(source, h.src_slot, h.src_gen);
    if (k != nullptr && h.src_off <= k->h.size && n <= k->h.size - h.src_off) {
      RmaOp a;
      a.op = Rma::get;
      a.local = r.rbuf;
      a.local_mem = find_local(r.rbuf, n);
      a.len = n;
      a.rkey = k;
      a.roff = h.src_off;
      if (k->lane->caps().sync) {
        started = static_cast<bool>(k->lane->rma(a, nullptr));
        if (started) g->complete(HCOMM_OK);
      } else if (a.local_mem != nullptr) {
        started = static_cast<bool>(k->lane->rma(a, g));
        if (started) lane = k->lane;
      }
    }
  }
  if (!started) {
    // Any other buffer: a raw zero-copy read of the sender's memory. A
    // failure other than the sender vanishing means it sent a bad address.
    Status cs = Status::error(Code::unsupported, "no transport reaching rank %d reads unregistered memory", source);
    for (Transport* t : p.rma) {
      cs = t->read_raw(source, r.rbuf, h.addr, h.rkey, n, g);
      if (cs) lane = t;
      if (cs.code() != Code::unsupported) break;
    }
    if (!cs)
      g->complete(cs.code() == Code::peer_failure   ? HCOMM_ERR_PEER_FAILURE
                  : cs.code() == Code::device_error ? HCOMM_ERR_DEVICE
                                                    : HCOMM_ERR_PROTOCOL,
                  cs.message());
  }
  if (lane != nullptr && lane->finishes_alone()) r.held_by = lane;
  _pulls.push_back({rp, g, source, h.sreq, h.total, false, lane});
  finish_pulls();
}

void Context::finish_pulls() {
  for (auto it = _pulls.begin(); it != _pulls.end();) {
    if (!it->read->done()) {
      ++it;
      continue;
    }
    Request& r = *it->recv;
    hcomm_status_t st = it->read->status;
    std::string why;
    if (st != HCOMM_OK) {
      if (st != HCOMM_ERR_PEER_FAILURE && st != HCOMM_ERR_DEVICE && st != HCOMM_ERR_NO_RESOURCE) st = HCOMM_ERR_PROTOCOL;
      why = std::string(it->by_write ? "rendezvous write" : "rendezvous pull") + " from rank " +
            std::to_string(it->source) + ": " + it->read->error;
    }
    if (it->by_write) {
      // The sender completed at its write; nothing goes back. (A failure
      // here is its peer's failure, or its error WDONE.)
      if (r.exposed_by != nullptr) r.exposed_by->unexpose_recv(r, st == HCOMM_OK);
      r.exposed_by = nullptr;
    } else {
      MsgHdr f{};
      f.type = static_cast<uint32_t>(MsgType::fin);
      f.sreq = it->sreq;
      f.status = static_cast<uint32_t>(st);
      post_ctl(it->source, f);
    }
    if (st == HCOMM_OK && it->total > r.rlen) {
      st = HCOMM_ERR_TRUNCATED;
      why = "message of " + std::to_string(it->total) + " bytes, buffer of " + std::to_string(r.rlen);
    }
    r.complete(st, why);
    it = _pulls.erase(it);
  }
}

// Rendezvous by write, sender side: the receiver won the claim and names
// its buffer. Write the payload (at most what we sent) there.
void Context::on_cts(Peer& p, const MsgHdr& h) {
  auto it = _pending_sends.find(h.sreq);
  if (it == _pending_sends.end() || it->second->peer != p.rank)
    return peer_failed(p, "CTS for message " + std::to_string(h.sreq) + ", which is not a send waiting for it");
  // A copy: write_raw may wait for send-queue room, and a peer failure
  // noticed meanwhile erases the entry.
  const std::shared_ptr<Request> s = it->second;
  for (const Push& u : _pushes)
    if (u.send == s) return peer_failed(p, "a second CTS for message " + std::to_string(h.sreq));
  if (h.total == 0 || h.total > s->slen)
    return peer_failed(p, "CTS asks for " + std::to_string(h.total) + " bytes of a message of " +
                              std::to_string(s->slen));
  auto g = new_request();
  g->peer = p.rank;
  g->id = next_id();
  Status st = p.am->write_raw(p.rank, *s, h.total, h.addr, h.rkey, g);
  if (!st)
    g->complete(st.code() == Code::peer_failure ? HCOMM_ERR_PEER_FAILURE : to_hcomm(st.code()), st.message());
  _pushes.push_back({s, g, p.rank});
  finish_pushes();
}

void Context::finish_pushes() {
  for (auto it = _pushes.begin(); it != _pushes.end();) {
    if (!it->write->done()) {
      ++it;
      continue;
    }
    Request& s = *it->send;
    const hcomm_status_t st = it->write->status;
    if (!s.done()) {  // (a peer failure completed it already)
      MsgHdr d{};
      d.type = static_cast<uint32_t>(MsgType::wdone);
      d.sreq = s.id;
      d.status = static_cast<uint32_t>(st);
      post_ctl(it->dest, d);
      _pending_sends.erase(s.id);
      send_done(s, st == HCOMM_OK ? HCOMM_OK : st == HCOMM_ERR_DEVICE ? st : HCOMM_ERR_PEER_FAILURE,
                st == HCOMM_OK ? "" : "writing to the receiver: " + it->write->error);
    }
    it = _pushes.erase(it);
  }
}

Status Context::isend(int dest, const void* buf, size_t len, uint64_t tag, std::shared_ptr<Request>* out) {
  if (dest < 0 || dest >= _size) return Status::error(Code::invalid_argument, "destination rank %d of %d", dest, _size);
  if (buf == nullptr && len > 0) return Status::error(Code::invalid_argument, "null send buffer");
  if (dest != _rank) {
    // The fast path: an eager message the lane takes now is complete, and
    // needs no request (*out stays empty).
    Peer& p = _peers[static_cast<size_t>(dest)];
    if (!p.alive) return Status(Code::peer_failure, p.why_dead);
    if (p.backlog.empty() && len <= p.am->caps().max_short) {
      MsgHdr h{};
      h.type = static_cast<uint32_t>(MsgType::eager);
      h.len = static_cast<uint32_t>(len);
      h.tag = tag;
      h.total = len;
      h.sreq = _next_id++;
      if (p.am->am_send(dest, h, buf, len)) {
        out->reset();
        return Status::ok();
      }
    }
  }
  auto r = new_request();
  r->kind = Request::Kind::send;
  r->peer = dest;
  r->id = _next_id++;
  r->sbuf = static_cast<const uint8_t*>(buf);
  r->slen = len;
  r->tag = tag;
  *out = r;
  if (dest == _rank) {
    // To ourselves: match like any other message, copying directly.
    if (std::shared_ptr<Request> q = match_deferred() ? nullptr : take_posted(_rank, tag)) {
      size_t n = std::min(len, q->rlen);
      if (n > 0) std::memcpy(q->rbuf, buf, n);
      q->info = {_rank, tag, len};
      q->complete(len > q->rlen ? HCOMM_ERR_TRUNCATED : HCOMM_OK);
      r->complete(HCOMM_OK);
      return Status::ok();
    }
    MsgHdr h{};
    h.type = static_cast<uint32_t>(MsgType::eager);
    h.tag = tag;
    h.total = len;
    h.len = static_cast<uint32_t>(std::min<size_t>(len, UINT32_MAX));
    Unexpected& u = _unexpected.emplace_back();
    u.source = _rank;
    u.hdr = h;
    u.keep(r->sbuf, len);
    r->complete(HCOMM_OK);
    return Status::ok();
  }
  Peer& p = _peers[static_cast<size_t>(dest)];
  if (!p.alive) return Status(Code::peer_failure, p.why_dead);
  // In order behind anything already queued for this peer.
  if (!p.backlog.empty() || !try_send(p, r)) {
    // try_send may have found the peer failed (a lane reaping its queue):
    // its backlog is never sent again.
    if (!p.alive) {
      send_done(*r, HCOMM_ERR_PEER_FAILURE, p.why_dead);
      return Status::ok();
    }
    p.backlog.push_back(r);
    p.queued = true;
  }
  return Status::ok();
}

bool Context::isend_unlocked(int dest, const void* buf, size_t len, uint64_t tag) {
  if (dest < 0 || dest >= _size || dest == _rank || (buf == nullptr && len > 0)) return false;
  Peer& p = _peers[static_cast<size_t>(dest)];
  // Transport* and its caps are fixed at init; alive and queued are atomics.
  if (p.am == nullptr || !p.am->caps().am_concurrent || len > p.am->caps().max_short || !p.alive || p.queued)
    return false;
  MsgHdr h{};
  h.type = static_cast<uint32_t>(MsgType::eager);
  h.len = static_cast<uint32_t>(len);
  h.tag = tag;
  h.total = len;
  return p.am->am_send(dest, h, buf, len);
}

Status Context::irecv(int source, void* buf, size_t len, uint64_t tag, uint64_t mask,
                      std::shared_ptr<Request>* out) {
  if (source != HCOMM_ANY_SOURCE && (source < 0 || source >= _size))
    return Status::error(Code::invalid_argument, "source rank %d of %d", source, _size);
  if (buf == nullptr && len > 0) return Status::error(Code::invalid_argument, "null receive buffer");
  // *out is the request's one reference besides the posted list's.
  std::shared_ptr<Request>& r = *out = new_request();
  r->kind = Request::Kind::recv;
  r->peer = source;
  r->id = _next_id++;
  r->rbuf = static_cast<uint8_t*>(buf);
  r->rlen = len;
  r->tag = tag;
  r->tag_mask = mask;
  // No progress here: a message still in a lane's ring is matched, in
  // arrival order, against this receive once progress takes it; only what
  // already sits in the unexpected queue is earlier than any of those.
  // While a claim is in flight, matching waits (see rematch): post.
  bool posted = false;
  for (auto it = _unexpected.begin(); it != _unexpected.end() && !match_deferred();) {
    if (!((source == HCOMM_ANY_SOURCE || source == it->source) && tag_match(it->hdr.tag, tag, mask))) {
      ++it;
      continue;
    }
    Unexpected u = std::move(*it);
    it = _unexpected.erase(it);
    if (u.hdr.type == static_cast<uint32_t>(MsgType::eager)) {
      if (posted) _posted.remove(r);
      deliver_eager(*r, u.source, u.hdr, u.payload());
      return Status::ok();
    }
    if (!posted) _posted.push_back(r);
    posted = true;
    start_claim(r, u.source, u.hdr);
    if (took_rendezvous(r)) return Status::ok();
    // The sender had retracted it: look further.
  }
  if (posted) return Status::ok();
  if (source != HCOMM_ANY_SOURCE && source != _rank && !_peers[static_cast<size_t>(source)].alive) {
    Status st(Code::peer_failure, _peers[static_cast<size_t>(source)].why_dead);
    out->reset();
    return st;
  }
  _posted.push_back(r);
  return Status::ok();
}

Status Context::probe(int source, uint64_t tag, uint64_t mask, bool* found, hcomm_recv_info_t* info) {
  if (source != HCOMM_ANY_SOURCE && (source < 0 || source >= _size))
    return Status::error(Code::invalid_argument, "source rank %d of %d", source, _size);
  progress();
  *found = false;
  for (const Unexpected& u : _unexpected) {
    if ((source == HCOMM_ANY_SOURCE || source == u.source) && tag_match(u.hdr.tag, tag, mask)) {
      *found = true;
      if (info != nullptr) *info = {u.source, u.hdr.tag, static_cast<size_t>(u.hdr.total)};
      return Status::ok();
    }
  }
  if (source != HCOMM_ANY_SOURCE && source != _rank && !_peers[static_cast<size_t>(source)].alive)
    return Status(Code::peer_failure, _peers[static_cast<size_t>(source)].why_dead);
  return Status::ok();
}

}  // namespace hcomm::api
