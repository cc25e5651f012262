// The context: bootstrap, peers, transports and lanes, progress, failure.
#include "api/core/context.h"

#include "hcomm_config.h"

#include <poll.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstring>
#include <random>
#include <thread>
#include <utility>

#include "api/transport/cma/cma.h"
#include "api/transport/npu/npu.h"
#include "api/transport/npu_roce/npu_roce.h"
#include "api/transport/shm/shm.h"
#if HCOMM_HAVE_IBVERBS
#include "api/transport/verbs/verbs.h"
#endif
#include "api/wireup/kv_store.h"
#include "api/wireup/mesh.h"
#include "common/barrier.h"
#include "common/env.h"
#include "common/paths.h"

namespace hcomm::api {

namespace {

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  for (size_t pos = 0; pos <= s.size();) {
    size_t c = s.find(sep, pos);
    if (c == std::string::npos) c = s.size();
    out.push_back(s.substr(pos, c - pos));
    pos = c + 1;
  }
  return out;
}

}  // namespace

const char* transport_name(TransportId id) {
  switch (id) {
    case TransportId::shm: return "shm";
    case TransportId::cma: return "cma";
    case TransportId::npu: return "npu";
    case TransportId::verbs: return "verbs";
    case TransportId::npu_roce: return "npu_roce";
  }
  return "?";
}

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

// Fills this thread's block caches (api/core/pool.h) with what windows of up
// to kReserve small messages need at their peak (requests, posted-receive and
// unexpected-message nodes), so that such a stream allocates nothing even the
// first time it reaches a new peak.
void Context::reserve_blocks() {
  constexpr size_t kReserve = 64;
  std::vector<std::shared_ptr<Request>> reqs;
  for (size_t i = 0; i < kReserve; ++i) reqs.push_back(new_request());
  PostedList posted(kReserve);
  std::list<Unexpected, PoolAlloc<Unexpected>> unexpected(kReserve);
}  // all of it goes back to the caches here

Status Context::init(const hcomm_config_t& cfg) {
  LaunchInfo li;
  const bool from_store = cfg.store != nullptr;
  if (from_store) {
    // Started by a framework that already knows the job (torch.distributed):
    // rank and size from the config, the exchange through its store.
    if (cfg.store->set == nullptr || cfg.store->get == nullptr)
      return Status::error(Code::invalid_argument, "hcomm_config_t.store: set and get callbacks are required");
    if (cfg.size < 1 || cfg.rank < 0 || cfg.rank >= cfg.size)
      return Status::error(Code::invalid_argument, "hcomm_config_t: rank %d / size %d with a store (need 0 <= rank < size)",
                           cfg.rank, cfg.size);
    li.rank = cfg.rank;
    li.size = cfg.size;
    li.source = "store";
    li.job_id = cfg.job_id != nullptr ? cfg.job_id : "";
    if (li.job_id.empty()) {
      // Jobs sharing a store must not share a job id (it names their keys
      // there): rank 0 draws one and publishes it through the store.
      auto kv = kv_store_from_c(*cfg.store);
      const int wait_ms = cfg.bootstrap_timeout_ms > 0 ? cfg.bootstrap_timeout_ms : 30000;
      if (li.rank == 0) {
        std::random_device rd;
        char id[40];
        std::snprintf(id, sizeof id, "s%08x%08x-%d", rd(), rd(), static_cast<int>(::getpid()));
        li.job_id = id;
        HCOMM_TRY(kv->set("hcomm/job-id", li.job_id));
      } else {
        HCOMM_TRY(kv->get("hcomm/job-id", &li.job_id, Deadline::after_ms(wait_ms)));
      }
    }
    if (const char* lr = std::getenv("LOCAL_RANK"); lr != nullptr && *lr != '\0') li.local_rank = std::atoi(lr);
  } else {
    if (cfg.rank >= 0 || cfg.size > 0)
      return Status::error(Code::invalid_argument, "hcomm_config_t: rank/size without a store (set store, or neither)");
    HCOMM_TRY(detect_launch(&li));
  }
  if (cfg.local_rank >= 0) li.local_rank = cfg.local_rank;
  // Every peer's hcomm_mem_alloc hands us one memfd: lift the soft fd limit
  // to the hard one so a few thousand registrations across ranks fit.
  if (rlimit rl{}; ::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    (void)::setrlimit(RLIMIT_NOFILE, &rl);
  }
  long boot_ms = cfg.bootstrap_timeout_ms > 0 ? cfg.bootstrap_timeout_ms : 30000;
  HCOMM_TRY(env_int("HCOMM_BOOTSTRAP_TIMEOUT_MS", 100, 3600000, &boot_ms));
  const int timeout_ms = static_cast<int>(boot_ms);
  long check_ms = cfg.peer_check_ms > 0 ? cfg.peer_check_ms : 1;
  HCOMM_TRY(env_int("HCOMM_PEER_CHECK_MS", 1, 60000, &check_ms));
  _peer_check = std::chrono::milliseconds(check_ms);
  if (from_store) HCOMM_TRY(Bootstrap::from_store(li.rank, li.size, li.job_id, kv_store_from_c(*cfg.store), timeout_ms, &_boot));
  else HCOMM_TRY(Bootstrap::create(li, timeout_ms, &_boot));
  _rank = _boot->rank();
  _size = _boot->size();
  _local_rank = li.local_rank;
  _job_hash = fnv1a(_boot->job_id() + "/" + std::to_string(_size));
  Deadline dl = Deadline::after_ms(timeout_ms);

  std::vector<MeshLink> links;
  HCOMM_TRY(connect_mesh(*_boot, dl, &links));
  _peers.resize(static_cast<size_t>(_size));
  for (int r = 0; r < _size; ++r) {
    Peer& p = _peers[static_cast<size_t>(r)];
    p.rank = r;
    p.same_host = links[static_cast<size_t>(r)].same_host;
    p.host = links[static_cast<size_t>(r)].host;
    if (r != _rank) p.sock = std::move(links[static_cast<size_t>(r)].fd);
  }
  _mems.assign(kMaxRegs, nullptr);
  _slot_gen.assign(kMaxRegs, 0);
  HCOMM_TRY(open_transports(cfg, li, dl));
  // While a collective waits, peers may wait on us (verbs: a revocation).
  // Without such a transport a collective's wait has nothing to wake for.
  if (std::any_of(_transports.begin(), _transports.end(), [](const auto& t) { return t->caps().acknowledges; }))
    _boot->on_idle([this] { return acknowledge_all(); });
  _sync_only = std::all_of(_transports.begin(), _transports.end(), [](const auto& t) { return t->caps().sync; });
  HCOMM_TRY(open_claims(dl));
  reserve_blocks();
  // Every rank's transports are wired up before anyone sends: a barrier, so
  // the first message never meets a half-built peer.
  return _boot->barrier(dl);
}

