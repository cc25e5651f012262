// hcomm-sim's RoCEv2 engine: reliable-connection queue pairs over one port
// (docs/device-abi.md §14 wire, §15 work requests, §16 reliability).
//
// The engine is single-threaded and clock-driven: the owner hands it every
// frame the port receives (rx), calls poll() to let it transmit and run its
// timers, and passes the time in both, so tests drive loss, reordering and
// timeouts deterministically. It reaches memory only through the device's
// translation (MemoryAccess) after checking the memory-key table (MrTable).
//
// Requester: PSNs assigned at post, at most kWindow PSNs unacknowledged,
// AckReq on the last packet of each message and every kAckEvery PSNs,
// go-back-N from the first unacknowledged PSN on a PSN-sequence NAK, an
// out-of-order READ response or the local ACK timeout (retry_cnt times,
// then RETRY_EXC_ERR), RNR NAK -> wait the RNR timer and resend
// (rnr_retry times, 7 = without limit). Completions in posting order.
// Responder: executes the expected PSN only; a PSN ahead -> one PSN-sequence
// NAK until the gap fills; a PSN behind (a duplicate) -> SEND/WRITE/
// WRITE_REDUCE re-acknowledged, never re-executed; READ answered again from
// memory; atomics answered from the saved result. Every request is checked
// against the key table first: bad key, range or right -> NAK remote access
// error, 0 bytes touched, and the QP goes to ERR (IBA class C error).
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "hal/abi/rdma.h"
#include "hal/abi/roce.h"

namespace hcomm::sim::roce {

namespace rdma = hal::abi::rdma;
namespace wire = hal::abi::roce;

// The device's view of its address space (the ATT, §6): a host pointer for
// [iova, iova + len), or nullptr when it is not mapped with that right.
class MemoryAccess {
 public:
  virtual ~MemoryAccess() = default;
  virtual uint8_t* map(uint64_t iova, uint64_t len, bool write) = 0;
  // WRITE_REDUCE holds it while it reduces a packet's payload into memory,
  // so that it is element-wise atomic against the device's DMA REDUCEs
  // (null: nothing else reduces into this memory).
  virtual std::mutex* reduce_mutex() { return nullptr; }
};

// The memory-key table (§15.1). Written by the driver's commands, read by
// the engine on every access; safe to use from both at once.
class MrTable {
 public:
  explicit MrTable(uint32_t entries) : _e(entries) {}
  enum class Check : uint8_t { ok, bad_key, out_of_range, no_right };
  // Installs e at key_index(e.key); refuses an index out of the table, a
  // zero length, a wrapping range, unknown access bits, or an index in use.
  Status set(const rdma::MrEntry& e);
  // Invalidates the entry the key names (its key byte must match).
  Status invalidate(uint32_t key);
  Check check(uint32_t key, uint64_t va, uint64_t len, uint8_t need) const;
  uint32_t size() const { return static_cast<uint32_t>(_e.size()); }

 private:
  mutable std::mutex _mu;
  std::vector<rdma::MrEntry> _e;
};

struct PortAddr {
  uint8_t mac[6] = {};
  uint32_t ip = 0;  // host order
};

// Port counters (§16.6): what `hcomm-probe info` shows.
struct Counters {
  uint64_t tx_frames = 0, rx_frames = 0;
  uint64_t rx_bad_icrc = 0, rx_malformed = 0, rx_not_roce = 0, rx_unsupported = 0;
  uint64_t rx_no_qp = 0;           // DestQP unknown or not ready
  uint64_t retransmits = 0;        // packets sent again (go-back-N)
  uint64_t timeouts = 0;           // local ACK timeouts
  uint64_t seq_naks_sent = 0, seq_naks_rcvd = 0;
  uint64_t rnr_naks_sent = 0, rnr_naks_rcvd = 0;
  uint64_t duplicates = 0;         // requests behind the expected PSN
  uint64_t access_naks_sent = 0;
  uint64_t arp_replies = 0;
};

class Engine {
 public:
  using TxFn = std::function<void(const uint8_t* frame, size_t len)>;
  using CqFn = std::function<void(const rdma::Cqe&)>;
  // Go-back-N resends what is in flight after a loss, so the window is the
  // price of each lost packet: 32 packets (128 KiB at a 4 KiB MTU) keep a
  // software port busy at 1% loss, where 128 resent ~2.5x the data.
  static constexpr uint32_t kWindow = 32;    // unacknowledged PSNs at most
  static constexpr uint32_t kAckEvery = 8;   // AckReq at least this often: a lost ACK never stalls the window
  static constexpr uint32_t kReadPiece = 128;  // READ response packets asked for at a time
  static constexpr size_t kAtomicHistory = 16;

