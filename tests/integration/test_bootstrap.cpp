// Integration: Bootstrap and connect_mesh across real processes. Every test
// forks its ranks from the single-threaded test process (before any thread
// exists), each child reports one line through a pipe and exits; the parent
// bounds everything and kills what is left. Ranks on "two hosts" get
// HCOMM_HOST_ID=a / b per child: TCP links between, AF_UNIX within; the store
// bootstrap runs over a directory store shared by the children.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "api/wireup/bootstrap.h"
#include "api/wireup/kv_store.h"
#include "api/wireup/mesh.h"
#include "tests/support/kv_stores.h"

namespace hcomm::api {
namespace {

using Ms = std::chrono::milliseconds;

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  ::close(fd);
  return ntohs(a.sin_port);
}

std::string unique_job(const char* tag) {
  static int n = 0;
  return std::string("test-") + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(n++);
}

struct RankOut {
  int status = -1;   // shell-style: exit code, or 128+signo
  std::string text;  // what the rank reported
};

// Runs body(rank) in one child per entry of `ranks`; a child reports
// body's return value and exits 0 when it starts with "ok".
std::map<int, RankOut> run_ranks(const std::vector<int>& ranks, const std::function<std::string(int)>& body,
                                 int limit_ms = 30000) {
  std::map<int, RankOut> res;
  std::map<int, std::pair<pid_t, int>> kids;
  for (int r : ranks) {
    int p[2];
    EXPECT_EQ(::pipe(p), 0);
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(p[0]);
      std::string t = body(r);
      ssize_t w = ::write(p[1], t.data(), t.size());
      (void)w;
      ::_exit(t.rfind("ok", 0) == 0 ? 0 : 1);
    }
    ::close(p[1]);
    kids[r] = {pid, p[0]};
  }
  Deadline dl = Deadline::after_ms(limit_ms);
  for (auto& [r, k] : kids) {
    std::string text;
    char buf[4096];
    for (;;) {
      pollfd pf{k.second, POLLIN, 0};
      if (::poll(&pf, 1, dl.remaining_ms()) <= 0) break;
      ssize_t n = ::read(k.second, buf, sizeof buf);
      if (n <= 0) break;
      text.append(buf, static_cast<size_t>(n));
    }
    ::close(k.second);
    int st = 0;
    if (dl.expired()) ::kill(k.first, SIGKILL);
    ::waitpid(k.first, &st, 0);
    res[r] = {WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st), text};
  }
  return res;
}

LaunchInfo tcp_launch(int rank, int size, int port, const std::string& job) {
  LaunchInfo li;
  li.rank = rank;
  li.size = size;
  li.source = "test";
  li.job_id = job;
  li.master_addr = "127.0.0.1";
  li.master_port = port;
  return li;
}

std::string describe(const Status& st, long ms) { return st.to_string() + " after " + std::to_string(ms) + " ms"; }

long since(Clock::time_point t0) { return std::chrono::duration_cast<Ms>(Clock::now() - t0).count(); }

std::vector<int> all_ranks(int n) {
  std::vector<int> v;
  for (int i = 0; i < n; ++i) v.push_back(i);
  return v;
}

void expect_all_ok(const std::map<int, RankOut>& res, size_t n) {
  ASSERT_EQ(res.size(), n);
  for (auto& [r, o] : res) EXPECT_EQ(o.status, 0) << "rank " << r << ": " << o.text;
}

// The abstract names ("@...") of the listening AF_UNIX sockets process `pid`
// holds: its fds' socket inodes, matched in /proc/net/unix (flag
// __SO_ACCEPTCON = 0x10000 marks a listener).
std::vector<std::string> listening_abstract(pid_t pid) {
  std::set<std::string> inodes;
  const std::string fd_dir = "/proc/" + std::to_string(pid) + "/fd";
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(fd_dir, ec)) {
    std::string t = std::filesystem::read_symlink(e.path(), ec).string();
    if (t.rfind("socket:[", 0) == 0) inodes.insert(t.substr(8, t.size() - 9));
  }
  std::vector<std::string> out;
  std::ifstream in("/proc/net/unix");
  std::string line;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    std::istringstream f(line);
    std::string num, refs, proto, flags, type, st, inode, path;
    if (!(f >> num >> refs >> proto >> flags >> type >> st >> inode >> path)) continue;
    if (path.empty() || path[0] != '@' || !inodes.count(inode)) continue;
    if ((std::stoul(flags, nullptr, 16) & 0x10000u) != 0) out.push_back(path);
  }
  return out;
}

