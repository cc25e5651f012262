// hcomm as a torch.distributed backend (PyTorch 1.13's c10d::ProcessGroup
// plugin API) and one-sided tensor windows.
//
// One hcomm context per process (World), started from the default group's
// c10d store through hcomm_config_t.store: no listener of hcomm's own, so
// torch's TCPStore keeps MASTER_PORT. Every group (new_group included) is a
// ProcessGroupHcomm over that context: group ranks map to world ranks and
// the group's id goes into hcomm's 64-bit tag.
#pragma once

#include <hcomm/hcomm.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace hcomm::torch_backend {

using Ms = std::chrono::milliseconds;

// Throws c10::Error (Python RuntimeError) naming what failed, with
// hcomm_last_error()'s detail.
[[noreturn]] void raise(hcomm_status_t st, const std::string& what);
inline void check(hcomm_status_t st, const std::string& what) {
  if (st != HCOMM_OK) raise(st, what);
}

// The process's hcomm context, started from a c10d store.
class World {
 public:
  World(c10::intrusive_ptr<c10d::Store> store, int rank, int size, Ms timeout);
  ~World();
  World(const World&) = delete;
  World& operator=(const World&) = delete;
  hcomm_context_t* ctx() const { return _ctx; }
  int rank() const { return _rank; }
  int size() const { return _size; }

  // Memory this module registered or allocated (windows, hcomm.torch.empty):
  // the registration that holds [p, p+len), or null.
  hcomm_mem_t* find_registration(const void* p, size_t len);
  void add_registration(hcomm_mem_t* m, const void* p, size_t len);
  void remove_registration(hcomm_mem_t* m);

 private:
  static int kv_set(void* arg, const char* key, const void* value, size_t len);
  static int kv_get(void* arg, const char* key, void* value, size_t cap, size_t* len, int timeout_ms);
  void note_store_error(const std::string& what);
  std::string _store_error;  // the store's last exception, for init's message
  c10::intrusive_ptr<c10d::Store> _store;  // barriers go through it until hcomm_finalize
  hcomm_kv_store_t _kv{};
  hcomm_context_t* _ctx = nullptr;
  int _rank = 0, _size = 1;
  std::mutex _mu;
  struct Reg {
    hcomm_mem_t* mem;
    uintptr_t begin, end;
  };
  std::vector<Reg> _regs;
};

// A Work over hcomm requests. wait() follows hcomm's cancel rule: past its
// timeout the requests are cancelled (withdrawn, or waited for until nothing
// touches the tensors) before it raises.
class HcommWork : public c10d::Work {
 public:
  HcommWork(std::shared_ptr<World> world, c10d::OpType type, std::string what, std::vector<hcomm_request_t*> reqs,
            Ms timeout, std::vector<at::Tensor> keep = {});
  ~HcommWork() override;
  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  bool wait(Ms timeout) override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override { return _keep; }
  // A completed future of the result tensors (what DistributedDataParallel's
  // reducer chains on); a pending request is waited for first.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  // Run after every request completed (checks of the received size, copies
  // out of staging, releasing temporary registrations); may throw.
  std::function<void()> on_done;
  // recvAnysource: world rank -> group rank
  std::function<int(int)> to_group_rank;
  // Temporary registrations released once the requests are over.
  std::vector<hcomm_mem_t*> temp_regs;

 private:
  void settle(std::exception_ptr e);  // every request is over: run on_done, release, finish
  void release_all();
  std::shared_ptr<World> _world;
  std::string _what;
  std::vector<hcomm_request_t*> _reqs;
  Ms _timeout;
  std::vector<at::Tensor> _keep;
  mutable std::mutex _mu;
  bool _settled = false;
  std::exception_ptr _error;
  int _source = -1;
};

class ProcessGroupHcomm : public c10d::ProcessGroup {
 public:
  ProcessGroupHcomm(std::shared_ptr<World> world, int rank, int size, std::vector<int> world_ranks, uint32_t group_id,
                    Ms timeout);
  const std::string getBackendName() const override { return "hcomm"; }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;

  const std::shared_ptr<World>& world() const { return _world; }
  int world_rank(int group_rank) const;
  int group_rank(int world_rank) const;  // -1: not in this group
  Ms timeout() const { return _timeout; }
  uint64_t p2p_tag(int tag) const;

 private:
  Ms timeout_of(Ms t) const { return t.count() < 0 ? _timeout : t; }
  uint64_t next_collective_tag();
  // One ring step: send [s, s+slen) to the right, receive [r, r+rlen) from the left.
  void ring_step(const void* s, size_t slen, void* r, size_t rlen, uint64_t tag, Ms timeout);
  // Ring collectives over chunk views (chunk i: the piece rank i ends up owning).
  void reduce_scatter_ring(std::vector<at::Tensor>& chunks, const c10d::ReduceOp& op, Ms timeout);
  void allgather_ring(std::vector<at::Tensor>& chunks, Ms timeout);
  c10::intrusive_ptr<c10d::Work> done(c10d::OpType type, std::vector<at::Tensor> keep = {});

  std::shared_ptr<World> _world;
  std::vector<int> _world_ranks;  // by group rank
  uint32_t _group_id;
  Ms _timeout;
  std::mutex _mu;
  uint64_t _collective_seq = 0;
};

// The process's World for a new group: the default group (no world ranks
// given) starts it; a later group shares it.
c10::intrusive_ptr<ProcessGroupHcomm> create_process_group(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                           int size, const std::vector<int64_t>& world_ranks,
                                                           const std::string& group_id, Ms timeout);

// A CPU tensor hcomm can move: contiguous, on the CPU; its bytes.
void check_tensor(const at::Tensor& t, const char* what);

}  // namespace hcomm::torch_backend
