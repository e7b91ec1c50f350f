"""``pagelm bench latency --profile-kernels N``: where a batch's step goes, kernel by kernel.

After a batch size's timed runs, one more ``generate`` of the same shape runs under
``torch.profiler``. On a GPU it records the device's kernels (those of CUDA graph replays
as CUPTI reports them: one by one where it traces graph nodes; not yet checked on a GPU); on
the CPU, where there are no kernels, the torch operators' own (self) time. The table divides by the run's engine steps (``output_len``:
one prefill step, the rest decode steps), so a row reads "launches a step, microseconds a
step"::

    kernel                                        per step    us/step   us each
    _gemv_kernel                                     113.0      421.3      3.73
    _split_decode_kernel                              28.0       61.6      2.20
    ...
    device busy 704.2 us of a 840.0 us step (TPOT): 135.8 us with no kernel running

"Busy" sums the kernels' durations, so it can only be compared with TPOT where a step's
kernels run one after another (one stream, as a decode step's do); the difference is the
launch gaps and waits the per-step kernel count costs, which is what fusing kernels removes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class KernelRow:
    name: str
    per_step: float  # launches a step
    us_per_step: float  # their durations summed, a step
    us_each: float  # mean duration of one launch


@dataclass
class KernelProfile:
    device: str  # "cuda": device kernels; "cpu": torch operators' self time
    num_steps: int
    busy_us_per_step: float
    kernels: list[KernelRow]  # most time a step first

    def print(self, top: int, tpot_s: float) -> None:
        what = "kernel" if self.device == "cuda" else "torch operator (self time, CPU)"
        print(f"  {what:70s} {'per step':>9s} {'us/step':>9s} {'us each':>8s}")
        for row in self.kernels[:top]:
            print(f"  {row.name[:70]:70s} {row.per_step:9.1f} {row.us_per_step:9.1f} {row.us_each:8.2f}")
        if len(self.kernels) > top:
            rest = sum(r.us_per_step for r in self.kernels[top:])
            print(f"  ({len(self.kernels) - top} more: {rest:.1f} us a step)")
        step_us, busy = 1e6 * tpot_s, self.busy_us_per_step
        if self.device == "cuda":
            print(f"  device busy {busy:.1f} us of a {step_us:.1f} us step (TPOT): "
                  f"{step_us - busy:.1f} us with no kernel running", flush=True)
        else:
            print(f"  torch operators {busy:.1f} us of a {step_us:.1f} us step (TPOT): "
                  f"{step_us - busy:.1f} us outside them (Python, the engine's own work)", flush=True)


def profile_steps(run: Callable[[], Any], num_steps: int, device: torch.device) -> KernelProfile:
    """Profile ``run()`` (a ``generate`` of ``num_steps`` engine steps) and tabulate it."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    activity = ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        run()
        if on_gpu:
            torch.cuda.synchronize(device)
    durations: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if on_gpu:
            if event.device_type == torch.autograd.DeviceType.CUDA:
                durations[event.name].append(event.time_range.elapsed_us())
        elif event.device_type == torch.autograd.DeviceType.CPU and event.name.startswith("aten::"):
            durations[event.name].append(event.self_cpu_time_total)
    rows = [
        KernelRow(name, len(d) / num_steps, sum(d) / num_steps, sum(d) / len(d))
        for name, d in durations.items()
    ]
    rows.sort(key=lambda r: -r.us_per_step)
    return KernelProfile("cuda" if on_gpu else "cpu", num_steps, sum(r.us_per_step for r in rows), rows)
