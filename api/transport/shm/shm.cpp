#include "api/transport/shm/shm.h"

#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "api/core/context.h"
#include "api/proto/am_check.h"
#include "api/wireup/mesh.h"
#include "common/barrier.h"
#include "common/memfd.h"
#include "hal/abi/reduce.h"

namespace hcomm::api {

namespace abi = hal::abi;

ShmTransport::ShmTransport(Context& ctx, AmSink& sink) : _ctx(ctx), _sink(sink), _rank(ctx.rank()) {
  _caps.max_short = kEagerMax;
  _caps.put = _caps.get = _caps.atomic64 = _caps.reduce = _caps.notify = true;
  _caps.sync = true;
  _caps.am_concurrent = true;
  _peers.resize(static_cast<size_t>(ctx.size()));
  _tx_locks = std::make_unique<TxLock[]>(static_cast<size_t>(ctx.size()));
}

Status ShmTransport::open(Context& ctx, AmSink& sink, std::unique_ptr<ShmTransport>* out) {
  std::unique_ptr<ShmTransport> t(new ShmTransport(ctx, sink));
  (void)marks_init();  // before any access: whether accesses fence themselves
  int fd = ::memfd_create("hcomm-ctrl", MFD_CLOEXEC | kSealableMemfd);
  if (fd < 0) return Status::from_errno(errno, "memfd_create(ctrl)");
  t->_ctrl_fd.reset(fd);
  if (::ftruncate(fd, sizeof(CtrlSegment)) != 0) return Status::from_errno(errno, "ftruncate(ctrl)");
  HCOMM_TRY(seal_size(fd, "control segment"));
  void* p = nullptr;
  HCOMM_TRY(t->map_fd(fd, sizeof(CtrlSegment), &p));
  t->_ctrl = static_cast<CtrlSegment*>(p);
  t->_ctrl->hdr = CtrlHeader{kCtrlMagic, kCtrlVersion, ctx.rank(), static_cast<int32_t>(::getpid()), ctx.job_hash(),
                             kMaxRegs, kLockStripes};
  pthread_mutexattr_t ma;
  pthread_mutexattr_init(&ma);
  pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&ma, PTHREAD_MUTEX_ROBUST);
  for (auto& m : t->_ctrl->locks) pthread_mutex_init(&m, &ma);
  pthread_mutexattr_destroy(&ma);
  t->_peers[static_cast<size_t>(ctx.rank())].pid = ::getpid();
  *out = std::move(t);
  return Status::ok();
}

ShmTransport::~ShmTransport() {
  for (auto& [p, len] : _maps) ::munmap(p, len);
}

Status ShmTransport::map_fd(int fd, size_t len, void** out) {
  void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return Status::from_errno(errno, "mmap(shared segment)");
  _maps.emplace_back(p, len);
  *out = p;
  return Status::ok();
}

CtrlSegment* ShmTransport::seg(int peer) const {
  return peer == _rank ? _ctrl : _peers[static_cast<size_t>(peer)].ctrl;
}