// The blob rank r contributes in round k: lengths from 0 to kMaxBlob.
std::string blob(int r, int k) {
  size_t len = k == 0 ? 0 : k == 1 ? static_cast<size_t>(r + 1) : k == 2 ? Bootstrap::kMaxBlob : 1000u * (r + 1u);
  std::string s(len, static_cast<char>('a' + r));
  if (!s.empty()) s.back() = static_cast<char>('0' + k);
  return s;
}

std::string allgather_rounds(const LaunchInfo& li) {
  std::unique_ptr<Bootstrap> b;
  Status st = Bootstrap::create(li, 20000, &b);
  if (!st) return "create: " + st.to_string();
  if (b->rank() != li.rank || b->size() != li.size) return "rank/size mismatch";
  Deadline dl = Deadline::after_ms(20000);
  for (int k = 0; k < 4; ++k) {
    std::vector<std::string> all;
    st = b->allgather(blob(li.rank, k), &all, dl);
    if (!st) return "allgather: " + st.to_string();
    if (all.size() != static_cast<size_t>(li.size)) return "allgather: wrong count";
    for (int r = 0; r < li.size; ++r)
      if (all[static_cast<size_t>(r)] != blob(r, k))
        return "round " + std::to_string(k) + ": slot " + std::to_string(r) + " is wrong";
    st = b->barrier(dl);
    if (!st) return "barrier: " + st.to_string();
  }
  return "ok";
}

class BootstrapN : public ::testing::TestWithParam<int> {};

TEST_P(BootstrapN, AllgatherAndBarrierOverTcp) {
  int n = GetParam(), port = free_port();
  std::string job = unique_job("tcp");
  expect_all_ok(run_ranks(all_ranks(n), [&](int r) { return allgather_rounds(tcp_launch(r, n, port, job)); }),
                static_cast<size_t>(n));
}

// A rank waiting long in a barrier wakes for the idle hook on a doubling
// schedule (2, 4, ... 32 ms: Bootstrap::on_idle), not every 2 ms: over a
// wait of T ms the hook runs at most 5 + (T - 62) / 32 times, on the root
// (rank 0) and on a leaf alike. Poll timeouts only end late, so a loaded
// machine can make fewer calls, never more.
TEST(BootstrapIdle, LongWaitWakesOnADoublingSchedule) {
  const int port = free_port();
  std::string job = unique_job("idle");
  auto res = run_ranks(all_ranks(3), [&](int r) -> std::string {
    std::unique_ptr<Bootstrap> b;
    Status st = Bootstrap::create(tcp_launch(r, 3, port, job), 20000, &b);
    if (!st) return "create: " + st.to_string();
    int calls = 0;
    b->on_idle([&] { return ++calls, false; });
    if (r == 1) std::this_thread::sleep_for(Ms(400));
    const auto t0 = Clock::now();
    st = b->barrier(Deadline::after_ms(20000));
    const long waited = since(t0);
    if (!st) return "barrier: " + st.to_string();
    if (r == 1) return "ok";
    const long bound = 5 + std::max(0L, waited - 62) / 32;
    if (calls < 1 || calls > bound)
      return std::to_string(calls) + " idle calls in a wait of " +
             std::to_string(waited) + " ms (expected 1.." + std::to_string(bound) + ")";
    return "ok";
  });
  expect_all_ok(res, 3);
}

// mpirun without MASTER_ADDR: the port travels through a file under /tmp.
TEST_P(BootstrapN, AllgatherOverThePortFile) {
  int n = GetParam();
  std::string job = unique_job("file");
  expect_all_ok(run_ranks(all_ranks(n),
                          [&](int r) {
                            LaunchInfo li = tcp_launch(r, n, 0, job);
                            li.master_addr.clear();
                            return allgather_rounds(li);
                          }),
                static_cast<size_t>(n));
  std::string pf = "/tmp/hcomm-" + std::to_string(::getuid()) + "/job-" + job + ".port";
  EXPECT_FALSE(std::filesystem::exists(pf)) << "rank 0 removes the port file once everyone joined";
}

