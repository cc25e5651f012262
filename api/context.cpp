// The context: bootstrap, peers, channels, progress, failure handling, and
// two-sided messaging. Memory and one-sided operations are in memory.cpp and
// rma.cpp.
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <thread>

#include "api/internal.h"
#include "api/wireup/mesh.h"
#include "common/barrier.h"
#include "common/paths.h"
#include "driver/discover.h"

namespace hcomm::api {

namespace {

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

bool tag_match(uint64_t msg_tag, uint64_t tag, uint64_t mask) { return (msg_tag & mask) == (tag & mask); }

}  // namespace

hcomm_status_t to_hcomm(Code c) {
  switch (c) {
    case Code::ok: return HCOMM_OK;
    case Code::in_progress: return HCOMM_IN_PROGRESS;
    case Code::no_resource: return HCOMM_ERR_NO_RESOURCE;
    case Code::invalid_argument: return HCOMM_ERR_INVALID;
    case Code::not_found: return HCOMM_ERR_NOT_FOUND;
    case Code::io_error: return HCOMM_ERR_IO;
    case Code::protocol_error: return HCOMM_ERR_PROTOCOL;
    case Code::timeout: return HCOMM_ERR_TIMEOUT;
    case Code::device_error: return HCOMM_ERR_DEVICE;
    case Code::access_denied: return HCOMM_ERR_ACCESS;
    case Code::out_of_range: return HCOMM_ERR_OUT_OF_RANGE;
    case Code::unsupported: return HCOMM_ERR_UNSUPPORTED;
    case Code::peer_failure: return HCOMM_ERR_PEER_FAILURE;
    case Code::closed: return HCOMM_ERR_CLOSED;
  }
  return HCOMM_ERR_IO;
}

Code from_hcomm(hcomm_status_t s) {
  switch (s) {
    case HCOMM_OK: return Code::ok;
    case HCOMM_IN_PROGRESS: return Code::in_progress;
    case HCOMM_ERR_NO_RESOURCE: return Code::no_resource;
    case HCOMM_ERR_INVALID: return Code::invalid_argument;
    case HCOMM_ERR_NOT_FOUND: return Code::not_found;
    case HCOMM_ERR_PROTOCOL: return Code::protocol_error;
    case HCOMM_ERR_TIMEOUT: return Code::timeout;
    case HCOMM_ERR_DEVICE: return Code::device_error;
    case HCOMM_ERR_ACCESS: return Code::access_denied;
    case HCOMM_ERR_OUT_OF_RANGE: return Code::out_of_range;
    case HCOMM_ERR_UNSUPPORTED: return Code::unsupported;
    case HCOMM_ERR_PEER_FAILURE: return Code::peer_failure;
    case HCOMM_ERR_CLOSED: return Code::closed;
    default: return Code::io_error;
  }
}

Status Context::create(const hcomm_config_t& cfg, std::unique_ptr<Context>* out) {
  std::unique_ptr<Context> c(new Context());
  HCOMM_TRY(c->init(cfg));
  *out = std::move(c);
  return Status::ok();
}

Status Context::init(const hcomm_config_t& cfg) {
  LaunchInfo li;
  HCOMM_TRY(detect_launch(&li));
  // Every peer's hcomm_mem_alloc hands us one memfd: lift the soft fd limit
  // to the hard one so a few thousand registrations across ranks fit.
  if (rlimit rl{}; ::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    (void)::setrlimit(RLIMIT_NOFILE, &rl);
  }
  const int timeout_ms = cfg.bootstrap_timeout_ms > 0 ? cfg.bootstrap_timeout_ms : 30000;
  _peer_check = std::chrono::milliseconds(cfg.peer_check_ms > 0 ? cfg.peer_check_ms : 1);
  if (const char* e = std::getenv("HCOMM_PEER_CHECK_MS"); e != nullptr && *e != '\0') {
    char* end = nullptr;
    long v = std::strtol(e, &end, 10);
    if (*end != '\0' || v < 1 || v > 60000)
      return Status::error(Code::invalid_argument, "HCOMM_PEER_CHECK_MS='%s': use 1..60000", e);
    _peer_check = std::chrono::milliseconds(v);
  }
  HCOMM_TRY(Bootstrap::create(li, timeout_ms, &_boot));
  _rank = _boot->rank();
  _size = _boot->size();
  _local_rank = li.local_rank;
  _job_hash = fnv1a(_boot->job_id() + "/" + std::to_string(_size));
  Deadline dl = Deadline::after_ms(timeout_ms);

  // Our control segment: the registration table peers validate keys against.
  int fd = ::memfd_create("hcomm-ctrl", MFD_CLOEXEC);
  if (fd < 0) return Status::from_errno(errno, "memfd_create(ctrl)");
  _ctrl_fd.reset(fd);
  if (::ftruncate(fd, sizeof(CtrlSegment)) != 0) return Status::from_errno(errno, "ftruncate(ctrl)");
  void* p = ::mmap(nullptr, sizeof(CtrlSegment), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return Status::from_errno(errno, "mmap(ctrl)");
  _maps.emplace_back(p, sizeof(CtrlSegment));
  _ctrl = static_cast<CtrlSegment*>(p);
  _ctrl->hdr = CtrlHeader{kCtrlMagic, kCtrlVersion, _rank, static_cast<int32_t>(::getpid()), _job_hash, kMaxRegs,
                          kLockStripes};
  pthread_mutexattr_t ma;
  pthread_mutexattr_init(&ma);
  pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&ma, PTHREAD_MUTEX_ROBUST);
  for (auto& m : _ctrl->locks) pthread_mutex_init(&m, &ma);
  pthread_mutexattr_destroy(&ma);
  _mems.assign(kMaxRegs, nullptr);

  std::vector<UniqueFd> socks;
  HCOMM_TRY(connect_mesh(*_boot, dl, &socks));
  _peers.resize(_size);
  for (int r = 0; r < _size; ++r) {
    _peers[r].rank = r;
    if (r != _rank) _peers[r].sock = std::move(socks[r]);
  }
  HCOMM_TRY(exchange_segments(dl));

  // Engine choice: explicit config, then HCOMM_ENGINE, then a reachable NPU.
  hcomm_engine_t engine = cfg.engine;
  if (engine == HCOMM_ENGINE_AUTO) {
    if (const char* e = std::getenv("HCOMM_ENGINE"); e != nullptr && *e != '\0') {
      std::string v = e;
      if (v == "host") engine = HCOMM_ENGINE_HOST;
      else if (v == "npu") engine = HCOMM_ENGINE_NPU;
      else if (v != "auto")
        return Status::error(Code::invalid_argument, "HCOMM_ENGINE='%s': use host, npu or auto", e);
    }
  }
  if (engine == HCOMM_ENGINE_AUTO) {
    std::string dev = cfg.device != nullptr ? cfg.device : "";
    bool have = !dev.empty() || ::access(sim_socket_path(default_sim_dir(), _local_rank).c_str(), F_OK) == 0;
    engine = have ? HCOMM_ENGINE_NPU : HCOMM_ENGINE_HOST;
  }
  if (engine == HCOMM_ENGINE_NPU) HCOMM_TRY(init_npu(cfg, li));
  // Every rank's segments are mapped and its engine is up before anyone
  // sends: a barrier, so the first message never meets a half-built peer.
  return _boot->barrier(dl);
}

Status Context::init_npu(const hcomm_config_t& cfg, const LaunchInfo& li) {
  std::string name = cfg.device != nullptr ? cfg.device : "";
  if (name.empty()) {
    if (const char* d = std::getenv("HCOMM_DEVICE"); d != nullptr && *d != '\0') {
      // One name, or a comma-separated list indexed by local rank (a job's
      // ranks on one host share the environment).
      std::vector<std::string> names;
      std::string all = d;
      for (size_t pos = 0; pos <= all.size();) {
        size_t c = all.find(',', pos);
        if (c == std::string::npos) c = all.size();
        names.push_back(all.substr(pos, c - pos));
        pos = c + 1;
      }
      if (names.size() == 1) {
        name = names[0];
      } else if (li.local_rank < static_cast<int>(names.size()) && !names[li.local_rank].empty()) {
        name = names[li.local_rank];
      } else {
        return Status::error(Code::invalid_argument, "HCOMM_DEVICE='%s' names no device for local rank %d", d,
                             li.local_rank);
      }
    } else {
      name = "sim:" + std::to_string(li.local_rank);
    }
  }
  driver::DeviceRef ref;
  HCOMM_TRY(driver::parse_device_name(name, default_sim_dir(), &ref));
  std::unique_ptr<driver::Link> link;
  Status st = driver::open_link(ref, &link, 5000);
  if (!st)
    return Status(st.code(), "NPU engine: cannot open " + ref.name() + ": " + st.message() +
                                 " (start hcomm-sim, or run with HCOMM_ENGINE=host)");
  HCOMM_TRY(hal::npu::Device::open(std::move(link), &_dev));
  HCOMM_TRY(_dev->create_queue(std::min<uint32_t>(10, _dev->info().max_queue_log2), false, &_q));
  HCOMM_TRY(driver::DmaBuffer::allocate(4096, -1, &_scratch));
  HCOMM_TRY(_dev->map_buffer(_scratch, hal::npu::access::RW, &_scratch_map));
  for (uint32_t i = 0; i < 4096 / 8; ++i) _scratch_free.push_back(i);
  _hbm_free[0] = _dev->info().hbm_size;
  return Status::ok();
}

// Each rank sends every peer its control segment and, for pairs where it is
// the lower rank, the pair's channel memory; then maps what it received.
Status Context::exchange_segments(const Deadline& dl) {
  std::vector<UniqueFd> chan_fds(_size);
  for (int r = _rank + 1; r < _size; ++r) {
    int fd = ::memfd_create("hcomm-chan", MFD_CLOEXEC);
    if (fd < 0) return Status::from_errno(errno, "memfd_create(channel)");
    chan_fds[r].reset(fd);
    if (::ftruncate(fd, sizeof(ChannelLayout)) != 0) return Status::from_errno(errno, "ftruncate(channel)");
  }
  for (int r = 0; r < _size; ++r) {
    if (r == _rank) continue;
    MeshMsg m{static_cast<uint32_t>(MeshType::segments), _rank, static_cast<int32_t>(::getpid()), 0, 0, 0};
    std::vector<int> fds = {_ctrl_fd.get()};
    if (r > _rank) fds.push_back(chan_fds[r].get());
    m.nfds = static_cast<uint32_t>(fds.size());
    HCOMM_TRY(send_msg(_peers[r].sock.get(), &m, sizeof m, fds, dl, r));
  }
  auto map_fd = [&](int fd, size_t len, void** out) -> Status {
    void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return Status::from_errno(errno, "mmap(peer segment)");
    _maps.emplace_back(p, len);
    *out = p;
    return Status::ok();
  };
  for (int r = 0; r < _size; ++r) {
    if (r == _rank) continue;
    Peer& p = _peers[r];
    std::vector<uint8_t> buf;
    std::vector<UniqueFd> fds;
    HCOMM_TRY(recv_msg(p.sock.get(), &buf, &fds, dl, r));
    MeshMsg m{};
    const size_t want_fds = r < _rank ? 2 : 1;
    if (buf.size() != sizeof m) return Status::error(Code::protocol_error, "rank %d: bad segment message", r);
    std::memcpy(&m, buf.data(), sizeof m);
    if (m.type != static_cast<uint32_t>(MeshType::segments) || m.rank != r || fds.size() != want_fds)
      return Status::error(Code::protocol_error, "rank %d: unexpected first message (type %u, %zu fds)", r, m.type,
                           fds.size());
    p.pid = m.pid;
    void* ctrl = nullptr;
    HCOMM_TRY(map_fd(fds[0].get(), sizeof(CtrlSegment), &ctrl));
    p.ctrl = static_cast<CtrlSegment*>(ctrl);
    if (p.ctrl->hdr.magic != kCtrlMagic || p.ctrl->hdr.version != kCtrlVersion || p.ctrl->hdr.rank != r ||
        p.ctrl->hdr.job_hash != _job_hash)
      return Status::error(Code::protocol_error, "rank %d: control segment does not belong to this job", r);
    void* chan = nullptr;
    HCOMM_TRY(map_fd(r < _rank ? fds[1].get() : chan_fds[r].get(), sizeof(ChannelLayout), &chan));
    p.chan = static_cast<ChannelLayout*>(chan);
    // dir[0] carries lower -> higher.
    p.tx = &p.chan->dir[_rank < r ? 0 : 1];
    p.rx = &p.chan->dir[_rank < r ? 1 : 0];
  }
  return Status::ok();
}

Context::~Context() {
  for (auto& [key, k] : _rndv_keys) (void)rkey_release(k);
  _rndv_keys.clear();
  _q.reset();
  if (_dev) {
    if (_scratch_map.valid()) (void)_dev->unmap(&_scratch_map);
    for (hcomm_mem* m : _mems) {
      if (m != nullptr && m->map.valid()) (void)_dev->unmap(&m->map);
    }
  }
  for (hcomm_mem* m : _mems) delete m;
  _dev.reset();
  for (auto& [p, len] : _maps) ::munmap(p, len);
}

// Control messages we owe peers (FINs that found the channel full) must go
// out before we block in a collective that makes no channel progress:
// a peer's send may be waiting on exactly that FIN.
void Context::flush_owed(const Deadline& dl) {
  while (!_fin_backlog.empty() && !dl.expired()) {
    progress();
    if (!_fin_backlog.empty()) cpu_relax();
  }
}

Status Context::barrier(const Deadline& dl) {
  if (_finalized) return Status::error(Code::closed, "context finalized");
  flush_owed(dl);
  return _boot->barrier(dl);
}

Status Context::finalize(const Deadline& dl) {
  if (_finalized) return Status::error(Code::closed, "context finalized twice");
  // Let our outstanding operations finish, then meet the others.
  Status st = flush(-1, dl);
  flush_owed(dl);
  Status b = _boot->barrier(dl);
  _finalized = true;
  return st ? b : st;
}

// ---- peers: liveness and the control plane ------------------------------------------

void Context::drain_socket(Peer& p) {
  while (p.alive) {
    std::vector<uint8_t> buf;
    std::vector<UniqueFd> fds;
    Status st = recv_msg(p.sock.get(), &buf, &fds, Deadline(std::chrono::nanoseconds(0)), p.rank);
    if (st.code() == Code::timeout) return;
    if (!st) return peer_failed(p, st.message());
    MeshMsg m{};
    if (buf.size() != sizeof m) return peer_failed(p, "malformed control message");
    std::memcpy(&m, buf.data(), sizeof m);
    if (m.type == static_cast<uint32_t>(MeshType::advert) && fds.size() == 1 && m.slot < kMaxRegs) {
      // A new generation of a slot replaces the old one's fd (mappings made
      // from it stay valid without it).
      p.adverts.erase(p.adverts.lower_bound(uint64_t{m.slot} << 32),
                      p.adverts.lower_bound(uint64_t{m.slot + 1} << 32));
      p.adverts[(uint64_t{m.slot} << 32) | m.gen] = std::move(fds[0]);
    } else {
      return peer_failed(p, "unexpected control message type " + std::to_string(m.type));
    }
  }
}

void Context::check_peers(bool force) {
  // Reading the clock costs ~40 ns here: look at it every 64th progress call.
  if (!force && (++_progress_calls & 63) != 0) return;
  auto now = Clock::now();
  if (!force && now - _last_check < _peer_check) return;
  _last_check = now;
  std::vector<pollfd> pfds;
  std::vector<Peer*> who;
  for (Peer& p : _peers) {
    if (p.rank == _rank || !p.alive) continue;
    pfds.push_back({p.sock.get(), POLLIN, 0});
    who.push_back(&p);
  }
  if (pfds.empty() || ::poll(pfds.data(), pfds.size(), 0) <= 0) return;
  for (size_t i = 0; i < pfds.size(); ++i) {
    if (pfds[i].revents & POLLIN) drain_socket(*who[i]);
    if (who[i]->alive && (pfds[i].revents & (POLLHUP | POLLERR)))
      peer_failed(*who[i], "connection closed (process exited or was killed)");
  }
}

void Context::peer_failed(Peer& p, const std::string& why) {
  if (!p.alive) return;
  p.alive = false;
  p.why_dead = "rank " + std::to_string(p.rank) + ": " + why;
  for (auto& r : p.backlog) complete(*r, HCOMM_ERR_PEER_FAILURE, p.why_dead);
  p.backlog.clear();
  for (auto it = _pending_sends.begin(); it != _pending_sends.end();) {
    if (it->second->peer == p.rank) {
      complete(*it->second, HCOMM_ERR_PEER_FAILURE, p.why_dead);
      it = _pending_sends.erase(it);
    } else {
      ++it;
    }
  }
  bool anyone = false;
  for (const Peer& q : _peers) anyone |= q.rank != _rank && q.alive;
  for (auto it = _posted.begin(); it != _posted.end();) {
    if ((*it)->peer == p.rank || ((*it)->peer == HCOMM_ANY_SOURCE && !anyone)) {
      complete(**it, HCOMM_ERR_PEER_FAILURE, p.why_dead);
      it = _posted.erase(it);
    } else {
      ++it;
    }
  }
}

Status Context::await_advert(Peer& p, uint32_t slot, uint32_t gen, const Deadline& dl, int* fd) {
  const uint64_t key = (uint64_t{slot} << 32) | gen;
  for (;;) {
    if (auto it = p.adverts.find(key); it != p.adverts.end()) {
      *fd = it->second.get();
      return Status::ok();
    }
    if (!p.alive) return Status(Code::peer_failure, p.why_dead);
    if (dl.expired())
      return Status::error(Code::timeout, "rank %d never advertised the memory of key slot %u", p.rank, slot);
    pollfd pf{p.sock.get(), POLLIN, 0};
    if (::poll(&pf, 1, std::min(dl.remaining_ms(), 10)) > 0) {
      drain_socket(p);
      if (p.alive && (pf.revents & (POLLHUP | POLLERR))) peer_failed(p, "connection closed");
    }
  }
}

// ---- progress ------------------------------------------------------------------------------

void Context::complete(Request& r, hcomm_status_t st, const std::string& why) {
  if (r.done()) return;
  r.status = st;
  r.error = why;
}

void Context::progress() {
  if (_dev) reap_npu();
  for (Peer& p : _peers) {
    if (p.rank == _rank || !p.alive) continue;
    while (!p.backlog.empty() && try_send(p, p.backlog.front())) p.backlog.pop_front();
    // Inbound: consume every published slot.
    RingLayout* rx = p.rx;
    uint32_t head = rx->head.v.load(std::memory_order_relaxed);
    uint32_t tail = rx->tail.v.load(std::memory_order_acquire);
    if (tail - head > kSlots) {
      peer_failed(p, "corrupt channel indices");
      continue;
    }
    while (head != tail && p.alive) {
      const uint8_t* slot = rx->slots[head % kSlots];
      MsgHdr h;
      std::memcpy(&h, slot, sizeof h);  // copy once, then validate the copy
      ++head;
      if ((h.type == static_cast<uint32_t>(MsgType::eager) && (h.len > kEagerMax || h.len != h.total)) ||
          h.type < static_cast<uint32_t>(MsgType::eager) || h.type > static_cast<uint32_t>(MsgType::fin)) {
        rx->head.v.store(head, std::memory_order_release);
        peer_failed(p, "garbled channel message (type " + std::to_string(h.type) + ")");
        break;
      }
      handle(p, h, slot + sizeof(MsgHdr));
      rx->head.v.store(head, std::memory_order_release);
    }
  }
  while (!_fin_backlog.empty()) {
    auto& [peer, h] = _fin_backlog.front();
    if (!_peers[peer].alive) {
      _fin_backlog.pop_front();
      continue;
    }
    if (!post_fin(_peers[peer], h.sreq, static_cast<hcomm_status_t>(h.status))) break;
    _fin_backlog.pop_front();
  }
  check_peers(false);
}

// Callers hold _mu. Three phases, by time waited (the clock is read every
// 64 rounds, not every round): spin on progress for 50 us (microsecond
// latencies), then yield the CPU between rounds up to 2 ms (on a busy
// machine the peer needs our core), then nap 50 us with the lock released.
bool Context::spin_wait(const std::function<bool()>& done, bool progress_each_round, const Deadline& dl) {
  if (done()) return true;
  const Clock::time_point start = Clock::now();
  for (uint32_t round = 1;; ++round) {
    if (progress_each_round || (round & 63) == 0) progress();
    if (done()) return true;
    if ((round & 63) != 0) {
      cpu_relax();
      continue;
    }
    const Clock::time_point now = Clock::now();
    if (now >= dl.at()) return false;
    const auto waited = now - start;
    if (waited < std::chrono::microseconds(50)) continue;
    _mu.unlock();
    if (waited < std::chrono::milliseconds(2)) sched_yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(50));
    _mu.lock();
  }
}

