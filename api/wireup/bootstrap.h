// Bootstrap: who am I, how many are we, and a way to swap small blobs with
// everyone before any data path exists.
//
// The launch is read from what clusters already set (torchrun, Open MPI's
// mpirun, PMIx, hcomm-run); there is no home-made cluster manager.
// Bootstrap is an interface with two implementations:
//  - create(): a TCP rendezvous in the style of torch's TCPStore: rank 0
//    listens, every other rank connects to it, and rank 0 relays each
//    collective. Collectives are called by every rank in the same order;
//    rank 0 checks that (sequence numbers) and turns any mismatch into
//    protocol_error.
//  - from_store(): through a key-value store the job already has (torch's
//    c10d store under torchrun / env://, whose TCPStore owns MASTER_PORT);
//    no listener of its own. See from_store for the key layout.
//
// Failure, both kinds: every wait has a deadline. A rank that never joins
// makes create() / from_store() fail with timeout naming it. On TCP a rank
// whose connection breaks makes rank 0 fail the collective with peer_failure
// and tell the survivors (who fail with the same code and a message naming
// the rank); over a store a rank that vanishes is seen as a timeout naming
// it (a store cannot tell dead from slow), and a rank that fails publishes
// why so that the others fail with its reason instead of waiting. After any
// failure the Bootstrap is broken: every later call returns the first error.
//
// Not thread-safe: one thread drives a Bootstrap.
#pragma once

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "api/wireup/kv_store.h"
#include "common/fd.h"
#include "common/status.h"
#include "common/time.h"

namespace hcomm::api {

struct LaunchInfo {
  int rank = 0;
  int size = 1;
  std::string source;  // "torchrun", "openmpi", "pmix", "hcomm-run", "single"
  std::string job_id;  // unique per launch where the launcher provides one; may be empty
  std::string master_addr;  // empty: single-host file rendezvous (see Bootstrap::create)
  int master_port = 0;
  int local_rank = 0;
};

// Reads the launch from the environment, first match wins:
//  1. RANK + WORLD_SIZE (torchrun style; MASTER_ADDR/MASTER_PORT/LOCAL_RANK
//     optional); source "hcomm-run" when HCOMM_JOB_ID is set (its job id),
//     else "torchrun" (job id from TORCHELASTIC_RUN_ID if set).
//  2. OMPI_COMM_WORLD_RANK + OMPI_COMM_WORLD_SIZE (+ _LOCAL_RANK); job id from
//     OMPI_MCA_ess_base_jobid, else PMIX_NAMESPACE.
//  3. PMIX_RANK + PMIX_NAMESPACE; size from OMPI_COMM_WORLD_SIZE, else
//     PMIX_SIZE, else invalid_argument (PMIx keeps the size in its server,
//     not the environment).
//  4. Nothing: a single rank ("single").
// MASTER_ADDR/MASTER_PORT are honoured with 2 and 3 too. Malformed values
// (non-numeric, rank outside [0, size), size < 1, port outside 1..65535,
// only one of RANK/WORLD_SIZE) are invalid_argument naming the variable.
Status detect_launch(LaunchInfo* out);

class Bootstrap {
 public:
  // Largest blob one rank may contribute to allgather: 64 KiB less room for
  // the store implementation's value header (hcomm_kv_store_t promises its
  // implementers values of at most 64 KiB).
  static constexpr size_t kMaxBlob = 64 * 1024 - 64;
  // Largest world, and longest job id, either implementation accepts.
  static constexpr int kMaxRanks = 65536;
  static constexpr size_t kMaxJobId = 1024;

  // TCP rendezvous. Joins; returns when every rank has joined (or fails with
  // timeout after timeout_ms, naming the ranks that did not show up).
  //  - size == 1: no network at all.
  //  - master_addr set: rank 0 listens on master_addr:master_port (numeric
  //    IPv4/IPv6 or a host name); the others connect, retrying until the
  //    deadline (rank 0 may start last).
  //  - master_addr empty (mpirun without MASTER_ADDR): SINGLE HOST ONLY.
  //    Rank 0 listens on 127.0.0.1 with an ephemeral port and publishes it in
  //    /tmp/hcomm-<uid>/job-<job id>.port (written to a temp file, then
  //    renamed, so readers never see half a file); the others poll for that
  //    file until the deadline. Needs a job id. Rank 0 removes the file once
  //    everyone has joined.
  static Status create(const LaunchInfo& info, int timeout_ms, std::unique_ptr<Bootstrap>* out);