TEST_P(BootstrapN, MeshPassesDescriptors) {
  int n = GetParam(), port = free_port();
  std::string job = unique_job("mesh");
  auto body = [&](int me) -> std::string {
    std::unique_ptr<Bootstrap> b;
    Status st = Bootstrap::create(tcp_launch(me, n, port, job), 20000, &b);
    if (!st) return "create: " + st.to_string();
    Deadline dl = Deadline::after_ms(20000);
    std::vector<MeshLink> peers;
    st = connect_mesh(*b, dl, &peers);
    if (!st) return "connect_mesh: " + st.to_string();
    if (peers.size() != static_cast<size_t>(n) || peers[static_cast<size_t>(me)].fd.valid()) return "bad peers vector";
    if (!listening_abstract(::getpid()).empty()) return "a listening socket outlived connect_mesh";
    // To every peer: a pipe's read end, with "me->p" already written into it.
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      int fds[2];
      if (::pipe(fds) != 0) return "pipe";
      UniqueFd rd(fds[0]), wr(fds[1]);
      std::string payload = std::to_string(me) + "->" + std::to_string(p);
      if (::write(wr.get(), payload.data(), payload.size()) != static_cast<ssize_t>(payload.size())) return "write";
      std::string msg = "from " + std::to_string(me);
      const int pass[] = {rd.get()};
      st = send_msg(peers[static_cast<size_t>(p)].fd.get(), msg.data(), msg.size(), pass, dl, p);
      if (!st) return "send_msg: " + st.to_string();
    }
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      std::vector<uint8_t> m;
      std::vector<UniqueFd> got;
      st = recv_msg(peers[static_cast<size_t>(p)].fd.get(), &m, &got, dl, p);
      if (!st) return "recv_msg: " + st.to_string();
      if (std::string(m.begin(), m.end()) != "from " + std::to_string(p)) return "wrong message from a peer";
      if (got.size() != 1) return "expected one descriptor";
      char buf[32] = {};
      ssize_t k = ::read(got[0].get(), buf, sizeof buf - 1);
      if (std::string(buf, k > 0 ? static_cast<size_t>(k) : 0) != std::to_string(p) + "->" + std::to_string(me))
        return "descriptor from rank " + std::to_string(p) + " reads \"" + buf + "\"";
    }
    st = b->barrier(dl);
    return st ? "ok" : "barrier: " + st.to_string();
  };
  expect_all_ok(run_ranks(all_ranks(n), body), static_cast<size_t>(n));
}

INSTANTIATE_TEST_SUITE_P(Ranks, BootstrapN, ::testing::Values(2, 4));

// Anyone in the network namespace can reach a rank's abstract listening
// name: strangers that connect first (one sending a bad hello, one staying
// silent past the 2 s hello wait) are dropped, and the mesh still forms.
TEST(Mesh, LocalStrangersAreDroppedAndTheMeshForms) {
  int port = free_port();
  std::string job = unique_job("strangers");
  const std::string dir = ::testing::TempDir() + "/" + job;
  std::filesystem::create_directories(dir);
  auto body = [&](int me) -> std::string {
    std::unique_ptr<Bootstrap> b;
    Status st = Bootstrap::create(tcp_launch(me, 2, port, job), 20000, &b);
    if (!st) return "create: " + st.to_string();
    UniqueFd bad, silent;
    if (me == 0) {
      std::ofstream(dir + "/pid0") << ::getpid();
    } else {
      // Rank 1 plays the strangers first: rank 0 listens (and waits in the
      // rendezvous for us) once it is in connect_mesh.
      pid_t pid0 = 0;
      std::vector<std::string> names;
      const Deadline find = Deadline::after_ms(10000);
      while (names.empty() && !find.expired()) {
        std::ifstream(dir + "/pid0") >> pid0;
        if (pid0 > 0) names = listening_abstract(pid0);
        if (names.empty()) std::this_thread::sleep_for(Ms(5));
      }
      if (names.size() != 1) return "rank 0's listening socket not found";
      sockaddr_un a{};
      a.sun_family = AF_UNIX;
      std::memcpy(a.sun_path + 1, names[0].data() + 1, names[0].size() - 1);
      const auto alen = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + names[0].size());
      bad.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
      silent.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
      if (::connect(bad.get(), reinterpret_cast<sockaddr*>(&a), alen) != 0 ||
          ::connect(silent.get(), reinterpret_cast<sockaddr*>(&a), alen) != 0)
        return std::string("stranger connect: ") + std::strerror(errno);
      if (::send(bad.get(), "not a hello", 11, 0) != 11) return "stranger send";
    }
    Deadline dl = Deadline::after_ms(20000);
    std::vector<MeshLink> peers;
    st = connect_mesh(*b, dl, &peers);
    if (!st) return "connect_mesh: " + st.to_string();
    const std::string msg = "hello " + std::to_string(me);
    const int peer = 1 - me;
    st = send_msg(peers[static_cast<size_t>(peer)].fd.get(), msg.data(), msg.size(), {}, dl, peer);
    if (!st) return "send_msg: " + st.to_string();
    std::vector<uint8_t> m;
    st = recv_msg(peers[static_cast<size_t>(peer)].fd.get(), &m, nullptr, dl, peer);
    if (!st) return "recv_msg: " + st.to_string();
    if (std::string(m.begin(), m.end()) != "hello " + std::to_string(peer)) return "wrong message";
    st = b->barrier(dl);
    return st ? "ok" : "barrier: " + st.to_string();
  };
  expect_all_ok(run_ranks(all_ranks(2), body), 2);
  std::filesystem::remove_all(dir);
}

