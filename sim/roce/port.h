// Port back-ends of hcomm-sim's RoCEv2 engine: where its Ethernet frames go.
//  - Link: the switch's uplink, whatever carries its frames.
//  - DgramPort: a QEMU `-netdev dgram` link: each UDP datagram on 127.0.0.1
//    carries one Ethernet frame, so a guest's virtio NIC (and the Soft-RoCE
//    device on it) is on the same wire as the engine.
//  - DpdkPort (sim/roce/dpdk_port.h): a DPDK ethdev (net_memif between two
//    simulators, net_tap to the kernel, a NIC).
//  - PcapWriter: a capture of what crossed a port (tshark, scapy read it).
#pragma once

#include <atomic>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "common/status.h"

namespace hcomm::sim::roce {

// The uplink as the fabric's network thread uses it: send and recv are
// called from that thread only; overflow() and describe() from any.
class Link {
 public:
  virtual ~Link() = default;
  // A frame out. A frame the link cannot take now (link down, ring full) is
  // lost, as on a wire, and counted in overflow(); an error is a broken link.
  virtual Status send(const uint8_t* frame, size_t len) = 0;
  // One frame in, waiting up to timeout_ms; 0 bytes and ok when none came.
  virtual Status recv(uint8_t* buf, size_t cap, size_t* len, int timeout_ms) = 0;
  // Frames the link itself lost (buffers full, link down), since open.
  virtual uint64_t overflow() const = 0;
  // One word: "dgram:127.0.0.1:L->R", "dpdk:NAME(DRIVER,link-up)".
  virtual std::string describe() const = 0;
};

// Opens the uplink a --uplink argument names: "LOCAL:REMOTE" (UDP ports of a
// dgram link) or "dpdk:DEVARGS" (sim/roce/dpdk_port.h). `run_dir` holds what
// the link needs on disk (DPDK's runtime directory).
Status open_link(const std::string& spec, const std::string& run_dir, std::unique_ptr<Link>* out);
// Whether `spec` has that form (DEVARGS are checked when the link opens);
// for a dgram link, its two ports.
bool valid_link_spec(const std::string& spec, uint16_t* local = nullptr, uint16_t* remote = nullptr);

class DgramPort final : public Link {
 public:
  DgramPort() = default;
  ~DgramPort() override;
  DgramPort(const DgramPort&) = delete;
  DgramPort& operator=(const DgramPort&) = delete;
  // Binds 127.0.0.1:local_port and sends to 127.0.0.1:remote_port (QEMU's
  // local.port / remote.port, crossed).
  Status open(uint16_t local_port, uint16_t remote_port);
  Status send(const uint8_t* frame, size_t len) override;
  // Datagrams from any other sender are dropped.
  Status recv(uint8_t* buf, size_t cap, size_t* len, int timeout_ms) override;
  // Frames the kernel dropped because the socket's buffer was full (the
  // link's own losses, SO_RXQ_OVFL), since open.
  uint64_t overflow() const override { return _overflow.load(std::memory_order_relaxed); }
  std::string describe() const override;

 private:
  int _fd = -1;
  uint16_t _local = 0, _remote = 0;
  std::atomic<uint32_t> _overflow{0};
};

class PcapWriter {
 public:
  ~PcapWriter();
  Status open(const std::string& path);  // LINKTYPE_ETHERNET, microsecond stamps
  void write(const uint8_t* frame, size_t len, uint64_t now_ns);
  Status close();

 private:
  std::FILE* _f = nullptr;
};

}  // namespace hcomm::sim::roce
