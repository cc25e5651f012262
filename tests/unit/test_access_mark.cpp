// Access marks (api/mem/access_mark.h): a thread's mark names the owner while
// it is held and not after; a release that waits for the owner's name to go
// sees every byte the access wrote; thread indexes come back when threads
// exit; threads beyond the table's lines share the counted last line.
#include "api/mem/access_mark.h"

#include <gtest/gtest.h>

#include <atomic>
#include <barrier>
#include <memory>
#include <set>
#include <thread>
#include <vector>

namespace hcomm::api {
namespace {

TEST(AccessMark, NamesTheOwnerWhileHeldAndNotAfter) {
  (void)marks_init();
  auto t = std::make_unique<MarkTable>();
  MarkSlot s;
  EXPECT_FALSE(marks_name(*t, 3));
  {
    const AccessMark m(t.get(), 3 + 1, s);
    EXPECT_TRUE(marks_name(*t, 3));
    EXPECT_FALSE(marks_name(*t, 2));
    EXPECT_NE(s.index1, 0u);
  }
  EXPECT_FALSE(marks_name(*t, 3));
  {
    const AccessMark none(nullptr, 3 + 1, s);  // a key with no CPU copy on this host
    EXPECT_FALSE(marks_name(*t, 3));
  }
}

TEST(AccessMark, AReleaseThatWaitsSeesTheWholeAccess) {
  (void)marks_init();
  auto t = std::make_unique<MarkTable>();
  std::vector<uint64_t> target(4096, 0);
  std::atomic<bool> marked{false};
  std::thread access([&] {
    MarkSlot s;
    const AccessMark m(t.get(), 7 + 1, s);
    marked.store(true);
    for (int round = 0; round < 200; ++round)
      for (uint64_t& w : target) w = static_cast<uint64_t>(round) + 1;  // the copy
  });
  while (!marked.load()) std::this_thread::yield();
  marks_heavy_barrier();
  while (marks_name(*t, 7)) std::this_thread::yield();  // the release's wait
  for (uint64_t w : target) ASSERT_EQ(w, 200u) << "the wait ended before the access's last byte";
  access.join();
}

TEST(AccessMark, AnExitedThreadsIndexIsGivenBack) {
  uint32_t first = 0, second = 0;
  auto t = std::make_unique<MarkTable>();
  std::thread([&] {
    MarkSlot s;
    const AccessMark m(t.get(), 1, s);
    first = s.index1;
  }).join();
  std::thread([&] {
    MarkSlot s;
    const AccessMark m(t.get(), 1, s);
    second = s.index1;
  }).join();
  EXPECT_NE(first, 0u);
  EXPECT_EQ(first, second);
  // Another table: the same index (a thread alternating between two
  // contexts does not use up lines).
  std::thread([&] {
    auto u = std::make_unique<MarkTable>();
    MarkSlot s;
    { const AccessMark m(t.get(), 1, s); }
    const uint32_t in_t = s.index1;
    { const AccessMark m(u.get(), 1, s); }
    EXPECT_EQ(s.index1, in_t);
  }).join();
}

TEST(AccessMark, ThreadsBeyondTheLinesShareTheCountedLastLine) {
  constexpr int kThreads = static_cast<int>(kMarkLines) + 9;
  auto t = std::make_unique<MarkTable>();
  std::barrier all_marked(kThreads + 1), release(kThreads + 1);
  std::vector<uint32_t> index(kThreads, 0);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      MarkSlot s;
      {
        const AccessMark m(t.get(), 5 + 1, s);
        index[static_cast<size_t>(i)] = s.index1 - 1;
        all_marked.arrive_and_wait();
        release.arrive_and_wait();
      }
    });
  }
  all_marked.arrive_and_wait();
  std::set<uint32_t> distinct(index.begin(), index.end());
  EXPECT_EQ(distinct.size(), static_cast<size_t>(kThreads)) << "two live threads share an index";
  uint32_t beyond = 0;
  for (uint32_t i : index) beyond += i >= kMarkLines - 1 ? 1 : 0;
  EXPECT_GE(beyond, static_cast<uint32_t>(kThreads - static_cast<int>(kMarkLines) + 1));
  EXPECT_EQ(t->lines[kMarkLines - 1].n.load(), beyond);
  EXPECT_TRUE(marks_name(*t, 5));
  EXPECT_TRUE(marks_name(*t, 9)) << "the shared line names every owner while it counts";
  release.arrive_and_wait();
  for (auto& th : threads) th.join();
  EXPECT_FALSE(marks_name(*t, 5));
  EXPECT_EQ(t->lines[kMarkLines - 1].n.load(), 0u);
}

}  // namespace
}  // namespace hcomm::api
