#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include "common/range_alloc.h"

namespace hcomm {
namespace {

TEST(RangeAlloc, FirstFitSplitsAndRunsOut) {
  RangeAllocator a(0x1000, 0x10000);
  EXPECT_EQ(a.take(0x4000), std::optional<uint64_t>(0x1000));
  EXPECT_EQ(a.take(0x4000), std::optional<uint64_t>(0x5000));
  EXPECT_EQ(a.free_bytes(), 0x8000u);
  EXPECT_EQ(a.take(0x9000), std::nullopt);  // more than is left
  EXPECT_EQ(a.take(0), std::nullopt);
  EXPECT_EQ(a.take(0x8000), std::optional<uint64_t>(0x9000));
  EXPECT_EQ(a.take(1), std::nullopt);
  EXPECT_EQ(a.fragments(), 0u);
  EXPECT_EQ(RangeAllocator().take(1), std::nullopt);
}

TEST(RangeAlloc, ReleasesCoalesceWithBothNeighbours) {
  RangeAllocator a(0, 0x3000);
  ASSERT_EQ(a.take(0x1000), std::optional<uint64_t>(0));
  ASSERT_EQ(a.take(0x1000), std::optional<uint64_t>(0x1000));
  ASSERT_EQ(a.take(0x1000), std::optional<uint64_t>(0x2000));
  EXPECT_TRUE(a.give(0, 0x1000));
  EXPECT_TRUE(a.give(0x2000, 0x1000));
  EXPECT_EQ(a.fragments(), 2u);
  // A hole of 0x1000 on each side: 0x2000 does not fit until the middle returns.
  EXPECT_EQ(a.take(0x2000), std::nullopt);
  EXPECT_TRUE(a.give(0x1000, 0x1000));
  EXPECT_EQ(a.fragments(), 1u);
  EXPECT_EQ(a.take(0x3000), std::optional<uint64_t>(0));
}

TEST(RangeAlloc, FirstFitTakesTheLowestHoleThatFits) {
  RangeAllocator a(0, 0x10000);
  std::vector<uint64_t> at;
  for (int i = 0; i < 8; ++i) at.push_back(*a.take(0x2000));
  EXPECT_TRUE(a.give(at[1], 0x2000));  // small hole at 0x2000
  EXPECT_TRUE(a.give(at[4], 0x2000));  // 0x8000..0xc000 after the next give
  EXPECT_TRUE(a.give(at[5], 0x2000));
  EXPECT_EQ(a.take(0x3000), std::optional<uint64_t>(0x8000));  // skips the 0x2000 hole
  EXPECT_EQ(a.take(0x1000), std::optional<uint64_t>(0x2000));  // lowest fit
}

TEST(RangeAlloc, DoubleAndOverlappingReleasesAreRefusedAndChangeNothing) {
  RangeAllocator a(0, 0x4000);
  ASSERT_EQ(a.take(0x2000), std::optional<uint64_t>(0));
  const uint64_t before = a.free_bytes();
  EXPECT_FALSE(a.give(0x2000, 0x1000));  // already free
  EXPECT_FALSE(a.give(0x1000, 0x2000));  // runs into the free tail
  EXPECT_FALSE(a.give(0x3fff, 2));       // inside the free tail
  EXPECT_FALSE(a.give(0x1000, 0));       // empty
  EXPECT_FALSE(a.give(UINT64_MAX, 2));   // wraps
  EXPECT_EQ(a.free_bytes(), before);
  EXPECT_EQ(a.fragments(), 1u);
  EXPECT_TRUE(a.give(0, 0x2000));
  EXPECT_FALSE(a.give(0, 0x2000));  // the same range twice
  EXPECT_EQ(a.free_bytes(), 0x4000u);
  EXPECT_EQ(a.fragments(), 1u);
}

TEST(RangeAlloc, RandomTakesAndGivesKeepEveryByteAccountedFor) {
  std::mt19937_64 rng(42);  // fixed: a failure replays
  RangeAllocator a(0x10000, 1 << 20);
  std::vector<std::pair<uint64_t, uint64_t>> live;
  uint64_t used = 0;
  for (int i = 0; i < 5000; ++i) {
    if (live.empty() || rng() % 2 == 0) {
      const uint64_t len = 1 + rng() % 20000;
      if (auto at = a.take(len)) {
        for (const auto& [s, l] : live) ASSERT_TRUE(*at + len <= s || s + l <= *at) << "overlap";
        ASSERT_GE(*at, 0x10000u);
        ASSERT_LE(*at + len, 0x10000u + (1 << 20));
        live.emplace_back(*at, len);
        used += len;
      }
    } else {
      const size_t k = rng() % live.size();
      ASSERT_TRUE(a.give(live[k].first, live[k].second));
      used -= live[k].second;
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    }
    ASSERT_EQ(a.free_bytes() + used, uint64_t{1} << 20);
  }
  for (const auto& [s, l] : live) ASSERT_TRUE(a.give(s, l));
  EXPECT_EQ(a.fragments(), 1u);
  EXPECT_EQ(a.take(1 << 20), std::optional<uint64_t>(0x10000));
}

}  // namespace
}  // namespace hcomm
