// api/ internals: the context, registered memory, remote keys, requests,
// the per-pair shared-memory channels and the two engines.
//
// Data paths (each user byte moved once by the engine):
//   host engine  one-sided: memcpy into / out of the peer's memory mapped
//                through its memfd (hcomm_mem_alloc), or process_vm_writev /
//                readv (the kernel's single copy) for memory the peer merely
//                registered; two-sided rendezvous: the receiver pulls the
//                same way.
//   npu engine   one-sided: descriptors on this rank's NPU DMA queue; the
//                peer's host memory is DMA-mapped into our device from its
//                memfd, its HBM is reached over the fabric (PEER_HBM).
// Eager messages (<= kEagerMax) are copied into a channel slot and out again.
#pragma once

#include <pthread.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "api/wireup/bootstrap.h"
#include "api/include/hcomm/hcomm.h"
#include "common/fd.h"
#include "common/status.h"
#include "common/time.h"
#include "driver/dma_memory.h"
#include "hal/npu/device.h"
#include "hal/npu/dma_queue.h"

namespace hcomm::api {

class Context;

hcomm_status_t to_hcomm(Code c);
// process_vm_readv (write = false) / writev of all of [remote, remote+len)
// in process pid: peer_failure if it is gone (api/rma.cpp).
Status cma(pid_t pid, void* local, uint64_t remote, size_t len, bool write);
Code from_hcomm(hcomm_status_t s);

// ---- control segment: each rank's registration table, shared read-mostly ----
inline constexpr uint32_t kCtrlMagic = 0x4843434cu;  // "HCCL"
inline constexpr uint32_t kCtrlVersion = 1;
inline constexpr uint32_t kMaxRegs = 4096;
inline constexpr uint32_t kLockStripes = 64;

enum class MemKind : uint32_t { host_alloc = 1, host_user = 2, device = 3 };

struct RegEntry {
  // Odd: valid registration; even: free or revoked. Writer: the owner only
  // (release after the other fields); readers: peers (acquire).
  std::atomic<uint32_t> gen;
  uint32_t rights;  // HCOMM_ACCESS_* bits
  uint64_t size;
  uint64_t addr;    // owner's virtual address (host memory) / HBM offset (device)
  uint32_t kind;    // MemKind
  uint32_t fabric_index;
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
  // Accumulate / CMA-atomic serialisation: robust process-shared mutexes so a
  // peer that dies holding one does not wedge the others.
  alignas(64) pthread_mutex_t locks[kLockStripes];
};

// ---- mesh-socket messages (control plane; the data plane is the channels) ----
enum class MeshType : uint32_t { segments = 1, advert = 2 };
struct MeshMsg {
  uint32_t type;  // MeshType
  int32_t rank;
  int32_t pid;
  uint32_t slot;  // advert
  uint32_t gen;   // advert
  uint32_t nfds;
};
static_assert(sizeof(MeshMsg) == 24);

// ---- remote key wire format -------------------------------------------------------
inline constexpr uint32_t kRkeyMagic = 0x4852434bu;  // "HRCK"
inline constexpr uint16_t kRkeyVersion = 1;
struct RkeyWire {
  uint32_t magic;
  uint16_t version;
  uint16_t kind;  // MemKind
  int32_t owner;
  uint32_t slot;
  uint32_t gen;
  uint32_t rights;
  uint64_t size;
  uint64_t addr;
  uint64_t job_hash;
  uint32_t fabric_index;
  uint32_t reserved;
};
static_assert(sizeof(RkeyWire) == 56 && sizeof(RkeyWire) <= HCOMM_RKEY_MAX);

// ---- channels: one SPSC ring per direction per pair, in a shared memfd ----------
inline constexpr uint32_t kSlots = 64;
inline constexpr uint32_t kSlotSize = 4096;

enum class MsgType : uint32_t { eager = 1, rts = 2, fin = 3 };

struct MsgHdr {
  uint32_t type;     // MsgType
  uint32_t len;      // payload bytes in this slot (eager)
  uint64_t tag;
  uint64_t total;    // message length
  uint64_t sreq;     // sender's request id (rts/fin)
  uint64_t addr;     // rts: sender's buffer address
  uint32_t src_slot; // rts: registration of the sender's buffer (kNoSlot if none)
  uint32_t src_gen;
  uint64_t src_off;  // rts: offset of the buffer in that registration
  uint32_t status;   // fin: hcomm_status_t of the receiver's pull
  uint32_t reserved;
};
static_assert(sizeof(MsgHdr) == 64);
inline constexpr uint32_t kNoSlot = 0xffffffffu;
inline constexpr uint32_t kEagerMax = kSlotSize - sizeof(MsgHdr);

struct alignas(64) RingIndex {
  std::atomic<uint32_t> v;
  uint8_t pad[60];
};
struct RingLayout {
  RingIndex head;  // consumer-owned
  RingIndex tail;  // producer-owned
  uint8_t slots[kSlots][kSlotSize];
};
struct ChannelLayout {
  RingLayout dir[2];  // dir[0]: lower rank -> higher rank; dir[1]: the reverse
};

// ---- registered memory -----------------------------------------------------------------
}  // namespace hcomm::api

