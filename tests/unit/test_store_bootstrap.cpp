// Unit: Bootstrap::from_store and the C store adapter, ranks as threads over
// an in-process store: collectives, the join, a rank that never comes, store
// errors, collectives called in a different order, a world size mismatch.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "api/wireup/bootstrap.h"
#include "api/wireup/kv_store.h"
#include "tests/support/kv_stores.h"

namespace hcomm::api {
namespace {

using test::MemStore;

long ms_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}

// Runs body(rank) on one thread per rank; returns what each returned.
std::vector<std::string> on_threads(int n, const std::function<std::string(int)>& body) {
  std::vector<std::string> out(static_cast<size_t>(n));
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r) ts.emplace_back([&, r] { out[static_cast<size_t>(r)] = body(r); });
  for (auto& t : ts) t.join();
  return out;
}

Status make(MemStore& s, int rank, int size, const std::string& job, int timeout_ms, std::unique_ptr<Bootstrap>* b) {
  return Bootstrap::from_store(rank, size, job, kv_store_from_c(s.c()), timeout_ms, b);
}

std::string blob(int r, int k) {
  size_t len = k == 0 ? 0 : k == 1 ? static_cast<size_t>(r + 1) : k == 2 ? Bootstrap::kMaxBlob : 5000u * (r + 1u);
  std::string s(len, static_cast<char>('a' + r));
  if (!s.empty()) s.back() = static_cast<char>('0' + k);
  return s;
}

TEST(StoreBootstrap, AllgatherAndBarrierOnFourThreads) {
  MemStore store;
  auto res = on_threads(4, [&](int r) -> std::string {
    std::unique_ptr<Bootstrap> b;
    Status st = make(store, r, 4, "job-a", 5000, &b);
    if (!st) return "from_store: " + st.to_string();
    if (b->rank() != r || b->size() != 4 || b->job_id() != "job-a") return "identity";
    Deadline dl = Deadline::after_ms(5000);
    for (int k = 0; k < 4; ++k) {
      std::vector<std::string> all;
      st = b->allgather(blob(r, k), &all, dl);
      if (!st) return "allgather: " + st.to_string();
      for (int p = 0; p < 4; ++p)
        if (all[static_cast<size_t>(p)] != blob(p, k))
          return "round " + std::to_string(k) + " slot " + std::to_string(p);
      st = b->barrier(dl);
      if (!st) return "barrier: " + st.to_string();
    }
    return "ok";
  });
  for (int r = 0; r < 4; ++r) EXPECT_EQ(res[static_cast<size_t>(r)], "ok") << "rank " << r;
  EXPECT_TRUE(store.has("hcomm/job-a/0/3")) << "the join is collective #0";
  EXPECT_TRUE(store.has("hcomm/job-a/8/0")) << "4 allgathers + 4 barriers are #1..#8";
  EXPECT_FALSE(store.has("hcomm/job-a/abort"));
}

TEST(StoreBootstrap, EmptyJobIdIsStore) {
  MemStore store;
  auto res = on_threads(2, [&](int r) -> std::string {
    std::unique_ptr<Bootstrap> b;
    Status st = make(store, r, 2, "", 5000, &b);
    if (!st) return st.to_string();
    return b->job_id();
  });
  EXPECT_EQ(res[0], "store");
  EXPECT_EQ(res[1], "store");
  EXPECT_TRUE(store.has("hcomm/store/0/1"));
}

TEST(StoreBootstrap, SingleRankNeedsNoStore) {
  std::unique_ptr<Bootstrap> b;
  ASSERT_TRUE(Bootstrap::from_store(0, 1, "", nullptr, 1000, &b));
  std::vector<std::string> all;
  ASSERT_TRUE(b->allgather("me", &all, Deadline::after_ms(100)));
  EXPECT_EQ(all, std::vector<std::string>{"me"});
}

TEST(StoreBootstrap, ArgumentChecks) {
  MemStore store;
  std::unique_ptr<Bootstrap> b;
  EXPECT_EQ(make(store, 2, 2, "j", 1000, &b).code(), Code::invalid_argument);
  EXPECT_EQ(make(store, -1, 2, "j", 1000, &b).code(), Code::invalid_argument);
  EXPECT_EQ(make(store, 0, 0, "j", 1000, &b).code(), Code::invalid_argument);
  EXPECT_EQ(make(store, 0, 2, "j", 0, &b).code(), Code::invalid_argument);
  EXPECT_EQ(make(store, 0, 2, std::string(Bootstrap::kMaxJobId + 1, 'j'), 1000, &b).code(), Code::invalid_argument);
  EXPECT_EQ(Bootstrap::from_store(0, 2, "j", nullptr, 1000, &b).code(), Code::invalid_argument);
  EXPECT_EQ(make(store, 0, 1, "j", 1000, nullptr).code(), Code::invalid_argument);
  EXPECT_EQ(store.keys(), 0u) << "nothing written for a refused call";
}