Status ShmTransport::connect(const Deadline& dl) {
  const int n = _ctx.size();
  std::vector<UniqueFd> chan_fds(static_cast<size_t>(n));
  std::vector<ChannelLayout*> chans(static_cast<size_t>(n), nullptr);
  for (int r = _rank + 1; r < n; ++r) {
    if (!_ctx.peer(r).same_host) continue;
    int fd = ::memfd_create("hcomm-chan", MFD_CLOEXEC | kSealableMemfd);
    if (fd < 0) return Status::from_errno(errno, "memfd_create(channel)");
    chan_fds[static_cast<size_t>(r)].reset(fd);
    if (::ftruncate(fd, sizeof(ChannelLayout)) != 0) return Status::from_errno(errno, "ftruncate(channel)");
    HCOMM_TRY(seal_size(fd, "channel"));
    // Every slot free for the producer's first lap, before the peer sees the channel.
    void* chan = nullptr;
    HCOMM_TRY(map_fd(fd, sizeof(ChannelLayout), &chan));
    auto* c = static_cast<ChannelLayout*>(chan);
    for (RingLayout& ring : c->dir)
      for (uint32_t i = 0; i < kSlots; ++i) ring.slots[i].line.seq.store(i, std::memory_order_release);
    chans[static_cast<size_t>(r)] = c;
  }
  for (int r = 0; r < n; ++r) {
    if (r == _rank || !_ctx.peer(r).same_host) continue;
    CtrlMsg m{static_cast<uint32_t>(CtrlType::segments), _rank, static_cast<int32_t>(::getpid()), 0, 0, 0};
    std::vector<int> fds = {_ctrl_fd.get()};
    if (r > _rank) fds.push_back(chan_fds[static_cast<size_t>(r)].get());
    m.nfds = static_cast<uint32_t>(fds.size());
    HCOMM_TRY(send_msg(_ctx.peer(r).sock.get(), &m, sizeof m, fds, dl, r));
  }
  for (int r = 0; r < n; ++r) {
    if (r == _rank || !_ctx.peer(r).same_host) continue;
    ShmPeer& p = _peers[static_cast<size_t>(r)];
    std::vector<uint8_t> buf;
    std::vector<UniqueFd> fds;
    HCOMM_TRY(recv_msg(_ctx.peer(r).sock.get(), &buf, &fds, dl, r));
    CtrlMsg m{};
    HCOMM_TRY(meshwire::parse_ctrl(buf, fds.size(), CtrlType::segments, r, r < _rank ? 2 : 1, 0, &m));
    p.pid = m.pid;
    void* ctrl = nullptr;
    HCOMM_TRY(check_peer_memfd(fds[0].get(), sizeof(CtrlSegment), "a peer's control segment"));
    HCOMM_TRY(map_fd(fds[0].get(), sizeof(CtrlSegment), &ctrl));
    p.ctrl = static_cast<CtrlSegment*>(ctrl);
    if (p.ctrl->hdr.magic != kCtrlMagic || p.ctrl->hdr.version != kCtrlVersion || p.ctrl->hdr.rank != r ||
        p.ctrl->hdr.job_hash != _ctx.job_hash())
      return Status::error(Code::protocol_error, "rank %d: control segment does not belong to this job", r);
    ChannelLayout* c = chans[static_cast<size_t>(r)];
    if (r < _rank) {
      void* chan = nullptr;
      HCOMM_TRY(check_peer_memfd(fds[1].get(), sizeof(ChannelLayout), "a peer's channel"));
      HCOMM_TRY(map_fd(fds[1].get(), sizeof(ChannelLayout), &chan));
      c = static_cast<ChannelLayout*>(chan);
    }
    // dir[0] carries lower -> higher.
    p.tx = &c->dir[_rank < r ? 0 : 1];
    p.rx = &c->dir[_rank < r ? 1 : 0];
  }
  return Status::ok();
}

// ---- the node registry -------------------------------------------------------------------

void ShmTransport::publish(hcomm_mem& m, uint32_t fabric_index) {
  RegEntry& e = _ctrl->regs[m.slot];
  e.rights = m.access;
  e.size = m.size;
  e.addr = m.kind == MemKind::device ? m.hbm_offset : reinterpret_cast<uint64_t>(m.ptr);
  e.kind = static_cast<uint32_t>(m.kind);
  e.fabric_index = fabric_index;
  e.gen.store(m.gen, std::memory_order_release);
}

void ShmTransport::revoke(const hcomm_mem& m) {
  _ctrl->regs[m.slot].gen.store(m.gen + 1, std::memory_order_seq_cst);
  // Wait out the accesses between their look at the generation and their
  // last byte (api/mem/access_mark.h): ours, from other threads, and every
  // peer's on this host. A peer whose process is gone is not waited for; the
  // whole wait is bounded (5 s: a copy of gigabytes; docs/api.md says what
  // is left past it).
  marks_heavy_barrier();
  const Deadline dl = Deadline::after_ms(5000);
  for (int r = 0; r < _ctx.size(); ++r) {
    const CtrlSegment* s = seg(r);
    if (s == nullptr) continue;
    for (uint32_t round = 1; marks_name(s->marks, _rank); ++round) {
      if ((round & 1023) == 0) {
        if (r != _rank && ::kill(pid(r), 0) != 0 && errno == ESRCH) break;
        if (dl.expired()) return;
        _ctx.acknowledge_all();  // a peer's release over RDMA may be what that access waits for
        std::this_thread::yield();
      }
      cpu_relax();
    }
  }
}

