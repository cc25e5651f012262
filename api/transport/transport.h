// The seam between protocols (api/proto) and transports (api/transport/*),
// in the spirit of UCX's ucp/uct split, but small.
//
// A Transport is one way of moving bytes, opened once per context: shm (the
// pair's shared-memory channels and memfd-mapped memory), cma (process_vm_*
// into memory a peer merely registered), npu (this rank's NPU DMA queue and
// the node's fabric), verbs (RC queue pairs through rdma-core), npu_roce (RC
// queue pairs of this rank's NPU's own RoCEv2 engine, to other nodes). It says what
// it can do (Caps) and which peers it reaches; the context picks, per peer,
// one messaging lane (the transport that carries the protocol's active
// messages: eager payloads, rendezvous headers, FINs) and an ordered list of
// RMA lanes. A remote key is imported onto the first RMA lane of its peer
// whose transport put a section into the packed key (api/mem/memory.h).
//
// Ownership and threading: transports belong to the Context and are called
// with the context lock held, except rma() and validate() of synchronous
// lanes (shm, cma), which the one-sided fast path calls from any thread
// without it: they read only what stays put after wire-up. Hot-path calls are virtual: one indirect call
// per operation, next to a memcpy or a descriptor write.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "api/include/hcomm/hcomm.h"
#include "common/status.h"
#include "common/time.h"

struct hcomm_mem;
struct hcomm_rkey;