  Engine(const PortAddr& addr, MemoryAccess& mem, MrTable& mrs, TxFn tx, CqFn cq);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const PortAddr& addr() const { return _addr; }
  void set_ip(uint32_t ip) { _addr.ip = ip; }
  const Counters& counters() const { return _c; }

  // Queue pairs (§15.2). QPNs start at 2 (0 and 1 are special in the IBA);
  // create_qp(n) takes the number n (a device gives slot s kQpnBase + s) and
  // returns 0 when n is invalid or in use.
  uint32_t create_qp();
  uint32_t create_qp(uint32_t qpn);
  Status modify_qp(uint32_t qpn, const rdma::QpAttr& a);
  Status destroy_qp(uint32_t qpn);
  rdma::QpState qp_state(uint32_t qpn) const;

  // Work requests. A malformed one completes at once with BAD_WQE (or
  // LOC_PROT_ERR for a bad local key) and moves the QP to ERR, as verbs
  // does; a QP not in RTS refuses sends (invalid_argument), a QP in ERR
  // completes them with WR_FLUSH_ERR.
  Status post_send(uint32_t qpn, const rdma::SendWqe& w);
  Status post_recv(uint32_t qpn, const rdma::RecvWqe& w);
  // Work requests the QP holds, posted and not yet completed (send) or not
  // yet consumed (receive, the one being filled included).
  size_t held(uint32_t qpn, bool send) const;

  // A frame from the wire.
  void rx(const uint8_t* frame, size_t len, uint64_t now_ns);
  // Transmits what the windows allow and runs the timers. Returns true
  // when it sent something.
  bool poll(uint64_t now_ns);
  // Whether any QP has work outstanding (unsent or unacknowledged).
  bool busy() const;
  // One line per QP: state, PSNs, queue depths (hcomm-probe info, test failures).
  std::string describe() const;

 private:
  struct Qp;
  Qp* find(uint32_t qpn) const;
  void send_frame(wire::Packet& p, const uint8_t* payload);
  void answer_arp(const uint8_t* f, size_t len);
  // requester
  bool tx_qp(Qp& q, uint64_t now);
  void read_request(Qp& q, size_t slot);  // the next piece of the READ in q.sq[slot]
  void requester_rx(Qp& q, const wire::Packet& p, uint64_t now);
  void ack_through(Qp& q, uint32_t psn, uint64_t now);
  void go_back(Qp& q, uint32_t psn);
  void count_tx(Qp& q, uint32_t psn, uint32_t n);
  bool read_pieces_pending(const Qp& q) const;
  void complete_front(Qp& q);
  void fail_qp(Qp& q, rdma::WcStatus front_status, uint32_t syndrome);
  // responder
  void responder_rx(Qp& q, const wire::Packet& p);
  void send_ack(Qp& q, uint8_t syndrome, uint32_t psn);
  void read_responses(Qp& q, uint32_t psn, uint8_t* src, uint32_t len);
  bool take_receive(Qp& q, uint32_t psn);
  void recv_cqe(Qp& q, const rdma::RecvWqe& r, rdma::WcStatus st, rdma::WcOp op, uint32_t len, bool imm,
                uint32_t immv);

  PortAddr _addr;
  MemoryAccess& _mem;
  MrTable& _mrs;
  TxFn _tx;
  CqFn _cq;
  Counters _c;
  uint32_t _next_qpn = 2;
  std::map<uint32_t, std::unique_ptr<Qp>> _qps;
  std::vector<uint8_t> _frame;
  uint16_t _ip_id = 0;
};

}  // namespace hcomm::sim::roce