Status ShmTransport::check_entry(int peer, const RkeyHeader& h) const {
  const CtrlSegment* s = seg(peer);
  if (s == nullptr) return Status::error(Code::unsupported, "rank %d is not on this host", peer);
  const RegEntry& e = s->regs[h.slot];
  uint32_t gen = e.gen.load(std::memory_order_acquire);
  if (gen != h.gen || (gen & 1u) == 0)
    return Status::error(Code::access_denied, "rkey_import: key of rank %d is revoked or stale (slot %u)", peer, h.slot);
  if (e.size != h.size || e.addr != h.addr || e.kind != h.kind || (h.rights & ~e.rights) != 0)
    return Status::error(Code::access_denied, "rkey_import: key does not match rank %d's registration (forged?)", peer);
  return Status::ok();
}

Status ShmTransport::live(int peer, uint32_t slot, uint32_t gen) const {
  if (seg(peer)->regs[slot].gen.load(std::memory_order_seq_cst) != gen)  // (after the access mark: api/mem/access_mark.h)
    return Status::error(Code::access_denied, "the key was revoked by rank %d", peer);
  return Status::ok();
}

bool ShmTransport::synth_key(int peer, uint32_t slot, uint32_t gen, std::vector<uint8_t>* key) const {
  const CtrlSegment* s = seg(peer);
  if (s == nullptr || slot >= kMaxRegs) return false;
  const RegEntry& e = s->regs[slot];
  if (e.gen.load(std::memory_order_acquire) != gen || (gen & 1u) == 0) return false;
  RkeyHeader h{kRkeyMagic, kRkeyVersion, static_cast<uint8_t>(e.kind), 0, peer, slot, gen, e.rights, e.size,
               e.addr, _ctx.job_hash()};
  // The sections every same-host transport would have written: shm for
  // memfd memory, npu (with the owner's fabric index) for what a device maps.
  std::vector<uint8_t> secs;
  auto add = [&](TransportId id, const void* data, uint8_t len) {
    secs.push_back(static_cast<uint8_t>(id));
    secs.push_back(len);
    secs.insert(secs.end(), static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + len);
    ++h.nsections;
  };
  if (e.kind == static_cast<uint32_t>(MemKind::host_alloc)) add(TransportId::shm, nullptr, 0);
  add(TransportId::npu, &e.fabric_index, sizeof e.fabric_index);
  if (e.kind != static_cast<uint32_t>(MemKind::device)) add(TransportId::cma, nullptr, 0);
  key->resize(sizeof h);
  std::memcpy(key->data(), &h, sizeof h);
  key->insert(key->end(), secs.begin(), secs.end());
  return true;
}

Status ShmTransport::lock_stripe(int peer, uint32_t slot, const Deadline& dl, pthread_mutex_t** out) {
  pthread_mutex_t* m = &seg(peer)->locks[slot % kLockStripes];
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  int64_t ns = ts.tv_nsec + int64_t{std::max(dl.remaining_ms(), 1)} * 1000000;
  ts.tv_sec += static_cast<time_t>(ns / 1000000000);
  ts.tv_nsec = static_cast<long>(ns % 1000000000);
  int rc = pthread_mutex_timedlock(m, &ts);
  if (rc == EOWNERDEAD) {
    // A rank died inside an accumulate: its partial update stays, the lock lives on.
    pthread_mutex_consistent(m);
    rc = 0;
  }
  if (rc == ETIMEDOUT) return Status::error(Code::timeout, "accumulate lock of rank %d busy until the deadline", peer);
  if (rc != 0) return Status::from_errno(rc, "pthread_mutex_timedlock");
  *out = m;
  return Status::ok();
}

// ---- memory ---------------------------------------------------------------------------------

// Hand the memfd of host_alloc memory to every same-host peer now, so that a
// key the user ships later (by any route) finds the fd already queued there.
void ShmTransport::advertise(const hcomm_mem& m) {
  CtrlMsg msg{static_cast<uint32_t>(CtrlType::advert), _rank, static_cast<int32_t>(::getpid()), m.slot, m.gen, 1};
  int fd = m.buf.fd();
  for (int r = 0; r < _ctx.size(); ++r) {
    Peer& p = _ctx.peer(r);
    if (r == _rank || !p.alive || !p.same_host) continue;
    Status st = send_msg(p.sock.get(), &msg, sizeof msg, {&fd, 1}, Deadline::after_ms(5000), r);
    if (!st) _sink.on_peer_failed(r, st.message());
  }
}

