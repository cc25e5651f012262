// The network side of a simulated NPU (docs/device-abi.md §15-§16): each
// device's RoCEv2 port (NetPort: registers, command window, QP rings in
// device memory, the engine of sim/roce/rc.h) and the simulator's L2 switch
// (NetSwitch) that joins the ports of its NPUs and one uplink, with MAC
// learning and fault injection on what the NPUs send.
//
// Threading: register accesses come from the front's thread, the switch and
// the engines run on the fabric's network thread; each NetPort has one
// mutex for both.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "common/status.h"
#include "hal/abi/rdma.h"
#include "hal/abi/regs.h"
#include "sim/roce/port.h"
#include "sim/roce/rc.h"

namespace hcomm::sim::roce {

// What the switch does to frames the NPUs send (hcomm-sim --net-fault,
// control command `net`): a percentage each, and counted one-shots.
struct NetFaultConfig {
  uint32_t drop_pct = 0, dup_pct = 0, reorder_pct = 0, corrupt_pct = 0;
  uint32_t drop_next = 0, corrupt_next = 0;
  uint64_t seed = 1;
};

struct NetFaultCounters {
  uint64_t dropped = 0, duplicated = 0, reordered = 0, corrupted = 0;
};

class NetSwitch {
 public:
  using Deliver = std::function<void(const uint8_t* frame, size_t len)>;
  // A port; frames for it go to `deliver` (called on the network thread, or
  // on the thread that called ingress). `faulty`: frames entering here get
  // the injected faults (the NPUs' ports; not the uplink).
  uint32_t add_port(Deliver deliver, bool faulty);
  // A frame entering at `port`: learn its source, forward to the port that
  // has its destination MAC, or flood (broadcast, unknown).
  void ingress(uint32_t port, const uint8_t* frame, size_t len, uint64_t now_ns);
  // Releases a frame held back for reordering once nothing overtook it for 1 ms.
  void tick(uint64_t now_ns);
  // Replaces the fault configuration and zeroes the fault counters.
  void set_faults(const NetFaultConfig& f);
  NetFaultConfig faults() const;
  NetFaultCounters fault_counters() const;
  // Captures every frame the switch forwards (hcomm-sim --pcap).
  Status capture(const std::string& path);

 private:
  void forward(uint32_t in, const std::vector<uint8_t>& f, uint64_t now);

  mutable std::mutex _mu;
  std::vector<Deliver> _ports;
  std::vector<bool> _faulty;
  std::map<uint64_t, uint32_t> _macs;
  NetFaultConfig _f;
  NetFaultCounters _fc;
  std::mt19937_64 _rng{1};
  std::vector<uint8_t> _held;
  uint32_t _held_port = 0;
  uint64_t _held_at = 0;
  PcapWriter _pcap;
};

// One NPU's port and engine, as its registers expose them (§15).
class NetPort {
 public:
  static constexpr uint32_t kNumQp = 16;
  static constexpr uint32_t kNumMr = 256;
  // MAC 02:4e:50:55:<node>:<index>, IPv4 10.0.<node>.<index + 1> until the
  // driver writes NET_IP.
  NetPort(uint32_t node, uint32_t index, MemoryAccess& mem, NetSwitch& sw);
  ~NetPort();
  NetPort(const NetPort&) = delete;
  NetPort& operator=(const NetPort&) = delete;

  static bool owns(uint64_t bar0_offset) {
    return bar0_offset >= hal::abi::reg::NET_MAC &&
           bar0_offset < hal::abi::reg::NET_COUNTERS + hal::abi::reg::kNetCounterCount * 8;
  }
  Status reg_read(uint64_t off, void* data, size_t len);
  Status reg_write(uint64_t off, const void* data, size_t len);
  // Device reset: every QP destroyed, the key table cleared, NET_IP to its default.
  void reset();
  // Host memory [p, p + len) is going away (vfio-user DMA_UNMAP): every QP
  // whose rings or shadow lie in it is destroyed first.
  void forget(const uint8_t* p, size_t len);

  // Network thread: a frame from the switch (queued), and one round of work:
  // new work requests from the rings, received frames, transmission and
  // timers, completions to the CQs. Returns true when anything moved.
  void deliver(const uint8_t* frame, size_t len);
  bool service(uint64_t now_ns);

  const PortAddr& addr() const { return _addr; }
  // Since the simulator started (the port's counters restart at every
  // device reset): frames dropped by an ICRC check, what tests compare with
  // the corruptions the switch injected; packets resent and local ACK
  // timeouts, what they report.
  struct Totals {
    uint64_t bad_icrc = 0, retransmits = 0, timeouts = 0;
  };
  Totals totals() const;
  Counters counters() const;
  std::string describe() const;  // port and QPs (hcomm-probe info via the control socket)

 private:
  struct Slot;
  void make_engine();
  uint32_t execute(uint32_t cmd, uint32_t* result);  // holds _mu
  void on_cqe(const rdma::Cqe& c);                    // holds _mu
  bool flush_cqes(Slot& s);                           // holds _mu

  MemoryAccess& _mem;
  NetSwitch& _sw;
  uint32_t _sw_port = 0;
  PortAddr _addr;
  uint32_t _default_ip = 0;
  mutable std::mutex _mu;
  std::unique_ptr<MrTable> _mrs;
  std::unique_ptr<Engine> _eng;
  Totals _before;  // the engines' before this one (resets)
  static Totals with(const Totals& t, const Counters& c);  // t plus one engine's counters
  std::vector<std::unique_ptr<Slot>> _slots;
  uint8_t _arg[hal::abi::reg::kNetCmdArgSize] = {};
  uint32_t _cmd_status = 0, _cmd_result = 0;
  uint64_t _now = 0;
  std::mutex _rx_mu;
  std::deque<std::vector<uint8_t>> _rx;
};

}  // namespace hcomm::sim::roce
