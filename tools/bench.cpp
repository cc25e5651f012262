// hcomm-bench: latency and bandwidth of the hcomm primitives, perftest /
// ucx_perftest style, on whichever engine the context runs (HCOMM_ENGINE).
//
//   hcomm-run -n 2 [--sim] build/tools/hcomm-bench [options]
//
// Rank 0 initiates, rank 1 is the target (further ranks only meet the
// barriers), except in the workloads (ps, pipe_sr, pipe_pn) where every rank
// takes part. The output names the transport serving rank 1 for rank 0
// (hcomm_peer_transport: "shm,cma" on one host, "verbs" across hosts). What each number measures (docs/performance.md repeats this):
//
//   (lat samples: batches of 16 iterations, one clock read per batch end;
//   each value below is per iteration of the batch)
//   send_recv lat  ping-pong hcomm_send / hcomm_recv; sample = round trip / 2.
//   put lat        ping-pong of blocking hcomm_put: the initiator writes an
//                  iteration number into the last 8 bytes of the payload, the
//                  target polls that word in its own memory and puts back
//                  (ucx_perftest ucp_put_lat / ib_write_lat); sample = RTT / 2.
//                  Relies on the engine writing the tail last (glibc memcpy
//                  and the simulated DMA engine do); the initiator's put has
//                  returned (complete at the target) before it polls anyway.
//   put_nbi lat    the same ping-pong with hcomm_put_nbi: the put does not
//                  wait for its own completion (the peer's answer proves it
//                  arrived), as ib_write_lat and ucp_put_lat; a flush every
//                  16 iterations (timed) reaps completions.
//   put_notify lat ping-pong of hcomm_put_notify / hcomm_notify_wait on the
//                  notify word; sample = RTT / 2.
//   get lat        one blocking hcomm_get (a round trip by nature), target
//                  passive; sample = the whole call.
//   acc lat        one blocking hcomm_accumulate (fp32 sum), target passive;
//                  sample = the whole call (completion at the target).
//   fetch_add lat  one blocking hcomm_fetch_add (8 bytes), target passive.
//                  Passive = waiting in a barrier (it naps after a spin), or
//                  with --passive spin polling a word of its memory until the
//                  initiator's put after the timed loop (ucx_perftest's get
//                  and fadd targets poll; perftest's servers sleep; where the
//                  NIC is software, a halted CPU answers later).
//   memcpy lat     one memcpy of the size between two hot registered buffers
//                  of rank 0 (the physical limit of a single-copy transfer).
//   bw (all)       windows of `--window` nonblocking operations, then wait
//                  for all of them (one-sided: complete at the target);
//                  put_nbi / get_nbi: windows of hcomm_put_nbi /
//                  hcomm_get_nbi, then one hcomm_flush (ucx_perftest's
//                  ucp_put_bw / ucp_get: put_nbx / get_nbx with no request);
//                  send_recv: the receiver pre-posts the window and answers
//                  each window with an 8-byte ack (osu_bw). Sample = one
//                  window; reported MB/s (1e6 B/s) = bytes of a window /
//                  median window time; avg_us = mean time per operation.
//   ps             parameter-server training step over a model of `size`
//                  bytes of fp32, sharded over every rank (rank q serves
//                  shard q): each rank accumulates its gradient of every shard
//                  into the shard's owner, bumps the owner's counter with a
//                  fetch-add, waits until the owner's counter shows all ranks,
//                  and gets the summed shard back. Sample = one step.
//   pipe_sr        pipeline hand-off of `size` bytes of activations from stage
//                  r to r+1 with send/recv, `--microbatches` per run; sample =
//                  run time / microbatches (first send to the last stage's ack).
//   pipe_pn        the same with put-with-notify into two slots at the next
//                  stage, which hands a credit back with an 8-byte put.
#include <hcomm/hcomm.hpp>

#include "common/barrier.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kTimeoutMs = 120000;
constexpr uint64_t kTagBase = 0x6265000000000000ull;  // "be"

// The busy polls' pause hint: none in a QEMU TCG guest (common/barrier.h says why).
using hcomm::cpu_relax;

double us_since(Clock::time_point t0, Clock::time_point t1) {
  return std::chrono::duration<double, std::micro>(t1 - t0).count();
}

struct Options {
  std::vector<std::string> tests;
  bool lat = true, bw = true;
  std::vector<size_t> sizes;
  size_t min_size = 8, max_size = size_t{16} << 20;
  unsigned factor = 4;
  int window = 32;
  long iters = 0;    // 0: adaptive
  long warmup = -1;  // -1: adaptive
  double scale = 1.0;
  int microbatches = 16;
  long batch = 0;  // lat iterations per timed sample; 0: 16, or 1 for short runs
  std::string format = "text";
  std::string output;
  unsigned mem_kind = HCOMM_MEM_HOST;
  bool passive_spin = false;  // --passive spin: the target of get/acc/fetch_add polls a word instead of a barrier
};

const std::vector<std::string> kBasicTests = {"send_recv", "put", "get", "acc", "put_notify", "fetch_add"};
const std::vector<std::string> kAllTests = {"send_recv", "put", "get", "acc", "put_notify", "fetch_add",
                                            "put_nbi", "get_nbi", "memcpy", "ps", "pipe_sr", "pipe_pn"};

