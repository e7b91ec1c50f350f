"""Issue 21 (session 23): where a batch-1 decode step goes (a copy of 2026-11-27/profile_tp.py
that takes the model). torch.profiler over 64 graph-replayed decode steps: GPU time per step
by kernel kind, the wall time per step, and so the GPU's idle share.
Run: python3 profile_step.py TP [MODEL] [extra LLM kwargs key=value ...]"""
import collections
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pagelm import LLM, SamplingParams
from pagelm.plugins.bench.presets import resolve_bench_model


def kind(name: str) -> str:
    n = name.lower()
    for key, label in (("allreduce", "all-reduce (NCCL)"), ("all_reduce", "all-reduce"), ("one_shot", "all-reduce (symm. mem.)"),
                       ("nvjet", "GEMM/GEMV"), ("gemv", "GEMM/GEMV"), ("gemm", "GEMM/GEMV"), ("splitk", "GEMM split-K reduce"),
                       ("attn", "attention"), ("attention", "attention"), ("decode", "attention"), ("rms", "rmsnorm"),
                       ("norm", "rmsnorm"), ("rotary", "rotary"), ("rope", "rotary"), ("silu", "silu-mul"), ("act", "silu-mul"),
                       ("store", "kv store"), ("reshape_and_cache", "kv store"), ("argmax", "sampling"), ("sample", "sampling")):
        if key in n:
            return label
    return "other"


MODEL = "qwen3-0.6b"


def main():
    global MODEL
    tp = int(sys.argv[1])
    if len(sys.argv) > 2 and "=" not in sys.argv[2]:
        MODEL = sys.argv.pop(2)
    kw = dict(a.split("=", 1) for a in sys.argv[2:])
    model, engine_kw = resolve_bench_model(MODEL, {"tensor_parallel_size": tp, "max_model_len": 4096, **kw})
    llm = LLM(model, **engine_kw)
    prompt = [{"prompt_token_ids": list(range(100, 228))}]
    steps = 64
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    llm.generate(prompt, params, use_tqdm=False)  # warm
    t0 = time.perf_counter()
    llm.generate(prompt, params, use_tqdm=False)
    wall = (time.perf_counter() - t0) / steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, params, use_tqdm=False)
    per_kind, per_name, total = collections.Counter(), collections.Counter(), 0.0
    counts = collections.Counter()
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t <= 0 or e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        per_kind[kind(e.key)] += t
        per_name[e.key[:90]] += t
        counts[e.key[:90]] += e.count
        total += t
    print(f"{MODEL} TP={tp} {kw}: wall per decode step (incl. prefill share) {wall * 1e3:.3f} ms; "
          f"rank-0 GPU kernel time per step {total / steps / 1e3:.3f} ms ({100 * total / steps / 1e3 / (wall * 1e3):.0f}% busy)")
    for k, t in per_kind.most_common():
        print(f"  {k:28s} {t / steps:8.1f} us/step")
    print("  top kernels:")
    for k, t in per_name.most_common(20):
        print(f"    {t / steps:8.1f} us/step  x{counts[k] / steps:5.1f}  {k}")
    llm.shutdown()


if __name__ == "__main__":
    main()
