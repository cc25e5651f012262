"""What each rank runs in tests/python/test_torch_backend.py: `torch_workers.py SCENARIO`.

Launched torchrun-style (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE in the environment; init from
env://, where torch's TCPStore holds MASTER_PORT). Every check compares element by element and
raises AssertionError naming what differed; the last line a rank prints is "rank R ok".
"""
import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import hcomm.torch as ht

P2P_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
              torch.int64, torch.uint8, torch.bool, torch.complex64]
ACC_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.float16, torch.bfloat16,
              torch.float32, torch.float64]


def data(dtype, n, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype == torch.uint8:
        return torch.randint(0, 256, (n,), generator=g).to(dtype)
    if not dtype.is_floating_point and not dtype.is_complex:
        return torch.randint(-100, 100, (n,), generator=g).to(dtype)
    if dtype.is_complex:
        return torch.randn(n, generator=g, dtype=dtype)
    return torch.randn(n, generator=g).to(dtype)


def expect_error(fn, exc, text):
    try:
        fn()
    except exc as e:
        assert text in str(e), "%s raised %r, expected %r in it" % (fn, str(e), text)
        return str(e)
    raise AssertionError("%s did not raise %s" % (fn, exc.__name__))


def p2p(rank, n):
    right, left = (rank + 1) % n, (rank - 1) % n
    for i, dt in enumerate(P2P_DTYPES):
        for count in (0, 1, 1000, 300_000):  # eager and rendezvous sizes
            src = data(dt, count, rank * 1000 + i)
            dst = torch.zeros(count, dtype=dt)
            ops = [dist.P2POp(dist.isend, src, right, tag=i), dist.P2POp(dist.irecv, dst, left, tag=i)]
            for q in dist.batch_isend_irecv(ops):
                q.wait()
            assert torch.equal(dst, data(dt, count, left * 1000 + i)), "%s x %d from rank %d" % (dt, count, left)
    # Tags select: rank 0 sends tag 5 then tag 7; rank 1 takes tag 7 first.
    if rank == 0:
        dist.send(torch.full((10,), 5.0), 1, tag=5)
        dist.send(torch.full((10,), 7.0), 1, tag=7)
    elif rank == 1:
        a, b = torch.zeros(10), torch.zeros(10)
        dist.recv(b, 0, tag=7)
        dist.recv(a, 0, tag=5)
        assert a.eq(5).all() and b.eq(7).all(), "tags crossed"
    # Any source: everyone sends its rank to rank 0, which learns who from recv's return value.
    if rank == 0:
        seen = set()
        for _ in range(n - 1):
            t = torch.zeros(3, dtype=torch.int64)
            src = dist.recv(t)
            assert t.eq(src).all(), "any-source: payload %s from rank %d" % (t.tolist(), src)
            seen.add(src)
        assert seen == set(range(1, n)), seen
    else:
        dist.send(torch.full((3,), rank, dtype=torch.int64), 0)
    # Work objects: is_completed, wait(timeout).
    big = torch.arange(1 << 20, dtype=torch.float32)
    if rank == 0:
        w = dist.isend(big, 1, tag=11)
        w.wait(timeout=datetime.timedelta(seconds=30))
        assert w.is_completed()
    elif rank == 1:
        got = torch.zeros(1 << 20)
        w = dist.irecv(got, 0, tag=11)
        w.wait(timeout=datetime.timedelta(seconds=30))
        assert w.is_completed() and torch.equal(got, big)
    # Clear errors: a non-contiguous tensor, a message longer than the tensor.
    expect_error(lambda: dist.send(torch.zeros(4, 4).t(), right), RuntimeError, "not contiguous")
    if rank == 0:
        dist.send(torch.zeros(8), 1, tag=12)
    elif rank == 1:
        expect_error(lambda: dist.recv(torch.zeros(4), 0, tag=12), RuntimeError, "truncated")
    dist.barrier()


def collectives(rank, n):
    dist.barrier()
    for root in range(n):
        t = torch.full((1000,), float(root + 1)) if rank == root else torch.zeros(1000)
        dist.broadcast(t, root)
        assert t.eq(root + 1).all(), "broadcast from %d" % root
    for dt in (torch.float64, torch.int64, torch.float32):
        base = torch.arange(1001).to(dt)
        cases = [(dist.ReduceOp.SUM, lambda k: base + k, sum(base + k for k in range(n))),
                 (dist.ReduceOp.MAX, lambda k: base * ((-1) ** k) + k, None),
                 (dist.ReduceOp.MIN, lambda k: base * ((-1) ** k) + k, None),
                 (dist.ReduceOp.PRODUCT, lambda k: torch.full((1001,), k + 2).to(dt), None)]
        for op, mine, want in cases:
            everyone = torch.stack([mine(k) for k in range(n)])
            if op == dist.ReduceOp.MAX:
                want = everyone.max(0).values
            elif op == dist.ReduceOp.MIN:
                want = everyone.min(0).values
            elif op == dist.ReduceOp.PRODUCT:
                want = everyone.prod(0)
            t = mine(rank).clone()
            dist.all_reduce(t, op=op)
            assert torch.equal(t, want.to(dt)), "all_reduce %s %s" % (op, dt)
    outs = [torch.zeros(5, dtype=torch.int32) for _ in range(n)]
    dist.all_gather(outs, torch.full((5,), rank * 3, dtype=torch.int32))
    assert all(o.eq(k * 3).all() for k, o in enumerate(outs)), "all_gather"
    out = torch.zeros(7)
    dist.reduce_scatter(out, [torch.full((7,), float(rank * 10 + j)) for j in range(n)])
    assert out.eq(sum(k * 10 + rank for k in range(n))).all(), "reduce_scatter: %s" % out.tolist()
    # the flat forms (_allgather_base / _reduce_scatter_base underneath)
    flat = torch.zeros(n * 6, dtype=torch.int64)
    dist.all_gather_into_tensor(flat, torch.full((6,), rank + 1, dtype=torch.int64))
    assert torch.equal(flat, torch.arange(1, n + 1).repeat_interleave(6)), "all_gather_into_tensor %s" % flat.tolist()
    part = torch.zeros(3)
    dist.reduce_scatter_tensor(part, torch.arange(3 * n, dtype=torch.float32) + rank)
    want = sum(torch.arange(3 * n, dtype=torch.float32) + k for k in range(n))[3 * rank:3 * rank + 3]
    assert torch.equal(part, want), "reduce_scatter_tensor %s" % part.tolist()
    if n >= 3:
        g = dist.new_group([1, 2])  # every rank takes part in creating it
        if rank in (1, 2):
            t = torch.full((100,), float(rank))
            dist.all_reduce(t, group=g)
            assert t.eq(3.0).all(), "subgroup all_reduce"
            peer = 3 - rank
            x = torch.zeros(4)
            if rank == 1:
                dist.send(torch.full((4,), 9.0), peer, group=g)
            else:
                dist.recv(x, peer, group=g)
                assert x.eq(9).all(), "subgroup send/recv"
            dist.barrier(group=g)
    dist.barrier()


def pg_engine():
    return dist.distributed_c10d._get_default_group().engine()


def windows(rank, n):
    right, left = (rank + 1) % n, (rank - 1) % n
    for i, dt in enumerate(ACC_DTYPES):
        w = ht.empty(64, dtype=dt).zero_()
        win = ht.Window(w)
        src = data(dt, 5, rank * 100 + i)
        win.put(src, right, offset=3)
        dist.barrier()
        assert torch.equal(w[3:8], data(dt, 5, left * 100 + i)), "put %s" % dt
        back = torch.zeros(5, dtype=dt)
        win.get(back, right, offset=3)
        assert torch.equal(back, src), "get %s" % dt
        dist.barrier()
        # accumulate from everyone into rank 0, each op on its own slice
        ones = torch.full((4,), rank + 1).to(dt)
        win.accumulate(ones, 0, offset=20, op=ht.SUM)
        win.accumulate(ones, 0, offset=30, op=dist.ReduceOp.MAX)
        win.accumulate(ones, 0, offset=40, op="min")
        dist.barrier()
        if rank == 0:
            assert w[20:24].eq(torch.tensor(sum(k + 1 for k in range(n))).to(dt)).all(), "acc sum %s: %s" % (dt, w[20:24])
            assert w[30:34].eq(n).all(), "acc max %s" % dt
            assert w[40:44].eq(0).all(), "acc min %s (0 is smaller than every rank's value)" % dt
        dist.barrier()
        win.free()
    # put_notify / notify_wait, async forms, flush
    w = torch.zeros(1000) if pg_engine() == "host" else ht.empty(1000).zero_()  # a tensor's own memory where it can
    win = ht.Window(w)
    work = win.put_notify(torch.full((1000,), float(rank)), right, value=7, async_op=True)
    work.wait()
    win.notify_wait(left, 7, timeout=30)
    assert w.eq(left).all(), "put_notify data visible with the word"
    q = win.get(torch.zeros(10), right, offset=0, async_op=True)
    q.wait()
    win.flush(right)
    win.flush()
    # checks before anything moves
    expect_error(lambda: win.put(torch.zeros(10), right, offset=995), IndexError, "outside")
    expect_error(lambda: win.put(torch.zeros(10, dtype=torch.float64), right), ValueError, "Double tensor for a Float window")
    expect_error(lambda: win.accumulate(torch.zeros(2), right, op="xor"), ValueError, "SUM")
    expect_error(lambda: win.put(torch.zeros(2), n + 5), IndexError, "not in the window")
    dist.barrier()
    win.free()
    # fetch_add: every rank adds 1 ten times to rank 0's counter; old values are all distinct.
    c = ht.empty(4, dtype=torch.int64).zero_()
    cw = ht.Window(c)
    olds = [cw.fetch_add(0, 1, 1) for _ in range(10)]
    w2 = cw.fetch_add(0, 1, 0, async_op=True)
    w2.wait()
    everyone = [torch.zeros(10, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(everyone, torch.tensor(olds, dtype=torch.int64))
    flat = sorted(torch.cat(everyone).tolist())
    assert flat == list(range(10 * n)), "fetch_add old values %s" % flat
    dist.barrier()
    if rank == 0:
        assert c[1].item() == 10 * n
    floats = ht.Window(ht.empty(4))
    expect_error(lambda: floats.fetch_add(0, 0, 1), ValueError, "int64")
    dist.barrier()  # free after every rank is done with the windows
    floats.free()
    cw.free()


def timeout_withdraws(rank, n):
    """A Work whose wait timed out has withdrawn its receive: the late message goes to the next one."""
    if rank == 0:
        buf = torch.zeros(1000)
        q = dist.irecv(buf, 1, tag=3)
        t0 = time.monotonic()
        expect_error(lambda: q.wait(timeout=datetime.timedelta(milliseconds=200)), RuntimeError, "withdrawn")
        assert time.monotonic() - t0 < 10
        buf.fill_(7.0)  # reused at once
        dist.barrier()  # rank 1 sends now
        nxt = torch.zeros(1000)
        dist.recv(nxt, 1, tag=3)
        assert nxt.eq(42).all(), "the late message went to the next receive"
        assert buf.eq(7).all(), "a withdrawn receive's tensor was written"
    else:
        dist.barrier()
        if rank == 1:
            dist.send(torch.full((1000,), 42.0), 0, tag=3)
    dist.barrier()


def killed_peer(rank, n):
    """A rank that dies makes a pending recv raise within the peer-check bound, not the 60 s timeout."""
    dist.barrier()
    if rank == n - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    msg = expect_error(lambda: dist.recv(torch.zeros(10), n - 1), RuntimeError, "peer failure")
    took = time.monotonic() - t0
    print("rank %d raised after %.2f s: %s" % (rank, took, msg.splitlines()[0]), flush=True)
    assert took < 10, "noticed only after %.1f s" % took
    print("rank %d ok" % rank, flush=True)
    os._exit(0)  # the dead rank cannot take part in teardown


SCENARIOS = {f.__name__: f for f in (p2p, collectives, windows, timeout_withdraws, killed_peer)}


def main():
    scenario = SCENARIOS[sys.argv[1]]
    dist.init_process_group(backend="hcomm", timeout=datetime.timedelta(seconds=60))
    rank, n = dist.get_rank(), dist.get_world_size()
    pg = dist.distributed_c10d._get_default_group()
    print("rank %d engine %s peers %s" % (rank, pg.engine(), [pg.peer_transport(r) for r in range(n)]), flush=True)
    scenario(rank, n)
    dist.destroy_process_group()
    print("rank %d ok" % rank, flush=True)


if __name__ == "__main__":
    main()
