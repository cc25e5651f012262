/*
 * mpi_bench: the Open MPI counterparts of hcomm-bench, measured the same way
 * (same sizes, iteration counts, window, percentiles, CSV columns), so that
 * bench/compare.py can print hcomm / MPI ratios.
 *
 *   mpirun -n 2 bench/mpi_bench [-t LIST] [-s SIZES] [-w WINDOW] [--scale F] [-o FILE]
 *
 * Tests (rank 0 initiates, rank 1 is the target; passive-target RMA in one
 * MPI_Win_lock_all epoch over an MPI_Win_allocate window):
 *   send_recv lat   MPI_Send/MPI_Recv ping-pong, RTT / 2
 *   send_recv bw    window of MPI_Isend / pre-posted MPI_Irecv + 8-byte ack (osu_bw)
 *   put lat         ping-pong of MPI_Put + MPI_Win_flush, the target polls the
 *                   last 8 bytes of its window (MPI_Win_sync), RTT / 2
 *   get, acc (MPI_Accumulate MPI_FLOAT MPI_SUM), fetch_add (MPI_Fetch_and_op
 *                   MPI_UINT64_T MPI_SUM) lat: one operation + MPI_Win_flush
 *   put, get, acc, fetch_add bw: window of operations, then MPI_Win_flush
 *   allreduce       data-parallel step: MPI_Allreduce of `size` bytes of fp32
 *                   (counterpart of hcomm-bench ps)
 *   allgather       MPI_Allgather of `size` bytes per rank (counterpart of the
 *                   pipeline hand-off, pipe_sr / pipe_pn)
 *   pipe_sr         the pipeline hand-off with MPI_Send/MPI_Recv, 16
 *                   micro-batches per sample (as hcomm-bench pipe_sr)
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { kMaxSizes = 64, kMicro = 16 };

static int g_rank, g_size, g_window = 32;
static double g_scale = 1.0;
static size_t g_sizes[kMaxSizes];
static int g_nsizes;
static char g_tests[512] = "send_recv,put,get,acc,fetch_add,allreduce,allgather,pipe_sr";
static unsigned char* g_base; /* the window: [0,max) written by the peer, [max,2max) local, then flags */
static size_t g_max;
static MPI_Win g_win;

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}

typedef struct {
  double p50, p99, avg, min;
} stats_t;

static stats_t stats_of(double* v, long n) {
  stats_t s = {0, 0, 0, 0};
  if (n <= 0) return s;
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  long i50 = (long)((50.0 / 100.0) * (double)n + 0.999999) - 1, i99 = (long)((99.0 / 100.0) * (double)n + 0.999999) - 1;
  s.p50 = v[i50 < 0 ? 0 : i50];
  s.p99 = v[i99 < 0 ? 0 : (i99 >= n ? n - 1 : i99)];
  s.min = v[0];
  double sum = 0;
  for (long k = 0; k < n; ++k) sum += v[k];
  s.avg = sum / (double)n;
  return s;
}

static long clampl(double v, double lo, double hi) { return (long)(v < lo ? lo : v > hi ? hi : v); }
static long lat_iters(size_t n) {
  long it = (long)(clampl((double)(256u << 20) / (double)n, 20, 10000) * g_scale + 0.5);
  return it < 2 ? 2 : it;
}
static long bw_windows(size_t n) {
  long it = (long)(clampl((double)(1u << 30) / ((double)n * g_window), 10, 1000) * g_scale + 0.5);
  return it < 2 ? 2 : it;
}
static long warm_of(long iters) { return iters / 10 < 2 ? 2 : iters / 10; }

static FILE* g_out;
static void emit(const char* test, const char* mode, size_t n, long iters, int window, stats_t s, double ops) {
  if (g_rank != 0) return;
  double mbps = s.p50 > 0 ? (double)n * ops / s.p50 : 0, mops = s.p50 > 0 ? ops / s.p50 : 0;
  fprintf(g_out, "mpi,ompi,%s,%s,%zu,%ld,%d,%.4f,%.4f,%.4f,%.4f,%.2f,%.5f\n", test, mode, n, iters, window,
          s.p50 / ops, s.p99 / ops, s.avg / ops, s.min / ops, mbps, mops);
  fflush(g_out);
}

