"""Where the host's time goes in EAGLE speculative steps on the demo model (issue 21): the
demo model's GPU work is tiny, so a speculative step's wall time is the host's. Batch 1,
128 random prompt tokens, 384 out, k=3 with the trained head (eagle-demo/), after a warm-up;
the same generation timed without a profiler and without speculation, then under cProfile.
Prints steps, ms per step, and the top functions by own time and by inclusive time."""

import cProfile
import io
import pstats
import sys
import time

import torch

from pagelm import LLM, SamplingParams
from pagelm.plugins.bench.presets import resolve_bench_model

head = sys.argv[1]
model, kw = resolve_bench_model("demo", {})
kw["num_kv_blocks"] = 2048  # two engines in one process: neither sizes its pool from free memory
prompt = {"prompt_token_ids": torch.randint(10, 1000, (128,), generator=torch.Generator().manual_seed(0)).tolist()}
params = SamplingParams(temperature=0.0, max_tokens=384, ignore_eos=True)
for spec in (None, {"method": "eagle", "num_speculative_tokens": 3, "model": head}):
    llm = LLM(model, speculative_config=spec, **kw)
    core = llm.engine.core
    for _ in range(3):
        llm.generate([prompt], params, use_tqdm=False)
    steps = [0]
    step = core.step
    core.step = lambda: steps.__setitem__(0, steps[0] + 1) or step()
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    wall = time.perf_counter() - start
    print(f"{'eagle' if spec else 'plain'}: {steps[0]} engine steps, {wall * 1e3:.1f} ms, {wall / steps[0] * 1e3:.3f} ms a step, "
          f"async scheduling {core.async_scheduling}", flush=True)
    if spec is None:
        del llm, core
        continue
    prof = cProfile.Profile()
    prof.enable()
    llm.generate([prompt], params, use_tqdm=False)
    prof.disable()
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(45)
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:9000], flush=True)
