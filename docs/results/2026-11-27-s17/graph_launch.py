"""How long the host spends launching CUDA graphs in a speculative step at llama-3.1-8b shapes,
without a profiler (issue 21): torch.cuda.CUDAGraph.replay timed on the host (no sync) during
a batch-1 EAGLE generation (k=3, random head, adaptive off, a 32,768-token draft vocabulary),
and the TPOT beside it. Usage: python3 graph_launch.py."""

import argparse
import statistics
import time

import torch

from pagelm import LLM, SamplingParams
from pagelm.plugins.bench.latency import add_parser, with_random_draft_head
from pagelm.plugins.bench.presets import resolve_bench_model
from pagelm.plugins.engine_args import engine_kwargs

parser = argparse.ArgumentParser()
add_parser(parser.add_subparsers())
args = parser.parse_args(["latency", "--model", "llama-3.1-8b", "--max-model-len", "1024", "--max-num-seqs", "8"])
model_dir, base = resolve_bench_model(args.model, engine_kwargs(args))
spec = {"method": "eagle", "num_speculative_tokens": 3, "adaptive": False, "draft_vocab_size": 32768}
llm = LLM(model_dir, **{**base, "speculative_config": with_random_draft_head(model_dir, spec)})
prompt = {"prompt_token_ids": list(range(1000, 1128))}
params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
llm.generate([prompt], params, use_tqdm=False)

times: list[tuple[int, float]] = []
replay = torch.cuda.CUDAGraph.replay


def timed_replay(self):
    start = time.perf_counter()
    replay(self)
    times.append((id(self), time.perf_counter() - start))


torch.cuda.CUDAGraph.replay = timed_replay
for _ in range(2):
    times.clear()
    t = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)
    wall = time.perf_counter() - t
    m = out[0].metrics
    tpot = (m.finished_time - m.first_token_time) / 127
    by_graph: dict[int, list[float]] = {}
    for gid, dt in times:
        by_graph.setdefault(gid, []).append(dt)
    print(f"generate {wall * 1e3:.1f} ms, TPOT {tpot * 1e3:.3f} ms, {len(times)} graph replays, "
          f"host time in replay {sum(dt for _, dt in times) * 1e3:.1f} ms ({sum(dt for _, dt in times) / 127 * 1e3:.3f} ms per step)")
    for gid, dts in sorted(by_graph.items(), key=lambda kv: -len(kv[1])):
        print(f"  graph {gid % 100000}: {len(dts)} replays, median {statistics.median(dts) * 1e6:.0f} us, "
              f"max {max(dts) * 1e6:.0f} us")
