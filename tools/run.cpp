// hcomm-run: starts N ranks of a program on this host, the way torchrun or
// mpirun would, for tests, examples and laptops.
//
//   hcomm-run -n N [--sim] [--sim-devices K] [--timeout SEC] [--grace SEC] [--] prog args...
//
// Every rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR=127.0.0.1, MASTER_PORT (a port that was free a moment ago) and
// HCOMM_JOB_ID (unique per run), which api::detect_launch reads. Each output
// line of rank r is written as "[r] line" to hcomm-run's stdout or stderr
// (kept apart), in one write, so lines never mix mid-line; a line longer
// than 64 KiB is split. The ranks' stdin is /dev/null.
//
// Simulator: with --sim, or when HCOMM_ENGINE=npu, HCOMM_DEVICE is unset and
// no simulator socket exists in $HCOMM_SIM_DIR (default /tmp/hcomm-sim-<uid>), hcomm-sim is
// started in a fresh temp dir with --devices max(N,2) (or K), its output is
// prefixed "[sim] ", HCOMM_SIM_DIR points the ranks at it, and it is stopped
// at the end. hcomm-sim is looked up next to this binary
// (<dir>/../sim/hcomm-sim, the build tree layout), then on PATH.
//
// Exit status: the worst (largest) status of the ranks that ended on their
// own, a rank killed by a signal counting as 128+signo. When a rank fails
// the others get --grace seconds (default 10) to finish, then SIGTERM and,
// 2 s later, SIGKILL; ranks stopped that way do not count. --timeout: after
// SEC everything is stopped the same way and the status is 124. SIGINT /
// SIGTERM / SIGHUP to hcomm-run stop every rank and give 128+signo. 2: usage
// or start-up error. When the simulator hcomm-run started dies while ranks
// run, they get 2 s to fail on their own (HCOMM_ERR_DEVICE), then are
// stopped; the status is then at least 1. Each rank runs in its own process
// group, which is killed when the run ends, so no stray grandchild outlives it.
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/paths.h"
#include "tools/options.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxLine = 64 * 1024;
constexpr auto kKillDelay = std::chrono::seconds(2);

using hcomm::tools::RunOptions;
namespace tools = hcomm::tools;
constexpr const char* kUsage =
    "usage: hcomm-run -n N [--sim] [--sim-devices K] [--timeout SEC] [--grace SEC] [--] prog args...\n";

// Exits 0 on --help (usage on stdout), 2 with usage on stderr on a bad command line.
RunOptions parse(int argc, char** argv) {
  RunOptions o;
  std::string why;
  switch (tools::parse_run_args(std::vector<std::string>(argv + 1, argv + argc), &o, &why)) {
    case tools::Parsed::run:
      return o;
    case tools::Parsed::help:
      std::fputs(kUsage, stdout);
      std::exit(0);
    case tools::Parsed::usage_error:
      break;
  }
  std::fprintf(stderr, "hcomm-run: %s\n%s", why.c_str(), kUsage);
  std::exit(2);
}

void write_full(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = ::write(fd, s.data() + off, s.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // our own output is gone (EPIPE): nothing better to do
    off += static_cast<size_t>(n);
  }
}

// One output stream of one child: reassembles lines and writes each whole.
struct Stream {
  int fd = -1;     // read end of the child's pipe; -1 once at EOF
  int out = 1;     // where its lines go (1 or 2)
  std::string prefix;
  std::string buf;

  void emit(std::string_view line) { write_full(out, prefix + std::string(line) + "\n"); }
  void drain_lines() {
    size_t start = 0;
    for (;;) {
      size_t nl = buf.find('\n', start);
      if (nl == std::string::npos) break;
      emit(std::string_view(buf).substr(start, nl - start));
      start = nl + 1;
    }
    buf.erase(0, start);
    while (buf.size() >= kMaxLine) {
      emit(std::string_view(buf).substr(0, kMaxLine));
      buf.erase(0, kMaxLine);
    }
  }
  // Reads what is there; false at EOF (after flushing a last partial line).
  bool read_some() {
    char tmp[16384];
    ssize_t n = ::read(fd, tmp, sizeof tmp);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return true;
    if (n > 0) {
      buf.append(tmp, static_cast<size_t>(n));
      drain_lines();
      return true;
    }
    if (!buf.empty()) emit(buf);
    buf.clear();
    ::close(fd);
    fd = -1;
    return false;
  }
};

