// hcomm-sim: one NPU. Implements docs/device-abi.md; section numbers below
// refer to it. The validation rules here are the conformance target: every
// rule a descriptor can break has its own CqStatus, and a broken rule stops
// the operation before any byte moves.
#include "sim/device.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "common/barrier.h"
#include "hal/abi/reduce.h"

namespace hcomm::sim {

namespace abi = hcomm::hal::abi;
using abi::CqStatus;

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// [a, a+alen) inside [b, b+blen), overflow-safe.
bool contained(uint64_t a, uint64_t alen, uint64_t b, uint64_t blen) {
  if (a < b) return false;
  uint64_t off = a - b;
  return off <= blen && alen <= blen - off;
}

bool overlaps(uint64_t a, uint64_t alen, uint64_t b, uint64_t blen) {
  return a < b + blen && b < a + alen;
}

}  // namespace

#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();
#endif

namespace {

// The bytes a descriptor moves are the device's DMA into memory of other
// processes (the drivers' mapped buffers) or into HBM: ThreadSanitizer
// cannot see the other side of those accesses, and shadowing them costs a
// page fault (with a TLB shootdown across the engine threads) per few KiB
// of every buffer ever touched - a 64 MiB COPY on each of four devices took
// over 30 s under TSan on a 2-vCPU VM. The engine's own state (queues,
// translation tables, locks) stays checked; only the data movement is
// hidden, as a real device's is.
class DeviceDataAccess {
 public:
#if defined(__SANITIZE_THREAD__)
  DeviceDataAccess() { __tsan_ignore_thread_begin(); }
  ~DeviceDataAccess() { __tsan_ignore_thread_end(); }
#else
  DeviceDataAccess() {}   // user-provided: a guard, never an "unused variable"
  ~DeviceDataAccess() {}
#endif
  DeviceDataAccess(const DeviceDataAccess&) = delete;
  DeviceDataAccess& operator=(const DeviceDataAccess&) = delete;
};

}  // namespace

// One DMA queue and its engine thread (§7, §8).
struct Device::Queue {
  uint32_t id = 0;
  UniqueFd doorbell;  // eventfd: MMIO writes to reg::doorbell(id) land here
  std::thread thread;
  std::atomic<bool> stop{false};

  // Guards everything below. The engine holds it for one batch at a time, so
  // a configuration change waits at most one batch.
  std::mutex mu;
  uint64_t sq_base = 0, cq_base = 0, shadow_base = 0;
  uint32_t size_log2 = 0;
  uint32_t msix = abi::kNoVector;
  bool enabled = false;
  uint8_t error = 0;  // abi::QueueError of the last refused enable
  // Latched at enable: the rings as the device sees them (host pointers).
  abi::Ring<abi::SqEntry> sq;
  abi::Ring<abi::CqEntry> cq;
  abi::QueueShadow* shadow = nullptr;
  uint64_t ring_bus_lo = 0, ring_bus_hi = 0;  // bus range the rings live in (for dma_unmap)
  uint32_t sq_head = 0;  // device-owned
  uint32_t cq_tail = 0;  // device-owned
  std::atomic<uint64_t> completed{0};
};

Device::Device(const DeviceConfig& cfg, Fabric* fabric) : _cfg(cfg), _fabric(fabric) {}

Device::~Device() {
  for (auto& q : _queues) {
    q->stop.store(true);
    uint64_t one = 1;
    ssize_t n = ::write(q->doorbell.get(), &one, sizeof one);
    (void)n;
  }
  for (auto& q : _queues) {
    if (q->thread.joinable()) q->thread.join();
  }
  std::unique_lock lk(_dma_mu);
  for (auto& [bus, r] : _dma) ::munmap(r.host, r.len);
  _dma.clear();
  if (_file != nullptr) ::munmap(_file, _file_size);
}

