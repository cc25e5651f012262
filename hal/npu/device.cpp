#include "hal/npu/device.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "common/time.h"
#include "hal/npu/dma_queue.h"

namespace hcomm::hal::npu {

namespace reg = abi::reg;

Status Device::open(std::unique_ptr<driver::Link> link, std::unique_ptr<Device>* out, const OpenOptions& opts) {
  if (!link || out == nullptr) return Status::error(Code::invalid_argument, "Device::open: null link or out");
  std::unique_ptr<Device> dev(new Device(std::move(link)));
  HCOMM_TRY(dev->bring_up(opts));
  *out = std::move(dev);
  return Status::ok();
}

Device::~Device() {
  if (_link) {
    // Quiesce: disable the engines; mappings and queues must be gone already
    // (their owners hold references to this device).
    (void)_link->write32(reg::CONTROL, 0);
  }
}

Status Device::bring_up(const OpenOptions& opts) {
  // §5 step 1: identity. A device that does not speak this ABI is left alone.
  uint32_t id = 0;
  HCOMM_TRY(_link->read32(reg::ID, &id));
  _info.vendor_id = static_cast<uint16_t>(id & 0xffff);
  _info.device_id = static_cast<uint16_t>(id >> 16);
  if (_info.vendor_id != abi::kPciVendorId || _info.device_id != abi::kPciDeviceId)
    return Status::error(Code::unsupported, "%s %s: id %04x:%04x is not an hcomm NPU (want %04x:%04x)",
                         _link->kind(), _link->location().c_str(), _info.vendor_id, _info.device_id,
                         abi::kPciVendorId, abi::kPciDeviceId);
  // §5 step 2: ABI version: same major, minor at least ours.
  HCOMM_TRY(_link->read32(reg::ABI_VERSION, &_info.abi_version));
  uint32_t major = _info.abi_version >> 16, minor = _info.abi_version & 0xffff;
  if (major != abi::kAbiMajor || minor < abi::kAbiMinor)
    return Status::error(Code::unsupported, "device ABI %u.%u, driver needs %u.>=%u", major, minor, abi::kAbiMajor,
                         abi::kAbiMinor);
  // §5 step 3: reset, then wait for READY with a deadline.
  HCOMM_TRY(_link->write32(reg::CONTROL, abi::ctrl::RESET));
  Deadline dl = Deadline::after_ms(opts.reset_timeout_ms);
  for (;;) {
    uint32_t ctl = 0, st = 0;
    HCOMM_TRY(_link->read32(reg::CONTROL, &ctl));
    HCOMM_TRY(_link->read32(reg::STATUS, &st));
    if ((ctl & abi::ctrl::RESET) == 0 && (st & abi::status::READY) != 0) {
      if (st & abi::status::FATAL) return Status::error(Code::device_error, "device reports FATAL after reset");
      break;
    }
    if (dl.expired()) return Status::error(Code::timeout, "device not READY %d ms after reset", opts.reset_timeout_ms);
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  // §5 step 4: capabilities and sizes.
  HCOMM_TRY(_link->read64(reg::CAPS, &_info.caps));
  HCOMM_TRY(_link->read64(reg::HBM_SIZE, &_info.hbm_size));
  HCOMM_TRY(_link->read32(reg::NUM_QUEUES, &_info.num_queues));
  HCOMM_TRY(_link->read32(reg::MAX_QUEUE_LOG2, &_info.max_queue_log2));
  HCOMM_TRY(_link->read32(reg::NUM_ATT, &_info.num_att));
  HCOMM_TRY(_link->read32(reg::FABRIC_INDEX, &_info.fabric_index));
  HCOMM_TRY(_link->read32(reg::FABRIC_SIZE, &_info.fabric_size));
  HCOMM_TRY(_link->read32(reg::NUM_MSIX, &_info.num_msix));
  if (_info.num_queues == 0 || _info.num_queues > reg::MAX_QUEUES || _info.num_att == 0 ||
      _info.max_queue_log2 == 0 || _info.max_queue_log2 > 24)
    return Status::error(Code::device_error, "implausible identity: %u queues, %u ATT entries, max ring 2^%u",
                         _info.num_queues, _info.num_att, _info.max_queue_log2);
  _att_used.assign(_info.num_att, false);
  _queue_used.assign(_info.num_queues, false);
  // §5 step 5: memory space + bus master in the PCI command register.
  uint16_t cmd = 0x0006;
  HCOMM_TRY(_link->write(7 /* VFIO_PCI_CONFIG_REGION_INDEX */, 0x04, &cmd, sizeof cmd));
  // §5 step 6: HBM aperture (BAR2), when the link can map it.
  driver::RegionInfo ri;
  if (_link->region_info(abi::kBarHbm, &ri).is_ok() && ri.mmapable && ri.size >= _info.hbm_size) {
    void* p = nullptr;
    uint64_t sz = 0;
    if (_link->map_region(abi::kBarHbm, &p, &sz).is_ok()) _hbm = static_cast<uint8_t*>(p);
  }
  // §5 step 7: enable.
  HCOMM_TRY(_link->write32(reg::CONTROL, abi::ctrl::ENABLE));
  return Status::ok();
}

uint64_t Device::alloc_iova(uint64_t len) {
  uint64_t iova = _next_iova;
  _next_iova += (len + 0xfff) & ~uint64_t{0xfff};
  _next_iova += 0x1000;  // a guard page between mappings catches off-by-one overruns
  return iova;
}

Status Device::att_install(uint64_t iova, uint64_t len, uint64_t target, uint32_t flags, uint32_t* index) {
  uint32_t idx = UINT32_MAX;
  for (uint32_t i = 0; i < _att_used.size(); ++i) {
    if (!_att_used[i]) {
      idx = i;
      break;
    }
  }
  if (idx == UINT32_MAX) return Status::error(Code::no_resource, "all %u ATT entries in use", _info.num_att);
  HCOMM_TRY(_link->write32(reg::ATT_INDEX, idx));
  HCOMM_TRY(_link->write64(reg::ATT_IOVA, iova));
  HCOMM_TRY(_link->write64(reg::ATT_LEN, len));
  HCOMM_TRY(_link->write64(reg::ATT_TARGET, target));
  HCOMM_TRY(_link->write32(reg::ATT_FLAGS, flags));
  HCOMM_TRY(_link->write32(reg::ATT_CMD, abi::att_cmd::WRITE));
  uint32_t st = 0;
  HCOMM_TRY(_link->read32(reg::ATT_STATUS, &st));
  if (st != abi::att_status::OK)
    return Status::error(Code::device_error, "ATT write [%#lx,+%#lx) -> %#lx flags %#x refused: status %u",
                         static_cast<unsigned long>(iova), static_cast<unsigned long>(len),
                         static_cast<unsigned long>(target), flags, st);
  _att_used[idx] = true;
  *index = idx;
  return Status::ok();
}

Status Device::att_clear(uint32_t index) {
  HCOMM_TRY(_link->write32(reg::ATT_INDEX, index));
  HCOMM_TRY(_link->write32(reg::ATT_CMD, abi::att_cmd::CLEAR));
  uint32_t st = 0;
  HCOMM_TRY(_link->read32(reg::ATT_STATUS, &st));
  if (st != abi::att_status::OK) return Status::error(Code::device_error, "ATT clear %u refused: %u", index, st);
  _att_used[index] = false;
  return Status::ok();
}

static Status check_rights(uint32_t rights) {
  if (rights == 0 || (rights & ~access::RW) != 0)
    return Status::error(Code::invalid_argument, "mapping rights must be a non-empty subset of READ|WRITE");
  return Status::ok();
}

Status Device::map_host(void* ptr, uint64_t len, int fd, uint64_t fd_offset, uint32_t rights, Mapping* out) {
  if (ptr == nullptr || len == 0 || out == nullptr)
    return Status::error(Code::invalid_argument, "map_host: null pointer or zero length");
  HCOMM_TRY(check_rights(rights));
  std::lock_guard lk(_mu);
  uint32_t prot = ((rights & access::READ) ? driver::dma_prot::READ : 0) |
                  ((rights & access::WRITE) ? driver::dma_prot::WRITE : 0);
  std::vector<driver::Link::DmaSegment> segs(1);
  segs[0].len = len;
  if ((_info.caps & abi::cap::ATT_SPAN) != 0) HCOMM_TRY(_link->dma_map_segments(ptr, len, fd, fd_offset, prot, &segs));
  else HCOMM_TRY(_link->dma_map(ptr, len, fd, fd_offset, prot, &segs[0].bus_addr));
  auto unmap_all = [&] {
    for (const auto& seg : segs) (void)_link->dma_unmap(seg.bus_addr, seg.len);
  };
  if (segs.empty()) return Status::error(Code::device_error, "map_host: the link mapped no segment");
  if (segs.size() > 1) {
    const auto free_att = static_cast<size_t>(std::count(_att_used.begin(), _att_used.end(), false));
    if (segs.size() > free_att) {
      unmap_all();
      return Status::error(Code::no_resource,
                           "map_host: the buffer of %llu bytes is in %zu physically contiguous pieces, one ATT entry "
                           "each, and %zu entries are free",
                           static_cast<unsigned long long>(len), segs.size(), free_att);
    }
  }
  Mapping m;
  m.len = len;
  m.host = true;
  m.bus_addr = segs[0].bus_addr;
  if (segs.size() == 1) {
    m.iova = alloc_iova(len);
    Status st = att_install(m.iova, len, m.bus_addr, rights | abi::att::KIND_HOST, &m.att_index);
    if (!st) {
      (void)_link->dma_unmap(m.bus_addr, len);
      return st;
    }
    *out = m;
    return Status::ok();
  }
  // Several pieces: the device IOVA keeps the buffer's offset in its page,
  // so every boundary between entries is 4 KiB-aligned (§6.4).
  const uint64_t in_page = reinterpret_cast<uintptr_t>(ptr) & 0xfff;
  m.iova = alloc_iova(len + in_page) + in_page;
  uint64_t off = 0;
  Status st;
  for (const auto& seg : segs) {
    Mapping::Piece p{UINT32_MAX, seg.bus_addr, seg.len};
    st = att_install(m.iova + off, seg.len, seg.bus_addr, rights | abi::att::KIND_HOST, &p.att_index);
    if (!st) break;
    m.pieces.push_back(p);
    off += seg.len;
  }
  if (!st) {
    for (const auto& p : m.pieces) (void)att_clear(p.att_index);
    unmap_all();
    return Status(st.code(), st.message() + " (mapping a buffer of " + std::to_string(len) + " bytes in " +
                                 std::to_string(segs.size()) + " pieces)");
  }
  m.att_index = m.pieces[0].att_index;
  *out = std::move(m);
  return Status::ok();
}

Status Device::map_hbm(uint64_t offset, uint64_t len, uint32_t rights, Mapping* out) {
  if (len == 0 || out == nullptr || offset > _info.hbm_size || len > _info.hbm_size - offset)
    return Status::error(Code::out_of_range, "map_hbm [%#lx,+%#lx) outside %lu bytes of HBM",
                         static_cast<unsigned long>(offset), static_cast<unsigned long>(len),
                         static_cast<unsigned long>(_info.hbm_size));
  HCOMM_TRY(check_rights(rights));
  std::lock_guard lk(_mu);
  Mapping m;
  m.iova = alloc_iova(len);
  m.len = len;
  HCOMM_TRY(att_install(m.iova, len, offset, rights | abi::att::KIND_HBM, &m.att_index));
  *out = m;
  return Status::ok();
}

Status Device::map_peer_hbm(uint32_t peer, uint64_t offset, uint64_t len, uint32_t rights, Mapping* out) {
  if ((_info.caps & abi::cap::PEER_DMA) == 0) return Status::error(Code::unsupported, "device lacks PEER_DMA");
  if (peer >= _info.fabric_size || peer > 0xff || len == 0 || out == nullptr)
    return Status::error(Code::invalid_argument, "peer %u not on this device's fabric (size %u)", peer,
                         _info.fabric_size);
  HCOMM_TRY(check_rights(rights));
  std::lock_guard lk(_mu);
  Mapping m;
  m.iova = alloc_iova(len);
  m.len = len;
  HCOMM_TRY(att_install(m.iova, len, offset, rights | abi::att::KIND_PEER_HBM | (peer << abi::att::PEER_SHIFT),
                        &m.att_index));
  *out = m;
  return Status::ok();
}

Status Device::health(bool force) {
  HCOMM_TRY(_link->health());
  if (!_link->cheap_register_reads()) return Status::ok();
  {
    std::lock_guard lk(_health_mu);
    const auto now = std::chrono::steady_clock::now();
    if (!force && now - _status_checked < std::chrono::milliseconds(kStatusCheckMs)) return Status::ok();
    _status_checked = now;
  }
  uint32_t st = 0;
  if (Status r = _link->read32(reg::STATUS, &st); !r) {
    // The read may be how a hang-up shows first: then say that, as the link does.
    if (Status h = _link->health(); !h) return h;
    return Status::error(Code::device_error, "reading STATUS failed: %s", r.message().c_str());
  }
  if (st == 0xffffffffu)
    return Status::error(Code::device_error, "registers read as all ones (removed from the bus, or in reset)");
  if ((st & abi::status::FATAL) != 0) return Status::error(Code::device_error, "the device reports FATAL");
  if ((st & abi::status::ENABLED) == 0)
    return Status::error(Code::device_error,
                         "the device was reset (STATUS without ENABLED): its queues and address translations are gone");
  return Status::ok();
}

Status Device::unmap(Mapping* m) {
  if (m == nullptr || !m->valid()) return Status::error(Code::invalid_argument, "unmap: not a valid mapping");
  std::lock_guard lk(_mu);
  if (m->att_index >= _att_used.size() || !_att_used[m->att_index])
    return Status::error(Code::not_found, "unmap: ATT entry %u not in use", m->att_index);
  // Clear the ATT entries first (the device stops using them), then the DMA maps.
  if (!m->pieces.empty()) {
    // Every piece, whatever fails: the first failure is reported, nothing is left half mapped.
    Status first;
    for (const auto& p : m->pieces)
      if (Status st = att_clear(p.att_index); !st && first.is_ok()) first = st;
    for (const auto& p : m->pieces)
      if (Status st = _link->dma_unmap(p.bus_addr, p.len); !st && first.is_ok()) first = st;
    *m = Mapping{};
    return first;
  }
  HCOMM_TRY(att_clear(m->att_index));
  if (m->host) HCOMM_TRY(_link->dma_unmap(m->bus_addr, m->len));
  *m = Mapping{};
  return Status::ok();
}

Status Device::create_queue(uint32_t log2, bool interrupts, std::unique_ptr<DmaQueue>* out) {
  if (log2 == 0 || log2 > _info.max_queue_log2)
    return Status::error(Code::invalid_argument, "queue size 2^%u outside 2^1..2^%u", log2, _info.max_queue_log2);
  uint32_t qid = UINT32_MAX;
  {
    std::lock_guard lk(_mu);
    for (uint32_t i = 0; i < _queue_used.size(); ++i) {
      if (!_queue_used[i]) {
        qid = i;
        _queue_used[i] = true;
        break;
      }
    }
  }
  if (qid == UINT32_MAX) return Status::error(Code::no_resource, "all %u DMA queues in use", _info.num_queues);
  std::unique_ptr<DmaQueue> q(new DmaQueue(*this, qid));
  Status st = q->init(log2, interrupts);
  if (!st) return st;  // ~DmaQueue releases the slot
  *out = std::move(q);
  return Status::ok();
}

void Device::release_queue(uint32_t q) {
  std::lock_guard lk(_mu);
  if (q < _queue_used.size()) _queue_used[q] = false;
}

Status Device::error_log(ErrorLog* out) {
  HCOMM_TRY(_link->read64(reg::ERR_COUNT, &out->count));
  HCOMM_TRY(_link->read32(reg::ERR_LOG_CODE, &out->last_code));
  HCOMM_TRY(_link->read32(reg::ERR_LOG_QUEUE, &out->last_queue));
  HCOMM_TRY(_link->read32(reg::ERR_LOG_INDEX, &out->last_index));
  HCOMM_TRY(_link->read64(reg::ERR_LOG_ADDR, &out->last_addr));
  HCOMM_TRY(_link->read64(reg::COMPLETED, &out->completed));
  return Status::ok();
}

Status Device::clear_errors() { return _link->write32(reg::ERR_CLEAR, 1); }

}  // namespace hcomm::hal::npu
