// shm: ranks on one host through shared memory.
//
//  - Messaging: one single-producer single-consumer ring per direction per
//    pair (64 slots x 4 KiB, a memfd the lower rank creates). Each slot's
//    first cache line carries its sequence word (Vyukov: seq == pos: free
//    for the producer's message #pos; pos + 1: holds it; the consumer hands
//    it back as pos + kSlots), so there are no shared head and tail lines: a
//    small eager message (at most kInlineMax bytes) travels with its tag in
//    that one line, one cache line from producer to consumer. Anything else:
//    a 64-byte MsgHdr in the slot's second line and up to kEagerMax payload
//    bytes after it.
//  - RMA: memory from hcomm_mem_alloc is a memfd handed to every same-host
//    peer when it is allocated (an "advert" on the control socket); an
//    importer maps it and the initiating CPU does memcpy / CPU atomics.
//  - The node registry: each rank's control segment (a memfd every same-host
//    peer maps) holds its registration table, which keys are validated
//    against at import and on every access (generation odd = registered),
//    and the accumulate locks (robust process-shared mutexes, so a rank that
//    dies holding one does not wedge the others). cma and npu, the other
//    same-host transports, validate against the same table.
#pragma once

#include <pthread.h>
#include <sys/types.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "api/mem/memory.h"
#include "api/transport/transport.h"
#include "common/fd.h"

namespace hcomm::api {

class Context;

inline constexpr uint32_t kCtrlMagic = 0x4843434cu;  // "HCCL"
inline constexpr uint32_t kCtrlVersion = 5;  // 3: channel slots with sequence words; 5: access marks
inline constexpr uint32_t kMaxRegs = 4096;
inline constexpr uint32_t kLockStripes = 64;

struct RegEntry {
  // Odd: valid registration; even: free or revoked. Writer: the owner only
  // (release after the other fields); readers: peers (acquire).
  std::atomic<uint32_t> gen;
  uint32_t rights;  // HCOMM_ACCESS_* bits
  uint64_t size;
  uint64_t addr;    // owner's virtual address (host memory) / HBM offset (device)
  uint32_t kind;    // MemKind
  uint32_t fabric_index;  // the owner's NPU on the node fabric (npu transport)
};
static_assert(sizeof(RegEntry) == 32);

struct CtrlHeader {
  uint32_t magic;
  uint32_t version;
  int32_t rank;
  int32_t pid;
  uint64_t job_hash;
  uint32_t max_regs;
  uint32_t lock_stripes;
};

struct CtrlSegment {
  CtrlHeader hdr;
  alignas(64) RegEntry regs[kMaxRegs];
  alignas(64) pthread_mutex_t locks[kLockStripes];
  MarkTable marks;  // this process's access marks (api/mem/access_mark.h)
};

inline constexpr uint32_t kSlots = 64;  // a power of two: sequence words wrap with the u32 position
inline constexpr uint32_t kSlotSize = 4096;
inline constexpr uint32_t kInlineMax = 48;
inline constexpr uint32_t kEagerMax = kSlotSize - 64 - sizeof(MsgHdr);

// A slot's first cache line.
struct alignas(64) SlotLine {
  std::atomic<uint32_t> seq;  // see above; written last (release) by the producer, first read (acquire) by the consumer
  uint32_t form;              // kFormInline | length, or kFormFull (a MsgHdr follows in the next line)
  uint64_t tag;               // inline form: the message's tag
  uint8_t data[kInlineMax];   // inline form: the payload
};
static_assert(sizeof(SlotLine) == 64);
inline constexpr uint32_t kFormInline = 1u << 16;
inline constexpr uint32_t kFormFull = 2u << 16;
struct Slot {
  SlotLine line;
  uint8_t body[kSlotSize - sizeof(SlotLine)];  // full form: MsgHdr, then the payload
};
struct RingLayout {
  Slot slots[kSlots];
};
struct ChannelLayout {
  RingLayout dir[2];  // dir[0]: lower rank -> higher rank; dir[1]: the reverse
};

// The CPU's part of a put, get or fetch atomic on memory this rank has
// mapped (target: the mapped address of the operation). Shared by
// ShmTransport::rma and the one-sided fast path, which runs it inline on a
// key whose lanes are shm (hcomm_rkey::direct). Words of 8 or 4 bytes are
// copied without a call into libc (parameter-server counters, pipeline
// credits); fetch atomics are CPU atomics (every rank maps this memory).
// Returns false for any other operation.
[[gnu::always_inline]] inline bool cpu_rma(uint8_t* target, const RmaOp& a) {
  auto copy = [](uint8_t* dst, const uint8_t* src, size_t n) {
    switch (n) {
      case 8: std::memcpy(dst, src, 8); return;
      case 4: std::memcpy(dst, src, 4); return;
      default: std::memcpy(dst, src, n); return;
    }
  };
  switch (a.op) {
    case Rma::put: copy(target, a.local, a.len); return true;
    case Rma::get: copy(a.local, target, a.len); return true;
    case Rma::fetch_add:
      *a.old_value = std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(target))
                         .fetch_add(a.operand, std::memory_order_acq_rel);
      return true;
    case Rma::cswap: {
      uint64_t expect = a.compare;
      std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(target))
          .compare_exchange_strong(expect, a.operand, std::memory_order_acq_rel);
      *a.old_value = expect;
      return true;
    }
    default: return false;
  }
}