Status Context::wait(Request& r, const Deadline& dl) {
  if (spin_wait([&] { return r.done(); }, true, dl)) return Status::ok();
  return Status::error(Code::timeout, "request still in progress at the deadline");
}

// ---- two-sided -------------------------------------------------------------------------------

bool Context::try_send(Peer& p, const std::shared_ptr<Request>& rp) {
  Request& r = *rp;
  RingLayout* tx = p.tx;
  uint32_t tail = tx->tail.v.load(std::memory_order_relaxed);
  uint32_t head = tx->head.v.load(std::memory_order_acquire);
  if (tail - head >= kSlots) return false;
  uint8_t* slot = tx->slots[tail % kSlots];
  MsgHdr h{};
  h.tag = r.tag;
  h.total = r.slen;
  h.sreq = r.id;
  if (r.slen <= kEagerMax) {
    h.type = static_cast<uint32_t>(MsgType::eager);
    h.len = static_cast<uint32_t>(r.slen);
    std::memcpy(slot, &h, sizeof h);
    if (r.slen > 0) std::memcpy(slot + sizeof h, r.sbuf, r.slen);
    complete(r, HCOMM_OK);
  } else {
    // Rendezvous: the receiver pulls the payload once from our buffer; we
    // tell it where, and whether the buffer is shareable registered memory.
    h.type = static_cast<uint32_t>(MsgType::rts);
    h.addr = reinterpret_cast<uint64_t>(r.sbuf);
    h.src_slot = kNoSlot;
    if (const hcomm_mem* m = find_local(r.sbuf, r.slen); m != nullptr && m->kind == MemKind::host_alloc) {
      h.src_slot = m->slot;
      h.src_gen = m->gen;
      h.src_off = static_cast<uint64_t>(r.sbuf - m->ptr);
    }
    std::memcpy(slot, &h, sizeof h);
    r.rts_sent = true;
    _pending_sends[r.id] = rp;  // completes when the receiver's FIN arrives
  }
  tx->tail.v.store(tail + 1, std::memory_order_release);
  return true;
}

