// verbs: RDMA through rdma-core (libibverbs), one RC queue pair per peer
// (the rank itself included: its own memory goes through the NIC when the
// NIC is the atomicity agent). Kernel bypass: posting and polling are user
// space (the provider's rings); only setup calls enter the kernel.
//
// Messaging: SEND_WITH_IMM of a 64-byte MsgHdr + up to kEagerMax bytes from
// a per-peer ring of registered bounce slots into receive buffers the peer
// pre-posted (kRecvDepth per pair). Credit-based flow control: a sender
// spends one credit per SEND and never sends without one (so no RNR NAK in
// normal operation); the receiver returns credits in the immediate data of
// its own sends, or alone (a zero-length SEND) once half its buffers were
// consumed; one buffer per pair is kept for those credit messages. AM SENDs
// are signalled every kSignalEvery posts (a completion retires every earlier
// slot of that queue pair).
// Rendezvous: the sender exposes its buffer (its registration if it is hcomm
// memory, else an ibv_reg_mr for this message, deregistered at FIN or at
// its write's completion). By write (Caps::rndv_write; the default from
// 128 KiB): the
// receiver exposes its buffer the same way (REMOTE_WRITE; deregistered at
// WDONE) and names it in a CTS, the sender RDMA WRITEs the payload straight
// into it. By read (below 128 KiB, or HCOMM_RNDV=get): the receiver RDMA READs the sender's
// buffer straight into the receive buffer (registered the same way), then
// sends FIN.
// One-sided: put = RDMA WRITE (inline when it fits), get = RDMA READ, both
// split at the port's max message size. Implicit (the _nbi calls,
// Caps::implicit): no request and no completion of their own; one is
// signalled when no signalled request to its peer is in flight, and one in
// kSignalEvery posts to retire send-queue entries; flush posts a
// signalled zero-byte WRITE behind any that trail (its completion, in queue
// order, says they are placed), and the error completion the NIC gives an
// unsignalled request that fails, or the pair's failure with some still
// unretired, reaches the context (AmSink::on_implicit_failed) for the next
// flush to report; fetch_add / compare_swap = the NIC's
// 64-bit atomics; put_notify = the data WRITE, and only once it completed
// (acknowledged: placed at the target) the WRITE of the notify word;
// accumulate = under the owner's lock word (taken and released with NIC
// compare-swap): READ, reduce here, WRITE, in chunks of kAccChunk. The
// NIC's atomics are self-tested once per device and port in the process,
// before the first fetch atomic or accumulate (check_atomics).
// Keys: each rank publishes its registrations in a table peers can RDMA READ
// (import checks the key against it: forged, stale and revoked keys are
// refused before anything is posted) and holds a revocation mailbox per
// peer, so a revoked key is refused locally, by a load, and the NIC never
// sees it (a remote access NAK would break the pair). Releasing memory:
//  1. RDMA WRITE the revoked generation into every peer's mailbox; wait for
//     those writes to complete (placed at the peers);
//  2. RDMA WRITE a revocation number (per owner, increasing) into the notice
//     word of every peer whose mailbox write completed;
//  3. wait for those peers to RDMA WRITE that number back into our ack word.
//     A peer writes it (acknowledge(): from progress, barriers and other
//     waits) on its own queue pair to us, behind everything it posted before
//     it saw the notice and fenced (IBV_SEND_FENCE: only once its earlier
//     READs and atomics have their responses, so none of them is asked
//     again after we deregister), and it checks the mailbox again right
//     before each post (rma(), each accumulate chunk, the notify word of
//     put_notify): so when the ack lands, every access that passed the check
//     before the revocation has run at our NIC, and none after it will be
//     posted;
//  4. deregister. A peer that does not acknowledge within
//     RevocationMailbox::ack_wait (it makes no hcomm call) is not waited for
//     longer: what it posted before has had the queue pair's retry bound to
//     run.
#pragma once

#include <infiniband/verbs.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "api/proto/verbs_wire.h"
#include "api/transport/transport.h"
#include "api/wireup/bootstrap.h"
#include "common/time.h"