class ShmTransport final : public Transport {
 public:
  // Creates this rank's control segment. `sink` receives inbound messages.
  static Status open(Context& ctx, AmSink& sink, std::unique_ptr<ShmTransport>* out);
  ~ShmTransport() override;

  // Collective among same-host ranks: each sends every same-host peer its
  // control segment and, where it is the lower rank, the pair's channel, over
  // the peers' control sockets; then maps what it received.
  Status connect(const Deadline& dl);
  // Messaging and the node registry only: another lane (npu) does the RMA.
  void messaging_only() { _caps.put = _caps.get = _caps.atomic64 = _caps.reduce = _caps.notify = false; }

  TransportId id() const override { return TransportId::shm; }
  const Caps& caps() const override { return _caps; }
  bool reaches(int /*peer*/, bool same_host) const override { return same_host; }
  Status mem_add(hcomm_mem& m) override;
  bool pack(const hcomm_mem& m, uint8_t* sec, size_t* len) const override;
  Status import(hcomm_rkey& k, const uint8_t* sec, size_t len) override;
  Status unimport(hcomm_rkey& k) override;
  Status validate(const hcomm_rkey& k) const override { return live(k.peer, k.h.slot, k.h.gen); }
  Status rma(const RmaOp& op, const std::shared_ptr<Request>& r) override;
  bool am_send(int peer, const MsgHdr& h, const void* payload, size_t len) override;
  void progress() override;

  // ---- the node registry (also used by cma and npu) ----
  // Publishes m in this rank's table (fields, then m.gen, odd, with
  // release); fabric_index: this rank's NPU, 0 without one.
  void publish(hcomm_mem& m, uint32_t fabric_index);
  // Revokes: every key of m fails validation from now on, on every peer.
  void revoke(const hcomm_mem& m);
  // The key's header matches the owner's live entry (import time).
  Status check_entry(int peer, const RkeyHeader& h) const;
  // The owner's NPU on the fabric, as its registry says (never from a key).
  uint32_t fabric_of(int peer, uint32_t slot) const { return seg(peer)->regs[slot].fabric_index; }
  // The owner's entry still has generation gen (every access).
  Status live(int peer, uint32_t slot, uint32_t gen) const;
  // The owner's generation word of `slot` (mapped until this transport goes).
  const std::atomic<uint32_t>* gen_word(int peer, uint32_t slot) const { return &seg(peer)->regs[slot].gen; }
  // Our process's access marks (api/mem/access_mark.h).
  MarkTable* marks() const { return &_ctrl->marks; }
  // A wire key for the owner's live registration (rendezvous pulls).
  bool synth_key(int peer, uint32_t slot, uint32_t gen, std::vector<uint8_t>* key) const;
  // The owner's accumulate lock for `slot`; unlock with pthread_mutex_unlock.
  Status lock_stripe(int peer, uint32_t slot, const Deadline& dl, pthread_mutex_t** out);
  pid_t pid(int peer) const { return _peers[static_cast<size_t>(peer)].pid; }
  // A peer handed us the memfd of registration (slot, gen).
  void on_advert(int peer, uint32_t slot, uint32_t gen, UniqueFd fd);
  // Maps the peer's hcomm memory named by k's header into k.mapped (own
  // memory: borrows the pointer); *fd (may be null): its memfd, owned here.
  Status attach(hcomm_rkey& k, int* fd);

 private:
  struct ShmPeer {
    pid_t pid = 0;
    CtrlSegment* ctrl = nullptr;  // the peer's control segment, mapped read-write (locks)
    RingLayout* tx = nullptr;
    RingLayout* rx = nullptr;
    uint32_t tx_pos = 0;  // our next message to the peer
    uint32_t rx_pos = 0;  // the peer's next message to us
    std::map<uint64_t, UniqueFd> adverts;  // (slot << 32 | gen) -> memfd
  };
  ShmTransport(Context& ctx, AmSink& sink);
  CtrlSegment* seg(int peer) const;
  void advertise(const hcomm_mem& m);
  Status await_advert(int peer, uint32_t slot, uint32_t gen, const Deadline& dl, int* fd);
  Status map_fd(int fd, size_t len, void** out);

  Context& _ctx;
  AmSink& _sink;
  Caps _caps;
  int _rank;
  UniqueFd _ctrl_fd;
  CtrlSegment* _ctrl = nullptr;
  std::vector<ShmPeer> _peers;
  // Per peer: held while a thread writes the peer's stream (tx_pos, slots).
  struct alignas(64) TxLock {
    std::atomic<bool> held{false};
  };
  std::unique_ptr<TxLock[]> _tx_locks;
  std::vector<std::pair<void*, size_t>> _maps;  // every mmap to undo
};

}  // namespace hcomm::api
