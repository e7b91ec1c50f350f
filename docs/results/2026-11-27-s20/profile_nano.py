"""Issue 21 (Triton within 10% of FlashInfer): where a nano-vllm run of qwen3-0.6b's shapes
spends its GPU time, per attention backend. One engine per backend: the bench's warm-up, a
timed run of the workload (seed 0, as `pagelm bench throughput`), then the same workload drawn
with seed 1 (so the prefix cache cannot help) under torch.profiler: GPU time per kernel, and
the GPU's busy share of the wall time.
Run: python3 profile_nano.py BACKEND [key=value engine kwargs ...]"""
import collections
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pagelm import LLM, SamplingParams
from pagelm.plugins.bench.presets import resolve_bench_model
from pagelm.plugins.bench.workload import TokenWorkload


def kind(name: str) -> str:
    n = name.lower()
    for key, label in (("paged_attention", "attention"), ("reduce_splits", "attention (split reduce)"),
                       ("prefill", "attention"), ("decode", "attention"), ("attn", "attention"),
                       ("merge_state", "attention"), ("nvjet", "GEMM"), ("gemm", "GEMM"), ("gemv", "GEMM"),
                       ("cutlass", "GEMM"), ("splitk", "GEMM"), ("rms", "rmsnorm"), ("norm", "rmsnorm"),
                       ("rotary", "rotary/kv store"), ("store", "rotary/kv store"), ("silu", "silu-mul"),
                       ("act", "silu-mul"), ("sample", "sampling"), ("argmax", "sampling"), ("topk", "sampling"),
                       ("softmax", "sampling"), ("exponential", "sampling"), ("graph_inputs", "inputs"),
                       ("memcpy", "copies"), ("memset", "copies"), ("copy", "copies"), ("index", "index/gather"),
                       ("gather", "index/gather")):
        if key in n:
            return label
    return "other"


def run(llm, workload, temperature=0.6):
    prompts = [{"prompt_token_ids": p} for p in workload.prompt_token_ids]
    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=n) for n in workload.output_lens]
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0


def main():
    backend = sys.argv[1]
    kw = dict(a.split("=", 1) for a in sys.argv[2:])
    model, engine_kw = resolve_bench_model("qwen3-0.6b", {"attention_backend": backend, "max_model_len": 4096, **kw})
    llm = LLM(model, **engine_kw)
    warm = TokenWorkload.fixed(8, 128, 16, 151936, 1)
    llm.generate([{"prompt_token_ids": p} for p in warm.prompt_token_ids],
                 SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    w0 = TokenWorkload.nano_vllm(seed=0)
    elapsed = run(llm, w0)
    print(f"[{backend}] timed run: {elapsed:.2f} s, {w0.num_output_tokens / elapsed:,.0f} output tok/s", flush=True)
    w1 = TokenWorkload.nano_vllm(seed=1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall = run(llm, w1)
    per_kind, per_name, counts, total = collections.Counter(), collections.Counter(), collections.Counter(), 0.0
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t <= 0 or e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        per_kind[kind(e.key)] += t
        per_name[e.key[:110]] += t
        counts[e.key[:110]] += e.count
        total += t
    print(f"[{backend}] profiled run (seed 1, {w1.num_output_tokens} output tokens): wall {wall:.2f} s, "
          f"GPU kernel time {total / 1e6:.2f} s ({100 * total / 1e6 / wall:.0f}% of wall)")
    for k, t in per_kind.most_common():
        print(f"[{backend}]   {k:26s} {t / 1e6:7.3f} s")
    print(f"[{backend}]   top kernels (s, calls):")
    for k, t in per_name.most_common(25):
        print(f"[{backend}]     {t / 1e6:7.3f}  x{counts[k]:7d}  {k}")
    llm.shutdown()


if __name__ == "__main__":
    main()
