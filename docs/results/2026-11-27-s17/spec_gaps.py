"""Where the GPU waits during EAGLE speculative steps at llama-3.1-8b shapes (issue 21): a
torch profiler trace of a short batch-1 generation (Python stacks on), then every gap between
consecutive GPU kernels, and which Python functions (innermost pagelm frames) ran on the host
while the GPU was idle. Usage: python3 spec_gaps.py OUT_DIR [extra speculative-config JSON]."""

import argparse
import bisect
import collections
import gzip
import json
import sys
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from pagelm import LLM, SamplingParams
from pagelm.plugins.bench.latency import add_parser, with_random_draft_head
from pagelm.plugins.bench.presets import resolve_bench_model
from pagelm.plugins.engine_args import engine_kwargs

out_dir = Path(sys.argv[1])
extra = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
parser = argparse.ArgumentParser()
add_parser(parser.add_subparsers())
args = parser.parse_args(["latency", "--model", "llama-3.1-8b", "--max-model-len", "1024", "--max-num-seqs", "8"])
model_dir, base = resolve_bench_model(args.model, engine_kwargs(args))
spec = {"method": "eagle", "num_speculative_tokens": 3, "adaptive": False, **extra}
llm = LLM(model_dir, **{**base, "speculative_config": with_random_draft_head(model_dir, spec)})
prompt = {"prompt_token_ids": list(range(1000, 1128))}
llm.generate([prompt], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True), use_tqdm=False)
params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
    llm.generate([prompt], params, use_tqdm=False)
trace = out_dir / "trace.json"
prof.export_chrome_trace(str(trace))
events = json.loads(trace.read_text())["traceEvents"]
with gzip.open(str(trace) + ".gz", "wt") as f:
    json.dump(events, f)
trace.unlink()

kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel")
py = [e for e in events if e.get("cat") == "python_function" and "dur" in e]
# The whole generation: its prefill step too (one step of 41).
start, end = kernels[0][0], kernels[-1][1]
gaps = [(a_end, b_start) for (_, a_end), (b_start, _) in zip(kernels, kernels[1:]) if b_start - a_end > 5]
busy = sum(e - s for s, e in kernels)
lines = [f"window {(end - start) / 1e3:.1f} ms, kernels {len(kernels)}, kernel time {busy / 1e3:.1f} ms, "
         f"gaps > 5 us: {len(gaps)} totalling {sum(b - a for a, b in gaps) / 1e3:.1f} ms"]
hist = collections.Counter()
for a, b in gaps:
    hist[min(int((b - a) // 100) * 100, 2000)] += b - a
lines.append("idle time by gap length (us bucket: ms): " + ", ".join(f"{k}: {v / 1e3:.1f}" for k, v in sorted(hist.items())))


def frame(name: str) -> str:
    return name.split("(")[0].strip() if "(" in name else name


# For every Python function event, how much of it lies inside GPU gaps; report pagelm frames.
overlap = collections.Counter()
gap_starts = [a for a, _ in gaps]
for e in py:
    name = e["name"]
    if "pagelm" not in name and "/core/" not in name and "/plugins/" not in name and "/models/" not in name:
        continue
    s, t = e["ts"], e["ts"] + e["dur"]
    i = max(0, bisect.bisect_right(gap_starts, s) - 1)
    total = 0.0
    while i < len(gaps) and gaps[i][0] < t:
        a, b = gaps[i]
        total += max(0.0, min(b, t) - max(a, s))
        i += 1
    if total:
        overlap[name[:140]] += total
lines.append("pagelm Python functions overlapping GPU idle (inclusive, ms):")
for name, us in overlap.most_common(45):
    lines.append(f"  {us / 1e3:8.2f}  {name}")
text = "\n".join(lines)
print(text)
(out_dir / "gaps.txt").write_text(text)