static int has_test(const char* t) {
  size_t l = strlen(t);
  for (const char* p = g_tests; (p = strstr(p, t)) != NULL; p += l)
    if ((p == g_tests || p[-1] == ',') && (p[l] == ',' || p[l] == '\0')) return 1;
  return 0;
}

static void spin_word(volatile uint64_t* w, uint64_t v) {
  int k = 0;
  while (*w < v) {
    MPI_Win_sync(g_win);
    if ((++k & 63) == 0) {
      int flag;
      MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &flag, MPI_STATUS_IGNORE);
    }
  }
}

static void lat_test(const char* t, size_t n) {
  long iters = lat_iters(n), warm = warm_of(iters);
  double* v = calloc((size_t)iters, sizeof *v);
  int peer = g_rank == 0 ? 1 : 0, init = g_rank == 0, target = g_rank == 1;
  unsigned char* local = g_base + g_max;
  uint64_t old = 0, one = 1;
  if (!strcmp(t, "acc")) {
    for (size_t k = 0; k < n / 4; ++k) ((float*)local)[k] = 1.0f, ((float*)g_base)[k] = 0.0f;
  }
  volatile uint64_t* seen = (volatile uint64_t*)(g_base + n - 8);
  if (!strcmp(t, "put")) *seen = 0;
  MPI_Win_sync(g_win);
  MPI_Barrier(MPI_COMM_WORLD);
  for (long i = 0; i < warm + iters && (init || target); ++i) {
    double t0 = now_us(), d = 0;
    if (!strcmp(t, "send_recv")) {
      if (init) {
        MPI_Send(local, (int)n, MPI_BYTE, peer, 1, MPI_COMM_WORLD);
        MPI_Recv(g_base, (int)n, MPI_BYTE, peer, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      } else {
        MPI_Recv(g_base, (int)n, MPI_BYTE, peer, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Send(local, (int)n, MPI_BYTE, peer, 1, MPI_COMM_WORLD);
      }
      d = (now_us() - t0) / 2;
    } else if (!strcmp(t, "put")) {
      uint64_t seq = (uint64_t)i + 1;
      if (target) spin_word(seen, seq);
      memcpy(local + n - 8, &seq, 8);
      MPI_Put(local, (int)n, MPI_BYTE, peer, 0, (int)n, MPI_BYTE, g_win);
      MPI_Win_flush(peer, g_win);
      if (init) spin_word(seen, seq);
      d = (now_us() - t0) / 2;
    } else if (init) {
      if (!strcmp(t, "get")) MPI_Get(local, (int)n, MPI_BYTE, peer, 0, (int)n, MPI_BYTE, g_win);
      else if (!strcmp(t, "acc"))
        MPI_Accumulate(local, (int)(n / 4), MPI_FLOAT, peer, 0, (int)(n / 4), MPI_FLOAT, MPI_SUM, g_win);
      else MPI_Fetch_and_op(&one, &old, MPI_UINT64_T, peer, (MPI_Aint)(2 * g_max + 16), MPI_SUM, g_win);
      MPI_Win_flush(peer, g_win);
      d = now_us() - t0;
    } else {
      break;
    }
    if (i >= warm) v[i - warm] = d;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  emit(t, "lat", n, iters, 1, stats_of(v, iters), 1);
  free(v);
}

static void bw_test(const char* t, size_t n) {
  long iters = bw_windows(n), warm = warm_of(iters);
  int win = g_window, peer = g_rank == 0 ? 1 : 0, init = g_rank == 0, target = g_rank == 1;
  double* v = calloc((size_t)iters, sizeof *v);
  MPI_Request* reqs = calloc((size_t)win, sizeof *reqs);
  unsigned char* local = g_base + g_max;
  uint64_t one = 1, *olds = calloc((size_t)win, sizeof *olds);
  if (!strcmp(t, "acc")) {
    for (size_t k = 0; k < n / 4; ++k) ((float*)local)[k] = 1.0f, ((float*)g_base)[k] = 0.0f;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  for (long i = 0; i < warm + iters; ++i) {
    double t0 = now_us();
    if (!strcmp(t, "send_recv")) {
      if (!init && !target) break;
      uint64_t ack = 0;
      if (init) {
        for (int k = 0; k < win; ++k) MPI_Isend(local, (int)n, MPI_BYTE, peer, 2, MPI_COMM_WORLD, &reqs[k]);
        MPI_Waitall(win, reqs, MPI_STATUSES_IGNORE);
        MPI_Recv(&ack, 8, MPI_BYTE, peer, 3, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      } else {
        for (int k = 0; k < win; ++k) MPI_Irecv(g_base, (int)n, MPI_BYTE, peer, 2, MPI_COMM_WORLD, &reqs[k]);
        MPI_Waitall(win, reqs, MPI_STATUSES_IGNORE);
        MPI_Send(&ack, 8, MPI_BYTE, peer, 3, MPI_COMM_WORLD);
      }
    } else {
      if (!init) break;
      for (int k = 0; k < win; ++k) {
        if (!strcmp(t, "put")) MPI_Put(local, (int)n, MPI_BYTE, peer, 0, (int)n, MPI_BYTE, g_win);
        else if (!strcmp(t, "get")) MPI_Get(local, (int)n, MPI_BYTE, peer, 0, (int)n, MPI_BYTE, g_win);
        else if (!strcmp(t, "acc"))
          MPI_Accumulate(local, (int)(n / 4), MPI_FLOAT, peer, 0, (int)(n / 4), MPI_FLOAT, MPI_SUM, g_win);
        else MPI_Fetch_and_op(&one, &olds[k], MPI_UINT64_T, peer, (MPI_Aint)(2 * g_max + 16), MPI_SUM, g_win);
      }
      MPI_Win_flush(peer, g_win);
    }
    if (i >= warm) v[i - warm] = now_us() - t0;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  emit(t, "bw", n, iters, win, stats_of(v, iters), win);
  free(v);
  free(reqs);
  free(olds);
}

static void step_test(const char* t, size_t n) {
  if (!strcmp(t, "allreduce") && (n % 4 != 0 || n / 4 < (size_t)g_size)) return;
  long iters = !strcmp(t, "pipe_sr") ? lat_iters(n * kMicro) : lat_iters(n), warm = warm_of(iters);
  double* v = calloc((size_t)iters, sizeof *v);
  unsigned char* a = malloc(n * (size_t)g_size + 64);
  unsigned char* b = malloc(n * (size_t)g_size + 64);
  for (size_t k = 0; k < n / 4; ++k) ((float*)a)[k] = (float)(g_rank + 1);
  memset(b, 0, n * (size_t)g_size);
  MPI_Barrier(MPI_COMM_WORLD);
  for (long i = 0; i < warm + iters; ++i) {
    double t0 = now_us(), d;
    if (!strcmp(t, "allreduce")) {
      MPI_Allreduce(a, b, (int)(n / 4), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      d = now_us() - t0;
    } else if (!strcmp(t, "allgather")) {
      MPI_Allgather(a, (int)n, MPI_BYTE, b, (int)n, MPI_BYTE, MPI_COMM_WORLD);
      d = now_us() - t0;
    } else {
      for (int m = 0; m < kMicro; ++m) {
        if (g_rank > 0) MPI_Recv(a, (int)n, MPI_BYTE, g_rank - 1, 4, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        if (g_rank + 1 < g_size) MPI_Send(a, (int)n, MPI_BYTE, g_rank + 1, 4, MPI_COMM_WORLD);
      }
      uint64_t ack = 0;
      if (g_rank == g_size - 1) MPI_Send(&ack, 8, MPI_BYTE, 0, 5, MPI_COMM_WORLD);
      if (g_rank == 0) MPI_Recv(&ack, 8, MPI_BYTE, g_size - 1, 5, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      d = (now_us() - t0) / kMicro;
    }
    if (i >= warm) v[i - warm] = d;
  }
  if (!strcmp(t, "allreduce") && ((float*)b)[0] != (float)(g_size * (g_size + 1) / 2)) {
    fprintf(stderr, "mpi_bench: allreduce gave %f\n", (double)((float*)b)[0]);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  emit(t, "step", n, iters, 1, stats_of(v, iters), 1);
  free(v);
  free(a);
  free(b);
}

static size_t parse_size(const char* s) {
  char* end;
  size_t v = (size_t)strtoull(s, &end, 10);
  if (*end == 'K' || *end == 'k') v <<= 10;
  else if (*end == 'M' || *end == 'm') v <<= 20;
  return v;
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  const char* out = NULL;
  char sizes[512] = "8,64,512,4K,32K,256K,1M,4M,16M";
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "-t") && i + 1 < argc) snprintf(g_tests, sizeof g_tests, "%s", argv[++i]);
    else if (!strcmp(argv[i], "-s") && i + 1 < argc) snprintf(sizes, sizeof sizes, "%s", argv[++i]);
    else if (!strcmp(argv[i], "-w") && i + 1 < argc) g_window = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--scale") && i + 1 < argc) g_scale = atof(argv[++i]);
    else if (!strcmp(argv[i], "-o") && i + 1 < argc) out = argv[++i];
    else {
      if (g_rank == 0) fprintf(stderr, "usage: mpi_bench [-t LIST] [-s SIZES] [-w WINDOW] [--scale F] [-o FILE]\n");
      MPI_Finalize();
      return 2;
    }
  }
  if (g_size < 2 || g_window < 1) {
    if (g_rank == 0) fprintf(stderr, "mpi_bench: needs 2 ranks and a window >= 1\n");
    MPI_Finalize();
    return 2;
  }
  for (char* tok = strtok(sizes, ","); tok != NULL && g_nsizes < kMaxSizes; tok = strtok(NULL, ","))
    if (parse_size(tok) > 0) g_sizes[g_nsizes++] = parse_size(tok);
  for (int i = 0; i < g_nsizes; ++i)
    if (g_sizes[i] > g_max) g_max = g_sizes[i];
  g_max = (g_max + 63) & ~(size_t)63;
  g_out = stdout;
  if (g_rank == 0 && out != NULL && (g_out = fopen(out, "w")) == NULL) {
    perror(out);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  if (g_rank == 0) fprintf(g_out, "impl,engine,test,mode,bytes,iters,window,p50_us,p99_us,avg_us,min_us,mbps,mops\n");
  MPI_Win_allocate((MPI_Aint)(2 * g_max + 64), 1, MPI_INFO_NULL, MPI_COMM_WORLD, &g_base, &g_win);
  memset(g_base, 0, 2 * g_max + 64);
  MPI_Win_lock_all(MPI_MODE_NOCHECK, g_win);
  static const char* basic[] = {"send_recv", "put", "get", "acc", "fetch_add"};
  for (unsigned b = 0; b < sizeof basic / sizeof basic[0]; ++b) {
    if (!has_test(basic[b])) continue;
    for (int i = 0; i < g_nsizes; ++i) {
      size_t n = g_sizes[i];
      if (!strcmp(basic[b], "fetch_add") && i > 0) break;
      if (!strcmp(basic[b], "fetch_add")) n = 8;
      if ((!strcmp(basic[b], "put") || !strcmp(basic[b], "acc")) && n < 8) continue;
      lat_test(basic[b], n);
      bw_test(basic[b], n);
    }
  }
  MPI_Win_unlock_all(g_win);
  static const char* steps[] = {"allreduce", "allgather", "pipe_sr"};
  for (unsigned s = 0; s < sizeof steps / sizeof steps[0]; ++s)
    if (has_test(steps[s]))
      for (int i = 0; i < g_nsizes; ++i) step_test(steps[s], g_sizes[i]);
  MPI_Win_free(&g_win);
  if (g_out != stdout) fclose(g_out);
  MPI_Finalize();
  return 0;
}
