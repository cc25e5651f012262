// Access marks: what lets a release on one host wait out the CPU copies that
// already looked at the owner's generation (docs/api.md, "Keys").
//
// Each process's control segment holds a MarkTable. Its first
// kMarkLines - 1 lines belong one each to the process's threads (by a
// process-wide thread index, handed out at a thread's first access and
// given back when the thread exits); the last line is a counter shared by
// the threads beyond those. An access stores the owner's rank + 1 in its
// thread's line before it looks at the owner's generation, and 0 after its
// last byte. A release stores the new generation, runs a barrier on every
// thread of every hcomm process (marks_heavy_barrier), then waits until no
// line of a same-host rank names it.
//
// That is Dekker's protocol with the fence moved to the rare side: the
// access pays two plain stores, because membarrier
// (MEMBARRIER_CMD_GLOBAL_EXPEDITED, each process registered when its first
// context opens) makes every running thread of a registered process execute
// a full barrier before the release reads the lines, and a thread that is
// not running passed one when it was switched out. Where the kernel refuses
// the registration, each access stores its mark with a seq_cst exchange
// instead (a full barrier; no std::atomic_thread_fence, which GCC's TSan
// rejects). An atomic read-modify-write on both sides of every access, the
// first version, cost 10 ns per 8-byte put (docs/performance.md).
#pragma once

#include <atomic>
#include <cstdint>

namespace hcomm::api {

inline constexpr uint32_t kMarkLines = 64;

struct alignas(64) MarkLine {
  std::atomic<uint32_t> n;  // owner rank + 1 while the thread accesses it, else 0; the last line: a count
};

struct MarkTable {
  MarkLine lines[kMarkLines];
};

// Registers this process for membarrier's global expedited barrier (once;
// thread-safe). Returns whether accesses may skip their own barrier.
bool marks_init();
// The release's side, between its generation store and its reads of the
// lines: a full barrier on every thread of every registered process.
void marks_heavy_barrier();
// Whether the owner `owner` is named by any line of table t.
inline bool marks_name(const MarkTable& t, int owner) {
  const uint32_t v = static_cast<uint32_t>(owner) + 1;
  for (uint32_t i = 0; i + 1 < kMarkLines; ++i)
    if (t.lines[i].n.load(std::memory_order_seq_cst) == v) return true;
  return t.lines[kMarkLines - 1].n.load(std::memory_order_seq_cst) != 0;
}

// A thread's index into every MarkTable, + 1 (0: none yet); kept in the
// context's per-thread cache (api/core/context.h: one thread-local block).
struct MarkSlot {
  uint32_t index1 = 0;
};

namespace detail {
extern bool g_marks_barrier;  // accesses make their own barrier (no membarrier)
uint32_t take_index(MarkSlot& s);  // this thread's index (given back at its exit)
}  // namespace detail

// Holds this thread's mark (value: the owner's rank + 1) in table t (null:
// nothing) for its scope: from before the look at the owner's generation to
// the last byte. Marks do not nest (no access runs inside another).
class AccessMark {
 public:
  [[gnu::always_inline]] AccessMark(MarkTable* t, uint32_t value, MarkSlot& s) noexcept {
    if (t == nullptr) return;
    const uint32_t i = s.index1 != 0 ? s.index1 - 1 : detail::take_index(s);
    if (i >= kMarkLines - 1) [[unlikely]] {
      _line = &t->lines[kMarkLines - 1];
      _shared = true;
      _line->n.fetch_add(1, std::memory_order_seq_cst);
      return;
    }
    _line = &t->lines[i];
    if (detail::g_marks_barrier) [[unlikely]] {
      (void)_line->n.exchange(value, std::memory_order_seq_cst);
    } else {
      _line->n.store(value, std::memory_order_relaxed);
      std::atomic_signal_fence(std::memory_order_seq_cst);  // (the release's membarrier orders the CPU)
    }
  }
  [[gnu::always_inline]] ~AccessMark() {
    if (_line == nullptr) return;
    if (_shared) [[unlikely]] _line->n.fetch_sub(1, std::memory_order_release);
    else _line->n.store(0, std::memory_order_release);  // after the copy's last byte
  }
  AccessMark(const AccessMark&) = delete;
  AccessMark& operator=(const AccessMark&) = delete;

 private:
  MarkLine* _line = nullptr;
  bool _shared = false;
};

}  // namespace hcomm::api
