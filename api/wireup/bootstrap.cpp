#include "api/wireup/bootstrap.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "api/wireup/bootstrap_wire.h"
#include "api/wireup/run_dir.h"
#include "common/env.h"

namespace hcomm::api {

// ---------------------------------------------------------------- launch --

namespace {


// Parses a decimal integer in [lo, hi]; anything else is invalid_argument
// naming the variable (no exceptions: std::strtol with full-string check).
Status parse_int(const char* name, const char* value, long lo, long hi, int* out) {
  errno = 0;
  char* end = nullptr;
  long v = std::strtol(value, &end, 10);
  if (end == value || *end != '\0' || errno == ERANGE)
    return Status::error(Code::invalid_argument, "%s=\"%s\" is not a decimal integer", name, value);
  if (v < lo || v > hi)
    return Status::error(Code::invalid_argument, "%s=%ld is outside [%ld, %ld]", name, v, lo, hi);
  *out = static_cast<int>(v);
  return Status::ok();
}

constexpr long kMaxRanks = Bootstrap::kMaxRanks;

Status read_master(LaunchInfo* li) {
  const char* addr = env("MASTER_ADDR");
  const char* port = env("MASTER_PORT");
  if ((addr == nullptr) != (port == nullptr))
    return Status::error(Code::invalid_argument, "MASTER_ADDR and MASTER_PORT must be set together (%s is missing)",
                         addr == nullptr ? "MASTER_ADDR" : "MASTER_PORT");
  if (addr == nullptr) return Status::ok();
  li->master_addr = addr;
  return parse_int("MASTER_PORT", port, 1, 65535, &li->master_port);
}

Status check_rank(const LaunchInfo& li, const char* rank_var) {
  if (li.rank >= li.size)
    return Status::error(Code::invalid_argument, "%s=%d is not below the world size %d", rank_var, li.rank,
                         li.size);
  return Status::ok();
}

}  // namespace

Status detect_launch(LaunchInfo* out) {
  if (out == nullptr) return Status::error(Code::invalid_argument, "detect_launch: null output");
  LaunchInfo li;
  const char* rank = env("RANK");
  const char* world = env("WORLD_SIZE");
  if (rank != nullptr || world != nullptr) {
    if (rank == nullptr || world == nullptr)
      return Status::error(Code::invalid_argument, "RANK and WORLD_SIZE must be set together (%s is missing)",
                           rank == nullptr ? "RANK" : "WORLD_SIZE");
    HCOMM_TRY(parse_int("WORLD_SIZE", world, 1, kMaxRanks, &li.size));
    HCOMM_TRY(parse_int("RANK", rank, 0, kMaxRanks - 1, &li.rank));
    HCOMM_TRY(check_rank(li, "RANK"));
    if (const char* lr = env("LOCAL_RANK")) HCOMM_TRY(parse_int("LOCAL_RANK", lr, 0, kMaxRanks - 1, &li.local_rank));
    if (const char* job = env("HCOMM_JOB_ID")) {
      li.source = "hcomm-run";
      li.job_id = job;
    } else {
      li.source = "torchrun";
      if (const char* run = env("TORCHELASTIC_RUN_ID")) li.job_id = run;
    }
    HCOMM_TRY(read_master(&li));
    *out = std::move(li);
    return Status::ok();
  }
  const char* orank = env("OMPI_COMM_WORLD_RANK");
  const char* osize = env("OMPI_COMM_WORLD_SIZE");
  if (orank != nullptr || osize != nullptr) {
    if (orank == nullptr || osize == nullptr)
      return Status::error(Code::invalid_argument,
                           "OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE must be set together (%s is missing)",
                           orank == nullptr ? "OMPI_COMM_WORLD_RANK" : "OMPI_COMM_WORLD_SIZE");
    li.source = "openmpi";
    HCOMM_TRY(parse_int("OMPI_COMM_WORLD_SIZE", osize, 1, kMaxRanks, &li.size));
    HCOMM_TRY(parse_int("OMPI_COMM_WORLD_RANK", orank, 0, kMaxRanks - 1, &li.rank));
    HCOMM_TRY(check_rank(li, "OMPI_COMM_WORLD_RANK"));
    if (const char* lr = env("OMPI_COMM_WORLD_LOCAL_RANK"))
      HCOMM_TRY(parse_int("OMPI_COMM_WORLD_LOCAL_RANK", lr, 0, kMaxRanks - 1, &li.local_rank));
    if (const char* j = env("OMPI_MCA_ess_base_jobid")) li.job_id = j;
    else if (const char* ns = env("PMIX_NAMESPACE")) li.job_id = ns;
    HCOMM_TRY(read_master(&li));
    *out = std::move(li);
    return Status::ok();
  }
  const char* prank = env("PMIX_RANK");
  const char* pns = env("PMIX_NAMESPACE");
  if (prank != nullptr && pns != nullptr) {
    li.source = "pmix";
    li.job_id = pns;
    const char* psize = env("OMPI_COMM_WORLD_SIZE");
    const char* size_var = "OMPI_COMM_WORLD_SIZE";
    if (psize == nullptr) psize = env(size_var = "PMIX_SIZE");
    if (psize == nullptr)
      return Status::error(Code::invalid_argument,
                           "PMIX_RANK is set but the world size is not in the environment "
                           "(OMPI_COMM_WORLD_SIZE or PMIX_SIZE)");
    HCOMM_TRY(parse_int(size_var, psize, 1, kMaxRanks, &li.size));
    HCOMM_TRY(parse_int("PMIX_RANK", prank, 0, kMaxRanks - 1, &li.rank));
    HCOMM_TRY(check_rank(li, "PMIX_RANK"));
    if (const char* lr = env("OMPI_COMM_WORLD_LOCAL_RANK"))
      HCOMM_TRY(parse_int("OMPI_COMM_WORLD_LOCAL_RANK", lr, 0, kMaxRanks - 1, &li.local_rank));
    HCOMM_TRY(read_master(&li));
    *out = std::move(li);
    return Status::ok();
  }
  li.source = "single";
  *out = std::move(li);
  return Status::ok();
}

namespace {

using namespace bootwire;

std::string rank_name(int r) { return "rank " + std::to_string(r); }

std::string endpoint(const std::string& addr, int port) {
  if (addr.find(':') != std::string::npos) return "[" + addr + "]:" + std::to_string(port);
  return addr + ":" + std::to_string(port);
}

// --- rendezvous address: MASTER_ADDR, or the single-host port file ---

std::string port_file(const std::string& dir, const std::string& job) {
  return dir + "/job-" + file_safe_job(job) + ".port";
}

Status publish_port(const std::string& path, int port) {
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Status::from_errno(errno, "create " + tmp);
  std::string body = "hcomm-port " + std::to_string(port) + "\n";
  bool ok = ::write(fd, body.data(), body.size()) == static_cast<ssize_t>(body.size());
  int err = errno;
  ::close(fd);
  // rename(2) is atomic: a reader sees the old file, no file, or this one whole.
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    if (ok) err = errno;
    ::unlink(tmp.c_str());
    return Status::from_errno(err, "publish " + path);
  }
  return Status::ok();
}

// 0 when the file is absent or not (yet) a valid port file.
int read_port_file(const std::string& path) {
  std::ifstream in(path);
  std::string tag;
  long port = 0;
  if (!(in >> tag >> port) || tag != "hcomm-port" || port < 1 || port > 65535) return 0;
  return static_cast<int>(port);
}

Status resolve(const std::string& addr, int port, bool passive, addrinfo** res) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  std::string svc = std::to_string(port);
  int rc = ::getaddrinfo(addr.c_str(), svc.c_str(), &hints, res);
  if (rc != 0)
    return Status::error(Code::invalid_argument, "cannot resolve MASTER_ADDR \"%s\": %s", addr.c_str(),
                         ::gai_strerror(rc));
  return Status::ok();
}