struct hcomm_mem {
  hcomm::api::Context* ctx = nullptr;
  uint32_t slot = 0;
  uint32_t gen = 0;
  hcomm::api::MemKind kind = hcomm::api::MemKind::host_alloc;
  uint8_t* ptr = nullptr;
  size_t size = 0;
  unsigned access = 0;
  hcomm::driver::DmaBuffer buf;       // host_alloc
  hcomm::hal::npu::Mapping map;       // npu engine: our device's mapping of this memory
  uint64_t hbm_offset = 0;            // device
};

// An imported remote key: how this rank reaches the peer's memory.
struct hcomm_rkey {
  hcomm::api::Context* ctx = nullptr;
  hcomm::api::RkeyWire w{};
  int peer = -1;
  uint8_t* mapped = nullptr;  // host engine / host_alloc: our mapping of the peer's memfd
  size_t mapped_len = 0;
  hcomm::hal::npu::Mapping map;  // npu engine: our device's mapping of the peer's memory
  bool released = false;
};

namespace hcomm::api {

// ---- requests ---------------------------------------------------------------------------
struct Request {
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
  bool rts_sent = false;  // rendezvous: waiting for FIN
  // recv
  uint8_t* rbuf = nullptr;
  size_t rlen = 0;
  uint64_t tag_mask = 0;
  hcomm_recv_info_t info{-1, 0, 0};
  // rma (npu engine): descriptors still outstanding; result copy-out
  uint32_t outstanding = 0;
  uint64_t* result_out = nullptr;
  uint32_t result_slot = UINT32_MAX;
  bool done() const { return status != HCOMM_IN_PROGRESS; }
};

// A message that arrived before its receive was posted.
struct Unexpected {
  int source;
  MsgHdr hdr;
  std::vector<uint8_t> payload;  // eager only
};

struct Peer {
  int rank = -1;
  bool alive = true;
  std::string why_dead;
  UniqueFd sock;  // mesh socket: fd adverts, liveness
  pid_t pid = 0;
  CtrlSegment* ctrl = nullptr;  // the peer's control segment, mapped read-write (locks)
  ChannelLayout* chan = nullptr;
  RingLayout* tx = nullptr;
  RingLayout* rx = nullptr;
  std::deque<std::shared_ptr<Request>> backlog;  // sends waiting for a free slot
  // memfds the peer advertised: (slot << 32 | gen) -> fd
  std::map<uint64_t, UniqueFd> adverts;
};

class Context {
 public:
  static Status create(const hcomm_config_t& cfg, std::unique_ptr<Context>* out);
  ~Context();

  int rank() const { return _rank; }
  int size() const { return _size; }
  bool npu() const { return _dev != nullptr; }
  const char* engine_name() const { return npu() ? "npu" : "host"; }
  std::mutex& mu() { return _mu; }

  Status barrier(const Deadline& dl);
  Status finalize(const Deadline& dl);

  // memory
  Status mem_alloc(size_t size, unsigned kind, unsigned access, hcomm_mem** out);
  Status mem_register(void* addr, size_t size, unsigned access, hcomm_mem** out);
  Status mem_release(hcomm_mem* m);
  Status rkey_pack(const hcomm_mem* m, void* buf, size_t* len) const;
  Status rkey_import(int peer, const void* buf, size_t len, hcomm_rkey** out);
  Status rkey_release(hcomm_rkey* k);

  // one-sided; returns a request (maybe already complete). out == nullptr:
  // the caller blocks anyway; on the host engine the operation then runs
  // without a request and is complete when this returns.
  enum class Rma { put, get, acc, fetch_add, cswap };
  struct RmaArgs {
    Rma op = Rma::put;
    uint8_t* local = nullptr;
    size_t len = 0;  // bytes
    hcomm_rkey* rkey = nullptr;
    uint64_t roff = 0;
    hcomm_dtype_t dtype = HCOMM_INT8;
    hcomm_op_t redop = HCOMM_SUM;
    uint64_t operand = 0, compare = 0;
    uint64_t* old_value = nullptr;
    hcomm_rkey* notify_rkey = nullptr;  // put_notify
    uint64_t notify_off = 0;
    uint64_t notify_value = 0;
  };
  Status rma(const RmaArgs& a, std::shared_ptr<Request>* out);
  Status notify_wait(hcomm_mem* m, uint64_t off, uint64_t value, const Deadline& dl);
  Status flush(int peer, const Deadline& dl);
  void fence() { _fence_next = true; }