// Rank 2 of 3 never starts: ranks 0 and 1 fail with timeout naming it, within the deadline.
TEST(BootstrapFailure, MissingRankTimesOutNamingIt) {
  int port = free_port();
  std::string job = unique_job("missing");
  auto res = run_ranks({0, 1}, [&](int r) -> std::string {
    auto t0 = Clock::now();
    std::unique_ptr<Bootstrap> b;
    Status st = Bootstrap::create(tcp_launch(r, 3, port, job), 1500, &b);
    return std::to_string(static_cast<int>(st.code())) + "|" + std::to_string(since(t0)) + "|" + st.message();
  });
  for (int r : {0, 1}) {
    const std::string& t = res[r].text;
    SCOPED_TRACE("rank " + std::to_string(r) + ": " + t);
    EXPECT_EQ(t.substr(0, t.find('|')), std::to_string(static_cast<int>(Code::timeout)));
    long ms = std::stol(t.substr(t.find('|') + 1));
    EXPECT_GE(ms, 1000);
    // Bounded by the deadline (plus scheduling slack on a loaded CI machine), not the 20 s of a hang.
    EXPECT_LE(ms, 1500 + 2500);
    EXPECT_NE(t.find("rank 2 of 3 did not join"), std::string::npos);
  }
}

TEST(BootstrapFailure, MissingRootTimesOut) {
  int port = free_port();
  std::string job = unique_job("noroot");
  auto res = run_ranks({1}, [&](int r) -> std::string {
    auto t0 = Clock::now();
    std::unique_ptr<Bootstrap> b;
    Status st = Bootstrap::create(tcp_launch(r, 2, port, job), 1000, &b);
    return describe(st, since(t0));
  });
  const std::string& t = res[1].text;
  EXPECT_NE(t.find("timeout"), std::string::npos) << t;
  EXPECT_NE(t.find("could not reach rank 0 at 127.0.0.1:" + std::to_string(port)), std::string::npos) << t;
  long ms = std::stol(t.substr(t.rfind("after ") + 6));
  EXPECT_LE(ms, 1000 + 2500) << t;  // the 1 s deadline plus scheduling slack
}

TEST(BootstrapFailure, MissingPortFileTimesOut) {
  std::string job = unique_job("nofile");
  auto res = run_ranks({1}, [&](int r) -> std::string {
    std::unique_ptr<Bootstrap> b;
    LaunchInfo li = tcp_launch(r, 2, 0, job);
    li.master_addr.clear();
    return Bootstrap::create(li, 500, &b).to_string();
  });
  EXPECT_NE(res[1].text.find("timeout: rank 1: rank 0 did not publish its port"), std::string::npos) << res[1].text;
}

// Rank 2 leaves right after joining: the collective fails on the others,
// promptly, with peer_failure naming rank 2; later calls keep failing.
TEST(BootstrapFailure, RankLeavingFailsTheCollectiveOnEveryone) {
  int port = free_port();
  std::string job = unique_job("leave");
  auto res = run_ranks({0, 1, 2}, [&](int r) -> std::string {
    std::unique_ptr<Bootstrap> b;
    Status st = Bootstrap::create(tcp_launch(r, 3, port, job), 20000, &b);
    if (!st) return "create: " + st.to_string();
    if (r == 2) return "ok left";
    auto t0 = Clock::now();
    std::vector<std::string> all;
    st = b->allgather("x", &all, Deadline::after_ms(20000));
    long ms = since(t0);
    Status again = b->barrier(Deadline::after_ms(20000));
    if (again.code() != st.code()) return "a later call did not repeat the failure: " + again.to_string();
    return describe(st, ms);
  });
  EXPECT_EQ(res[2].status, 0) << res[2].text;
  for (int r : {0, 1}) {
    const std::string& t = res[r].text;
    EXPECT_EQ(t.rfind("peer_failure", 0), 0u) << "rank " << r << ": " << t;
    EXPECT_NE(t.find("rank 2"), std::string::npos) << t;
    EXPECT_LE(std::stol(t.substr(t.rfind("after ") + 6)), 6000) << t;  // far inside the 20 s deadline
  }
}

TEST(BootstrapFailure, RootLeavingFailsTheCollective) {
  int port = free_port();
  std::string job = unique_job("rootleave");
  auto res = run_ranks({0, 1}, [&](int r) -> std::string {
    std::unique_ptr<Bootstrap> b;
    Status st = Bootstrap::create(tcp_launch(r, 2, port, job), 20000, &b);
    if (!st) return "create: " + st.to_string();
    if (r == 0) return "ok left";
    std::vector<std::string> all;
    return b->allgather("x", &all, Deadline::after_ms(20000)).to_string();
  });
  EXPECT_EQ(res[1].text.rfind("peer_failure", 0), 0u) << res[1].text;
  EXPECT_NE(res[1].text.find("rank 0"), std::string::npos) << res[1].text;
}