// Which transports this context opens, and in what order of preference:
//   shm (messaging; RMA on hcomm memory), npu (RMA on everything its device
//   maps, when the NPU engine runs), cma (RMA on registered user memory, and
//   rendezvous from unregistered buffers).
// HCOMM_TRANSPORTS / hcomm_config_t.transports restricts the set; a named
// transport that cannot open or cannot serve a peer fails init, never
// silently replaced.
Status Context::open_transports(const hcomm_config_t& cfg, const LaunchInfo& li, const Deadline& dl) {
  if (const char* e = std::getenv("HCOMM_RNDV"); e != nullptr && *e != '\0') {
    const std::string v = e;
    if (v == "get") _rndv_write = false;
    else if (v == "put") _rndv_write_min = 0;
    else if (v != "auto")
      return Status::error(Code::invalid_argument, "HCOMM_RNDV='%s': use auto, get or put", e);
  }
  std::vector<std::string> forced;
  std::string list = cfg.transports != nullptr ? cfg.transports : "";
  const char* list_src = "hcomm_config_t.transports";
  if (list.empty()) {
    if (const char* e = std::getenv("HCOMM_TRANSPORTS"); e != nullptr && *e != '\0') {
      list = e;
      list_src = "HCOMM_TRANSPORTS";
    }
  }
  bool allow[kTransportKinds] = {false, true, true, true, true, true};
  if (!list.empty()) {
    for (bool& a : allow) a = false;
    for (const std::string& n : split(list, ',')) {
      bool known = false;
      for (int id = 1; id < kTransportKinds; ++id) {
        if (n == transport_name(static_cast<TransportId>(id))) {
          allow[id] = true;
          known = true;
        }
      }
      if (!known)
        return Status::error(Code::invalid_argument,
                             "%s='%s': unknown transport '%s' (use shm, cma, npu, npu_roce, verbs)",
                             list_src, list.c_str(), n.c_str());
      forced.push_back(n);
    }
  }
  auto allowed = [&](TransportId id) { return allow[static_cast<int>(id)]; };

  // Engine choice: explicit config, then HCOMM_ENGINE, then a reachable NPU
  // (or npu named in the transport list).
  const bool forced_npu = !list.empty() && allowed(TransportId::npu);
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
  if (engine == HCOMM_ENGINE_HOST && forced_npu)
    return Status::error(Code::invalid_argument, "%s='%s' names npu, but the host engine was asked for", list_src,
                         list.c_str());
  if (engine == HCOMM_ENGINE_NPU && !allowed(TransportId::npu))
    return Status::error(Code::invalid_argument, "the NPU engine needs transport npu, which %s='%s' leaves out",
                         list_src, list.c_str());
  if (engine == HCOMM_ENGINE_AUTO) {
    std::string dev = cfg.device != nullptr ? cfg.device : "";
    bool have = !dev.empty() || ::access(sim_socket_path(default_sim_dir(), _local_rank).c_str(), F_OK) == 0;
    engine = forced_npu || (have && allowed(TransportId::npu)) ? HCOMM_ENGINE_NPU : HCOMM_ENGINE_HOST;
  }

  // Same-host transports ride on shm's node registry (control segments);
  // they are opened even for a rank alone on its host (its own memory).
  if (allowed(TransportId::shm) || allowed(TransportId::cma) || engine == HCOMM_ENGINE_NPU) {
    if (!allowed(TransportId::shm))
      return Status::error(Code::invalid_argument,
                           "%s='%s': cma and npu need shm (its control segments validate their keys and carry "
                           "their messages)", list_src, list.c_str());
    if (!allowed(TransportId::cma))
      return Status::error(Code::invalid_argument,
                           "%s='%s': shm needs cma (a rendezvous from a buffer that is not hcomm memory is read "
                           "with process_vm_readv)", list_src, list.c_str());
    std::unique_ptr<ShmTransport> shm;
    HCOMM_TRY(ShmTransport::open(*this, *this, &shm));
    _shm = shm.get();
    HCOMM_TRY(_shm->connect(dl));
    if (engine == HCOMM_ENGINE_NPU) {
      std::string name = cfg.device != nullptr ? cfg.device : "";
      if (name.empty()) {
        if (const char* d = std::getenv("HCOMM_DEVICE"); d != nullptr && *d != '\0') {
          // One name, or a comma-separated list indexed by local rank (a
          // job's ranks on one host share the environment).
          std::vector<std::string> names = split(d, ',');
          if (names.size() == 1) {
            name = names[0];
          } else if (li.local_rank < static_cast<int>(names.size()) && !names[static_cast<size_t>(li.local_rank)].empty()) {
            name = names[static_cast<size_t>(li.local_rank)];
          } else {
            return Status::error(Code::invalid_argument, "HCOMM_DEVICE='%s' names no device for local rank %d", d,
                                 li.local_rank);
          }
        } else {
          name = "sim:" + std::to_string(li.local_rank);
        }
      }
      std::unique_ptr<NpuTransport> npu;
      HCOMM_TRY(NpuTransport::open(name, _rank, *_shm, &npu));
      _npu = npu.get();
      _yield_early = npu->software();
      _shm->messaging_only();  // every one-sided operation goes through the device
      _transports.push_back(std::move(shm));
      _transports.push_back(std::move(npu));
    } else {
      _transports.push_back(std::move(shm));
    }
    if (allowed(TransportId::cma)) _transports.push_back(std::make_unique<CmaTransport>(_rank, *_shm));
  }
  for (const Peer& p : _peers) _cross_host |= !p.same_host;
  // npu_roce: the NPU's own RoCE engine to peers on other nodes; wanted when
  // named, or when the job spans hosts (then every rank has a peer on
  // another host, so every rank takes part in its wire-up, with or without
  // an NPU).
  const bool forced_roce = !list.empty() && allowed(TransportId::npu_roce);
  std::string roce_why;
  std::vector<bool> roce_have;
  if (allowed(TransportId::npu_roce) && (forced_roce || _cross_host)) {
    std::unique_ptr<NpuRoceTransport> t;
    Status rs = _npu != nullptr ? Status::ok()
                                : Status::error(Code::unsupported, "rank %d runs the host engine (no NPU)", _rank);
    NpuRoceConfig rc;
    if (rs) rs = NpuRoceConfig::from_env(&rc);
    if (rs) {
      std::vector<bool> same(static_cast<size_t>(_size));
      for (const Peer& p : _peers) same[static_cast<size_t>(p.rank)] = p.same_host;
      rs = NpuRoceTransport::open(*this, *this, _npu->device(), rc, same, &t);
    }
    HCOMM_TRY(NpuRoceTransport::connect(*_boot, rs ? t.get() : nullptr, rs.message(), dl, &roce_have));
    if (!rs && forced_roce) return Status(rs.code(), std::string(list_src) + " names npu_roce: " + rs.message());
    if (rs) _transports.push_back(std::move(t));
    else roce_why = rs.message();
  }
  // verbs: wanted when named, or when the job spans hosts and npu_roce does
  // not join every pair of ranks on different hosts (decided from what every
  // rank contributed, so the same on every rank: its wire-up is collective).
  const bool forced_verbs = !list.empty() && allowed(TransportId::verbs);
  // (With more than one host every rank has a peer on another host, so
  // every pair across hosts is joined exactly when every rank has npu_roce.)
  const bool roce_covers =
      !roce_have.empty() && std::all_of(roce_have.begin(), roce_have.end(), [](bool h) { return h; });
  // Why no cross-host transport: each part names its transport.
  std::string why_not = roce_why.empty() ? "" : "npu_roce: " + roce_why;
  auto also = [&](const std::string& s) { why_not += (why_not.empty() ? "" : "; ") + s; };
  if (allowed(TransportId::verbs) && (forced_verbs || (_cross_host && !roce_covers))) {
#if HCOMM_HAVE_IBVERBS
    VerbsConfig vc;
    std::unique_ptr<VerbsTransport> v;
    Status vs = VerbsConfig::from_env(&vc);
    if (vs) vs = VerbsTransport::open(*this, *this, vc, &v);
    std::vector<bool> have;
    HCOMM_TRY(VerbsTransport::connect(*_boot, vs ? v.get() : nullptr, vs.message(), dl, &have));
    if (!vs && forced_verbs) return Status(vs.code(), std::string(list_src) + " names verbs: " + vs.message());
    if (vs) {
      _nap_early = v->software();
      _verbs = v.get();
      _transports.push_back(std::move(v));
    } else {
      also("verbs: " + vs.message());
    }
    for (int r = 0; r < _size; ++r)
      if (!have[static_cast<size_t>(r)] && (forced_verbs || !_peers[static_cast<size_t>(r)].same_host))
        also("verbs: rank " + std::to_string(r) + " has no RDMA device");
#else
    const std::string no_verbs = "this build has no verbs transport (libibverbs-dev was missing at configure time)";
    if (forced_verbs) return Status::error(Code::unsupported, "%s names verbs: %s", list_src, no_verbs.c_str());
    also("verbs: " + no_verbs);
#endif
  }
  return choose_lanes(forced, why_not);
}

