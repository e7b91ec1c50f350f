"""Time one all-reduce between the two GPUs as pagelm's row-parallel layers issue it: a
[tokens, hidden] bf16 tensor through torch.distributed (NCCL), eager and inside a CUDA graph
(how a decode step replays it). Run: python3 allreduce.py (spawns one process per GPU)."""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _time(fn, iters):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters  # us


def worker(rank, world, port):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for tokens in (1, 8, 32, 256, 2048):
        x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
        for _ in range(20):
            dist.all_reduce(x)
        eager = _time(lambda: dist.all_reduce(x), 200)
        # 32 all-reduces in one graph, as 32 layers' worth of one decode step.
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                dist.all_reduce(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(32):
                dist.all_reduce(x)
        graphed = _time(g.replay, 50) / 32
        if rank == 0:
            print(f"allreduce bf16 [{tokens} x 4096] ({tokens * 8} KiB): eager {eager:.1f} us, in a CUDA graph {graphed:.1f} us", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, 29533), nprocs=2)