  // two-sided
  Status isend(int dest, const void* buf, size_t len, uint64_t tag, std::shared_ptr<Request>* out);
  Status irecv(int source, void* buf, size_t len, uint64_t tag, uint64_t mask, std::shared_ptr<Request>* out);
  Status probe(int source, uint64_t tag, uint64_t mask, bool* found, hcomm_recv_info_t* info);

  // progress
  void progress();
  void flush_owed(const Deadline& dl);
  Status wait(Request& r, const Deadline& dl);

 private:
  Context() = default;
  Status init(const hcomm_config_t& cfg);
  Status init_npu(const hcomm_config_t& cfg, const LaunchInfo& li);
  Status exchange_segments(const Deadline& dl);
  Status alloc_slot(uint32_t* slot);
  void publish(hcomm_mem* m);
  void advertise(hcomm_mem* m);
  Status await_advert(Peer& p, uint32_t slot, uint32_t gen, const Deadline& dl, int* fd);
  void drain_socket(Peer& p);
  void check_peers(bool force);
  void peer_failed(Peer& p, const std::string& why);
  Status check_key(hcomm_rkey* k, uint64_t off, uint64_t len, unsigned need) const;
  const hcomm_mem* find_local(const void* p, size_t len) const;

  Status rma_host(const RmaArgs& a);
  // Waits until done() with progress; false at the deadline. Releases _mu while napping.
  bool spin_wait(const std::function<bool()>& done, bool progress_each_round, const Deadline& dl);
  Status rma_npu(const RmaArgs& a, const std::shared_ptr<Request>& r);
  Status lock_stripe(Peer& p, uint32_t slot, const Deadline& dl, pthread_mutex_t** out);
  Status remote_rw(Peer& p, hcomm_rkey* k, uint64_t off, void* buf, size_t len, bool write);
  void reap_npu();
  uint64_t npu_iova_local(const hcomm_mem* m, const void* p) const;

  bool try_send(Peer& p, const std::shared_ptr<Request>& r);
  hcomm_rkey* rendezvous_key(int source, uint32_t slot, uint32_t gen);
  void handle(Peer& p, const MsgHdr& h, const uint8_t* payload);
  std::shared_ptr<Request> take_posted(int source, uint64_t tag);
  void deliver(Request& r, int source, const MsgHdr& h, const uint8_t* payload);
  void pull(Request& r, int source, const MsgHdr& h);
  bool post_fin(Peer& p, uint64_t sreq, hcomm_status_t st);
  void complete(Request& r, hcomm_status_t st, const std::string& why = "");

  std::mutex _mu;
  int _rank = 0, _size = 1, _local_rank = 0;
  uint64_t _job_hash = 0;
  std::unique_ptr<Bootstrap> _boot;
  std::vector<Peer> _peers;
  // own control segment
  UniqueFd _ctrl_fd;
  CtrlSegment* _ctrl = nullptr;
  std::vector<hcomm_mem*> _mems;  // by slot
  std::map<uintptr_t, hcomm_mem*> _by_addr;  // CPU-visible registrations by start address
  // channels created by this rank (lower of the pair)
  std::vector<std::pair<void*, size_t>> _maps;  // every mmap to undo
  // requests
  uint64_t _next_id = 1;
  std::map<uint64_t, std::shared_ptr<Request>> _pending_sends;  // rendezvous awaiting FIN
  std::list<std::shared_ptr<Request>> _posted;                   // receives
  std::list<Unexpected> _unexpected;
  std::deque<std::pair<int, MsgHdr>> _fin_backlog;               // FINs waiting for a slot
  std::map<uint64_t, hcomm_rkey*> _rndv_keys;                    // (peer << 32 | slot) -> cached import
  Clock::time_point _last_check{};
  std::chrono::milliseconds _peer_check{1};
  uint32_t _progress_calls = 0;
  bool _fence_next = false;
  bool _finalized = false;
  // npu engine
  std::unique_ptr<hal::npu::Device> _dev;
  std::unique_ptr<hal::npu::DmaQueue> _q;
  std::map<uint64_t, std::shared_ptr<Request>> _npu_pending;  // by request id
  driver::DmaBuffer _scratch;  // fetch-atomic results
  hal::npu::Mapping _scratch_map;
  std::vector<uint32_t> _scratch_free;
  uint64_t _hbm_next = 0;  // device memory bump allocator
  std::map<uint64_t, uint64_t> _hbm_free;  // offset -> size
};

}  // namespace hcomm::api

// The C handle of a request: shares the request with the context.
struct hcomm_request {
  hcomm::api::Context* ctx = nullptr;
  std::shared_ptr<hcomm::api::Request> r;
};
struct hcomm_context {
  std::unique_ptr<hcomm::api::Context> impl;
};
