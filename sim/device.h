// One simulated NPU: register file, HBM, address translation table, DMA
// engines. Fronts (vfio-user today, the QEMU/ivshmem front later) turn their
// transport's messages into calls on this class; the device does not know
// which front drives it.
//
// Threading: front calls come from the front's thread; engine threads run
// descriptors. All public methods are thread-safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/fd.h"
#include "common/status.h"
#include "hal/abi/desc.h"
#include "hal/abi/regs.h"
#include "hal/abi/ring.h"
#include "sim/roce/net.h"

namespace hcomm::sim {

namespace abi = hcomm::hal::abi;

class Fabric;

struct DeviceConfig {
  uint32_t fabric_index = 0;
  uint32_t node = 0;  // this simulator's node id (the port's MAC and default IP, §16.1)
  uint64_t hbm_size = 64ull << 20;
  uint32_t num_queues = 4;
  uint32_t max_queue_log2 = 16;
  uint32_t num_att = 1024;
  // Engine polling: spin this long on an idle queue before sleeping.
  uint32_t spin_us = 50;
  // The HBM memfd may carry a prefix the front uses (the ivshmem front puts
  // its header and register mailbox there): HBM starts at hbm_file_offset,
  // and the file is at least hbm_file_size bytes (0: offset + HBM).
  uint64_t hbm_file_offset = 0;
  uint64_t hbm_file_size = 0;
};

// Fault injection (sim/faults: command line and control socket).
struct FaultState {
  std::atomic<uint32_t> fail_next{0};     // next N descriptors complete with INJECTED
  std::atomic<uint32_t> corrupt_next{0};  // next N COPYs flip one byte of the destination
  std::atomic<int64_t> stall_until_ns{0}; // engines take no descriptor before this (steady clock)
  // "stall DEV MS AFTER": the engines take AFTER more descriptors, then
  // stall for stall_ms (a stall that starts between two descriptors of one
  // exchange, e.g. after a rendezvous claim and before its copy)
  std::atomic<uint32_t> stall_after{0};
  std::atomic<int64_t> stall_ms{0};
  // next N fetch atomics are done but answer what the device answered to
  // its previous fetch atomic (what Soft-RoCE did to a retransmitted
  // compare-swap: the old value of another word)
  std::atomic<uint32_t> stale_next{0};
  std::atomic<uint64_t> last_fetched{0};
};

// A host DMA mapping made by the client (vfio-user DMA_MAP).
struct DmaRegion {
  uint64_t bus_addr = 0;
  uint64_t len = 0;
  uint32_t prot = 0;  // driver::dma_prot bits
  uint8_t* host = nullptr;  // our mmap of the client's memory
};

class Device {
 public:
  Device(const DeviceConfig& cfg, Fabric* fabric);
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  Status init();  // creates HBM memfd, starts engines

  uint32_t fabric_index() const { return _cfg.fabric_index; }
  const DeviceConfig& config() const { return _cfg; }

  // ---- regions, as a front exposes them ----
  // PCI config space (256 bytes, read-only except command register).
  Status config_read(uint64_t offset, void* data, size_t len);
  Status config_write(uint64_t offset, const void* data, size_t len);
  // BAR0 registers: 4- or 8-byte accesses at natural alignment.
  Status bar0_read(uint64_t offset, void* data, size_t len);
  Status bar0_write(uint64_t offset, const void* data, size_t len);
  // BAR2 = HBM: mmapable; the memfd, where HBM starts in it, and its size.
  int hbm_fd() const { return _hbm_fd.get(); }
  uint64_t hbm_fd_offset() const { return _cfg.hbm_file_offset; }
  // The whole memfd as mapped here (prefix + HBM + any tail).
  uint8_t* file_base() const { return _file; }
  uint64_t file_size() const { return _file_size; }
  uint64_t hbm_size() const { return _cfg.hbm_size; }
  uint8_t* hbm() const { return _hbm; }
  // Slow-path HBM access for fronts without mmap (vfio-user REGION_READ/WRITE on BAR2).
  Status hbm_access(uint64_t offset, void* data, size_t len, bool write);

