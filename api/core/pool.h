// Per-thread caches of fixed-size blocks for what the messaging path
// allocates per operation (requests with their shared_ptr control blocks,
// nodes of the posted-receive and unexpected-message lists), so that a
// stream of small sends and receives allocates nothing once it runs
// (tests/integration/test_fast_path.cpp counts).
//
// A block freed on one thread goes to that thread's cache; any thread reuses
// it. No locks: each cache belongs to its thread. A block freed after the
// thread's reaper ran (from another thread_local's destructor, say) goes back
// to the heap.
#pragma once

#include <cstddef>
#include <new>

namespace hcomm::api {

// Trivially destructible and constant-initialised, so that reaching it is a
// plain TLS access (no init guard, no wrapper call on every allocation); the
// blocks are handed back to the heap at thread exit by a reaper that the
// first cached block arms.
template <size_t Size>
struct BlockCache {
  static constexpr size_t kMax = 256;
  void* items[kMax];
  size_t n;
  bool armed;  // the reaper is registered
  bool dead;   // the thread is exiting: the heap takes blocks back
};
template <size_t Size>
inline constinit thread_local BlockCache<Size> t_blocks{};

template <size_t Size>
struct BlockReaper {
  bool on = false;
  ~BlockReaper() {
    BlockCache<Size>& c = t_blocks<Size>;
    for (size_t i = 0; i < c.n; ++i) ::operator delete(c.items[i]);
    c.n = 0;
    c.dead = true;
  }
};
template <size_t Size>
inline thread_local BlockReaper<Size> t_reaper;

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
        if (!c.armed) {
          t_reaper<sizeof(T)>.on = true;  // constructs it: its destructor runs at thread exit
          c.armed = true;
        }
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
