// DmaBuffer: memfd-backed DMA memory.
#include "driver/dma_memory.h"
#include "common/fd.h"
#include "common/memfd.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <numa.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <utility>

namespace hcomm::driver {
namespace {

void expect_shared_through_fd(const DmaBuffer& b) {
  // A second, independent mapping of the fd must see the same bytes in both
  // directions: that is what a device model in another process relies on.
  auto* p = static_cast<uint8_t*>(b.data());
  for (size_t i = 0; i < b.size(); i += 4096) p[i] = static_cast<uint8_t>(i / 4096 + 1);
  void* q = ::mmap(nullptr, b.size(), PROT_READ | PROT_WRITE, MAP_SHARED, b.fd(), 0);
  ASSERT_NE(q, MAP_FAILED);
  auto* m = static_cast<uint8_t*>(q);
  for (size_t i = 0; i < b.size(); i += 4096) ASSERT_EQ(m[i], static_cast<uint8_t>(i / 4096 + 1)) << i;
  m[b.size() - 1] = 0xa5;
  EXPECT_EQ(p[b.size() - 1], 0xa5);
  ::munmap(q, b.size());
}

TEST(DmaBuffer, AllocateWriteReadAndShareThroughFd) {
  DmaBuffer b;
  ASSERT_TRUE(DmaBuffer::allocate(10000, -1, &b).is_ok());
  EXPECT_TRUE(b.valid());
  EXPECT_EQ(b.size(), 3u * 4096);  // rounded up to whole pages
  EXPECT_FALSE(b.hugepages());      // not a 2 MiB multiple
  EXPECT_EQ(b.node(), -1);
  ASSERT_GE(b.fd(), 0);
  struct stat st {};
  ASSERT_EQ(::fstat(b.fd(), &st), 0);
  EXPECT_EQ(static_cast<size_t>(st.st_size), b.size());

  // Zero-filled on allocation.
  auto* p = static_cast<const uint8_t*>(b.data());
  for (size_t i = 0; i < b.size(); ++i) ASSERT_EQ(p[i], 0) << i;
  std::memset(b.data(), 0x3c, 10000);
  EXPECT_EQ(p[9999], 0x3c);
  expect_shared_through_fd(b);
}

// Peers map these files: the size is sealed, and a receiver maps a file only
// if it holds the bytes it expects and cannot shrink (a peer that truncated
// it under the mapping would turn the next access into SIGBUS).
TEST(DmaBuffer, SharedFilesAreSealedAndReceiversCheckThem) {
  DmaBuffer b;
  ASSERT_TRUE(DmaBuffer::allocate(10000, -1, &b).is_ok());
  const int seals = ::fcntl(b.fd(), F_GET_SEALS);
  ASSERT_GE(seals, 0);
  EXPECT_NE(seals & F_SEAL_SHRINK, 0);
  EXPECT_NE(seals & F_SEAL_GROW, 0);
  EXPECT_NE(::ftruncate(b.fd(), 4096), 0) << "a sealed buffer shrank";
  EXPECT_TRUE(check_peer_memfd(b.fd(), b.size(), "buffer").is_ok());
  Status st = check_peer_memfd(b.fd(), b.size() + 1, "buffer");
  EXPECT_EQ(st.code(), Code::protocol_error) << st.to_string();

  // A file that can still shrink is refused, whatever its size.
  hcomm::UniqueFd loose(::memfd_create("t", MFD_CLOEXEC));
  ASSERT_TRUE(loose.valid());
  ASSERT_EQ(::ftruncate(loose.get(), 65536), 0);
  st = check_peer_memfd(loose.get(), 4096, "loose");
  EXPECT_EQ(st.code(), Code::protocol_error) << st.to_string();
  EXPECT_NE(st.message().find("not sealed"), std::string::npos) << st.message();

  // Sealed but shorter than expected: refused.
  hcomm::UniqueFd shortf(::memfd_create("t", MFD_CLOEXEC | kSealableMemfd));
  ASSERT_TRUE(shortf.valid());
  ASSERT_EQ(::ftruncate(shortf.get(), 4096), 0);
  ASSERT_TRUE(seal_size(shortf.get(), "short").is_ok());
  st = check_peer_memfd(shortf.get(), 8192, "short");
  EXPECT_EQ(st.code(), Code::protocol_error) << st.to_string();
  EXPECT_TRUE(check_peer_memfd(shortf.get(), 4096, "short").is_ok());
}

TEST(DmaBuffer, HugepageSizeTriesHugetlbAndFallsBack) {
  DmaBuffer b;
  ASSERT_TRUE(DmaBuffer::allocate(kHugePageSize, -1, &b).is_ok());
  EXPECT_EQ(b.size(), kHugePageSize);
  // Either outcome is valid (depends on vm.nr_hugepages); both must work.
  RecordProperty("hugepages", b.hugepages() ? "yes" : "no");
  expect_shared_through_fd(b);
}

TEST(DmaBuffer, NumaNodeZero) {
  DmaBuffer b;
  Status st = DmaBuffer::allocate(64 * 1024, 0, &b);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(b.node(), 0);
  if (numa_available() >= 0) {
    // The pages really are on node 0.
    int node = -1;
    ASSERT_EQ(numa_move_pages(0, 1, std::array<void*, 1>{b.data()}.data(), nullptr, &node, 0), 0);
    EXPECT_EQ(node, 0);
  }
  expect_shared_through_fd(b);
}

TEST(DmaBuffer, RejectsBadRequests) {
  DmaBuffer b;
  Status st = DmaBuffer::allocate(0, -1, &b);
  EXPECT_EQ(st.code(), Code::invalid_argument);
  EXPECT_NE(st.message().find("zero-size"), std::string::npos) << st.message();

  st = DmaBuffer::allocate(SIZE_MAX / 2, -1, &b);
  EXPECT_EQ(st.code(), Code::invalid_argument);
  EXPECT_NE(st.message().find("more than the machine's"), std::string::npos) << st.message();
  st = DmaBuffer::allocate(SIZE_MAX, -1, &b);
  EXPECT_EQ(st.code(), Code::invalid_argument);

  EXPECT_EQ(DmaBuffer::allocate(4096, -2, &b).code(), Code::invalid_argument);
  st = DmaBuffer::allocate(4096, 4000, &b);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("NUMA node 4000"), std::string::npos) << st.message();
  EXPECT_FALSE(b.valid());
}

TEST(DmaBuffer, MoveTransfersOwnership) {
  DmaBuffer a;
  ASSERT_TRUE(DmaBuffer::allocate(4096, -1, &a).is_ok());
  void* p = a.data();
  int fd = a.fd();
  DmaBuffer b(std::move(a));
  EXPECT_FALSE(a.valid());
  EXPECT_EQ(a.fd(), -1);
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(b.fd(), fd);
  DmaBuffer c;
  ASSERT_TRUE(DmaBuffer::allocate(8192, -1, &c).is_ok());
  c = std::move(b);  // c's old buffer is released
  EXPECT_EQ(c.data(), p);
  EXPECT_EQ(c.size(), 4096u);
  { DmaBuffer gone(std::move(c)); }
  EXPECT_EQ(::fcntl(fd, F_GETFD), -1);  // closed with its buffer
}

}  // namespace
}  // namespace hcomm::driver