void tune(int fd) {
  int one = 1;
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// Rank 0's listening socket on addr:port (port 0: ephemeral; *bound gets the
// port actually bound).
Status listen_on(const std::string& addr, int port, UniqueFd* out, int* bound) {
  addrinfo* res = nullptr;
  HCOMM_TRY(resolve(addr, port, true, &res));
  Status last = Status::error(Code::io_error, "no usable address for %s", addr.c_str());
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    UniqueFd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
    if (!fd.valid()) {
      last = Status::from_errno(errno, "socket");
      continue;
    }
    int one = 1;
    (void)::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd.get(), 1024) != 0) {
      last = Status::from_errno(errno, "listen on " + endpoint(addr, port));
      continue;
    }
    sockaddr_storage ss{};
    socklen_t sl = sizeof ss;
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &sl) != 0) {
      last = Status::from_errno(errno, "getsockname");
      continue;
    }
    *bound = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    *out = std::move(fd);
    ::freeaddrinfo(res);
    return Status::ok();
  }
  ::freeaddrinfo(res);
  return last;
}

// One connection attempt, bounded by `dl`; errors are retryable by the caller.
Status try_connect(const std::string& addr, int port, const Deadline& dl, UniqueFd* out) {
  addrinfo* res = nullptr;
  HCOMM_TRY(resolve(addr, port, false, &res));
  Status last = Status::error(Code::io_error, "no address for %s", addr.c_str());
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    UniqueFd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
    if (!fd.valid()) {
      last = Status::from_errno(errno, "socket");
      continue;
    }
    if (::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        last = Status::from_errno(errno, "connect " + endpoint(addr, port));
        continue;
      }
      Status w = wait_fd(fd.get(), POLLOUT, dl, "connect " + endpoint(addr, port));
      if (!w) {
        last = w;
        continue;
      }
      int err = 0;
      socklen_t el = sizeof err;
      (void)::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &el);
      if (err != 0) {
        last = Status::from_errno(err, "connect " + endpoint(addr, port));
        continue;
      }
    }
    tune(fd.get());
    *out = std::move(fd);
    ::freeaddrinfo(res);
    return Status::ok();
  }
  ::freeaddrinfo(res);
  return last;
}