namespace hcomm::api {

class Context;
class RevocationMailbox;

struct VerbsConfig {
  std::string device;     // HCOMM_IB_DEVICE ("" = first with an active port)
  int port = 0;           // HCOMM_IB_PORT (0 = first active)
  std::string gid;        // HCOMM_IB_GID: an index or an IP address ("" = automatic)
  int timeout = 14;       // HCOMM_IB_TIMEOUT: local ACK timeout, 4.096 us * 2^timeout
  int retry = 7;          // HCOMM_IB_RETRY: transport retries (0..7)
  size_t max_msg = 0;     // HCOMM_IB_MAX_MSG: largest request posted (0 = the port's max_msg_sz)
  static Status from_env(VerbsConfig* out);
};

class VerbsTransport final : public Transport {
 public:
  static constexpr uint32_t kRecvDepth = 32;
  static constexpr uint32_t kSendRing = 64;
  static constexpr uint32_t kSlot = 4096;
  static constexpr uint32_t kEagerMax = kSlot - sizeof(MsgHdr);
  static constexpr uint32_t kSignalEvery = 16;
  static constexpr size_t kAccChunk = 1u << 20;

  // Opens the device, port and GID, the protection domain, completion queues,
  // the registration table and mailboxes, and one queue pair per rank.
  static Status open(Context& ctx, AmSink& sink, const VerbsConfig& cfg, std::unique_ptr<VerbsTransport>* out);
  ~VerbsTransport() override;
  // Collective: every rank that wanted verbs calls it (absent = a rank whose
  // open failed, why in `absent`); exchanges QPN, GID, PSN, MTU and table
  // addresses through the bootstrap, brings every queue pair to RTS and
  // posts the receive buffers.
  static Status connect(Bootstrap& boot, VerbsTransport* self, const std::string& absent, const Deadline& dl,
                        std::vector<bool>* have);

  TransportId id() const override { return TransportId::verbs; }
  const Caps& caps() const override { return _caps; }
  bool reaches(int peer, bool /*same_host*/) const override { return _peers[static_cast<size_t>(peer)].up; }
  Status mem_add(hcomm_mem& m) override;
  void mem_remove(hcomm_mem& m) override;
  bool pack(const hcomm_mem& m, uint8_t* sec, size_t* len) const override;
  Status import(hcomm_rkey& k, const uint8_t* sec, size_t len) override;
  Status validate(const hcomm_rkey& k) const override;
  Status rma(const RmaOp& op, const std::shared_ptr<Request>& r) override;
  Status flush(int peer, const Deadline& dl) override;
  bool am_send(int peer, const MsgHdr& h, const void* payload, size_t len) override;
  Status expose(Request& r, MsgHdr& h) override;
  void unexpose(Request& r) override;
  Status read_raw(int peer, void* local, uint64_t addr, uint32_t rkey, size_t len,
                  const std::shared_ptr<Request>& g) override;
  Status expose_recv(int peer, Request& r, size_t len, uint64_t* addr, uint32_t* rkey) override;
  void unexpose_recv(Request& r, bool arrived) override;
  Status write_raw(int peer, const Request& s, size_t len, uint64_t addr, uint32_t rkey,
                   const std::shared_ptr<Request>& g) override;
  void progress() override;
  // The queue pair reports a lost peer after its ACK timeout (4.096 us x
  // 2^timeout) times (retries + 1).
  std::chrono::milliseconds stall_bound() const override {
    if (_timeout == 0) return std::chrono::milliseconds(0);  // no ACK timeout: the keepalive decides
    const double ms = 4.096e-3 * static_cast<double>(uint64_t{1} << _timeout) * (_retry + 1);
    return std::chrono::milliseconds(static_cast<int64_t>(ms) + 1);
  }
  void peer_failed(int peer, const std::string& why) override;
  // Answers revocation notices (see "Keys" above).
  bool acknowledge() override;

