"""Issue 18: can a one-shot all-reduce over torch symmetric memory (P2P loads over NVLink, no
multicast) beat NCCL for a decode step's small [tokens, 4096] bf16 all-reduce inside a CUDA graph?
Times NCCL and each symmetric-memory op this torch has, checks each against NCCL's sum.
Run: python3 allreduce_symm.py (spawns one process per GPU)."""
import os
import traceback

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
    return start.elapsed_time(end) * 1000 / iters


def graphed(fn, per_graph=32):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per_graph):
            fn()
    return _time(g.replay, 50) / per_graph


def worker(rank, world, port):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.group.WORLD
    gname = group.group_name
    import torch.distributed._symmetric_memory as symm_mem
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        try:
            symm_mem.enable_symm_mem_for_group(gname)
        except Exception as e:  # deprecated in newer torch
            print("enable_symm_mem_for_group:", e)
    max_tokens = 512
    buf = symm_mem.empty(max_tokens * 4096, dtype=torch.bfloat16, device=f"cuda:{rank}")
    symm_mem.rendezvous(buf, gname)
    ops = torch.ops.symm_mem
    if rank == 0:
        print("torch", torch.__version__, "symm_mem ops:", sorted(n for n in dir(ops) if "reduce" in n), flush=True)
    for tokens in (1, 8, 32, 128, 512):
        torch.manual_seed(rank * 100 + tokens)
        x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
        ref = x.float().clone()
        dist.all_reduce(ref)
        y = x.clone()
        line = [f"[{tokens} x 4096] {tokens * 8} KiB:"]
        line.append(f"nccl {graphed(lambda: dist.all_reduce(y)):.1f} us")
        view = buf[: tokens * 4096].view(tokens, 4096)
        variants = {
            "one_shot(copy in)": lambda: ops.one_shot_all_reduce(view.copy_(x), "sum", gname),
            "one_shot_copy": lambda: ops.one_shot_all_reduce_copy(view, x, "sum", gname),
            "two_shot_(in place)": lambda: ops.two_shot_all_reduce_(view.copy_(x), "sum", gname),
        }
        for name, fn in variants.items():
            try:
                out = fn()
                out = view if out is None else out
                torch.cuda.synchronize()
                err = (out.float() - ref).abs().max().item()
                us = graphed(fn)
                line.append(f"{name} {us:.1f} us (max err {err:.3g})")
            except Exception as e:
                line.append(f"{name} FAILED {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        if rank == 0:
            print("  ".join(line), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, 29541), nprocs=2)