// Per peer: the first transport that carries messages and reaches it, and
// every transport with RMA that reaches it, in order of preference.
Status Context::choose_lanes(const std::vector<std::string>& forced, const std::string& why_not) {
  for (Peer& p : _peers) {
    p.am = nullptr;
    p.rma.clear();
    p.lanes.clear();
    for (auto& t : _transports) {
      if (!t->reaches(p.rank, p.same_host)) continue;
      if (p.am == nullptr && t->caps().max_short > 0) p.am = t.get();
      if (t->caps().put || t->caps().get) p.rma.push_back(t.get());
    }
    if (p.am == nullptr && p.rank != _rank) {
      std::string names;
      for (const std::string& n : forced) names += (names.empty() ? "" : ",") + n;
      return Status::error(Code::unsupported, "no transport%s%s carries messages to rank %d (%s host%s%s)%s%s",
                           names.empty() ? "" : " of ", names.c_str(), p.rank, p.same_host ? "same" : "another",
                           p.host.empty() ? "" : " ", p.host.c_str(), why_not.empty() ? "" : ": ",
                           why_not.c_str());
    }
    if (p.am != nullptr) p.lanes = p.am->name();
    // A lone rank's own memory: the lanes of its RMA.
    for (Transport* t : p.rma)
      if (t != p.am) p.lanes += std::string(p.lanes.empty() ? "" : ",") + t->name();
  }
  return Status::ok();
}

