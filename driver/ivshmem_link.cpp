#include "driver/ivshmem_link.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "common/barrier.h"
#include "common/time.h"
#include "hal/abi/regs.h"

namespace hcomm::driver {

namespace iv = hal::abi::ivshmem;
namespace abi = hal::abi;

namespace {
constexpr uint32_t kConfigRegion = 7;  // VFIO_PCI_CONFIG_REGION_INDEX
constexpr uint64_t kPciCommand = 0x04;
constexpr uint64_t kPage = 4096;
}  // namespace

Status IvshmemLink::open(std::unique_ptr<Link> pci, const IvshmemOptions& opts, std::unique_ptr<Link>* out) {
  if (!pci || out == nullptr) return Status::error(Code::invalid_argument, "IvshmemLink::open: null link or out");
  std::unique_ptr<IvshmemLink> l(new IvshmemLink(std::move(pci), opts));
  HCOMM_TRY(l->init());
  *out = std::move(l);
  return Status::ok();
}

IvshmemLink::~IvshmemLink() {
  // Whatever the HAL left running stops before the memory behind it goes
  // (the ivshmem function's link unmaps DMA when it is destroyed next).
  if (_mb != nullptr) (void)call(iv::MailboxOp::new_driver, 0, 0, 0, 0, 0, nullptr);
}

Status IvshmemLink::init() {
  const std::string loc = _pci->location();
  void* p = nullptr;
  uint64_t size = 0;
  Status st = _pci->map_region(iv::kSharedBar, &p, &size);
  if (!st) return Status(st.code(), "ivshmem " + loc + ": shared memory BAR2: " + st.message());
  if (size < iv::kMailboxOffset + sizeof(iv::Mailbox))
    return Status::error(Code::unsupported, "ivshmem %s: BAR2 of %llu bytes is too small for an hcomm NPU",
                         loc.c_str(), static_cast<unsigned long long>(size));
  _shared = static_cast<uint8_t*>(p);
  _shared_size = size;
  std::memcpy(&_hdr, _shared + iv::kHeaderOffset, sizeof _hdr);
  if (_hdr.magic != iv::kMagic)
    return Status::error(Code::unsupported,
                         "ivshmem %s: shared memory carries no hcomm header (magic %#llx): not served by hcomm-sim",
                         loc.c_str(), static_cast<unsigned long long>(_hdr.magic));
  if (_hdr.version != iv::kLayoutVersion)
    return Status::error(Code::unsupported, "ivshmem %s: layout version %u, this driver speaks %u", loc.c_str(),
                         _hdr.version, iv::kLayoutVersion);
  if (_hdr.shared_size != size || _hdr.hbm_offset < iv::kMailboxOffset + sizeof(iv::Mailbox) ||
      _hdr.hbm_offset % kPage != 0 || _hdr.hbm_size > size || _hdr.hbm_offset > size - _hdr.hbm_size ||
      _hdr.num_queues == 0 || _hdr.num_queues > abi::reg::MAX_QUEUES ||
      uint64_t{_hdr.vectors} < uint64_t{_hdr.doorbell_vector_base} + _hdr.num_queues ||
      _hdr.mailbox_vector >= _hdr.vectors ||
      _hdr.sim_peer > 0xffff)
    return Status::error(Code::device_error,
                         "ivshmem %s: inconsistent header (shared %llu of BAR %llu, HBM %llu at %#llx, %u queues, "
                         "%u vectors)",
                         loc.c_str(), static_cast<unsigned long long>(_hdr.shared_size),
                         static_cast<unsigned long long>(size), static_cast<unsigned long long>(_hdr.hbm_size),
                         static_cast<unsigned long long>(_hdr.hbm_offset), _hdr.num_queues, _hdr.vectors);
  HCOMM_TRY(_pci->doorbell(iv::kRegDoorbell, &_kick));
  _kick.fixed = true;
  _kick.fixed_value = iv::doorbell_value(_hdr.sim_peer, _hdr.mailbox_vector);
  _mb = reinterpret_cast<iv::Mailbox*>(_shared + iv::kMailboxOffset);
  _live = reinterpret_cast<const iv::Liveness*>(_shared + iv::kLivenessOffset);
  _resets_at_open = __atomic_load_n(&_live->resets, __ATOMIC_ACQUIRE);
  _last_heartbeat = __atomic_load_n(&_live->heartbeat, __ATOMIC_ACQUIRE);
  _heartbeat_seen = std::chrono::steady_clock::now();
  // A previous driver instance may have died mid-request: let the model
  // finish it before this one writes the mailbox.
  Deadline dl = Deadline::after_ms(_opts.mailbox_timeout_ms);
  for (;;) {
    uint32_t seq = __atomic_load_n(&_mb->seq, __ATOMIC_ACQUIRE);
    if (__atomic_load_n(&_mb->ack, __ATOMIC_ACQUIRE) == seq) break;
    if (dl.expired()) {
      Status k = Status::error(Code::timeout, "ivshmem %s: mailbox busy for %d ms (is hcomm-sim serving it?)",
                               loc.c_str(), _opts.mailbox_timeout_ms);
      _mb = nullptr;
      return k;
    }
    _kick.ring(0);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  st = call(iv::MailboxOp::new_driver, 0, 0, 0, 0, 0, nullptr);
  if (!st) {
    _mb = nullptr;
    return st;
  }
  return Status::ok();
}

Status IvshmemLink::call(iv::MailboxOp op, uint32_t width, uint64_t offset, uint64_t value, uint64_t len,
                         uint32_t prot, uint64_t* result) {
  if (_mb == nullptr) return Status::error(Code::closed, "ivshmem %s: mailbox not open", location().c_str());
  std::lock_guard lk(_mu);
  Deadline dl = Deadline::after_ms(_opts.mailbox_timeout_ms);
  // A request that timed out may still be being read by the model: never
  // rewrite the fields before it is answered.
  while (__atomic_load_n(&_mb->ack, __ATOMIC_ACQUIRE) != __atomic_load_n(&_mb->seq, __ATOMIC_ACQUIRE)) {
    if (dl.expired())
      return Status::error(Code::timeout, "ivshmem %s: mailbox still busy with an earlier request (hcomm-sim gone?)",
                           location().c_str());
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  __atomic_store_n(&_mb->op, static_cast<uint32_t>(op), __ATOMIC_RELAXED);
  __atomic_store_n(&_mb->width, width, __ATOMIC_RELAXED);
  __atomic_store_n(&_mb->offset, offset, __ATOMIC_RELAXED);
  __atomic_store_n(&_mb->value, value, __ATOMIC_RELAXED);
  __atomic_store_n(&_mb->len, len, __ATOMIC_RELAXED);
  __atomic_store_n(&_mb->prot, prot, __ATOMIC_RELAXED);
  const uint32_t s = __atomic_load_n(&_mb->seq, __ATOMIC_RELAXED) + 1;
  __atomic_store_n(&_mb->seq, s, __ATOMIC_RELEASE);
  _kick.ring(0);
  // Spin briefly (the model answers in microseconds on a real host), then
  // sleep between looks (an emulated guest must not starve the model's CPU).
  dl = Deadline::after_ms(_opts.mailbox_timeout_ms);
  for (uint32_t spins = 0;; ++spins) {
    if (__atomic_load_n(&_mb->ack, __ATOMIC_ACQUIRE) == s) break;
    if (spins < 256) {
      cpu_relax();
      continue;
    }
    if (dl.expired())
      return Status::error(Code::timeout, "ivshmem %s: no answer to mailbox op %u within %d ms (hcomm-sim gone?)",
                           location().c_str(), static_cast<unsigned>(op), _opts.mailbox_timeout_ms);
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  const int32_t code = __atomic_load_n(&_mb->status, __ATOMIC_RELAXED);
  if (code != 0) {
    char msg[iv::kMailboxMessageLen];
    std::memcpy(msg, _mb->message, sizeof msg);
    msg[sizeof msg - 1] = '\0';
    if (code < 0 || code > static_cast<int32_t>(Code::closed))
      return Status::error(Code::protocol_error, "ivshmem %s: mailbox status %d is not a status code",
                           location().c_str(), code);
    return Status(static_cast<Code>(code), "hcomm-sim (ivshmem " + location() + "): " + msg);
  }
  if (result != nullptr) *result = __atomic_load_n(&_mb->value, __ATOMIC_RELAXED);
  return Status::ok();
}

Status IvshmemLink::region_info(uint32_t region, RegionInfo* out) {
  RegionInfo r;
  r.index = region;
  if (region == abi::kBarRegs) {
    r.size = abi::kBar0Size;
    r.readable = r.writable = true;
  } else if (region == abi::kBarHbm) {
    r.size = _hdr.hbm_size;
    r.readable = r.writable = r.mmapable = true;
  } else if (region == kConfigRegion) {
    return _pci->region_info(region, out);
  }
  *out = r;
  return Status::ok();
}

Status IvshmemLink::map_region(uint32_t region, void** out, uint64_t* size) {
  if (region != abi::kBarHbm)
    return Status::error(Code::unsupported, "ivshmem %s: only the HBM aperture (BAR2) is mmapable",
                         location().c_str());
  *out = _shared + _hdr.hbm_offset;
  *size = _hdr.hbm_size;
  return Status::ok();
}

Status IvshmemLink::read(uint32_t region, uint64_t offset, void* data, size_t len) {
  if (region == abi::kBarRegs) {
    if ((len != 4 && len != 8) || offset % len != 0 || offset > abi::kBar0Size - len)
      return Status::error(Code::invalid_argument, "ivshmem %s: BAR0 read of %zu bytes at %#llx (4 or 8, aligned)",
                           location().c_str(), len, static_cast<unsigned long long>(offset));
    uint64_t v = 0;
    HCOMM_TRY(call(iv::MailboxOp::bar0_read, static_cast<uint32_t>(len), offset, 0, 0, 0, &v));
    std::memcpy(data, &v, len);
    return Status::ok();
  }
  if (region == abi::kBarHbm) {
    if (offset > _hdr.hbm_size || len > _hdr.hbm_size - offset)
      return Status::error(Code::out_of_range, "ivshmem %s: HBM read outside %llu bytes", location().c_str(),
                           static_cast<unsigned long long>(_hdr.hbm_size));
    std::memcpy(data, _shared + _hdr.hbm_offset + offset, len);
    return Status::ok();
  }
  if (region == kConfigRegion) return _pci->read(region, offset, data, len);
  return Status::error(Code::not_found, "ivshmem %s: region %u does not exist", location().c_str(), region);
}

Status IvshmemLink::write(uint32_t region, uint64_t offset, const void* data, size_t len) {
  if (region == abi::kBarRegs) {
    if ((len != 4 && len != 8) || offset % len != 0 || offset > abi::kBar0Size - len)
      return Status::error(Code::invalid_argument, "ivshmem %s: BAR0 write of %zu bytes at %#llx (4 or 8, aligned)",
                           location().c_str(), len, static_cast<unsigned long long>(offset));
    uint64_t v = 0;
    std::memcpy(&v, data, len);
    return call(iv::MailboxOp::bar0_write, static_cast<uint32_t>(len), offset, v, 0, 0, nullptr);
  }
  if (region == abi::kBarHbm) {
    if (offset > _hdr.hbm_size || len > _hdr.hbm_size - offset)
      return Status::error(Code::out_of_range, "ivshmem %s: HBM write outside %llu bytes", location().c_str(),
                           static_cast<unsigned long long>(_hdr.hbm_size));
    std::memcpy(_shared + _hdr.hbm_offset + offset, data, len);
    return Status::ok();
  }
  if (region == kConfigRegion) {
    HCOMM_TRY(_pci->write(region, offset, data, len));
    // The model gates its DMA on bus mastering as silicon does: it must see
    // the command register the driver wrote.
    if (offset <= kPciCommand && offset + len >= kPciCommand + 2) {
      uint16_t cmd;
      std::memcpy(&cmd, static_cast<const uint8_t*>(data) + (kPciCommand - offset), 2);
      HCOMM_TRY(call(iv::MailboxOp::config_write, 2, kPciCommand, cmd, 0, 0, nullptr));
    }
    return Status::ok();
  }
  return Status::error(Code::not_found, "ivshmem %s: region %u does not exist", location().c_str(), region);
}

Status IvshmemLink::doorbell(uint64_t bar0_offset, Doorbell* out) {
  const uint64_t rel = bar0_offset - abi::kDoorbellPageOffset;
  if (bar0_offset < abi::kDoorbellPageOffset || rel % abi::reg::DOORBELL_STRIDE != 0 ||
      rel / abi::reg::DOORBELL_STRIDE >= _hdr.num_queues)
    return Status::error(Code::invalid_argument, "ivshmem %s: %#llx is not a queue doorbell", location().c_str(),
                         static_cast<unsigned long long>(bar0_offset));
  const uint32_t q = static_cast<uint32_t>(rel / abi::reg::DOORBELL_STRIDE);
  HCOMM_TRY(_pci->doorbell(iv::kRegDoorbell, out));
  out->fixed = true;
  out->fixed_value = iv::doorbell_value(_hdr.sim_peer, _hdr.doorbell_vector_base + q);
  return Status::ok();
}

Status IvshmemLink::set_msix(uint32_t first_vector, std::span<const int> eventfds) {
  if (first_vector > msix_count() || eventfds.size() > msix_count() - first_vector)
    return Status::error(Code::invalid_argument, "ivshmem %s: MSI-X vectors [%u,+%zu) beyond %u",
                         location().c_str(), first_vector, eventfds.size(), msix_count());
  return _pci->set_msix(first_vector, eventfds);
}

uint32_t IvshmemLink::msix_count() const { return std::min(_pci->msix_count(), _hdr.num_queues); }

Status IvshmemLink::dma_map(void* vaddr, uint64_t len, int fd, uint64_t fd_offset, uint32_t prot,
                            uint64_t* bus_addr) {
  uint64_t bus = 0;
  HCOMM_TRY(_pci->dma_map(vaddr, len, fd, fd_offset, prot, &bus));
  if (Status st = model_map(bus, len, prot); !st) {
    (void)_pci->dma_unmap(bus, len);
    return st;
  }
  *bus_addr = bus;
  return Status::ok();
}

Status IvshmemLink::dma_map_segments(void* vaddr, uint64_t len, int fd, uint64_t fd_offset, uint32_t prot,
                                     std::vector<DmaSegment>* out) {
  std::vector<DmaSegment> segs;
  HCOMM_TRY(_pci->dma_map_segments(vaddr, len, fd, fd_offset, prot, &segs));
  for (size_t i = 0; i < segs.size(); ++i) {
    if (Status st = model_map(segs[i].bus_addr, segs[i].len, prot); !st) {
      for (size_t j = 0; j < i; ++j) (void)dma_unmap(segs[j].bus_addr, segs[j].len);
      for (size_t j = i; j < segs.size(); ++j) (void)_pci->dma_unmap(segs[j].bus_addr, segs[j].len);
      return st;
    }
  }
  *out = std::move(segs);
  return Status::ok();
}

Status IvshmemLink::model_map(uint64_t bus, uint64_t len, uint32_t prot) {
  const uint64_t start = bus & ~(kPage - 1);
  const uint64_t mlen = (bus + len + kPage - 1) / kPage * kPage - start;
  uint64_t range = start;
  auto it = _ranges.upper_bound(start);
  if (it != _ranges.begin() && std::prev(it)->first + std::prev(it)->second.len >= start + mlen) {
    auto& r = *std::prev(it);
    if ((prot & ~r.second.prot) != 0)
      return Status::error(Code::access_denied,
                           "ivshmem %s: [%#llx,+%#llx) is already mapped for the device with fewer rights (%#x, "
                           "asked %#x); the same physical memory has one set of rights",
                           location().c_str(), static_cast<unsigned long long>(start),
                           static_cast<unsigned long long>(mlen), r.second.prot, prot);
    ++r.second.refs;  // the model can already reach it
    range = r.first;
  } else {
    HCOMM_TRY(call(iv::MailboxOp::dma_map, 0, start, 0, mlen, prot, nullptr));
    _ranges[start] = DmaRange{mlen, 1, prot};
  }
  _views.emplace(bus, std::make_pair(range, len));
  return Status::ok();
}

Status IvshmemLink::dma_unmap(uint64_t bus_addr, uint64_t len) {
  auto [v, end] = _views.equal_range(bus_addr);
  while (v != end && v->second.second != len) ++v;
  if (v == end)
    return Status::error(Code::not_found, "ivshmem %s: no DMA mapping of %llu bytes at %#llx", location().c_str(),
                         static_cast<unsigned long long>(len), static_cast<unsigned long long>(bus_addr));
  auto r = _ranges.find(v->second.first);
  if (r != _ranges.end() && r->second.refs == 1) {
    // The model stops using the range before the IOMMU mapping goes. If it
    // cannot be told, nothing is torn down: it may still be using the pages.
    HCOMM_TRY(call(iv::MailboxOp::dma_unmap, 0, r->first, 0, r->second.len, 0, nullptr));
    _ranges.erase(r);
  } else if (r != _ranges.end()) {
    --r->second.refs;
  }
  _views.erase(v);
  return _pci->dma_unmap(bus_addr, len);
}

Status IvshmemLink::health() {
  if (_live == nullptr) return Status::error(Code::closed, "ivshmem %s: not open", location().c_str());
  std::lock_guard lk(_health_mu);
  const auto now = std::chrono::steady_clock::now();
  const uint64_t hb = __atomic_load_n(&_live->heartbeat, __ATOMIC_ACQUIRE);
  if (hb != _last_heartbeat) {
    _last_heartbeat = hb;
    _heartbeat_seen = now;
  } else if (now - _heartbeat_seen > std::chrono::milliseconds(iv::kHeartbeatStaleMs)) {
    return Status::error(Code::device_error,
                         "ivshmem %s: hcomm-sim stopped serving the function (no heartbeat for %lld ms: killed or "
                         "stopped?)",
                         location().c_str(),
                         static_cast<long long>(
                             std::chrono::duration_cast<std::chrono::milliseconds>(now - _heartbeat_seen).count()));
  }
  if (__atomic_load_n(&_live->resets, __ATOMIC_ACQUIRE) != _resets_at_open)
    return Status::error(Code::device_error,
                         "ivshmem %s: the device reset itself: its queues and address translations are gone",
                         location().c_str());
  return Status::ok();
}

Status IvshmemLink::reset() { return call(iv::MailboxOp::reset, 0, 0, 0, 0, 0, nullptr); }

}  // namespace hcomm::driver
