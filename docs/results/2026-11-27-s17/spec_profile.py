"""Where one speculative step's time goes at llama-3.1-8b shapes (issue 21): GPU kernel time
and GPU idle time per step, plain decoding against EAGLE k=3 with a random head (adaptive
off), batch 1. Usage: python3 spec_profile.py OUT_DIR [extra speculative-config JSON keys]."""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from pagelm import LLM, SamplingParams
from pagelm.plugins.bench.latency import add_parser, with_random_draft_head
from pagelm.plugins.bench.presets import resolve_bench_model
from pagelm.plugins.engine_args import engine_kwargs

out_dir = Path(sys.argv[1])
extra = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
parser = argparse.ArgumentParser()
add_parser(parser.add_subparsers())
args = parser.parse_args(["latency", "--model", os.environ.get("MODEL", "llama-3.1-8b"), "--max-model-len", "1024", "--max-num-seqs", "8"])
model_dir, base = resolve_bench_model(args.model, engine_kwargs(args))
params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
prompt = {"prompt_token_ids": list(range(1000, 1128))}


def measure(name: str, kwargs: dict) -> None:
    llm = LLM(model_dir, **kwargs)
    for _ in range(2):
        llm.generate([prompt], params, use_tqdm=False)
    t = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    wall = time.perf_counter() - t
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof_wall = time.perf_counter() - t
    events = prof.key_averages()
    # Kernels only (the ops that launched them carry the same time again).
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    rows = sorted(events, key=lambda e: -e.self_device_time_total)[:25]
    lines = [f"{name}: unprofiled generate {wall * 1e3:.1f} ms for 128 tokens ({128 / wall:.1f} tok/s)",
             f"  profiled: wall {prof_wall * 1e3:.1f} ms, GPU kernel time {gpu_us / 1e3:.1f} ms "
             f"({gpu_us / 1e4 / prof_wall:.0f}% busy)"]
    for e in rows:
        lines.append(f"  {e.self_device_time_total / 1e3:8.2f} ms  {e.count:6d}x  {e.key[:90]}")
    cpu_rows = sorted(events, key=lambda e: -e.self_cpu_time_total)[:25]
    lines.append("  -- CPU self time")
    for e in cpu_rows:
        lines.append(f"  {e.self_cpu_time_total / 1e3:8.2f} ms  {e.count:6d}x  {e.key[:90]}")
    text = "\n".join(lines)
    print(text, flush=True)
    (out_dir / f"{name}.txt").write_text(text)
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


spec = {"method": "eagle", "num_speculative_tokens": 3, "adaptive": False, **extra}
measure("plain", dict(base))
measure("eagle", {**base, "speculative_config": with_random_draft_head(model_dir, spec)})