Status Device::init() {
  if (_cfg.num_queues == 0 || _cfg.num_queues > abi::reg::MAX_QUEUES)
    return Status::error(Code::invalid_argument, "queues must be 1..%u", abi::reg::MAX_QUEUES);
  if (_cfg.hbm_size == 0 || _cfg.hbm_size % 4096 != 0)
    return Status::error(Code::invalid_argument, "HBM size must be a non-zero multiple of 4 KiB");
  if (_cfg.max_queue_log2 < 1 || _cfg.max_queue_log2 > 20)
    return Status::error(Code::invalid_argument, "max queue log2 must be 1..20");
  if (_cfg.hbm_file_offset % 4096 != 0 || _cfg.hbm_file_offset > (uint64_t{1} << 40))
    return Status::error(Code::invalid_argument, "HBM file offset must be 4 KiB aligned");
  _file_size = std::max(_cfg.hbm_file_size, _cfg.hbm_file_offset + _cfg.hbm_size);
  int fd = ::memfd_create("hcomm-sim-hbm", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return Status::from_errno(errno, "memfd_create(hbm)");
  _hbm_fd.reset(fd);
  if (::ftruncate(fd, static_cast<off_t>(_file_size)) != 0)
    return Status::from_errno(errno, "ftruncate(hbm)");
  // Clients get this fd (vfio-user BAR2, the ivshmem shared memory): none may
  // resize it under the engines (a shrink would SIGBUS the model).
  if (::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    return Status::from_errno(errno, "seal(hbm)");
  void* p = ::mmap(nullptr, _file_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return Status::from_errno(errno, "mmap(hbm)");
  _file = static_cast<uint8_t*>(p);
  _hbm = _file + _cfg.hbm_file_offset;
  _att.assign(_cfg.num_att, AttEntry{});
  _msix.resize(_cfg.num_queues);
  for (uint32_t i = 0; i < _cfg.num_queues; ++i) {
    auto q = std::make_unique<Queue>();
    q->id = i;
    int efd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (efd < 0) return Status::from_errno(errno, "eventfd(doorbell)");
    q->doorbell.reset(efd);
    _queues.push_back(std::move(q));
  }
  for (auto& q : _queues) {
    Queue* qp = q.get();
    qp->thread = std::thread([this, qp] { engine_loop(*qp); });
  }
  if (_fabric != nullptr) _net = std::make_unique<roce::NetPort>(_cfg.node, _cfg.fabric_index, _net_mem, _fabric->net_switch());
  return Status::ok();
}

bool Device::net_service(uint64_t now_ns) {
  if (!_net) return false;
  std::shared_lock dl(_dma_mu);
  std::shared_lock al(_att_mu);
  return _net->service(now_ns);
}

// ---- PCI config space (§2) ---------------------------------------------------

namespace {
constexpr uint32_t kCfgSize = 256;
constexpr uint16_t kPciCommandBusMaster = 0x0004;
constexpr uint8_t kMsixCapOffset = 0x40;
}  // namespace

Status Device::config_read(uint64_t offset, void* data, size_t len) {
  if (len == 0 || len > kCfgSize || offset > kCfgSize - len)
    return Status::error(Code::out_of_range, "config read [%#lx,+%zu) outside 256 bytes",
                         static_cast<unsigned long>(offset), len);
  uint8_t cfg[kCfgSize] = {};
  auto put16 = [&](uint32_t off, uint16_t v) { std::memcpy(cfg + off, &v, 2); };
  auto put32 = [&](uint32_t off, uint32_t v) { std::memcpy(cfg + off, &v, 4); };
  put16(0x00, abi::kPciVendorId);
  put16(0x02, abi::kPciDeviceId);
  {
    std::lock_guard lk(_reg_mu);
    put16(0x04, _pci_command);
  }
  put16(0x06, 1u << 4);  // status: capabilities list present
  put32(0x08, (abi::kPciClassCode << 8) | 0x01);  // class code, revision 1
  // BARs: 64-bit prefetchable memory BARs 0, 2, 4 (type bits only; the
  // transport reports sizes and addresses).
  put32(0x10, 0x4 | 0x8);
  put32(0x18, 0x4 | 0x8);
  put32(0x20, 0x4 | 0x8);
  put16(0x2c, abi::kPciVendorId);  // subsystem vendor
  put16(0x2e, abi::kPciDeviceId);  // subsystem id
  cfg[0x34] = kMsixCapOffset;
  // MSI-X capability: table in BAR4 at 0, PBA in BAR4 at 0x800.
  cfg[kMsixCapOffset] = 0x11;
  cfg[kMsixCapOffset + 1] = 0;
  put16(kMsixCapOffset + 2, static_cast<uint16_t>(msix_count() - 1));
  put32(kMsixCapOffset + 4, 0x000 | abi::kBarMsix);
  put32(kMsixCapOffset + 8, 0x800 | abi::kBarMsix);
  std::memcpy(data, cfg + offset, len);
  return Status::ok();
}

Status Device::config_write(uint64_t offset, const void* data, size_t len) {
  if (len == 0 || len > kCfgSize || offset > kCfgSize - len)
    return Status::error(Code::out_of_range, "config write outside 256 bytes");
  // Only the command register (memory space, bus master) is writable.
  if (offset <= 0x04 && offset + len >= 0x06) {
    uint16_t cmd;
    std::memcpy(&cmd, static_cast<const uint8_t*>(data) + (0x04 - offset), 2);
    std::lock_guard lk(_reg_mu);
    _pci_command = cmd & 0x0006;
  }
  return Status::ok();
}

// ---- BAR0 registers (§4) -------------------------------------------------------

namespace {
// Merge a 4- or 8-byte write at `offset` into a 64-bit register at `base`.
void merge64(uint64_t& reg, uint64_t base, uint64_t offset, uint64_t v, size_t len) {
  if (len == 8) {
    reg = v;
  } else if (offset == base) {
    reg = (reg & 0xffffffff00000000ull) | (v & 0xffffffffu);
  } else {
    reg = (reg & 0xffffffffull) | (v << 32);
  }
}
bool in64(uint64_t offset, uint64_t base) { return offset == base || offset == base + 4; }
uint64_t pick(uint64_t reg, uint64_t base, uint64_t offset, size_t len) {
  if (len == 8) return reg;
  return offset == base ? (reg & 0xffffffffu) : (reg >> 32);
}
}  // namespace

Status Device::bar0_read(uint64_t offset, void* data, size_t len) {
  namespace reg = abi::reg;
  if ((len != 4 && len != 8) || offset % len != 0 || offset > abi::kBar0Size - len)
    return Status::error(Code::invalid_argument, "BAR0 read of %zu bytes at %#lx: need an aligned 4/8-byte access",
                         len, static_cast<unsigned long>(offset));
  uint64_t v = 0;
  if (roce::NetPort::owns(offset)) {
    if (!_net) {
      std::memset(data, 0, len);
      return Status::ok();
    }
    return _net->reg_read(offset, data, len);
  }
  auto r64 = [&](uint64_t base, uint64_t value) {
    if (in64(offset, base)) v = pick(value, base, offset, len);
  };
  if (offset >= reg::QUEUE_BASE && offset < reg::QUEUE_BASE + reg::MAX_QUEUES * reg::QUEUE_STRIDE) {
    uint32_t qi = static_cast<uint32_t>((offset - reg::QUEUE_BASE) / reg::QUEUE_STRIDE);
    uint64_t field = (offset - reg::QUEUE_BASE) % reg::QUEUE_STRIDE;
    if (qi < _queues.size()) {
      Queue& q = *_queues[qi];
      std::lock_guard lk(q.mu);
      auto rq = [&](uint64_t base, uint64_t value) {
        if (in64(field, base)) v = pick(value, base, field, len);
      };
      rq(reg::Q_SQ_BASE, q.sq_base);
      rq(reg::Q_CQ_BASE, q.cq_base);
      rq(reg::Q_SHADOW, q.shadow_base);
      rq(reg::Q_COMPLETED, q.completed.load(std::memory_order_relaxed));
      if (field == reg::Q_SIZE_LOG2) v = q.size_log2;
      if (field == reg::Q_MSIX) v = q.msix;
      if (field == reg::Q_CTRL) v = q.enabled ? abi::qctrl::ENABLE : 0;
      if (field == reg::Q_STATUS)
        v = (q.enabled ? abi::qstatus::ENABLED : 0) |
            (q.error != 0 ? abi::qstatus::ERROR | (uint32_t{q.error} << abi::qstatus::ERROR_SHIFT) : 0);
    }
    std::memcpy(data, &v, len);
    return Status::ok();
  }
  std::lock_guard lk(_reg_mu);
  switch (offset) {
    case reg::ID: v = abi::kPciVendorId | (uint32_t{abi::kPciDeviceId} << 16); break;
    case reg::ABI_VERSION: v = abi::kAbiVersion; break;
    case reg::NUM_QUEUES: v = _cfg.num_queues; break;
    case reg::MAX_QUEUE_LOG2: v = _cfg.max_queue_log2; break;
    case reg::NUM_ATT: v = _cfg.num_att; break;
    case reg::FABRIC_INDEX: v = _cfg.fabric_index; break;
    case reg::FABRIC_SIZE: v = _fabric != nullptr ? _fabric->size() : 1; break;
    case reg::NUM_MSIX: v = msix_count(); break;
    case reg::CONTROL: v = _control & abi::ctrl::ENABLE; break;
    case reg::STATUS:
      v = abi::status::READY | ((_control & abi::ctrl::ENABLE) ? abi::status::ENABLED : 0);
      break;
    case reg::ERR_LOG_CODE: v = _err_code; break;
    case reg::ERR_LOG_QUEUE: v = _err_queue; break;
    case reg::ERR_LOG_INDEX: v = _err_index; break;
    case reg::SCRATCH: v = _scratch; break;
    case reg::ATT_INDEX: v = _att_index; break;
    case reg::ATT_FLAGS: v = _att_flags; break;
    case reg::ATT_STATUS: v = _att_status; break;
    default: break;
  }
  uint64_t caps = abi::cap::COPY | abi::cap::FILL | abi::cap::REDUCE | abi::cap::NOTIFY |
                  abi::cap::FP16 | abi::cap::BF16 | abi::cap::PEER_DMA | abi::cap::MSIX |
                  abi::cap::WAKE_SUPPRESS | abi::cap::ATOMIC | abi::cap::ATT_SPAN |
                  (_net ? abi::cap::ROCE : 0);
  r64(reg::CAPS, caps);
  r64(reg::HBM_SIZE, _cfg.hbm_size);
  r64(reg::ERR_COUNT, _err_count.load(std::memory_order_relaxed));
  r64(reg::ERR_LOG_ADDR, _err_addr);
  r64(reg::COMPLETED, _completed.load(std::memory_order_relaxed));
  r64(reg::ATT_IOVA, _att_iova);
  r64(reg::ATT_LEN, _att_len);
  r64(reg::ATT_TARGET, _att_target);
  std::memcpy(data, &v, len);
  return Status::ok();
}

Status Device::bar0_write(uint64_t offset, const void* data, size_t len) {
  namespace reg = abi::reg;
  if ((len != 4 && len != 8) || offset % len != 0 || offset > abi::kBar0Size - len)
    return Status::error(Code::invalid_argument, "BAR0 write of %zu bytes at %#lx: need an aligned 4/8-byte access",
                         len, static_cast<unsigned long>(offset));
  uint64_t v = 0;
  std::memcpy(&v, data, len);
  if (roce::NetPort::owns(offset)) {
    if (!_net) return Status::ok();
    // Commands translate ring addresses through the ATT (QP_CREATE).
    std::shared_lock dl(_dma_mu);
    std::shared_lock al(_att_mu);
    return _net->reg_write(offset, data, len);
  }
  // §8 doorbells: any write wakes the queue's engine.
  if (offset >= abi::kDoorbellPageOffset) {
    uint64_t rel = offset - abi::kDoorbellPageOffset;
    if (rel % reg::DOORBELL_STRIDE == 0 && rel / reg::DOORBELL_STRIDE < _queues.size()) {
      uint64_t one = 1;
      ssize_t n = ::write(_queues[rel / reg::DOORBELL_STRIDE]->doorbell.get(), &one, sizeof one);
      (void)n;
    }
    return Status::ok();
  }
  if (offset >= reg::QUEUE_BASE && offset < reg::QUEUE_BASE + reg::MAX_QUEUES * reg::QUEUE_STRIDE) {
    uint32_t qi = static_cast<uint32_t>((offset - reg::QUEUE_BASE) / reg::QUEUE_STRIDE);
    uint64_t rel = (offset - reg::QUEUE_BASE) % reg::QUEUE_STRIDE;
    if (qi >= _queues.size()) return Status::ok();  // absent queue: writes ignored
    Queue& q = *_queues[qi];
    if (rel == reg::Q_CTRL) {
      queue_enable(qi, (v & abi::qctrl::ENABLE) != 0);
      return Status::ok();
    }
    std::lock_guard lk(q.mu);
    if (q.enabled) return Status::ok();  // config is frozen while enabled (§7)
    if (in64(rel, reg::Q_SQ_BASE)) merge64(q.sq_base, reg::Q_SQ_BASE, rel, v, len);
    else if (in64(rel, reg::Q_CQ_BASE)) merge64(q.cq_base, reg::Q_CQ_BASE, rel, v, len);
    else if (in64(rel, reg::Q_SHADOW)) merge64(q.shadow_base, reg::Q_SHADOW, rel, v, len);
    else if (rel == reg::Q_SIZE_LOG2) q.size_log2 = static_cast<uint32_t>(v);
    else if (rel == reg::Q_MSIX) q.msix = static_cast<uint32_t>(v);
    return Status::ok();
  }
  if (offset == reg::CONTROL) {
    if (v & abi::ctrl::RESET) {
      reset();
      return Status::ok();
    }
    std::lock_guard lk(_reg_mu);
    _control = static_cast<uint32_t>(v) & abi::ctrl::ENABLE;
    for (auto& q : _queues) {
      uint64_t one = 1;
      ssize_t n = ::write(q->doorbell.get(), &one, sizeof one);
      (void)n;
    }
    return Status::ok();
  }
  if (offset == reg::ATT_CMD) {
    att_command(static_cast<uint32_t>(v));
    return Status::ok();
  }
  std::lock_guard lk(_reg_mu);
  if (offset == reg::ERR_CLEAR) {
    if (v & 1) {
      _err_code = _err_queue = _err_index = 0;
      _err_addr = 0;
    }
  } else if (offset == reg::SCRATCH) {
    _scratch = static_cast<uint32_t>(v);
  } else if (offset == reg::ATT_INDEX) {
    _att_index = static_cast<uint32_t>(v);
  } else if (offset == reg::ATT_FLAGS) {
    _att_flags = static_cast<uint32_t>(v);
  } else if (in64(offset, reg::ATT_IOVA)) {
    merge64(_att_iova, reg::ATT_IOVA, offset, v, len);
  } else if (in64(offset, reg::ATT_LEN)) {
    merge64(_att_len, reg::ATT_LEN, offset, v, len);
  } else if (in64(offset, reg::ATT_TARGET)) {
    merge64(_att_target, reg::ATT_TARGET, offset, v, len);
  }
  // Everything else is read-only or reserved: writes are ignored (§4).
  return Status::ok();
}

Status Device::hbm_access(uint64_t offset, void* data, size_t len, bool write) {
  if (!contained(offset, len, 0, _cfg.hbm_size))
    return Status::error(Code::out_of_range, "HBM access [%#lx,+%zu) outside %lu bytes",
                         static_cast<unsigned long>(offset), len,
                         static_cast<unsigned long>(_cfg.hbm_size));
  if (write) std::memcpy(_hbm + offset, data, len);
  else std::memcpy(data, _hbm + offset, len);
  return Status::ok();
}

int Device::doorbell_eventfd(uint32_t q) const {
  return q < _queues.size() ? _queues[q]->doorbell.get() : -1;
}

uint8_t* Device::peer_hbm(uint64_t offset, uint64_t len) {
  return contained(offset, len, 0, _cfg.hbm_size) ? _hbm + offset : nullptr;
}

// ---- §6 address translation table ------------------------------------------------

void Device::att_command(uint32_t cmd) {
  uint32_t index, flags;
  uint64_t iova, len, target;
  {
    std::lock_guard lk(_reg_mu);
    index = _att_index;
    flags = _att_flags;
    iova = _att_iova;
    len = _att_len;
    target = _att_target;
  }
  auto result = [&](uint32_t st) {
    std::lock_guard lk(_reg_mu);
    _att_status = st;
  };
  if (index >= _cfg.num_att) return result(abi::att_status::BAD_INDEX);
  if (cmd == abi::att_cmd::CLEAR) {
    // Exclusive lock: waits for any engine batch that may be using the entry.
    std::unique_lock lk(_att_mu);
    _att[index].valid = false;
    return result(abi::att_status::OK);
  }
  if (cmd != abi::att_cmd::WRITE) return result(abi::att_status::BAD_CMD);
  if (len == 0 || iova + len < iova || target + len < target) return result(abi::att_status::BAD_RANGE);
  uint32_t kind = flags & abi::att::KIND_MASK;
  if ((flags & ~abi::att::kKnownBits) != 0 || (flags & (abi::att::READ | abi::att::WRITE)) == 0)
    return result(abi::att_status::BAD_FLAGS);
  uint32_t peer = (flags & abi::att::PEER_MASK) >> abi::att::PEER_SHIFT;
  if (kind == abi::att::KIND_HBM) {
    if (!contained(target, len, 0, _cfg.hbm_size)) return result(abi::att_status::BAD_RANGE);
  } else if (kind == abi::att::KIND_PEER_HBM) {
    Device* p = _fabric != nullptr ? _fabric->device(peer) : nullptr;
    if (p == nullptr) return result(abi::att_status::BAD_FLAGS);
    if (!contained(target, len, 0, p->hbm_size())) return result(abi::att_status::BAD_RANGE);
  } else if (kind == abi::att::KIND_HOST) {
    std::shared_lock dl(_dma_mu);
    uint32_t need = ((flags & abi::att::READ) ? 1u : 0u) | ((flags & abi::att::WRITE) ? 2u : 0u);
    if (host_ptr(target, len, need) == nullptr) return result(abi::att_status::NOT_MAPPED);
  } else {
    return result(abi::att_status::BAD_FLAGS);
  }
  if (kind != abi::att::KIND_PEER_HBM && (flags & abi::att::PEER_MASK) != 0)
    return result(abi::att_status::BAD_FLAGS);
  std::unique_lock lk(_att_mu);
  for (uint32_t i = 0; i < _att.size(); ++i) {
    const AttEntry& e = _att[i];
    if (i != index && e.valid && overlaps(iova, len, e.iova, e.len)) return result(abi::att_status::OVERLAP);
  }
  _att[index] = AttEntry{iova, len, target, flags, true};
  result(abi::att_status::OK);
}

uint8_t* Device::host_ptr(uint64_t bus_addr, uint64_t len, uint32_t need_prot) const {
  auto it = _dma.upper_bound(bus_addr);
  if (it == _dma.begin()) return nullptr;
  --it;
  const DmaRegion& r = it->second;
  if (!contained(bus_addr, len, r.bus_addr, r.len)) return nullptr;
  if ((r.prot & need_prot) != need_prot) return nullptr;
  return r.host + (bus_addr - r.bus_addr);
}

Device::Xlate Device::translate(uint64_t iova, uint64_t len, bool write, bool src) const {
  const CqStatus fault = src ? CqStatus::SRC_FAULT : CqStatus::DST_FAULT;
  const CqStatus perm = src ? CqStatus::SRC_PERM : CqStatus::DST_PERM;
  // Linear scan is fine for a model; hardware uses a CAM / radix table.
  for (const AttEntry& e : _att) {
    if (!e.valid || !contained(iova, len, e.iova, e.len)) continue;
    uint32_t need = write ? abi::att::WRITE : abi::att::READ;
    if ((e.flags & need) == 0) return {nullptr, perm};
    uint64_t off = e.target + (iova - e.iova);
    switch (e.flags & abi::att::KIND_MASK) {
      case abi::att::KIND_HBM:
        return contained(off, len, 0, _cfg.hbm_size) ? Xlate{_hbm + off, CqStatus::OK} : Xlate{nullptr, fault};
      case abi::att::KIND_PEER_HBM: {
        uint32_t peer = (e.flags & abi::att::PEER_MASK) >> abi::att::PEER_SHIFT;
        Device* p = _fabric != nullptr ? _fabric->device(peer) : nullptr;
        uint8_t* ptr = p != nullptr ? p->peer_hbm(off, len) : nullptr;
        return ptr != nullptr ? Xlate{ptr, CqStatus::OK} : Xlate{nullptr, CqStatus::PEER_FAULT};
      }
      default: {
        uint8_t* ptr = host_ptr(off, len, write ? 2u : 1u);
        return ptr != nullptr ? Xlate{ptr, CqStatus::OK} : Xlate{nullptr, CqStatus::HOST_FAULT};
      }
    }
  }
  return {nullptr, fault};
}

Device::Span Device::translate_span(uint64_t iova, uint64_t len, bool write, bool src) const {
  Span sp;
  Xlate x = translate(iova, len, write, src);
  if (x.ptr != nullptr) {
    sp.one = {x.ptr, len};
    return sp;
  }
  const CqStatus fault = src ? CqStatus::SRC_FAULT : CqStatus::DST_FAULT;
  sp.status = x.status;
  if (x.status != fault) return sp;  // held by one entry, refused there (rights, backing store)
  // Not inside one entry: walk the entries it runs through. Each boundary
  // must be 4 KiB-aligned, so an element of any dtype never straddles one.
  uint64_t cur = iova, left = len;
  while (left > 0) {
    const AttEntry* hit = nullptr;
    for (const AttEntry& e : _att)
      if (e.valid && contained(cur, 1, e.iova, e.len)) {
        hit = &e;
        break;
      }
    if (hit == nullptr) return sp.many.clear(), sp;  // a hole: the operand faults
    const uint64_t piece = std::min(left, hit->iova + hit->len - cur);
    if (piece < left && (cur + piece) % 4096 != 0) return sp.many.clear(), sp;
    Xlate p = translate(cur, piece, write, src);
    if (p.ptr == nullptr) {
      sp.many.clear();
      sp.status = p.status;
      return sp;
    }
    sp.many.push_back({p.ptr, piece});
    cur += piece;
    left -= piece;
  }
  if (sp.many.size() == 1) {
    sp.one = sp.many[0];
    sp.many.clear();
  }
  sp.status = CqStatus::OK;
  return sp;
}

namespace {

// Walks two spans of equal total length in step: fn(dst, src, n) for each
// run that is contiguous on both sides.
template <class Fn>
void zip_pieces(const auto& t, const auto& s, Fn fn) {
  size_t ti = 0, si = 0;
  uint64_t toff = 0, soff = 0;
  while (ti < t.count() && si < s.count()) {
    const auto& tp = t.at(ti);
    const auto& spc = s.at(si);
    const uint64_t n = std::min(tp.len - toff, spc.len - soff);
    fn(tp.ptr + toff, spc.ptr + soff, n);
    toff += n;
    soff += n;
    if (toff == tp.len) ++ti, toff = 0;
    if (soff == spc.len) ++si, soff = 0;
  }
}

uint8_t* byte_at(const auto& span, uint64_t off) {
  for (size_t i = 0; i < span.count(); ++i) {
    if (off < span.at(i).len) return span.at(i).ptr + off;
    off -= span.at(i).len;
  }
  return nullptr;
}

}  // namespace

// ---- host DMA space --------------------------------------------------------------

Status Device::dma_map(uint64_t bus_addr, uint64_t len, int fd, uint64_t offset, uint32_t prot) {
  UniqueFd owned(fd);
  if (len == 0 || bus_addr % 4096 != 0 || len % 4096 != 0 || offset % 4096 != 0 || bus_addr + len < bus_addr)
    return Status::error(Code::invalid_argument, "DMA map: address, size and offset must be 4 KiB aligned and non-empty");
  if ((prot & ~3u) != 0 || prot == 0)
    return Status::error(Code::invalid_argument, "DMA map: bad protection %#x", prot);
  if (!owned.valid()) return Status::error(Code::invalid_argument, "DMA map: no file descriptor");
  void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, owned.get(), static_cast<off_t>(offset));
  if (p == MAP_FAILED) {
    // A read-only fd can still back a device-read-only mapping.
    p = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, owned.get(), static_cast<off_t>(offset));
    if (p == MAP_FAILED) return Status::from_errno(errno, "DMA map: mmap of the client's memory");
    if (prot & 2u) {
      ::munmap(p, len);
      return Status::error(Code::access_denied, "DMA map: memory is not writable but WRITE was asked");
    }
  }
  std::unique_lock lk(_dma_mu);
  for (auto& [b, r] : _dma) {
    if (overlaps(bus_addr, len, r.bus_addr, r.len)) {
      ::munmap(p, len);
      return Status::error(Code::invalid_argument, "DMA map: [%#lx,+%#lx) overlaps an existing mapping",
                           static_cast<unsigned long>(bus_addr), static_cast<unsigned long>(len));
    }
  }
  _dma[bus_addr] = DmaRegion{bus_addr, len, prot, static_cast<uint8_t*>(p)};
  return Status::ok();
}

Status Device::dma_unmap(uint64_t bus_addr, uint64_t len) {
  {
    std::shared_lock lk(_dma_mu);
    auto it = _dma.find(bus_addr);
    if (it == _dma.end() || it->second.len != len)
      return Status::error(Code::not_found, "DMA unmap: no mapping [%#lx,+%#lx)", static_cast<unsigned long>(bus_addr),
                           static_cast<unsigned long>(len));
  }
  // A queue whose rings live in the memory being removed stops first (its
  // latched ring pointers would dangle otherwise); so does a queue pair.
  if (_net) {
    std::shared_lock lk(_dma_mu);
    auto it = _dma.find(bus_addr);
    if (it != _dma.end()) _net->forget(it->second.host, it->second.len);
  }
  for (auto& q : _queues) {
    std::lock_guard ql(q->mu);
    if (q->enabled && overlaps(q->ring_bus_lo, q->ring_bus_hi - q->ring_bus_lo, bus_addr, len)) {
      q->enabled = false;
      q->shadow = nullptr;
    }
  }
  std::unique_lock lk(_dma_mu);  // waits for engine batches using the memory
  auto it = _dma.find(bus_addr);
  if (it == _dma.end()) return Status::error(Code::not_found, "DMA unmap: mapping vanished");
  ::munmap(it->second.host, it->second.len);
  _dma.erase(it);
  return Status::ok();
}

Status Device::set_msix(uint32_t vector, int fd) {
  UniqueFd owned(fd);
  if (vector >= msix_count())
    return Status::error(Code::invalid_argument, "MSI-X vector %u >= %u", vector, msix_count());
  std::lock_guard lk(_irq_mu);
  _msix[vector] = std::move(owned);
  return Status::ok();
}

// ---- §7 queues ---------------------------------------------------------------------

// Called with q.mu held on an enabled queue (its rings are mapped: dma_unmap
// disables a queue under q.mu before it removes ring memory). Completes every
// published descriptor the engine has not taken with ABORTED, as far as the
// CQ has room, so a driver's waiters fail instead of timing out.
void Device::abort_pending(Queue& q) {
  abi::QueueShadow* sh = q.shadow;
  if (sh == nullptr) return;
  uint32_t tail = sh->sq_tail.value.load(std::memory_order_acquire);
  if (!q.sq.valid_producer(tail, q.sq_head)) return;
  while (q.sq_head != tail) {
    uint32_t cq_head = sh->cq_head.value.load(std::memory_order_acquire);
    if (q.cq.used(q.cq_tail, cq_head) >= q.cq.size()) break;
    uint64_t user_data;
    std::memcpy(&user_data, &q.sq.at(q.sq_head).user_data, sizeof user_data);
    abi::CqEntry& c = q.cq.at(q.cq_tail);
    c.user_data = user_data;
    c.sq_index = q.sq_head++;
    c.status = static_cast<uint16_t>(CqStatus::ABORTED);
    std::atomic_ref<uint16_t>(c.info).store(q.cq.phase(q.cq_tail), std::memory_order_release);
    ++q.cq_tail;
  }
  sh->sq_head.value.store(q.sq_head, std::memory_order_release);
}

void Device::queue_enable(uint32_t qi, bool on) {
  Queue& q = *_queues[qi];
  std::lock_guard lk(q.mu);
  if (!on) {
    if (q.enabled) abort_pending(q);
    q.enabled = false;
    q.shadow = nullptr;
    return;
  }
  if (q.enabled) return;
  auto refuse = [&](abi::QueueError e) { q.error = static_cast<uint8_t>(e); };
  if (q.size_log2 == 0 || q.size_log2 > _cfg.max_queue_log2) return refuse(abi::QueueError::bad_size);
  if (q.sq_base % 64 != 0 || q.cq_base % 64 != 0 || q.shadow_base % 64 != 0)
    return refuse(abi::QueueError::misaligned);
  if (q.msix != abi::kNoVector && q.msix >= msix_count()) return refuse(abi::QueueError::bad_vector);
  uint64_t entries = 1ull << q.size_log2;
  std::shared_lock dl(_dma_mu);
  std::shared_lock al(_att_mu);
  Xlate sq = translate(q.sq_base, entries * sizeof(abi::SqEntry), false, true);
  if (sq.ptr == nullptr) return refuse(abi::QueueError::sq_unmapped);
  Xlate cq = translate(q.cq_base, entries * sizeof(abi::CqEntry), true, false);
  if (cq.ptr == nullptr) return refuse(abi::QueueError::cq_unmapped);
  Xlate shr = translate(q.shadow_base, sizeof(abi::QueueShadow), false, true);
  Xlate shw = translate(q.shadow_base, sizeof(abi::QueueShadow), true, false);
  if (shr.ptr == nullptr || shw.ptr == nullptr) return refuse(abi::QueueError::shadow_unmapped);
  // Rings must be host memory: the engine latches the pointers, and
  // dma_unmap() stops queues whose rings it removes. Record the bus range.
  uint64_t lo = UINT64_MAX, hi = 0;
  for (auto& [b, r] : _dma) {
    for (uint8_t* p : {sq.ptr, cq.ptr, shr.ptr}) {
      if (p >= r.host && p < r.host + r.len) {
        lo = std::min(lo, r.bus_addr);
        hi = std::max(hi, r.bus_addr + r.len);
      }
    }
  }
  auto* shadow = reinterpret_cast<abi::QueueShadow*>(shr.ptr);
  if (shadow->sq_tail.value.load(std::memory_order_acquire) != 0 ||
      shadow->cq_head.value.load(std::memory_order_acquire) != 0)
    return refuse(abi::QueueError::dirty_shadow);
  q.ring_bus_lo = lo == UINT64_MAX ? 0 : lo;
  q.ring_bus_hi = hi;
  q.sq = abi::Ring<abi::SqEntry>(reinterpret_cast<abi::SqEntry*>(sq.ptr), q.size_log2);
  q.cq = abi::Ring<abi::CqEntry>(reinterpret_cast<abi::CqEntry*>(cq.ptr), q.size_log2);
  q.shadow = shadow;
  q.sq_head = 0;
  q.cq_tail = 0;
  q.shadow->sq_head.value.store(0, std::memory_order_release);
  q.shadow->need_wakeup.value.store(0, std::memory_order_release);
  q.error = 0;
  q.enabled = true;
  uint64_t one = 1;
  ssize_t n = ::write(q.doorbell.get(), &one, sizeof one);
  (void)n;
}

void Device::stop_queues() {
  for (auto& q : _queues) {
    std::lock_guard lk(q->mu);
    if (q->enabled) abort_pending(*q);
    q->enabled = false;
    q->shadow = nullptr;
    q->sq_base = q->cq_base = q->shadow_base = 0;
    q->size_log2 = 0;
    q->msix = abi::kNoVector;
    q->error = 0;
    q->completed.store(0);
  }
}

void Device::reset() {
  stop_queues();
  if (_net) _net->reset();
  {
    std::unique_lock lk(_att_mu);
    for (auto& e : _att) e = AttEntry{};
  }
  std::lock_guard lk(_reg_mu);
  _control = 0;
  _scratch = 0;
  _att_index = _att_flags = _att_status = 0;
  _att_iova = _att_len = _att_target = 0;
  _err_code = _err_queue = _err_index = 0;
  _err_addr = 0;
  _err_count.store(0);
  _completed.store(0);
}

void Device::self_reset() {
  reset();
  const uint64_t n = _self_resets.fetch_add(1, std::memory_order_acq_rel) + 1;
  std::lock_guard lk(_hook_mu);
  if (_self_reset_hook) _self_reset_hook(n);
}

void Device::client_gone() {
  reset();
  {
    std::unique_lock lk(_dma_mu);
    for (auto& [b, r] : _dma) ::munmap(r.host, r.len);
    _dma.clear();
  }
  std::lock_guard lk(_irq_mu);
  for (auto& fd : _msix) fd.reset();
  std::lock_guard rl(_reg_mu);
  _pci_command = 0;
}

void Device::log_error(uint32_t q, uint32_t sq_index, CqStatus st, uint64_t addr) {
  _err_count.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard lk(_reg_mu);
  _err_code = static_cast<uint32_t>(st);
  _err_queue = q;
  _err_index = sq_index;
  _err_addr = addr;
}

// ---- §9 descriptor execution ---------------------------------------------------------

CqStatus Device::execute(Queue& q, const abi::SqEntry& d, uint64_t* fault_addr) {
  (void)q;
  using abi::Opcode;
  *fault_addr = 0;
  if (d.opcode >= abi::kOpcodeCount) return CqStatus::BAD_OPCODE;
  if ((d.flags & ~abi::desc_flag::kKnown) != 0 || d.rsvd0 != 0 || d.rsvd1 != 0 ||
      (d.compare != 0 && d.opcode != static_cast<uint8_t>(Opcode::CMP_SWAP)))
    return CqStatus::BAD_FIELD;
  const auto op = static_cast<Opcode>(d.opcode);
  if (op != Opcode::REDUCE && (d.dtype != 0 || d.redop != 0)) return CqStatus::BAD_FIELD;

  // Fault injection takes effect on a well-formed descriptor, before any byte moves.
  for (uint32_t n = _faults.stall_after.load(); n > 0;) {
    if (_faults.stall_after.compare_exchange_weak(n, n - 1)) {
      if (n == 1) _faults.stall_until_ns.store(now_ns() + _faults.stall_ms.load() * 1000000, std::memory_order_release);
      break;
    }
  }
  for (uint32_t n = _faults.fail_next.load(); n > 0;) {
    if (_faults.fail_next.compare_exchange_weak(n, n - 1)) return CqStatus::INJECTED;
  }

  switch (op) {
    case Opcode::NOP:
      return d.length == 0 ? CqStatus::OK : CqStatus::BAD_LENGTH;
    case Opcode::COPY: {
      if (d.length == 0) return CqStatus::BAD_LENGTH;
      Span s = translate_span(d.src, d.length, false, true);
      if (!s.ok()) return *fault_addr = d.src, s.status;
      Span t = translate_span(d.dst, d.length, true, false);
      if (!t.ok()) return *fault_addr = d.dst, t.status;
      DeviceDataAccess dma;
      if (s.count() == 1 && t.count() == 1) {
        std::memmove(t.one.ptr, s.one.ptr, d.length);
      } else {
        // Pieces may alias each other (two entries over the same memory):
        // read the whole source first, as memmove would.
        std::vector<uint8_t> bounce(d.length);
        uint64_t at = 0;
        for (size_t i = 0; i < s.count(); ++i) {
          std::memcpy(bounce.data() + at, s.at(i).ptr, s.at(i).len);
          at += s.at(i).len;
        }
        at = 0;
        for (size_t i = 0; i < t.count(); ++i) {
          std::memcpy(t.at(i).ptr, bounce.data() + at, t.at(i).len);
          at += t.at(i).len;
        }
      }
      for (uint32_t n = _faults.corrupt_next.load(); n > 0;) {
        if (_faults.corrupt_next.compare_exchange_weak(n, n - 1)) {
          *byte_at(t, d.length / 2) ^= 0x5a;  // silent corruption: status stays OK
          break;
        }
      }
      return CqStatus::OK;
    }
    case Opcode::FILL: {
      if (d.length == 0) return CqStatus::BAD_LENGTH;
      Span t = translate_span(d.dst, d.length, true, false);
      if (!t.ok()) return *fault_addr = d.dst, t.status;
      uint8_t pat[8];
      std::memcpy(pat, &d.value, 8);
      DeviceDataAccess dma;
      uint64_t at = 0;  // byte offset into the operand: the pattern's phase
      for (size_t i = 0; i < t.count(); ++i) {
        const Piece& p = t.at(i);
        if (d.value == 0) {
          std::memset(p.ptr, 0, p.len);
        } else {
          for (uint64_t k = 0; k < p.len; ++k) p.ptr[k] = pat[(at + k) % 8];
        }
        at += p.len;
      }
      return CqStatus::OK;
    }
    case Opcode::REDUCE: {
      if (d.dtype >= abi::kDTypeCount) return CqStatus::BAD_DTYPE;
      if (d.redop >= abi::kRedOpCount) return CqStatus::BAD_REDOP;
      const auto dt = static_cast<abi::DType>(d.dtype);
      const uint32_t es = abi::dtype_size(dt);
      if (d.length == 0) return CqStatus::BAD_LENGTH;
      if (d.length % es != 0 || d.src % es != 0 || d.dst % es != 0) return CqStatus::BAD_ALIGN;
      Span s = translate_span(d.src, d.length, false, true);
      if (!s.ok()) return *fault_addr = d.src, s.status;
      Span r = translate_span(d.dst, d.length, false, false);  // dst is read too
      if (!r.ok()) return *fault_addr = d.dst, r.status == CqStatus::SRC_PERM ? CqStatus::DST_PERM : r.status;
      Span t = translate_span(d.dst, d.length, true, false);
      if (!t.ok()) return *fault_addr = d.dst, t.status;
      {
        // Accumulates into one memory from several devices must not lose
        // updates: REDUCEs are serialised fabric-wide (silicon does this at
        // the memory controller / with PCIe AtomicOps per element). Piece
        // boundaries are 4 KiB-aligned, so every run holds whole elements.
        std::lock_guard lk(_fabric != nullptr ? _fabric->reduce_mutex() : _reduce_mu);
        DeviceDataAccess dma;
        zip_pieces(t, s, [&](uint8_t* dst, const uint8_t* src, uint64_t n) {
          abi::reduce(dt, static_cast<abi::RedOp>(d.redop), dst, src, n / es);
        });
      }
      return CqStatus::OK;
    }
    case Opcode::NOTIFY: {
      if (d.length != 8) return CqStatus::BAD_LENGTH;
      if (d.dst % 8 != 0) return CqStatus::BAD_ALIGN;
      Xlate t = translate(d.dst, 8, true, false);
      if (t.ptr == nullptr) return *fault_addr = d.dst, t.status;
      // Every earlier descriptor of this queue has completed: the engine runs a
      // queue in order. Publish the value with release ordering so a waiter
      // that sees it also sees the data the earlier descriptors moved.
      // The translated address must be 8-byte aligned too (an ATT entry may
      // shift alignment): the store is one atomic 64-bit write.
      if (reinterpret_cast<uintptr_t>(t.ptr) % 8 != 0) return *fault_addr = d.dst, CqStatus::BAD_ALIGN;
      std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(t.ptr)).store(d.value, std::memory_order_release);
      return CqStatus::OK;
    }
    case Opcode::FETCH_ADD:
    case Opcode::CMP_SWAP: {
      if (d.length != 8) return CqStatus::BAD_LENGTH;
      if (d.dst % 8 != 0 || d.src % 8 != 0) return CqStatus::BAD_ALIGN;
      Xlate r = translate(d.dst, 8, false, false);  // dst is read and written
      if (r.ptr == nullptr) return *fault_addr = d.dst, r.status == CqStatus::SRC_PERM ? CqStatus::DST_PERM : r.status;
      Xlate t = translate(d.dst, 8, true, false);
      if (t.ptr == nullptr) return *fault_addr = d.dst, t.status;
      // The result goes to src: the device writes there, so it needs WRITE.
      Xlate res = translate(d.src, 8, true, true);
      if (res.ptr == nullptr)
        return *fault_addr = d.src, res.status == CqStatus::DST_PERM ? CqStatus::SRC_PERM : res.status;
      if (reinterpret_cast<uintptr_t>(t.ptr) % 8 != 0 || reinterpret_cast<uintptr_t>(res.ptr) % 8 != 0)
        return *fault_addr = d.dst, CqStatus::BAD_ALIGN;
      // A real atomic on the (shared) memory: atomic against other devices of
      // the fabric and against CPU atomics on the same word.
      std::atomic_ref<uint64_t> word(*reinterpret_cast<uint64_t*>(t.ptr));
      uint64_t old;
      if (op == Opcode::FETCH_ADD) {
        old = word.fetch_add(d.value, std::memory_order_acq_rel);
      } else {
        old = d.compare;
        word.compare_exchange_strong(old, d.value, std::memory_order_acq_rel);
      }
      uint64_t answer = old;
      const uint64_t previous = _faults.last_fetched.exchange(old, std::memory_order_relaxed);
      for (uint32_t n = _faults.stale_next.load(); n > 0;) {
        if (_faults.stale_next.compare_exchange_weak(n, n - 1)) {
          answer = previous;
          break;
        }
      }
      std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(res.ptr)).store(answer, std::memory_order_release);
      return CqStatus::OK;
    }
  }
  return CqStatus::BAD_OPCODE;
}