// A rank killed after the mesh exists: the survivor's recv_msg reports it promptly.
TEST(BootstrapFailure, KilledPeerIsPeerFailureOnTheMesh) {
  int port = free_port();
  std::string job = unique_job("kill");
  auto res = run_ranks({0, 1}, [&](int r) -> std::string {
    std::unique_ptr<Bootstrap> b;
    Status st = Bootstrap::create(tcp_launch(r, 2, port, job), 20000, &b);
    if (!st) return "create: " + st.to_string();
    std::vector<MeshLink> peers;
    st = connect_mesh(*b, Deadline::after_ms(20000), &peers);
    if (!st) return "connect_mesh: " + st.to_string();
    if (r == 1) ::raise(SIGKILL);
    auto t0 = Clock::now();
    std::vector<uint8_t> m;
    std::vector<UniqueFd> fds;
    st = recv_msg(peers[1].fd.get(), &m, &fds, Deadline::after_ms(20000), 1);
    return describe(st, since(t0));
  });
  EXPECT_EQ(res[1].status, 128 + SIGKILL);
  const std::string& t = res[0].text;
  EXPECT_EQ(t.rfind("peer_failure", 0), 0u) << t;
  EXPECT_NE(t.find("rank 1"), std::string::npos) << t;
  EXPECT_LE(std::stol(t.substr(t.rfind("after ") + 6)), 5000) << t;  // far inside the 20 s deadline
}

// ---- ranks on "two hosts" (HCOMM_HOST_ID per child): TCP between, UNIX within ----

// Sets the per-child variables the cross-host mesh reads; unsets the rest.
void host_env(const std::string& host, const char* sock_addr = nullptr) {
  ::setenv("HCOMM_HOST_ID", host.c_str(), 1);
  for (const char* v : {"HCOMM_SOCKET_IFNAME", "HCOMM_SOCKET_ADDR", "MASTER_ADDR", "HCOMM_KEEPALIVE_MS"}) ::unsetenv(v);
  if (sock_addr != nullptr) ::setenv("HCOMM_SOCKET_ADDR", sock_addr, 1);
}

int sock_int(int fd, int level, int name) {
  int v = -1;
  socklen_t l = sizeof v;
  return ::getsockopt(fd, level, name, &v, &l) == 0 ? v : -1;
}

// Every rank sends `m` to every peer, then receives from every peer.
std::string exchange_all(std::vector<MeshLink>& links, int me, size_t len, const Deadline& dl) {
  auto payload = [](int from, int to, size_t n) {
    std::string s(n, '\0');
    for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 31 + static_cast<size_t>(from * 7 + to)) & 0xff);
    return s;
  };
  const int n = static_cast<int>(links.size());
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    std::string m = payload(me, p, len);
    Status st = send_msg(links[static_cast<size_t>(p)].fd.get(), m.data(), m.size(), {}, dl, p);
    if (!st) return "send " + std::to_string(len) + " B to rank " + std::to_string(p) + ": " + st.to_string();
  }
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    std::vector<uint8_t> m;
    Status st = recv_msg(links[static_cast<size_t>(p)].fd.get(), &m, nullptr, dl, p);
    if (!st) return "recv " + std::to_string(len) + " B from rank " + std::to_string(p) + ": " + st.to_string();
    if (std::string(m.begin(), m.end()) != payload(p, me, len))
      return std::to_string(len) + " B from rank " + std::to_string(p) + " arrived wrong";
  }
  return "ok";
}

