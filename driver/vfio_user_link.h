// The vfio-user client: a driver::Link to a device served over a UNIX socket
// (hcomm-sim's VfioUserServer, or any vfio-user server exposing the hcomm NPU
// ABI), speaking protocol 0.1 as QEMU's vfio-user client does
// (hal/abi/vfio_user.h).
//
// How each Link operation travels:
//   region_info   cached at open from DEVICE_GET_REGION_INFO (all 9 PCI regions)
//   map_region    mmap of the fd that came with the region info (BAR2 = HBM)
//   read / write  REGION_READ / REGION_WRITE (BAR0 registers, CONFIG, or BAR2)
//   doorbell      the ioeventfd GET_REGION_IO_FDS gave for that BAR0 offset
//   set_msix      DEVICE_SET_IRQS (MSIX index, ACTION_TRIGGER, DATA_EVENTFD)
//   dma_map       DMA_MAP with the memory's fd, at a bus address this link
//                 allocates (4 KiB aligned, never 0)
//   reset         DEVICE_RESET
//
// Every reply wait has a deadline (timeout_ms). A timeout, a malformed reply or
// a closed socket leaves the stream in an unknown state, so the link then
// fails every later call with the same status (reopen to recover). An error
// reply from the server only fails that call.
//
// Thread-safe: one mutex serialises request/reply pairs.
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "driver/link.h"

namespace hcomm::driver {

// Connects to `socket_path`, negotiates the version and reads the device's
// regions, interrupts and doorbell fds. timeout_ms bounds the connect and
// each later request/reply.
Status open_vfio_user(const std::string& socket_path, std::unique_ptr<Link>* out, int timeout_ms = 5000);

}  // namespace hcomm::driver
