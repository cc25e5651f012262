// Deadlines: every wait in hcomm has one.
#pragma once

#include <chrono>
#include <cstdint>

namespace hcomm {

using Clock = std::chrono::steady_clock;

class Deadline {
 public:
  explicit Deadline(std::chrono::nanoseconds budget) : _at(Clock::now() + budget) {}
  static Deadline after_ms(int64_t ms) { return Deadline(std::chrono::milliseconds(ms)); }
  bool expired() const { return Clock::now() >= _at; }
  // Milliseconds left, rounded up, clamped at 0 (for poll(2)).
  int remaining_ms() const {
    auto left = std::chrono::ceil<std::chrono::milliseconds>(_at - Clock::now()).count();
    return left <= 0 ? 0 : (left > 0x7fffffff ? 0x7fffffff : static_cast<int>(left));
  }
  Clock::time_point at() const { return _at; }

 private:
  Clock::time_point _at;
};

}  // namespace hcomm
