// Fault injection and inspection: a line protocol on DIR/control.sock, and
// the same commands from the command line (hcomm-sim --fault "fail 0 3").
//
//   fail DEV N      next N well-formed descriptors on DEV complete with INJECTED
//   corrupt DEV N   next N COPYs on DEV flip one byte of the destination (status OK)
//   stale DEV N     next N fetch atomics on DEV are done but answer the value
//                   DEV's previous fetch atomic returned (a wrong old value)
//   stall DEV MS    DEV's engines take no descriptor for MS milliseconds
//   clear DEV       cancel all of the above
//   reset DEV       the device resets itself (queues stop, ATT cleared, CONTROL.ENABLE = 0)
//   stats DEV       "ok completed=N errors=N"
//   ping            "ok"
//   net faults drop=P dup=P reorder=P corrupt=P [seed=S]
//                   the switch drops/duplicates/reorders/corrupts that percentage
//                   of the frames the NPUs send (corruption: one bit the ICRC covers)
//   net drop-next N / net corrupt-next N   the next N frames the NPUs send
//   net clear       no network faults    net stats   "ok dropped=N duplicated=N ..."
//   net info DEV    the device's port, QPs and counters on one line
// Each request is one line; each reply is one line starting "ok" or "error".
#pragma once

#include <atomic>
#include <string>
#include <thread>

#include "common/fd.h"
#include "common/status.h"

namespace hcomm::sim {

class Fabric;

// Executes one command line against the fabric; returns the reply line.
std::string control_command(Fabric& fabric, const std::string& line);

// One client's byte stream: each complete line is executed in order and
// answered with one line. Lines are at most kMaxLine bytes; a longer one
// gets "error: line too long" and the client is to be dropped.
class ControlSession {
 public:
  static constexpr size_t kMaxLine = 256;
  explicit ControlSession(Fabric& fabric) : _fabric(fabric) {}
  // Takes the next bytes from the client; returns the replies they complete
  // (each ending in '\n'). *drop is set when the client must be dropped.
  std::string feed(const char* data, size_t n, bool* drop);

 private:
  Fabric& _fabric;
  std::string _buf;
};

class ControlServer {
 public:
  explicit ControlServer(Fabric& fabric) : _fabric(fabric) {}
  ~ControlServer() { stop(); }
  Status start(const std::string& path);
  void stop();

 private:
  void loop();
  void serve(int fd);

  Fabric& _fabric;
  std::string _path;
  UniqueFd _listen;
  std::atomic<bool> _stop{false};
  std::thread _thread;
};

}  // namespace hcomm::sim