bool Context::post_fin(Peer& p, uint64_t sreq, hcomm_status_t st) {
  RingLayout* tx = p.tx;
  uint32_t tail = tx->tail.v.load(std::memory_order_relaxed);
  uint32_t head = tx->head.v.load(std::memory_order_acquire);
  if (tail - head >= kSlots) return false;  // FINs are not ordered with sends: they may overtake the backlog
  MsgHdr h{};
  h.type = static_cast<uint32_t>(MsgType::fin);
  h.sreq = sreq;
  h.status = static_cast<uint32_t>(st);
  std::memcpy(tx->slots[tail % kSlots], &h, sizeof h);
  tx->tail.v.store(tail + 1, std::memory_order_release);
  return true;
}

// The first posted receive (in posting order) that a message from `source`
// with `tag` matches, removed from the posted list; null if none.
std::shared_ptr<Request> Context::take_posted(int source, uint64_t tag) {
  for (auto it = _posted.begin(); it != _posted.end(); ++it) {
    const Request& r = **it;
    if ((r.peer == HCOMM_ANY_SOURCE || r.peer == source) && tag_match(tag, r.tag, r.tag_mask)) {
      std::shared_ptr<Request> keep = std::move(*it);
      _posted.erase(it);
      return keep;
    }
  }
  return nullptr;
}

