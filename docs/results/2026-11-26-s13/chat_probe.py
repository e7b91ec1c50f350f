"""Issue 20: where a multi-turn chat step's time goes with and without the CPU tier.
Runs `pagelm bench offload --workload chat` with a smaller workload, times every engine step
(a CUDA sync after each), records the tier copier's runs of consecutive tier blocks, and
profiles 60 late steps with torch.profiler (top ops by device and host time).
Run: python3 chat_probe.py [bench offload flags...]"""
import collections
import statistics
import sys
import time

import torch

import pagelm.plugins.bench.offload as off
import pagelm.plugins.kv_offload.copier as copier

runs = collections.Counter()
_orig_runs = copier._runs


def _count_runs(ids):
    out = _orig_runs(ids)
    for i, j, _ in out:
        runs[j - i] += 1
    return out


copier._runs = _count_runs
_orig_drive = off._drive_chat
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)


def _drive(llm, turns, args):
    engine = llm.engine
    step = engine.step
    times, n = [], [0]
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])

    def timed():
        n[0] += 1
        if n[0] == 400:
            prof.__enter__()
        sync()
        t = time.perf_counter()
        out = step()
        sync()
        times.append(time.perf_counter() - t)
        if n[0] == 460:
            prof.__exit__(None, None, None)
        return out

    engine.step = timed
    runs.clear()
    res = _orig_drive(llm, turns, args)
    engine.step = step
    times.sort()
    print(f"steps {len(times)}  total {sum(times):.2f} s  p50 {1e3 * statistics.median(times):.1f} ms  "
          f"p90 {1e3 * times[int(0.9 * len(times))]:.1f} ms  max {1e3 * times[-1]:.1f} ms  "
          f"time in steps > 30 ms: {sum(t for t in times if t > 0.03):.2f} s", flush=True)
    total = sum(runs.values())
    print(f"copier runs: {total}, blocks {sum(k * v for k, v in runs.items())}, "
          f"length histogram {sorted(runs.items())[:12]}", flush=True)
    if n[0] >= 460:
        ka = prof.key_averages()
        print(ka.table(sort_by="self_cuda_time_total", row_limit=14), flush=True)
        print(ka.table(sort_by="self_cpu_time_total", row_limit=14), flush=True)
    return res


off._drive_chat = _drive

if __name__ == "__main__":
    from pagelm.cli import main

    sys.argv = ["pagelm", "bench", "offload", *sys.argv[1:]]
    sys.exit(main())
