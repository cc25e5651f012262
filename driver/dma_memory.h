// DMA-able host memory: a memfd-backed, pinned-in-practice, shareable buffer.
//
// Why memfd: the same bytes must be reachable three ways — by this process
// (data()), by a device behind Linux VFIO (the link pins the pages with
// VFIO_IOMMU_MAP_DMA), and by a device model in another process (hcomm-sim
// over vfio-user maps fd()). A memfd is the one object that serves all three.
//
// Why hugepages when possible: a 2 MiB page is physically contiguous, which
// iova-mode=pa (no IOMMU, or QEMU without a vIOMMU) needs for any buffer
// larger than 4 KiB, and it cuts IOTLB misses for large rings/buffers.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace hcomm::driver {

inline constexpr size_t kHugePageSize = size_t{2} << 20;

class DmaBuffer {
 public:
  DmaBuffer() = default;
  DmaBuffer(DmaBuffer&& o) noexcept;
  DmaBuffer& operator=(DmaBuffer&& o) noexcept;
  DmaBuffer(const DmaBuffer&) = delete;
  DmaBuffer& operator=(const DmaBuffer&) = delete;
  // Unmaps, then closes the memfd. Callers must have dma_unmap()ed the
  // buffer from every link first: the device must not outlive its memory.
  ~DmaBuffer();

  // Allocate at least `bytes` (rounded up to the page size used), zeroed and
  // populated. MFD_HUGETLB is tried when `bytes` is a multiple of 2 MiB; on
  // any failure there (no hugepages reserved) it falls back to normal pages.
  // numa_node: -1 = no preference, else the pages are bound to that node
  // (libnuma) before they are first touched.
  static Status allocate(size_t bytes, int numa_node, DmaBuffer* out);

  // Process-wide, like DPDK's EAL iova mode: once a link that uses physical
  // addresses as bus addresses is open (iova-mode=pa), every buffer larger
  // than a 4 KiB page comes from 2 MiB hugepages (rounded up) with no
  // fallback, so that buffers up to 2 MiB are physically contiguous. The
  // link still checks contiguity of what it maps.
  static void set_physically_contiguous(bool on);
  static bool physically_contiguous();

  void* data() const { return _data; }
  size_t size() const { return _size; }  // mapped bytes (>= requested)
  int fd() const { return _fd; }         // owned by the buffer; dup() to keep it longer
  bool hugepages() const { return _hugepages; }
  int node() const { return _node; }     // the requested node, -1 for none
  bool valid() const { return _data != nullptr; }

 private:
  void release() noexcept;

  void* _data = nullptr;
  size_t _size = 0;
  int _fd = -1;
  bool _hugepages = false;
  int _node = -1;
};

}  // namespace hcomm::driver
