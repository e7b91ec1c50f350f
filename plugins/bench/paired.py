"""``pagelm bench latency --compare spec-off --paired``: speculative and plain decoding timed
run by run, in turns, each engine in a process of its own.

Why: on a small, host-bound model a decode step is a few hundred microseconds, and what the
machine does that minute decides it. On the GPU machines the plain runs of one command spread
945-2,724 tok/s at batch 1 (the host's minute: the GPU's clock stays at its top whenever it
has work, and pinning the process to a core does not help), so two
engines measured one after the other, seconds apart, compare their minutes as much as their
code. Here both engines stay up at once and take turns, run for run (plain first in even
runs, speculative first in odd ones), so each pair of runs meets the same conditions; the
speedup reported is the median over the pairs of ``plain TPOT / speculative TPOT``::

    parent ---- run i ----> plain engine (process 1)    ---- TPOTs ---->
           ---- run i ----> speculative engine (process 2)  ---- TPOTs ---->   ratio_i

``pagelm.plugins.bench.latency`` says what runs in each process (``serve_engine``). Two
processes rather than two engines in one: each sizes its KV pool from its own profile
(the other's memory counts as not torch's), and neither's Python, allocator or CUDA graphs
run inside the other's steps. The plain engine takes half the memory fraction, the
speculative one what remains of the full fraction.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class RunTimes:
    """One ``generate`` of a batch: wall time, each request's TTFT and TPOT (seconds), and the
    requests' speculative counters (``SpecCounts``) when the engine speculates."""

    e2e_s: float
    ttft_s: list[float]
    tpot_s: list[float]
    spec: object | None


@dataclass
class PairedRuns:
    """The timed runs of one batch size, both engines, in the order they ran."""

    plain: list[RunTimes]
    spec: list[RunTimes]

    @property
    def speedups(self) -> list[float]:
        """Per pair: the plain run's median TPOT over the speculative run's."""
        return [statistics.median(p.tpot_s) / statistics.median(s.tpot_s) for p, s in zip(self.plain, self.spec)]

    @property
    def speedup(self) -> float:
        return statistics.median(self.speedups)


class EngineProcess:
    """An engine in a spawned process, driven run by run. ``serve(conn, *args)`` runs there
    (a module-level function): it builds the engine, answers ``("ready", None)`` (or
    ``("error", text)``), then a ``RunTimes`` for each ``("run", batch_size, run)`` until
    ``None``."""

    def __init__(self, name: str, serve: Callable, *args):
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child, *args), name=f"pagelm-bench-{name}", daemon=True)
        self.process.start()
        child.close()
        self._answer()

    def _answer(self):
        try:
            msg = self.conn.recv()
        except EOFError:
            raise SystemExit(f"the {self.name} engine's process died (exit code {self.process.exitcode})") from None
        if isinstance(msg, tuple) and msg[0] == "error":
            raise SystemExit(f"the {self.name} engine failed: {msg[1]}")
        return msg

    def run(self, batch_size: int, run: int) -> RunTimes:
        self.conn.send(("run", batch_size, run))
        return self._answer()

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()


def run_in_turns(plain: EngineProcess, spec: EngineProcess, batch_sizes: list[int], warmup: int, iters: int
                 ) -> dict[int, PairedRuns]:
    """Every batch size through both engines in turns: ``warmup`` untimed runs each, then
    ``iters`` timed pairs, the order alternating from pair to pair."""
    out = {}
    for b in batch_sizes:
        for i in range(warmup):
            plain.run(b, -1 - i)
            spec.run(b, -1 - i)
        runs = PairedRuns([], [])
        for i in range(iters):
            order = (plain, spec) if i % 2 == 0 else (spec, plain)
            for engine in order:
                (runs.plain if engine is plain else runs.spec).append(engine.run(b, i))
        out[b] = runs
        print(f"  batch {b:>4}: pairs' speedups {' '.join(f'{s:.2f}' for s in runs.speedups)}", flush=True)
    return out