namespace hcomm::api {

struct Request;

// Wire ids: they appear in packed keys (api/mem/memory.h), never renumber.
enum class TransportId : uint8_t { shm = 1, cma = 2, npu = 3, verbs = 4, npu_roce = 5 };
inline constexpr int kTransportKinds = 6;
const char* transport_name(TransportId id);

struct Caps {
  size_t max_short = 0;       // largest active-message payload (eager), 0 = no messaging
  size_t max_zcopy = 0;       // largest single RMA the transport posts (0 = no limit)
  bool put = false, get = false;
  bool atomic64 = false;      // 64-bit fetch_add / compare_swap
  bool reduce = false;        // accumulate (native or emulated, element-wise atomic)
  bool notify = false;        // put_notify ordered on the lane itself
  bool remote_hosts = false;  // reaches peers on other hosts
  bool sync = false;          // every RMA is complete at the target when rma() returns
  // am_send may be called on several threads at once without the context
  // lock (it serialises each peer's stream itself): the eager fast path.
  bool am_concurrent = false;
  // Rendezvous by the sender's write: expose_recv / write_raw below (a
  // receiver sends CTS naming its buffer; the sender writes the payload).
  bool rndv_write = false;
  // A peer's release waits for this transport's acknowledge() (revocation
  // notices): the context answers them while it waits in a collective.
  bool acknowledges = false;
  // rma() takes put and get without a request (RmaOp::implicit, the _nbi
  // calls): a failure reaches the context through
  // AmSink::on_implicit_failed, and flush(peer) returns only once they
  // completed.
  bool implicit = false;
};

// ---- active messages: the protocol's headers (64 bytes, then payload) ----
// cts (receiver -> sender, rendezvous by write): addr/rkey name the receive
// buffer, total the bytes to write; wdone (sender -> receiver): they are
// written (status: the write's hcomm_status_t).
enum class MsgType : uint32_t { eager = 1, rts = 2, fin = 3, retract = 4, cts = 5, wdone = 6 };
inline constexpr uint32_t kLastMsgType = static_cast<uint32_t>(MsgType::wdone);
inline constexpr uint32_t kNoSlot = 0xffffffffu;

struct MsgHdr {
  uint32_t type;     // MsgType
  uint32_t len;      // payload bytes carried with this header (eager)
  uint64_t tag;
  uint64_t total;    // message length
  uint64_t sreq;     // sender's request id (rts/fin/retract/cts/wdone)
  uint64_t addr;     // rts: sender's buffer address; cts: receiver's buffer address
  uint32_t src_slot; // rts: registration of the sender's buffer (kNoSlot if none)
  uint32_t src_gen;
  uint64_t src_off;  // rts: offset of the buffer in that registration
  uint32_t status;   // fin: hcomm_status_t of the receiver's pull; wdone: of the sender's write;
                     // rts: the sender's claim word (kNoSlot: none)
  uint32_t rkey;     // rts / cts: the key of the sender's / receiver's buffer on a lane that needs one
};
static_assert(sizeof(MsgHdr) == 64);

// What the context gives transports: delivery of inbound active messages and
// peer failure reports. Implemented by the Context.
class AmSink {
 public:
  virtual ~AmSink() = default;
  // One inbound message from `peer` (header copied once and checked for
  // form by the transport; payload valid only during the call).
  virtual void on_am(int peer, const MsgHdr& h, const uint8_t* payload) = 0;
  virtual void on_peer_failed(int peer, const std::string& why) = 0;
  // An implicit operation (RmaOp::implicit) to `peer` failed or will not
  // complete: the next flush covering the peer reports it.
  virtual void on_implicit_failed(int peer, hcomm_status_t st, const std::string& why) = 0;
};

// A message whose later part could not be posted (its pair failed, or the
// queue stayed full past the deadline) after `posted` of its `len` bytes:
// what is posted runs on while the call returns, so the pair fails (its
// queue pair to error: the engine stops touching the buffers) and the
// caller learns it. Nothing posted yet: `st` as it is. (verbs, npu_roce)
inline Status cut_short(AmSink& sink, bool pair_up, const char* lane, int peer, size_t posted, size_t len,
                        const Status& st) {
  if (posted == 0) return st;
  Status cut = Status::error(Code::peer_failure, "%s: a message to rank %d cut short after %zu of %zu bytes: %s", lane,
                             peer, posted, len, st.message().c_str());
  if (pair_up) sink.on_peer_failed(peer, cut.message());
  return cut;
}

// One remote-memory operation on an already-checked key.
enum class Rma { put, get, acc, fetch_add, cswap, notify };
struct RmaOp {
  // User-provided (members keep their defaults): GCC then stores each field
  // instead of clearing the whole struct with `rep stos`, which cost more than
  // the rest of an 8-byte put on the fast path.
  RmaOp() noexcept {}  // NOLINT(modernize-use-equals-default)
  Rma op = Rma::put;
  uint8_t* local = nullptr;  // inside local_mem (put/get/acc)
  // Set by the checks; synchronous lanes must not dereference it (on the
  // unlocked fast path it only proves the buffer was registered).
  const hcomm_mem* local_mem = nullptr;
  size_t len = 0;            // bytes
  hcomm_rkey* rkey = nullptr;
  uint64_t roff = 0;
  hcomm_dtype_t dtype = HCOMM_INT8;
  hcomm_op_t redop = HCOMM_SUM;
  uint64_t operand = 0, compare = 0;  // fetch_add / cswap; notify: the value
  uint64_t* old_value = nullptr;
  hcomm_rkey* notify_rkey = nullptr;  // put_notify on one lane (Caps::notify)
  uint64_t notify_off = 0;
  uint64_t notify_value = 0;
  bool fence = false;  // start after every earlier operation of this lane completed
  // _nbi: the caller keeps no request. A lane with Caps::implicit then runs
  // a put or get with none (rma(op, nullptr)); the context passes one
  // otherwise.
  bool implicit = false;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual TransportId id() const = 0;
  const char* name() const { return transport_name(id()); }
  virtual const Caps& caps() const = 0;
  // Whether this transport can serve `peer` (same_host: shares this host).
  virtual bool reaches(int peer, bool same_host) const = 0;

  // ---- memory: called for every registration of the context ----
  // Make m reachable through this transport (map it into a device, register
  // it with a NIC); a transport that needs nothing returns ok.
  virtual Status mem_add(hcomm_mem& /*m*/) { return Status::ok(); }
  virtual void mem_remove(hcomm_mem& /*m*/) {}
  // The transport's section of m's packed key (at most kMaxSection bytes);
  // false when this transport cannot reach m.
  static constexpr size_t kMaxSection = 24;
  virtual bool pack(const hcomm_mem& m, uint8_t* sec, size_t* len) const = 0;
  // Binds k (header already validated by the context) to this lane from its
  // section; unsupported when this lane cannot reach that memory after all.
  virtual Status import(hcomm_rkey& k, const uint8_t* sec, size_t len) = 0;
  virtual Status unimport(hcomm_rkey& /*k*/) { return Status::ok(); }
  // Per-access validity beyond bounds and rights (e.g. the owner's live
  // generation): access_denied once the owner revoked the memory.
  virtual Status validate(const hcomm_rkey& /*k*/) const { return Status::ok(); }