void usage(FILE* f) {
  std::fprintf(f,
               "usage: hcomm-bench [options]   (launch with hcomm-run -n 2 [--sim])\n"
               "  -t, --tests LIST     comma list of: send_recv put get acc put_notify fetch_add\n"
               "                       put_nbi get_nbi memcpy ps pipe_sr pipe_pn, or 'basic' (the\n"
               "                       first six, default),\n"
               "                       'workloads' (ps,pipe_sr,pipe_pn) or 'all'\n"
               "  -m, --mode MODE      lat, bw or both (default both; workloads: one 'step' mode)\n"
               "  -s, --sizes LIST     comma list of byte sizes (suffixes K, M), e.g. 8,4K,1M\n"
               "      --min SIZE       smallest size (default 8)\n"
               "      --max SIZE       largest size (default 16M)\n"
               "      --factor N       size step: 2 or 4 (default 4)\n"
               "  -w, --window N       operations in flight per bandwidth window (default 32)\n"
               "  -n, --iters N        iterations (lat) / windows (bw) / steps; default adaptive to size\n"
               "      --warmup N       warm-up iterations (default adaptive: a tenth, at least 2)\n"
               "      --scale F        multiply the adaptive counts by F (e.g. 0.05 for a smoke run)\n"
               "      --microbatches N pipeline micro-batches per sample (default 16)\n"
               "      --batch N        lat: iterations per timed sample (default 16, 1 for runs of\n"
               "                       fewer than 320; 1 = the median of single iterations, as\n"
               "                       perftest's t_typical and ucx_perftest's typical)\n"
               "      --mem host|device  memory of the buffers (device: NPU engine HBM)\n"
               "      --passive wait|spin  get/acc/fetch_add lat: the target waits in a barrier\n"
               "                       (default) or polls a word of its memory that the initiator\n"
               "                       writes at the end, as ucx_perftest's target does\n"
               "      --json | --csv   machine-readable output instead of the table\n"
               "  -o, --output FILE    write the output to FILE (rank 0) instead of stdout\n");
}

size_t parse_size(const std::string& s) {
  char* end = nullptr;
  unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (end == s.c_str()) throw std::runtime_error("bad size '" + s + "'");
  std::string suf = end;
  if (suf == "K" || suf == "k" || suf == "KiB") v <<= 10;
  else if (suf == "M" || suf == "m" || suf == "MiB") v <<= 20;
  else if (suf == "G" || suf == "g" || suf == "GiB") v <<= 30;
  else if (!suf.empty()) throw std::runtime_error("bad size suffix in '" + s + "'");
  return static_cast<size_t>(v);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t p = 0;
  while (p <= s.size()) {
    size_t q = s.find(',', p);
    if (q == std::string::npos) q = s.size();
    if (q > p) out.push_back(s.substr(p, q - p));
    p = q + 1;
  }
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  auto need = [&](int& i) -> std::string {
    if (i + 1 >= argc) throw std::runtime_error(std::string(argv[i]) + " needs a value");
    return argv[++i];
  };
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      usage(stdout);
      std::exit(0);
    } else if (a == "-t" || a == "--tests") {
      for (auto& t : split(need(i))) {
        if (t == "basic") o.tests.insert(o.tests.end(), kBasicTests.begin(), kBasicTests.end());
        else if (t == "all") o.tests.insert(o.tests.end(), kAllTests.begin(), kAllTests.end());
        else if (t == "workloads") o.tests.insert(o.tests.end(), {"ps", "pipe_sr", "pipe_pn"});
        else if (std::find(kAllTests.begin(), kAllTests.end(), t) != kAllTests.end()) o.tests.push_back(t);
        else throw std::runtime_error("unknown test '" + t + "'");
      }
    } else if (a == "-m" || a == "--mode") {
      std::string m = need(i);
      if (m == "lat") o.bw = false;
      else if (m == "bw") o.lat = false;
      else if (m != "both") throw std::runtime_error("mode is lat, bw or both");
    } else if (a == "-s" || a == "--sizes") {
      for (auto& s : split(need(i))) o.sizes.push_back(parse_size(s));
    } else if (a == "--min") {
      o.min_size = parse_size(need(i));
    } else if (a == "--max") {
      o.max_size = parse_size(need(i));
    } else if (a == "--factor") {
      o.factor = static_cast<unsigned>(std::stoul(need(i)));
      if (o.factor != 2 && o.factor != 4) throw std::runtime_error("--factor is 2 or 4");
    } else if (a == "-w" || a == "--window") {
      o.window = std::stoi(need(i));
      if (o.window < 1 || o.window > 4096) throw std::runtime_error("--window is 1..4096");
    } else if (a == "-n" || a == "--iters") {
      o.iters = std::stol(need(i));
      if (o.iters < 1) throw std::runtime_error("--iters is at least 1");
    } else if (a == "--warmup") {
      o.warmup = std::stol(need(i));
    } else if (a == "--scale") {
      o.scale = std::stod(need(i));
      if (!(o.scale > 0)) throw std::runtime_error("--scale must be positive");
    } else if (a == "--microbatches") {
      o.microbatches = std::stoi(need(i));
      if (o.microbatches < 1) throw std::runtime_error("--microbatches is at least 1");
    } else if (a == "--batch") {
      o.batch = std::stol(need(i));
      if (o.batch < 1 || o.batch > 4096) throw std::runtime_error("--batch is 1..4096");
    } else if (a == "--mem") {
      std::string m = need(i);
      if (m == "host") o.mem_kind = HCOMM_MEM_HOST;
      else if (m == "device") o.mem_kind = HCOMM_MEM_DEVICE;
      else throw std::runtime_error("--mem is host or device");
    } else if (a == "--passive") {
      std::string m = need(i);
      if (m == "wait") o.passive_spin = false;
      else if (m == "spin") o.passive_spin = true;
      else throw std::runtime_error("--passive is wait or spin");
    } else if (a == "--json") {
      o.format = "json";
    } else if (a == "--csv") {
      o.format = "csv";
    } else if (a == "-o" || a == "--output") {
      o.output = need(i);
    } else {
      throw std::runtime_error("unknown option '" + a + "' (see --help)");
    }
  }
  if (o.tests.empty()) o.tests = kBasicTests;
  if (o.sizes.empty()) {
    if (o.min_size == 0 || o.min_size > o.max_size) throw std::runtime_error("--min must be in 1..--max");
    for (size_t s = o.min_size; s <= o.max_size; s *= o.factor) o.sizes.push_back(s);
  }
  for (size_t s : o.sizes)
    if (s == 0) throw std::runtime_error("size 0 is not measured");
  if (o.passive_spin && o.mem_kind != HCOMM_MEM_HOST)
    throw std::runtime_error("--passive spin polls host memory: not with --mem device");
  return o;
}

