// Bootstrap: who am I, how many are we, and a way to swap small blobs with
// everyone before any data path exists.
//
// The launch is read from what clusters already set (torchrun, Open MPI's
// mpirun, PMIx, hcomm-run); there is no home-made cluster manager. The
// exchange is a TCP rendezvous in the style of torch's TCPStore: rank 0
// listens, every other rank connects to it, and rank 0 relays each
// collective. Collectives are called by every rank in the same order; rank 0
// checks that (sequence numbers) and turns any mismatch into protocol_error.
//
// Failure: every wait has a deadline. A rank whose connection breaks makes
// rank 0 fail the collective with peer_failure and tell the survivors (who
// fail with the same code and a message naming the rank); a rank that never
// joins makes create() fail with timeout naming it. After any failure the
// Bootstrap is broken: every later call returns the first error.
//
// Not thread-safe: one thread drives a Bootstrap.
#pragma once

#include <memory>
#include <string>
#include <vector>

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
  // Largest blob one rank may contribute to allgather.
  static constexpr size_t kMaxBlob = 64 * 1024;

  // Joins the rendezvous; returns when every rank has joined (or fails with
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

  ~Bootstrap();
  Bootstrap(const Bootstrap&) = delete;
  Bootstrap& operator=(const Bootstrap&) = delete;

  int rank() const noexcept { return _rank; }
  int size() const noexcept { return _size; }
  // The launch's job id, or one derived from the rendezvous address; never
  // empty. Shared by all ranks.
  const std::string& job_id() const noexcept { return _job_id; }

  // Every rank contributes one blob (0..kMaxBlob bytes); on success
  // (*all)[r] is rank r's blob on every rank.
  Status allgather(const std::string& mine, std::vector<std::string>* all, const Deadline& deadline);
  // Returns once every rank has entered it.
  Status barrier(const Deadline& deadline);

 private:
  Bootstrap(int rank, int size, std::string job_id);
  Status fail(Status st);  // records the first failure, returns it
  Status allgather_root(const std::string& mine, std::vector<std::string>* all, const Deadline& dl);
  Status allgather_leaf(const std::string& mine, std::vector<std::string>* all, const Deadline& dl);
  void abort_all(const Status& why);  // rank 0: best-effort ABORT to every live rank

  int _rank;
  int _size;
  std::string _job_id;
  uint32_t _seq = 0;  // collectives completed so far; identical on every rank
  Status _failed;     // first failure; once set, every call returns it
  // Rank 0: _peers[r] is rank r's connection (invalid for r == 0).
  // Other ranks: _peers[0] is the connection to rank 0, the rest invalid.
  std::vector<UniqueFd> _peers;

  friend struct BootstrapBuilder;
};

}  // namespace hcomm::api