const char* Context::peer_transport(int peer) const {
  if (peer < 0 || peer >= _size) return nullptr;
  return _peers[static_cast<size_t>(peer)].lanes.c_str();
}

Context::~Context() {
  _closing = true;
  // Rendezvous left pending (finalize waits for neither a send no receiver
  // matched nor a receive its sender never wrote): their per-message
  // registrations go before the transports that made them.
  for (auto& [id, r] : _pending_sends)
    if (r->exposed_by != nullptr) std::exchange(r->exposed_by, nullptr)->unexpose(*r);
  for (Peer& p : _peers)  // (a send exposed, then queued for want of credits)
    for (auto& r : p.backlog)
      if (r->exposed_by != nullptr) std::exchange(r->exposed_by, nullptr)->unexpose(*r);
  for (Pull& u : _pulls)
    if (u.by_write && u.recv->exposed_by != nullptr)
      std::exchange(u.recv->exposed_by, nullptr)->unexpose_recv(*u.recv, false);
  for (auto& [key, k] : _rndv_keys) (void)rkey_release(k);
  _rndv_keys.clear();
  for (hcomm_rkey* k : _claim_keys)
    if (k != nullptr) (void)rkey_release(k);
  _claim_keys.clear();
  for (hcomm_mem* m : _mems) {
    if (m == nullptr) continue;
    for (auto it = _transports.rbegin(); it != _transports.rend(); ++it) (*it)->mem_remove(*m);
    delete m;
  }
  // Transports built on others (npu and cma on shm) go first.
  while (!_transports.empty()) _transports.pop_back();
}