struct Child {
  pid_t pid = -1;      // -1 once reaped
  int status = -1;     // exit status as a shell reports it (128+signo for a signal)
  bool stopped_by_us = false;
  Stream out, err;
};

int shell_status(int st) {
  if (WIFEXITED(st)) return WEXITSTATUS(st);
  if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
  return 255;
}

sigset_t g_old_mask;

// Forks a child with stdout/stderr on fresh pipes. In the child: own process
// group, default signal dispositions and mask, stdin from /dev/null, `env`
// added, then exec (127 if that fails).
bool spawn(const std::vector<std::string>& args, const std::vector<std::pair<std::string, std::string>>& env,
           const std::string& prefix, Child* c) {
  int po[2], pe[2];
  if (::pipe2(po, O_CLOEXEC) != 0) return false;
  if (::pipe2(pe, O_CLOEXEC) != 0) {
    ::close(po[0]);
    ::close(po[1]);
    return false;
  }
  // Everything the child needs is built before fork: after it, only
  // async-signal-safe calls (and setenv, safe here: we are single-threaded).
  std::vector<std::string> argcopy = args;
  std::vector<char*> argv;
  for (auto& a : argcopy) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = ::fork();
  if (pid < 0) return false;
  if (pid == 0) {
    ::setpgid(0, 0);
    for (int s : {SIGPIPE, SIGINT, SIGTERM, SIGHUP, SIGCHLD}) ::signal(s, SIG_DFL);
    ::sigprocmask(SIG_SETMASK, &g_old_mask, nullptr);
    int devnull = ::open("/dev/null", O_RDONLY);
    if (devnull >= 0) ::dup2(devnull, 0);
    ::dup2(po[1], 1);
    ::dup2(pe[1], 2);
    for (auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    ::execvp(argv[0], argv.data());
    const char* e = std::strerror(errno);
    std::string msg = std::string("hcomm-run: cannot exec ") + argv[0] + ": " + e + "\n";
    write_full(2, msg);
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also here, so that kill(-pid) works before the child runs
  ::close(po[1]);
  ::close(pe[1]);
  c->pid = pid;
  c->out = Stream{po[0], 1, prefix, {}};
  c->err = Stream{pe[0], 2, prefix, {}};
  return true;
}

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

std::string sim_binary() {
  char self[4096];
  ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    self[n] = '\0';
    std::filesystem::path p = std::filesystem::path(self).parent_path() / ".." / "sim" / "hcomm-sim";
    if (::access(p.c_str(), X_OK) == 0) return p.lexically_normal().string();
  }
  return "hcomm-sim";  // execvp searches PATH
}

bool wants_sim(const RunOptions& o) {
  if (o.sim) return true;
  const char* eng = std::getenv("HCOMM_ENGINE");
  if (eng == nullptr || std::string(eng) != "npu") return false;
  if (const char* d = std::getenv("HCOMM_DEVICE"); d != nullptr && *d != '\0') return false;  // real devices
  struct stat sb{};
  return ::stat(hcomm::sim_socket_path(hcomm::default_sim_dir(), 0).c_str(), &sb) != 0;
}

void signal_group(const Child& c, int sig) {
  if (c.pid > 0) ::kill(-c.pid, sig);
}

// One run: the simulator when wanted, the ranks, and the event loop that
// relays their output, fires the timers and reaps them. Each step is a
// method; run() strings them together.
class Launcher {
 public:
  explicit Launcher(RunOptions opt) : _opt(std::move(opt)) {}
  ~Launcher() {
    if (_sfd >= 0) ::close(_sfd);
  }
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;

  // The whole run; returns hcomm-run's exit status (see the header comment).
  int run() {
    if (!watch_signals() || !make_env() || !start_sim()) return 2;
    _ranks.resize(static_cast<size_t>(_opt.n));
    if (_opt.timeout_s > 0) _run_deadline = Clock::now() + seconds(_opt.timeout_s);
    if (_sim) {
      _sim_ready_by = Clock::now() + std::chrono::seconds(15);
    } else {
      start_ranks();
    }
    while (!finished()) {
      if (_sim && !_started && !_stopping) await_sim();
      fire_timers();
      poll_once();
      reap();
    }
    close_pipes();
    stop_sim();
    return exit_status();
  }

 private:
  static Clock::duration seconds(double s) {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  }

  // Signals arrive through a signalfd, in the one event loop: no handlers,
  // no EINTR races. Children get the old mask back before exec.
  bool watch_signals() {
    sigset_t mask;
    sigemptyset(&mask);
    for (int s : {SIGCHLD, SIGINT, SIGTERM, SIGHUP}) sigaddset(&mask, s);
    ::sigprocmask(SIG_BLOCK, &mask, &g_old_mask);
    ::signal(SIGPIPE, SIG_IGN);
    _sfd = ::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (_sfd < 0) std::perror("hcomm-run: signalfd");
    return _sfd >= 0;
  }

  // The variables every rank gets (RANK and LOCAL_RANK are added per rank).
  bool make_env() {
    const int port = free_port();
    if (port < 0) {
      std::perror("hcomm-run: picking a free port");
      return false;
    }
    timespec ts{};
    ::clock_gettime(CLOCK_REALTIME, &ts);
    char job[64];
    std::snprintf(job, sizeof job, "hcomm-run-%d-%lx%09ld", static_cast<int>(::getpid()),
                  static_cast<unsigned long>(ts.tv_sec), static_cast<long>(ts.tv_nsec));
    _env = {
        {"WORLD_SIZE", std::to_string(_opt.n)},       {"LOCAL_WORLD_SIZE", std::to_string(_opt.n)},
        {"MASTER_ADDR", "127.0.0.1"},                 {"MASTER_PORT", std::to_string(port)},
        {"HCOMM_JOB_ID", job},
    };
    return true;
  }

  // The simulator, when wanted. It is a Child too, so its output is prefixed
  // and its exit is reaped by the same loop.
  bool start_sim() {
    if (!wants_sim(_opt)) return true;
    char tmpl[] = "/tmp/hcomm-run-sim-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) {
      std::perror("hcomm-run: mkdtemp");
      return false;
    }
    _sim_dir = tmpl;
    const int devices = _opt.sim_devices > 0 ? _opt.sim_devices : std::max(_opt.n, 2);
    _sim.emplace();
    if (!spawn({sim_binary(), "--dir", _sim_dir, "--devices", std::to_string(devices)}, {}, "[sim] ", &*_sim)) {
      std::perror("hcomm-run: starting hcomm-sim");
      return false;
    }
    _env.emplace_back("HCOMM_SIM_DIR", _sim_dir);
    return true;
  }

  void start_ranks() {
    _started = true;
    for (int r = 0; r < _opt.n; ++r) {
      auto e = _env;
      e.emplace_back("RANK", std::to_string(r));
      e.emplace_back("LOCAL_RANK", std::to_string(r));
      if (!spawn(_opt.argv, e, "[" + std::to_string(r) + "] ", &_ranks[static_cast<size_t>(r)])) {
        std::perror("hcomm-run: fork");
        _startup_failed = true;
        stop_all();
        return;
      }
    }
  }

  // Every rank started was reaped (or none will start).
  bool ranks_done() const { return (_started || _stopping) && live() == 0; }

  int live() const {
    int k = 0;
    for (const auto& c : _ranks) k += c.pid > 0;
    return k;
  }

  // Asks every live rank to stop; SIGKILL follows kKillDelay later.
  void stop_all() {
    if (_stopping) return;
    _stopping = true;
    for (auto& c : _ranks)
      if (c.pid > 0) {
        c.stopped_by_us = true;
        signal_group(c, SIGTERM);
      }
    _kill_at = Clock::now() + kKillDelay;
  }

  // Starting: the ranks wait for the simulator's ready file.
  void await_sim() {
    if (std::filesystem::exists(_sim_dir + "/ready")) {
      _sim_ready_by.reset();
      start_ranks();
    } else if (_sim->pid < 0 || Clock::now() >= *_sim_ready_by) {
      std::fprintf(stderr, "hcomm-run: hcomm-sim %s\n",
                   _sim->pid < 0 ? "exited during start-up" : "was not ready within 15 s");
      _startup_failed = true;
      _stopping = true;
      _sim_ready_by.reset();
    }
  }

  // Done when every rank has been reaped and its pipes are drained. Each
  // group was killed when its rank was reaped, so the pipes reach EOF at
  // once; the bound only guards against a process that left its group and
  // kept a pipe.
  bool finished() {
    if (!ranks_done()) return false;
    bool pipes_open = false;
    for (const auto& c : _ranks) pipes_open |= c.out.fd >= 0 || c.err.fd >= 0;
    if (!_drain_until) _drain_until = Clock::now() + std::chrono::seconds(1);
    return !pipes_open || Clock::now() >= *_drain_until;
  }

  void fire_timers() {
    const auto t = Clock::now();
    if (_run_deadline && t >= *_run_deadline && !_timed_out && !ranks_done()) {
      _timed_out = true;
      std::fprintf(stderr, "hcomm-run: timeout after %g s, stopping all ranks\n", _opt.timeout_s);
      stop_all();
    }
    if (_timed_out) _run_deadline.reset();  // fired timers leave the poll timeout alone
    if (_grace_at && t >= *_grace_at) {
      if (!_stopping) std::fprintf(stderr, "hcomm-run: grace period over, stopping the remaining ranks\n");
      stop_all();
      _grace_at.reset();
    }
    if (_kill_at && t >= *_kill_at) {
      for (auto& c : _ranks) signal_group(c, SIGKILL);
      _kill_at.reset();
    }
  }

  // Until the next timer (at most 1 s; 10 ms while the simulator starts).
  int wait_ms() const {
    std::optional<Clock::time_point> next;
    for (const auto& tp : {_run_deadline, _grace_at, _kill_at, _drain_until, _sim_ready_by})
      if (tp && (!next || *tp < *next)) next = tp;
    int ms = -1;
    if (next) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(*next - Clock::now()).count();
      ms = static_cast<int>(std::clamp<long long>(left, 0, 1000));
    }
    if (_sim && !_started) ms = ms < 0 ? 10 : std::min(ms, 10);
    return ms;
  }

  // Relays what the children wrote and handles the signals that came.
  void poll_once() {
    std::vector<pollfd> pfds{{_sfd, POLLIN, 0}};
    std::vector<Stream*> streams{nullptr};
    auto add = [&](Stream& s) {
      if (s.fd >= 0) {
        pfds.push_back({s.fd, POLLIN, 0});
        streams.push_back(&s);
      }
    };
    for (auto& c : _ranks) add(c.out), add(c.err);
    if (_sim) add(_sim->out), add(_sim->err);
    const int n = ::poll(pfds.data(), pfds.size(), wait_ms());
    if (n < 0 && errno != EINTR) {
      std::perror("hcomm-run: poll");
      stop_all();
    }
    for (size_t i = 1; i < pfds.size(); ++i)
      if (pfds[i].revents != 0) streams[i]->read_some();
    if (n > 0 && pfds[0].revents != 0) read_signals();
  }

  void read_signals() {
    signalfd_siginfo si;
    while (::read(_sfd, &si, sizeof si) == static_cast<ssize_t>(sizeof si)) {
      const int sig = static_cast<int>(si.ssi_signo);
      if (sig == SIGCHLD) continue;  // reaped below
      if (_interrupted == 0) {
        _interrupted = sig;
        std::fprintf(stderr, "hcomm-run: %s, stopping all ranks\n", ::strsignal(sig));
      }
      stop_all();
      if (!_started) _stopping = true;
    }
  }

  // Reaps whatever exited (SIGCHLD coalesces: loop until nothing is left).
  void reap() {
    for (;;) {
      int st;
      const pid_t p = ::waitpid(-1, &st, WNOHANG);
      if (p <= 0) return;
      if (_sim && p == _sim->pid) {
        sim_exited(shell_status(st));
        continue;
      }
      for (size_t r = 0; r < _ranks.size(); ++r)
        if (_ranks[r].pid == p) rank_exited(r, shell_status(st));
    }
  }

  void sim_exited(int status) {
    _sim->pid = -1;
    _sim->status = status;
    if (!_started || _stopping || live() == 0) return;
    // The ranks' devices are gone: they fail their operations with
    // HCOMM_ERR_DEVICE on their own; whatever has not exited within 2 s is stopped.
    _sim_died = true;
    std::fprintf(stderr,
                 "hcomm-run: hcomm-sim exited early (status %d): the ranks' NPUs are gone; stopping the ranks "
                 "in 2 s\n",
                 status);
    const auto at = Clock::now() + std::chrono::seconds(2);
    if (!_grace_at || *_grace_at > at) _grace_at = at;
    _grace_started = true;
  }

  void rank_exited(size_t r, int status) {
    Child& c = _ranks[r];
    // Kill what the rank left behind in its group, then forget the pid.
    ::kill(-c.pid, SIGKILL);
    c.pid = -1;
    c.status = status;
    if (c.status != 0 && !c.stopped_by_us && !_stopping && live() > 0 && !_grace_started) {
      _grace_started = true;
      std::fprintf(stderr, "hcomm-run: rank %zu failed (status %d); stopping the others in %g s\n", r, c.status,
                   _opt.grace_s);
      _grace_at = Clock::now() + seconds(_opt.grace_s);
    }
  }

  void close_pipes() {
    for (auto& c : _ranks) {
      if (c.out.fd >= 0) ::close(c.out.fd);
      if (c.err.fd >= 0) ::close(c.err.fd);
    }
  }

  // SIGTERM, SIGKILL after 5 s; relays its last output; removes its directory.
  void stop_sim() {
    if (!_sim) return;
    if (_sim->pid > 0) {
      ::kill(_sim->pid, SIGTERM);
      const auto until = Clock::now() + std::chrono::seconds(5);
      int st;
      while (::waitpid(_sim->pid, &st, WNOHANG) == 0) {
        if (Clock::now() >= until) {
          ::kill(_sim->pid, SIGKILL);
          ::waitpid(_sim->pid, &st, 0);
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
    for (Stream* s : {&_sim->out, &_sim->err})
      while (s->fd >= 0 && s->read_some()) {
      }
    std::error_code ec;
    std::filesystem::remove_all(_sim_dir, ec);
  }

  int exit_status() const {
    if (_interrupted != 0) return 128 + _interrupted;
    if (_timed_out) return 124;
    if (_startup_failed) return 2;
    if (_sim_died) {
      int worst = 1;
      for (const auto& c : _ranks) worst = std::max(worst, c.status);
      return worst;
    }
    int worst = 0, worst_any = 0;
    for (const auto& c : _ranks) {
      worst_any = std::max(worst_any, c.status);
      if (!c.stopped_by_us) worst = std::max(worst, c.status);
    }
    return worst != 0 ? worst : worst_any;
  }

  const RunOptions _opt;
  int _sfd = -1;
  std::vector<std::pair<std::string, std::string>> _env;
  std::optional<Child> _sim;
  std::string _sim_dir;
  std::vector<Child> _ranks;
  std::optional<Clock::time_point> _run_deadline, _grace_at, _kill_at, _drain_until, _sim_ready_by;
  int _interrupted = 0;
  bool _timed_out = false, _stopping = false, _grace_started = false, _started = false, _startup_failed = false;
  bool _sim_died = false;
};

}  // namespace

int main(int argc, char** argv) { return Launcher(parse(argc, argv)).run(); }
