// run_ranks: forks N ranks of one test body, each a real hcomm process
// (bootstrap through the environment, as hcomm-run sets it), and collects
// their verdicts. Inside a rank, CHECK() reports and exits non-zero; the
// parent turns that into a gtest failure. Every rank is bounded in time.
#pragma once

#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace hcomm::test {

struct RankFailure {};

class CheckStream {
 public:
  CheckStream(const char* file, int line, const char* expr) { _s << file << ":" << line << ": CHECK(" << expr << ") "; }
  ~CheckStream() {
    std::fprintf(stderr, "[rank %s] %s\n", std::getenv("RANK") ? std::getenv("RANK") : "?", _s.str().c_str());
    std::fflush(stderr);
    ::_exit(1);
  }
  template <typename T>
  CheckStream& operator<<(const T& v) {
    _s << v;
    return *this;
  }

 private:
  std::ostringstream _s;
};

#define RCHECK(cond)            \
  if (cond) {                 \
  } else             \
    ::hcomm::test::CheckStream(__FILE__, __LINE__, #cond)

#define RCHECK_OK(expr)                                                                                   \
  if (hcomm_status_t _s = (expr); _s == HCOMM_OK) {                                                       \
  } else                                                                                                  \
    ::hcomm::test::CheckStream(__FILE__, __LINE__, #expr) << "= " << hcomm_strerror(_s) << " (" << hcomm_last_error() << ") "

#define RCHECK_EQ_STATUS(expr, want)                                                                      \
  if (hcomm_status_t _s = (expr); _s == (want)) {                                                         \
  } else                                                                                                  \
    ::hcomm::test::CheckStream(__FILE__, __LINE__, #expr) << "= " << hcomm_strerror(_s) << ", want "      \
                                                           << hcomm_strerror(want) << " (" << hcomm_last_error() << ") "

// Spread mode, for a job across machines (the qemu suite's two guests):
// HCOMM_TEST_HOSTS=H, HCOMM_TEST_HOST_INDEX=i, HCOMM_TEST_MASTER=ADDR[:PORT]
// (default port 29500). Every machine runs the same tests in the same order;
// this one forks only the ranks r with r % H == i (so a ring crosses
// machines), and all of them meet at ADDR on a port that advances with each
// job (PORT + job number), torchrun style (MASTER_ADDR/MASTER_PORT).
struct Spread {
  int hosts = 1, index = 0, port = 0;
  std::string master;
};
inline Spread spread() {
  Spread s;
  const char* h = std::getenv("HCOMM_TEST_HOSTS");
  const char* m = std::getenv("HCOMM_TEST_MASTER");
  if (h == nullptr || m == nullptr) return s;
  s.hosts = std::max(1, std::atoi(h));
  const char* i = std::getenv("HCOMM_TEST_HOST_INDEX");
  s.index = i != nullptr ? std::atoi(i) : 0;
  s.master = m;
  s.port = 29500;
  if (auto c = s.master.find(':'); c != std::string::npos) {
    s.port = std::atoi(s.master.c_str() + c + 1);
    s.master.resize(c);
  }
  return s;
}

// Forks n ranks running body(rank); env entries are set in every child.
// Returns "" if every rank exited 0, else a description.
// Ranks listed in killed_ok may end by SIGKILL (tests that kill a rank on purpose).
inline std::string run_ranks(int n, const std::vector<std::pair<std::string, std::string>>& env,
                             const std::function<void(int rank)>& body, int timeout_s = 120,
                             const std::vector<int>& killed_ok = {}) {
  static std::atomic<int> seq{0};
  const Spread sp = spread();
  const int job_no = seq++;
  std::string job = sp.hosts > 1 ? "x" + std::to_string(job_no) : "t" + std::to_string(::getpid()) + "-" + std::to_string(job_no);
  std::vector<pid_t> pids;
  std::vector<int> ranks;
  for (int r = 0; r < n; ++r) {
    if (r % sp.hosts != sp.index) continue;
    pid_t pid = ::fork();
    if (pid < 0) return "fork failed";
    if (pid == 0) {
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r / sp.hosts).c_str(), 1);
      ::setenv("HCOMM_JOB_ID", job.c_str(), 1);
      if (sp.hosts > 1) {
        ::setenv("MASTER_ADDR", sp.master.c_str(), 1);
        ::setenv("MASTER_PORT", std::to_string(sp.port + job_no).c_str(), 1);
      } else {
        ::unsetenv("MASTER_ADDR");
        ::unsetenv("MASTER_PORT");
      }
      for (auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
      body(r);
      std::fflush(stdout);
      ::_exit(0);
    }
    pids.push_back(pid);
    ranks.push_back(r);
  }
  std::string err;
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  size_t left = pids.size();
  std::vector<bool> reaped(pids.size(), false);
  while (left > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (reaped[i]) continue;
      int st = 0;
      pid_t w = ::waitpid(pids[i], &st, WNOHANG);
      if (w == pids[i]) {
        reaped[i] = true;
        --left;
        if (WIFEXITED(st) && WEXITSTATUS(st) == 0) continue;
        if (WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL &&
            std::find(killed_ok.begin(), killed_ok.end(), ranks[i]) != killed_ok.end())
          continue;
        err += "rank " + std::to_string(ranks[i]) +
               (WIFEXITED(st) ? " exited " + std::to_string(WEXITSTATUS(st)) : " killed by signal " + std::to_string(WTERMSIG(st))) +
               "; ";
      }
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > until) {
      for (size_t i = 0; i < pids.size(); ++i)
        if (!reaped[i]) ::kill(pids[i], SIGKILL), ::waitpid(pids[i], nullptr, 0);
      return err + "ranks still running after " + std::to_string(timeout_s) + " s (killed)";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return err;
}

}  // namespace hcomm::test
