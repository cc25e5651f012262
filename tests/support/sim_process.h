// SimProcess: starts hcomm-sim as a separate process on a private directory
// for one test (suite), and stops it. Every wait is bounded.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

namespace hcomm::test {

inline std::string sim_binary() {
  const char* p = std::getenv("HCOMM_SIM_BIN");
  return p != nullptr ? p : "hcomm-sim";
}

class SimProcess {
 public:
  SimProcess() = default;
  SimProcess(const SimProcess&) = delete;
  SimProcess& operator=(const SimProcess&) = delete;
  ~SimProcess() { stop(); }

  // Returns "" on success, else why it failed.
  std::string start(std::vector<std::string> extra = {}) {
    char tmpl[] = "/tmp/hcomm-test-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) return "mkdtemp failed";
    _dir = tmpl;
    std::vector<std::string> args = {sim_binary(), "--dir", _dir};
    if (extra.empty()) extra = {"--devices", "2", "--hbm", "64M"};
    args.insert(args.end(), extra.begin(), extra.end());
    _pid = ::fork();
    if (_pid < 0) return "fork failed";
    if (_pid == 0) {
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execvp(argv[0], argv.data());
      std::fprintf(stderr, "exec %s: %s\n", argv[0], std::strerror(errno));
      ::_exit(127);
    }
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(15);
    while (std::chrono::steady_clock::now() < until) {
      if (std::filesystem::exists(_dir + "/ready")) return "";
      int st;
      if (::waitpid(_pid, &st, WNOHANG) == _pid) {
        _pid = -1;
        return "hcomm-sim exited during start-up (status " + std::to_string(st) + ")";
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return "hcomm-sim not ready after 15 s";
  }

  void stop() {
    if (_pid > 0) {
      ::kill(_pid, SIGTERM);
      int st;
      auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (::waitpid(_pid, &st, WNOHANG) == 0) {
        if (std::chrono::steady_clock::now() > until) {
          ::kill(_pid, SIGKILL);
          ::waitpid(_pid, &st, 0);
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      _pid = -1;
    }
    if (!_dir.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(_dir, ec);
      _dir.clear();
    }
  }

  bool alive() const { return _pid > 0 && ::kill(_pid, 0) == 0; }
  pid_t pid() const { return _pid; }
  const std::string& dir() const { return _dir; }
  std::string socket(unsigned i) const { return _dir + "/npu" + std::to_string(i) + ".sock"; }

  // One control-socket command ("fail 0 3"); returns the reply line.
  std::string control(const std::string& cmd) const {
    int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return "error: socket";
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::string p = _dir + "/control.sock";
    std::memcpy(a.sun_path, p.c_str(), p.size() + 1);
    std::string reply;
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
      std::string line = cmd + "\n";
      if (::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size())) {
        timeval tv{5, 0};
        ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        char c;
        while (::read(fd, &c, 1) == 1 && c != '\n') reply += c;
      }
    } else {
      reply = "error: connect";
    }
    ::close(fd);
    return reply;
  }

 private:
  pid_t _pid = -1;
  std::string _dir;
};

// A UDP port on 127.0.0.1 nobody holds right now.
inline uint16_t free_udp_port() {
  int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t l = sizeof a;
  uint16_t p = 0;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &l) == 0)
    p = ntohs(a.sin_port);
  if (fd >= 0) ::close(fd);
  return p;
}

// How two simulated nodes' uplinks are joined: "dgram" (UDP on 127.0.0.1,
// as QEMU's -netdev dgram) or "memif" (DPDK net_memif, shared-memory rings).
// HCOMM_TEST_ROCE_LINK picks it for the suites that take the default.
inline std::string roce_link() {
  const char* e = std::getenv("HCOMM_TEST_ROCE_LINK");
  return e != nullptr && *e != '\0' ? e : "dgram";
}

// Two simulators as two nodes (--node 0 / 1) whose switches' uplinks are
// joined by `link` (roce_link()); extra arguments go to both. "" or why not.
inline std::string start_two_nodes(SimProcess& n0, SimProcess& n1, const std::vector<std::string>& extra,
                                   const std::string& link = roce_link()) {
  std::string up0, up1;
  if (link == "dgram") {
    const uint16_t p0 = free_udp_port(), p1 = free_udp_port();
    if (p0 == 0 || p1 == 0 || p0 == p1) return "no free UDP ports for the uplinks";
    up0 = std::to_string(p0) + ":" + std::to_string(p1);
    up1 = std::to_string(p1) + ":" + std::to_string(p0);
  } else if (link == "memif") {
    // An abstract socket: nothing on disk, gone with the simulators.
    static int seq = 0;
    const std::string sock = "/hcomm-test-" + std::to_string(::getpid()) + "-" + std::to_string(++seq);
    up0 = "dpdk:net_memif0,role=server,socket=" + sock;
    up1 = "dpdk:net_memif0,role=client,socket=" + sock;
  } else {
    return "unknown link '" + link + "' (dgram, memif)";
  }
  auto args = [&](int node, const std::string& up) {
    std::vector<std::string> a = extra;
    for (const std::string& s : {std::string("--node"), std::to_string(node), std::string("--uplink"), up})
      a.push_back(s);
    return a;
  };
  if (std::string e = n0.start(args(0, up0)); !e.empty()) return "node 0: " + e;
  if (std::string e = n1.start(args(1, up1)); !e.empty()) return "node 1: " + e;
  if (link == "memif") {
    // A memif link comes up a moment after both ends exist (the client
    // connects to the server's socket); traffic before then is lost.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    for (SimProcess* n : {&n0, &n1}) {
      while (n->control("net stats").find(",link-up)") == std::string::npos) {
        if (std::chrono::steady_clock::now() > until) return "the memif link did not come up in 10 s";
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
  }
  return "";
}

}  // namespace hcomm::test
