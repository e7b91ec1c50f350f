"""GPU microbenchmark for issue 21: F.linear (cuBLAS) vs the split-K Triton GEMV (and, at one
row, the one-row GEMV the decode path uses by default) on the projections of Qwen3-0.6B,
Llama-3.2-1B and Llama-3.1-8B, M in {1, 2, 4, 8} rows.

Each variant is captured in a CUDA graph of 20 back-to-back calls, each on its own copy of
the weight (so the H100's 50 MB L2 does not serve them; matrices over 100 MB cycle through
enough copies to span 200 MB), and the graph replayed 50 times. Prints us per call, TB/s
(weight + activations read, output written) and the max abs difference from F.linear (and
from a float64 product). ``python3 gemv_bench.py [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from pagelm.backends.kernels.gemv import gemv
from pagelm.backends.kernels.gemv_splitk import _num_sms, gemv_splitk, gemv_splitk_config, split_k_for

SHAPES = {  # (name, N, K): torch Linear weight [N, K]
    "qwen3-0.6b": [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072),
                   ("lm_head", 151936, 1024)],
    "llama-3.2-1b": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192)],
    "llama-3.1-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
}
ROWS = (1, 2, 4, 8)
CALLS, REPLAYS = 20, 50


def time_graph(fn, weights, xs) -> float:
    """us per call: CALLS calls (call i on weights[i % len]) captured once, replayed REPLAYS times."""
    for w, x in zip(weights, xs):  # compile / pick cuBLAS algorithms outside the capture
        fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(xs[0], weights[0])  # warm the capture stream
        with torch.cuda.graph(graph, stream=stream):
            for i in range(CALLS):
                fn(xs[i % len(xs)], weights[i % len(weights)])
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * CALLS)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(device), f"{_num_sms(device)} SMs", args.dtype)
    print(f"{'model':13} {'proj':8} {'N':>6} {'K':>6} {'M':>2} {'config':>18} | {'cuBLAS us':>9} {'TB/s':>5} | "
          f"{'splitK us':>9} {'TB/s':>5} {'x':>5} | {'1-row us':>8} {'TB/s':>5} | err vs linear / vs fp64")
    rows = []
    for model, shapes in SHAPES.items():
        for name, n, k in shapes:
            weight_bytes = n * k * dtype.itemsize
            copies = CALLS if weight_bytes <= 100e6 else max(2, math.ceil(200e6 / weight_bytes))
            gen = torch.Generator(device=device).manual_seed(0)
            weights = [torch.randn(n, k, device=device, dtype=dtype, generator=gen) * k**-0.5 for _ in range(copies)]
            for m in ROWS:
                xs = [torch.randn(m, k, device=device, dtype=dtype, generator=gen) for _ in range(CALLS)]
                moved = weight_bytes + (m * k + m * n) * dtype.itemsize
                t_linear = time_graph(lambda x, w: F.linear(x, w), weights, xs)
                t_splitk = time_graph(lambda x, w: gemv_splitk(x, w), weights, xs)
                t_gemv = time_graph(lambda x, w: gemv(x, w), weights, xs) if m == 1 else float("nan")
                expected = F.linear(xs[0], weights[0])
                exact = (xs[0].double() @ weights[0].double().T)
                got = gemv_splitk(xs[0], weights[0])
                err_linear = (got.float() - expected.float()).abs().max().item()
                err_exact = (got.double() - exact).abs().max().item()
                err_cublas_exact = (expected.double() - exact).abs().max().item()
                deterministic = torch.equal(got, gemv_splitk(xs[0], weights[0]))
                config = gemv_splitk_config(m, n, k, _num_sms(device))
                tbs = lambda t: moved / (t * 1e-6) / 1e12  # noqa: E731
                row = dict(model=model, proj=name, n=n, k=k, m=m, config=config, weight_copies=copies,
                           cublas_us=t_linear, splitk_us=t_splitk, gemv_1row_us=t_gemv,
                           cublas_tbs=tbs(t_linear), splitk_tbs=tbs(t_splitk), gemv_1row_tbs=tbs(t_gemv),
                           max_abs_err_vs_linear=err_linear, max_abs_err_vs_fp64=err_exact,
                           cublas_max_abs_err_vs_fp64=err_cublas_exact, deterministic=deterministic)
                rows.append(row)
                print(f"{model:13} {name:8} {n:6} {k:6} {m:2} {str(config):>18} | {t_linear:9.2f} {tbs(t_linear):5.2f} | "
                      f"{t_splitk:9.2f} {tbs(t_splitk):5.2f} {t_linear / t_splitk:5.2f} | {t_gemv:8.2f} {tbs(t_gemv):5.2f} | "
                      f"{err_linear:.2e} / {err_exact:.2e} (cuBLAS {err_cublas_exact:.2e}){'' if deterministic else ' NONDET'}",
                      flush=True)
            del weights
            torch.cuda.empty_cache()
    if args.sweep:
        rows.extend(sweep(dtype, device))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(device), dtype=args.dtype, rows=rows), f, indent=1)


def sweep(dtype: torch.dtype, device: torch.device) -> list[dict]:
    print("sweep: model proj M (BLOCK_N, BLOCK_K, split, warps) us TB/s")
    results = []
    for name, n, k in SHAPES["qwen3-0.6b"][:4]:
        weights = [torch.randn(n, k, device=device, dtype=dtype) for _ in range(CALLS)]
        for m in (1, 4):
            xs = [torch.randn(m, k, device=device, dtype=dtype) for _ in range(CALLS)]
            moved = (n * k + m * k + m * n) * dtype.itemsize
            for block_n in (16, 32, 64) if m == 1 else (16, 32):
                for block_k in (256, 512):
                    for per_sm in (2, 4, 8):
                        for warps in (4, 8) if m == 1 and per_sm == 4 else (4,):
                            config = (block_n, block_k, split_k_for(n, k, block_n, block_k, _num_sms(device), per_sm), warps)
                            t = time_graph(lambda x, w: gemv_splitk(x, w, config=config), weights, xs)
                            results.append(dict(sweep=True, proj=name, n=n, k=k, m=m, config=config, splitk_us=t,
                                                splitk_tbs=moved / (t * 1e-6) / 1e12))
            best = sorted((r for r in results if r["proj"] == name and r["m"] == m), key=lambda r: r["splitk_us"])[:3]
            for r in best:
                print(f"sweep: qwen3-0.6b {name:8} {m} {str(r['config']):>20} {r['splitk_us']:6.2f} {r['splitk_tbs']:5.2f}", flush=True)
        del weights
    return results


if __name__ == "__main__":
    main()