// ---- §8 the engine: adaptive polling with wake-up suppression ----------------------------

void Device::engine_loop(Queue& q) {
  constexpr uint32_t kBatch = 32;
  constexpr int64_t kIdleYieldNs = 3000;
  int64_t idle_since = 0;
  auto sleep_on_doorbell = [&](int timeout_ms) {
    pollfd pfd{q.doorbell.get(), POLLIN, 0};
    ::poll(&pfd, 1, timeout_ms);
    uint64_t cnt;
    while (::read(q.doorbell.get(), &cnt, sizeof cnt) > 0) {
    }
  };
  while (!q.stop.load(std::memory_order_relaxed)) {
    int64_t stall = _faults.stall_until_ns.load(std::memory_order_relaxed);
    if (stall != 0) {
      int64_t left = stall - now_ns();
      if (left > 0) {
        sleep_on_doorbell(static_cast<int>(std::min<int64_t>(left / 1000000 + 1, 20)));
        continue;
      }
      // Over: back to 0 (unless a newer stall replaced it), so the checks
      // per descriptor below read no clock once no stall is pending.
      _faults.stall_until_ns.compare_exchange_strong(stall, 0, std::memory_order_relaxed);
    }
    uint32_t irq_vector = abi::kNoVector;
    bool idle = false;
    bool cq_full = false;
    {
      std::unique_lock ql(q.mu);
      bool dev_on;
      {
        std::lock_guard rl(_reg_mu);
        // Engines run only while the device is enabled and may master the bus.
        dev_on = (_control & abi::ctrl::ENABLE) != 0 && (_pci_command & kPciCommandBusMaster) != 0;
      }
      if (!q.enabled || q.shadow == nullptr || !dev_on) {
        ql.unlock();
        sleep_on_doorbell(100);
        continue;
      }
      std::shared_lock dl(_dma_mu);
      std::shared_lock al(_att_mu);
      abi::QueueShadow* sh = q.shadow;
      uint32_t tail = sh->sq_tail.value.load(std::memory_order_acquire);
      // A stall that began after the check at the top (this thread was
      // preempted in between) still holds what was posted after it: seen
      // here, after the tail that may carry such a descriptor.
      if (int64_t st = _faults.stall_until_ns.load(std::memory_order_acquire); st != 0 && st - now_ns() > 0) continue;
      uint32_t cq_head0 = sh->cq_head.value.load(std::memory_order_acquire);
      const bool bad_tail = !q.sq.valid_producer(tail, q.sq_head);
      if (bad_tail || q.cq.used(q.cq_tail, cq_head0) > q.cq.size()) {
        // The driver published an impossible index: stop the queue and say
        // why in Q_STATUS (and ERR_LOG: index = sq_head, addr = the bad value).
        q.enabled = false;
        q.shadow = nullptr;
        q.error = static_cast<uint8_t>(bad_tail ? abi::QueueError::bad_tail : abi::QueueError::bad_cq_head);
        uint32_t head = q.sq_head;
        al.unlock();
        dl.unlock();
        ql.unlock();
        log_error(q.id, head, CqStatus::BAD_FIELD, bad_tail ? tail : cq_head0);
        continue;
      }
      uint32_t done = 0;
      while (done < kBatch && q.sq_head != tail) {
        // A stall that a descriptor of this batch started ("stall DEV MS
        // AFTER") holds the rest of the batch.
        if (int64_t st = _faults.stall_until_ns.load(std::memory_order_relaxed); st != 0 && st - now_ns() > 0) break;
        uint32_t cq_head = sh->cq_head.value.load(std::memory_order_acquire);
        if (q.cq.used(q.cq_tail, cq_head) >= q.cq.size()) {  // CQ full: wait for the driver
          cq_full = true;
          break;
        }
        // Copy the shared descriptor once; validate and use only the copy.
        abi::SqEntry d;
        std::memcpy(&d, &q.sq.at(q.sq_head), sizeof d);
        uint32_t index = q.sq_head++;
        sh->sq_head.value.store(q.sq_head, std::memory_order_release);
        uint64_t fault_addr = 0;
        CqStatus st = execute(q, d, &fault_addr);
        if (st != CqStatus::OK) log_error(q.id, index, st, fault_addr);
        abi::CqEntry& c = q.cq.at(q.cq_tail);
        c.user_data = d.user_data;
        c.sq_index = index;
        c.status = static_cast<uint16_t>(st);
        std::atomic_ref<uint16_t>(c.info).store(q.cq.phase(q.cq_tail), std::memory_order_release);
        ++q.cq_tail;
        q.completed.fetch_add(1, std::memory_order_relaxed);
        _completed.fetch_add(1, std::memory_order_relaxed);
        if ((d.flags & abi::desc_flag::INTERRUPT) != 0) irq_vector = q.msix;
        ++done;
      }
      if (done > 0) {
        idle_since = 0;
      } else if (q.sq_head == tail) {
        int64_t now = now_ns();
        if (idle_since == 0) idle_since = now;
        if (now - idle_since >= int64_t{_cfg.spin_us} * 1000) {
          // Going to sleep: announce it, then re-check so a tail published
          // before the announcement is not missed (§8).
          sh->need_wakeup.value.store(1, std::memory_order_seq_cst);
          if (sh->sq_tail.value.load(std::memory_order_seq_cst) == q.sq_head) idle = true;
          else sh->need_wakeup.value.store(0, std::memory_order_relaxed);
        }
      }
      if (idle) {
        al.unlock();
        dl.unlock();
        ql.unlock();
        // Bounded sleep: a lost doorbell costs at most this much latency.
        sleep_on_doorbell(50);
        std::unique_lock ql2(q.mu);
        std::shared_lock dl2(_dma_mu);
        if (q.enabled && q.shadow != nullptr) q.shadow->need_wakeup.value.store(0, std::memory_order_seq_cst);
        idle_since = 0;
      }
    }
    if (irq_vector != abi::kNoVector) {
      std::lock_guard lk(_irq_mu);
      if (irq_vector < _msix.size() && _msix[irq_vector].valid()) {
        uint64_t one = 1;
        ssize_t n = ::write(_msix[irq_vector].get(), &one, sizeof one);
        (void)n;
      }
    }
    if (cq_full) {
      // The driver consumes completions without a doorbell: nap briefly.
      sleep_on_doorbell(1);
    } else if (!idle) {
      // Idle for a few microseconds: yield rather than spin. This thread
      // shares the host's CPUs with the ranks that feed it; one of them on
      // this core can post the next descriptor only when it runs, and a
      // spinning engine kept it off the CPU until the spin ended or the
      // scheduler's tick (a rank and the engine on one core of two: NPU
      // send/recv of 1 MiB at 170-200 us per message, put ping-pong 70-370
      // us). Alone on its core the yield returns at once.
      // (idle_since is non-zero only while rounds find no descriptor.)
      if (idle_since != 0 && now_ns() - idle_since >= kIdleYieldNs) std::this_thread::yield();
      else cpu_relax();
    }
  }
}

