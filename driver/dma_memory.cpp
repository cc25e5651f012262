#include "driver/dma_memory.h"

#include <numa.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <utility>

#include "common/fd.h"
#include "common/memfd.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels answer EINVAL
#endif

namespace hcomm::driver {

namespace {

constexpr size_t kSmallPage = 4096;

size_t physical_memory_bytes() {
  long pages = ::sysconf(_SC_PHYS_PAGES);
  long page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return SIZE_MAX;  // unknown: do not second-guess the kernel
  return static_cast<size_t>(pages) * static_cast<size_t>(page);
}

// Fault every page in (pages are already zero: memfd contents start zeroed).
// MADV_POPULATE_WRITE reports failure as an errno; touching by hand would
// turn a node without free memory into SIGBUS.
int populate(void* p, size_t len, size_t page, bool allow_touch) {
  if (::madvise(p, len, MADV_POPULATE_WRITE) == 0) return 0;
  int err = errno;
  if (err != EINVAL || !allow_touch) return err;
  volatile char* c = static_cast<volatile char*>(p);
  for (size_t off = 0; off < len; off += page) c[off] = 0;
  return 0;
}

std::atomic<bool> g_contiguous{false};

}  // namespace

void DmaBuffer::set_physically_contiguous(bool on) { g_contiguous.store(on, std::memory_order_relaxed); }
bool DmaBuffer::physically_contiguous() { return g_contiguous.load(std::memory_order_relaxed); }

DmaBuffer::DmaBuffer(DmaBuffer&& o) noexcept
    : _data(std::exchange(o._data, nullptr)),
      _size(std::exchange(o._size, 0)),
      _fd(std::exchange(o._fd, -1)),
      _hugepages(std::exchange(o._hugepages, false)),
      _node(std::exchange(o._node, -1)) {}

DmaBuffer& DmaBuffer::operator=(DmaBuffer&& o) noexcept {
  if (this != &o) {
    release();
    _data = std::exchange(o._data, nullptr);
    _size = std::exchange(o._size, 0);
    _fd = std::exchange(o._fd, -1);
    _hugepages = std::exchange(o._hugepages, false);
    _node = std::exchange(o._node, -1);
  }
  return *this;
}

DmaBuffer::~DmaBuffer() { release(); }

void DmaBuffer::release() noexcept {
  // Order: mapping first, then the fd (the mapping holds its own reference
  // to the file, so either order is safe; this one mirrors allocate()).
  if (_data != nullptr) ::munmap(_data, _size);
  if (_fd >= 0) ::close(_fd);
  _data = nullptr;
  _size = 0;
  _fd = -1;
  _hugepages = false;
  _node = -1;
}

Status DmaBuffer::allocate(size_t bytes, int numa_node, DmaBuffer* out) {
  if (bytes == 0) return Status::error(Code::invalid_argument, "DMA buffer: zero-size allocation");
  const size_t phys = physical_memory_bytes();
  if (bytes > phys || bytes > SIZE_MAX - kHugePageSize)
    return Status::error(Code::invalid_argument,
                         "DMA buffer: %zu bytes requested, more than the machine's %zu bytes of memory", bytes,
                         phys);
  if (numa_node < -1)
    return Status::error(Code::invalid_argument, "DMA buffer: NUMA node %d (use -1 for no preference)",
                         numa_node);

  bool bind = false;
  if (numa_node >= 0) {
    if (numa_available() < 0) {
      // No NUMA support in this kernel: there is exactly one node, node 0.
      if (numa_node != 0)
        return Status::error(Code::unsupported, "DMA buffer: NUMA node %d requested but NUMA is not available",
                             numa_node);
    } else {
      if (numa_node > numa_max_node() || numa_bitmask_isbitset(numa_all_nodes_ptr, numa_node) == 0)
        return Status::error(Code::invalid_argument, "DMA buffer: NUMA node %d does not exist or has no memory",
                             numa_node);
      bind = true;
    }
  }

  // Hugepages first when the size asks for them, then normal pages.
  const bool must_huge = physically_contiguous() && bytes > kSmallPage;
  const bool want_huge = must_huge || bytes % kHugePageSize == 0;
  Status last;
  for (int attempt = want_huge ? 0 : 1; attempt < (must_huge ? 1 : 2); ++attempt) {
    const bool huge = attempt == 0;
    const size_t page = huge ? kHugePageSize : kSmallPage;
    const size_t len = (bytes + page - 1) / page * page;

    UniqueFd fd(::memfd_create("hcomm-dma", MFD_CLOEXEC | kSealableMemfd | (huge ? MFD_HUGETLB : 0u)));
    if (!fd.valid()) {
      last = Status::from_errno(errno, huge ? "DMA buffer: memfd_create(MFD_HUGETLB)" : "DMA buffer: memfd_create");
      continue;
    }
    if (::ftruncate(fd.get(), static_cast<off_t>(len)) != 0) {
      last = Status::from_errno(errno, "DMA buffer: ftruncate to " + std::to_string(len));
      continue;
    }
    // Peers map this file (hcomm memory on one host): its size is final.
    if (Status st = seal_size(fd.get(), "DMA buffer"); !st) {
      last = st;
      continue;
    }
    // With a node binding the pages must not be faulted before mbind():
    // numa_tonode_memory() does not move pages that already exist. Without
    // one, MAP_POPULATE faults them in at mmap time.
    const int flags = MAP_SHARED | (bind ? 0 : MAP_POPULATE);
    void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, flags, fd.get(), 0);
    if (p == MAP_FAILED) {
      // Hugetlb reserves at mmap time: ENOMEM here = no free hugepages.
      last = Status::from_errno(errno, "DMA buffer: mmap " + std::to_string(len) + " bytes" +
                                           (huge ? " of hugepages" : ""));
      continue;
    }
    if (bind) {
      numa_tonode_memory(p, len, numa_node);
      // Hand-touching hugepages could SIGBUS on a node without free ones.
      if (int err = populate(p, len, page, !huge); err != 0) {
        ::munmap(p, len);
        last = Status::from_errno(err, "DMA buffer: populate on NUMA node " + std::to_string(numa_node));
        continue;
      }
    }
    DmaBuffer b;
    b._data = p;
    b._size = len;
    b._fd = fd.release();
    b._hugepages = huge;
    b._node = numa_node;
    *out = std::move(b);
    return Status::ok();
  }
  if (must_huge)
    return Status(last.code(), last.message() +
                                   " (iova-mode=pa needs hugepages for buffers over 4 KiB: reserve some with "
                                   "/proc/sys/vm/nr_hugepages)");
  return last;
}

}  // namespace hcomm::driver
