"""How many threads a CPU step's forward pass gets.

On a CPU the engine core shares the machine with the API process, which tokenizes prompts
and streams tokens while the core computes. OpenMP threads that wait spin, so a core thread
on every CPU starves the event loop that feeds the engine (``share_cpu`` leaves it one core).
That is the right trade for short steps (decodes: a few milliseconds of small ops, where a
second thread mostly waits at barriers), and the wrong one for long steps: a step of a few
thousand prompt tokens is tens of milliseconds of GEMMs and attention that split cleanly
over threads, while the API process has little to do until its tokens come out. On two
cores, 16 clients sending 768-token prompts got 1.3x the output tokens/s from a second
thread in such steps; given to every step, it cost 16 clients decoding a quarter of theirs
(docs/benchmarks.md, "CPU: every core for long steps").

So the forward pass of a step of at least ``min_tokens`` tokens runs on every core, and
everything else (the LM head over the sampled rows, sampling, short steps) on the share
``share_cpu`` leaves. The split is also what keeps results independent of the thread
count: MKL's GEMMs of 5-11 rows round differently on two threads than on one, those of
hundreds of rows do not (``tests/test_cpu_step_threads.py`` checks both).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

# A forward pass of at least this many tokens runs on every core (see above). Below it a
# step's ops are too short for a second thread to pay for the barriers it waits at, and a
# GEMM of few rows may round differently.
MIN_TOKENS_FOR_ALL_CORES = 512


@dataclass(frozen=True)
class StepThreads:
    """``few`` threads by default, ``many`` for a forward pass of at least ``min_tokens``."""

    few: int
    many: int
    min_tokens: int = MIN_TOKENS_FOR_ALL_CORES

    def __post_init__(self) -> None:
        assert 1 <= self.few <= self.many and self.min_tokens >= 1


# The engine core's policy (``share_cpu`` sets it in the core process); None elsewhere: an
# in-process engine keeps whatever threads its caller gave torch.
_step_threads: StepThreads | None = None


def set_step_threads(policy: StepThreads | None) -> None:
    global _step_threads
    _step_threads = policy
    if policy is not None:
        torch.set_num_threads(policy.few)


@contextmanager
def forward_threads(num_tokens: int) -> Iterator[None]:
    """The model runner's forward pass of ``num_tokens`` tokens: on every core if it is
    long (and a policy is set), back to the default share after it."""
    policy = _step_threads
    if policy is None or num_tokens < policy.min_tokens or policy.many == policy.few:
        yield
        return
    torch.set_num_threads(policy.many)
    try:
        yield
    finally:
        torch.set_num_threads(policy.few)
