"""Where a batch-1 decode step goes, kernel by kernel (issue 21; for a later session).
One engine (CUDA graphs, PDL, as `pagelm bench latency` runs it), random weights of a preset's
shapes; torch.profiler (CUDA activity) over a generate of OUTLEN tokens after a warm-up one.
Prints, per kernel name: launches a decode step, GPU us a step (summed durations), mean us a
launch; then the step's span on the GPU (first kernel start to last kernel end, median over
the steps) against the sum of its kernels' durations: the difference is the time no kernel
of the step ran (launch gaps, PDL waits). MODEL (a preset), OUTLEN from the environment."""
import collections, os, statistics, sys
import torch
from torch.profiler import ProfilerActivity, profile
from pagelm import LLM, SamplingParams
from pagelm.plugins.bench.presets import resolve_bench_model

model = os.environ.get("MODEL", "qwen3-0.6b"); outlen = int(os.environ.get("OUTLEN", "128"))
path, kw = resolve_bench_model(model, {})
llm = LLM(path, max_model_len=4096, gpu_memory_utilization=0.5, **kw)
prompt = [{"prompt_token_ids": list(range(1000, 1128))}]
sp = SamplingParams(max_tokens=outlen, temperature=0, ignore_eos=True)
llm.generate(prompt, sp, use_tqdm=False)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    llm.generate(prompt, sp, use_tqdm=False)
    torch.cuda.synchronize()
kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
# A decode step: the kernels between two launches of the sampler's argmax-like first kernel are
# not identifiable by name in general, so split the timeline at gaps the host leaves between
# steps instead: a gap over GAP_US ends a step (the one sync a step waits on the host).
GAP_US = float(os.environ.get("GAP_US", "8"))
steps, cur = [], [kernels[0]]
for prev, e in zip(kernels, kernels[1:]):
    if e.time_range.start - prev.time_range.end > GAP_US:
        steps.append(cur); cur = []
    cur.append(e)
steps.append(cur)
common = collections.Counter(len(s) for s in steps).most_common(1)[0][0]
decode = [s for s in steps if len(s) == common]
print(f"{model}: {len(kernels)} kernels, {len(steps)} steps split at {GAP_US} us gaps; {len(decode)} steps of {common} kernels (decode)")
per_name = collections.defaultdict(list)
for s in decode:
    for e in s:
        per_name[e.name].append(e.time_range.end - e.time_range.start)
rows = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))
print(f"{'kernel':90s} {'per step':>8s} {'us/step':>8s} {'us each':>8s}")
for name, d in rows:
    print(f"{name[:90]:90s} {len(d) / len(decode):8.1f} {sum(d) / len(decode):8.1f} {statistics.mean(d):8.2f}")
span = statistics.median(s[-1].time_range.end - s[0].time_range.start for s in decode)
busy = statistics.median(sum(e.time_range.end - e.time_range.start for e in s) for s in decode)
print(f"step span on the GPU {span:.1f} us (median), kernels' durations summed {busy:.1f} us, no kernel running {span - busy:.1f} us")