void Context::handle(Peer& p, const MsgHdr& h, const uint8_t* payload) {
  if (h.type == static_cast<uint32_t>(MsgType::fin)) {
    auto it = _pending_sends.find(h.sreq);
    if (it == _pending_sends.end()) return peer_failed(p, "FIN for an unknown send");
    hcomm_status_t st = static_cast<hcomm_status_t>(h.status);
    complete(*it->second, st == HCOMM_OK ? HCOMM_OK : HCOMM_ERR_PEER_FAILURE,
             st == HCOMM_OK ? "" : "receiver could not pull the payload: " + std::string(hcomm_strerror(st)));
    _pending_sends.erase(it);
    return;
  }
  if (std::shared_ptr<Request> r = take_posted(p.rank, h.tag)) {
    deliver(*r, p.rank, h, payload);
    return;
  }
  Unexpected u{p.rank, h, {}};
  if (h.type == static_cast<uint32_t>(MsgType::eager)) u.payload.assign(payload, payload + h.len);
  _unexpected.push_back(std::move(u));
}

void Context::deliver(Request& r, int source, const MsgHdr& h, const uint8_t* payload) {
  r.info = {source, h.tag, static_cast<size_t>(h.total)};
  if (h.type == static_cast<uint32_t>(MsgType::eager)) {
    size_t n = std::min<size_t>(h.len, r.rlen);
    if (n > 0) std::memcpy(r.rbuf, payload, n);
    complete(r, h.total > r.rlen ? HCOMM_ERR_TRUNCATED : HCOMM_OK,
             h.total > r.rlen ? "message of " + std::to_string(h.total) + " bytes, buffer of " + std::to_string(r.rlen)
                              : "");
    return;
  }
  pull(r, source, h);
}

