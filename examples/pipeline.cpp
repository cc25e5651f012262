// A pipeline of N stages (one per rank). Stage 0 makes M microbatches of
// activations (ROWS x 1024 fp32); every stage i applies x <- 2x + (i+1) and
// hands the microbatch to stage i+1; the last stage checks every element and
// prints a checksum next to the analytic value.
//
//   default    two-sided: irecv into a double buffer (the next microbatch's
//              receive is posted before this one is worked on), send onward.
//   --notify   one-sided: every stage but the first owns a registered inbox
//              of two slots and a `ready` word; the producer writes microbatch m
//              into slot m%2 with put_notify(ready = m+1). The consumer gives
//              each slot back with fetch_add on the producer's `credits` word
//              once it has finished with it, and the producer waits for that
//              credit (notify_wait on its own memory) before reusing a slot,
//              so it never overwrites a microbatch that has not been read.
//              A middle stage transforms in its inbox slot and puts from
//              there: registered memory is a valid source, no staging copy.
//
// The input is x0 = (7m + j) % 64 and every value stays an integer below
// 2^24, so fp32 is exact and the checksum equals
//   2^N * sum(x0) + M * E * sum_i (i+1) 2^(N-1-i),  sum(x0) = 31.5 * M * E
// with E = ROWS * 1024 elements per microbatch.
//
// Run: hcomm-run -n 4 build/examples/pipeline [--notify] [--microbatches M] [--rows R] [--slow-last MS]
#include <hcomm/hcomm.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

namespace {

constexpr size_t kCols = 1024;
constexpr int kMaxStages = 16;  // 2^16 * 63 + ... < 2^24: exact in fp32
constexpr uint64_t kTagInboxKey = 1, kTagCreditKey = 2;
constexpr uint64_t kTagData = uint64_t{1} << 32;  // | microbatch index

struct Shape {
  int microbatches;
  size_t rows;
  int slow_ms;  // the last stage dawdles this long over each microbatch (exercises the back-pressure)
  size_t elems() const { return rows * kCols; }
  size_t bytes() const { return elems() * sizeof(float); }
};

float input(int m, size_t j) { return static_cast<float>((7 * static_cast<size_t>(m) + j) % 64); }

void transform(int stage, float* x, size_t n) {
  const float add = static_cast<float>(stage + 1);
  for (size_t j = 0; j < n; ++j) x[j] = 2.0f * x[j] + add;
}

// What the last of `stages` stages holds for element j of microbatch m.
float expected(int stages, int m, size_t j) {
  float v = input(m, j);
  for (int i = 0; i < stages; ++i) v = 2.0f * v + static_cast<float>(i + 1);
  return v;
}

double analytic_checksum(int stages, const Shape& sh) {
  double c = 0;
  for (int i = 0; i < stages; ++i) c += (i + 1) * std::ldexp(1.0, stages - 1 - i);
  const double n = static_cast<double>(sh.microbatches) * static_cast<double>(sh.elems());
  return std::ldexp(1.0, stages) * 31.5 * n + n * c;
}

// The last stage: checks one microbatch element by element, adds it to the checksum.
class Sink {
 public:
  Sink(int stages, const Shape& sh) : _stages(stages), _sh(sh) {}
  void take(int m, const float* x) {
    if (_sh.slow_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(_sh.slow_ms));
    for (size_t j = 0; j < _sh.elems(); ++j) {
      if (x[j] != expected(_stages, m, j) && _bad++ == 0)
        std::fprintf(stderr, "pipeline: microbatch %d element %zu is %g, want %g\n", m, j, double(x[j]),
                     double(expected(_stages, m, j)));
      _sum += x[j];
    }
  }
  // Prints the verdict; true if everything matched.
  bool report(int rank, const char* how, const char* engine) const {
    const double want = analytic_checksum(_stages, _sh);
    std::printf("stage %d/%d: %d microbatches of [%zu, %zu] fp32 through %d stages by %s over the %s engine\n", rank,
                _stages, _sh.microbatches, _sh.rows, kCols, _stages, how, engine);
    const bool ok = _bad == 0 && _sum == want;
    std::printf("stage %d/%d: checksum %.1f, analytic %.1f: %s\n", rank, _stages, _sum, want, ok ? "match" : "MISMATCH");
    if (_bad != 0) std::printf("stage %d/%d: %zu wrong elements\n", rank, _stages, _bad);
    return ok;
  }

