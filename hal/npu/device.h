// hal::npu::Device: one NPU brought up over a driver::Link, following the
// bring-up sequence of docs/device-abi.md §5. Owns the device's translation
// table (ATT) and IOVA space: callers get Mappings, never raw ATT indices.
//
// Thread-safety: mapping calls are serialised internally (cold path); each
// DmaQueue is single-producer and belongs to one thread at a time.
#pragma once

#include <cstdint>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "driver/dma_memory.h"
#include "driver/link.h"
#include "hal/abi/desc.h"
#include "hal/abi/regs.h"

namespace hcomm::hal::npu {

class DmaQueue;
class RdmaQp;
struct NetInfo;
struct QpOptions;

struct DeviceInfo {
  uint16_t vendor_id = 0;
  uint16_t device_id = 0;
  uint32_t abi_version = 0;
  uint64_t caps = 0;
  uint64_t hbm_size = 0;
  uint32_t num_queues = 0;
  uint32_t max_queue_log2 = 0;
  uint32_t num_att = 0;
  uint32_t fabric_index = 0;
  uint32_t fabric_size = 0;
  uint32_t num_msix = 0;
};

struct ErrorLog {
  uint64_t count = 0;      // error completions since reset
  uint32_t last_code = 0;  // abi::CqStatus of the last one (0 = none)
  uint32_t last_queue = 0;
  uint32_t last_index = 0;
  uint64_t last_addr = 0;
  uint64_t completed = 0;  // all completions since reset
};

// Device access rights of a mapping.
namespace access {
inline constexpr uint32_t READ = abi::att::READ;
inline constexpr uint32_t WRITE = abi::att::WRITE;
inline constexpr uint32_t RW = READ | WRITE;
}  // namespace access

// One ATT entry: [iova, iova+len) as the device's engines see it.
struct Mapping {
  uint64_t iova = 0;
  uint64_t len = 0;
  uint32_t att_index = UINT32_MAX;  // the (first) ATT entry
  uint64_t bus_addr = 0;   // host mappings: the link's bus address (to dma_unmap)
  bool host = false;
  // A host buffer the link mapped in several pieces (VFIO iova-mode=pa and
  // memory that is not physically contiguous; needs cap::ATT_SPAN): one ATT
  // entry per piece at adjacent device IOVAs, piece k at iova + the sum of
  // the earlier lengths. Empty when one entry maps it all.
  struct Piece {
    uint32_t att_index = UINT32_MAX;
    uint64_t bus_addr = 0;
    uint64_t len = 0;
  };
  std::vector<Piece> pieces;
  bool valid() const { return att_index != UINT32_MAX; }
};

struct OpenOptions {
  int reset_timeout_ms = 1000;
};

class Device {
 public:
  // Bring-up (§5): identity and ABI check, reset, bus master, BAR2 map, enable.
  static Status open(std::unique_ptr<driver::Link> link, std::unique_ptr<Device>* out,
                     const OpenOptions& opts = {});
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  const DeviceInfo& info() const { return _info; }
  driver::Link& link() { return *_link; }
  // BAR2 mapped into this process (CPU access to HBM), or null if the link
  // cannot map it.
  uint8_t* hbm() const { return _hbm; }

  // Make host memory reachable by the engines: dma_map through the link, then
  // an ATT entry. `fd`/`fd_offset` describe the same memory as a file.
  Status map_host(void* ptr, uint64_t len, int fd, uint64_t fd_offset, uint32_t rights, Mapping* out);
  Status map_buffer(const driver::DmaBuffer& buf, uint32_t rights, Mapping* out) {
    return map_host(buf.data(), buf.size(), buf.fd(), 0, rights, out);
  }
  Status map_hbm(uint64_t offset, uint64_t len, uint32_t rights, Mapping* out);
  Status map_peer_hbm(uint32_t peer, uint64_t offset, uint64_t len, uint32_t rights, Mapping* out);
  Status unmap(Mapping* m);

  // Whether the device still serves this driver, without blocking long
  // (polled every peer_check_ms by the NPU transport): the link's own check
  // (vfio-user server hung up, ivshmem model gone or reset) on every call
  // and, where register reads are cheap, STATUS at most every
  // kStatusCheckMs: all ones (gone from the bus), FATAL, or ENABLED cleared
  // (the device was reset under us: its queues and translations are gone)
  // is device_error.
  // force: read STATUS now (after an ABORTED completion, say).
  static constexpr int kStatusCheckMs = 50;
  Status health(bool force = false);

  // A DMA queue with 1 << log2 entries. `interrupts`: completions signal an
  // MSI-X eventfd the queue waits on (else wait() polls).
  Status create_queue(uint32_t log2, bool interrupts, std::unique_ptr<DmaQueue>* out);

  // ---- the network engine (cap::ROCE, §15; hal/npu/rdma_qp.h) ----
  Status net_info(NetInfo* out);
  Status net_set_ip(uint32_t ip);
  // A memory key over [iova, iova + len) (a mapping's IOVAs) with
  // rdma::access rights; a new key byte each time an index is reused.
  Status mr_register(uint64_t iova, uint64_t len, uint8_t access, uint32_t* key);
  Status mr_invalidate(uint32_t key);
  Status create_qp(const QpOptions& o, std::unique_ptr<RdmaQp>* out);
  // One NET_CMD with its argument block; result: NET_CMD_RESULT.
  Status net_command(uint32_t cmd, const void* arg, size_t len, uint32_t* result);

  Status error_log(ErrorLog* out);
  Status clear_errors();

  // Raw register access for diagnostics (probe selftest).
  Status read32(uint32_t off, uint32_t* v) { return _link->read32(off, v); }
  Status write32(uint32_t off, uint32_t v) { return _link->write32(off, v); }

 private:
  explicit Device(std::unique_ptr<driver::Link> link) : _link(std::move(link)) {}
  Status bring_up(const OpenOptions& opts);
  Status att_install(uint64_t iova, uint64_t len, uint64_t target, uint32_t flags, uint32_t* index);
  Status att_clear(uint32_t index);
  uint64_t alloc_iova(uint64_t len);
  void release_queue(uint32_t q);
  friend class DmaQueue;
  friend class RdmaQp;
  std::mutex _net_mu;                // NET_CMD and its argument window
  std::vector<uint8_t> _mr_gen;      // key byte last used per key index
  std::vector<bool> _mr_used;

  std::unique_ptr<driver::Link> _link;
  DeviceInfo _info;
  uint8_t* _hbm = nullptr;
  std::mutex _mu;                 // ATT, IOVA space, queue slots
  std::vector<bool> _att_used;
  std::vector<bool> _queue_used;
  uint64_t _next_iova = 1ull << 32;  // never 0; 4 KiB aligned
  std::mutex _health_mu;
  std::chrono::steady_clock::time_point _status_checked{};
};

}  // namespace hcomm::hal::npu
