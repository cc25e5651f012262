// IvshmemFront: serves one sim::Device to one QEMU guest through QEMU's
// ivshmem-doorbell device: hcomm-sim is the ivshmem server (it speaks the
// server protocol of QEMU docs/specs/ivshmem-spec itself; Debian ships no
// ivshmem-server) and the only other peer. Layout and mailbox protocol:
// hal/abi/ivshmem.h; prose: docs/device-abi.md §11.3.
//
//   QEMU:  -chardev socket,path=<socket>,id=c0
//          -device ivshmem-doorbell,chardev=c0,vectors=<vectors_for(queues)>
//          -object memory-backend-file,id=ram,share=on,mem-path=<guest_ram>,...
//          -machine q35,memory-backend=ram
//
// On connect the guest (QEMU) gets: protocol version 0, its peer id
// (kGuestPeer), the device's memfd as the shared memory, the sim's eventfds
// (vector 0 = mailbox, 1 + q = the doorbell eventfd of queue q, the same one
// the engine sleeps on) and its own interrupt eventfds, which become the
// device's MSI-X vectors.
//
// Robustness: the guest is untrusted. Each mailbox request is copied out of
// shared memory once and validated by the device like any register access;
// an unknown op, a bad width or a DMA range outside guest RAM gets an error
// status and message. A QEMU that goes away resets the device and drops its
// DMA mappings (client_gone()), and the front waits for the next one.
//
// Threading: one front thread does accept, the mailbox and disconnects.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "common/fd.h"
#include "common/status.h"
#include "hal/abi/ivshmem.h"
#include "sim/device.h"
#include "sim/front.h"

namespace hcomm::sim {

struct IvshmemFrontOptions {
  // The guest's RAM as a file (QEMU memory-backend-file,share=on). DMA is
  // served from it: guest-physical address = file offset. Opened when the
  // first DMA_MAP arrives (QEMU creates it at start-up). Empty: no DMA.
  std::string guest_ram_path;
  // Sending the set-up messages to a connecting QEMU must finish in this.
  int io_timeout_ms = 3000;
};

class IvshmemFront : public SocketFront {
 public:
  // The device must have been created with hbm_file_offset = kHbmOffset and
  // hbm_file_size = shared_size_for(hbm) (ivshmem_device_config() does it).
  IvshmemFront(Device& dev, std::string socket_path, IvshmemFrontOptions opts = {});
  ~IvshmemFront() override;
  IvshmemFront(const IvshmemFront&) = delete;
  IvshmemFront& operator=(const IvshmemFront&) = delete;

  Status start() override;
  void stop() override;
  std::string describe() const override;

  uint32_t vectors() const { return hal::abi::ivshmem::vectors_for(_dev.config().num_queues); }
  uint64_t clients_served() const { return _clients_served.load(std::memory_order_acquire); }

 private:
  bool serve(UniqueFd client) override;
  void handle_mailbox();
  Status execute(uint32_t op, uint32_t width, uint64_t offset, uint64_t len, uint32_t prot, uint64_t* value);
  Status open_guest_ram();
  // Function-level reset by the transport: what a new driver instance gets.
  void transport_reset();

  Device& _dev;
  IvshmemFrontOptions _opts;
  hal::abi::ivshmem::Mailbox* _mb = nullptr;
  hal::abi::ivshmem::Liveness* _live = nullptr;  // heartbeat and self-resets, for the guest's driver

  UniqueFd _mailbox_efd;
  std::atomic<uint64_t> _clients_served{0};

  // Per-connection (front thread only).
  std::vector<UniqueFd> _guest_irq;  // the guest's interrupt eventfds, per vector
  UniqueFd _ram;
  uint64_t _ram_size = 0;
  uint32_t _last_seq = 0;
};

// The DeviceConfig changes an ivshmem-served device needs (HBM after the
// header and mailbox, file sized to a power of two).
void ivshmem_device_config(DeviceConfig* cfg);

}  // namespace hcomm::sim
