// A parameter server over one-sided operations. Rank 0 (the server) holds fp32
// weights, a gradient accumulator and two control words in registered memory;
// ranks 1..N-1 (the workers) run K steps each:
//
//   worker: grad = f(weights it pulled, its rank)
//           accumulate(grad, fp32 SUM) into the server's accumulator
//           fetch_add(push counter, 1)
//           wait until the published step reaches s+1, then get the weights
//   server: notify_wait(push counter >= W*(s+1))      (its own memory)
//           weights -= lr * accum / W; accum = 0; published step = s+1
//
// The server's CPU never sends anything: the workers push and pull.
//
// The fake gradient is grad_r = w + r (r = 1..W), so accum/W = w + (W+1)/2 and,
// with lr = 1/2, every step is w <- w/2 - (W+1)/4, whose closed form after K
// steps is w* + (w0 - w*) / 2^K with w* = -(W+1)/2. All values are short
// dyadic fractions, so fp32 computes them exactly in any order of the adds and
// the checksum must equal the analytic value bit for bit. (The accumulator
// needs K+1 fraction bits and log2(W*(16+W)) integer bits of fp32's 24:
// hence at most 12 steps and 32 workers.)
//
// Run: hcomm-run -n 4 build/examples/parameter_server [--steps K] [--elems N]
#include <hcomm/hcomm.hpp>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