// Control messages we owe peers (FINs that found no room) must go out
// before we block in a collective that makes no progress: a peer's send may
// be waiting on exactly that FIN.
void Context::flush_owed(const Deadline& dl) {
  while (!_ctl_backlog.empty() && !dl.expired()) {
    progress();
    if (!_ctl_backlog.empty()) cpu_relax();
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

// Rendezvous claim words (api/proto/tag.cpp): our word memory, and every
// rank's key for its words, imported once here.
Status Context::open_claims(const Deadline& dl) {
  HCOMM_TRY(mem_alloc(kClaimWords * sizeof(uint64_t), HCOMM_MEM_HOST, HCOMM_ACCESS_REMOTE_ATOMIC, &_claim_mem));
  uint8_t key[HCOMM_RKEY_MAX];
  size_t n = sizeof key;
  HCOMM_TRY(rkey_pack(_claim_mem, key, &n));
  std::vector<std::string> all;
  HCOMM_TRY(_boot->allgather(std::string(reinterpret_cast<const char*>(key), n), &all, dl));
  _claim_keys.assign(static_cast<size_t>(_size), nullptr);
  for (int r = 0; r < _size; ++r) {
    const std::string& k = all[static_cast<size_t>(r)];
    Status st = rkey_import(r, k.data(), k.size(), &_claim_keys[static_cast<size_t>(r)]);
    if (!st) return Status::error(st.code(), "rank %d's rendezvous claim words: %s", r, st.message().c_str());
  }
  _claim_free.reserve(kClaimWords);
  for (uint32_t i = kClaimWords; i > 0; --i) _claim_free.push_back(i - 1);
  // The cancel bound: what a transport may take to report an operation
  // failed, plus liveness, plus a second for scheduling.
  std::chrono::milliseconds stall{0};
  for (auto& t : _transports) stall = std::max(stall, t->stall_bound());
  _cancel_bound = std::chrono::milliseconds(1000) + _peer_check + stall;
  return Status::ok();
}

// ---- the cancel rule -------------------------------------------------------------------

// r is held up past the cancel bound by its peer: close that peer, which
// makes its transports stop touching our memory (verbs: the queue pair goes
// to error; same host: nothing more is read or written for it).
void Context::cancel_stuck(Request& r, const char* what) {
  const std::string why = std::string(what) + " did not finish within the cancel bound (" +
                          std::to_string(_cancel_bound.count()) + " ms)";
  // A wildcard receive is held up by the rank whose message it matched
  // (claiming it, or reading it): that is the peer to close.
  int peer = r.peer;
  if (peer < 0 && r.kind == Request::Kind::recv) {
    peer = r.info.source;
    for (const Claim& c : _claims)
      if (peer < 0 && c.recv.get() == &r) peer = c.source;
  }
  if (peer >= 0 && peer < _size && peer != _rank) peer_failed(_peers[static_cast<size_t>(peer)], why);
  r.complete(HCOMM_ERR_PEER_FAILURE, "rank " + std::to_string(peer) + ": " + why);
}

void Context::cancel_send(const std::shared_ptr<Request>& rp, const Deadline& dl) {
  Request& r = *rp;
  Peer& p = _peers[static_cast<size_t>(r.peer)];
  // Not yet handed to the lane: withdraw it.
  if (auto it = std::find(p.backlog.begin(), p.backlog.end(), rp); it != p.backlog.end()) {
    p.backlog.erase(it);
    p.queued = !p.backlog.empty();
    send_done(r, HCOMM_ERR_CANCELLED, "cancelled before it was sent");
    return;
  }
  auto pend = _pending_sends.find(r.id);
  if (pend == _pending_sends.end() || r.claim == kNoSlot) return;  // completes by itself (FIN or failure)
  // A rendezvous: take our claim word back unless the receiver won it. An
  // answer that is none of this send's states is no answer: ask again (see
  // claim_resolved in api/proto/tag.cpp).
  uint64_t state = 0;
  for (unsigned ask = 0;; ++ask) {
    auto g = new_request();
    g->peer = _rank;
    g->id = next_id();
    (void)claim_cas(_claim_keys[static_cast<size_t>(_rank)], r.claim, claim_token(r.id, kExposed),
                    claim_token(r.id, kRetracted), &g->fetched, g);
    if (!spin_wait([&] { return g->done(); }, true, dl)) return cancel_stuck(r, "retracting a rendezvous send");
    if (r.done()) return;  // the FIN came meanwhile
    if (g->status != HCOMM_OK) return;  // the word is out of reach: the FIN or the peer's failure decides
    // (Our own word: nothing else writes a later message's token into it.)
    state = claim_state(g->fetched, r.id);
    if (state != 0 || ask + 1 == kClaimAsks) break;
  }
  if (state != kExposed && state != kRetracted) return;  // claimed (or no answer): wait for the FIN
  _pending_sends.erase(r.id);
  MsgHdr h{};
  h.type = static_cast<uint32_t>(MsgType::retract);
  h.sreq = r.id;
  post_ctl(r.peer, h);
  send_done(r, HCOMM_ERR_CANCELLED, "cancelled before the receiver matched it");
}

void Context::cancel(const std::shared_ptr<Request>& rp) {
  Request& r = *rp;
  const Deadline dl = Deadline::after_ms(static_cast<int>(_cancel_bound.count()));
  progress();
  if (r.done()) return;
  if (r.kind == Request::Kind::recv) {
    // Posted and unmatched (a lost claim leaves it posted again): withdraw.
    auto withdrawable = [&] { return !r.claiming && std::find(_posted.begin(), _posted.end(), rp) != _posted.end(); };
    if (!withdrawable() && !spin_wait([&] { return r.done() || withdrawable(); }, true, dl))
      return cancel_stuck(r, "a matched receive");
    if (r.done()) return;
    _posted.remove(rp);
    r.complete(HCOMM_ERR_CANCELLED, "cancelled before a message matched it");
    return;
  }
  if (r.kind == Request::Kind::send) {
    cancel_send(rp, dl);
    if (r.done()) return;
  }
  // In flight (a claimed rendezvous send, an RMA on an asynchronous lane):
  // it cannot be called back; wait until no engine touches its buffers, a
  // bound at a time while a lane reports progress toward the peer (a long
  // transfer on a lossy wire), stuck after a whole bound without.
  auto mark = [&] {
    uint64_t m = 0;
    if (r.peer >= 0 && r.peer < _size)
      for (auto& t : _transports) m += t->progress_mark(r.peer);
    return m;
  };
  for (Deadline round = dl;; round = Deadline::after_ms(static_cast<int>(_cancel_bound.count()))) {
    const uint64_t before = mark();
    if (spin_wait([&] { return r.done(); }, true, round)) return;
    if (mark() == before) break;
  }
  // Held by a lane that finishes alone (the NPU's DMA queue): its engine
  // ends every descriptor it took, or its health check fails them when the
  // device is lost, and until then it may write into the caller's buffer.
  // Failing the peer would not stop it, so the cancel waits for the lane
  // (bounded: a device neither finishing nor found lost in a minute).
  if (r.held_by != nullptr && spin_wait([&] { return r.done(); }, true, Deadline::after_ms(kFinishAloneMs)))
    return;
  cancel_stuck(r, r.kind == Request::Kind::send ? "a send the receiver is reading" : "a one-sided operation");
}

// ---- peers: liveness and the control plane ------------------------------------------

void Context::drain_socket(Peer& p) {
  while (p.alive) {
    std::vector<uint8_t> buf;
    std::vector<UniqueFd> fds;
    Status st = recv_msg(p.sock.get(), &buf, &fds, Deadline(std::chrono::nanoseconds(0)), p.rank);
    if (st.code() == Code::timeout) return;
    if (!st) return peer_failed(p, st.message());
    CtrlMsg m{};
    st = meshwire::parse_ctrl(buf, fds.size(), CtrlType::advert, p.rank, 1, kMaxRegs, &m);
    if (!st) return peer_failed(p, st.message());
    if (_shm == nullptr) return peer_failed(p, "an advert, but shared memory is not in use");
    _shm->on_advert(p.rank, m.slot, m.gen, std::move(fds[0]));
  }
}

Status Context::pump_control(Peer& p, const Deadline& dl) {
  pollfd pf{p.sock.get(), POLLIN, 0};
  if (::poll(&pf, 1, dl.remaining_ms()) > 0) {
    drain_socket(p);
    if (p.alive && (pf.revents & (POLLHUP | POLLERR))) peer_failed(p, "connection closed");
  }
  return Status::ok();
}

void Context::check_peers(bool force) {
  // Reading the clock costs ~40 ns here: look at it every 64th progress call.
  if (!force && (++_progress_calls & 63) != 0) return;
  auto now = Clock::now();
  if (!force && now - _last_check < _peer_check) return;
  _last_check = now;
  for (auto& t : _transports) t->check_health();
  // Reused, so that a peer check allocates nothing (the fast path's promise).
  std::vector<pollfd>& pfds = _check_pfds;
  std::vector<Peer*>& who = _check_who;
  pfds.clear();
  who.clear();
  for (Peer& p : _peers) {
    if (p.rank == _rank || !p.alive) continue;
    pfds.push_back({p.sock.get(), POLLIN, 0});
    who.push_back(&p);
  }
  if (pfds.empty() || ::poll(pfds.data(), pfds.size(), 0) <= 0) return;
  for (size_t i = 0; i < pfds.size(); ++i) {
    if (pfds[i].revents & POLLIN) drain_socket(*who[i]);
    if (who[i]->alive && (pfds[i].revents & (POLLHUP | POLLERR))) {
      int err = 0;
      socklen_t el = sizeof err;
      (void)::getsockopt(pfds[i].fd, SOL_SOCKET, SO_ERROR, &err, &el);
      peer_failed(*who[i], err == ETIMEDOUT ? "its host stopped answering (keepalive timed out: silent, stopped or "
                                              "unreachable)"
                                            : "connection closed (process exited or was killed, or it "
                                              "declared this rank failed)");
    }
  }
}

void Context::peer_failed(Peer& p, const std::string& why) {
  if (!p.alive) return;
  p.why_dead = "rank " + std::to_string(p.rank) + ": " + why;
  p.alive = false;  // after why_dead: the unlocked fast path reads it once it sees this
  // Tell it: a rank this one declared failed (its message garbled, its
  // transfer stuck past the cancel bound) learns it from the closed control
  // connection at its next liveness check, instead of waiting for answers
  // that will not come until its own timeouts.
  if (p.sock.valid()) (void)::shutdown(p.sock.get(), SHUT_RDWR);
  ++_peers_failed;
  _last_failure = p.why_dead;
  for (auto& t : _transports) t->peer_failed(p.rank, p.why_dead);
  for (auto& r : p.backlog) send_done(*r, HCOMM_ERR_PEER_FAILURE, p.why_dead);
  p.backlog.clear();
  p.queued = false;
  // A read on a lane that finishes alone (the NPU's DMA queue) is left to
  // end: its engine may be copying into the receive buffer right now, and
  // the receive must not return before it stops (it ends OK, the message
  // whole, or with the device's error, and the FIN is dropped).
  for (Pull& u : _pulls)
    if (u.source == p.rank && (u.lane == nullptr || !u.lane->finishes_alone()))
      u.read->complete(HCOMM_ERR_PEER_FAILURE, p.why_dead);
  for (Push& u : _pushes)
    if (u.dest == p.rank) u.write->complete(HCOMM_ERR_PEER_FAILURE, p.why_dead);
  // A claim on its word is lost with it (the RTS is dropped).
  for (Claim& c : _claims)
    if (c.source == p.rank) c.op->complete(HCOMM_ERR_PEER_FAILURE, p.why_dead);
  for (auto it = _pending_sends.begin(); it != _pending_sends.end();) {
    if (it->second->peer == p.rank) {
      send_done(*it->second, HCOMM_ERR_PEER_FAILURE, p.why_dead);
      it = _pending_sends.erase(it);
    } else {
      ++it;
    }
  }
  bool anyone = false;
  for (const Peer& q : _peers) anyone |= q.rank != _rank && q.alive;
  for (auto it = _posted.begin(); it != _posted.end();) {
    if ((*it)->peer == p.rank || ((*it)->peer == HCOMM_ANY_SOURCE && !anyone)) {
      (*it)->complete(HCOMM_ERR_PEER_FAILURE, p.why_dead);
      it = _posted.erase(it);
    } else {
      ++it;
    }
  }
}

// ---- progress ------------------------------------------------------------------------------

void Context::progress() {
  for (auto& t : _transports) t->progress();
  if (!_claims.empty()) finish_claims();
  if (!_pulls.empty()) finish_pulls();
  if (!_pushes.empty()) finish_pushes();
  for (Peer& p : _peers) {
    if (p.rank == _rank || !p.alive) continue;
    if (p.backlog.empty()) continue;
    while (!p.backlog.empty() && try_send(p, p.backlog.front())) p.backlog.pop_front();
    if (p.backlog.empty()) p.queued = false;
  }
  while (!_ctl_backlog.empty() && try_ctl(_ctl_backlog.front().first, _ctl_backlog.front().second))
    _ctl_backlog.pop_front();
  check_peers(false);
}

// Callers hold _mu. Three phases, by time waited (the clock is read every
// 64 rounds, not every round): spin on progress for 50 us (microsecond
// latencies; 3 us when the NPU is hcomm-sim on this host, below), then yield the CPU between rounds up to 2 ms (on a busy
// machine the peer needs our core), then nap with the lock released, for
// 1/16 of the time waited so far (50 us to 1 ms). A wait that has gone on
// for long (a retransmission timeout, a slow peer, a consumer waiting for a
// producer's next step) then stops waking tens of thousands of times a
// second: on two vCPUs, four ranks waiting with 50 us naps took the CPU
// from the simulators whose work they were waiting for (the RoCE cases
// under ASan timed out on their own retransmissions). What the wait waits
// for is seen at most 1/16 of the wait, or 1 ms, after it happened.
// Over a software RDMA device the yield phase is skipped (see below).
bool Context::spin_wait(const std::function<bool()>& done, bool progress_each_round, const Deadline& dl) {
  if (done()) return true;
  Clock::time_point start{};  // at the first clock reading: a wait that ends within 64 rounds reads none
  for (uint32_t round = 1;; ++round) {
    if (progress_each_round || (round & 63) == 0) progress();
    if (done()) return true;
    if ((round & 63) != 0) {
      cpu_relax();
      continue;
    }
    const Clock::time_point now = Clock::now();
    if (start == Clock::time_point{}) start = now;
    if (now >= dl.at()) return false;
    const auto waited = now - start;
    // Over a software RDMA device a round trip takes hundreds of microseconds
    // (QEMU guests): spin up to 2 ms before napping, as perftest spins; rxe's
    // work runs in softirq context, which preempts the spinning thread.
    // A simulated NPU's engine is a thread on these CPUs: while this rank
    // spins on the core it shares with that thread, the descriptor it waits
    // for does not run. Spinning 50 us there made every hand-off between a
    // rank and the engine cost the spin (NPU send/recv of 1 MiB took 170-200
    // us per message instead of ~30 whenever the scheduler put the receiver
    // on the engine's core): yield after 3 us instead.
    const auto spin_for = _nap_early     ? std::chrono::microseconds(2000)
                          : _yield_early ? std::chrono::microseconds(3)
                                         : std::chrono::microseconds(50);
    if (waited < spin_for) continue;
    _mu.unlock();
    // A software RDMA device (rxe, siw) does the NIC's work in kernel threads
    // on these CPUs, and sched_yield does not hand them the CPU: nap at once.
    if (waited < std::chrono::milliseconds(2) && !_nap_early) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(std::clamp<Clock::duration>(waited / 16, std::chrono::microseconds(50),
                                                              std::chrono::milliseconds(1)));
    }
    _mu.lock();
  }
}

Status Context::wait(Request& r, const Deadline& dl) {
  if (r.done()) return Status::ok();
  progress();  // the common case: what it waits for already sits in a lane
  if (r.done() || spin_wait([&] { return r.done(); }, true, dl)) return Status::ok();
  return Status::error(Code::timeout, "request still in progress at the deadline");
}

}  // namespace hcomm::api
