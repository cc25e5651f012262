#include "api/mem/access_mark.h"

#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <mutex>

namespace hcomm::api {

namespace detail {
bool g_marks_fence = true;

MarkLine* take_line(MarkTable& t, MarkSlot& s) {
  const uint32_t i = t.threads.fetch_add(1, std::memory_order_relaxed);
  MarkLine* line = &t.lines[i < kMarkLines - 1 ? i : kMarkLines - 1];
  s = MarkSlot{t.id, line};
  return line;
}
}  // namespace detail

namespace {
long membarrier(int cmd) { return ::syscall(__NR_membarrier, cmd, 0, 0); }
std::atomic<uint64_t> g_next_table_id{1};
}  // namespace

uint64_t new_mark_table_id() { return g_next_table_id.fetch_add(1, std::memory_order_relaxed); }

bool marks_init() {
  static std::once_flag once;
  std::call_once(once, [] {
    const long q = membarrier(MEMBARRIER_CMD_QUERY);
    detail::g_marks_fence = !(q > 0 && (q & MEMBARRIER_CMD_GLOBAL_EXPEDITED) != 0 &&
                              membarrier(MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED) == 0);
  });
  return !detail::g_marks_fence;
}

void marks_heavy_barrier() {
  // Registered processes are reached by the membarrier (whether or not this
  // one could register); one that could not fences each access itself.
  (void)membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED);
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

}  // namespace hcomm::api
