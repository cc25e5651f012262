// Rank 0 sends a 1024x1024 fp32 tensor; rank 1 receives it and prints its
// shape and sum. Run: hcomm-run -n 2 build/examples/point_to_point
#include <hcomm/hcomm.hpp>

#include <cstdio>
#include <numeric>
#include <vector>

int main() {
  try {
    hcomm::Context ctx;
    if (ctx.size() < 2) {
      std::fprintf(stderr, "point_to_point needs 2 ranks (hcomm-run -n 2 ...)\n");
      return 2;
    }
    constexpr size_t rows = 1024, cols = 1024;
    std::vector<float> t(rows * cols);
    const uint64_t tag = 7;
    if (ctx.rank() == 0) {
      for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<float>(i % 1000) * 0.001f;
      ctx.send(1, t.data(), t.size() * sizeof(float), tag);
      std::printf("rank 0 sent a %zux%zu fp32 tensor (%zu bytes) over the %s engine\n", rows, cols,
                  t.size() * sizeof(float), ctx.engine());
    } else if (ctx.rank() == 1) {
      auto info = ctx.recv(0, t.data(), t.size() * sizeof(float), tag);
      double sum = std::accumulate(t.begin(), t.end(), 0.0);
      std::printf("rank 1 received shape [%zu, %zu] (%zu bytes from rank %d), sum = %.3f\n", rows, cols,
                  info.length, info.source, sum);
    }
    ctx.finalize();
    return 0;
  } catch (const hcomm::Error& e) {
    std::fprintf(stderr, "point_to_point: %s\n", e.what());
    return 1;
  }
}