std::string list_ranks(const std::vector<int>& rs) {
  std::string s;
  for (int r : rs) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

// Rank 0 answers before the deadline its peers share, so that they hear
// why (a missing rank) instead of timing out on their own.
Deadline root_deadline(const Deadline& dl) {
  auto left = dl.at() - Clock::now();
  auto margin = std::min<Clock::duration>(std::chrono::milliseconds(500), left / 10);
  return Deadline(std::chrono::duration_cast<std::chrono::nanoseconds>(left - margin));
}

}  // namespace

// -------------------------------------------------------------- Bootstrap --

Bootstrap::Bootstrap(int rank, int size, std::string job_id)
    : _rank(rank), _size(size), _job_id(std::move(job_id)) {}

Bootstrap::~Bootstrap() = default;

Status Bootstrap::run(Collective kind, const std::string& mine, std::vector<std::string>* all, const Deadline& dl) {
  if (!_failed.is_ok()) return _failed;
  if (all == nullptr) return Status::error(Code::invalid_argument, "allgather: null output");
  if (mine.size() > kMaxBlob)
    return Status::error(Code::invalid_argument, "allgather: blob of %zu bytes exceeds %zu", mine.size(), kMaxBlob);
  if (_size == 1) {
    all->assign(1, mine);
  } else {
    _idle_slice_ms = kIdleSliceMs;
    Status st = exchange(_seq, kind, mine, all, dl);
    if (!st) {
      _failed = st;
      broken(st);
      return st;
    }
  }
  ++_seq;
  return Status::ok();
}