// ---- Fabric ------------------------------------------------------------------------------

Status Fabric::add(std::unique_ptr<Device> dev) {
  if (dev->fabric_index() != _devices.size())
    return Status::error(Code::invalid_argument, "device index %u out of order", dev->fabric_index());
  _devices.push_back(std::move(dev));
  return Status::ok();
}

Device* Fabric::device(uint32_t index) const {
  return index < _devices.size() ? _devices[index].get() : nullptr;
}

Fabric::~Fabric() { stop_network(); }

Status Fabric::start_network(const NetOptions& o) {
  if (!o.pcap.empty()) HCOMM_TRY(_switch.capture(o.pcap));
  if (!o.uplink.empty()) {
    HCOMM_TRY(roce::open_link(o.uplink, o.run_dir, &_uplink));
    _uplink_port = _switch.add_port(
        [this](const uint8_t* f, size_t n) {
          if (Status st = _uplink->send(f, n); !st.is_ok())
            std::fprintf(stderr, "hcomm-sim: uplink: %s\n", st.to_string().c_str());
        },
        false);
  }
  _net_stop.store(false);
  _net_thread = std::thread([this] { network_loop(); });
  return Status::ok();
}

void Fabric::stop_network() {
  _net_stop.store(true);
  if (_net_thread.joinable()) _net_thread.join();
}