// The sender's registration, imported once and cached while its generation
// stays the same (a rendezvous per message must not pay an mmap / ATT write).
hcomm_rkey* Context::rendezvous_key(int source, uint32_t slot, uint32_t gen) {
  if (slot >= kMaxRegs) return nullptr;
  const RegEntry& e = _peers[source].ctrl->regs[slot];
  if (e.gen.load(std::memory_order_acquire) != gen || (gen & 1u) == 0) return nullptr;
  const uint64_t key = (uint64_t{static_cast<uint32_t>(source)} << 32) | slot;
  if (auto it = _rndv_keys.find(key); it != _rndv_keys.end()) {
    if (it->second->w.gen == gen) return it->second;
    (void)rkey_release(it->second);  // the sender re-registered the slot
    _rndv_keys.erase(it);
  }
  RkeyWire w{kRkeyMagic, kRkeyVersion, static_cast<uint16_t>(e.kind), source, slot, gen, e.rights, e.size,
             e.addr, _job_hash, e.fabric_index, 0};
  hcomm_rkey* k = nullptr;
  if (!rkey_import(source, &w, sizeof w, &k)) return nullptr;
  _rndv_keys[key] = k;
  return k;
}

// Rendezvous: move the payload once, straight from the sender's buffer into
// the receive buffer, then tell the sender (FIN).
void Context::pull(Request& r, int source, const MsgHdr& h) {
  Peer& p = _peers[source];
  const size_t n = std::min<size_t>(h.total, r.rlen);
  hcomm_status_t st = HCOMM_OK;
  std::string why;
  bool moved = false;
  if (n > 0 && h.src_slot != kNoSlot && h.src_slot < kMaxRegs) {
    // The sender's buffer is registered shareable memory: use the engine.
    hcomm_rkey* k = rendezvous_key(source, h.src_slot, h.src_gen);
    if (k != nullptr && h.src_off <= k->w.size && n <= k->w.size - h.src_off) {
      const hcomm_mem* local = find_local(r.rbuf, n);
      if (!_dev) {
        std::memcpy(r.rbuf, k->mapped + h.src_off, n);
        moved = true;
      } else if (local != nullptr && local->map.valid()) {
        // Synchronous DMA inside progress: reap this queue only (no
        // recursion into progress, the context lock stays held).
        RmaArgs a;
        a.op = Rma::get;
        a.local = r.rbuf;
        a.len = n;
        a.rkey = k;
        a.roff = h.src_off;
        std::shared_ptr<Request> g;
        Status gs = rma(a, &g);
        Deadline gdl = Deadline::after_ms(30000);
        while (gs && !g->done() && !gdl.expired()) {
          reap_npu();
          cpu_relax();
        }
        if (gs && g->status == HCOMM_OK) moved = true;
      }
    }
  }
  if (!moved && n > 0) {
    // Any other buffer: the kernel's single copy out of the sender's memory.
    // A failure other than the sender vanishing means it sent a bad address.
    Status cs = cma(p.pid, r.rbuf, h.addr, n, false);
    if (!cs) {
      st = cs.code() == Code::peer_failure ? HCOMM_ERR_PEER_FAILURE : HCOMM_ERR_PROTOCOL;
      why = "rendezvous pull from rank " + std::to_string(source) + ": " + cs.message();
    }
  }
  if (!post_fin(p, h.sreq, st)) {
    MsgHdr f{};
    f.sreq = h.sreq;
    f.status = static_cast<uint32_t>(st);
    _fin_backlog.emplace_back(source, f);
  }
  if (st == HCOMM_OK && h.total > r.rlen) {
    st = HCOMM_ERR_TRUNCATED;
    why = "message of " + std::to_string(h.total) + " bytes, buffer of " + std::to_string(r.rlen);
  }
  complete(r, st, why);
}

