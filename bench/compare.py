#!/usr/bin/python3
"""compare.py: hcomm next to its peers, measured in one run on this machine.

Runs, one after another (never two at once):
  * hcomm-bench on the host engine (HCOMM_ENGINE=host, hcomm-run -n 2), with the hot memcpy,
  * hcomm-bench on the simulated NPU engine (hcomm-run -n 2 --sim, HCOMM_ENGINE=npu),
  * ucx_perftest (Debian ucx-utils) over loopback 127.0.0.1, UCX_TLS=posix,self,cma:
    tag_lat, tag_bw, ucp_put_lat, ucp_put_bw, ucp_get, ucp_fadd,
  * bench/mpi_bench under Open MPI's mpirun -n 2 (point-to-point, RMA, allreduce, allgather),
then prints ratios hcomm / peer per operation and size, checks the targets of issue 4, and writes
results.csv, ratios.md and compare.png into --out.

Every ratio is a ratio of TIMES (median time per operation, or per step), so < 1 means hcomm is
faster, whatever the mode: for bandwidth rows the time is the median window time / window.

  bench/compare.py [--build build-bench] [--sizes 8,64,...] [--scale 0.3] [--repeat 3] [--out build-bench/compare]
Needs: python3 (and python3-matplotlib for the PNG; without it the plot is skipped).
"""
import argparse
import csv
import io
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

