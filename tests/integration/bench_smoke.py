#!/usr/bin/env python3
"""Smoke test of hcomm-bench: runs it under hcomm-run for a couple of sizes and
checks that the machine-readable output parses and covers what was asked.
No timing is asserted: the numbers only have to be present and finite.

  bench_smoke.py HCOMM_RUN HCOMM_BENCH [--engine host|npu] [--tests LIST] [--sizes LIST]
                 [--extra "OPTIONS"]   (more hcomm-bench options, e.g. "--passive spin")
"""
import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile

FIELDS = ["test", "mode", "bytes", "iters", "window", "p50_us", "p99_us", "avg_us", "min_us", "mbps", "mops"]


def run(args, fmt, out):
    cmd = [args.run, "-n", str(args.ranks), "--timeout", "240"]
    if args.engine == "npu":
        cmd.append("--sim")
    cmd += ["--", args.bench, "-t", args.tests, "-s", args.sizes, "--scale", "0.01", "-w", "4",
            "--" + fmt, "-o", out] + args.extra.split()
    env = dict(os.environ, HCOMM_ENGINE=args.engine)
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    if p.returncode != 0:
        sys.exit("FAIL: %s exited %d\n%s" % (" ".join(cmd), p.returncode, p.stdout))


def check_rows(rows, args, fmt):
    want_tests = set(args.tests.split(","))
    seen = set()
    for r in rows:
        for f in FIELDS:
            if f not in r:
                sys.exit("FAIL (%s): row without %s: %r" % (fmt, f, r))
        for f in FIELDS[2:]:
            v = float(r[f])
            if not math.isfinite(v) or v < 0:
                sys.exit("FAIL (%s): %s=%r in %r" % (fmt, f, r[f], r))
        if float(r["p50_us"]) <= 0:
            sys.exit("FAIL (%s): no samples in %r" % (fmt, r))
        seen.add(r["test"])
    if seen != want_tests:
        sys.exit("FAIL (%s): tests %s in the output, asked for %s" % (fmt, sorted(seen), sorted(want_tests)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("bench")
    ap.add_argument("--engine", default="host")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tests", default="send_recv,put,get,acc,put_notify,fetch_add,memcpy,ps,pipe_sr,pipe_pn")
    ap.add_argument("--sizes", default="8,64K")
    ap.add_argument("--extra", default="")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "bench.json")
        run(args, "json", out)
        with open(out) as f:
            doc = json.load(f)
        if doc.get("tool") != "hcomm-bench" or doc.get("engine") != args.engine or doc.get("ranks") != args.ranks:
            sys.exit("FAIL: header %r" % {k: v for k, v in doc.items() if k != "results"})
        check_rows(doc["results"], args, "json")
        out = os.path.join(d, "bench.csv")
        run(args, "csv", out)
        with open(out) as f:
            rows = list(csv.DictReader(f))
        check_rows(rows, args, "csv")
        if any(r["impl"] != "hcomm" or r["engine"] != args.engine for r in rows):
            sys.exit("FAIL: csv impl/engine columns")
    print("ok: hcomm-bench %s engine, %d rows" % (args.engine, len(rows)))


if __name__ == "__main__":
    main()