Status Context::isend(int dest, const void* buf, size_t len, uint64_t tag, std::shared_ptr<Request>* out) {
  if (dest < 0 || dest >= _size) return Status::error(Code::invalid_argument, "destination rank %d of %d", dest, _size);
  if (buf == nullptr && len > 0) return Status::error(Code::invalid_argument, "null send buffer");
  auto r = std::make_shared<Request>();
  r->kind = Request::Kind::send;
  r->peer = dest;
  r->id = _next_id++;
  r->sbuf = static_cast<const uint8_t*>(buf);
  r->slen = len;
  r->tag = tag;
  *out = r;
  if (dest == _rank) {
    // To ourselves: match like any other message, copying directly.
    if (std::shared_ptr<Request> q = take_posted(_rank, tag)) {
      size_t n = std::min(len, q->rlen);
      if (n > 0) std::memcpy(q->rbuf, buf, n);
      q->info = {_rank, tag, len};
      complete(*q, len > q->rlen ? HCOMM_ERR_TRUNCATED : HCOMM_OK);
      complete(*r, HCOMM_OK);
      return Status::ok();
    }
    MsgHdr h{};
    h.type = static_cast<uint32_t>(MsgType::eager);
    h.tag = tag;
    h.total = len;
    h.len = static_cast<uint32_t>(std::min<size_t>(len, UINT32_MAX));
    Unexpected u{_rank, h, {}};
    u.payload.assign(r->sbuf, r->sbuf + len);
    _unexpected.push_back(std::move(u));
    complete(*r, HCOMM_OK);
    return Status::ok();
  }
  Peer& p = _peers[dest];
  if (!p.alive) return Status(Code::peer_failure, p.why_dead);
  // In order behind anything already queued for this peer.
  if (!p.backlog.empty() || !try_send(p, r)) p.backlog.push_back(r);
  return Status::ok();
}

