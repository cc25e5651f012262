// A rank of the chaos test (tests/integration/chaos.cpp): every kind of
// traffic for --rounds rounds, checking
// every byte. Someone (a rank, or the simulator) may be SIGKILLed at any
// moment; this rank must then end on its own with a status, never hang.
//
//   chaos_rank --rounds N [--announce]
//
// --announce: once the first round is done, print "HCOMM-RUNNING rank R"
// (the QEMU suite's host side kills hcomm-sim when it sees it).
//
// Each round: a ring sendrecv of 64 B (eager) and 256 KiB (rendezvous);
// put to the right neighbour's window and get it back; an fp32 sum
// accumulate and a fetch_add into rank 0's window; a barrier.
// Exit status: 0 done; 10 peer failure; 11 device error; 12 a timeout
// inside hcomm_init (a rank that died during start-up looks like one that
// never came); 20 a timeout after start-up (a failure was missed); 21 a
// wrong byte; 22 any other error. The first line of stderr names the call
// and the status.
#include <hcomm/hcomm.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int kOpMs = 20000;  // far beyond any failure bound: a timeout here is a miss
int g_rank = -1;

[[noreturn]] void fail(const char* what, hcomm_status_t st, bool in_init = false) {
  std::fprintf(stderr, "chaos_rank %d: %s: %s (%s)\n", g_rank, what, hcomm_strerror(st), hcomm_last_error());
  int code = 22;
  if (st == HCOMM_ERR_PEER_FAILURE) code = 10;
  else if (st == HCOMM_ERR_DEVICE) code = 11;
  else if (st == HCOMM_ERR_TIMEOUT) code = in_init ? 12 : 20;
  std::exit(code);
}

void check(const char* what, hcomm_status_t st) {
  if (st != HCOMM_OK) fail(what, st);
}