  // The eventfd a front hands out as the ioeventfd of queue q's doorbell:
  // a write to it is the same as an MMIO write to reg::doorbell(q).
  int doorbell_eventfd(uint32_t q) const;

  // ---- host DMA space ----
  // Takes ownership of fd (closes it), maps [offset, offset+len) of it.
  Status dma_map(uint64_t bus_addr, uint64_t len, int fd, uint64_t offset, uint32_t prot);
  Status dma_unmap(uint64_t bus_addr, uint64_t len);

  // ---- interrupts ----
  // MSI-X vector -> eventfd (takes ownership); fd -1 disconnects.
  Status set_msix(uint32_t vector, int fd);
  uint32_t msix_count() const { return _cfg.num_queues; }

  // Full device reset: queues stopped (pending descriptors ABORTED), ATT cleared,
  // registers to defaults. DMA mappings and MSI-X fds stay (they belong to the
  // transport); client_gone() drops those too.
  void reset();
  // The device resets itself, as after an internal fault (hcomm-sim's
  // control "reset"): reset() and one more in self_resets(), which the
  // ivshmem front publishes; a driver sees STATUS without ENABLED.
  void self_reset();
  uint64_t self_resets() const { return _self_resets.load(std::memory_order_acquire); }
  // Called (count after the reset) by self_reset(), so that a front can
  // publish the reset before anyone can open the device anew.
  void set_self_reset_hook(std::function<void(uint64_t)> hook) {
    std::lock_guard lk(_hook_mu);
    _self_reset_hook = std::move(hook);
  }
  // The front's client vanished: reset and drop everything it gave us.
  void client_gone();

  FaultState& faults() { return _faults; }


  // Counters for probe/info and tests.
  uint64_t completed() const { return _completed.load(std::memory_order_relaxed); }
  uint64_t errors() const { return _err_count.load(std::memory_order_relaxed); }

  // Translation used by a peer device's engine for KIND_PEER_HBM targets.
  uint8_t* peer_hbm(uint64_t offset, uint64_t len);

  // The network engine (cap::ROCE): null without a fabric. net_service() is
  // one round of its work on the fabric's network thread.
  roce::NetPort* net() const { return _net.get(); }
  bool net_service(uint64_t now_ns);

 private:
  struct Queue;
  struct AttEntry {
    uint64_t iova = 0;
    uint64_t len = 0;
    uint64_t target = 0;
    uint32_t flags = 0;
    bool valid = false;
  };
  // Result of translating one IOVA range.
  struct Xlate {
    uint8_t* ptr = nullptr;
    abi::CqStatus status = abi::CqStatus::OK;
  };

  // A data operand translated piece by piece (§6.4, ABI 1.2): one piece
  // when one entry holds it (no allocation), else one per entry it runs
  // through, each boundary 4 KiB-aligned.
  struct Piece {
    uint8_t* ptr = nullptr;
    uint64_t len = 0;
  };
  struct Span {
    abi::CqStatus status = abi::CqStatus::OK;
    Piece one;
    std::vector<Piece> many;  // set instead of `one` when the operand crosses entries
    bool ok() const { return status == abi::CqStatus::OK; }
    size_t count() const { return many.empty() ? 1 : many.size(); }
    const Piece& at(size_t i) const { return many.empty() ? one : many[i]; }
  };

  Xlate translate(uint64_t iova, uint64_t len, bool write, bool src) const;  // holds _att_mu shared
  Span translate_span(uint64_t iova, uint64_t len, bool write, bool src) const;  // holds _att_mu shared
  uint8_t* host_ptr(uint64_t bus_addr, uint64_t len, uint32_t need_prot) const;  // holds _dma_mu shared
  void att_command(uint32_t cmd);
  void queue_enable(uint32_t q, bool on);
  void abort_pending(Queue& q);
  void engine_loop(Queue& q);
  abi::CqStatus execute(Queue& q, const abi::SqEntry& d, uint64_t* fault_addr);
  void log_error(uint32_t q, uint32_t sq_index, abi::CqStatus st, uint64_t addr);
  void stop_queues();