// Every device's network engine, the switch's reorder buffer and the
// uplink, round after round. Like the DMA engines it keeps polling for a
// while after the last round that moved something (a reply is usually on
// its way), then naps: 1/16 of the time it has been idle, 100 us to 1 ms
// (with an uplink, a nap of 1 ms is a wait on it, which a frame ends).
// The engines poll the drivers' queue tails (there is no doorbell), so a
// work request posted after a pause waits up to that long; an exchange
// that pauses for less than 1.6 ms between steps sees 100 us naps. Napping
// 100 us forever woke an idle simulator ~7500 times a second and took 15 %
// of a core from the ranks and DMA engines it shares the CPUs with.
//
// The engines run on the devices' own clock, not the wall's. A NIC reads
// its wire at line rate on its own silicon; this thread shares the CPUs
// with the ranks and the other simulator, and under a sanitizer on two
// vCPUs it can be descheduled for tens of milliseconds or fall behind the
// frames queued on its uplink (16 MiB of socket buffer is ~2000 frames).
// Were the local ACK timers to count that time, a QP would time out on
// answers that arrived and wait unread, resend its window or a READ
// piece into the same queue, and make the queue longer: go-back-N
// collapse, ending in RETRY_EXC_ERR on a healthy link. So the clock
// advances at most kMaxStepNs per round (a round longer than that was the
// simulator not running), and at most kBehindStepNs per round while the
// uplink still holds frames this thread has not read. A silent or dead
// peer leaves nothing queued: the timers then run at wall speed.
void Fabric::network_loop() {
  constexpr uint64_t kMaxStepNs = 5'000'000;
  constexpr uint64_t kBehindStepNs = 20'000;
  constexpr int kUplinkBurst = 64;
  std::vector<uint8_t> buf(hal::abi::roce::kMaxFrame + 64);
  auto wall = [] { return static_cast<uint64_t>(now_ns()); };
  uint64_t last_busy = 0, last_wall = wall(), now = last_wall;
  bool behind = false;
  const uint32_t spin_us = _devices.empty() ? 0 : _devices[0]->config().spin_us;
  while (!_net_stop.load(std::memory_order_relaxed)) {
    const uint64_t w = wall();
    now += std::min(w - last_wall, behind ? kBehindStepNs : kMaxStepNs);
    last_wall = w;
    bool moved = false;
    for (auto& d : _devices) moved |= d->net_service(now);
    _switch.tick(now);
    behind = false;
    if (_uplink) {
      int k = 0;
      for (; k < kUplinkBurst; ++k) {
        size_t n = 0;
        if (!_uplink->recv(buf.data(), buf.size(), &n, 0).is_ok() || n == 0) break;
        _switch.ingress(_uplink_port, buf.data(), n, now);
        moved = true;
      }
      behind = k == kUplinkBurst;  // (the next frame may be there or not: judged as there)
    }
    if (moved) {
      last_busy = now;
    } else if (now - last_busy > uint64_t{spin_us} * 1000) {
      // Idle for now - last_busy on the devices' clock (the wall's, but for
      // rounds the thread did not run): nap 1/16 of it.
      const auto nap = std::clamp<uint64_t>((now - last_busy) / 16, 100'000, 1'000'000);
      if (size_t n = 0; _uplink && nap == 1'000'000) {
        if (_uplink->recv(buf.data(), buf.size(), &n, 1).is_ok() && n > 0) {
          _switch.ingress(_uplink_port, buf.data(), n, now);
          last_busy = now;
        }
      } else {
        std::this_thread::sleep_for(std::chrono::nanoseconds(nap));
      }
    } else {
      std::this_thread::yield();
    }
  }
}

std::mutex* Device::NetMemory::reduce_mutex() { return _d._fabric != nullptr ? &_d._fabric->reduce_mutex() : &_d._reduce_mu; }

}  // namespace hcomm::sim