  // ---- one-sided ----
  // r == nullptr when caps().sync (the call completes the operation) or for
  // an implicit put or get on a lane with caps().implicit. Otherwise the
  // transport completes r later, from progress().
  virtual Status rma(const RmaOp& op, const std::shared_ptr<Request>& r) = 0;
  // Waits until every operation of this lane (to `peer`, or all: -1)
  // completed at its target.
  virtual Status flush(int /*peer*/, const Deadline& /*dl*/) { return Status::ok(); }

  // ---- active messages (caps().max_short > 0) ----
  // Queues one message; false when there is no room now (try again after
  // progress). len <= caps().max_short.
  virtual bool am_send(int /*peer*/, const MsgHdr& /*h*/, const void* /*payload*/, size_t /*len*/) { return false; }
  // Rendezvous, sender side: make the send buffer of r readable by the peer
  // (fills h.rkey); unexpose once the receiver's FIN came (or the peer failed).
  virtual Status expose(Request& /*r*/, MsgHdr& /*h*/) { return Status::ok(); }
  virtual void unexpose(Request& /*r*/) {}
  // Rendezvous, receiver side: a zero-copy read of [addr, addr+len) of the
  // peer's buffer (rkey from its RTS) into local, completing g (a synchronous
  // lane completes it before returning); unsupported when the transport
  // cannot.
  virtual Status read_raw(int /*peer*/, void* /*local*/, uint64_t /*addr*/, uint32_t /*rkey*/, size_t /*len*/,
                          const std::shared_ptr<Request>& /*g*/) {
    return Status::error(Code::unsupported, "%s cannot read a peer's unregistered memory", name());
  }

  // Rendezvous by write (caps().rndv_write), receiver side: make [r.rbuf,
  // r.rbuf+len) writable by `peer` (fills *addr and *rkey for the CTS; may
  // stage it); the request's exposed / exposed_by hold what it took.
  // unexpose_recv releases it once the sender's WDONE came (arrived: the
  // bytes are in, copy staged ones out) or the transfer failed.
  virtual Status expose_recv(int /*peer*/, Request& /*r*/, size_t /*len*/, uint64_t* /*addr*/, uint32_t* /*rkey*/) {
    return Status::error(Code::unsupported, "%s cannot expose a receive buffer", name());
  }
  virtual void unexpose_recv(Request& /*r*/, bool /*arrived*/) {}
  // Sender side: write the first len bytes of the exposed send `s` to the
  // receiver's [addr, addr+len), completing g once they are placed there.
  virtual Status write_raw(int /*peer*/, const Request& /*s*/, size_t /*len*/, uint64_t /*addr*/, uint32_t /*rkey*/,
                           const std::shared_ptr<Request>& /*g*/) {
    return Status::error(Code::unsupported, "%s cannot write a peer's receive buffer", name());
  }

  // Completions and inbound messages.
  virtual void progress() {}
  // What peers wait on us for that needs no protocol step (verbs: answering
  // a revocation notice): called by progress and by waits that make none
  // (barriers, the bootstrap). Returns whether it found a notice to answer.
  // Only transports whose caps() say `acknowledges` do anything here.
  virtual bool acknowledge() { return false; }
  // How long an operation already handed to this transport can go on
  // before the transport itself reports it failed (verbs: the queue pair's
  // ACK timeout times its retries); part of the cancel bound.
  virtual std::chrono::milliseconds stall_bound() const { return std::chrono::milliseconds(0); }
  // A mark that moves while this transport makes progress toward `peer`
  // (completions, frames on its port): a cancel that waits for an operation
  // in flight keeps waiting, a bound at a time, while it moves. An operation
  // that stops moving fails by itself within stall_bound(). 0: no such mark.
  virtual uint64_t progress_mark(int /*peer*/) { return 0; }
  // Called every peer_check_ms by the context's liveness check: a transport
  // whose device vanished fails what is pending on it, and later operations.
  virtual void check_health() {}
  // The peer failed: fail what is queued for it.
  virtual void peer_failed(int /*peer*/, const std::string& /*why*/) {}
  // Operations handed to this transport end by themselves whatever becomes
  // of the peer (a local DMA engine completes every descriptor it took, or
  // the device is lost and check_health fails them): a peer's failure must
  // not complete them early, since the engine may still be writing into the
  // caller's buffer. False: peer_failed stops the transport touching our
  // memory for that peer (verbs: the queue pair goes to error), and the
  // context fails what is left.
  virtual bool finishes_alone() const { return false; }
};

}  // namespace hcomm::api
