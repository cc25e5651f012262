// npu_roce: the NPU's own RoCEv2 engine (docs/device-abi.md §15-§16) for
// peers on other nodes, with no host NIC in the path. One RC queue pair of
// this rank's device per peer on another node; work requests go straight
// onto the queue pair's rings in DMA memory (hal::npu::RdmaQp), completions
// come back through its completion ring. The mirror of api/transport/verbs
// with the engine's native operations:
//   put = RDMA WRITE, get = RDMA READ (split at kMaxMsg); fetch_add /
//   compare_swap = the engine's 64-bit atomics; accumulate = WRITE_REDUCE
//   (the target's engine reduces the payload into its memory, serialised
//   with the DMA engines' REDUCEs there); put_notify = the data WRITE and
//   the notify WRITE posted back to back (the responder places a queue
//   pair's WRITEs in PSN order, §16.3, so the word never lands before the
//   data).
// Zero-copy: registered memory (host pages or HBM) is the device's own
// mapping (the npu transport's ATT entry) plus a memory key of the engine.
// Memory that is not registered (a rendezvous from or into a plain buffer)
// is staged once through a DMA buffer of this message.
// Messaging: SEND_IMM of a 64-byte MsgHdr + up to kEagerMax bytes from a
// per-peer ring of send slots into receive buffers the peer pre-posted,
// with the same credit scheme as verbs (grants in the immediate data; one
// buffer kept for credit-only messages; never an RNR NAK in normal work).
// Keys: each rank publishes its registrations in a table peers RDMA READ
// at import (forged, stale and revoked keys are refused before anything is
// posted) and holds a revocation mailbox per peer that releasing memory
// RDMA WRITEs into (waited for), then a revocation number every peer WRITEs
// back on its own queue pair (acknowledge()) before the engine's key is
// invalidated, as verbs does (api/transport/verbs/verbs.h, "Keys"): a
// revoked key is refused by a load here, checked again right before each
// post, and the engine never NAKs one (a remote access NAK would put the
// pair in ERR).
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "api/proto/verbs_wire.h"
#include "api/transport/transport.h"
#include "api/wireup/bootstrap.h"
#include "common/time.h"
#include "driver/dma_memory.h"
#include "hal/npu/device.h"
#include "hal/npu/rdma_qp.h"

namespace hcomm::api {

class Context;
class RevocationMailbox;

struct NpuRoceConfig {
  int timeout = 14;  // HCOMM_ROCE_TIMEOUT: local ACK timeout, 4.096 us * 2^timeout (1..31)
  int retry = 7;     // HCOMM_ROCE_RETRY: retransmissions before RETRY_EXC_ERR (0..7)
  static Status from_env(NpuRoceConfig* out);
};

class NpuRoceTransport final : public Transport {
 public:
  static constexpr uint32_t kRecvDepth = 32;
  static constexpr uint32_t kSendRing = 64;
  static constexpr uint32_t kSlot = 4096;
  static constexpr uint32_t kEagerMax = kSlot - sizeof(MsgHdr);
  static constexpr uint64_t kMaxMsg = uint64_t{1} << 30;

  // Creates, on `dev` (the npu transport's device), the message buffers,
  // registration table, mailboxes and one queue pair per rank on another
  // node (same_host[r] false).
  static Status open(Context& ctx, AmSink& sink, hal::npu::Device& dev, const NpuRoceConfig& cfg,
                     const std::vector<bool>& same_host, std::unique_ptr<NpuRoceTransport>* out);
  ~NpuRoceTransport() override;
  // Collective over every rank (absent: a rank without it, why in
  // `absent`): exchanges port address, QPNs, PSN, MTU and table addresses,
  // brings each queue pair to RTS and posts the receive buffers.
  static Status connect(Bootstrap& boot, NpuRoceTransport* self, const std::string& absent, const Deadline& dl,
                        std::vector<bool>* have);

  TransportId id() const override { return TransportId::npu_roce; }
  const Caps& caps() const override { return _caps; }
  bool reaches(int peer, bool same_host) const override {
    return !same_host && _peers[static_cast<size_t>(peer)].up;
  }
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
  Status expose_recv(int peer, Request& r, size_t len, uint64_t* addr, uint32_t* rkey) override;
  void unexpose_recv(Request& r, bool arrived) override;
  Status write_raw(int peer, const Request& s, size_t len, uint64_t addr, uint32_t rkey,
                   const std::shared_ptr<Request>& g) override;
  Status read_raw(int peer, void* local, uint64_t addr, uint32_t rkey, size_t len,
                  const std::shared_ptr<Request>& g) override;
  void progress() override;
  // A queue pair reports a lost peer after its ACK timeout times (retries + 1).
  std::chrono::milliseconds stall_bound() const override {
    const double ms = 4.096e-3 * static_cast<double>(uint64_t{1} << _timeout) * (_retry + 1);
    return std::chrono::milliseconds(static_cast<int64_t>(ms) + 1);
  }
  // Completions from the peer's queue pair plus the port's frame counters:
  // a long transfer on a lossy wire is slow, not stuck.
  uint64_t progress_mark(int peer) override;
  void check_health() override;
  void peer_failed(int peer, const std::string& why) override;
  bool acknowledge() override;

