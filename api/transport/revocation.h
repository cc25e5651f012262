// The revocation mailbox of the RDMA transports (verbs, npu_roce): u32 words
// in memory peers RDMA WRITE into. [owner][slot] = the highest generation
// the owner revoked; then [owner] = the owner's latest revocation number
// (its notice); then [peer] = the latest of our numbers that peer
// acknowledged. The protocol: api/transport/verbs/verbs.h, "Keys".
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <vector>

#include "api/transport/shm/shm.h"  // kMaxRegs
#include "common/barrier.h"         // cpu_relax
#include "common/time.h"

namespace hcomm::api {

class RevocationMailbox {
 public:
  RevocationMailbox(uint32_t* words, int size) : _w(words), _size(static_cast<size_t>(size)) {}

  static size_t words(int size) { return static_cast<size_t>(size) * (kMaxRegs + 2); }
  static size_t slot_word(int owner, uint32_t slot) { return static_cast<size_t>(owner) * kMaxRegs + slot; }
  size_t notice_word(int owner) const { return _size * kMaxRegs + static_cast<size_t>(owner); }
  size_t ack_word(int peer) const { return _size * (kMaxRegs + 1) + static_cast<size_t>(peer); }

  uint32_t load(size_t word) const { return std::atomic_ref<uint32_t>(_w[word]).load(std::memory_order_acquire); }
  void store(size_t word, uint32_t v) const { std::atomic_ref<uint32_t>(_w[word]).store(v, std::memory_order_release); }
  // Whether `peer` revoked generation `gen` of its registration `slot`.
  bool revoked(int peer, uint32_t slot, uint32_t gen) const {
    const uint32_t r = load(slot_word(peer, slot));
    return r != 0 && r >= gen;
  }

  // How long a release waits for a peer's acknowledgement: a peer that
  // makes no hcomm call that long has had its queue pair's retry bound
  // (`stall`) for what it posted before.
  static std::chrono::milliseconds ack_wait(std::chrono::milliseconds stall) {
    return std::max(std::chrono::milliseconds(1000), 2 * stall);
  }

  // Step 3 of a release: waits until every rank in `waiting` has
  // acknowledged revocation number n, or is down (up(r) false), or
  // ack_wait(stall) passes; step() runs between looks (answer the peers' own
  // notices, reap completions). Spins 2 ms (a peer inside hcomm answers
  // within a round trip), then naps: on a software NIC the peer's answer
  // needs these CPUs.
  template <class Step, class Up>
  void await_acks(std::vector<int> waiting, uint32_t n, std::chrono::milliseconds stall, Step step, Up up) const {
    const Deadline dl(ack_wait(stall));
    const Clock::time_point start = Clock::now();
    while (!waiting.empty() && !dl.expired()) {
      step();
      std::erase_if(waiting, [&](int r) { return !up(r) || static_cast<int32_t>(load(ack_word(r)) - n) >= 0; });
      if (Clock::now() - start < std::chrono::milliseconds(2)) cpu_relax();
      else std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

 private:
  uint32_t* _w;
  size_t _size;
};

}  // namespace hcomm::api
