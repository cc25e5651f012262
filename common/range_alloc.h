// First-fit allocation of address ranges: the NPU transport's device memory
// (HBM offsets) and the VFIO link's IOVA space. Cold paths: the free list is
// a std::map from start to length, sorted by address and coalesced on every
// release, so it stays as short as the number of holes.
#pragma once

#include <cstdint>
#include <iterator>
#include <map>
#include <optional>

namespace hcomm {

class RangeAllocator {
 public:
  RangeAllocator() = default;
  // Everything in [base, base + size) starts free.
  RangeAllocator(uint64_t base, uint64_t size) {
    if (size != 0) _free.emplace(base, size);
  }

  // The start of the lowest free range that holds `len` bytes, now taken;
  // nothing when len is 0 or no range is large enough.
  std::optional<uint64_t> take(uint64_t len) {
    if (len == 0) return std::nullopt;
    for (auto it = _free.begin(); it != _free.end(); ++it) {
      if (it->second < len) continue;
      const uint64_t start = it->first;
      const uint64_t left = it->second - len;
      _free.erase(it);
      if (left != 0) _free.emplace(start + len, left);
      return start;
    }
    return std::nullopt;
  }

  // Gives [start, start + len) back, merged with free neighbours. Refused
  // (false, nothing changes) when the range is empty, wraps around, or
  // overlaps a range that is already free: a release of something never
  // taken, or released twice, must not corrupt the list.
  bool give(uint64_t start, uint64_t len) {
    if (len == 0 || start + len < start) return false;
    auto next = _free.lower_bound(start);
    if (next != _free.end() && next->first < start + len) return false;
    if (next != _free.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second > start) return false;
    }
    auto it = _free.emplace_hint(next, start, len);
    if (next != _free.end() && start + len == next->first) {
      it->second += next->second;
      _free.erase(next);
    }
    if (it != _free.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == start) {
        prev->second += it->second;
        _free.erase(it);
      }
    }
    return true;
  }

  uint64_t free_bytes() const {
    uint64_t n = 0;
    for (const auto& [start, len] : _free) n += len;
    return n;
  }
  // Free ranges (holes) in the list: 1 when nothing is taken.
  size_t fragments() const { return _free.size(); }

 private:
  std::map<uint64_t, uint64_t> _free;  // start -> length, disjoint, never adjacent
};

}  // namespace hcomm
