// The one-sided fast path on one host (synchronous lanes: shm, cma):
//  - it allocates nothing once it runs: blocking put/get/fetch_add and
//    nonblocking iput/iget with wait and free (a call that completed at once
//    hands out the static completed handle). Proven by counting every
//    operator new in the rank's process (libhcomm's included: a replaced
//    global operator new serves the whole program) between a warm-up and the
//    end of a measured stretch;
//  - the completed handle behaves as any request under wait/test/cancel/free;
//  - it runs without the context lock and stays thread-safe: several threads
//    drive one context at once while another registers and releases memory
//    (the suite runs under TSan in CI), every result exact;
//  - the checks still hold unlocked: a released local buffer, a revoked key;
//  - eager sends run without the context lock too (a per-peer stream lock in
//    the shm lane): threads sending to one peer at once, beside rendezvous
//    sends and a full ring (sends queue, the locked path), keep each
//    thread's order and every byte.
#include <gtest/gtest.h>
#include <hcomm/hcomm.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <new>
#include <thread>
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
// Every form is replaced: one left to the runtime would go uncounted, and
// under ASan its block would reach our free() (alloc-dealloc mismatch).
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  if (g_counting.load(std::memory_order_relaxed)) g_news.fetch_add(1, std::memory_order_relaxed);
  return std::malloc(n == 0 ? 1 : n);
}
void* operator new[](std::size_t n, const std::nothrow_t& nt) noexcept { return operator new(n, nt); }
void* operator new(std::size_t n, std::align_val_t a) {
  if (g_counting.load(std::memory_order_relaxed)) g_news.fetch_add(1, std::memory_order_relaxed);
  const auto al = static_cast<std::size_t>(a);
  if (void* p = std::aligned_alloc(al, (n + al - 1) / al * al)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t a) { return operator new(n, a); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop

namespace hcomm {
namespace {

using test::run_ranks;
constexpr int T = 10000;

// Runs body(ctx, rank, peer) on two host-engine ranks, each with its context.
std::string on_two_ranks(const std::function<void(hcomm_context_t*, int, int)>& body, int timeout_s = 60) {
  return run_ranks(2, {{"HCOMM_ENGINE", "host"}}, [&](int rank) {
    hcomm_config_t cfg;
    hcomm_config_init(&cfg);
    hcomm_context_t* ctx = nullptr;
    RCHECK_OK(hcomm_init(&cfg, &ctx));
    body(ctx, rank, 1 - rank);
    RCHECK_OK(hcomm_finalize(ctx));
  }, timeout_s);
}

TEST(FastPath, OneSidedOnOneHostAllocatesNothing) {
  std::string err = on_two_ranks([](hcomm_context_t* ctx, int /*rank*/, int peer) {
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
  });
  EXPECT_EQ(err, "");
}

// Small messages allocate nothing either once they run: blocking ping-pong,
// windows of nonblocking sends against pre-posted receives, messages that
// arrive before their receive (unexpected), and sendrecv (requests and list
// nodes come from per-thread caches; an eager send the lane took needs no
// request).
TEST(FastPath, SmallMessagesAllocateNothing) {
  std::string err = on_two_ranks([](hcomm_context_t* ctx, int rank, int peer) {
    std::vector<hcomm_request_t*> reqs(32);
    uint64_t out[32] = {}, in[32] = {};
    // delay: 1 = the receiver posts late (every message of the window
    // arrives unexpected), 2 = the sender sends late (every receive waits
    // posted); the warm-up sets both peaks, which no later round exceeds.
    auto stretch = [&](int rounds, int delay) {
      for (int i = 0; i < rounds; ++i) {
        const uint64_t v = static_cast<uint64_t>(i) * 64;
        uint64_t got = 0;
        // ping-pong
        if (rank == 0) {
          RCHECK_OK(hcomm_send(ctx, peer, &v, 8, 1, T));
          RCHECK_OK(hcomm_recv(ctx, peer, &got, 8, 2, HCOMM_TAG_MASK_ALL, nullptr, T));
        } else {
          RCHECK_OK(hcomm_recv(ctx, peer, &got, 8, 1, HCOMM_TAG_MASK_ALL, nullptr, T));
          RCHECK_OK(hcomm_send(ctx, peer, &got, 8, 2, T));
        }
        RCHECK(got == v) << "round " << i;
        // a window: rank 1 pre-posts, rank 0 sends 32 (some may come before their receive)
        if ((delay == 1 && rank == 1) || (delay == 2 && rank == 0))
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        if (rank == 0) {
          for (int j = 0; j < 32; ++j) {
            out[j] = v + static_cast<uint64_t>(j);
            RCHECK_OK(hcomm_isend(ctx, peer, &out[j], 8, 100 + static_cast<uint64_t>(j), &reqs[j]));
          }
        } else {
          for (int j = 0; j < 32; ++j)
            RCHECK_OK(hcomm_irecv(ctx, peer, &in[j], 8, 100 + static_cast<uint64_t>(j), HCOMM_TAG_MASK_ALL, &reqs[j]));
        }
        for (auto& r : reqs) {
          RCHECK_OK(hcomm_wait(r, T));
          hcomm_request_free(r);
        }
        if (rank == 1) {
          for (int j = 0; j < 32; ++j) RCHECK(in[j] == v + static_cast<uint64_t>(j)) << "round " << i << " msg " << j;
        }
        // sendrecv both ways at once
        uint64_t mine = v + static_cast<uint64_t>(rank), theirs = 0;
        RCHECK_OK(hcomm_sendrecv(ctx, peer, &mine, 8, 3, peer, &theirs, 8, 3, HCOMM_TAG_MASK_ALL, nullptr, T));
        RCHECK(theirs == v + static_cast<uint64_t>(peer)) << "round " << i;
      }
    };
    stretch(20, 0);  // warm-up: caches fill, up to both peaks
    stretch(2, 1);
    stretch(2, 2);
    g_news.store(0);
    g_counting.store(true);
    stretch(1000, 0);
    g_counting.store(false);
    RCHECK(g_news.load() == 0) << g_news.load() << " allocations in 1000 rounds of send/recv, isend/irecv, sendrecv";
    RCHECK_OK(hcomm_barrier(ctx, T));
  });
  EXPECT_EQ(err, "");
}

TEST(FastPath, TheCompletedHandleBehavesAsAnyRequest) {
  std::string err = on_two_ranks([](hcomm_context_t* ctx, int /*rank*/, int peer) {
    hcomm_mem_t* w;
    RCHECK_OK(hcomm_mem_alloc(ctx, 4096, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w));
    hcomm_rkey_t* k = test::swap_keys(ctx, peer, w, 1, T);
    auto* lp = static_cast<uint8_t*>(hcomm_mem_ptr(w));
    std::memset(lp, 0x5a, 64);
    hcomm_request_t* r = nullptr;
    RCHECK_OK(hcomm_iput(ctx, lp, 64, k, 1024, &r));
    RCHECK(r != nullptr);
    int done = 0;
    RCHECK_OK(hcomm_test(r, &done));
    RCHECK(done == 1);
    RCHECK_OK(hcomm_wait(r, T));
    RCHECK_OK(hcomm_request_cancel(r));  // completed: nothing to withdraw, its own status
    hcomm_recv_info_t info;
    RCHECK_EQ_STATUS(hcomm_request_recv_info(r, &info), HCOMM_ERR_INVALID);
    hcomm_request_free(r);
    hcomm_request_free(r);  // a no-op on the shared handle, however often
    RCHECK_OK(hcomm_wait(r, T));
    // A failed nonblocking call hands out no handle and says why.
    hcomm_request_t* bad = nullptr;
    RCHECK_EQ_STATUS(hcomm_iput(ctx, lp, 64, k, 4096, &bad), HCOMM_ERR_OUT_OF_RANGE);
    RCHECK(bad == nullptr);
    RCHECK_OK(hcomm_barrier(ctx, T));
    // The data arrived (the peer put 0x5a into our [1024, 1088)).
    for (int i = 0; i < 64; ++i) RCHECK(lp[1024 + i] == 0x5a) << "byte " << i;
    RCHECK_OK(hcomm_barrier(ctx, T));
    RCHECK_OK(hcomm_rkey_release(k));
  });
  EXPECT_EQ(err, "");
}

TEST(FastPath, ChecksStillHoldWithoutTheLock) {
  std::string err = on_two_ranks([](hcomm_context_t* ctx, int rank, int peer) {
    hcomm_mem_t *w, *l;
    RCHECK_OK(hcomm_mem_alloc(ctx, 4096, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w));
    RCHECK_OK(hcomm_mem_alloc(ctx, 4096, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &l));
    hcomm_rkey_t* k = test::swap_keys(ctx, peer, w, 1, T);
    auto* lp = static_cast<uint8_t*>(hcomm_mem_ptr(l));
    // Registered user memory: the cached lookup hits, then misses once it is released.
    std::vector<uint8_t> user(8192, 7);
    hcomm_mem_t* u;
    RCHECK_OK(hcomm_mem_register(ctx, user.data(), user.size(), HCOMM_ACCESS_ALL, &u));
    RCHECK_OK(hcomm_put(ctx, user.data() + 100, 8, k, 0, T));
    RCHECK_OK(hcomm_put(ctx, user.data() + 200, 8, k, 8, T));
    RCHECK_OK(hcomm_mem_release(u));
    RCHECK_EQ_STATUS(hcomm_put(ctx, user.data() + 100, 8, k, 0, T), HCOMM_ERR_INVALID);
    hcomm_request_t* r = nullptr;
    RCHECK_EQ_STATUS(hcomm_iget(ctx, user.data(), 8, k, 0, &r), HCOMM_ERR_INVALID);
    RCHECK_OK(hcomm_put(ctx, lp, 8, k, 0, T));  // another registration still works
    // Bounds and rights on the unlocked path.
    RCHECK_EQ_STATUS(hcomm_get(ctx, lp, 16, k, 4088, T), HCOMM_ERR_OUT_OF_RANGE);
    uint64_t old = 0;
    RCHECK_EQ_STATUS(hcomm_fetch_add(ctx, k, 4, 1, &old, T), HCOMM_ERR_INVALID);  // misaligned
    RCHECK_OK(hcomm_barrier(ctx, T));
    // The owner revokes; the key fails on every unlocked call from then on.
    if (rank == 1) {
      RCHECK_OK(hcomm_mem_release(w));
    }
    RCHECK_OK(hcomm_barrier(ctx, T));
    if (rank == 0) {
      std::memset(lp, 0xee, 64);
      RCHECK_EQ_STATUS(hcomm_put(ctx, lp, 64, k, 0, T), HCOMM_ERR_ACCESS);
      RCHECK_EQ_STATUS(hcomm_iput(ctx, lp, 64, k, 0, &r), HCOMM_ERR_ACCESS);
      RCHECK_EQ_STATUS(hcomm_fetch_add(ctx, k, 0, 1, &old, T), HCOMM_ERR_ACCESS);
      RCHECK_EQ_STATUS(hcomm_accumulate(ctx, lp, 4, HCOMM_FP32, HCOMM_SUM, k, 0, T), HCOMM_ERR_ACCESS);
    }
    RCHECK_OK(hcomm_barrier(ctx, T));
    RCHECK_OK(hcomm_rkey_release(k));
  });
  EXPECT_EQ(err, "");
}

// Rank 0 drives one context from four threads at once (puts into per-thread
// slices, gets back, fetch_adds and fp32 accumulates on shared words), while
// a fifth registers and releases memory in a loop (the registration epoch
// moves under the readers), a sixth calls progress and fence (a pending
// fence sends the callers through the locked path) and a seventh exchanges
// messages with an echo thread of rank 1. Every result exact.
TEST(FastPath, ThreadsShareOneContext) {
  std::string err = on_two_ranks([](hcomm_context_t* ctx, int rank, int peer) {
    constexpr int kThreads = 4, kRounds = 2000;
    constexpr uint64_t kSlice = 1024;  // bytes per thread; words at [kThreads * kSlice, +64)
    hcomm_mem_t* w;
    RCHECK_OK(hcomm_mem_alloc(ctx, kThreads * kSlice + 64, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &w));
    std::memset(hcomm_mem_ptr(w), 0, kThreads * kSlice + 64);
    hcomm_rkey_t* k = test::swap_keys(ctx, peer, w, 1, T);
    const uint64_t counter = kThreads * kSlice, sum = counter + 8;
    if (rank == 0) {
      std::atomic<bool> stop{false};
      std::vector<std::thread> ts;
      for (int t = 0; t < kThreads; ++t) {
        ts.emplace_back([&, t] {
          hcomm_mem_t* l;
          RCHECK_OK(hcomm_mem_alloc(ctx, 2 * kSlice, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &l));
          auto* lp = static_cast<uint8_t*>(hcomm_mem_ptr(l));
          const float one = 1.0f;
          for (int i = 0; i < kRounds; ++i) {
            const uint64_t off = static_cast<uint64_t>(t) * kSlice + static_cast<uint64_t>(i % 16) * 64;
            std::memset(lp, t * 16 + i % 16 + 1, 64);
            hcomm_request_t* r = nullptr;
            if (i % 2) {
              RCHECK_OK(hcomm_put(ctx, lp, 64, k, off, T));
            } else {
              RCHECK_OK(hcomm_iput(ctx, lp, 64, k, off, &r));
              RCHECK_OK(hcomm_wait(r, T));
              hcomm_request_free(r);
            }
            RCHECK_OK(hcomm_get(ctx, lp + kSlice, 64, k, off, T));
            RCHECK(std::memcmp(lp, lp + kSlice, 64) == 0) << "thread " << t << " round " << i;
            uint64_t old = 0;
            RCHECK_OK(hcomm_fetch_add(ctx, k, counter, 1, &old, T));
            std::memcpy(lp, &one, 4);
            RCHECK_OK(hcomm_accumulate(ctx, lp, 1, HCOMM_FP32, HCOMM_SUM, k, sum, T));
          }
          RCHECK_OK(hcomm_mem_release(l));
        });
      }
      std::thread churn([&] {
        std::vector<uint8_t> buf(1 << 16);
        while (!stop.load()) {
          hcomm_mem_t* m;
          RCHECK_OK(hcomm_mem_register(ctx, buf.data(), buf.size(), HCOMM_ACCESS_ALL, &m));
          RCHECK_OK(hcomm_mem_release(m));
        }
      });
      std::thread fencer([&] {
        while (!stop.load()) {
          RCHECK_OK(hcomm_progress(ctx));
          RCHECK_OK(hcomm_fence(ctx));
          std::this_thread::yield();
        }
      });
      // Two-sided beside it all (the locked path, requests from per-thread caches).
      std::thread messenger([&] {
        for (uint64_t i = 0; i < kRounds; ++i) {
          uint64_t back = 0;
          RCHECK_OK(hcomm_send(ctx, peer, &i, 8, 9, T));
          RCHECK_OK(hcomm_recv(ctx, peer, &back, 8, 10, HCOMM_TAG_MASK_ALL, nullptr, T));
          RCHECK(back == i + 1) << "echo " << i;
        }
      });
      for (auto& t : ts) t.join();
      messenger.join();
      stop.store(true);
      churn.join();
      fencer.join();
    } else {
      std::thread echo([&] {
        for (int i = 0; i < kRounds; ++i) {
          uint64_t v = 0;
          RCHECK_OK(hcomm_recv(ctx, peer, &v, 8, 9, HCOMM_TAG_MASK_ALL, nullptr, T));
          ++v;
          hcomm_request_t* r = nullptr;
          RCHECK_OK(hcomm_isend(ctx, peer, &v, 8, 10, &r));
          RCHECK_OK(hcomm_wait(r, T));
          hcomm_request_free(r);
        }
      });
      echo.join();
    }
    RCHECK_OK(hcomm_barrier(ctx, T));
    if (rank == 1) {
      auto* base = static_cast<uint8_t*>(hcomm_mem_ptr(w));
      uint64_t c = 0;
      float f = 0;
      std::memcpy(&c, base + counter, 8);
      std::memcpy(&f, base + sum, 4);
      RCHECK(c == kThreads * kRounds) << "counter " << c;
      RCHECK(f == static_cast<float>(kThreads * kRounds)) << "sum " << f;
    }
    RCHECK_OK(hcomm_barrier(ctx, T));
    RCHECK_OK(hcomm_rkey_release(k));
  }, 120);
  EXPECT_EQ(err, "");
}

// Four threads of rank 0 send to rank 1 at once, each on its own tag, in
// windows of nonblocking sends (and blocking ones in between): small eager
// messages (inline and full slots; the unlocked path), eager ones near the
// slot size and rendezvous ones (the locked path). Rank 1 starts late, so
// the ring fills and sends queue behind it: a later small send of the same
// thread must queue too, not overtake. Four threads of rank 1 receive, each
// its tag: every message arrives once, in its thread's order, every byte right.
TEST(FastPath, ConcurrentSendersKeepEachThreadsOrder) {
  std::string err = on_two_ranks([](hcomm_context_t* ctx, int rank, int peer) {
    constexpr int kThreads = 4, kMsgs = 3000, kWindow = 8;
    constexpr size_t kSizes[] = {8, 40, 200, 8, 3000, 16, 64 << 10, 8, 24};
    constexpr size_t kMax = 64 << 10;
    auto fill = [](uint8_t* b, size_t n, int t, uint64_t i) {
      std::memset(b, static_cast<int>((t * 31 + i) & 0xff), n);
      std::memcpy(b, &i, 8);
    };
    RCHECK_OK(hcomm_barrier(ctx, T));
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(30));
    std::vector<std::thread> ts;
    for (int t = 0; t < kThreads; ++t) {
      ts.emplace_back([&, t] {
        std::vector<std::vector<uint8_t>> bufs(kWindow, std::vector<uint8_t>(kMax));
        std::vector<uint8_t> want(kMax);
        const uint64_t tag = 100 + static_cast<uint64_t>(t);
        for (uint64_t i = 0; i < kMsgs; i += kWindow) {
          hcomm_request_t* rs[kWindow] = {};
          for (uint64_t j = 0; j < kWindow; ++j) {
            const uint64_t m = i + j;
            const size_t n = kSizes[m % std::size(kSizes)];
            uint8_t* b = bufs[j].data();
            if (rank == 0) {
              fill(b, n, t, m);
              if ((i / kWindow) % 4 != 3) {
                RCHECK_OK(hcomm_isend(ctx, peer, b, n, tag, &rs[j]));
              } else {
                RCHECK_OK(hcomm_send(ctx, peer, b, n, tag, T));
              }
            } else {
              hcomm_recv_info_t info{};
              RCHECK_OK(hcomm_recv(ctx, peer, b, kMax, tag, HCOMM_TAG_MASK_ALL, &info, T));
              RCHECK(info.length == n) << "thread " << t << " message " << m << ": " << info.length << " bytes";
              fill(want.data(), n, t, m);
              uint64_t seq = 0;
              std::memcpy(&seq, b, 8);
              RCHECK(seq == m) << "thread " << t << ": message " << seq << " where " << m << " was due";
              RCHECK(std::memcmp(b, want.data(), n) == 0) << "thread " << t << " message " << m;
            }
          }
          for (hcomm_request_t* r : rs) {
            if (r == nullptr) continue;
            RCHECK_OK(hcomm_wait(r, T));  // the buffers are ours again
            hcomm_request_free(r);
          }
        }
      });
    }
    for (auto& th : ts) th.join();
    RCHECK_OK(hcomm_barrier(ctx, T));
  }, 120);
  EXPECT_EQ(err, "");
}

// The unlocked eager path never overtakes a queued send: rank 0 sends more
// small messages than the ring holds while rank 1 is not receiving (the rest
// queue as requests), makes no progress while rank 1 drains the ring, then
// sends one more: it must arrive after every queued one.
TEST(FastPath, ASmallSendQueuesBehindQueuedOnes) {
  std::string err = on_two_ranks([](hcomm_context_t* ctx, int rank, int peer) {
    constexpr uint64_t kBurst = 300;
    RCHECK_OK(hcomm_barrier(ctx, T));
    if (rank == 0) {
      std::vector<uint64_t> vals(kBurst + 1);
      std::vector<hcomm_request_t*> rs(kBurst + 1, nullptr);
      for (uint64_t i = 0; i < kBurst; ++i) {
        vals[i] = i;
        RCHECK_OK(hcomm_isend(ctx, peer, &vals[i], 8, 5, &rs[i]));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(150));  // rank 1 drains the ring meanwhile
      vals[kBurst] = kBurst;
      RCHECK_OK(hcomm_isend(ctx, peer, &vals[kBurst], 8, 5, &rs[kBurst]));
      for (hcomm_request_t* r : rs) {
        RCHECK_OK(hcomm_wait(r, T));
        hcomm_request_free(r);
      }
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // rank 0's burst fills the ring
      for (uint64_t i = 0; i <= kBurst; ++i) {
        uint64_t v = ~0ull;
        RCHECK_OK(hcomm_recv(ctx, peer, &v, 8, 5, HCOMM_TAG_MASK_ALL, nullptr, T));
        RCHECK(v == i) << "message " << v << " where " << i << " was due";
      }
    }
    RCHECK_OK(hcomm_barrier(ctx, T));
  });
  EXPECT_EQ(err, "");
}

}  // namespace
}  // namespace hcomm