// 4 ranks: 0, 1 on host "a", 2, 3 on host "b".
TEST(MeshTwoHosts, TcpBetweenUnixWithinMessagesBothWaysAndGoodbye) {
  const int n = 4;
  int port = free_port();
  std::string job = unique_job("twohosts");
  auto res = run_ranks(all_ranks(n), [&](int me) -> std::string {
    host_env(me < 2 ? "a" : "b");  // the default listen address (no override)
    std::unique_ptr<Bootstrap> b;
    Status st = Bootstrap::create(tcp_launch(me, n, port, job), 20000, &b);
    if (!st) return "create: " + st.to_string();
    Deadline dl = Deadline::after_ms(20000);
    std::vector<MeshLink> links;
    st = connect_mesh(*b, dl, &links);
    if (!st) return "connect_mesh: " + st.to_string();
    if (links.size() != static_cast<size_t>(n)) return "bad links vector";
    const MeshLink& self = links[static_cast<size_t>(me)];
    if (self.fd.valid() || !self.same_host || self.host != (me < 2 ? "a" : "b")) return "bad self link";
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      const MeshLink& l = links[static_cast<size_t>(p)];
      bool same = (p < 2) == (me < 2);
      if (l.same_host != same || l.host != (p < 2 ? "a" : "b")) return "rank " + std::to_string(p) + ": wrong host";
      int domain = sock_int(l.fd.get(), SOL_SOCKET, SO_DOMAIN);
      if (same && domain != AF_UNIX) return "same-host link to " + std::to_string(p) + " is not AF_UNIX";
      if (!same && domain != AF_INET && domain != AF_INET6) return "cross-host link is not TCP";
      if (!same && (sock_int(l.fd.get(), IPPROTO_TCP, TCP_NODELAY) != 1 ||
                    sock_int(l.fd.get(), SOL_SOCKET, SO_KEEPALIVE) != 1 ||
                    sock_int(l.fd.get(), IPPROTO_TCP, TCP_USER_TIMEOUT) != 5000 ||
                    sock_int(l.fd.get(), IPPROTO_TCP, TCP_KEEPIDLE) != 2 ||
                    sock_int(l.fd.get(), IPPROTO_TCP, TCP_KEEPINTVL) != 1 ||
                    sock_int(l.fd.get(), IPPROTO_TCP, TCP_KEEPCNT) != 3))
        return "TCP link options are not the defaults of HCOMM_KEEPALIVE_MS=5000";
      // Descriptors travel within a host only.
      const int pass[] = {0};
      st = send_msg(l.fd.get(), "fd", 2, pass, dl, p);
      if (same ? !st : st.code() != Code::invalid_argument) return "passing an fd to rank " + std::to_string(p) + ": " + st.to_string();
      if (same) {
        std::vector<uint8_t> m;
        std::vector<UniqueFd> fds;
        st = recv_msg(l.fd.get(), &m, &fds, dl, p);
        if (!st || fds.size() != 1) return "fd from rank " + std::to_string(p) + ": " + st.to_string();
      }
    }
    for (size_t len : {size_t{1}, size_t{3}, size_t{100}, size_t{4096}, size_t{20000}, kMaxMsg}) {
      std::string r = exchange_all(links, me, len, dl);
      if (r != "ok") return r;
    }
    st = b->barrier(dl);
    if (!st) return "barrier: " + st.to_string();
    for (int p = 0; p < n; ++p) {
      st = mesh_goodbye(links[static_cast<size_t>(p)], Deadline::after_ms(5000));
      if (!st) return "goodbye to rank " + std::to_string(p) + ": " + st.to_string();
    }
    return "ok";
  });
  expect_all_ok(res, n);
}

// Forwards to a real Bootstrap and lets a test look at each allgather's
// result before the caller does (here: the mesh's TCP endpoints).
class SpyBootstrap : public Bootstrap {
 public:
  using Hook = std::function<void(uint32_t seq, const std::vector<std::string>& all)>;
  SpyBootstrap(std::unique_ptr<Bootstrap> inner, Hook hook)
      : Bootstrap(inner->rank(), inner->size(), inner->job_id()), _inner(std::move(inner)), _hook(std::move(hook)) {}

 protected:
  Status exchange(uint32_t seq, Collective kind, const std::string& mine, std::vector<std::string>* all,
                  const Deadline& dl) override {
    Status st = kind == Collective::barrier ? _inner->barrier(dl) : _inner->allgather(mine, all, dl);
    if (st && kind != Collective::barrier) _hook(seq, *all);
    return st;
  }

 private:
  std::unique_ptr<Bootstrap> _inner;
  Hook _hook;
};

std::string be16(uint16_t v) {
  v = htons(v);
  return std::string(reinterpret_cast<const char*>(&v), 2);
}
std::string be32s(uint32_t v) {
  v = htonl(v);
  return std::string(reinterpret_cast<const char*>(&v), 4);
}
std::string hello_bytes(uint32_t magic, uint16_t version, uint64_t cookie, uint32_t rank, uint32_t size) {
  return be32s(magic) + be16(version) + be16(1) + be32s(static_cast<uint32_t>(cookie >> 32)) +
         be32s(static_cast<uint32_t>(cookie)) + be32s(rank) + be32s(size) + be32s(0);
}

