// VfioUserServer: serves one sim::Device to one vfio-user client at a time
// over a UNIX stream socket, the way libvfio-user serves QEMU (protocol
// 0.1, hal/abi/vfio_user.h).
//
// What the client sees (region indices as VFIO PCI):
//   CONFIG (7): 256 bytes, REGION_READ/WRITE -> Device::config_read/write.
//   BAR0   (0): abi::kBar0Size, trapped (not mmapable) -> bar0_read/write.
//               GET_REGION_IO_FDS hands out one ioeventfd per queue (a dup of
//               Device::doorbell_eventfd(q)) at reg::doorbell(q), size 4.
//   BAR2   (2): HBM, mmapable through Device::hbm_fd(); REGION_READ/WRITE go
//               through Device::hbm_access.
//   other BARs, ROM, VGA: size 0.
//   IRQ MSIX (2): Device::msix_count() vectors, eventfd-capable.
//
// Robustness contract: every message is validated before anything reaches the
// device. A malformed header, an oversized message, a short read, or a client
// that stalls more than io_timeout_ms inside one message is dropped (the device
// sees client_gone()) and the server goes back to accept(). Anything else that
// is wrong gets an error reply with an errno and the connection stays up.
// Received fds are owned from the moment they arrive: unexpected ones are
// closed, expected ones are handed to the device (which takes ownership).
//
// Threading: one server thread does accept and all client I/O, so device
// calls from this front are serialised. start()/stop() are called from the
// owner's thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "common/fd.h"
#include "common/status.h"
#include "common/time.h"
#include "hal/abi/vfio_user.h"
#include "sim/device.h"
#include "sim/front.h"

namespace hcomm::sim {

struct VfioUserServerOptions {
  // A client that has sent part of a message (or does not drain a reply) for
  // longer than this is dropped. Idle time between messages is unlimited.
  int io_timeout_ms = 3000;
};

class VfioUserServer : public SocketFront {
 public:
  // `dev` must outlive the server. The socket file is created by start()
  // (a stale socket file at the path is replaced) and removed by stop().
  VfioUserServer(Device& dev, std::string socket_path, VfioUserServerOptions opts = {});
  ~VfioUserServer() override;
  VfioUserServer(const VfioUserServer&) = delete;
  VfioUserServer& operator=(const VfioUserServer&) = delete;

  Status start() override;
  void stop() override;
  std::string describe() const override;

  const std::string& socket_path() const { return _path; }
  // Clients served to completion (connected and then gone), for tests/logs.
  uint64_t clients_served() const { return _clients_served.load(std::memory_order_acquire); }
  // Of those, the ones dropped for a protocol violation or a stall.
  uint64_t clients_dropped() const { return _clients_dropped.load(std::memory_order_acquire); }

 private:
  struct Message;  // one received command: header, payload, fds
  struct Reply;    // what goes back: header fields, payload, fds

  bool serve(UniqueFd client) override;

  void dispatch(Message& m, Reply* r);
  void do_version(Message& m, Reply* r);
  void do_dma_map(Message& m, Reply* r);
  void do_dma_unmap(Message& m, Reply* r);
  void do_get_info(Message& m, Reply* r);
  void do_region_info(Message& m, Reply* r);
  void do_region_io_fds(Message& m, Reply* r);
  void do_irq_info(Message& m, Reply* r);
  void do_set_irqs(Message& m, Reply* r);
  void do_region_rw(Message& m, Reply* r, bool write);
  void do_reset(Message& m, Reply* r);

  uint64_t region_size(uint32_t index) const;

  Device& _dev;
  VfioUserServerOptions _opts;

  std::atomic<uint64_t> _clients_served{0};
  std::atomic<uint64_t> _clients_dropped{0};

  // Per-connection state (server thread only).
  bool _negotiated = false;
  hal::abi::vfio_user::Caps _peer;  // what the client told us it accepts
};

}  // namespace hcomm::sim