  const std::string& device_name() const { return _dev_name; }
  // Soft-RoCE / soft-iWARP: the "NIC" is kernel code running on our CPUs.
  bool software() const { return _dev_name.rfind("rxe", 0) == 0 || _dev_name.rfind("siw", 0) == 0; }

 private:
  struct Op {  // one signalled work request in flight
    std::shared_ptr<Request> r;
    ibv_mr* own_mr = nullptr;     // registered for this operation only
    // put_notify: posted once the data WRITE completed
    uint64_t notify_addr = 0, notify_value = 0;
    uint32_t notify_rkey = 0;
    uint32_t notify_slot = 0, notify_gen = 0;  // its key, checked again right before the word is posted
    uint64_t* result = nullptr;   // fetch atomics: copy the scratch slot here
    int scratch = -1;
    bool sync = false;            // a synchronous wait owns it (sync_done)
    bool live = false;            // in flight (its slot of VPeer::ops)
  };
  // Signalled work requests in flight, per queue pair, in the slot of their
  // sequence number: fewer than kSqDepth are ever posted and not retired
  // (post() waits for room), so live slots never collide; no allocation or
  // tree per operation.
  static constexpr uint32_t kSqDepth = 256;
  // Work requests one queue pair holds posted and not retired, at most
  // (post() waits for room): below max_send_wr, and below kSqDepth.
  static constexpr uint64_t kSqRoom = 255;
  static_assert(kSqDepth > kSqRoom, "a live slot could be reused");
  struct VPeer {
    ibv_qp* qp = nullptr;
    bool up = false;
    uint32_t credits = 0;         // receive buffers the peer has for us
    uint32_t grant_owed = 0;      // buffers we reposted and have not told the peer about
    uint64_t sq_posted = 0, sq_retired = 0;  // work requests on this QP (seq numbers)
    std::vector<Op> ops;          // kSqDepth slots: signalled requests in flight by seq % kSqDepth
    uint32_t async_ops = 0;       // live ops no synchronous wait owns (what flush waits for)
    uint64_t am_posted = 0, am_slot_seq[kSendRing] = {};  // AM ring: seq of the WR using each slot
    uint32_t unsignaled = 0;
    // Implicit (request-less) WRITEs and READs: the sequence number after the
    // last one (those below sq_retired are done), and the one after the last
    // signalled request (a later completion covers every earlier request).
    uint64_t implicit_end = 0, signalled_end = 0;
    uint32_t notice_acked = 0;    // the last revocation number of this peer's we acknowledged
    std::string down;             // why the pair failed (peer_failed), for what is refused after
    // the peer's table, locks and our mailbox there
    uint64_t table_addr = 0, locks_addr = 0, mailbox_addr = 0;
    uint32_t table_rkey = 0, locks_rkey = 0, mailbox_rkey = 0;
  };
  VerbsTransport(Context& ctx, AmSink& sink);
  Status setup(const VerbsConfig& cfg);
  Status choose_gid(const VerbsConfig& cfg);
  Status reg(void* addr, size_t len, int access, ibv_mr** out, const char* what);
  Status bring_up(int peer, uint32_t qpn, const ibv_gid& gid, uint16_t lid, ibv_mtu mtu, uint32_t psn);
  std::string wire_blob() const;
  // peer_failure: the pair to `peer` is down, and why.
  Status down(int peer) const;
  // Waits for send-queue room until `room` (nullptr: 30 s). Sets wr.wr_id:
  // the sequence number is known only then (while it waits, complete_op may
  // post a put_notify's word).
  Status post(int peer, ibv_send_wr& wr, Op op, bool signalled, const Deadline* room = nullptr);
  // r == nullptr: implicit (see "Implicit" above).
  Status post_rdma(int peer, ibv_wr_opcode opc, void* local, uint32_t lkey, uint64_t raddr, uint32_t rkey, size_t len,
                   const std::shared_ptr<Request>& r, ibv_mr* own_mr);
  // The implicit requests to `peer` from sequence number `seq` on will not
  // complete: tells the context (once), for its next flush to report.
  void implicit_lost(int peer, uint64_t seq, hcomm_status_t st, const std::string& why);
  bool send_credit(int peer);
  void poll_send();
  void poll_recv();
  void complete_op(uint64_t wr_id, const ibv_wc& wc);
  Status sync_wait(uint64_t wr_id, const Deadline& dl, const char* what);
  Status sync_rdma(int peer, ibv_wr_opcode opc, void* local, uint32_t lkey, uint64_t raddr, uint32_t rkey, size_t len,
                   const char* what);
  Status sync_atomic(int peer, ibv_wr_opcode opc, uint64_t raddr, uint32_t rkey, uint64_t compare_add, uint64_t swap,
                     uint64_t* old);
  Status accumulate(const RmaOp& a);
  // The NIC's atomics, self-tested before their first use (check_atomics).
  Status atomics_ok() { return _atomics_tested ? _atomics : check_atomics(); }
  Status check_atomics();
  // Our revocation mailbox (api/transport/revocation.h).
  RevocationMailbox mb() const;
  // Steps 2 and 3 of a release, with the peers that took step 1: the
  // notices, then the acknowledgements.
  void await_acks(const std::vector<int>& told);
  // WRITEs `value` (from scratch word `from`) into word `word` of the
  // mailbox of each live rank in `peers` but us, and waits for those
  // writes: the ranks whose write completed.
  std::vector<int> write_peers(const std::vector<int>& peers, int from, uint32_t value, size_t word, const char* what);
  // known: the registration holding [p, p+len) when the caller found it already.
  Status lkey_of(const void* p, size_t len, uint32_t* lkey, ibv_mr** own, const hcomm_mem* known = nullptr);
  uint64_t wr_id(int peer, uint64_t seq) const { return (uint64_t(uint32_t(peer)) << 40) | (seq & ((1ull << 40) - 1)); }
  uint8_t* recv_buf(int peer, uint32_t i) const;
  uint8_t* send_buf(int peer, uint32_t i) const;