Status Context::irecv(int source, void* buf, size_t len, uint64_t tag, uint64_t mask,
                      std::shared_ptr<Request>* out) {
  if (source != HCOMM_ANY_SOURCE && (source < 0 || source >= _size))
    return Status::error(Code::invalid_argument, "source rank %d of %d", source, _size);
  if (buf == nullptr && len > 0) return Status::error(Code::invalid_argument, "null receive buffer");
  auto r = std::make_shared<Request>();
  r->kind = Request::Kind::recv;
  r->peer = source;
  r->id = _next_id++;
  r->rbuf = static_cast<uint8_t*>(buf);
  r->rlen = len;
  r->tag = tag;
  r->tag_mask = mask;
  *out = r;
  progress();  // pull in what has arrived so the unexpected queue is current
  for (auto it = _unexpected.begin(); it != _unexpected.end(); ++it) {
    if ((source == HCOMM_ANY_SOURCE || source == it->source) && tag_match(it->hdr.tag, tag, mask)) {
      Unexpected u = std::move(*it);
      _unexpected.erase(it);
      deliver(*r, u.source, u.hdr, u.payload.data());
      return Status::ok();
    }
  }
  if (source != HCOMM_ANY_SOURCE && source != _rank && !_peers[source].alive)
    return Status(Code::peer_failure, _peers[source].why_dead);
  _posted.push_back(r);
  return Status::ok();
}

Status Context::probe(int source, uint64_t tag, uint64_t mask, bool* found, hcomm_recv_info_t* info) {
  if (source != HCOMM_ANY_SOURCE && (source < 0 || source >= _size))
    return Status::error(Code::invalid_argument, "source rank %d of %d", source, _size);
  progress();
  *found = false;
  for (const Unexpected& u : _unexpected) {
    if ((source == HCOMM_ANY_SOURCE || source == u.source) && tag_match(u.hdr.tag, tag, mask)) {
      *found = true;
      if (info != nullptr) *info = {u.source, u.hdr.tag, static_cast<size_t>(u.hdr.total)};
      return Status::ok();
    }
  }
  if (source != HCOMM_ANY_SOURCE && source != _rank && !_peers[source].alive)
    return Status(Code::peer_failure, _peers[source].why_dead);
  return Status::ok();
}

}  // namespace hcomm::api
