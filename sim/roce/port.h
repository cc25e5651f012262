// Port back-ends of hcomm-sim's RoCEv2 engine: where its Ethernet frames go.
//  - DgramPort: a QEMU `-netdev dgram` link: each UDP datagram on 127.0.0.1
//    carries one Ethernet frame, so a guest's virtio NIC (and the Soft-RoCE
//    device on it) is on the same wire as the engine.
//  - PcapWriter: a capture of what crossed a port (tshark, scapy read it).
#pragma once

#include <atomic>

#include <cstdint>
#include <cstdio>
#include <string>

#include "common/status.h"

namespace hcomm::sim::roce {

class DgramPort {
 public:
  DgramPort() = default;
  ~DgramPort();
  DgramPort(const DgramPort&) = delete;
  DgramPort& operator=(const DgramPort&) = delete;
  // Binds 127.0.0.1:local_port and sends to 127.0.0.1:remote_port (QEMU's
  // local.port / remote.port, crossed).
  Status open(uint16_t local_port, uint16_t remote_port);
  Status send(const uint8_t* frame, size_t len);
  // Waits up to timeout_ms for a frame; 0 bytes and ok when none came.
  // Datagrams from any other sender are dropped.
  Status recv(uint8_t* buf, size_t cap, size_t* len, int timeout_ms);
  // Frames the kernel dropped because the socket's buffer was full (the
  // link's own losses, SO_RXQ_OVFL), since open.
  uint32_t overflow() const { return _overflow.load(std::memory_order_relaxed); }

 private:
  int _fd = -1;
  uint16_t _remote = 0;
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
