// The torch.distributed backend "hcomm": point to point over hcomm's tagged
// messages (each tensor's bytes moved once), convenience collectives over
// them (ring, tree; documented as not tuned), and the Work objects.
#include "python/csrc/backend.h"

#include <ATen/core/ivalue.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <stdexcept>
#include <thread>

namespace hcomm::torch_backend {

namespace {

int ms_of(Ms t) { return static_cast<int>(std::clamp<int64_t>(t.count(), 1, INT_MAX)); }

std::string status_text(hcomm_status_t st) {
  const char* detail = hcomm_last_error();
  return std::string(hcomm_strerror(st)) + (detail != nullptr && *detail != '\0' ? std::string(": ") + detail : "");
}

std::exception_ptr error_of(hcomm_status_t st, const std::string& what) {
  return std::make_exception_ptr(std::runtime_error("hcomm: " + what + ": " + status_text(st)));
}

}  // namespace

void raise(hcomm_status_t st, const std::string& what) { TORCH_CHECK(false, "hcomm: ", what, ": ", status_text(st)); }

void check_tensor(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.defined(), "hcomm: ", what, ": undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), "hcomm: ", what, ": the tensor is on ", t.device().str(),
              "; hcomm's backend moves CPU tensors");
  TORCH_CHECK(t.layout() == c10::kStrided, "hcomm: ", what, ": only dense (strided) tensors");
  TORCH_CHECK(t.is_contiguous(), "hcomm: ", what, ": the tensor is not contiguous (pass tensor.contiguous())");
}

// ---- World ------------------------------------------------------------------------------------

World::World(c10::intrusive_ptr<c10d::Store> store, int rank, int size, Ms timeout)
    : _store(std::move(store)), _rank(rank), _size(size) {
  _kv.arg = this;
  _kv.set = kv_set;
  _kv.get = kv_get;
  hcomm_config_t cfg;
  hcomm_config_init(&cfg);
  cfg.rank = rank;
  cfg.size = size;
  cfg.store = &_kv;
  cfg.bootstrap_timeout_ms = ms_of(std::min<Ms>(timeout, Ms(300000)));
  hcomm_status_t st = hcomm_init(&cfg, &_ctx);
  if (st != HCOMM_OK) {
    std::string what = "starting from the c10d store (rank " + std::to_string(rank) + " of " + std::to_string(size) + ")";
    std::lock_guard l(_mu);
    if (!_store_error.empty()) what += " [the store said: " + _store_error + "]";
    raise(st, what);
  }
}

World::~World() {
  if (_ctx != nullptr) (void)hcomm_finalize(_ctx);  // frees what is still registered
}

int World::kv_set(void* arg, const char* key, const void* value, size_t len) {
  auto* w = static_cast<World*>(arg);
  try {
    const auto* p = static_cast<const uint8_t*>(value);
    w->_store->set(key, std::vector<uint8_t>(p, p + len));
    return 0;
  } catch (const std::exception& e) {
    w->note_store_error(e.what());
    return 2;
  }
}

int World::kv_get(void* arg, const char* key, void* value, size_t cap, size_t* len, int timeout_ms) {
  auto* w = static_cast<World*>(arg);
  const auto deadline = std::chrono::steady_clock::now() + Ms(std::max(timeout_ms, 0));
  const std::vector<std::string> keys{key};
  try {
    // Polled with check(): a TCPStore client whose wait() timed out still has
    // that wait's answer coming on its socket, and the next request reads it.
    for (int nap_us = 50; !w->_store->check(keys); nap_us = std::min(nap_us * 2, 5000)) {
      if (std::chrono::steady_clock::now() >= deadline) return 1;
      std::this_thread::sleep_for(std::chrono::microseconds(nap_us));
    }
    std::vector<uint8_t> v = w->_store->get(key);
    std::memcpy(value, v.data(), std::min(cap, v.size()));
    *len = v.size();
    return 0;
  } catch (const std::exception& e) {
    w->note_store_error(e.what());
    return 2;
  }
}

void World::note_store_error(const std::string& what) {
  std::lock_guard l(_mu);
  _store_error = what;
}

hcomm_mem_t* World::find_registration(const void* p, size_t len) {
  std::lock_guard l(_mu);
  const auto b = reinterpret_cast<uintptr_t>(p);
  for (const Reg& r : _regs)
    if (b >= r.begin && b + len <= r.end) return r.mem;
  return nullptr;
}