Status ShmTransport::mem_add(hcomm_mem& m) {
  if (m.kind == MemKind::host_alloc) advertise(m);
  return Status::ok();
}

void ShmTransport::on_advert(int peer, uint32_t slot, uint32_t gen, UniqueFd fd) {
  auto& adverts = _peers[static_cast<size_t>(peer)].adverts;
  // A new generation of a slot replaces the old one's fd (mappings made from
  // it stay valid without it).
  adverts.erase(adverts.lower_bound(uint64_t{slot} << 32), adverts.lower_bound(uint64_t{slot + 1} << 32));
  adverts[(uint64_t{slot} << 32) | gen] = std::move(fd);
}

Status ShmTransport::await_advert(int peer, uint32_t slot, uint32_t gen, const Deadline& dl, int* fd) {
  const uint64_t key = (uint64_t{slot} << 32) | gen;
  Peer& p = _ctx.peer(peer);
  for (;;) {
    auto& adverts = _peers[static_cast<size_t>(peer)].adverts;
    if (auto it = adverts.find(key); it != adverts.end()) {
      *fd = it->second.get();
      return Status::ok();
    }
    if (!p.alive) return Status(Code::peer_failure, p.why_dead);
    if (dl.expired())
      return Status::error(Code::timeout, "rank %d never advertised the memory of key slot %u", peer, slot);
    HCOMM_TRY(_ctx.pump_control(p, Deadline::after_ms(std::min(dl.remaining_ms(), 10))));
  }
}

bool ShmTransport::pack(const hcomm_mem& m, uint8_t* /*sec*/, size_t* len) const {
  *len = 0;  // the header's slot and generation name the advertised memfd
  return m.kind == MemKind::host_alloc;
}

Status ShmTransport::import(hcomm_rkey& k, const uint8_t* /*sec*/, size_t len) {
  if (len != 0) return Status::error(Code::protocol_error, "rkey_import: shm section of %zu bytes", len);
  return attach(k, nullptr);
}

Status ShmTransport::attach(hcomm_rkey& k, int* fd_out) {
  if (static_cast<MemKind>(k.h.kind) != MemKind::host_alloc)
    return Status::error(Code::protocol_error, "rkey_import: shm section on memory that is not hcomm memory");
  if (k.peer == _rank) {
    hcomm_mem* m = _ctx.mem_at_slot(k.h.slot);
    if (m == nullptr) return Status::error(Code::access_denied, "rkey_import: own registration vanished");
    k.mapped = m->ptr;  // borrowed, not unmapped
    if (fd_out != nullptr) *fd_out = m->buf.fd();
    return Status::ok();
  }
  int fd = -1;
  HCOMM_TRY(await_advert(k.peer, k.h.slot, k.h.gen, Deadline::after_ms(5000), &fd));
  // The size comes from the owner's table; the file must hold it, and keep it.
  HCOMM_TRY(check_peer_memfd(fd, k.h.size, "rkey_import: the peer's memory"));
  void* p = ::mmap(nullptr, k.h.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return Status::from_errno(errno, "rkey_import: mmap of the peer's memory");
  k.mapped = static_cast<uint8_t*>(p);
  k.mapped_len = k.h.size;
  if (fd_out != nullptr) *fd_out = fd;
  return Status::ok();
}

Status ShmTransport::unimport(hcomm_rkey& k) {
  if (k.mapped_len > 0) ::munmap(k.mapped, k.mapped_len);
  k.mapped = nullptr;
  k.mapped_len = 0;
  return Status::ok();
}

// ---- one-sided: the initiating CPU moves the bytes, once; complete at return --------------

Status ShmTransport::rma(const RmaOp& a, const std::shared_ptr<Request>& /*r*/) {
  hcomm_rkey& k = *a.rkey;
  uint8_t* target = k.mapped + a.roff;
  if (cpu_rma(target, a)) return Status::ok();  // put, get, fetch atomics
  switch (a.op) {
    case Rma::notify:
      // The data before it is in place (its copy returned); publish the word
      // with release so a waiter that sees it sees the data.
      std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(target)).store(a.operand, std::memory_order_release);
      return Status::ok();
    case Rma::acc: {
      // One atomicity agent per memory: every rank's accumulate on it takes
      // the owner's lock for the registration's stripe.
      const auto dt = static_cast<abi::DType>(a.dtype);
      pthread_mutex_t* lk = nullptr;
      HCOMM_TRY(lock_stripe(k.peer, k.h.slot, Deadline::after_ms(30000), &lk));
      abi::reduce(dt, static_cast<abi::RedOp>(a.redop), target, a.local, a.len / abi::dtype_size(dt));
      pthread_mutex_unlock(lk);
      return Status::ok();
    }
    default: break;
  }
  return Status::error(Code::invalid_argument, "shm: unknown operation");
}