Status Bootstrap::allgather(const std::string& mine, std::vector<std::string>* all, const Deadline& dl) {
  return run(Collective::allgather, mine, all, dl);
}

Status Bootstrap::barrier(const Deadline& dl) {
  std::vector<std::string> ignored;
  return run(Collective::barrier, std::string(), &ignored, dl);
}

// ------------------------------------------------------------ TCP rendezvous --

namespace {

class TcpBootstrap final : public Bootstrap {
 public:
  TcpBootstrap(int rank, int size, std::string job_id)
      : Bootstrap(rank, size, std::move(job_id)), _peers(static_cast<size_t>(size)) {}

  Status join_root(const LaunchInfo& li, const Deadline& dl, int timeout_ms);
  Status join_leaf(const LaunchInfo& li, const Deadline& dl, int timeout_ms);

 protected:
  Status exchange(uint32_t seq, Collective kind, const std::string& mine, std::vector<std::string>* all,
                  const Deadline& dl) override;
  void broken(const Status&) noexcept override {
    _peers.clear();  // closing wakes every peer still waiting on us
    _peers.resize(static_cast<size_t>(size()));
  }

 private:
  Status allgather_root(uint32_t seq, const std::string& mine, std::vector<std::string>* all, const Deadline& dl);
  Status allgather_leaf(uint32_t seq, const std::string& mine, std::vector<std::string>* all, const Deadline& dl);
  void abort_all(uint32_t seq, const Status& why);  // rank 0: best-effort ABORT to every live rank