FIELDS = ["impl", "engine", "test", "mode", "bytes", "iters", "window", "p50_us", "p99_us", "avg_us", "min_us", "mbps",
          "mops"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def lat_iters(n, scale):
    return max(2, int(round(min(10000, max(20, (256 << 20) / n)) * scale)))


def bw_windows(n, window, scale):
    return max(2, int(round(min(1000, max(10, (1 << 30) / (n * window))) * scale)))


def read_csv(path):
    with open(path) as f:
        return [dict(r) for r in csv.DictReader(f)]


def run_hcomm(a, engine, tests, out):
    cmd = [os.path.join(a.build, "tools", "hcomm-run"), "-n", "2", "--timeout", "1200"]
    if engine == "npu":
        cmd.append("--sim")
    cmd += ["--", os.path.join(a.build, "tools", "hcomm-bench"), "-t", tests, "-s", a.sizes, "-w", str(a.window),
            "--scale", str(a.scale), "--csv", "-o", out]
    log("+ HCOMM_ENGINE=%s %s" % (engine, " ".join(cmd)))
    subprocess.run(cmd, env=dict(os.environ, HCOMM_ENGINE=engine), check=True, stdout=subprocess.DEVNULL)
    rows = read_csv(out)
    for r in rows:
        if r["test"] == "memcpy":
            r["impl"], r["engine"] = "memcpy", "cpu"
        else:
            r["impl"] = "hcomm-" + engine
    return rows


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


UCX_TESTS = [  # (ucx test, hcomm test, mode)
    ("tag_lat", "send_recv", "lat"),
    ("tag_bw", "send_recv", "bw"),
    ("ucp_put_lat", "put", "lat"),
    ("ucp_put_bw", "put", "bw"),
    ("ucp_get", "get", "bw"),
    ("ucp_fadd", "fetch_add", "bw"),
]


def run_ucx(a, sizes):
    exe = shutil.which("ucx_perftest")
    if exe is None:
        log("ucx_perftest not found (apt-get install ucx-utils): UCX skipped")
        return []
    env = dict(os.environ, UCX_TLS="posix,self,cma")
    rows = []
    for ut, test, mode in UCX_TESTS:
        for n in ([8] if test == "fetch_add" else sizes):
            iters = lat_iters(n, a.scale) if mode == "lat" else bw_windows(n, a.window, a.scale) * a.window
            warm = max(2, iters // 10)
            port = free_port()
            srv = subprocess.Popen([exe, "-p", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                out = ""
                for _ in range(50):  # the server needs a moment to listen
                    time.sleep(0.1)
                    p = subprocess.run([exe, "127.0.0.1", "-p", str(port), "-t", ut, "-s", str(n), "-n", str(iters),
                                        "-w", str(warm), "-f", "-v"], env=env, capture_output=True, text=True,
                                       timeout=600)
                    if p.returncode == 0:
                        out = p.stdout
                        break
                srv.wait(timeout=60)
            finally:
                if srv.poll() is None:
                    srv.kill()
                    srv.wait()
            lines = [l.strip() for l in out.splitlines() if l.strip()[:1].isdigit()]
            if not lines:
                log("ucx_perftest %s -s %d gave no result" % (ut, n))
                continue
            f = [float(x) for x in lines[-1].split(",")]
            # iterations, p50 lat, avg lat, overall lat, avg bw, overall bw (MB/s = 2^20 B/s), avg mr, overall mr
            # bw tests: mean time per operation (UCX gives no median), from the
            # overall message rate (ops/s, printed whole: the overall latency
            # column has 1 ns resolution, 10 % of an 8-byte put)
            p50 = f[1] if mode == "lat" else (1e6 / f[7] if f[7] > 0 else f[3])
            rows.append(dict(impl="ucx", engine="posix,self,cma", test=test, mode=mode, bytes=str(n), iters=str(iters),
                             window="1", p50_us="%.4f" % p50, p99_us="", avg_us="%.4f" % f[2], min_us="",
                             mbps="%.2f" % (n / p50 if p50 > 0 else 0), mops="%.5f" % (1 / p50 if p50 > 0 else 0)))
            if ut in ("ucp_put_bw", "ucp_get"):  # put_nbx / get_nbx with no request: hcomm's _nbi windows
                rows.append(dict(rows[-1], test=test + "_nbi"))
            log("  ucx %-11s %9d B  %.3f us" % (ut, n, p50))
    return rows


def run_mpi(a, out):
    exe = os.path.join(a.build, "bench", "mpi_bench")
    mpirun = shutil.which("mpirun")
    if not os.path.exists(exe) or mpirun is None:
        log("mpi_bench or mpirun missing (apt-get install libopenmpi-dev openmpi-bin; rebuild): Open MPI skipped")
        return []
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")
    cmd = [mpirun, "-n", "2", "--bind-to", "none", exe, "-s", a.sizes, "-w", str(a.window), "--scale", str(a.scale),
           "-o", out]
    log("+ " + " ".join(cmd))
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return read_csv(out)


def fmt_size(n):
    return "%dM" % (n >> 20) if n >= 1 << 20 and n % (1 << 20) == 0 else "%dK" % (n >> 10) if n >= 1024 and n % 1024 == 0 else str(n)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build-bench"))
    ap.add_argument("--sizes", default="8,64,512,4K,32K,256K,1M,4M,16M")
    ap.add_argument("--scale", type=float, default=0.3, help="multiplies the adaptive iteration counts")
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(ROOT, "build-bench", "compare"))
    ap.add_argument("--skip", default="", help="comma list of: npu,ucx,mpi")
    ap.add_argument("--repeat", type=int, default=3, help="runs of everything; each cell is the median over runs")
    a = ap.parse_args()
    skip = set(a.skip.split(",")) - {""}
    os.makedirs(a.out, exist_ok=True)
    sizes = []
    for s in a.sizes.split(","):
        m = {"K": 1 << 10, "M": 1 << 20}.get(s[-1], 1)
        sizes.append(int(s[:-1] if m > 1 else s) * m)

    runs = []
    for rep in range(a.repeat):
        log("== run %d of %d" % (rep + 1, a.repeat))
        rows = run_hcomm(a, "host", "all", os.path.join(a.out, "hcomm-host.%d.csv" % rep))
        if "npu" not in skip:
            rows += run_hcomm(a, "npu", "basic,workloads", os.path.join(a.out, "hcomm-npu.%d.csv" % rep))
        if "ucx" not in skip:
            rows += run_ucx(a, sizes)
        if "mpi" not in skip:
            rows += run_mpi(a, os.path.join(a.out, "mpi.%d.csv" % rep))
        runs.append(rows)
    # One row per (impl, test, mode, bytes): the median over the runs of each number.
    cells = {}
    for rows in runs:
        for r in rows:
            cells.setdefault((r["impl"], r["test"], r["mode"], r["bytes"]), []).append(r)
    rows = []
    for group in cells.values():
        r = dict(group[0])
        for k in ("p50_us", "p99_us", "avg_us", "min_us", "mbps", "mops"):
            v = sorted(float(g[k]) for g in group if g.get(k, "") != "")
            r[k] = "%.4f" % statistics.median(v) if v else ""
        rows.append(r)
    with open(os.path.join(a.out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in FIELDS})

    t = {}
    for r in rows:
        t[(r["impl"], r["test"], r["mode"], int(r["bytes"]))] = float(r["p50_us"])
    # Per run, for paired ratios: hcomm and its peers ran minutes apart at most within one run, so
    # a ratio taken inside each run, then the median over runs, is less at the mercy of a noisy
    # machine (a VM whose speed changes from minute to minute) than a ratio of two medians.
    per_run = []
    for rs in runs:
        d = {}
        for r in rs:
            d[(r["impl"], r["test"], r["mode"], int(r["bytes"]))] = float(r["p50_us"])
        per_run.append(d)

    def ratio(x, y):
        return "%.2f" % (x / y) if x is not None and y is not None and y > 0 else "-"

    out = io.StringIO()
    out.write("Ratios of median time per operation, hcomm / peer (< 1: hcomm faster).\n")
    out.write("host = hcomm host engine; npu = hcomm simulated-NPU engine; memcpy = hot memcpy of the same size.\n\n")
    out.write("| test | mode | bytes | host us | host/memcpy | host/UCX | host/MPI | npu us | npu/host | npu/UCX | npu/MPI |\n")
    out.write("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    keys = sorted({(k[1], k[2], k[3]) for k in t if k[0].startswith("hcomm")},
                  key=lambda k: (["send_recv", "put", "get", "acc", "put_notify", "fetch_add", "put_nbi", "get_nbi",
                                  "ps", "pipe_sr", "pipe_pn"].index(k[0]), k[1], k[2]))
    peer_test = {"ps": "allreduce", "pipe_sr": "allgather", "pipe_pn": "allgather"}
    for test, mode, n in keys:
        h = t.get(("hcomm-host", test, mode, n))
        nn = t.get(("hcomm-npu", test, mode, n))
        mc = t.get(("memcpy", "memcpy", mode, n)) if test in ("put", "get", "send_recv", "put_notify", "acc", "put_nbi",
                                                               "get_nbi") else None
        u = t.get(("ucx", test, mode, n))
        m = t.get(("mpi", peer_test.get(test, test), mode, n))
        out.write("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n" % (
            test + (" (MPI: %s)" % peer_test[test] if test in peer_test else ""), mode, fmt_size(n),
            "%.3f" % h if h else "-", ratio(h, mc), ratio(h, u), ratio(h, m), "%.3f" % nn if nn else "-",
            ratio(nn, h), ratio(nn, u), ratio(nn, m)))
    # The pipeline against Open MPI's own send/recv hand-off, for reference.
    for test in ("pipe_sr", "pipe_pn"):
        for n in sizes:
            h, m = t.get(("hcomm-host", test, "step", n)), t.get(("mpi", "pipe_sr", "step", n))
            if h and m:
                out.write("| %s (MPI: pipe_sr) | step | %s | %.3f | - | - | %s | - | - | - | - |\n" % (
                    test, fmt_size(n), h, ratio(h, m)))

    # Targets (issue 4), at 1 MiB and 8 B.
    M = 1 << 20

    class Cell:  # one measured number: the cross-run median, and each run's own
        def __init__(self, k):
            self.all = t.get(k)
            self.runs = [d.get(k) for d in per_run]

    g = lambda *k: Cell(k)
    checks = []

    def target(name, x, limit):
        if x is None:
            checks.append("| %s | - | - | %s | not measured |" % (name, limit))
        else:
            paired, of_medians = x
            checks.append("| %s | %.2f | %.2f | %s | %s |" % (name, paired, of_medians, limit,
                                                            "met" if paired <= limit else "MISSED"))

    def div(x, y):
        # (median over runs of the ratio inside each run, ratio of the medians)
        if x.all is None or not y.all:
            return None
        pairs = [a / b for a, b in zip(x.runs, y.runs) if a is not None and b]
        return (statistics.median(pairs) if pairs else x.all / y.all, x.all / y.all)

    for op in ("put", "get"):
        target("host %s 1 MiB bw / memcpy" % op, div(g("hcomm-host", op, "bw", M), g("memcpy", "memcpy", "bw", M)), 1.1)
        target("host %s 1 MiB bw / UCX" % op, div(g("hcomm-host", op, "bw", M), g("ucx", op, "bw", M)), 1.0)
    target("host send_recv 1 MiB bw / put bw", div(g("hcomm-host", "send_recv", "bw", M), g("hcomm-host", "put", "bw", M)), 1.3)
    for op, mode in (("put", "lat"), ("get", "bw"), ("send_recv", "lat")):
        target("host %s 8 B %s / UCX" % (op, mode), div(g("hcomm-host", op, mode, 8), g("ucx", op, mode, 8)), 1.0)
    target("host get 8 B lat (blocking call) / UCX ucp_get per-op", div(g("hcomm-host", "get", "lat", 8), g("ucx", "get", "bw", 8)), 1.0)
    target("host acc fp32 1 MiB bw / put bw", div(g("hcomm-host", "acc", "bw", M), g("hcomm-host", "put", "bw", M)), 1.5)
    for op in ("put", "get", "send_recv", "acc"):
        target("npu %s 1 MiB bw / host" % op, div(g("hcomm-npu", op, "bw", M), g("hcomm-host", op, "bw", M)), 1.3)
    # Issue 12 (the small-message fast path), on the host engine against UCX posix,self,cma.
    for op in ("put", "send_recv"):
        target("host %s 8 B lat / UCX [12]" % op, div(g("hcomm-host", op, "lat", 8), g("ucx", op, "lat", 8)), 1.0)
    for n in (8, 64, 512, 4096):
        if n not in sizes:
            continue
        for op in ("put_nbi", "get_nbi", "send_recv"):
            target("host %s %s windowed / UCX [12]" % (op, fmt_size(n)),
                   div(g("hcomm-host", op, "bw", n), g("ucx", op, "bw", n)), 1.0)
        for op in ("put", "get"):
            target("host %s %s windowed, with requests / UCX [12]" % (op, fmt_size(n)),
                   div(g("hcomm-host", op, "bw", n), g("ucx", op, "bw", n)), 1.0)
    target("host fetch_add windowed / UCX ucp_fadd [12]", div(g("hcomm-host", "fetch_add", "bw", 8), g("ucx", "fetch_add", "bw", 8)), 1.0)
    out.write("\nTargets (time ratios; limit = the issue's bound; [12]: issue 12's). Verdict on the paired ratio: the "
              "median over runs of the ratio inside each run; the ratio of the medians beside it:\n\n"
              "| target | paired ratio | ratio of medians | limit | verdict |\n|---|---:|---:|---:|---|\n")
    out.write("\n".join(checks) + "\n")
    text = out.getvalue()
    print(text)
    with open(os.path.join(a.out, "ratios.md"), "w") as f:
        f.write(text)

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("python3-matplotlib missing: no plot")
        return
    fig, ax = plt.subplots(1, 2, figsize=(14, 5.5))
    series = [("hcomm-host", "-"), ("hcomm-npu", "--"), ("ucx", ":"), ("mpi", "-."), ("memcpy", "-")]
    colors = {"send_recv": "C0", "put": "C1", "get": "C2", "acc": "C3", "memcpy": "k"}
    for impl, ls in series:
        for test in ("send_recv", "put", "get", "acc", "memcpy"):
            for k, mode in ((0, "lat"), (1, "bw")):
                pts = sorted((key[3], v) for key, v in t.items() if key[0] == impl and key[1] == test and key[2] == mode)
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                ys = [p[1] if mode == "lat" else p[0] / p[1] / 1e3 for p in pts]  # bw in GB/s
                ax[k].plot(xs, ys, ls, color=colors[test], marker=".", label="%s %s" % (impl, test))
    ax[0].set(xscale="log", yscale="log", xlabel="bytes", ylabel="median latency, us", title="latency (lower is better)")
    ax[1].set(xscale="log", xlabel="bytes", ylabel="GB/s (median window)", title="bandwidth, window %d" % a.window)
    for x in ax:
        x.grid(True, which="both", alpha=0.3)
    ax[1].legend(fontsize=6, ncol=2)
    fig.suptitle("hcomm vs UCX (posix,self,cma) vs Open MPI, 2 ranks on this machine")
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "compare.png"), dpi=110)
    log("wrote %s" % os.path.join(a.out, "compare.png"))


if __name__ == "__main__":
    main()
