// Child processes for integration tests: start a program with its stdout and
// stderr on pipes, collect both (poll()), kill it after a time limit, and
// return {status, out, err, ms}; plus the line-splitting helpers the tests
// compare output with. Every wait is bounded.
#pragma once

#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <functional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace hcomm::test {

inline std::string env_or(const char* k, const char* dflt) {
  const char* v = std::getenv(k);
  return v != nullptr ? v : dflt;
}

struct ChildResult {
  int status = -1;  // exit status, 128 + signal if killed; -1 if it never started
  std::string out, err;
  long ms = 0;  // wall time from finish_child()'s start to the child's reaping
};

// Variables that would make a child think it is already a rank.
inline std::vector<std::string> launch_vars() {
  return {"RANK",         "WORLD_SIZE", "LOCAL_RANK",           "LOCAL_WORLD_SIZE",     "MASTER_ADDR",
          "MASTER_PORT",  "HCOMM_JOB_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"};
}

// The child's environment: the parent's, less `unset`, plus `set`.
struct ChildEnv {
  std::vector<std::string> unset = launch_vars();
  std::vector<std::pair<std::string, std::string>> set;
};

// Starts args (args[0] found on PATH unless it holds a '/') with stdout and
// stderr on pipes, returned in *out_fd and *err_fd. Returns the pid, or -1.
inline pid_t start_child(const std::vector<std::string>& args, int* out_fd, int* err_fd, const ChildEnv& env = {}) {
  int po[2], pe[2];
  if (::pipe(po) != 0) return -1;
  if (::pipe(pe) != 0) {
    ::close(po[0]);
    ::close(po[1]);
    return -1;
  }
  pid_t pid = ::fork();
  if (pid == 0) {
    for (const auto& v : env.unset) ::unsetenv(v.c_str());
    for (const auto& [k, v] : env.set) ::setenv(k.c_str(), v.c_str(), 1);
    ::dup2(po[1], 1);
    ::dup2(pe[1], 2);
    ::close(po[0]);
    ::close(pe[0]);
    ::close(po[1]);
    ::close(pe[1]);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(po[1]);
  ::close(pe[1]);
  if (pid < 0) {
    ::close(po[0]);
    ::close(pe[0]);
    return -1;
  }
  *out_fd = po[0];
  *err_fd = pe[0];
  return pid;
}

// Reads both pipes until EOF; kills the child after limit_ms (and says so at
// the end of err). on_out, if given, sees all of stdout so far after each read.
inline ChildResult finish_child(pid_t pid, int ofd, int efd, int limit_ms,
                                const std::function<void(const std::string&)>& on_out = {}) {
  ChildResult r;
  if (pid <= 0) return r;
  auto t0 = std::chrono::steady_clock::now();
  auto until = t0 + std::chrono::milliseconds(limit_ms);
  int fds[2] = {ofd, efd};
  std::string* bufs[2] = {&r.out, &r.err};
  while (fds[0] >= 0 || fds[1] >= 0) {
    pollfd p[2] = {{fds[0], POLLIN, 0}, {fds[1], POLLIN, 0}};
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now()).count();
    if (left <= 0 || ::poll(p, 2, static_cast<int>(left)) <= 0) {
      ::kill(pid, SIGKILL);
      r.err += "\n[test] killed after " + std::to_string(limit_ms) + " ms\n";
      break;
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i] < 0 || p[i].revents == 0) continue;
      char buf[8192];
      ssize_t n = ::read(fds[i], buf, sizeof buf);
      if (n <= 0) {
        ::close(fds[i]);
        fds[i] = -1;
      } else {
        bufs[i]->append(buf, static_cast<size_t>(n));
        if (i == 0 && on_out) on_out(r.out);
      }
    }
  }
  for (int f : fds)
    if (f >= 0) ::close(f);
  int st = 0;
  ::waitpid(pid, &st, 0);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  r.ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

// start_child() then finish_child(); status -1 if it could not be started.
inline ChildResult run_child(const std::vector<std::string>& args, int limit_ms, const ChildEnv& env = {},
                             const std::function<void(const std::string&)>& on_out = {}) {
  int o = -1, e = -1;
  pid_t pid = start_child(args, &o, &e, env);
  return finish_child(pid, o, e, limit_ms, on_out);
}

inline std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> v;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) v.push_back(l);
  return v;
}

// Splits at runs of whitespace (no std::regex: GCC 12 warns inside it under ASan).
inline std::vector<std::string> words(const std::string& s) {
  std::vector<std::string> v;
  std::istringstream in(s);
  for (std::string w; in >> w;) v.push_back(w);
  return v;
}

inline std::vector<std::string> sorted(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  return v;
}

inline std::vector<std::string> sorted_lines(const std::string& s) { return sorted(lines(s)); }

}  // namespace hcomm::test