struct Stats {
  double p50 = 0, p99 = 0, avg = 0, min = 0;
};
Stats stats_of(std::vector<double> v) {
  Stats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  auto pct = [&](double p) {
    size_t i = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(v.size()))) ;
    return v[std::min(v.size() - 1, i == 0 ? 0 : i - 1)];
  };
  s.p50 = pct(50);
  s.p99 = pct(99);
  s.min = v.front();
  s.avg = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  return s;
}

struct Result {
  std::string test, mode;
  size_t size = 0;
  long iters = 0;
  int window = 1;
  Stats lat;          // microseconds per operation (lat) / per window op (bw) / per step
  double mbps = 0;    // 1e6 bytes/s, from the median sample
  double mrate = 0;   // million operations/s, from the median sample
};

// Iteration counts adaptive to size: roughly constant bytes per point, bounded.
long lat_iters(const Options& o, size_t size) {
  if (o.iters > 0) return o.iters;
  double n = std::clamp(static_cast<double>(size_t{256} << 20) / static_cast<double>(size), 20.0, 10000.0);
  return std::max(2L, std::lround(n * o.scale));
}
long bw_windows(const Options& o, size_t size) {
  if (o.iters > 0) return o.iters;
  double n = std::clamp(static_cast<double>(size_t{1} << 30) / (static_cast<double>(size) * o.window), 10.0, 1000.0);
  return std::max(2L, std::lround(n * o.scale));
}
long warm_of(const Options& o, long iters) { return o.warmup >= 0 ? o.warmup : std::max(2L, iters / 10); }

class Bench {
 public:
  Bench(hcomm::Context& ctx, const Options& o) : _c(ctx), _o(o) {
    _rank = _c.rank();
    _size = _c.size();
    _peer = _rank == 0 ? 1 : 0;
    size_t max = *std::max_element(o.sizes.begin(), o.sizes.end());
    _max = (max + 63) & ~size_t{63};
    // Two regions: [0, _max) is where the peer writes into us / reads from
    // us; [_max, 2*_max) is our local source / destination. Then the flags
    // (notify word at +0, ack word at +8, fetch-add word at +16) and, a page
    // further, --passive spin's end-of-test word at +kSpinWord: the polling
    // target reads a page the peer's fetch_add does not touch, as
    // ucx_perftest's target polls its send buffer while its peer's atomics
    // hit its receive buffer.
    _mem = _c.alloc(2 * _max + kSpinWord + 64, o.mem_kind);
    _flags = 2 * _max;
    std::memset(_mem.data(), 0, 2 * _max + kSpinWord + 64);
    exchange_keys(_mem, &_key);
  }

  std::vector<Result> run() {
    std::vector<Result> out;
    for (const std::string& t : _o.tests) {
      if (t == "ps" || t == "pipe_sr" || t == "pipe_pn") {
        for (size_t s : _o.sizes) {
          Result r = workload(t, s);
          if (r.iters > 0) out.push_back(r);
        }
        continue;
      }
      if (_size < 2 && t != "memcpy") throw std::runtime_error("test '" + t + "' needs 2 ranks (hcomm-run -n 2)");
      std::vector<size_t> sizes = _o.sizes;
      if (t == "fetch_add") sizes = {8};
      for (size_t s : sizes) {
        if ((t == "put" || t == "acc" || t == "put_notify" || t == "put_nbi") && s < 8) continue;
        if (t == "acc" && s % 4 != 0) continue;
        // Implicit completion: windows only, but for put_nbi's ping-pong.
        const bool nbi = t == "get_nbi";
        if (_o.lat && !nbi) out.push_back(lat(t, s));
        if (_o.bw) out.push_back(bw(t, s));
      }
    }
    return out;
  }

