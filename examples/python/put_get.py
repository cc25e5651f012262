"""One-sided tensors: rank 0 puts a 1024x1024 tensor into rank 1's window, rank 1 takes no part;
then rank 0 gets it back and checks it.

    PYTHONPATH=build/python build/tools/hcomm-run -n 2 /usr/bin/python3 examples/python/put_get.py
"""
import torch
import torch.distributed as dist

import hcomm.torch


def main():
    dist.init_process_group(backend="hcomm")
    rank = dist.get_rank()
    # Tensors in hcomm memory work on every engine (the NPU engine's driver cannot register a
    # tensor's own memory; on the host engine torch.zeros(...) would do as well).
    window = hcomm.torch.empty(1024, 1024).zero_()
    win = hcomm.torch.Window(window)  # collective: registers and exchanges keys
    if rank == 0:
        torch.manual_seed(0)
        src = hcomm.torch.empty(1024, 1024).copy_(torch.randn(1024, 1024))
        win.put_notify(src, rank=1)  # data, then rank 1's notify word for rank 0
        back = hcomm.torch.empty(1024, 1024)
        win.get(back, rank=1)
        assert torch.equal(back, src), "get returned other bytes than put wrote"
        print(f"rank 0 put and got back {tuple(back.shape)} sum {back.sum().item():.6f}", flush=True)
    elif rank == 1:
        win.notify_wait(0, 1, timeout=60)  # the data is visible once the word is
        print(f"rank 1 window holds sum {window.sum().item():.6f}", flush=True)
    dist.barrier()
    win.free()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