 private:
  // DMA memory the engine reaches: pages, their ATT mapping, a memory key.
  struct Region {
    driver::DmaBuffer buf;
    hal::npu::Mapping map;
    uint32_t key = 0;
    size_t len = 0;  // bytes asked for
    uint8_t* data() const { return static_cast<uint8_t*>(buf.data()); }
  };
  struct Op {  // one work request in flight (every one is signalled)
    std::shared_ptr<Request> r;
    uint64_t* result = nullptr;  // fetch atomics: copy the scratch word here
    int scratch = -1;            // scratch word held until completion
    bool sync = false;           // a synchronous wait collects it (_sync_done)
    std::shared_ptr<Region> staging;  // read_raw into a plain buffer: copy out, then free
    uint8_t* copy_to = nullptr;
    size_t copy_len = 0;
  };
  struct RPeer {
    std::unique_ptr<hal::npu::RdmaQp> qp;
    bool up = false;
    uint32_t credits = 0;     // receive buffers the peer has for us
    uint32_t grant_owed = 0;  // buffers we reposted and have not told the peer about
    uint64_t posted = 0, retired = 0;  // send work requests (seq numbers; completions come in order)
    uint64_t am_posted = 0, am_slot_seq[kSendRing] = {};
    uint64_t table_iova = 0, mailbox_iova = 0;
    uint32_t table_key = 0, mailbox_key = 0;
    uint64_t completions = 0;
    uint32_t notice_acked = 0;  // the last revocation number of this peer's we acknowledged
  };
  // The registration table's entry (addr: the IOVA), read by peers.
  using Entry = RegTableEntry;

  NpuRoceTransport(Context& ctx, AmSink& sink, hal::npu::Device& dev);
  Status setup(const NpuRoceConfig& cfg, const std::vector<bool>& same_host);
  Status region(size_t len, uint8_t access, Region* out, const char* what);
  void drop_region(Region& r);
  Status bring_up(int peer, const NpuRoceWireHdr& w, uint32_t qpn);
  Status post(int peer, hal::abi::rdma::SendWqe w, Op op);
  Status post_data(int peer, hal::abi::rdma::WrOp opc, uint64_t laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey,
                   size_t len, const std::shared_ptr<Request>& r, uint8_t dtype = 0, uint8_t redop = 0,
                   uint8_t flags = 0);
  int take_scratch(const Deadline& dl);
  void poll(int peer);
  void complete_op(int peer, const hal::abi::rdma::Cqe& c);
  void deliver(int peer, const hal::abi::rdma::Cqe& c);
  bool send_credit(int peer);
  Status sync_wait(int peer, uint64_t id, const Deadline& dl, const char* what);
  void lose(const Status& why);
  uint64_t wr_id(int peer, uint64_t seq) const { return (uint64_t(uint32_t(peer)) << 40) | (seq & ((1ull << 39) - 1)); }
  bool post_recv_slot(int peer, uint32_t slot);
  uint8_t* recv_buf(int peer, uint32_t i) const;
  uint64_t recv_iova(int peer, uint32_t i) const;
  uint8_t* send_buf(int peer, uint32_t i) const;
  uint64_t send_iova(int peer, uint32_t i) const;
  uint64_t scratch_iova(int word) const { return _scratch.map.iova + 8ull * static_cast<uint64_t>(word); }

  Context& _ctx;
  AmSink& _sink;
  hal::npu::Device& _dev;
  Caps _caps;
  int _rank, _size;
  int _timeout = 14, _retry = 7;
  uint32_t _ip = 0;
  uint8_t _mac[6] = {};
  uint8_t _mtu = 5;
  uint32_t _psn = 0;
  std::vector<RPeer> _peers;
  Region _am;       // recv [size][kRecvDepth][kSlot], then send [size][kSendRing][kSlot]
  Region _table;    // Entry x kMaxRegs
  Region _mailbox;  // revocation mailboxes (RevocationMailbox's layout)
  uint32_t _revocations = 0;  // our latest revocation number
  RevocationMailbox mb() const;  // a view of _mailbox (api/transport/revocation.h)
  Region _scratch;  // fetch results, notify values, import reads, the revoked generation
  std::vector<int> _scratch_free;
  std::map<uint64_t, Op> _ops;            // by wr_id
  std::map<uint64_t, uint8_t> _sync_done;  // wr_id -> WcStatus a synchronous wait collects
  std::set<uint64_t> _sync_abandoned;      // synchronous requests whose wait timed out
  std::deque<std::pair<int, hal::abi::rdma::Cqe>> _rx;  // receive completions reaped while posting
  Status _lost;  // !ok: the device is gone
};

}  // namespace hcomm::api
