"""What bench/compare_rdma.sh's tables read from run-rdma.sh's console: the
perftest / ucx_perftest client rows (HCOMM-PERF NAME client FIELDS...) and
hcomm-bench's JSON, one HCOMM-BENCH NAME line per line of it."""


def read(path):
    perf, bench = {}, {}
    for l in open(path, errors="replace").read().splitlines():
        f = l.split()
        if len(f) > 3 and f[0] == "HCOMM-PERF" and f[2] == "client":
            perf[f[1]] = f[3:]
        elif len(f) > 2 and f[0] == "HCOMM-BENCH":
            bench.setdefault(f[1], []).append(l.split(" ", 2)[2])
    return perf, bench
