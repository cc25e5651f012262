// Registrations and packed remote keys (format: api/mem/memory.h).
//
// Revocation: on the same host a registration is a slot in the owner's
// control segment (api/transport/shm) whose generation is odd while
// registered; hcomm_mem_release bumps it, so every key minted for it stops
// validating at once, on every peer, with no message (docs/api.md "memory").
#include <cerrno>
#include <cstring>

#include "api/core/context.h"
#include "api/transport/npu/npu.h"
#include "api/transport/shm/shm.h"

namespace hcomm::api {

namespace {
constexpr unsigned kKnownAccess = HCOMM_ACCESS_ALL;
}  // namespace

Status Context::mem_alloc(size_t size, unsigned kind, unsigned access, hcomm_mem** out) {
  if (out == nullptr || size == 0) return Status::error(Code::invalid_argument, "mem_alloc: zero size or null out");
  if ((access & ~kKnownAccess) != 0)
    return Status::error(Code::invalid_argument, "mem_alloc: unknown access bits %#x", access);
  if (kind != HCOMM_MEM_HOST && kind != HCOMM_MEM_DEVICE)
    return Status::error(Code::invalid_argument, "mem_alloc: kind %u is neither HOST nor DEVICE", kind);
  if (kind == HCOMM_MEM_DEVICE && _npu == nullptr)
    return Status::error(Code::unsupported, "device memory needs the NPU engine (this context runs the host engine)");
  auto m = std::make_unique<hcomm_mem>();
  m->ctx = this;
  m->size = size;
  m->access = access;
  if (kind == HCOMM_MEM_HOST) {
    m->kind = MemKind::host_alloc;
    HCOMM_TRY(driver::DmaBuffer::allocate(size, -1, &m->buf));
    m->ptr = static_cast<uint8_t*>(m->buf.data());
  } else {
    m->kind = MemKind::device;
    HCOMM_TRY(_npu->alloc_hbm(*m));
  }
  return add_mem(std::move(m), out);
}

Status Context::mem_register(void* addr, size_t size, unsigned access, hcomm_mem** out) {
  if (out == nullptr || addr == nullptr || size == 0)
    return Status::error(Code::invalid_argument, "mem_register: null address, zero size or null out");
  if ((access & ~kKnownAccess) != 0)
    return Status::error(Code::invalid_argument, "mem_register: unknown access bits %#x", access);
  if (find_local(addr, 1) != nullptr || find_local(static_cast<uint8_t*>(addr) + size - 1, 1) != nullptr)
    return Status::error(Code::invalid_argument, "mem_register: range overlaps memory already registered");
  auto m = std::make_unique<hcomm_mem>();
  m->ctx = this;
  m->kind = MemKind::host_user;
  m->ptr = static_cast<uint8_t*>(addr);
  m->size = size;
  m->access = access;
  return add_mem(std::move(m), out);
}

// A slot and generation, then every transport; on a failure the ones that
// took the memory let go of it (device memory's range goes back to the npu
// transport even when mapping it failed).
Status Context::add_mem(std::unique_ptr<hcomm_mem> m, hcomm_mem** out) {
  uint32_t slot = kMaxRegs;
  for (uint32_t i = 0; i < kMaxRegs; ++i) {
    if (_mems[i] == nullptr) {
      slot = i;
      break;
    }
  }
  if (slot == kMaxRegs) {
    if (m->kind == MemKind::device) _npu->mem_remove(*m);
    return Status::error(Code::no_resource, "all %u registration slots in use", kMaxRegs);
  }
  m->slot = slot;
  uint32_t& gen = _slot_gen[slot];
  gen = (gen | 1u) == gen ? gen + 2 : gen + 1;  // next odd value
  m->gen = gen;
  if (_shm != nullptr) _shm->publish(*m, _npu != nullptr ? _npu->fabric_index() : 0);
  for (size_t i = 0; i < _transports.size(); ++i) {
    Status st = _transports[i]->mem_add(*m);
    if (!st) {
      if (_shm != nullptr) _shm->revoke(*m);
      ++gen;
      for (size_t j = 0; j <= i; ++j) _transports[j]->mem_remove(*m);
      return st;
    }
  }
  _mems[slot] = m.get();
  if (m->ptr != nullptr) _by_addr[reinterpret_cast<uintptr_t>(m->ptr)] = m.get();
  mem_changed();
  *out = m.release();
  return Status::ok();
}

Status Context::mem_release(hcomm_mem* m) {
  if (m == nullptr || m->ctx != this || m->slot >= kMaxRegs || _mems[m->slot] != m)
    return Status::error(Code::invalid_argument, "mem_release: not a registration of this context");
  // Revoke first: every key for it fails validation from now on.
  if (_shm != nullptr) _shm->revoke(*m);
  ++_slot_gen[m->slot];
  // Then each transport lets go (the npu one waits for its descriptors first).
  for (auto it = _transports.rbegin(); it != _transports.rend(); ++it) (*it)->mem_remove(*m);
  _mems[m->slot] = nullptr;
  if (m->ptr != nullptr) _by_addr.erase(reinterpret_cast<uintptr_t>(m->ptr));
  mem_changed();
  delete m;
  return Status::ok();
}

Status Context::rkey_pack(const hcomm_mem* m, void* buf, size_t* len) const {
  if (m == nullptr || buf == nullptr || len == nullptr)
    return Status::error(Code::invalid_argument, "rkey_pack: null argument");
  RkeyHeader h{kRkeyMagic, kRkeyVersion, static_cast<uint8_t>(m->kind), 0, _rank, m->slot, m->gen, m->access,
               m->size, m->kind == MemKind::device ? m->hbm_offset : reinterpret_cast<uint64_t>(m->ptr), _job_hash};
  uint8_t out[HCOMM_RKEY_MAX];
  size_t n = sizeof h;
  for (const auto& t : _transports) {
    uint8_t sec[Transport::kMaxSection];
    size_t slen = 0;
    if (!t->pack(*m, sec, &slen)) continue;
    if (n + kRkeySectionHdr + slen > sizeof out)
      return Status::error(Code::no_resource, "rkey_pack: sections exceed %d bytes", HCOMM_RKEY_MAX);
    out[n] = static_cast<uint8_t>(t->id());
    out[n + 1] = static_cast<uint8_t>(slen);
    std::memcpy(out + n + kRkeySectionHdr, sec, slen);
    n += kRkeySectionHdr + slen;
    ++h.nsections;
  }
  std::memcpy(out, &h, sizeof h);
  if (*len < n) return Status::error(Code::invalid_argument, "rkey_pack: buffer of %zu bytes, need %zu", *len, n);
  std::memcpy(buf, out, n);
  *len = n;
  return Status::ok();
}

Status Context::rkey_import(int peer, const void* buf, size_t len, hcomm_rkey** out) {
  if (buf == nullptr || out == nullptr) return Status::error(Code::invalid_argument, "rkey_import: null argument");
  if (peer < 0 || peer >= _size) return Status::error(Code::invalid_argument, "rkey_import: rank %d of %d", peer, _size);
  if (len < sizeof(RkeyHeader) || len > HCOMM_RKEY_MAX)
    return Status::error(Code::protocol_error, "rkey_import: %zu bytes is not a remote key (%zu..%d)", len,
                         sizeof(RkeyHeader), HCOMM_RKEY_MAX);
  const auto* b = static_cast<const uint8_t*>(buf);
  RkeyHeader h;
  std::memcpy(&h, b, sizeof h);
  if (h.magic != kRkeyMagic) return Status::error(Code::protocol_error, "rkey_import: not a remote key (bad magic)");
  if (h.version != kRkeyVersion)
    return Status::error(Code::protocol_error, "rkey_import: key version %u, this library reads %u", h.version,
                         kRkeyVersion);
  if (h.job_hash != _job_hash) return Status::error(Code::access_denied, "rkey_import: key from another job");
  if (h.owner != peer)
    return Status::error(Code::access_denied, "rkey_import: key belongs to rank %d, not rank %d", h.owner, peer);
  if (h.slot >= kMaxRegs || h.kind < 1 || h.kind > 3 || (h.rights & ~kKnownAccess) != 0 || h.size == 0)
    return Status::error(Code::protocol_error, "rkey_import: malformed key fields");
  // The sections: each (id, length, bytes), exactly filling the blob.
  struct Sec {
    uint8_t id;
    const uint8_t* data;
    size_t len;
  };
  std::vector<Sec> secs;
  size_t off = sizeof h;
  while (off < len) {
    if (len - off < kRkeySectionHdr || b[off + 1] > Transport::kMaxSection ||
        len - off - kRkeySectionHdr < b[off + 1])
      return Status::error(Code::protocol_error, "rkey_import: section %zu overruns the key", secs.size());
    for (const Sec& q : secs)
      if (q.id == b[off])
        return Status::error(Code::protocol_error, "rkey_import: two sections for transport %u", b[off]);
    secs.push_back({b[off], b + off + kRkeySectionHdr, b[off + 1]});
    off += kRkeySectionHdr + b[off + 1];
  }
  if (secs.size() != h.nsections)
    return Status::error(Code::protocol_error, "rkey_import: %zu sections, header says %u", secs.size(), h.nsections);
  Peer& p = _peers[static_cast<size_t>(peer)];
  // Same host: the owner's live registration table (forged, stale, revoked).
  if (p.same_host && _shm != nullptr) HCOMM_TRY(_shm->check_entry(peer, h));
  if (peer != _rank && !p.alive) return Status(Code::peer_failure, p.why_dead);

  auto k = std::make_unique<hcomm_rkey>();
  k->ctx = this;
  k->h = h;
  k->peer = peer;
  Status why = Status::error(Code::unsupported, "rkey_import: no transport serving rank %d (%s) can reach this memory",
                             peer, p.lanes.c_str());
  for (Transport* t : p.rma) {
    for (const Sec& s : secs) {
      if (s.id != static_cast<uint8_t>(t->id())) continue;
      Status st = t->import(*k, s.data, s.len);
      if (st) {
        k->lane = k->alane = t;
        // One atomicity agent per memory: in a job that spans hosts, NIC-
        // reachable memory takes every rank's atomics through the NIC.
        if (_verbs != nullptr && _cross_host && t != _verbs) {
          for (const Sec& v : secs) {
            if (v.id != static_cast<uint8_t>(TransportId::verbs)) continue;
            Status vs = _verbs->import(*k, v.data, v.len);
            if (!vs) {
              (void)t->unimport(*k);
              return vs;
            }
            k->alane = _verbs;
          }
        }
        k->sync = k->lane->caps().sync && k->alane->caps().sync;
        auto node = [](const Transport* x) { return x->id() == TransportId::shm || x->id() == TransportId::cma; };
        if (_shm != nullptr && node(k->lane) && node(k->alane)) k->live_gen = _shm->gen_word(peer, h.slot);
        // Bytes the CPU moves on this host (the data lane is shm or cma, even
        // when the atomicity agent is the NIC) hold the access mark.
        if (_shm != nullptr && node(k->lane)) {
          k->marks = _shm->marks();
          k->mark_value = static_cast<uint32_t>(peer) + 1;
        }
        if (k->live_gen != nullptr && k->lane == k->alane && k->lane->id() == TransportId::shm) k->direct = k->mapped;
        *out = k.release();
        return Status::ok();
      }
      if (st.code() != Code::unsupported) return st;
      why = st;
    }
  }
  return why;
}

Status Context::rkey_release(hcomm_rkey* k) {
  if (k == nullptr || k->ctx != this) return Status::error(Code::invalid_argument, "rkey_release: not a key of this context");
  if (k->lane != nullptr) HCOMM_TRY(k->lane->unimport(*k));
  delete k;
  return Status::ok();
}

// Every remote access is checked here first: a released key, a revoked one,
// an out-of-bounds range or a missing right fails before anything moves.
Status Context::check_key(hcomm_rkey* k, uint64_t off, uint64_t len, unsigned need) const {
  if (k == nullptr || k->ctx != this) return Status::error(Code::invalid_argument, "not a remote key of this context");
  if (off > k->h.size || len > k->h.size - off)
    return Status::error(Code::out_of_range, "remote range [%lu,+%lu) outside the key's %lu bytes",
                         static_cast<unsigned long>(off), static_cast<unsigned long>(len),
                         static_cast<unsigned long>(k->h.size));
  if ((k->h.rights & need) != need)
    return Status::error(Code::access_denied, "the key lacks the right (has %#x, needs %#x)", k->h.rights, need);
  HCOMM_TRY(check_live(*k));
  const Peer& p = _peers[static_cast<size_t>(k->peer)];
  if (k->peer != _rank && !p.alive) return Status(Code::peer_failure, p.why_dead);
  return Status::ok();
}

Status Context::check_live(const hcomm_rkey& k) const {
  if (k.live_gen != nullptr) {
    // shm / cma: the owner's live generation (what their validate() reads).
    if (k.live_gen->load(std::memory_order_seq_cst) != k.h.gen)  // (after the access mark: see AccessMark)
      return Status::error(Code::access_denied, "the key was revoked by rank %d", k.peer);
    return Status::ok();
  }
  HCOMM_TRY(k.lane->validate(k));
  if (k.alane != k.lane) HCOMM_TRY(k.alane->validate(k));
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

namespace {
// Epochs are unique across contexts, so that a context created where a
// finalized one lived never matches the old one's cache entries.
std::atomic<uint64_t> g_mem_epochs{0};
}  // namespace

constinit thread_local ThreadCache t_cache;

void Context::mem_changed() {
  _mem_epoch.store(g_mem_epochs.fetch_add(1, std::memory_order_relaxed) + 1, std::memory_order_release);
}

const hcomm_mem* Context::find_local_unlocked(const void* p, size_t len) {
  if (const hcomm_mem* hit = cached_local(p, len)) return hit;
  std::lock_guard lock(_mu);
  const hcomm_mem* m = find_local(p, len);
  if (m != nullptr) t_cache.hit = LocalHit{this, _mem_epoch.load(std::memory_order_relaxed), reinterpret_cast<uintptr_t>(m->ptr), m->size, m};
  return m;
}

}  // namespace hcomm::api
