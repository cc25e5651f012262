// Access marks: what lets a release on one host wait out the CPU copies that
// already looked at the owner's generation (docs/api.md, "Keys").
//
// Each process's control segment holds a MarkTable. Its first
// kMarkLines - 1 lines belong one each to the process's threads that make a
// CPU access (handed out on a thread's first one); the last line is a
// counter shared by any further threads. An access stores the owner's rank
// + 1 in its thread's line before it looks at the owner's generation, and
// puts the line back after its last byte. A release stores the new
// generation, runs a barrier on every thread of every hcomm process
// (heavy_barrier), then waits until no line of a same-host rank names it.
//
// That is Dekker's protocol with the fence moved to the rare side: the
// access pays two plain stores and no fence, because membarrier
// (MEMBARRIER_CMD_GLOBAL_EXPEDITED, each process registered at init) makes
// every running thread of a registered process execute a full barrier
// before the release reads the lines. Where the kernel refuses membarrier,
// every access fences itself instead (std::atomic_thread_fence) and the
// release fences too. An atomic read-modify-write on both sides, the first
// version, cost 10 ns per 8-byte put (7.8 -> 18.5 ns, docs/performance.md).
#pragma once

#include <atomic>
#include <cstdint>

namespace hcomm::api {

inline constexpr uint32_t kMarkLines = 64;

struct alignas(64) MarkLine {
  std::atomic<uint32_t> n;  // owner rank + 1 while the thread accesses it, else 0; the last line: a count
};

struct MarkTable {
  alignas(64) std::atomic<uint32_t> threads;  // lines handed out to this process's threads
  uint64_t id;                                // unique in the process (a later table may reuse the address)
  MarkLine lines[kMarkLines];
};

// An id for a new table (never 0).
uint64_t new_mark_table_id();

// Registers this process for membarrier's global expedited barrier (once;
// thread-safe). Returns whether accesses may skip their own fence.
bool marks_init();
// The release's side: a full barrier on every thread of every registered
// process (or this thread's fence where the kernel refused).
void marks_heavy_barrier();
// Whether the owner `owner` is named by any line of table t.
inline bool marks_name(const MarkTable& t, int owner) {
  const uint32_t v = static_cast<uint32_t>(owner) + 1;
  for (uint32_t i = 0; i + 1 < kMarkLines; ++i)
    if (t.lines[i].n.load(std::memory_order_acquire) == v) return true;
  return t.lines[kMarkLines - 1].n.load(std::memory_order_acquire) != 0;
}

// A thread's line in the last table it used (kept in the context's
// per-thread cache, api/core/context.h: one thread-local block).
struct MarkSlot {
  uint64_t id = 0;  // the table's
  MarkLine* line = nullptr;
};

namespace detail {
extern bool g_marks_fence;  // accesses fence themselves (no membarrier)
MarkLine* take_line(MarkTable& t, MarkSlot& s);  // a new line in t for this thread (or the shared last one)
}  // namespace detail

// Holds this thread's mark (value: the owner's rank + 1) in table t (null:
// nothing) for its scope: from before the look at the owner's generation to
// the last byte. A thread keeps its line for the last table it used; one
// that alternates between contexts takes a new line each time and ends up
// on the shared last line (correct, with a read-modify-write per access).
// Marks do not nest (no access runs inside another).
class AccessMark {
 public:
  // id: t's (copied into the key, so the check reads no line of t).
  [[gnu::always_inline]] AccessMark(MarkTable* t, uint64_t id, uint32_t value, MarkSlot& s) noexcept {
    if (t == nullptr) return;
    _line = s.id == id ? s.line : detail::take_line(*t, s);
    if (_line == &t->lines[kMarkLines - 1]) [[unlikely]] {
      _shared = true;
      _line->n.fetch_add(1, std::memory_order_seq_cst);
      return;
    }
    _line->n.store(value, std::memory_order_relaxed);
    if (detail::g_marks_fence) [[unlikely]] std::atomic_thread_fence(std::memory_order_seq_cst);
    else std::atomic_signal_fence(std::memory_order_seq_cst);
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