void World::add_registration(hcomm_mem_t* m, const void* p, size_t len) {
  std::lock_guard l(_mu);
  const auto b = reinterpret_cast<uintptr_t>(p);
  _regs.push_back({m, b, b + len});
}

void World::remove_registration(hcomm_mem_t* m) {
  std::lock_guard l(_mu);
  _regs.erase(std::remove_if(_regs.begin(), _regs.end(), [&](const Reg& r) { return r.mem == m; }), _regs.end());
}

// ---- Work --------------------------------------------------------------------------------------

HcommWork::HcommWork(std::shared_ptr<World> world, c10d::OpType type, std::string what,
                     std::vector<hcomm_request_t*> reqs, Ms timeout, std::vector<at::Tensor> keep)
    : c10d::Work(-1, type),
      _world(std::move(world)),
      _what(std::move(what)),
      _reqs(std::move(reqs)),
      _timeout(timeout),
      _keep(std::move(keep)) {
  if (_reqs.empty()) settle(nullptr);
}

HcommWork::~HcommWork() {
  // Dropped while pending (its tensors may go away now): the cancel rule.
  if (!_settled)
    for (hcomm_request_t* r : _reqs) (void)hcomm_request_cancel(r);
  release_all();
}

void HcommWork::release_all() {
  for (hcomm_request_t* r : _reqs) hcomm_request_free(r);
  _reqs.clear();
  for (hcomm_mem_t* m : temp_regs) (void)hcomm_mem_release(m);
  temp_regs.clear();
}

void HcommWork::settle(std::exception_ptr err) {
  {
    std::lock_guard l(_mu);
    if (_settled) return;
    _settled = true;
  }
  if (!err && _reqs.size() == 1 && to_group_rank) {
    hcomm_recv_info_t info{};
    if (hcomm_request_recv_info(_reqs[0], &info) == HCOMM_OK) _source = to_group_rank(info.source);
  }
  if (!err && on_done) {
    try {
      on_done();
    } catch (...) {
      err = std::current_exception();
    }
  }
  release_all();
  _error = err;
  finish(err);
}

bool HcommWork::isCompleted() {
  std::unique_lock l(_mu);
  if (_settled) return true;
  std::exception_ptr err;
  for (hcomm_request_t* r : _reqs) {
    int done = 0;
    hcomm_status_t st = hcomm_test(r, &done);
    if (done == 0) return false;
    if (st != HCOMM_OK && !err) err = error_of(st, _what);
  }
  l.unlock();
  settle(err);
  return true;
}

bool HcommWork::isSuccess() const {
  std::lock_guard l(_mu);
  return _settled && !_error;
}

std::exception_ptr HcommWork::exception() const {
  std::lock_guard l(_mu);
  return _error;
}

c10::intrusive_ptr<c10::ivalue::Future> HcommWork::getFuture() {
  auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
  try {
    wait(Ms(0));
    fut->markCompleted(c10::IValue(_keep));
  } catch (...) {
    fut->setError(std::current_exception());
  }
  return fut;
}

int HcommWork::sourceRank() const {
  std::lock_guard l(_mu);
  TORCH_CHECK(_source >= 0, "hcomm: sourceRank() is known once a receive has completed");
  return _source;
}

bool HcommWork::wait(Ms timeout) {
  const Ms limit = timeout.count() <= 0 ? _timeout : timeout;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  std::unique_lock l(_mu);
  if (!_settled) {
    std::exception_ptr err;
    for (hcomm_request_t* r : _reqs) {
      const auto left = std::chrono::duration_cast<Ms>(deadline - std::chrono::steady_clock::now());
      hcomm_status_t st = hcomm_wait(r, static_cast<int>(std::clamp<int64_t>(left.count(), 0, INT_MAX)));
      if (st == HCOMM_ERR_TIMEOUT) {
        // The cancel rule: withdraw what is still pending, or wait (bounded)
        // until it ran to its end, before raising.
        bool withdrawn = false;
        for (hcomm_request_t* q : _reqs) {
          hcomm_status_t c = hcomm_request_cancel(q);
          if (c == HCOMM_ERR_CANCELLED) withdrawn = true;
          else if (c != HCOMM_OK && !err) err = error_of(c, _what);
        }
        if (withdrawn && !err)
          err = std::make_exception_ptr(std::runtime_error(
              "hcomm: " + _what + ": timed out after " + std::to_string(limit.count()) +
              " ms (the operation was withdrawn; its tensors are no longer touched)"));
        break;
      }
      if (st != HCOMM_OK && !err) err = error_of(st, _what);
    }
    l.unlock();
    settle(err);
  } else {
    l.unlock();
  }
  if (_error) std::rethrow_exception(_error);
  return true;
}

