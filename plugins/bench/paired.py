"""``pagelm bench latency --compare spec-off --paired``: speculative and plain decoding timed
run by run, in turns, each engine in a process of its own.

Why: on a small, host-bound model a decode step is a few hundred microseconds, and what the
machine does that minute decides it. On the GPU machines the plain runs of one command spread
945-2,543 tok/s at batch 1 (the GPU's clock follows its load, the host is shared), so two
engines measured one after the other, seconds apart, compare their minutes as much as their
code. Here both engines stay up at once and take turns, run for run (plain first in even
runs, speculative first in odd ones), so each pair of runs meets the same conditions; the
speedup reported is the median over the pairs of ``plain TPOT / speculative TPOT``::

    parent ---- run i ----> plain engine (process 1)    ---- TPOTs ---->
           ---- run i ----> speculative engine (process 2)  ---- TPOTs ---->   ratio_i

Two processes rather than two engines in one: each sizes its KV pool from its own profile
(the other's memory counts as not torch's), and neither's Python, allocator or CUDA graphs
run inside the other's steps. The plain engine takes half the memory fraction, the
speculative one what remains of the full fraction.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
from dataclasses import dataclass

from pagelm.plugins.bench.latency import SpecCounts, load_tokenizer, reject_all_drafts, timed_generate


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


def _engine_process(conn, model_dir: str, kwargs: dict, args: argparse.Namespace, vocab_size: int,
                    reject_all: bool) -> None:
    """One engine, serving ``("run", batch_size, run)`` requests from the parent until
    ``None``; answers ``("ready", None)`` once built, a ``RunTimes`` per run, or
    ``("error", text)``."""
    from pagelm import LLM

    try:
        tokenizer = load_tokenizer(model_dir, kwargs) if args.workload == "code" else None
        llm = LLM(model_dir, **kwargs)
        if reject_all:
            reject_all_drafts(llm, vocab_size)
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    speculates = "speculative_config" in kwargs
    try:
        while (msg := conn.recv()) is not None:
            _, batch_size, run = msg
            try:
                e2e, ttft, tpot, outs = timed_generate(llm, batch_size, args, vocab_size, tokenizer, run)
            except BaseException as e:  # noqa: BLE001
                conn.send(("error", f"{type(e).__name__}: {e}"))
                continue
            conn.send(RunTimes(e2e, ttft, tpot, SpecCounts.from_outputs(outs) if speculates else None))
    finally:
        llm.engine.shutdown()


class EngineProcess:
    """An engine in a spawned process, driven run by run."""

    def __init__(self, name: str, model_dir: str, kwargs: dict, args: argparse.Namespace, vocab_size: int,
                 reject_all: bool = False):
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_engine_process, args=(child, model_dir, kwargs, args, vocab_size, reject_all),
            name=f"pagelm-bench-{name}", daemon=True,
        )
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


def measure_paired(
    model_dir: str, kwargs: dict, batch_sizes: list[int], args: argparse.Namespace, vocab_size: int
) -> dict[int, PairedRuns]:
    """Every batch size through both engines in turns: ``--warmup`` untimed runs each, then
    ``--iters`` timed pairs, the order alternating from pair to pair."""
    fraction = kwargs.get("gpu_memory_utilization", 0.9)
    plain_kwargs = {k: v for k, v in kwargs.items() if k != "speculative_config"}
    plain_kwargs["gpu_memory_utilization"] = fraction / 2
    print("paired runs: an engine without speculative decoding and one with it, in turns", flush=True)
    plain = EngineProcess("plain", model_dir, plain_kwargs, args, vocab_size)
    try:
        spec = EngineProcess("speculative", model_dir, kwargs, args, vocab_size, reject_all=args.spec_reject_all)
        try:
            out = {}
            for b in batch_sizes:
                for i in range(args.warmup):
                    plain.run(b, -1 - i)
                    spec.run(b, -1 - i)
                runs = PairedRuns([], [])
                for i in range(args.iters):
                    order = (plain, spec) if i % 2 == 0 else (spec, plain)
                    for engine in order:
                        (runs.plain if engine is plain else runs.spec).append(engine.run(b, i))
                out[b] = runs
                print(f"  batch {b:>4}: pairs' speedups {' '.join(f'{s:.2f}' for s in runs.speedups)}", flush=True)
            return out
        finally:
            spec.close()
    finally:
        plain.close()