// ---- messaging ------------------------------------------------------------------------------

bool ShmTransport::am_send(int peer, const MsgHdr& h, const void* payload, size_t len) {
  ShmPeer& sp = _peers[static_cast<size_t>(peer)];
  // One writer per peer stream at a time: the eager fast path calls us
  // without the context lock (Caps::am_concurrent).
  TxLock& l = _tx_locks[static_cast<size_t>(peer)];
  while (l.held.exchange(true, std::memory_order_acquire)) {
    while (l.held.load(std::memory_order_relaxed)) cpu_relax();
  }
  struct Release {
    TxLock& l;
    ~Release() { l.held.store(false, std::memory_order_release); }
  } release{l};
  Slot& s = sp.tx->slots[sp.tx_pos % kSlots];
  // Free for message #tx_pos once the consumer handed it back.
  if (s.line.seq.load(std::memory_order_acquire) != sp.tx_pos) return false;
  if (h.type == static_cast<uint32_t>(MsgType::eager) && len <= kInlineMax) {
    s.line.form = kFormInline | static_cast<uint32_t>(len);
    s.line.tag = h.tag;
    if (len > 0) std::memcpy(s.line.data, payload, len);
  } else {
    s.line.form = kFormFull;
    std::memcpy(s.body, &h, sizeof h);
    if (len > 0) std::memcpy(s.body + sizeof h, payload, len);
  }
  s.line.seq.store(sp.tx_pos + 1, std::memory_order_release);
  ++sp.tx_pos;
  return true;
}

void ShmTransport::progress() {
  for (int r = 0; r < _ctx.size(); ++r) {
    ShmPeer& sp = _peers[static_cast<size_t>(r)];
    Peer& p = _ctx.peer(r);
    if (r == _rank || !p.alive || sp.rx == nullptr || p.am != this) continue;
    // Inbound: consume what is published, in order, at most one ring's worth
    // per call (a producer that refills as fast as we drain, or a hostile one
    // re-arming slots, must not keep progress here).
    for (uint32_t budget = kSlots; budget > 0 && p.alive; --budget) {
      Slot& s = sp.rx->slots[sp.rx_pos % kSlots];
      const uint32_t seq = s.line.seq.load(std::memory_order_acquire);
      if (seq == sp.rx_pos) break;  // not written yet
      if (seq != sp.rx_pos + 1) {
        _sink.on_peer_failed(r, "corrupt channel sequence word");
        break;
      }
      // Copy the header the peer wrote once, then validate the copy (the
      // payload is read in place: only its bytes, never a length, come from it).
      // An inline slot is a valid eager message by construction.
      const uint32_t form = s.line.form;
      MsgHdr h{};
      const uint8_t* payload = nullptr;
      const uint32_t pos = sp.rx_pos++;
      if ((form & ~0xffffu) == kFormInline && (form & 0xffffu) <= kInlineMax) {
        h.type = static_cast<uint32_t>(MsgType::eager);
        h.len = form & 0xffffu;
        h.total = h.len;
        h.tag = s.line.tag;
        h.src_slot = kNoSlot;
        payload = s.line.data;
      } else {
        std::string why;
        bool ok = form == kFormFull;
        if (ok) {
          std::memcpy(&h, s.body, sizeof h);
          payload = s.body + sizeof h;
          // A full slot has no length of its own: the header's len is the payload.
          ok = am_header_ok(h, kBodyInHeader, kEagerMax, &why);
        } else {
          why = "slot form " + std::to_string(form);
        }
        if (!ok) {
          s.line.seq.store(pos + kSlots, std::memory_order_release);
          _sink.on_peer_failed(r, "garbled channel message (" + why + ")");
          break;
        }
      }
      _sink.on_am(r, h, payload);
      s.line.seq.store(pos + kSlots, std::memory_order_release);
    }
  }
}

}  // namespace hcomm::api
