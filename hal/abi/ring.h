// Ring: the one ring-index arithmetic used by the driver (hal/npu) and the
// device model (sim/). Indices are free-running 32-bit counters; the slot of
// index i is i & (size - 1), and the CQ phase of index i is ((i >> log2) & 1) ^ 1,
// so the first pass over a zeroed CQ writes phase 1 (docs/device-abi.md §8).
#pragma once

#include <cstdint>

namespace hcomm::hal::abi {

template <typename Entry>
class Ring {
 public:
  Ring() = default;
  Ring(Entry* entries, uint32_t log2) : _entries(entries), _log2(log2), _mask((1u << log2) - 1) {}

  uint32_t size() const { return _mask + 1; }
  uint32_t log2() const { return _log2; }
  Entry& at(uint32_t index) const { return _entries[index & _mask]; }
  Entry* entries() const { return _entries; }

  // Entries between a consumer index and a producer index (mod 2^32).
  static uint32_t used(uint32_t producer, uint32_t consumer) { return producer - consumer; }
  uint32_t free_slots(uint32_t producer, uint32_t consumer) const {
    return size() - used(producer, consumer);
  }
  // A producer index is plausible only if it is at most one ring ahead.
  bool valid_producer(uint32_t producer, uint32_t consumer) const {
    return used(producer, consumer) <= size();
  }
  uint16_t phase(uint32_t index) const { return static_cast<uint16_t>(((index >> _log2) & 1u) ^ 1u); }

 private:
  Entry* _entries = nullptr;
  uint32_t _log2 = 0;
  uint32_t _mask = 0;
};

}  // namespace hcomm::hal::abi
