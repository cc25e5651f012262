// Registered memory and remote keys.
//
// A registration is a slot in this rank's control segment (shared with every
// peer). The slot's generation is odd while the memory is registered; a
// release bumps it to even, so every key minted for it stops validating at
// once, on every peer, with no message (§ "memory" in docs/api.md).
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "api/internal.h"
#include "api/wireup/mesh.h"

namespace hcomm::api {

namespace {
constexpr unsigned kKnownAccess = HCOMM_ACCESS_ALL;

// Device (ATT) rights an imported key needs: accumulate reads and writes the
// target; fetch atomics read and write it too.
uint32_t att_rights(unsigned key_rights) {
  uint32_t r = 0;
  if (key_rights & (HCOMM_ACCESS_REMOTE_READ | HCOMM_ACCESS_REMOTE_ATOMIC)) r |= hal::npu::access::READ;
  if (key_rights & (HCOMM_ACCESS_REMOTE_WRITE | HCOMM_ACCESS_REMOTE_ATOMIC)) r |= hal::npu::access::WRITE;
  return r;
}
}  // namespace

Status Context::alloc_slot(uint32_t* slot) {
  for (uint32_t i = 0; i < kMaxRegs; ++i) {
    if (_mems[i] == nullptr) {
      *slot = i;
      return Status::ok();
    }
  }
  return Status::error(Code::no_resource, "all %u registration slots in use", kMaxRegs);
}

// Make the registration visible to peers: fields first, then the odd
// generation with release (readers load it with acquire).
void Context::publish(hcomm_mem* m) {
  RegEntry& e = _ctrl->regs[m->slot];
  uint32_t gen = e.gen.load(std::memory_order_relaxed);
  m->gen = (gen | 1u) == gen ? gen + 2 : gen + 1;  // next odd value
  e.rights = m->access;
  e.size = m->size;
  e.addr = m->kind == MemKind::device ? m->hbm_offset : reinterpret_cast<uint64_t>(m->ptr);
  e.kind = static_cast<uint32_t>(m->kind);
  e.fabric_index = _dev ? _dev->info().fabric_index : 0;
  e.gen.store(m->gen, std::memory_order_release);
  _mems[m->slot] = m;
  if (m->ptr != nullptr) _by_addr[reinterpret_cast<uintptr_t>(m->ptr)] = m;
}

// Hand the memfd of host_alloc memory to every peer now, so that a key the
// user ships later (by any route) finds the fd already queued at the peer.
void Context::advertise(hcomm_mem* m) {
  MeshMsg msg{static_cast<uint32_t>(MeshType::advert), _rank, static_cast<int32_t>(::getpid()), m->slot, m->gen, 1};
  int fd = m->buf.fd();
  for (Peer& p : _peers) {
    if (p.rank == _rank || !p.alive) continue;
    Status st = send_msg(p.sock.get(), &msg, sizeof msg, {&fd, 1}, Deadline::after_ms(5000), p.rank);
    if (!st) peer_failed(p, st.message());
  }
}

Status Context::mem_alloc(size_t size, unsigned kind, unsigned access, hcomm_mem** out) {
  if (out == nullptr || size == 0) return Status::error(Code::invalid_argument, "mem_alloc: zero size or null out");
  if ((access & ~kKnownAccess) != 0) return Status::error(Code::invalid_argument, "mem_alloc: unknown access bits %#x", access);
  if (kind != HCOMM_MEM_HOST && kind != HCOMM_MEM_DEVICE)
    return Status::error(Code::invalid_argument, "mem_alloc: kind %u is neither HOST nor DEVICE", kind);
  uint32_t slot;
  HCOMM_TRY(alloc_slot(&slot));
  auto m = std::make_unique<hcomm_mem>();
  m->ctx = this;
  m->slot = slot;
  m->size = size;
  m->access = access;
  if (kind == HCOMM_MEM_HOST) {
    m->kind = MemKind::host_alloc;
    HCOMM_TRY(driver::DmaBuffer::allocate(size, -1, &m->buf));
    m->ptr = static_cast<uint8_t*>(m->buf.data());
    if (_dev) HCOMM_TRY(_dev->map_buffer(m->buf, hal::npu::access::RW, &m->map));
  } else {
    if (!_dev) return Status::error(Code::unsupported, "device memory needs the NPU engine (this context runs the host engine)");
    m->kind = MemKind::device;
    const uint64_t want = (size + 4095) & ~uint64_t{4095};
    auto it = _hbm_free.begin();
    while (it != _hbm_free.end() && it->second < want) ++it;
    if (it == _hbm_free.end())
      return Status::error(Code::no_resource, "no %zu free bytes of device memory (HBM %lu bytes)", size,
                           static_cast<unsigned long>(_dev->info().hbm_size));
    m->hbm_offset = it->first;
    uint64_t left = it->second - want;
    _hbm_free.erase(it);
    if (left > 0) _hbm_free[m->hbm_offset + want] = left;
    Status st = _dev->map_hbm(m->hbm_offset, size, hal::npu::access::RW, &m->map);
    if (!st) {
      _hbm_free[m->hbm_offset] = want;
      return st;
    }
    m->ptr = _dev->hbm() != nullptr ? _dev->hbm() + m->hbm_offset : nullptr;
    if (m->ptr != nullptr) std::memset(m->ptr, 0, size);
  }
  publish(m.get());
  if (m->kind == MemKind::host_alloc) advertise(m.get());
  *out = m.release();
  return Status::ok();
}

Status Context::mem_register(void* addr, size_t size, unsigned access, hcomm_mem** out) {
  if (out == nullptr || addr == nullptr || size == 0)
    return Status::error(Code::invalid_argument, "mem_register: null address, zero size or null out");
  if ((access & ~kKnownAccess) != 0) return Status::error(Code::invalid_argument, "mem_register: unknown access bits %#x", access);
  if (find_local(addr, 1) != nullptr || find_local(static_cast<uint8_t*>(addr) + size - 1, 1) != nullptr)
    return Status::error(Code::invalid_argument, "mem_register: range overlaps memory already registered");
  uint32_t slot;
  HCOMM_TRY(alloc_slot(&slot));
  auto m = std::make_unique<hcomm_mem>();
  m->ctx = this;
  m->slot = slot;
  m->kind = MemKind::host_user;
  m->ptr = static_cast<uint8_t*>(addr);
  m->size = size;
  m->access = access;
  if (_dev) {
    // The device needs the memory pinned and mapped; over vfio-user that takes
    // an fd, which arbitrary user memory does not have.
    Status st = _dev->map_host(addr, size, -1, 0, hal::npu::access::RW, &m->map);
    if (!st)
      return Status(Code::unsupported, "the NPU engine cannot DMA this buffer (" + st.message() +
                                           "): allocate it with hcomm_mem_alloc instead");
  }
  publish(m.get());
  *out = m.release();
  return Status::ok();
}

Status Context::mem_release(hcomm_mem* m) {
  if (m == nullptr || m->ctx != this || m->slot >= kMaxRegs || _mems[m->slot] != m)
    return Status::error(Code::invalid_argument, "mem_release: not a registration of this context");
  // Revoke first: every key for it fails validation from now on.
  _ctrl->regs[m->slot].gen.store(m->gen + 1, std::memory_order_release);
  // Our own device may still run descriptors on it: let them finish.
  if (_dev) HCOMM_TRY(flush(-1, Deadline::after_ms(30000)));
  if (m->map.valid()) HCOMM_TRY(_dev->unmap(&m->map));
  if (m->kind == MemKind::device) {
    uint64_t want = (m->size + 4095) & ~uint64_t{4095};
    _hbm_free[m->hbm_offset] = want;
    // Coalesce with neighbours.
    auto it = _hbm_free.find(m->hbm_offset);
    if (auto nx = std::next(it); nx != _hbm_free.end() && it->first + it->second == nx->first) {
      it->second += nx->second;
      _hbm_free.erase(nx);
    }
    if (it != _hbm_free.begin()) {
      auto pv = std::prev(it);
      if (pv->first + pv->second == it->first) {
        pv->second += it->second;
        _hbm_free.erase(it);
      }
    }
  }
  _mems[m->slot] = nullptr;
  if (m->ptr != nullptr) _by_addr.erase(reinterpret_cast<uintptr_t>(m->ptr));
  delete m;
  return Status::ok();
}

Status Context::rkey_pack(const hcomm_mem* m, void* buf, size_t* len) const {
  if (m == nullptr || buf == nullptr || len == nullptr)
    return Status::error(Code::invalid_argument, "rkey_pack: null argument");
  if (*len < sizeof(RkeyWire))
    return Status::error(Code::invalid_argument, "rkey_pack: buffer of %zu bytes, need %zu", *len, sizeof(RkeyWire));
  RkeyWire w{kRkeyMagic, kRkeyVersion, static_cast<uint16_t>(m->kind), _rank, m->slot, m->gen, m->access,
             m->size, m->kind == MemKind::device ? m->hbm_offset : reinterpret_cast<uint64_t>(m->ptr), _job_hash,
             _dev ? _dev->info().fabric_index : 0, 0};
  std::memcpy(buf, &w, sizeof w);
  *len = sizeof w;
  return Status::ok();
}

Status Context::rkey_import(int peer, const void* buf, size_t len, hcomm_rkey** out) {
  if (buf == nullptr || out == nullptr) return Status::error(Code::invalid_argument, "rkey_import: null argument");
  if (peer < 0 || peer >= _size) return Status::error(Code::invalid_argument, "rkey_import: rank %d of %d", peer, _size);
  if (len != sizeof(RkeyWire))
    return Status::error(Code::protocol_error, "rkey_import: %zu bytes is not a remote key (%zu)", len, sizeof(RkeyWire));
  RkeyWire w;
  std::memcpy(&w, buf, sizeof w);
  if (w.magic != kRkeyMagic) return Status::error(Code::protocol_error, "rkey_import: not a remote key (bad magic)");
  if (w.version != kRkeyVersion)
    return Status::error(Code::protocol_error, "rkey_import: key version %u, this library reads %u", w.version,
                         kRkeyVersion);
  if (w.job_hash != _job_hash) return Status::error(Code::access_denied, "rkey_import: key from another job");
  if (w.owner != peer)
    return Status::error(Code::access_denied, "rkey_import: key belongs to rank %d, not rank %d", w.owner, peer);
  if (w.slot >= kMaxRegs || w.kind < 1 || w.kind > 3 || (w.rights & ~kKnownAccess) != 0 || w.size == 0)
    return Status::error(Code::protocol_error, "rkey_import: malformed key fields");
  // Validate against the owner's live registration table.
  const RegEntry& e = peer == _rank ? _ctrl->regs[w.slot] : _peers[peer].ctrl->regs[w.slot];
  uint32_t gen = e.gen.load(std::memory_order_acquire);
  if (gen != w.gen || (gen & 1u) == 0)
    return Status::error(Code::access_denied, "rkey_import: key of rank %d is revoked or stale (slot %u)", peer, w.slot);
  if (e.size != w.size || e.addr != w.addr || e.kind != w.kind || (w.rights & ~e.rights) != 0)
    return Status::error(Code::access_denied, "rkey_import: key does not match rank %d's registration (forged?)", peer);
  if (peer != _rank && !_peers[peer].alive) return Status(Code::peer_failure, _peers[peer].why_dead);

  auto k = std::make_unique<hcomm_rkey>();
  k->ctx = this;
  k->w = w;
  k->peer = peer;
  const MemKind kind = static_cast<MemKind>(w.kind);
  if (peer == _rank) {
    hcomm_mem* m = _mems[w.slot];
    if (m == nullptr) return Status::error(Code::access_denied, "rkey_import: own registration vanished");
    if (kind != MemKind::device) k->mapped = m->ptr;  // borrowed, not unmapped
    if (_dev && att_rights(w.rights) != 0) {
      // A separate ATT entry with exactly the key's rights.
      if (kind == MemKind::device) HCOMM_TRY(_dev->map_hbm(w.addr, w.size, att_rights(w.rights), &k->map));
      else if (kind == MemKind::host_alloc)
        HCOMM_TRY(_dev->map_host(m->ptr, m->size, m->buf.fd(), 0, att_rights(w.rights), &k->map));
    }
  } else if (kind == MemKind::host_alloc) {
    int fd = -1;
    HCOMM_TRY(await_advert(_peers[peer], w.slot, w.gen, Deadline::after_ms(5000), &fd));
    void* p = ::mmap(nullptr, w.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return Status::from_errno(errno, "rkey_import: mmap of the peer's memory");
    k->mapped = static_cast<uint8_t*>(p);
    k->mapped_len = w.size;
    if (_dev && att_rights(w.rights) != 0) {
      Status st = _dev->map_host(p, w.size, fd, 0, att_rights(w.rights), &k->map);
      if (!st) {
        ::munmap(p, w.size);
        return st;
      }
    }
  } else if (kind == MemKind::device) {
    if (!_dev) return Status::error(Code::unsupported, "rkey_import: device memory key, but this rank runs the host engine");
    if (att_rights(w.rights) != 0)
      HCOMM_TRY(_dev->map_peer_hbm(w.fabric_index, w.addr, w.size, att_rights(w.rights), &k->map));
  } else if (_dev) {
    return Status::error(Code::unsupported,
                         "rkey_import: rank %d registered user memory, which the NPU engine cannot reach", peer);
  }
  // host_user on the host engine: reached with process_vm_readv/writev.
  *out = k.release();
  return Status::ok();
}

Status Context::rkey_release(hcomm_rkey* k) {
  if (k == nullptr || k->ctx != this) return Status::error(Code::invalid_argument, "rkey_release: not a key of this context");
  if (_dev && k->map.valid()) {
    HCOMM_TRY(flush(-1, Deadline::after_ms(30000)));
    HCOMM_TRY(_dev->unmap(&k->map));
  }
  if (k->mapped_len > 0) ::munmap(k->mapped, k->mapped_len);
  delete k;
  return Status::ok();
}

// Every remote access is checked here first: a released key, a revoked one,
// an out-of-bounds range or a missing right fails before anything moves.
Status Context::check_key(hcomm_rkey* k, uint64_t off, uint64_t len, unsigned need) const {
  if (k == nullptr || k->ctx != this) return Status::error(Code::invalid_argument, "not a remote key of this context");
  if (off > k->w.size || len > k->w.size - off)
    return Status::error(Code::out_of_range, "remote range [%lu,+%lu) outside the key's %lu bytes",
                         static_cast<unsigned long>(off), static_cast<unsigned long>(len),
                         static_cast<unsigned long>(k->w.size));
  if ((k->w.rights & need) != need)
    return Status::error(Code::access_denied, "the key lacks the right (has %#x, needs %#x)", k->w.rights, need);
  const RegEntry& e = k->peer == _rank ? _ctrl->regs[k->w.slot] : _peers[k->peer].ctrl->regs[k->w.slot];
  if (e.gen.load(std::memory_order_acquire) != k->w.gen)
    return Status::error(Code::access_denied, "the key was revoked by rank %d", k->peer);
  if (k->peer != _rank && !_peers[k->peer].alive) return Status(Code::peer_failure, _peers[k->peer].why_dead);
  return Status::ok();
}

const hcomm_mem* Context::find_local(const void* p, size_t len) const {
  auto a = reinterpret_cast<uintptr_t>(p);
  auto it = _by_addr.upper_bound(a);
  if (it == _by_addr.begin()) return nullptr;
  const hcomm_mem* m = std::prev(it)->second;
  auto b = reinterpret_cast<uintptr_t>(m->ptr);
  return a - b <= m->size && len <= m->size - (a - b) ? m : nullptr;
}

}  // namespace hcomm::api