// Rank 2 of 3 never starts: the join fails with timeout naming it, within the deadline.
TEST(StoreBootstrap, MissingRankTimesOutNamingIt) {
  MemStore store;
  auto res = on_threads(2, [&](int r) -> std::string {
    auto t0 = Clock::now();
    std::unique_ptr<Bootstrap> b;
    Status st = make(store, r, 3, "missing", 600, &b);
    return st.to_string() + " |" + std::to_string(ms_since(t0));
  });
  for (const auto& t : res) {
    SCOPED_TRACE(t);
    EXPECT_EQ(t.rfind("timeout", 0), 0u);
    EXPECT_NE(t.find("rank 2 of 3 did not join the store rendezvous"), std::string::npos);
    long ms = std::stol(t.substr(t.rfind('|') + 1));
    EXPECT_GE(ms, 500);
    EXPECT_LE(ms, 600 + 2500);
  }
}

// Everyone joined; rank 2 then never enters the collective.
TEST(StoreBootstrap, MissingContributionTimesOutNamingTheRankAndSticks) {
  MemStore store;
  auto res = on_threads(3, [&](int r) -> std::string {
    std::unique_ptr<Bootstrap> b;
    Status st = make(store, r, 3, "late", 5000, &b);
    if (!st) return "from_store: " + st.to_string();
    if (r == 2) return "ok";
    std::vector<std::string> all;
    auto t0 = Clock::now();
    st = b->allgather("x", &all, Deadline::after_ms(400));
    long ms = ms_since(t0);
    Status again = b->barrier(Deadline::after_ms(5000));
    if (again.code() != st.code() || again.message() != st.message()) return "not sticky: " + again.to_string();
    return st.to_string() + " |" + std::to_string(ms);
  });
  EXPECT_EQ(res[2], "ok");
  for (int r : {0, 1}) {
    const std::string& t = res[static_cast<size_t>(r)];
    SCOPED_TRACE(t);
    EXPECT_EQ(t.rfind("timeout", 0), 0u);
    EXPECT_NE(t.find("rank 2 of 3 did not contribute"), std::string::npos);
    EXPECT_LE(std::stol(t.substr(t.rfind('|') + 1)), 400 + 2500);
  }
}

TEST(StoreBootstrap, StoreSetErrorIsIoErrorAndReachesTheOthers) {
  MemStore store;
  store.fail_set("hcomm/seterr/0/1", 7);
  auto res = on_threads(2, [&](int r) -> std::string {
    std::unique_ptr<Bootstrap> b;
    return make(store, r, 2, "seterr", 3000, &b).to_string();
  });
  EXPECT_EQ(res[1].rfind("io_error", 0), 0u) << res[1];
  EXPECT_NE(res[1].find("set(\"hcomm/seterr/0/1\") failed (7)"), std::string::npos) << res[1];
  // Rank 0 waits for rank 1's key, which never comes, and hears why.
  EXPECT_EQ(res[0].rfind("io_error", 0), 0u) << res[0];
  EXPECT_NE(res[0].find("aborted by rank 1"), std::string::npos) << res[0];
}

TEST(StoreBootstrap, StoreGetErrorIsIoErrorAndReachesTheOthers) {
  MemStore store;
  store.fail_get("hcomm/geterr/1/0", 9);  // rank 1 reading rank 0's key in collective #1
  auto res = on_threads(2, [&](int r) -> std::string {
    std::unique_ptr<Bootstrap> b;
    Status st = make(store, r, 2, "geterr", 3000, &b);
    if (!st) return "from_store: " + st.to_string();
    std::vector<std::string> all;
    st = b->allgather("x", &all, Deadline::after_ms(3000));
    if (!st) return st.to_string();
    return b->barrier(Deadline::after_ms(3000)).to_string();
  });
  EXPECT_EQ(res[1].rfind("io_error", 0), 0u) << res[1];
  EXPECT_NE(res[1].find("failed (9)"), std::string::npos) << res[1];
  // Rank 0 finished #1 (rank 1's key was there) and waits in #2 for rank 1,
  // which has given up: it hears why through the abort key.
  EXPECT_EQ(res[0].rfind("io_error", 0), 0u) << res[0];
  EXPECT_NE(res[0].find("aborted by rank 1"), std::string::npos) << res[0];
}

