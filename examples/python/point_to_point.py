"""Rank 0 sends a 1024x1024 tensor to rank 1 over the torch.distributed backend "hcomm".

    PYTHONPATH=build/python build/tools/hcomm-run -n 2 /usr/bin/python3 examples/python/point_to_point.py
"""
import torch
import torch.distributed as dist

import hcomm.torch  # noqa: F401  (registers the backend "hcomm")


def main():
    dist.init_process_group(backend="hcomm")  # env://: MASTER_ADDR/PORT, RANK, WORLD_SIZE
    rank = dist.get_rank()
    if rank == 0:
        torch.manual_seed(0)
        t = torch.randn(1024, 1024)
        dist.send(t, dst=1)
        print(f"rank 0 sent {tuple(t.shape)} sum {t.sum().item():.6f}", flush=True)
    elif rank == 1:
        t = torch.empty(1024, 1024)
        dist.recv(t, src=0)
        print(f"rank 1 received {tuple(t.shape)} sum {t.sum().item():.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