// Connects to addr:port as a stranger, sends `hello`, returns the listener's
// answer as "type <t>: <text>" (or what went wrong).
std::string stranger(const std::string& addr, int port, const std::string& hello) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, addr.c_str(), &a.sin_addr);
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  std::string out;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    out = "connect failed";
  } else if (::send(fd, hello.data(), hello.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(hello.size())) {
    out = "send failed";
  } else {
    char h[kMeshTcpHello];
    if (::recv(fd, h, sizeof h, MSG_WAITALL) != static_cast<ssize_t>(sizeof h)) {
      out = "no answer";
    } else {
      uint32_t w[7];
      std::memcpy(w, h, sizeof w);
      std::string text(ntohl(w[6]), '\0');
      if (!text.empty()) (void)::recv(fd, text.data(), text.size(), MSG_WAITALL);
      out = "type " + std::to_string(ntohl(w[1]) & 0xffff) + ": " + text;
    }
  }
  ::close(fd);
  return out;
}

// Strangers knock on rank 0's TCP listener before rank 1 connects: each is
// refused with a message naming what differed, and the job still forms.
TEST(MeshTwoHosts, StrangersAreRefusedAndTheJobStillForms) {
  int port = free_port();
  std::string job = unique_job("stranger");
  auto res = run_ranks({0, 1}, [&](int me) -> std::string {
    host_env(me == 0 ? "a" : "b", "127.0.0.1");
    std::unique_ptr<Bootstrap> real;
    Status st = Bootstrap::create(tcp_launch(me, 2, port, job), 20000, &real);
    if (!st) return "create: " + st.to_string();
    std::string verdict = "ok";
    SpyBootstrap spy(std::move(real), [&](uint32_t, const std::vector<std::string>& all) {
      // Round 2 of the mesh carries "addr port" for each rank with remote peers.
      if (me != 1 || all[0].find('\n') != std::string::npos || all[0].empty()) return;
      std::string addr = all[0].substr(0, all[0].find(' '));
      int p = std::stoi(all[0].substr(all[0].find(' ') + 1));
      const uint64_t cookie = mesh_job_cookie(job);
      struct Case {
        std::string hello, want;
      } cases[] = {
          {std::string("GET / HTTP/1.0\r\n\r\n") + std::string(10, ' '), "not an hcomm mesh hello"},
          {hello_bytes(kMeshTcpMagic, 99, cookie, 1, 2), "version 99"},
          {hello_bytes(kMeshTcpMagic, kMeshTcpVersion, mesh_job_cookie("another-job"), 1, 2), "another job"},
          {hello_bytes(kMeshTcpMagic, kMeshTcpVersion, cookie, 1, 3), "world size 3"},
          {hello_bytes(kMeshTcpMagic, kMeshTcpVersion, cookie, 0, 2), "only ranks above 0"},
      };
      for (const Case& c : cases) {
        std::string got = stranger(addr, p, c.hello);
        if (got.rfind("type 2: ", 0) != 0 || got.find(c.want) == std::string::npos)
          verdict = "stranger wanting \"" + c.want + "\" got \"" + got + "\"";
      }
    });
    Deadline dl = Deadline::after_ms(20000);
    std::vector<MeshLink> links;
    st = connect_mesh(spy, dl, &links);
    if (!st) return "connect_mesh: " + st.to_string();
    if (verdict != "ok") return verdict;
    std::string r = exchange_all(links, me, 1000, dl);
    if (r != "ok") return r;
    return spy.barrier(dl) ? "ok" : "barrier failed";
  });
  expect_all_ok(res, 2);
}

// A rank on the other host killed after the mesh exists: peer_failure, promptly.
TEST(MeshTwoHosts, KilledPeerIsPeerFailure) {
  int port = free_port();
  std::string job = unique_job("tcpkill");
  auto res = run_ranks({0, 1}, [&](int r) -> std::string {
    host_env(r == 0 ? "a" : "b", "127.0.0.1");
    std::unique_ptr<Bootstrap> b;
    Status st = Bootstrap::create(tcp_launch(r, 2, port, job), 20000, &b);
    if (!st) return "create: " + st.to_string();
    std::vector<MeshLink> links;
    st = connect_mesh(*b, Deadline::after_ms(20000), &links);
    if (!st) return "connect_mesh: " + st.to_string();
    if (links[1 - r].same_host) return "expected a TCP link";
    if (r == 1) ::raise(SIGKILL);
    auto t0 = Clock::now();
    std::vector<uint8_t> m;
    st = recv_msg(links[1].fd.get(), &m, nullptr, Deadline::after_ms(20000), 1);
    return describe(st, since(t0));
  });
  EXPECT_EQ(res[1].status, 128 + SIGKILL);
  const std::string& t = res[0].text;
  EXPECT_EQ(t.rfind("peer_failure", 0), 0u) << t;
  EXPECT_NE(t.find("rank 1"), std::string::npos) << t;
  EXPECT_LE(std::stol(t.substr(t.rfind("after ") + 6)), 5000) << t;
}

// ---- the store bootstrap across processes (a directory as the store) ----

class StoreDir : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/hcomm-store-test-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
};

