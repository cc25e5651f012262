// Per-thread caches of fixed-size blocks for what the messaging path
// allocates per operation (requests with their shared_ptr control blocks,
// nodes of the posted-receive and unexpected-message lists), so that a
// stream of small sends and receives allocates nothing once it runs
// (tests/integration/test_fast_path.cpp counts).
//
// A block freed on one thread goes to that thread's cache; any thread reuses
// it. No locks: each cache belongs to its thread. A block freed after its
// thread's cache was destroyed (from another thread_local's destructor, say)
// goes back to the heap.
#pragma once

#include <cstddef>
#include <new>

namespace hcomm::api {

template <size_t Size>
struct BlockCache {
  static constexpr size_t kMax = 256;
  void* items[kMax];
  size_t n = 0;
  bool dead = false;
  ~BlockCache() {
    for (size_t i = 0; i < n; ++i) ::operator delete(items[i]);
    n = 0;
    dead = true;
  }
};
template <size_t Size>
inline thread_local BlockCache<Size> t_blocks;

// A std allocator over the per-thread block caches (single objects only;
// arrays go to the heap). Alignment: at most the default new alignment.
template <class T>
struct PoolAlloc {
  using value_type = T;
  static_assert(alignof(T) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__);
  PoolAlloc() noexcept = default;
  template <class U>
  PoolAlloc(const PoolAlloc<U>& /*other*/) noexcept {}  // NOLINT(google-explicit-constructor)

  T* allocate(size_t n) {
    if (n == 1) {
      BlockCache<sizeof(T)>& c = t_blocks<sizeof(T)>;
      if (!c.dead && c.n > 0) return static_cast<T*>(c.items[--c.n]);
    }
    return static_cast<T*>(::operator new(n * sizeof(T)));
  }
  void deallocate(T* p, size_t n) noexcept {
    if (n == 1) {
      BlockCache<sizeof(T)>& c = t_blocks<sizeof(T)>;
      if (!c.dead && c.n < BlockCache<sizeof(T)>::kMax) {
        c.items[c.n++] = p;
        return;
      }
    }
    ::operator delete(p);
  }
  template <class U>
  bool operator==(const PoolAlloc<U>& /*other*/) const noexcept {
    return true;
  }
};

}  // namespace hcomm::api
