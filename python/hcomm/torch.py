"""hcomm for PyTorch: the torch.distributed backend ``"hcomm"`` and tensor windows.

``import hcomm.torch`` registers the backend; then::

    dist.init_process_group(backend="hcomm")          # env:// (torchrun, hcomm-run), or rank/world_size/store
    dist.send(t, 1); dist.recv(t, 0); dist.isend/irecv/batch_isend_irecv/new_group
    win = hcomm.torch.Window(tensor)                  # collective over the group
    win.put(src, rank, offset); win.get(dst, rank, offset); win.accumulate(src, rank, offset, op=hcomm.torch.SUM)

hcomm starts from the group's c10d store (no listener of its own: torch's TCPStore keeps MASTER_PORT),
moves each CPU tensor's bytes once, and every group shares the process's one hcomm context. The
collectives (barrier, broadcast, all_reduce, all_gather, reduce_scatter) are convenience
implementations over point to point (ring, binomial tree), not tuned.
"""

import datetime

import torch
import torch.distributed as dist

from hcomm import _C

__all__ = ["Window", "empty", "SUM", "PROD", "MAX", "MIN", "BACKEND"]

BACKEND = "hcomm"
# hcomm_op_t
SUM, PROD, MAX, MIN = 0, 1, 2, 3
_OP_NAMES = {"sum": SUM, "prod": PROD, "max": MAX, "min": MIN}


def _op_code(op):
    """hcomm.torch.SUM/PROD/MAX/MIN, their names, or torch.distributed.ReduceOp.SUM/PRODUCT/MAX/MIN."""
    if isinstance(op, bool):
        pass
    elif isinstance(op, int) and op in (SUM, PROD, MAX, MIN):
        return op
    elif isinstance(op, str) and op.lower() in _OP_NAMES:
        return _OP_NAMES[op.lower()]
    else:
        for theirs, ours in ((dist.ReduceOp.SUM, SUM), (dist.ReduceOp.PRODUCT, PROD), (dist.ReduceOp.MAX, MAX),
                             (dist.ReduceOp.MIN, MIN)):
            try:
                if op == theirs:
                    return ours
            except TypeError:
                pass
    raise ValueError("hcomm: accumulate op must be SUM, PROD, MAX or MIN, not %r" % (op,))
_KEY_BYTES = 512  # a window's keys (two packed keys and their sizes) in the collective exchange


def _create(options, pg_options):
    return _C.create_process_group(options)


if not hasattr(dist.Backend, BACKEND.upper()):
    dist.Backend.register_backend(BACKEND, _create, extended_api=True)


def _group_pg(group):
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, _C.ProcessGroupHcomm):
        raise TypeError("hcomm: the group is served by %r, not hcomm (init_process_group(backend=\"hcomm\"))"
                        % (type(pg).__name__,))
    return pg


def _ms(timeout):
    if timeout is None:
        return 60000
    if isinstance(timeout, datetime.timedelta):
        return max(1, int(timeout.total_seconds() * 1000))
    return max(1, int(timeout * 1000))


def _finish(work, async_op, timeout):
    if async_op:
        return work
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout))
    return None


def empty(*size, dtype=torch.float32, group=None):
    """A tensor in hcomm memory: shareable with peers and registrable on every engine (on the NPU
    engine a Window needs one: its driver cannot register a tensor's own memory)."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    return _C.empty(_group_pg(group), [int(s) for s in size], torch.empty(0, dtype=dtype))


class Window:
    """A tensor that the ranks of ``group`` read and write without its owner taking part.

    Collective: every rank of the group constructs its window (sizes may differ) and keys are
    exchanged. Offsets are in elements of the window's dtype; bounds (IndexError) and dtypes
    (ValueError) are checked before anything moves. Each operation has an async form
    (``async_op=True``) returning a Work; ``flush(rank)`` waits until earlier operations are
    complete at their targets. Free it (``free()``) after a barrier: peers that still use a freed
    window get an error, never someone else's memory.
    """

    def __init__(self, tensor, group=None):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError("hcomm: Window needs a torch.Tensor")
        self._group = group
        pg = _group_pg(group)
        self._pg = pg
        self._w = _C.Window(pg, tensor)
        mine = self._w.keys()
        if len(mine) > _KEY_BYTES - 2:
            raise RuntimeError("hcomm: window keys of %d bytes do not fit the exchange" % len(mine))
        buf = torch.zeros(_KEY_BYTES, dtype=torch.uint8)
        buf[0] = len(mine) & 0xFF
        buf[1] = len(mine) >> 8
        buf[2:2 + len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        everyone = [torch.zeros(_KEY_BYTES, dtype=torch.uint8) for _ in range(pg.size())]
        dist.all_gather(everyone, buf, group=group)
        keys = []
        for b in everyone:
            n = int(b[0]) | (int(b[1]) << 8)
            keys.append(bytes(b[2:2 + n].tolist()))
        self._w.connect(keys)

    @property
    def tensor(self):
        return self._w.tensor()

    def put(self, src, rank, offset=0, async_op=False, timeout=None):
        return _finish(self._w.put(src, rank, offset), async_op, timeout)

    def get(self, dst, rank, offset=0, async_op=False, timeout=None):
        return _finish(self._w.get(dst, rank, offset), async_op, timeout)

    def accumulate(self, src, rank, offset=0, op=SUM, async_op=False, timeout=None):
        return _finish(self._w.accumulate(src, rank, offset, _op_code(op)), async_op, timeout)

    def put_notify(self, src, rank, offset=0, value=1, async_op=False, timeout=None):
        """Put, then set the target's notify word for this rank to ``value`` once the data is visible."""
        return _finish(self._w.put_notify(src, rank, offset, int(value)), async_op, timeout)

    def notify_wait(self, rank, value=1, timeout=None):
        """Waits until ``rank``'s notify word here is >= ``value``."""
        self._w.notify_wait(rank, int(value), _ms(timeout))

    def notify_value(self, rank):
        return self._w.notify_value(rank)

    def fetch_add(self, rank, offset, value, async_op=False, timeout=None):
        """Atomically adds ``value`` to the int64 at ``offset`` of ``rank``'s window; returns the old value
        (async: a Work whose ``result()[0]`` holds it)."""
        work = self._w.fetch_add(rank, offset, int(value))
        if async_op:
            return work
        _finish(work, False, timeout)
        return int(work.result()[0].item())

    def flush(self, rank=None, timeout=None):
        self._w.flush(-1 if rank is None else rank, _ms(timeout))

    def free(self):
        self._w.free()