 private:
  uint8_t* base() const { return _mem.as<uint8_t>(); }
  uint8_t* local() const { return base() + _max; }
  std::atomic_ref<uint64_t> word(uint64_t off) const { return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(base() + off)); }

  void exchange_keys(const hcomm::Memory& m, std::vector<hcomm::RemoteKey>* keys) {
    keys->clear();
    keys->resize(_size);
    uint64_t tag = kTagBase | (uint64_t{0xee} << 40) | _key_seq++;
    for (int r = 0; r < _size; ++r)
      if (r != _rank) _c.send_key(r, m, tag);
    for (int r = 0; r < _size; ++r) {
      if (r != _rank) (*keys)[r] = _c.recv_key(r, tag);
      else (*keys)[r] = _c.import_key(_rank, m.rkey());
    }
  }

  // ---- latency -------------------------------------------------------------------
  // Latency samples are batches of kBatch iterations: one clock read at each
  // end of a batch instead of two per iteration (a clock read costs about
  // 25 ns on a VM's TSC, a quarter of a small round trip, while
  // ucx_perftest reads the TSC directly). Sample = batch time / kBatch
  // (/ 2 for ping-pongs); batches start after the warm-up. Short runs (fewer
  // than 20 batches) time every iteration, as does --batch 1: a batch's
  // sample is a mean, so a rare slow iteration (a retransmission, a host
  // preempting a guest) lifts the median of batches, not the median of single
  // iterations (what perftest and ucx_perftest report).
  struct Batches {
    static constexpr long kBatch = 16;
    long warm, batch, left = 0;  // left: iterations still to run in the current batch
    std::vector<double>* out;
    Clock::time_point t0{};
    Batches(long w, long iters, long forced, std::vector<double>* o)
        : warm(w), batch(forced > 0 ? forced : iters >= 20 * kBatch ? kBatch : 1), out(o) {}
    void begin(long i) {
      if (left == 0 && i >= warm) {
        left = batch;
        t0 = Clock::now();
      }
    }
    void end(long i, int div) {
      if (i < warm || --left != 0) return;
      out->push_back(us_since(t0, Clock::now()) / static_cast<double>(batch * div));
    }
  };

  Result lat(const std::string& t, size_t n) {
    Result res{t, "lat", n, lat_iters(_o, n), 1, {}, 0, 0};
    const long warm = warm_of(_o, res.iters);
    const long total = warm + res.iters;
    std::vector<double> samples;
    samples.reserve(static_cast<size_t>(res.iters));
    Batches bt(warm, res.iters, _o.batch, &samples);
    prepare(t, n);
    _c.barrier(kTimeoutMs);
    hcomm_context_t* c = _c.get();
    const bool init = _rank == 0, target = _rank == 1;
    if (t == "memcpy") {
      if (init) {
        for (long i = 0; i < total; ++i) {
          bt.begin(i);
          std::memcpy(base(), local(), n);
          bt.end(i, 1);
        }
      }
    } else if (t == "send_recv" && (init || target)) {
      uint64_t tag = kTagBase | 1;
      for (long i = 0; i < total; ++i) {
        bt.begin(i);
        if (init) {
          hcomm::check(hcomm_send(c, _peer, local(), n, tag, kTimeoutMs), "send");
          hcomm::check(hcomm_recv(c, _peer, base(), n, tag, HCOMM_TAG_MASK_ALL, nullptr, kTimeoutMs), "recv");
        } else {
          hcomm::check(hcomm_recv(c, _peer, base(), n, tag, HCOMM_TAG_MASK_ALL, nullptr, kTimeoutMs), "recv");
          hcomm::check(hcomm_send(c, _peer, local(), n, tag, kTimeoutMs), "send");
        }
        bt.end(i, 2);
      }
    } else if ((t == "put" || t == "put_nbi") && (init || target)) {
      // The peer writes into our [0, n); the last 8 bytes carry the iteration.
      // put_nbi: the put does not wait for its own completion (the peer's
      // answer shows it arrived), as ib_write_lat and ucp_put_lat do not; a
      // flush every 16 iterations, inside the timing, reaps completions.
      const uint64_t tail = n - 8;
      auto seen = word(tail);
      seen.store(0, std::memory_order_relaxed);
      const bool nbi = t == "put_nbi";
      _c.barrier(kTimeoutMs);
      for (long i = 0; i < total; ++i) {
        const uint64_t seq = static_cast<uint64_t>(i) + 1;
        bt.begin(i);
        if (target) spin_until(seen, seq);
        std::memcpy(local() + tail, &seq, 8);
        if (nbi) hcomm::check(hcomm_put_nbi(c, local(), n, _key[_peer].get(), 0), "put_nbi");
        else hcomm::check(hcomm_put(c, local(), n, _key[_peer].get(), 0, kTimeoutMs), "put");
        if (init) spin_until(seen, seq);
        if (nbi && ((i & 15) == 15 || i + 1 == total)) hcomm::check(hcomm_flush(c, _peer, kTimeoutMs), "flush");
        bt.end(i, 2);
      }
    } else if (t == "put_notify" && (init || target)) {
      word(_flags).store(0);
      _c.barrier(kTimeoutMs);
      for (long i = 0; i < total; ++i) {
        const uint64_t seq = static_cast<uint64_t>(i) + 1;
        bt.begin(i);
        if (target) hcomm::check(hcomm_notify_wait(c, _mem.get(), _flags, seq, kTimeoutMs), "notify_wait");
        hcomm::check(hcomm_put_notify(c, local(), n, _key[_peer].get(), 0, _key[_peer].get(), _flags, seq, kTimeoutMs),
                     "put_notify");
        if (init) hcomm::check(hcomm_notify_wait(c, _mem.get(), _flags, seq, kTimeoutMs), "notify_wait");
        bt.end(i, 2);
      }
    } else if ((t == "get" || t == "acc" || t == "fetch_add") && (init || (target && _o.passive_spin))) {
      // --passive spin: the target polls the word at _flags + kSpinWord until the
      // initiator's last put (after the timed loop) writes this test's number,
      // so its CPU stays busy as ucx_perftest's target's does; otherwise it
      // waits in the barrier below.
      const uint64_t done = ++_tests_run;
      if (target) {
        auto w = word(_flags + kSpinWord);
        spin_until(w, done);
      } else {
        uint64_t old = 0;
        for (long i = 0; i < total; ++i) {
          bt.begin(i);
          if (t == "get") hcomm::check(hcomm_get(c, local(), n, _key[_peer].get(), 0, kTimeoutMs), "get");
          else if (t == "acc")
            hcomm::check(hcomm_accumulate(c, local(), n / 4, HCOMM_FP32, HCOMM_SUM, _key[_peer].get(), 0, kTimeoutMs),
                         "accumulate");
          else hcomm::check(hcomm_fetch_add(c, _key[_peer].get(), _flags + 16, 1, &old, kTimeoutMs), "fetch_add");
          bt.end(i, 1);
        }
        if (_o.passive_spin) {
          std::memcpy(local(), &done, 8);
          hcomm::check(hcomm_put(c, local(), 8, _key[_peer].get(), _flags + kSpinWord, kTimeoutMs),
                     "put (end of test)");
        }
      }
    }
    _c.barrier(kTimeoutMs);
    res.lat = stats_of(samples);
    if (res.lat.p50 > 0) {
      res.mbps = static_cast<double>(n) / res.lat.p50;
      res.mrate = 1.0 / res.lat.p50;
    }
    return res;
  }

  // Accumulate: normal floats on both sides (what the buffers held before may
  // read as denormals or NaNs, which would time the FPU's slow paths).
  void prepare(const std::string& t, size_t n) {
    if (t != "acc") return;
    std::vector<float> one(n / 4, 1.0f), zero(n / 4, 0.0f);
    std::memcpy(local(), one.data(), n / 4 * 4);
    std::memcpy(base(), zero.data(), n / 4 * 4);
  }

  static void spin_until(std::atomic_ref<uint64_t>& w, uint64_t v) {
    auto dl = Clock::now() + std::chrono::milliseconds(kTimeoutMs);
    for (unsigned spins = 0; w.load(std::memory_order_acquire) < v; ++spins) {
      cpu_relax();
      if ((spins & 0xffff) == 0 && Clock::now() > dl) throw std::runtime_error("peer never wrote the polled word");
    }
  }

  // ---- bandwidth -----------------------------------------------------------------
  Result bw(const std::string& t, size_t n) {
    const int win = t == "memcpy" ? 1 : _o.window;
    Result res{t, "bw", n, bw_windows(_o, n), win, {}, 0, 0};
    if (t == "memcpy") res.iters = lat_iters(_o, n);
    const long warm = warm_of(_o, res.iters);
    const long total = warm + res.iters;
    std::vector<double> samples;  // microseconds per window
    samples.reserve(static_cast<size_t>(res.iters));
    hcomm_context_t* c = _c.get();
    const bool init = _rank == 0, target = _rank == 1;
    word(_flags).store(0);
    prepare(t, n);
    _c.barrier(kTimeoutMs);
    std::vector<hcomm_request_t*> reqs(static_cast<size_t>(win), nullptr);
    std::vector<uint64_t> olds(static_cast<size_t>(win), 0);
    // A window is waited for as MPI programs wait for one (MPI_Waitall):
    // one call, one deadline; it frees every request and NULLs its entry.
    auto wait_all = [&] { hcomm::check(hcomm_wait_all(reqs.data(), reqs.size(), nullptr, kTimeoutMs), "wait_all"); };
    uint64_t notified = 0;
    // The operation, decided once (not by string compares inside the window).
    enum class Op { put, get, acc, put_notify, fetch_add, put_nbi, get_nbi };
    const Op op = t == "put" ? Op::put : t == "get" ? Op::get : t == "acc" ? Op::acc
                : t == "put_notify" ? Op::put_notify : t == "put_nbi" ? Op::put_nbi
                : t == "get_nbi" ? Op::get_nbi : Op::fetch_add;
    for (long i = 0; i < total; ++i) {
      auto t0 = Clock::now();
      if (t == "memcpy") {
        if (!init) break;
        std::memcpy(base(), local(), n);
      } else if (t == "send_recv") {
        if (!init && !target) break;
        uint64_t tag = kTagBase | 2;
        uint64_t ack = 0;
        if (init) {
          for (int k = 0; k < win; ++k) hcomm::check(hcomm_isend(c, _peer, local(), n, tag, &reqs[k]), "isend");
          wait_all();
          hcomm::check(hcomm_recv(c, _peer, &ack, 8, tag + 1, HCOMM_TAG_MASK_ALL, nullptr, kTimeoutMs), "recv ack");
        } else {
          for (int k = 0; k < win; ++k)
            hcomm::check(hcomm_irecv(c, _peer, base(), n, tag, HCOMM_TAG_MASK_ALL, &reqs[k]), "irecv");
          wait_all();
          hcomm::check(hcomm_send(c, _peer, &ack, 8, tag + 1, kTimeoutMs), "send ack");
        }
      } else {
        if (!init) break;  // one-sided: the target waits in the barrier below
        hcomm_rkey_t* k = _key[_peer].get();
        uint8_t* src = local();
        for (int j = 0; j < win; ++j) {
          hcomm_status_t s = HCOMM_OK;
          switch (op) {
            case Op::put: s = hcomm_iput(c, src, n, k, 0, &reqs[j]); break;
            case Op::get: s = hcomm_iget(c, src, n, k, 0, &reqs[j]); break;
            case Op::acc: s = hcomm_iaccumulate(c, src, n / 4, HCOMM_FP32, HCOMM_SUM, k, 0, &reqs[j]); break;
            case Op::put_notify: s = hcomm_iput_notify(c, src, n, k, 0, k, _flags, ++notified, &reqs[j]); break;
            case Op::fetch_add: s = hcomm_ifetch_add(c, k, _flags + 16, 1, &olds[j], &reqs[j]); break;
            case Op::put_nbi: s = hcomm_put_nbi(c, src, n, k, 0); break;
            case Op::get_nbi: s = hcomm_get_nbi(c, src, n, k, 0); break;
          }
          if (s != HCOMM_OK) hcomm::check(s, t.c_str());
        }
        if (op == Op::put_nbi || op == Op::get_nbi) hcomm::check(hcomm_flush(c, _peer, kTimeoutMs), "flush");
        else wait_all();
      }
      auto t1 = Clock::now();
      if (i >= warm) samples.push_back(us_since(t0, t1));
    }
    _c.barrier(kTimeoutMs);
    if (t == "put_notify" && target && word(_flags).load(std::memory_order_acquire) != static_cast<uint64_t>(total * win))
      throw std::runtime_error("put_notify bw: notify word is not the last value");
    res.lat = stats_of(samples);
    const double ops = win;
    if (res.lat.p50 > 0) {
      res.mbps = static_cast<double>(n) * ops / res.lat.p50;
      res.mrate = ops / res.lat.p50;
    }
    res.lat.p50 /= ops;
    res.lat.p99 /= ops;
    res.lat.avg /= ops;
    res.lat.min /= ops;
    return res;
  }

  // ---- workloads -----------------------------------------------------------------
  Result workload(const std::string& t, size_t n) {
    Result res{t, "step", n, 0, 1, {}, 0, 0};
    if (t == "ps" && (n % 4 != 0 || n / 4 < static_cast<size_t>(_size))) return res;
    if (t != "ps" && _size < 2) throw std::runtime_error(t + " needs at least 2 ranks");
    res.iters = t == "ps" ? lat_iters(_o, n) : std::max(2L, lat_iters(_o, n * _o.microbatches));
    const long warm = warm_of(_o, res.iters);
    std::vector<double> samples;
    if (t == "ps") samples = ps(n, warm, res.iters);
    else samples = pipeline(t == "pipe_pn", n, warm, res.iters);
    res.lat = stats_of(samples);
    if (res.lat.p50 > 0) {
      res.mbps = static_cast<double>(n) / res.lat.p50;
      res.mrate = 1.0 / res.lat.p50;
    }
    return res;
  }

  std::vector<double> ps(size_t n, long warm, long iters) {
    hcomm_context_t* c = _c.get();
    const size_t elems = n / 4;
    auto shard_off = [&](int q) { return (elems * static_cast<size_t>(q) / static_cast<size_t>(_size)) * 4; };
    auto shard_len = [&](int q) { return shard_off(q + 1) - shard_off(q); };
    // grads | weights (pulled) | counter; the summed shards live in `sum`.
    hcomm::Memory work = _c.alloc(2 * n + 128, _o.mem_kind);
    const uint64_t ctr = (n + 63) & ~uint64_t{63};  // the shard owner's step counter
    hcomm::Memory sum = _c.alloc(ctr + 64, _o.mem_kind);
    std::memset(sum.data(), 0, ctr + 64);
    std::vector<float> g(elems, static_cast<float>(_rank + 1));
    std::memcpy(work.data(), g.data(), n);
    std::vector<hcomm::RemoteKey> keys;
    exchange_keys(sum, &keys);
    uint8_t* grads = work.as<uint8_t>();
    uint8_t* weights = grads + n;
    uint64_t* probe = reinterpret_cast<uint64_t*>(grads + ((2 * n + 63) & ~size_t{63}));
    std::vector<double> samples;
    _c.barrier(kTimeoutMs);
    uint64_t old = 0;
    for (long s = 1; s <= warm + iters; ++s) {
      const uint64_t want = static_cast<uint64_t>(s) * static_cast<uint64_t>(_size);
      auto t0 = Clock::now();
      for (int i = 1; i <= _size; ++i) {  // peers first, our own shard last
        int q = (_rank + i) % _size;
        hcomm::check(hcomm_accumulate(c, grads + shard_off(q), shard_len(q) / 4, HCOMM_FP32, HCOMM_SUM,
                                      keys[q].get(), shard_off(q), kTimeoutMs), "ps accumulate");
        hcomm::check(hcomm_fetch_add(c, keys[q].get(), ctr, 1, &old, kTimeoutMs), "ps fetch_add");
      }
      for (int i = 0; i < _size; ++i) {
        int q = (_rank + i) % _size;
        if (q == _rank) {
          hcomm::check(hcomm_notify_wait(c, sum.get(), ctr, want, kTimeoutMs), "ps wait own shard");
        } else {
          auto dl = Clock::now() + std::chrono::milliseconds(kTimeoutMs);
          for (;;) {
            hcomm::check(hcomm_get(c, probe, 8, keys[q].get(), ctr, kTimeoutMs), "ps poll counter");
            if (*probe >= want) break;
            if (Clock::now() > dl) throw std::runtime_error("ps: shard owner never complete");
            cpu_relax();
          }
        }
        hcomm::check(hcomm_get(c, weights + shard_off(q), shard_len(q), keys[q].get(), shard_off(q), kTimeoutMs),
                     "ps get");
      }
      auto t1 = Clock::now();
      if (s == 1) {
        // Correctness of the first (untimed) step: every element is the sum
        // over ranks of (rank + 1). The barrier keeps faster ranks from
        // pushing step 2 into a shard before everyone pulled step 1 (later
        // steps may overlap that way, as asynchronous workers do).
        const float expect = static_cast<float>(_size * (_size + 1) / 2);
        const float* w = reinterpret_cast<const float*>(weights);
        for (size_t e = 0; e < elems; e += std::max<size_t>(1, elems / 64))
          if (w[e] != expect)
            throw std::runtime_error("ps: element " + std::to_string(e) + " is " + std::to_string(w[e]) +
                                     " after the first step, want " + std::to_string(expect));
        _c.barrier(kTimeoutMs);
      }
      if (s > warm) samples.push_back(us_since(t0, t1));
    }
    _c.barrier(kTimeoutMs);
    return _rank == 0 ? samples : std::vector<double>{};
  }

  std::vector<double> pipeline(bool notify, size_t n, long warm, long iters) {
    hcomm_context_t* c = _c.get();
    const int prev = _rank - 1, next = _rank + 1 < _size ? _rank + 1 : -1, last = _size - 1;
    const int mb = _o.microbatches;
    // slots (2 x n, written by the previous stage) | flags: notify[2], credit | our activation (n)
    const uint64_t flag_off = (2 * n + 63) & ~uint64_t{63}, credit_off = flag_off + 16;
    hcomm::Memory m = _c.alloc(flag_off + 64 + n, _o.mem_kind);
    std::memset(m.data(), 0, flag_off + 64 + n);
    std::vector<hcomm::RemoteKey> keys;
    exchange_keys(m, &keys);
    uint8_t* slots = m.as<uint8_t>();
    uint8_t* act = slots + flag_off + 64;
    auto credit = std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(slots + credit_off));
    uint64_t* credit_src = reinterpret_cast<uint64_t*>(slots + credit_off + 8);  // registered 8-byte source
    std::vector<double> samples;
    uint64_t seq = 0;  // micro-batches handed on so far (monotonic over runs)
    const uint64_t tag = kTagBase | 3;
    _c.barrier(kTimeoutMs);
    for (long it = 0; it < warm + iters; ++it) {
      auto t0 = Clock::now();
      for (int i = 0; i < mb; ++i) {
        const uint64_t k = seq + static_cast<uint64_t>(i);  // this micro-batch's number
        const uint8_t* out = act;
        if (prev >= 0) {
          if (notify) {
            hcomm::check(hcomm_notify_wait(c, m.get(), flag_off + 8 * (k % 2), k + 1, kTimeoutMs), "pipe wait");
            out = slots + (k % 2) * n;  // forward straight from the slot
          } else {
            hcomm::check(hcomm_recv(c, prev, act, n, tag, HCOMM_TAG_MASK_ALL, nullptr, kTimeoutMs), "pipe recv");
          }
        }
        if (next >= 0) {
          if (notify) {
            // Slot k % 2 at the next stage is free once it returned the credit of k - 2.
            if (k >= 2) spin_until(credit, k - 1);
            hcomm::check(hcomm_put_notify(c, out, n, keys[next].get(), (k % 2) * n, keys[next].get(),
                                          flag_off + 8 * (k % 2), k + 1, kTimeoutMs), "pipe put_notify");
          } else {
            hcomm::check(hcomm_send(c, next, out, n, tag, kTimeoutMs), "pipe send");
          }
        }
        if (notify && prev >= 0) {
          *credit_src = k + 1;
          hcomm::check(hcomm_put(c, credit_src, 8, keys[prev].get(), credit_off, kTimeoutMs), "pipe credit");
        }
      }
      seq += static_cast<uint64_t>(mb);
      uint64_t ack = 0;
      if (_rank == last) hcomm::check(hcomm_send(c, 0, &ack, 8, tag + 1, kTimeoutMs), "pipe ack");
      if (_rank == 0) hcomm::check(hcomm_recv(c, last, &ack, 8, tag + 1, HCOMM_TAG_MASK_ALL, nullptr, kTimeoutMs), "pipe ack");
      auto t1 = Clock::now();
      if (it >= warm) samples.push_back(us_since(t0, t1) / mb);
    }
    _c.barrier(kTimeoutMs);
    return _rank == 0 ? samples : std::vector<double>{};
  }

  hcomm::Context& _c;
  const Options& _o;
  int _rank = 0, _size = 1, _peer = 1;
  size_t _max = 0;
  static constexpr uint64_t kSpinWord = 4096;
  uint64_t _flags = 0;
  uint64_t _tests_run = 0;  // --passive spin: the value that ends the target's poll
  uint64_t _key_seq = 0;
  hcomm::Memory _mem;
  std::vector<hcomm::RemoteKey> _key;
};