TEST(StoreBootstrap, BarrierAgainstAllgatherIsProtocolError) {
  MemStore store;
  auto res = on_threads(2, [&](int r) -> std::string {
    std::unique_ptr<Bootstrap> b;
    Status st = make(store, r, 2, "order", 3000, &b);
    if (!st) return "from_store: " + st.to_string();
    std::vector<std::string> all;
    return (r == 0 ? b->barrier(Deadline::after_ms(3000)) : b->allgather("x", &all, Deadline::after_ms(3000)))
        .to_string();
  });
  for (const auto& t : res) {
    EXPECT_EQ(t.rfind("protocol_error", 0), 0u) << t;
    EXPECT_NE(t.find("different order"), std::string::npos) << t;
  }
}

TEST(StoreBootstrap, WorldSizeMismatchIsProtocolErrorOnBoth) {
  MemStore store;
  auto t0 = Clock::now();
  auto res = on_threads(2, [&](int r) -> std::string {
    std::unique_ptr<Bootstrap> b;
    return make(store, r, r == 0 ? 2 : 3, "sizes", 5000, &b).to_string();
  });
  for (const auto& t : res) {
    EXPECT_EQ(t.rfind("protocol_error", 0), 0u) << t;
    EXPECT_NE(t.find("world size mismatch"), std::string::npos) << t;
  }
  EXPECT_LT(ms_since(t0), 4000) << "rank 1 hears of rank 0's failure instead of waiting out its deadline";
}

TEST(StoreBootstrap, ForeignValueIsProtocolError) {
  MemStore store;
  hcomm_kv_store_t c = store.c();
  ASSERT_EQ(c.set(c.arg, "hcomm/foreign/0/0", "hello", 5), 0);
  std::unique_ptr<Bootstrap> b;
  Status st = make(store, 1, 2, "foreign", 2000, &b);
  EXPECT_EQ(st.code(), Code::protocol_error) << st.to_string();
  EXPECT_NE(st.message().find("does not hold an hcomm bootstrap value"), std::string::npos) << st.message();
}

// --- the C adapter on its own ---

TEST(KvStoreFromC, TimeoutErrorAndLongValues) {
  MemStore store;
  auto kv = kv_store_from_c(store.c());
  std::string v;
  auto t0 = Clock::now();
  Status st = kv->get("absent", &v, Deadline::after_ms(100));
  EXPECT_EQ(st.code(), Code::timeout) << st.to_string();
  EXPECT_GE(ms_since(t0), 90);
  std::string big(40000, 'b');
  big.back() = 'e';
  ASSERT_TRUE(kv->set("big", big));
  ASSERT_TRUE(kv->get("big", &v, Deadline::after_ms(100)));
  EXPECT_EQ(v, big) << "a value longer than the first buffer is fetched again whole";
  ASSERT_TRUE(kv->set("empty", ""));
  ASSERT_TRUE(kv->get("empty", &v, Deadline::after_ms(100)));
  EXPECT_TRUE(v.empty());
  store.fail_get("big", 5);
  EXPECT_EQ(kv->get("big", &v, Deadline::after_ms(100)).code(), Code::io_error);
  store.fail_set("x", -1);
  EXPECT_EQ(kv->set("x", "1").code(), Code::io_error);
  EXPECT_EQ(kv->set("y", std::string(KvStore::kMaxValue + 1, 'y')).code(), Code::invalid_argument);
  EXPECT_EQ(kv_store_from_c(hcomm_kv_store_t{}) ->set("k", "v").code(), Code::invalid_argument);
}

TEST(KvStoreFromC, OversizedStoredValueIsProtocolError) {
  MemStore store;
  hcomm_kv_store_t c = store.c();
  std::string huge(KvStore::kMaxValue + 1, 'h');
  ASSERT_EQ(c.set(c.arg, "huge", huge.data(), huge.size()), 0);
  std::string v;
  EXPECT_EQ(kv_store_from_c(c)->get("huge", &v, Deadline::after_ms(100)).code(), Code::protocol_error);
}

}  // namespace
}  // namespace hcomm::api
