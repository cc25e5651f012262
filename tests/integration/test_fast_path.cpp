// The one-sided fast path on one host allocates nothing once it runs:
// blocking put/get/fetch_add and nonblocking iput/iget with wait and free
// (the completed request is shared, request handles are recycled per
// thread). Proven by counting every operator new in the rank's process
// (libhcomm's included: a replaced global operator new serves the whole
// program) between a warm-up and the end of a measured stretch.
#include <gtest/gtest.h>
#include <hcomm/hcomm.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <vector>

#include "tests/support/keys.h"
#include "tests/support/ranks.h"

namespace {
std::atomic<long> g_news{0};
std::atomic<bool> g_counting{false};
}  // namespace

// GCC cannot see that these pair with each other (malloc/free throughout).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void* operator new(std::size_t n) {
  if (g_counting.load(std::memory_order_relaxed)) g_news.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop

namespace hcomm {
namespace {

using test::run_ranks;
constexpr int T = 10000;

TEST(FastPath, OneSidedOnOneHostAllocatesNothing) {
  std::string err = run_ranks(2, {{"HCOMM_ENGINE", "host"}}, [](int rank) {
    hcomm_config_t cfg;
    hcomm_config_init(&cfg);
    hcomm_context_t* ctx = nullptr;
    RCHECK_OK(hcomm_init(&cfg, &ctx));
    const int peer = 1 - rank;
    hcomm_mem_t *w, *l;
    RCHECK_OK(hcomm_mem_alloc(ctx, 1 << 16, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w));
    RCHECK_OK(hcomm_mem_alloc(ctx, 1 << 16, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &l));
    hcomm_rkey_t* k = test::swap_keys(ctx, peer, w, 1, T);
    auto* lp = static_cast<uint8_t*>(hcomm_mem_ptr(l));
    std::vector<hcomm_request_t*> reqs(32);
    auto stretch = [&](int rounds) {
      for (int i = 0; i < rounds; ++i) {
        uint64_t old = 0;
        RCHECK_OK(hcomm_put(ctx, lp, 8, k, 64, T));
        RCHECK_OK(hcomm_get(ctx, lp + 8, 8, k, 64, T));
        RCHECK_OK(hcomm_put(ctx, lp, 4096, k, 4096, T));
        RCHECK_OK(hcomm_fetch_add(ctx, k, 0, 1, &old, T));
        for (auto& r : reqs) RCHECK_OK(hcomm_iput(ctx, lp, 8, k, 128, &r));
        for (auto& r : reqs) {
          RCHECK_OK(hcomm_wait(r, T));
          hcomm_request_free(r);
        }
        for (auto& r : reqs) RCHECK_OK(hcomm_iget(ctx, lp + 64, 8, k, 128, &r));
        for (auto& r : reqs) {
          RCHECK_OK(hcomm_wait(r, T));
          hcomm_request_free(r);
        }
      }
    };
    stretch(10);  // warm-up: the handle cache fills, lazy state settles
    g_news.store(0);
    g_counting.store(true);
    stretch(1000);
    g_counting.store(false);
    RCHECK(g_news.load() == 0) << g_news.load() << " allocations in 1000 rounds of put/get/fetch_add/iput/iget";
    RCHECK_OK(hcomm_barrier(ctx, T));
    RCHECK_OK(hcomm_rkey_release(k));
    RCHECK_OK(hcomm_finalize(ctx));
  }, 60);
  EXPECT_EQ(err, "");
}

}  // namespace
}  // namespace hcomm