std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

// `transport`: what serves rank 0's measured peer, rank 1 (hcomm_peer_transport).
void emit(FILE* f, const Options& o, const std::string& engine, int ranks, const std::string& transport,
          const std::vector<Result>& rs) {
  if (o.format == "json") {
    std::fprintf(f, "{\"tool\":\"hcomm-bench\",\"engine\":\"%s\",\"ranks\":%d,\"transport\":\"%s\",\"window\":%d,"
                 "\"mem\":\"%s\",\"results\":[",
                 engine.c_str(), ranks, transport.c_str(), o.window, o.mem_kind == HCOMM_MEM_HOST ? "host" : "device");
    for (size_t i = 0; i < rs.size(); ++i) {
      const Result& r = rs[i];
      std::fprintf(f,
                   "%s\n {\"test\":\"%s\",\"mode\":\"%s\",\"bytes\":%zu,\"iters\":%ld,\"window\":%d,"
                   "\"p50_us\":%.4f,\"p99_us\":%.4f,\"avg_us\":%.4f,\"min_us\":%.4f,\"mbps\":%.2f,\"mops\":%.5f}",
                   i ? "," : "", r.test.c_str(), r.mode.c_str(), r.size, r.iters, r.window, r.lat.p50, r.lat.p99,
                   r.lat.avg, r.lat.min, r.mbps, r.mrate);
    }
    std::fprintf(f, "\n]}\n");
  } else if (o.format == "csv") {
    std::fprintf(f, "impl,engine,test,mode,bytes,iters,window,p50_us,p99_us,avg_us,min_us,mbps,mops\n");
    for (const Result& r : rs)
      std::fprintf(f, "hcomm,%s,%s,%s,%zu,%ld,%d,%.4f,%.4f,%.4f,%.4f,%.2f,%.5f\n", engine.c_str(), r.test.c_str(),
                   r.mode.c_str(), r.size, r.iters, r.window, r.lat.p50, r.lat.p99, r.lat.avg, r.lat.min, r.mbps,
                   r.mrate);
  } else {
    std::fprintf(f, "# hcomm-bench: engine %s, %d ranks, rank 1 served by %s, window %d, %s memory\n", engine.c_str(),
                 ranks, transport.c_str(), o.window, o.mem_kind == HCOMM_MEM_HOST ? "host" : "device");
    std::fprintf(f, "# lat: usec per operation (bw rows: per operation inside a window); MB/s = 1e6 B/s at the median\n");
    std::fprintf(f, "+------------+------+-----------+--------+--------+------------+------------+------------+------------+----------+\n");
    std::fprintf(f, "| %-10s | %-4s | %9s | %6s | %6s | %10s | %10s | %10s | %10s | %8s |\n", "test", "mode", "bytes",
                 "iters", "window", "p50 us", "p99 us", "avg us", "MB/s", "Mops/s");
    std::fprintf(f, "+------------+------+-----------+--------+--------+------------+------------+------------+------------+----------+\n");
    for (const Result& r : rs)
      std::fprintf(f, "| %-10s | %-4s | %9zu | %6ld | %6d | %10s | %10s | %10s | %10s | %8s |\n", r.test.c_str(),
                   r.mode.c_str(), r.size, r.iters, r.window, fmt("%.3f", r.lat.p50).c_str(),
                   fmt("%.3f", r.lat.p99).c_str(), fmt("%.3f", r.lat.avg).c_str(), fmt("%.1f", r.mbps).c_str(),
                   fmt("%.4f", r.mrate).c_str());
    std::fprintf(f, "+------------+------+-----------+--------+--------+------------+------------+------------+------------+----------+\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hcomm-bench: %s\n", e.what());
    usage(stderr);
    return 2;
  }
  try {
    hcomm::Context ctx;
    std::vector<Result> rs;
    {
      Bench b(ctx, o);
      rs = b.run();
    }
    if (ctx.rank() == 0) {
      FILE* f = stdout;
      if (!o.output.empty() && (f = std::fopen(o.output.c_str(), "w")) == nullptr) {
        std::fprintf(stderr, "hcomm-bench: cannot write %s: %s\n", o.output.c_str(), std::strerror(errno));
        return 1;
      }
      const char* tr = ctx.size() > 1 ? hcomm_peer_transport(ctx.get(), 1) : nullptr;
      emit(f, o, ctx.engine(), ctx.size(), tr != nullptr ? tr : "-", rs);
      if (f != stdout) std::fclose(f);
      else std::fflush(stdout);
    }
    ctx.finalize();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hcomm-bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