// ---- the process group ---------------------------------------------------------------------

ProcessGroupHcomm::ProcessGroupHcomm(std::shared_ptr<World> world, int rank, int size, std::vector<int> world_ranks,
                                     uint32_t group_id, Ms timeout)
    : c10d::ProcessGroup(rank, size),
      _world(std::move(world)),
      _world_ranks(std::move(world_ranks)),
      _group_id(group_id),
      _timeout(timeout) {}

int ProcessGroupHcomm::world_rank(int group_rank) const {
  TORCH_CHECK(group_rank >= 0 && group_rank < size_, "hcomm: rank ", group_rank, " is not in a group of ", size_);
  return _world_ranks[static_cast<size_t>(group_rank)];
}

int ProcessGroupHcomm::group_rank(int world_rank) const {
  auto it = std::find(_world_ranks.begin(), _world_ranks.end(), world_rank);
  return it == _world_ranks.end() ? -1 : static_cast<int>(it - _world_ranks.begin());
}

// hcomm's 64-bit tag: bit 63 collective, bits 62..40 the group, then torch's
// 32-bit tag (point to point) or the group's collective sequence number.
uint64_t ProcessGroupHcomm::p2p_tag(int tag) const {
  return (uint64_t{_group_id} << 40) | static_cast<uint32_t>(tag);
}

uint64_t ProcessGroupHcomm::next_collective_tag() {
  std::lock_guard l(_mu);
  return (uint64_t{1} << 63) | (uint64_t{_group_id} << 40) | (_collective_seq++ & ((uint64_t{1} << 40) - 1));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHcomm::done(c10d::OpType type, std::vector<at::Tensor> keep) {
  return c10::make_intrusive<HcommWork>(_world, type, "collective", std::vector<hcomm_request_t*>{}, _timeout,
                                        std::move(keep));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHcomm::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  TORCH_CHECK(tensors.size() == 1, "hcomm: send takes one tensor, got ", tensors.size());
  at::Tensor& t = tensors[0];
  check_tensor(t, "send");
  const std::string what = "send to rank " + std::to_string(dst);
  hcomm_request_t* q = nullptr;
  check(hcomm_isend(_world->ctx(), world_rank(dst), t.data_ptr(), t.nbytes(), p2p_tag(tag), &q), what);
  return c10::make_intrusive<HcommWork>(_world, c10d::OpType::SEND, what, std::vector<hcomm_request_t*>{q}, _timeout,
                                        std::vector<at::Tensor>{t});
}

namespace {
c10::intrusive_ptr<c10d::Work> post_recv(ProcessGroupHcomm& pg, at::Tensor& t, int source_world, int tag,
                                         c10d::OpType type, const std::string& what) {
  check_tensor(t, "recv");
  hcomm_request_t* q = nullptr;
  check(hcomm_irecv(pg.world()->ctx(), source_world, t.data_ptr(), t.nbytes(), pg.p2p_tag(tag), HCOMM_TAG_MASK_ALL, &q),
        what);
  auto w = c10::make_intrusive<HcommWork>(pg.world(), type, what, std::vector<hcomm_request_t*>{q}, pg.timeout(),
                                          std::vector<at::Tensor>{t});
  const size_t want = t.nbytes();
  w->to_group_rank = [&pg](int wr) { return pg.group_rank(wr); };
  w->on_done = [q, want, what] {
    hcomm_recv_info_t info{};
    if (hcomm_request_recv_info(q, &info) == HCOMM_OK && info.length != want)
      throw std::runtime_error("hcomm: " + what + ": the message has " + std::to_string(info.length) +
                               " bytes, the tensor " + std::to_string(want));
  };
  return w;
}
}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupHcomm::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  TORCH_CHECK(tensors.size() == 1, "hcomm: recv takes one tensor, got ", tensors.size());
  return post_recv(*this, tensors[0], world_rank(src), tag, c10d::OpType::RECV,
                   "recv from rank " + std::to_string(src));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHcomm::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  TORCH_CHECK(tensors.size() == 1, "hcomm: recv takes one tensor, got ", tensors.size());
  // Any source of this group: the group's id is in the tag, so only its
  // members' messages match.
  return post_recv(*this, tensors[0], HCOMM_ANY_SOURCE, tag, c10d::OpType::RECVANYSOURCE, "recv from any source");
}

