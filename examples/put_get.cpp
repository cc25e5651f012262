// One-sided transfers into registered memory: rank 0 puts a 1024x1024 fp32
// tensor into rank 1's registered memory and raises a flag word there with
// put_notify; rank 1 waits on the flag, checks the tensor and prints its shape
// and sum. Then rank 1 gets a second tensor out of rank 0's registered memory
// and prints its sum. Neither target takes part in the transfer.
//
// Run: hcomm-run -n 2 build/examples/put_get
//      HCOMM_ENGINE=npu hcomm-run -n 2 --sim build/examples/put_get [--hbm]
// --hbm: rank 1 keeps its target tensor in NPU memory (npu engine only).
#include <hcomm/hcomm.hpp>

#include <cstdio>
#include <cstring>
#include <numeric>

namespace {

constexpr size_t kRows = 1024, kCols = 1024, kElems = kRows * kCols;
constexpr size_t kBytes = kElems * sizeof(float);
// Rank 1's target memory: the tensor, then the 8-byte flag put_notify raises.
constexpr uint64_t kFlagOffset = kBytes;
constexpr uint64_t kTagPutKey = 1, kTagGetKey = 2;

// Small integers: every value and every partial sum is exact in fp32/double,
// so the printed sums do not depend on the engine or the order of the adds.
float put_value(size_t i) { return static_cast<float>(i % 1024); }
float get_value(size_t i) { return static_cast<float>(i % 256) * 0.5f; }

double sum(const float* t, size_t n) { return std::accumulate(t, t + n, 0.0); }

// Index of the first element of t that differs from f(i), or n.
size_t first_mismatch(const float* t, size_t n, float (*f)(size_t)) {
  for (size_t i = 0; i < n; ++i)
    if (t[i] != f(i)) return i;
  return n;
}

int run(hcomm::Context& ctx, bool hbm) {
  const int rank = ctx.rank();
  if (rank == 0) {
    // Source of the put and target of rank 1's get: both registered.
    hcomm::Memory src = ctx.alloc(kBytes);
    hcomm::Memory shared = ctx.alloc(kBytes);
    float* s = src.as<float>();
    float* g = shared.as<float>();
    for (size_t i = 0; i < kElems; ++i) s[i] = put_value(i), g[i] = get_value(i);
    ctx.send_key(1, shared, kTagGetKey);
    hcomm::RemoteKey dst = ctx.recv_key(1, kTagPutKey);
    // Data, then the flag (value 1) once the data is visible at rank 1.
    ctx.put_notify(s, kBytes, dst, 0, dst, kFlagOffset, 1);
    std::printf("rank 0 put a %zux%zu fp32 tensor (%zu bytes) into rank 1 over the %s engine\n", kRows, kCols, kBytes,
                ctx.engine());
    ctx.barrier();  // rank 1 is done with `shared` (and with our key to it)
  } else if (rank == 1) {
    hcomm::Memory dst = ctx.alloc(kBytes + 64, hbm ? HCOMM_MEM_DEVICE : HCOMM_MEM_HOST);
    hcomm::Memory local = ctx.alloc(kBytes);
    ctx.send_key(0, dst, kTagPutKey);
    hcomm::RemoteKey shared = ctx.recv_key(0, kTagGetKey);
    ctx.notify_wait(dst, kFlagOffset, 1);
    // (Device memory is read here through its CPU mapping of the HBM aperture.)
    int rc = 0;
    const float* t = dst.as<float>();
    if (size_t bad = first_mismatch(t, kElems, put_value); bad != kElems) {
      std::fprintf(stderr, "put_get: element %zu of the put tensor is %g, want %g\n", bad, double(t[bad]),
                   double(put_value(bad)));
      rc = 1;
    } else {
      std::printf("rank 1 received shape [%zu, %zu] by put_notify%s, sum = %.1f\n", kRows, kCols,
                  hbm ? " into HBM" : "", sum(t, kElems));
    }
    ctx.get(local.data(), kBytes, shared, 0);
    t = local.as<float>();
    if (size_t bad = first_mismatch(t, kElems, get_value); bad != kElems) {
      std::fprintf(stderr, "put_get: element %zu of the got tensor is %g, want %g\n", bad, double(t[bad]),
                   double(get_value(bad)));
      rc = 1;
    } else {
      std::printf("rank 1 got shape [%zu, %zu] from rank 0, sum = %.1f\n", kRows, kCols, sum(t, kElems));
    }
    ctx.barrier();  // rank 0 may release `shared` now
    return rc;
  } else {
    ctx.barrier();  // ranks past 1 only take part in the collectives
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bool hbm = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--hbm") == 0) {
      hbm = true;
    } else {
      std::fprintf(stderr, "usage: put_get [--hbm]\n");
      return 2;
    }
  }
  try {
    hcomm::Context ctx;
    if (ctx.size() < 2) {
      std::fprintf(stderr, "put_get needs 2 ranks (hcomm-run -n 2 ...)\n");
      return 2;
    }
    // Registered memory and keys must go before the context does.
    int rc = run(ctx, hbm);
    ctx.finalize();
    return rc;
  } catch (const hcomm::Error& e) {
    std::fprintf(stderr, "put_get: %s\n", e.what());
    return 1;
  }
}