  DeviceConfig _cfg;
  Fabric* _fabric;
  UniqueFd _hbm_fd;
  uint8_t* _file = nullptr;
  uint64_t _file_size = 0;
  uint8_t* _hbm = nullptr;

  mutable std::mutex _reg_mu;  // register file (front thread vs reset)
  uint32_t _control = 0;
  uint32_t _scratch = 0;
  uint32_t _att_index = 0;
  uint64_t _att_iova = 0, _att_len = 0, _att_target = 0;
  uint32_t _att_flags = 0, _att_status = 0;
  // ERR_LOG_* (guarded by _reg_mu; written by engines)
  uint32_t _err_code = 0, _err_queue = 0, _err_index = 0;
  uint64_t _err_addr = 0;
  std::atomic<uint64_t> _err_count{0};
  std::atomic<uint64_t> _completed{0};
  uint16_t _pci_command = 0;

  mutable std::shared_mutex _att_mu;
  std::vector<AttEntry> _att;

  mutable std::shared_mutex _dma_mu;
  std::map<uint64_t, DmaRegion> _dma;  // by bus_addr

  std::mutex _irq_mu;
  std::vector<UniqueFd> _msix;

  std::vector<std::unique_ptr<Queue>> _queues;
  FaultState _faults;
  std::atomic<uint64_t> _self_resets{0};
  std::mutex _hook_mu;
  std::function<void(uint64_t)> _self_reset_hook;
  std::mutex _reduce_mu;  // REDUCE serialisation when there is no fabric
  // The network engine reaches memory through the ATT like the DMA engines
  // (callers hold _dma_mu and _att_mu shared).
  class NetMemory : public roce::MemoryAccess {
   public:
    explicit NetMemory(Device& d) : _d(d) {}
    uint8_t* map(uint64_t iova, uint64_t len, bool write) override {
      return _d.translate(iova, len, write, !write).ptr;
    }
    std::mutex* reduce_mutex() override;  // the REDUCE serialisation of the DMA engines

   private:
    Device& _d;
  };
  NetMemory _net_mem{*this};
  std::unique_ptr<roce::NetPort> _net;
};

// All devices of one hcomm-sim process: the intra-node fabric over which a
// device's engines reach a peer's HBM.
class Fabric {
 public:
  Status add(std::unique_ptr<Device> dev);
  Device* device(uint32_t index) const;
  uint32_t size() const { return static_cast<uint32_t>(_devices.size()); }
  // Held by an engine for the duration of one REDUCE (see Device::execute).
  std::mutex& reduce_mutex() { return _reduce_mu; }

  // The network (§16): the switch joining the devices' ports, one thread
  // running every device's network engine, and an optional uplink (a QEMU
  // -netdev dgram link to a guest or another simulator, or a DPDK ethdev).
  struct NetOptions {
    std::string uplink;  // roce::open_link's spec; empty: no uplink
    std::string run_dir;  // the simulator's directory (DPDK's runtime files)
    std::string pcap;     // capture of the switch
  };
  roce::NetSwitch& net_switch() { return _switch; }
  // Frames lost whole on the uplink (buffers full, link down), since start.
  uint64_t uplink_overflow() const { return _uplink ? _uplink->overflow() : 0; }
  std::string uplink_describe() const { return _uplink ? _uplink->describe() : "none"; }
  Status start_network(const NetOptions& o);
  void stop_network();
  ~Fabric();

 private:
  void network_loop();

  std::vector<std::unique_ptr<Device>> _devices;
  std::mutex _reduce_mu;
  roce::NetSwitch _switch;
  std::unique_ptr<roce::Link> _uplink;
  uint32_t _uplink_port = 0;
  std::atomic<bool> _net_stop{false};
  std::thread _net_thread;
};

}  // namespace hcomm::sim