  // Store rendezvous: rank/size come from the caller (the store's owner knows
  // them), job_id names the job inside the store ("" -> "store"; ranks of one
  // job pass the same, and a job id is used once per store). Collective #s
  // (s = 0 is the join this call performs, the caller's first collective is
  // #1) is: rank r sets "hcomm/<job>/<s>/<r>" to a 16-byte header (magic,
  // version, kind, world size, rank) + its blob, then gets every other rank's
  // key. A value with another world size, rank or collective kind (a barrier
  // against an allgather) is protocol_error; keys that do not appear before
  // the deadline are a timeout naming the ranks that did not contribute. A
  // rank that fails sets "hcomm/<job>/abort" to its reason; waits look at it
  // every 200 ms and fail with that reason (first failure wins, as on TCP).
  // size == 1 touches no store. The store is owned by the Bootstrap.
  static Status from_store(int rank, int size, std::string job_id, std::unique_ptr<KvStore> store, int timeout_ms,
                           std::unique_ptr<Bootstrap>* out);

  virtual ~Bootstrap();
  Bootstrap(const Bootstrap&) = delete;
  Bootstrap& operator=(const Bootstrap&) = delete;

  int rank() const noexcept { return _rank; }
  int size() const noexcept { return _size; }
  // The launch's job id, or one derived from the rendezvous address ("store"
  // for a store without one); never empty. Shared by all ranks.
  const std::string& job_id() const noexcept { return _job_id; }

  // Every rank contributes one blob (0..kMaxBlob bytes); on success
  // (*all)[r] is rank r's blob on every rank.
  Status allgather(const std::string& mine, std::vector<std::string>* all, const Deadline& deadline);
  // Returns once every rank has entered it.
  Status barrier(const Deadline& deadline);
  // Called between slices of a collective's wait for other ranks (the
  // context answers what peers wait for: verbs' revocation notices); it
  // returns whether it found anything to do. The first slice is
  // kIdleSliceMs long, each idle one after it twice the last, up to
  // kIdleSliceMaxMs: a rank waiting long in a barrier (a passive target)
  // wakes a few dozen times a second, not 500 (each wake is a vCPU taken
  // out of halt in a QEMU guest: 5-7 % on a waiting target's 8-byte get
  // and fetch_add over rxe), and a peer's release is answered within
  // kIdleSliceMaxMs.
  void on_idle(std::function<bool()> f) { _idle = std::move(f); }

 protected:
  // What a collective is, for implementations that can check it (the store).
  enum class Collective : uint16_t { join = 1, allgather = 2, barrier = 3 };

  Bootstrap(int rank, int size, std::string job_id);
  // One collective, numbered `seq` (identical on every rank); only called
  // while healthy and with size() > 1, `mine` within kMaxBlob. On success
  // (*all)[r] holds rank r's blob. A failure is recorded by the caller.
  virtual Status exchange(uint32_t seq, Collective kind, const std::string& mine, std::vector<std::string>* all,
                          const Deadline& deadline) = 0;
  // Called once, at the first failure: let go of connections so that peers
  // still waiting on us wake up.
  virtual void broken(const Status& why) noexcept { (void)why; }
  // The number the next collective will carry.
  uint32_t seq() const noexcept { return _seq; }
  // Implementations call it between slices of their waits: the TCP
  // rendezvous's slices are idle_slice_ms() long when a hook is set; the
  // store's are its abort poll's, 200 ms.
  void idle() {
    if (_idle) _idle_slice_ms = _idle() ? kIdleSliceMs : std::min(2 * _idle_slice_ms, kIdleSliceMaxMs);
  }
  bool has_idle() const noexcept { return static_cast<bool>(_idle); }
  int idle_slice_ms() const noexcept { return _idle_slice_ms; }
  static constexpr int kIdleSliceMs = 2;
  static constexpr int kIdleSliceMaxMs = 32;

 private:
  Status run(Collective kind, const std::string& mine, std::vector<std::string>* all, const Deadline& deadline);

  int _rank;
  int _size;
  std::string _job_id;
  uint32_t _seq = 0;  // collectives completed so far; identical on every rank
  Status _failed;     // first failure; once set, every call returns it
  std::function<bool()> _idle;
  int _idle_slice_ms = kIdleSliceMs;  // the next slice of a wait (idle())
};

}  // namespace hcomm::api