// ---- collectives: convenience, over point to point (ring / binomial tree / dissemination) ----

void ProcessGroupHcomm::ring_step(const void* s, size_t slen, void* r, size_t rlen, uint64_t tag, Ms timeout) {
  const int n = size_;
  check(hcomm_sendrecv(_world->ctx(), world_rank((rank_ + 1) % n), s, slen, tag, world_rank((rank_ + n - 1) % n), r,
                       rlen, tag, HCOMM_TAG_MASK_ALL, nullptr, ms_of(timeout)),
        "collective ring step");
}

namespace {

void reduce_into(at::Tensor& dst, const at::Tensor& src, const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: dst.add_(src); return;
    case c10d::ReduceOp::PRODUCT: dst.mul_(src); return;
    case c10d::ReduceOp::MIN: dst.copy_(at::minimum(dst, src)); return;
    case c10d::ReduceOp::MAX: dst.copy_(at::maximum(dst, src)); return;
    case c10d::ReduceOp::BAND: dst.bitwise_and_(src); return;
    case c10d::ReduceOp::BOR: dst.bitwise_or_(src); return;
    case c10d::ReduceOp::BXOR: dst.bitwise_xor_(src); return;
    default: break;
  }
  TORCH_CHECK(false, "hcomm: reduce op ", static_cast<int>(op.op_),
              " is not supported (SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR are)");
}

// n pieces of a 1-D tensor whose length n divides.
std::vector<at::Tensor> equal_pieces(const at::Tensor& flat, int n) {
  std::vector<at::Tensor> out;
  const int64_t len = flat.numel() / n;
  for (int i = 0; i < n; ++i) out.push_back(flat.narrow(0, i * len, len));
  return out;
}

// n nearly equal pieces of a 1-D tensor.
std::vector<at::Tensor> pieces(const at::Tensor& flat, int n) {
  std::vector<at::Tensor> out;
  const int64_t total = flat.numel(), base = total / n, rem = total % n;
  int64_t at = 0;
  for (int i = 0; i < n; ++i) {
    const int64_t len = base + (i < rem ? 1 : 0);
    out.push_back(flat.narrow(0, at, len));
    at += len;
  }
  return out;
}

}  // namespace

// After it, chunk[rank] holds the reduction of every rank's chunk[rank].
void ProcessGroupHcomm::reduce_scatter_ring(std::vector<at::Tensor>& chunks, const c10d::ReduceOp& op, Ms timeout) {
  const int n = size_, r = rank_;
  if (n == 1) return;
  const uint64_t tag = next_collective_tag();
  int64_t most = 0;
  for (const at::Tensor& c : chunks) most = std::max(most, c.numel());
  at::Tensor tmp = at::empty({most}, chunks[0].options());
  for (int s = 0; s < n - 1; ++s) {
    const int si = ((r - s - 1) % n + n) % n, ri = ((r - s - 2) % n + n) % n;
    at::Tensor in = tmp.narrow(0, 0, chunks[static_cast<size_t>(ri)].numel());
    ring_step(chunks[static_cast<size_t>(si)].data_ptr(), chunks[static_cast<size_t>(si)].nbytes(), in.data_ptr(),
              in.nbytes(), tag, timeout);
    reduce_into(chunks[static_cast<size_t>(ri)], in, op);
  }
}