namespace {

constexpr float kLr = 0.5f;
constexpr uint64_t kTagKey = 1;
// The server's control words (one registered page, 8-byte aligned words).
constexpr uint64_t kPushCounter = 0;  // fetch_add by every worker after each push
constexpr uint64_t kPublished = 64;   // the last step whose update is applied; written by the server

float initial_weight(size_t j) { return static_cast<float>(j % 16); }

// sum_j w_K(j), from the closed form (not from running the steps).
double analytic_checksum(size_t elems, int steps, int workers) {
  const double fixed = -(workers + 1) / 2.0;
  double s0 = 0;
  for (size_t j = 0; j < elems; ++j) s0 += initial_weight(j);
  return static_cast<double>(elems) * fixed + (s0 - static_cast<double>(elems) * fixed) / std::ldexp(1.0, steps);
}

double checksum(const float* w, size_t n) {
  double s = 0;
  for (size_t j = 0; j < n; ++j) s += w[j];
  return s;
}

int server(hcomm::Context& ctx, size_t elems, int steps) {
  const int workers = ctx.size() - 1;
  const size_t bytes = elems * sizeof(float);
  hcomm::Memory weights = ctx.alloc(bytes);
  hcomm::Memory accum = ctx.alloc(bytes);  // zeroed by hcomm_mem_alloc
  hcomm::Memory control = ctx.alloc(4096);
  float* w = weights.as<float>();
  float* a = accum.as<float>();
  for (size_t j = 0; j < elems; ++j) w[j] = initial_weight(j);
  for (int r = 1; r <= workers; ++r) {
    ctx.send_key(r, weights, kTagKey);
    ctx.send_key(r, accum, kTagKey);
    ctx.send_key(r, control, kTagKey);
  }
  std::atomic_ref<uint64_t> published(*reinterpret_cast<uint64_t*>(control.as<uint8_t>() + kPublished));
  for (int s = 0; s < steps; ++s) {
    // Every worker accumulated before its fetch_add, and each blocking call
    // returned only once complete at this rank: the sum is in place.
    ctx.notify_wait(control, kPushCounter, static_cast<uint64_t>(workers) * static_cast<uint64_t>(s + 1));
    // accum / W first: that quotient is exact, a precomputed lr / W is not.
    for (size_t j = 0; j < elems; ++j) {
      w[j] -= kLr * (a[j] / static_cast<float>(workers));
      a[j] = 0.0f;
    }
    // Release: a worker that reads the new step reads the new weights.
    published.store(static_cast<uint64_t>(s + 1), std::memory_order_release);
  }
  double got = checksum(w, elems), want = analytic_checksum(elems, steps, workers);
  std::printf("server: %d steps from %d worker%s on %zu fp32 weights over the %s engine\n", steps, workers,
              workers == 1 ? "" : "s", elems, ctx.engine());
  std::printf("server: checksum %.6f, analytic %.6f: %s\n", got, want, got == want ? "match" : "MISMATCH");
  ctx.barrier();  // the workers are done with our memory
  return got == want ? 0 : 1;
}

int worker(hcomm::Context& ctx, size_t elems, int steps) {
  const int rank = ctx.rank(), workers = ctx.size() - 1;
  const size_t bytes = elems * sizeof(float);
  hcomm::RemoteKey weights = ctx.recv_key(0, kTagKey);
  hcomm::RemoteKey accum = ctx.recv_key(0, kTagKey);
  hcomm::RemoteKey control = ctx.recv_key(0, kTagKey);
  if (weights.size() < bytes || accum.size() < bytes) {
    std::fprintf(stderr, "worker %d: the server's buffers are smaller than --elems\n", rank);
    ctx.barrier();
    return 1;
  }
  // Local buffers of one-sided operations must be registered too.
  hcomm::Memory w = ctx.alloc(bytes);
  hcomm::Memory grad = ctx.alloc(bytes);
  ctx.get(w.data(), bytes, weights, 0);
  for (int s = 0; s < steps; ++s) {
    const float* wp = w.as<float>();
    float* g = grad.as<float>();
    for (size_t j = 0; j < elems; ++j) g[j] = wp[j] + static_cast<float>(rank);
    ctx.accumulate(g, elems, HCOMM_FP32, HCOMM_SUM, accum, 0);
    ctx.fetch_add(control, kPushCounter, 1);
    // Wait for the server's update: an atomic read (fetch_add of 0) of the
    // published step, backing off while the server is busy.
    for (int polls = 0; ctx.fetch_add(control, kPublished, 0) < static_cast<uint64_t>(s + 1); ++polls) {
      if (polls > 100) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    ctx.get(w.data(), bytes, weights, 0);
  }
  double got = checksum(w.as<float>(), elems), want = analytic_checksum(elems, steps, workers);
  std::printf("worker %d: pulled the step-%d weights, checksum %.6f: %s\n", rank, steps, got,
              got == want ? "match" : "MISMATCH");
  ctx.barrier();
  return got == want ? 0 : 1;
}

bool parse_int(const char* s, long lo, long hi, long* out) {
  char* end = nullptr;
  long v = std::strtol(s, &end, 10);
  if (end == s || *end != '\0' || v < lo || v > hi) return false;
  *out = v;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  long steps = 10, elems = 1 << 20;  // 1024 x 1024
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    bool ok = false;
    if (a == "--steps" && i + 1 < argc) ok = parse_int(argv[++i], 0, 12, &steps);
    else if (a == "--elems" && i + 1 < argc) ok = parse_int(argv[++i], 1, 1 << 24, &elems);
    if (!ok) {
      std::fprintf(stderr, "usage: parameter_server [--steps K (0..12)] [--elems N (1..16777216)]\n");
      return 2;
    }
  }
  try {
    hcomm::Context ctx;
    if (ctx.size() < 2 || ctx.size() > 33) {
      std::fprintf(stderr, "parameter_server needs a server and 1..32 workers (hcomm-run -n 3 ...)\n");
      return 2;
    }
    // Registered memory and keys must go before the context does.
    int rc = ctx.rank() == 0 ? server(ctx, static_cast<size_t>(elems), static_cast<int>(steps))
                             : worker(ctx, static_cast<size_t>(elems), static_cast<int>(steps));
    ctx.finalize();
    return rc;
  } catch (const hcomm::Error& e) {
    std::fprintf(stderr, "parameter_server: %s\n", e.what());
    return 1;
  }
}