  Context& _ctx;
  AmSink& _sink;
  Caps _caps;
  int _rank, _size;
  std::string _dev_name;
  ibv_context* _dev = nullptr;
  ibv_pd* _pd = nullptr;
  ibv_cq* _scq = nullptr;
  ibv_cq* _rcq = nullptr;
  uint8_t _port = 1;
  ibv_port_attr _port_attr{};
  ibv_device_attr _dev_attr{};
  int _gid_index = -1;
  ibv_gid _gid{};
  uint32_t _max_inline = 0;
  uint32_t _max_msg = 0;
  uint32_t _psn = 0;
  int _timeout = 14, _retry = 7;
  std::vector<VPeer> _peers;
  // AM buffers: recv [size][kRecvDepth][kSlot], then send [size][kSendRing][kSlot]
  std::vector<uint8_t> _am_mem;
  ibv_mr* _am_mr = nullptr;
  // registration table (RegEntry x kMaxRegs) + lock words, readable/atomic by peers
  std::vector<RegTableEntry> _table;  // followed by locks in _locks
  std::vector<uint64_t> _locks;
  ibv_mr* _table_mr = nullptr;
  ibv_mr* _locks_mr = nullptr;
  // revocation mailboxes (RevocationMailbox's layout)
  std::vector<uint32_t> _mailbox;
  uint32_t _revocations = 0;  // our latest revocation number
  bool _atomics_tested = false;
  Status _atomics;  // the atomics self-test's verdict, once _atomics_tested
  ibv_mr* _mailbox_mr = nullptr;
  // scratch: fetch results, import reads, accumulate bounce
  std::vector<uint64_t> _scratch;
  ibv_mr* _scratch_mr = nullptr;
  std::vector<int> _scratch_free;
  std::vector<uint8_t> _bounce;
  ibv_mr* _bounce_mr = nullptr;
  std::map<uint64_t, ibv_wc> _sync_done;  // completions that a synchronous wait collects
  std::set<uint64_t> _sync_abandoned;     // synchronous requests whose wait timed out
};

}  // namespace hcomm::api