// Before it chunk[rank] is ours; after it every chunk is everyone's.
void ProcessGroupHcomm::allgather_ring(std::vector<at::Tensor>& chunks, Ms timeout) {
  const int n = size_, r = rank_;
  if (n == 1) return;
  const uint64_t tag = next_collective_tag();
  for (int s = 0; s < n - 1; ++s) {
    const int si = ((r - s) % n + n) % n, ri = ((r - s - 1) % n + n) % n;
    ring_step(chunks[static_cast<size_t>(si)].data_ptr(), chunks[static_cast<size_t>(si)].nbytes(),
              chunks[static_cast<size_t>(ri)].data_ptr(), chunks[static_cast<size_t>(ri)].nbytes(), tag, timeout);
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHcomm::barrier(const c10d::BarrierOptions& opts) {
  const Ms t = timeout_of(opts.timeout);
  const uint64_t tag = next_collective_tag();
  const int n = size_;
  // Dissemination: log2(n) rounds of one byte each way.
  for (int k = 1; k < n; k <<= 1) {
    uint8_t out = 1, in = 0;
    check(hcomm_sendrecv(_world->ctx(), world_rank((rank_ + k) % n), &out, 1, tag, world_rank((rank_ - k + n) % n), &in,
                         1, tag, HCOMM_TAG_MASK_ALL, nullptr, ms_of(t)),
          "barrier");
  }
  return done(c10d::OpType::BARRIER);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHcomm::broadcast(std::vector<at::Tensor>& tensors,
                                                            const c10d::BroadcastOptions& opts) {
  TORCH_CHECK(tensors.size() == 1, "hcomm: broadcast takes one tensor, got ", tensors.size());
  at::Tensor& t = tensors[0];
  check_tensor(t, "broadcast");
  const int n = size_, root = static_cast<int>(opts.rootRank);
  TORCH_CHECK(root >= 0 && root < n, "hcomm: broadcast root ", root, " is not in a group of ", n);
  const Ms timeout = timeout_of(opts.timeout);
  const uint64_t tag = next_collective_tag();
  // Binomial tree on ranks relative to the root.
  const int v = (rank_ - root + n) % n;
  int mask = 1;
  while (mask < n) {
    if (v & mask) {
      check(hcomm_recv(_world->ctx(), world_rank((v - mask + root) % n), t.data_ptr(), t.nbytes(), tag,
                       HCOMM_TAG_MASK_ALL, nullptr, ms_of(timeout)),
            "broadcast");
      break;
    }
    mask <<= 1;
  }
  for (mask >>= 1; mask > 0; mask >>= 1)
    if (v + mask < n)
      check(hcomm_send(_world->ctx(), world_rank((v + mask + root) % n), t.data_ptr(), t.nbytes(), tag, ms_of(timeout)),
            "broadcast");
  return done(c10d::OpType::BROADCAST, {t});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHcomm::allreduce(std::vector<at::Tensor>& tensors,
                                                            const c10d::AllreduceOptions& opts) {
  const Ms timeout = timeout_of(opts.timeout);
  for (at::Tensor& t : tensors) {
    check_tensor(t, "all_reduce");
    std::vector<at::Tensor> chunks = pieces(t.view({-1}), size_);
    reduce_scatter_ring(chunks, opts.reduceOp, timeout);
    allgather_ring(chunks, timeout);
  }
  return done(c10d::OpType::ALLREDUCE, tensors);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHcomm::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(inputs.size() == 1 && outputs.size() == 1, "hcomm: all_gather takes one input and one output list");
  at::Tensor& in = inputs[0];
  check_tensor(in, "all_gather");
  TORCH_CHECK(static_cast<int>(outputs[0].size()) == size_, "hcomm: all_gather needs ", size_, " output tensors, got ",
              outputs[0].size());
  std::vector<at::Tensor> chunks;
  for (at::Tensor& o : outputs[0]) {
    check_tensor(o, "all_gather");
    TORCH_CHECK(o.nbytes() == in.nbytes(), "hcomm: all_gather: output of ", o.nbytes(), " bytes for an input of ",
                in.nbytes());
    chunks.push_back(o);
  }
  chunks[static_cast<size_t>(rank_)].copy_(in);
  allgather_ring(chunks, timeout_of(opts.timeout));
  return done(c10d::OpType::ALLGATHER, outputs[0]);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHcomm::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                  const c10d::AllgatherOptions& opts) {
  check_tensor(input, "all_gather_into_tensor");
  check_tensor(output, "all_gather_into_tensor");
  TORCH_CHECK(output.numel() == input.numel() * size_ && output.scalar_type() == input.scalar_type(),
              "hcomm: all_gather_into_tensor: the output must hold ", size_, " inputs of the same dtype");
  std::vector<at::Tensor> chunks = equal_pieces(output.view({-1}), size_);
  chunks[static_cast<size_t>(rank_)].copy_(input.view({-1}));
  allgather_ring(chunks, timeout_of(opts.timeout));
  return done(c10d::OpType::_ALLGATHER_BASE, {output});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHcomm::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                 std::vector<std::vector<at::Tensor>>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == 1 && inputs.size() == 1, "hcomm: reduce_scatter takes one output and one input list");
  TORCH_CHECK(static_cast<int>(inputs[0].size()) == size_, "hcomm: reduce_scatter needs ", size_, " inputs, got ",
              inputs[0].size());
  at::Tensor& out = outputs[0];
  check_tensor(out, "reduce_scatter");
  std::vector<at::Tensor> flat;
  for (at::Tensor& t : inputs[0]) {
    check_tensor(t, "reduce_scatter");
    flat.push_back(t.reshape({-1}));
  }
  at::Tensor work = at::cat(flat);  // the inputs stay as they were
  std::vector<at::Tensor> chunks;
  int64_t at = 0;
  for (const at::Tensor& f : flat) {
    chunks.push_back(work.narrow(0, at, f.numel()));
    at += f.numel();
  }
  reduce_scatter_ring(chunks, opts.reduceOp, timeout_of(opts.timeout));
  out.view({-1}).copy_(chunks[static_cast<size_t>(rank_)]);
  return done(c10d::OpType::REDUCE_SCATTER, {out});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHcomm::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                       const c10d::ReduceScatterOptions& opts) {
  check_tensor(input, "reduce_scatter_tensor");
  check_tensor(output, "reduce_scatter_tensor");
  TORCH_CHECK(input.numel() == output.numel() * size_ && output.scalar_type() == input.scalar_type(),
              "hcomm: reduce_scatter_tensor: the input must hold ", size_, " outputs of the same dtype");
  std::vector<at::Tensor> chunks = equal_pieces(input.reshape({-1}).clone(), size_);
  reduce_scatter_ring(chunks, opts.reduceOp, timeout_of(opts.timeout));
  output.view({-1}).copy_(chunks[static_cast<size_t>(rank_)]);
  return done(c10d::OpType::_REDUCE_SCATTER_BASE, {output});
}

// ---- groups -----------------------------------------------------------------------------------

namespace {
std::mutex g_mu;
std::weak_ptr<World> g_world;

uint32_t group_number(const std::string& id) {
  uint64_t v = 0;
  bool digits = !id.empty() && id.size() < 10;
  for (char c : id) digits = digits && c >= '0' && c <= '9';
  if (digits) v = std::stoull(id);
  else
    for (unsigned char c : id) v = (v ^ c) * 1099511628211ull;
  return static_cast<uint32_t>(v & ((1u << 23) - 1));
}
}  // namespace

c10::intrusive_ptr<ProcessGroupHcomm> create_process_group(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                           int size, const std::vector<int64_t>& world_ranks,
                                                           const std::string& group_id, Ms timeout) {
  std::lock_guard l(g_mu);
  std::shared_ptr<World> w = g_world.lock();
  std::vector<int> ranks;
  if (world_ranks.empty()) {
    // The default group: it starts the process's context.
    if (!w) {
      w = std::make_shared<World>(store, rank, size, timeout);
      g_world = w;
    }
    TORCH_CHECK(w->size() == size && w->rank() == rank, "hcomm: a default group of ", size,
                " ranks while the previous one (", w->size(), " ranks) is still alive");
    for (int r = 0; r < size; ++r) ranks.push_back(r);
  } else {
    TORCH_CHECK(w != nullptr, "hcomm: new_group needs the default group (init_process_group(backend=\"hcomm\")) first");
    TORCH_CHECK(static_cast<int>(world_ranks.size()) == size, "hcomm: group of ", size, " ranks with ",
                world_ranks.size(), " global ranks");
    for (int64_t r : world_ranks) {
      TORCH_CHECK(r >= 0 && r < w->size(), "hcomm: global rank ", r, " of ", w->size());
      ranks.push_back(static_cast<int>(r));
    }
    TORCH_CHECK(ranks[static_cast<size_t>(rank)] == w->rank(), "hcomm: group rank ", rank, " is world rank ",
                ranks[static_cast<size_t>(rank)], ", this process is ", w->rank());
  }
  return c10::make_intrusive<ProcessGroupHcomm>(w, rank, size, std::move(ranks), group_number(group_id), timeout);
}

}  // namespace hcomm::torch_backend