  // Rank 0: _peers[r] is rank r's connection (invalid for r == 0).
  // Other ranks: _peers[0] is the connection to rank 0, the rest invalid.
  std::vector<UniqueFd> _peers;
};

void TcpBootstrap::abort_all(uint32_t seq, const Status& why) {
  std::string f = frame(kAbort, seq, abort_payload(why));
  Deadline dl = Deadline::after_ms(200);
  for (int r = 1; r < size(); ++r)
    if (_peers[static_cast<size_t>(r)].valid())
      (void)write_all(_peers[static_cast<size_t>(r)].get(), f, dl, rank_name(r));
}

Status TcpBootstrap::join_root(const LaunchInfo& li, const Deadline& dl, int timeout_ms) {
  const bool file_mode = li.master_addr.empty();
  std::string addr = file_mode ? "127.0.0.1" : li.master_addr;
  UniqueFd lfd;
  int port = 0;
  HCOMM_TRY(listen_on(addr, file_mode ? 0 : li.master_port, &lfd, &port));
  std::string where = endpoint(addr, port);
  std::string pfile;
  if (file_mode) {
    std::string dir;
    HCOMM_TRY(private_run_dir(&dir));
    pfile = port_file(dir, job_id());
    HCOMM_TRY(publish_port(pfile, port));
  }
  // The port file only serves the join; nobody needs it afterwards.
  struct Unlink {
    std::string p;
    ~Unlink() {
      if (!p.empty()) ::unlink(p.c_str());
    }
  } unlink_pfile{pfile};

  Deadline join = root_deadline(dl);
  int joined = 1;
  std::string dropped;  // why stray connections were refused, for the timeout message
  while (joined < size()) {
    // Poll the listener and every joined rank: one that leaves before the
    // job has formed must fail the join now, not at the first collective.
    std::vector<pollfd> pfds{{lfd.get(), POLLIN, 0}};
    std::vector<int> who{0};
    for (int r = 1; r < size(); ++r)
      if (_peers[static_cast<size_t>(r)].valid()) {
        pfds.push_back({_peers[static_cast<size_t>(r)].get(), POLLIN, 0});
        who.push_back(r);
      }
    int n = ::poll(pfds.data(), pfds.size(), join.remaining_ms());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::from_errno(errno, "bootstrap poll");
    if (n == 0) {
      std::vector<int> missing;
      for (int r = 1; r < size(); ++r)
        if (!_peers[static_cast<size_t>(r)].valid()) missing.push_back(r);
      Status st = Status::error(Code::timeout, "rank%s %s of %d did not join the rendezvous at %s within %d ms%s",
                                missing.size() > 1 ? "s" : "", list_ranks(missing).c_str(), size(),
                                where.c_str(), timeout_ms, dropped.c_str());
      abort_all(0, st);
      return st;
    }
    for (size_t i = 1; i < pfds.size(); ++i) {
      if (pfds[i].revents == 0) continue;
      char c;
      ssize_t got = ::recv(pfds[i].fd, &c, 1, MSG_PEEK);
      if (got < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      Status st = got <= 0
                      ? Status::error(Code::peer_failure, "rank %d left before all %d ranks joined", who[i], size())
                      : Status::error(Code::protocol_error, "rank %d sent data before the job formed", who[i]);
      _peers[static_cast<size_t>(who[i])].reset();
      abort_all(0, st);
      return st;
    }
    if (pfds[0].revents == 0) continue;
    UniqueFd c(::accept4(lfd.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!c.valid()) {
      if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED) continue;
      return Status::from_errno(errno, "accept on " + where);
    }
    tune(c.get());
    // A connected client sends HELLO at once; a silent one is dropped
    // after a short while so that it cannot hold up the others.
    Deadline hdl(std::min(std::chrono::nanoseconds(std::chrono::seconds(2)),
                          std::chrono::duration_cast<std::chrono::nanoseconds>(join.at() - Clock::now())));
    Frame f;
    Hello h;
    Status st = read_frame(c.get(), hdl, kMaxHello, "a connecting rank", &f);
    if (st) st = parse_hello(f, &h);
    if (!st) {
      dropped += "; dropped a connection: " + st.message();
      continue;
    }
    const uint32_t r = h.rank, sz = h.size;
    const std::string& job = h.job;
    Status reject;
    if (sz != static_cast<uint32_t>(size()))
      reject = Status::error(Code::invalid_argument, "world size mismatch: rank 0 has %d, rank %u has %u", size(),
                             r, sz);
    else if (job != job_id())
      reject = Status::error(Code::invalid_argument, "job id mismatch: rank 0 is in \"%s\", rank %u in \"%s\"",
                             job_id().c_str(), r, job.c_str());
    else if (r == 0 || r >= sz)
      reject = Status::error(Code::invalid_argument, "rank %u is out of range for world size %u", r, sz);
    else if (_peers[r].valid())
      reject = Status::error(Code::invalid_argument, "rank %u joined twice", r);
    if (!reject.is_ok()) {
      // Tell the stray process why, then carry on waiting for the real one.
      (void)write_all(c.get(), frame(kAbort, 0, abort_payload(reject)), Deadline::after_ms(200), "a stray rank");
      dropped += "; refused a connection: " + reject.message();
      continue;
    }
    _peers[r] = std::move(c);
    ++joined;
  }
  std::string welcome = frame(kWelcome, 0, "");
  for (int r = 1; r < size(); ++r) {
    Status st = write_all(_peers[static_cast<size_t>(r)].get(), welcome, dl, rank_name(r));
    if (!st) {
      _peers[static_cast<size_t>(r)].reset();
      abort_all(0, st);
      return st;
    }
  }
  return Status::ok();
}

Status TcpBootstrap::join_leaf(const LaunchInfo& li, const Deadline& dl, int timeout_ms) {
  const bool file_mode = li.master_addr.empty();
  std::string pfile;
  if (file_mode) {
    std::string dir;
    HCOMM_TRY(private_run_dir(&dir));
    pfile = port_file(dir, job_id());
  }
  std::string who = "rank 0";
  UniqueFd fd;
  Status last;
  std::string where;
  for (;;) {
    int port = li.master_port;
    std::string addr = li.master_addr;
    if (file_mode) {
      // Re-read every time: a stale file from an earlier run with the same
      // id may be replaced by the live rank 0's at any moment.
      addr = "127.0.0.1";
      port = read_port_file(pfile);
    }
    if (port > 0) {
      where = endpoint(addr, port);
      Deadline attempt(std::min(std::chrono::nanoseconds(std::chrono::seconds(1)),
                                std::chrono::duration_cast<std::chrono::nanoseconds>(dl.at() - Clock::now())));
      last = try_connect(addr, port, attempt, &fd);
      if (last) {
        last = write_all(fd.get(), frame(kHello, 0, hello_payload(rank(), size(), job_id())), dl, who);
        if (last) break;
        fd.reset();
      }
      if (last.code() == Code::invalid_argument) return last;  // unresolvable address: retrying won't help
    }
    if (dl.expired()) {
      if (file_mode && port == 0)
        return Status::error(Code::timeout, "rank %d: rank 0 did not publish its port in %s within %d ms", rank(),
                             pfile.c_str(), timeout_ms);
      return Status::error(Code::timeout, "rank %d: could not reach rank 0 at %s within %d ms (%s)", rank(),
                           where.c_str(), timeout_ms, last.message().c_str());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(50, std::max(1, dl.remaining_ms()))));
  }
  Frame f;
  Status st = read_frame(fd.get(), dl, 0, who, &f);
  if (!st) {
    if (st.code() == Code::timeout)
      return Status::error(Code::timeout, "rank %d: connected to rank 0 at %s, but the job did not form within %d ms",
                           rank(), where.c_str(), timeout_ms);
    return st;
  }
  if (f.type == kAbort) return abort_status(f, who);
  if (f.type != kWelcome)
    return Status::error(Code::protocol_error, "rank 0 answered HELLO with frame type %u", f.type);
  _peers[0] = std::move(fd);
  return Status::ok();
}

Status TcpBootstrap::allgather_root(uint32_t seq, const std::string& mine, std::vector<std::string>* all, const Deadline& dl) {
  all->assign(static_cast<size_t>(size()), std::string());
  (*all)[0] = mine;
  std::vector<bool> have(static_cast<size_t>(size()), false);
  have[0] = true;
  int missing = size() - 1;
  Deadline rdl = root_deadline(dl);
  while (missing > 0) {
    std::vector<pollfd> pfds;
    std::vector<int> who;
    for (int r = 1; r < size(); ++r)
      if (!have[static_cast<size_t>(r)]) {
        pfds.push_back({_peers[static_cast<size_t>(r)].get(), POLLIN, 0});
        who.push_back(r);
      }
    const int wait_ms = has_idle() ? std::min(rdl.remaining_ms(), idle_slice_ms()) : rdl.remaining_ms();
    int n = ::poll(pfds.data(), pfds.size(), wait_ms);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::from_errno(errno, "bootstrap poll");
    if (n == 0 && !rdl.expired()) {
      idle();
      continue;
    }
    if (n == 0) {
      Status st = Status::error(Code::timeout, "collective #%u: rank%s %s did not arrive before the deadline", seq,
                                who.size() > 1 ? "s" : "", list_ranks(who).c_str());
      abort_all(seq, st);
      return st;
    }
    for (size_t i = 0; i < pfds.size(); ++i) {
      if (pfds[i].revents == 0) continue;
      int r = who[i];
      Frame f;
      Status st = read_frame(pfds[i].fd, dl, kMaxBlob, rank_name(r), &f);
      if (st && f.type != kContrib)
        st = Status::error(Code::protocol_error, "rank %d sent frame type %u in collective #%u", r, f.type, seq);
      if (st && f.seq != seq)
        st = Status::error(Code::protocol_error,
                           "rank %d is in collective #%u, rank 0 in #%u (collectives called in a different order?)", r,
                           f.seq, seq);
      if (!st) {
        _peers[static_cast<size_t>(r)].reset();
        abort_all(seq, st);
        return st;
      }
      (*all)[static_cast<size_t>(r)] = std::move(f.payload);
      have[static_cast<size_t>(r)] = true;
      --missing;
    }
  }
  std::string f = frame(kResult, seq, result_payload(*all));
  for (int r = 1; r < size(); ++r) {
    Status st = write_all(_peers[static_cast<size_t>(r)].get(), f, dl, rank_name(r));
    if (!st) {
      _peers[static_cast<size_t>(r)].reset();
      abort_all(seq, st);
      return st;
    }
  }
  return Status::ok();
}

Status TcpBootstrap::allgather_leaf(uint32_t seq, const std::string& mine, std::vector<std::string>* all, const Deadline& dl) {
  const std::string who = "rank 0";
  HCOMM_TRY(write_all(_peers[0].get(), frame(kContrib, seq, mine), dl, who));
  while (has_idle()) {  // until rank 0 answers (read_frame reports errors and the deadline)
    pollfd pf{_peers[0].get(), POLLIN, 0};
    const int n = ::poll(&pf, 1, std::min(dl.remaining_ms(), idle_slice_ms()));
    if (n < 0 && errno == EINTR) continue;
    if (n != 0 || dl.expired()) break;
    idle();
  }
  Frame f;
  size_t cap = 4 + static_cast<size_t>(size()) * (4 + kMaxBlob);
  Status st = read_frame(_peers[0].get(), dl, cap, who, &f);
  if (!st) {
    if (st.code() == Code::timeout)
      return Status::error(Code::timeout, "rank %d: collective #%u: no answer from rank 0 before the deadline", rank(),
                           seq);
    return st;
  }
  return parse_result(f, seq, size(), all);
}

Status TcpBootstrap::exchange(uint32_t seq, Collective, const std::string& mine, std::vector<std::string>* all,
                              const Deadline& dl) {
  return rank() == 0 ? allgather_root(seq, mine, all, dl) : allgather_leaf(seq, mine, all, dl);
}

}  // namespace

