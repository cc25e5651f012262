#include "driver/link.h"

#include <unistd.h>

#include "common/barrier.h"

namespace hcomm::driver {

void Doorbell::ring(uint32_t value) const {
  if (fixed) value = fixed_value;
  if (mmio != nullptr) {
    // Device (write) barrier before the MMIO: the descriptor and the tail in
    // the shadow block must be visible before the device is poked.
    wmb();
    *mmio = value;
    return;
  }
  if (pwrite_fd >= 0) {
    wmb();
    // A failed pwrite is a vanished device; the waiter's deadline reports it.
    ssize_t n = ::pwrite(pwrite_fd, &value, sizeof value, static_cast<off_t>(pwrite_offset));
    (void)n;
    return;
  }
  if (eventfd >= 0) {
    uint64_t one = 1;
    // An eventfd write only fails on counter overflow, which a doorbell
    // cannot reach in practice; a lost wake-up is also covered by the
    // engine's bounded sleep.
    ssize_t n = ::write(eventfd, &one, sizeof one);
    (void)n;
  }
}

}  // namespace hcomm::driver
