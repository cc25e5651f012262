#include "api/mem/access_mark.h"

#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

namespace hcomm::api {

namespace {

long membarrier(int cmd) { return ::syscall(__NR_membarrier, cmd, 0, 0); }

// Thread indexes: handed out lowest first, given back when a thread exits.
std::mutex g_index_mu;
std::vector<uint32_t> g_free_indexes;
uint32_t g_next_index = 0;

// Gives the thread's index back at its exit (constructed on its first access).
struct IndexHolder {
  uint32_t index = UINT32_MAX;
  ~IndexHolder() {
    if (index == UINT32_MAX) return;
    std::lock_guard lk(g_index_mu);
    g_free_indexes.push_back(index);
  }
};

}  // namespace

namespace detail {

bool g_marks_barrier = true;

uint32_t take_index(MarkSlot& s) {
  thread_local IndexHolder holder;
  if (holder.index == UINT32_MAX) {
    std::lock_guard lk(g_index_mu);
    if (!g_free_indexes.empty()) {
      holder.index = g_free_indexes.back();
      g_free_indexes.pop_back();
    } else {
      holder.index = g_next_index++;
    }
  }
  s.index1 = holder.index + 1;
  return holder.index;
}

}  // namespace detail

bool marks_init() {
  static std::once_flag once;
  std::call_once(once, [] {
    const long q = membarrier(MEMBARRIER_CMD_QUERY);
    detail::g_marks_barrier = !(q > 0 && (q & MEMBARRIER_CMD_GLOBAL_EXPEDITED) != 0 &&
                                membarrier(MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED) == 0);
  });
  return !detail::g_marks_barrier;
}

void marks_heavy_barrier() {
  // Registered processes are reached by the membarrier, whether or not this
  // one could register; one that could not makes its own barrier per access.
  if (membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED) != 0) {
    // Refused here but maybe not in a peer's process (another seccomp
    // policy): what a peer stored without a barrier leaves its store buffer
    // within nanoseconds; wait far longer than that before reading.
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace hcomm::api
