#!/usr/bin/python3
"""The workloads hcomm exists for, against what PyTorch users would otherwise use (gloo), in one run.

  parameter server: one server and N workers train an MLP on synthetic data; workers pull the
      weights with Window.get and push gradients with Window.accumulate (notify words say when),
      the server applies SGD: samples/s, and the loss curve. Against DistributedDataParallel
      of the same model, seed, data split and learning rate on gloo (and, for reference, on hcomm).
  pipeline: a small transformer split in two stages hands activations forward with dist.send/recv
      (micro-batches) on hcomm and on gloo, and with an all_gather of activations on gloo:
      ms per step.

  PYTHONPATH=build-bench/python /usr/bin/python3 bench/torch_workloads.py --repeat 3 --out build-bench/torch

Prints a table (medians of --repeat runs; ratios against gloo) and writes OUT.json and OUT.png.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)


# ---- one rank ----------------------------------------------------------------------------------

def make_model(torch, seed, width):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 10))


def make_data(torch, steps, batch, seed):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(steps, batch, 256, generator=g)
    teacher = torch.randn(256, 10, generator=g)
    y = (torch.tanh(x) @ teacher).argmax(-1)
    return x, y


def rank_main(a):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    if a.backend == "hcomm":
        import hcomm.torch as ht
    torch.set_num_threads(1)
    dist.init_process_group(a.backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    result = {}
    if a.workload in ("ps", "ddp"):
        # ps: rank 0 is the server; with --colocated it is also worker 0 (as many processes as DDP)
        workers = n - 1 if a.workload == "ps" and not a.colocated else n
        first_worker = 1 if a.workload == "ps" and not a.colocated else 0
        model = make_model(torch, 0, a.width)
        x, y = make_data(torch, a.steps, a.batch * workers, 0)
        shard = lambda step, w: (x[step, w * a.batch:(w + 1) * a.batch], y[step, w * a.batch:(w + 1) * a.batch])
        losses = []
        if a.workload == "ddp":
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.SGD(ddp.parameters(), lr=a.lr)
            dist.barrier()
            t0 = time.perf_counter()
            for step in range(a.steps):
                xb, yb = shard(step, rank)
                opt.zero_grad()
                loss = F.cross_entropy(ddp(xb), yb)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            dist.barrier()
            took = time.perf_counter() - t0
        else:
            params = list(model.parameters())
            flat = torch.nn.utils.parameters_to_vector(params).detach()
            weights = ht.empty(flat.numel()).copy_(flat)          # the server's weights (every rank has one)
            grads = ht.empty(flat.numel()).zero_()                # the server's gradient sum
            ctl = ht.empty(n, dtype=torch.int64).zero_()          # notify words live in the windows
            ww, wg, wc = ht.Window(weights), ht.Window(grads), ht.Window(ctl)
            one = ht.empty(1, dtype=torch.int64).fill_(1)
            local = ht.empty(flat.numel())
            dist.barrier()
            t0 = time.perf_counter()
            def work(step):  # one worker's step: pull, compute, push, say so
                if rank != 0 and step > 0:
                    wc.notify_wait(0, step, timeout=120)              # the weights of this step are out
                ww.get(local, 0)                                      # pull the weights
                torch.nn.utils.vector_to_parameters(local, params)
                xb, yb = shard(step, rank - first_worker)
                model.zero_grad()
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                g = torch.nn.utils.parameters_to_vector([p.grad for p in params])
                wg.accumulate(g, 0, op=ht.SUM)                       # push the gradient
                wg.flush(0)                                           # complete at the server, then say so
                if rank != 0:
                    wc.put_notify(one, 0, offset=rank, value=step + 1)
                losses.append(loss.item())

            for step in range(a.steps):
                if rank >= first_worker:
                    work(step)
                if rank == 0:  # the server
                    for w in range(1, n):
                        wc.notify_wait(w, step + 1, timeout=120)      # worker w's gradient is in
                    weights.sub_(grads, alpha=a.lr / workers)
                    grads.zero_()
                    for w in range(1, n):
                        wc.put_notify(one, w, offset=0, value=step + 1)  # the weights of step+1 are out
            dist.barrier()
            took = time.perf_counter() - t0
            for w_ in (ww, wg, wc):
                w_.free()
        result = {"samples_per_s": a.steps * a.batch * workers / took, "losses": losses}
        # the first worker's shard (shard 0) reports its curve
        reporter = first_worker
        if rank == reporter:
            print("RESULT " + json.dumps(result), flush=True)
    else:  # pipeline: stage 0 -> stage 1
        torch.manual_seed(0)
        if a.layers > 0:
            stage = torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(a.dmodel, 4, 2 * a.dmodel, batch_first=True)
                                          for _ in range(a.layers)]).eval()
        else:  # handoff only: what moving the activations costs
            stage = torch.nn.Identity()
        mb = torch.randn(a.micro, a.seq, a.dmodel)
        act = torch.empty(a.micro, a.seq, a.dmodel)
        times = []
        with torch.no_grad():
            for it in range(a.warmup + a.steps):
                dist.barrier()
                t0 = time.perf_counter()
                reqs = []
                for m in range(a.micros):
                    if a.mode == "all_gather":
                        out = stage(mb) if rank == 0 else torch.zeros_like(mb)
                        got = [torch.empty_like(mb) for _ in range(n)]
                        dist.all_gather(got, out)
                        if rank == 1:
                            stage(got[0])
                    elif rank == 0:
                        out = stage(mb)
                        reqs.append(dist.isend(out.contiguous(), 1, tag=m))
                    else:
                        dist.recv(act, 0, tag=m)
                        stage(act)
                for q in reqs:
                    q.wait()
                dist.barrier()
                if it >= a.warmup:
                    times.append(time.perf_counter() - t0)
        if rank == 1:
            print("RESULT " + json.dumps({"ms_per_step": 1000 * statistics.median(times)}), flush=True)
    dist.destroy_process_group()


# ---- the driver -------------------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(n, args, timeout=600):
    port = free_port()
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), HCOMM_ENGINE=os.environ.get("HCOMM_ENGINE", "host"))
        procs.append(subprocess.Popen([sys.executable, HERE, "--rank-main"] + args, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, o in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError("a rank failed (%s):\n%s" % (args, o))
    for o in outs:
        for line in o.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[7:])
    raise RuntimeError("no result (%s):\n%s" % (args, "\n".join(outs)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", default="hcomm")
    ap.add_argument("--workload", default="ps")
    ap.add_argument("--mode", default="p2p")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--colocated", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=32, help="samples per worker and step")
    ap.add_argument("--width", type=int, default=1024, help="MLP hidden width (1024: 1.3 M parameters, 5 MiB)")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--dmodel", type=int, default=64)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=16, help="samples per micro-batch")
    ap.add_argument("--micros", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--layers", type=int, default=1, help="transformer layers per stage (0: handoff only)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="torch_workloads")
    a = ap.parse_args()
    if a.rank_main:
        return rank_main(a)
    common = ["--steps", str(a.steps), "--batch", str(a.batch), "--width", str(a.width), "--lr", str(a.lr)]
    pipe = ["--steps", "6", "--dmodel", str(a.dmodel), "--seq", str(a.seq), "--micro", str(a.micro),
            "--micros", str(a.micros), "--layers", str(a.layers), "--warmup", "1", "--workload", "pipeline"]
    # handoff only: 8 micro-batches of 4 MiB activations, no compute
    hand = ["--steps", "20", "--dmodel", "256", "--seq", "256", "--micro", "16", "--micros", "8", "--layers", "0",
            "--warmup", "3", "--workload", "pipeline"]
    configs = [
        ("ps", "hcomm parameter server (Window get/accumulate)", a.workers + 1,
         ["--backend", "hcomm", "--workload", "ps"] + common),
        ("ps", "hcomm parameter server on worker 0's process", a.workers,
         ["--backend", "hcomm", "--workload", "ps", "--colocated"] + common),
        ("ps", "gloo DistributedDataParallel", a.workers, ["--backend", "gloo", "--workload", "ddp"] + common),
        ("ps", "hcomm DistributedDataParallel", a.workers, ["--backend", "hcomm", "--workload", "ddp"] + common),
        ("pipe", "transformer: hcomm send/recv", 2, ["--backend", "hcomm", "--mode", "p2p"] + pipe),
        ("pipe", "transformer: gloo send/recv", 2, ["--backend", "gloo", "--mode", "p2p"] + pipe),
        ("pipe", "transformer: gloo all_gather", 2, ["--backend", "gloo", "--mode", "all_gather"] + pipe),
        ("pipe", "handoff only: hcomm send/recv", 2, ["--backend", "hcomm", "--mode", "p2p"] + hand),
        ("pipe", "handoff only: gloo send/recv", 2, ["--backend", "gloo", "--mode", "p2p"] + hand),
        ("pipe", "handoff only: gloo all_gather", 2, ["--backend", "gloo", "--mode", "all_gather"] + hand),
    ]
    results = {}
    for rep in range(a.repeat):  # interleaved, so a slow spell of the machine hits every row
        for kind, name, n, args in configs:
            r = run(n, args)
            results.setdefault(name, []).append(r)
            print("  run %d %-48s %s" % (rep + 1, name,
                                         "%.0f samples/s" % r["samples_per_s"] if kind == "ps" else
                                         "%.2f ms/step" % r["ms_per_step"]), flush=True)
    table = {}
    for kind, name, n, _ in configs:
        rs = results[name]
        if kind == "ps":
            table[name] = {"samples_per_s": statistics.median(r["samples_per_s"] for r in rs),
                           "final_loss": rs[0]["losses"][-1], "losses": rs[0]["losses"]}
        else:
            table[name] = {"ms_per_step": statistics.median(r["ms_per_step"] for r in rs)}
    ps_ref = table["gloo DistributedDataParallel"]
    pipe_ref = {"transformer": table["transformer: gloo send/recv"], "handoff only": table["handoff only: gloo send/recv"]}
    print("\nparameter server: %d workers, MLP 256-%d-%d-10, batch %d per worker, %d steps (medians of %d)"
          % (a.workers, a.width, a.width, a.batch, a.steps, a.repeat))
    print("  %-48s %12s %14s %12s" % ("", "samples/s", "x gloo DDP", "final loss"))
    for kind, name, n, _ in configs:
        if kind == "ps":
            t = table[name]
            print("  %-48s %12.0f %14.2f %12.4f" % (name, t["samples_per_s"], t["samples_per_s"] / ps_ref["samples_per_s"],
                                                    t["final_loss"]))
    d = abs(table[configs[0][1]]["final_loss"] - ps_ref["final_loss"]) / ps_ref["final_loss"]
    print("  final loss, hcomm parameter server vs gloo DDP: %.3f%% apart (tolerance 1%%)" % (100 * d))
    print("\npipeline: 2 stages x %d transformer layer(s) (d_model %d, seq %d), %d micro-batches of %d, forward;"
          % (a.layers, a.dmodel, a.seq, a.micros, a.micro))
    print("  handoff only: the same hand-over of 8 micro-batches of 4 MiB activations with no compute")
    print("  %-48s %12s %14s" % ("", "ms/step", "gloo / this"))
    for kind, name, n, _ in configs:
        if kind == "pipe":
            t = table[name]
            ref = pipe_ref[name.split(":")[0]]
            print("  %-48s %12.2f %14.2f" % (name, t["ms_per_step"], ref["ms_per_step"] / t["ms_per_step"]))
    with open(a.out + ".json", "w") as f:
        json.dump({"args": vars(a), "table": table}, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (l, r) = plt.subplots(1, 2, figsize=(11, 4))
        for kind, name, n, _ in configs:
            if kind == "ps":
                l.plot(table[name]["losses"], label=name)
        l.set_xlabel("step")
        l.set_ylabel("loss (worker of shard 0)")
        l.legend(fontsize=7)
        names = [name for kind, name, n, _ in configs if kind == "pipe"]
        r.bar(range(len(names)), [table[x]["ms_per_step"] for x in names])
        r.set_xticks(range(len(names)))
        r.set_xticklabels(names, fontsize=7)
        r.set_ylabel("ms per pipeline step")
        fig.tight_layout()
        fig.savefig(a.out + ".png", dpi=110)
        print("\nwrote %s.json and %s.png" % (a.out, a.out))
    except ImportError:
        print("\nwrote %s.json (no matplotlib: scripts/deps.sh --bench)" % a.out)


if __name__ == "__main__":
    main()