Status Bootstrap::create(const LaunchInfo& li, int timeout_ms, std::unique_ptr<Bootstrap>* out) {
  if (out == nullptr) return Status::error(Code::invalid_argument, "Bootstrap::create: null output");
  if (li.size < 1 || li.size > kMaxRanks)
    return Status::error(Code::invalid_argument, "world size %d is outside [1, %d]", li.size, kMaxRanks);
  if (li.rank < 0 || li.rank >= li.size)
    return Status::error(Code::invalid_argument, "rank %d is outside [0, %d)", li.rank, li.size);
  if (timeout_ms <= 0) return Status::error(Code::invalid_argument, "timeout_ms must be positive, got %d", timeout_ms);
  if (li.job_id.size() > kMaxJobId)
    return Status::error(Code::invalid_argument, "job id longer than %zu bytes", kMaxJobId);
  if (!li.master_addr.empty() && (li.master_port < 1 || li.master_port > 65535))
    return Status::error(Code::invalid_argument, "master port %d is outside 1..65535", li.master_port);
  std::string job = li.job_id;
  if (job.empty()) {
    if (li.size > 1 && li.master_addr.empty())
      return Status::error(Code::invalid_argument,
                           "no MASTER_ADDR/MASTER_PORT and no job id: cannot find the rendezvous");
    job = li.master_addr.empty() ? "single-" + std::to_string(::getpid())
                                 : "tcp-" + endpoint(li.master_addr, li.master_port);
  }
  auto b = std::make_unique<TcpBootstrap>(li.rank, li.size, std::move(job));
  if (li.size > 1) {
    Deadline dl = Deadline::after_ms(timeout_ms);
    HCOMM_TRY(li.rank == 0 ? b->join_root(li, dl, timeout_ms) : b->join_leaf(li, dl, timeout_ms));
  }
  *out = std::move(b);
  return Status::ok();
}


}  // namespace hcomm::api