 private:
  int _stages;
  Shape _sh;
  double _sum = 0;
  size_t _bad = 0;
};

// Mode A: two-sided.
bool run_send_recv(hcomm::Context& ctx, const Shape& sh) {
  const int rank = ctx.rank(), n = ctx.size();
  hcomm::Memory buf = ctx.alloc(2 * sh.bytes());  // registered: the rendezvous moves it zero-copy
  float* slot[2] = {buf.as<float>(), buf.as<float>() + sh.elems()};
  if (rank == 0) {
    for (int m = 0; m < sh.microbatches; ++m) {
      float* x = slot[m % 2];
      for (size_t j = 0; j < sh.elems(); ++j) x[j] = input(m, j);
      transform(rank, x, sh.elems());
      ctx.send(1, x, sh.bytes(), kTagData | static_cast<uint64_t>(m));
    }
    ctx.barrier();
    return true;
  }
  Sink sink(n, sh);
  hcomm::Request next;
  if (sh.microbatches > 0) next = ctx.irecv(rank - 1, slot[0], sh.bytes(), kTagData);
  for (int m = 0; m < sh.microbatches; ++m) {
    hcomm::Request cur = std::move(next);
    // Post the receive of microbatch m+1 into the other slot first.
    if (m + 1 < sh.microbatches)
      next = ctx.irecv(rank - 1, slot[(m + 1) % 2], sh.bytes(), kTagData | static_cast<uint64_t>(m + 1));
    cur.wait();
    float* x = slot[m % 2];
    transform(rank, x, sh.elems());
    if (rank + 1 < n) ctx.send(rank + 1, x, sh.bytes(), kTagData | static_cast<uint64_t>(m));
    else sink.take(m, x);
  }
  bool ok = rank + 1 < n || sink.report(rank, "send/recv", ctx.engine());
  ctx.barrier();
  return ok;
}

// Mode B: put_notify into the next stage's double buffer, credits coming back.
bool run_put_notify(hcomm::Context& ctx, const Shape& sh) {
  const int rank = ctx.rank(), n = ctx.size();
  const bool first = rank == 0, last = rank + 1 == n;
  const uint64_t ready_off = 2 * sh.bytes();
  // Our inbox (not on stage 0): two slots, then the ready word.
  hcomm::Memory inbox;
  if (!first) inbox = ctx.alloc(2 * sh.bytes() + 64);
  // Our credit word (not on the last stage): slots the next stage has given back.
  hcomm::Memory credits;
  if (!last) credits = ctx.alloc(64);
  // Stage 0's source buffers (the others put straight from their inbox).
  hcomm::Memory source;
  if (first) source = ctx.alloc(2 * sh.bytes());
  // Keys: our inbox to the producer, our credit word to the consumer (eager
  // sends, so everyone sends before anyone receives).
  if (!first) ctx.send_key(rank - 1, inbox, kTagInboxKey);
  if (!last) ctx.send_key(rank + 1, credits, kTagCreditKey);
  hcomm::RemoteKey next_inbox, prev_credits;
  if (!last) next_inbox = ctx.recv_key(rank + 1, kTagInboxKey);
  if (!first) prev_credits = ctx.recv_key(rank - 1, kTagCreditKey);

  Sink sink(n, sh);
  for (int m = 0; m < sh.microbatches; ++m) {
    const uint64_t slot_off = static_cast<uint64_t>(m % 2) * sh.bytes();
    float* x = nullptr;
    if (first) {
      x = source.as<float>() + (m % 2) * sh.elems();
      for (size_t j = 0; j < sh.elems(); ++j) x[j] = input(m, j);
    } else {
      ctx.notify_wait(inbox, ready_off, static_cast<uint64_t>(m + 1));
      x = reinterpret_cast<float*>(inbox.as<uint8_t>() + slot_off);
    }
    transform(rank, x, sh.elems());
    if (!last) {
      // Slot m%2 of the next stage last held microbatch m-2: wait until it gave it back.
      if (m >= 2) ctx.notify_wait(credits, 0, static_cast<uint64_t>(m - 1));
      ctx.put_notify(x, sh.bytes(), next_inbox, slot_off, next_inbox, ready_off, static_cast<uint64_t>(m + 1));
    } else {
      sink.take(m, x);
    }
    // Done with our inbox slot (the put above completed at the target): give it back.
    if (!first) ctx.fetch_add(prev_credits, 0, 1);
  }
  bool ok = !last || sink.report(rank, "put_notify", ctx.engine());
  ctx.barrier();  // nobody touches another stage's memory after this
  return ok;
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
  bool notify = false;
  long microbatches = 8, rows = 256, slow_ms = 0;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    bool ok = true;
    if (a == "--notify") notify = true;
    else if (a == "--microbatches" && i + 1 < argc) ok = parse_int(argv[++i], 0, 1 << 20, &microbatches);
    else if (a == "--rows" && i + 1 < argc) ok = parse_int(argv[++i], 1, 16384, &rows);
    else if (a == "--slow-last" && i + 1 < argc) ok = parse_int(argv[++i], 0, 10000, &slow_ms);
    else ok = false;
    if (!ok) {
      std::fprintf(stderr, "usage: pipeline [--notify] [--microbatches M] [--rows R (1..16384)] [--slow-last MS]\n");
      return 2;
    }
  }
  // The checksum (values < 2^23 summed in double) is exact below 2^30 elements.
  if (static_cast<double>(microbatches) * static_cast<double>(rows) * kCols > 0x1p30) {
    std::fprintf(stderr, "pipeline: microbatches x rows x %zu must stay within 2^30 elements\n", kCols);
    return 2;
  }
  try {
    hcomm::Context ctx;
    if (ctx.size() < 2 || ctx.size() > kMaxStages) {
      std::fprintf(stderr, "pipeline needs 2..%d stages (hcomm-run -n 3 ...)\n", kMaxStages);
      return 2;
    }
    const Shape sh{static_cast<int>(microbatches), static_cast<size_t>(rows), static_cast<int>(slow_ms)};
    // Registered memory and keys must go before the context does.
    bool ok = notify ? run_put_notify(ctx, sh) : run_send_recv(ctx, sh);
    ctx.finalize();
    return ok ? 0 : 1;
  } catch (const hcomm::Error& e) {
    std::fprintf(stderr, "pipeline: %s\n", e.what());
    return 1;
  }
}