TEST_F(StoreDir, AllgatherAndMeshAcrossProcesses) {
  const int n = 3;
  std::string job = unique_job("store");
  auto res = run_ranks(all_ranks(n), [&](int me) -> std::string {
    host_env(me == 2 ? "b" : "a", "127.0.0.1");
    test::DirStore store(dir_);
    std::unique_ptr<Bootstrap> b;
    Status st = Bootstrap::from_store(me, n, job, kv_store_from_c(store.c()), 20000, &b);
    if (!st) return "from_store: " + st.to_string();
    Deadline dl = Deadline::after_ms(20000);
    for (int k = 0; k < 4; ++k) {
      std::vector<std::string> all;
      st = b->allgather(blob(me, k), &all, dl);
      if (!st) return "allgather: " + st.to_string();
      for (int r = 0; r < n; ++r)
        if (all[static_cast<size_t>(r)] != blob(r, k)) return "round " + std::to_string(k) + " slot " + std::to_string(r);
    }
    std::vector<MeshLink> links;
    st = connect_mesh(*b, dl, &links);
    if (!st) return "connect_mesh: " + st.to_string();
    std::string r = exchange_all(links, me, 5000, dl);
    if (r != "ok") return r;
    return b->barrier(dl) ? "ok" : "barrier failed";
  });
  expect_all_ok(res, n);
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/hcomm#" + job + "#0#2")) << "rank 2's join key";
}

TEST_F(StoreDir, RankThatNeverArrivesTimesOutNamingIt) {
  std::string job = unique_job("storemissing");
  auto res = run_ranks({0, 2}, [&](int me) -> std::string {
    test::DirStore store(dir_);
    auto t0 = Clock::now();
    std::unique_ptr<Bootstrap> b;
    Status st = Bootstrap::from_store(me, 3, job, kv_store_from_c(store.c()), 800, &b);
    return describe(st, since(t0));
  });
  for (int r : {0, 2}) {
    const std::string& t = res[r].text;
    EXPECT_EQ(t.rfind("timeout", 0), 0u) << t;
    EXPECT_NE(t.find("rank 1 of 3 did not join the store rendezvous"), std::string::npos) << t;
    EXPECT_LE(std::stol(t.substr(t.rfind("after ") + 6)), 800 + 2500) << t;
  }
}

// A fake rank 0 answers HELLO with a malformed frame: protocol_error, not a hang or a crash.
class BadRoot : public ::testing::TestWithParam<std::vector<uint8_t>> {};

TEST_P(BadRoot, IsProtocolError) {
  int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ASSERT_EQ(::bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(lfd, 4), 0);
  ASSERT_EQ(::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  int port = ntohs(a.sin_port);
  std::string job = unique_job("badroot");
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(lfd);
    std::unique_ptr<Bootstrap> b;
    Status st = Bootstrap::create(tcp_launch(1, 2, port, job), 5000, &b);
    std::string t = st.to_string();
    std::fprintf(stderr, "child: %s\n", t.c_str());
    ::_exit(st.code() == Code::protocol_error ? 0 : 1);
  }
  pollfd pf{lfd, POLLIN, 0};
  ASSERT_EQ(::poll(&pf, 1, 5000), 1);
  int c = ::accept(lfd, nullptr, nullptr);
  ASSERT_GE(c, 0);
  char hello[16];
  ASSERT_EQ(::recv(c, hello, sizeof hello, MSG_WAITALL), 16);
  const auto& reply = GetParam();
  ASSERT_EQ(::send(c, reply.data(), reply.size(), MSG_NOSIGNAL), static_cast<ssize_t>(reply.size()));
  int st = 0;
  ASSERT_EQ(::waitpid(pid, &st, 0), pid);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "the child did not see protocol_error (its stderr says why)";
  ::close(c);
  ::close(lfd);
}

// 'HCBS' | version | type | seq | length, big-endian.
INSTANTIATE_TEST_SUITE_P(
    Frames, BadRoot,
    ::testing::Values(std::vector<uint8_t>{'X', 'C', 'B', 'S', 0, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0},      // magic
                      std::vector<uint8_t>{'H', 'C', 'B', 'S', 0, 9, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0},      // version
                      std::vector<uint8_t>{'H', 'C', 'B', 'S', 0, 1, 0, 77, 0, 0, 0, 0, 0, 0, 0, 0},     // type
                      std::vector<uint8_t>{'H', 'C', 'B', 'S', 0, 1, 0, 2, 0, 0, 0, 0, 0x40, 0, 0, 0},   // length
                      std::vector<uint8_t>{'H', 'C', 'B', 'S', 0, 1, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0}));  // RESULT, not WELCOME

}  // namespace
}  // namespace hcomm::api