[[noreturn]] void wrong(const char* what) {
  std::fprintf(stderr, "chaos_rank %d: %s: wrong data\n", g_rank, what);
  std::exit(21);
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t rounds = 50;
  bool announce = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--rounds") == 0 && i + 1 < argc) rounds = std::strtoull(argv[++i], nullptr, 10);
    else if (std::strcmp(argv[i], "--announce") == 0) announce = true;
  }
  hcomm_config_t cfg;
  hcomm_config_init(&cfg);
  hcomm_context_t* ctx = nullptr;
  if (hcomm_status_t st = hcomm_init(&cfg, &ctx); st != HCOMM_OK) fail("hcomm_init", st, true);
  const int me = hcomm_rank(ctx), n = hcomm_size(ctx);
  g_rank = me;
  std::printf("chaos_rank %d: initialized\n", me);  // the chaos driver tells start-up failures by it
  std::fflush(stdout);
  const int right = (me + 1) % n, left = (me + n - 1) % n;

  constexpr size_t kWin = 1 << 20, kBig = 256 << 10;
  hcomm_mem_t *win = nullptr, *buf = nullptr;
  check("hcomm_mem_alloc(window)", hcomm_mem_alloc(ctx, kWin, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &win));
  check("hcomm_mem_alloc(buffer)", hcomm_mem_alloc(ctx, 2 * kBig, HCOMM_MEM_HOST, HCOMM_ACCESS_ALL, &buf));
  std::memset(hcomm_mem_ptr(win), 0, kWin);
  // Every rank's window key, by a ring of sendrecvs (n - 1 steps).
  std::vector<hcomm_rkey_t*> keys(static_cast<size_t>(n), nullptr);
  {
    uint8_t mine[HCOMM_RKEY_MAX];
    size_t len = sizeof mine;
    check("hcomm_mem_rkey_pack", hcomm_mem_rkey_pack(win, mine, &len));
    std::vector<std::vector<uint8_t>> packed(static_cast<size_t>(n));
    packed[static_cast<size_t>(me)].assign(mine, mine + len);
    for (int step = 0; step < n - 1; ++step) {
      const int send_of = (me - step + n) % n, recv_of = (me - step - 1 + 2 * n) % n;
      std::vector<uint8_t> in(HCOMM_RKEY_MAX);
      hcomm_recv_info_t info{};
      auto& out = packed[static_cast<size_t>(send_of)];
      check("hcomm_sendrecv(keys)", hcomm_sendrecv(ctx, right, out.data(), out.size(), 1, left, in.data(), in.size(),
                                                   1, ~0ull, &info, kOpMs));
      in.resize(info.length);
      packed[static_cast<size_t>(recv_of)] = in;
    }
    for (int r = 0; r < n; ++r)
      check("hcomm_rkey_import", hcomm_rkey_import(ctx, r, packed[static_cast<size_t>(r)].data(),
                                                   packed[static_cast<size_t>(r)].size(), &keys[static_cast<size_t>(r)]));
  }

  auto* b = static_cast<uint8_t*>(hcomm_mem_ptr(buf));
  for (uint64_t round = 1; round <= rounds; ++round) {
    // Two-sided, eager and rendezvous, checked.
    for (size_t len : {size_t{64}, kBig}) {
      for (size_t i = 0; i < len; ++i) b[i] = static_cast<uint8_t>(me * 31 + round + i);
      hcomm_recv_info_t info{};
      check("hcomm_sendrecv", hcomm_sendrecv(ctx, right, b, len, 100 + round, left, b + kBig, len, 100 + round, ~0ull,
                                             &info, kOpMs));
      for (size_t i = 0; i < len; i += 97)
        if (b[kBig + i] != static_cast<uint8_t>(left * 31 + round + i)) wrong("sendrecv");
    }
    // One-sided into the right neighbour's window (its first half, ours alone).
    const size_t off = 4096;
    for (size_t i = 0; i < 8192; ++i) b[i] = static_cast<uint8_t>(me + round * 7 + i);
    check("hcomm_put", hcomm_put(ctx, b, 8192, keys[static_cast<size_t>(right)], off, kOpMs));
    check("hcomm_get", hcomm_get(ctx, b + kBig, 8192, keys[static_cast<size_t>(right)], off, kOpMs));
    if (std::memcmp(b, b + kBig, 8192) != 0) wrong("put/get");
    // Atomics on rank 0's window (second half).
    auto* ones = reinterpret_cast<float*>(b);  // registered memory, as the NPU engine needs
    for (int i = 0; i < 256; ++i) ones[i] = 1.0f;
    check("hcomm_accumulate", hcomm_accumulate(ctx, ones, 256, HCOMM_FP32, HCOMM_SUM, keys[0], kWin / 2, kOpMs));
    uint64_t old = 0;
    check("hcomm_fetch_add", hcomm_fetch_add(ctx, keys[0], kWin - 8, 1, &old, kOpMs));
    check("hcomm_flush", hcomm_flush(ctx, 0, kOpMs));
    check("hcomm_barrier", hcomm_barrier(ctx, kOpMs));
    if (announce && round == 1) {
      std::printf("HCOMM-RUNNING rank %d\n", me);
      std::fflush(stdout);
    }
  }
  // Rank 0's atomics add up: every rank did every round.
  check("hcomm_barrier(final)", hcomm_barrier(ctx, kOpMs));
  if (me == 0) {
    const auto* w = static_cast<const uint8_t*>(hcomm_mem_ptr(win));
    uint64_t count;
    std::memcpy(&count, w + kWin - 8, 8);
    float sum;
    std::memcpy(&sum, w + kWin / 2 + 4 * 17, 4);
    if (count != rounds * static_cast<uint64_t>(n)) wrong("fetch_add count");
    if (sum != static_cast<float>(rounds * static_cast<uint64_t>(n))) wrong("accumulate sum");
  }
  for (auto* k : keys) check("hcomm_rkey_release", hcomm_rkey_release(k));
  check("hcomm_mem_release", hcomm_mem_release(buf));
  check("hcomm_mem_release", hcomm_mem_release(win));
  check("hcomm_finalize", hcomm_finalize(ctx));
  std::printf("chaos_rank %d: %llu rounds\n", me, static_cast<unsigned long long>(rounds));
  return 0;
}
