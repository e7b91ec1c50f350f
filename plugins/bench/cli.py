"""``pagelm bench BENCHMARK``: performance measurements. Each benchmark is a module under
``pagelm.plugins.bench`` exposing ``add_parser(subparsers)``."""

from __future__ import annotations

import importlib

# Benchmark modules under pagelm.plugins.bench, in the order `pagelm bench --help` lists them.
BENCHMARKS = ["latency", "throughput", "serve", "structured", "offload", "multimodal"]


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: latency, throughput, serve, structured, offload, multimodal", description=__doc__)
    bench_sub = p.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name in BENCHMARKS:
        importlib.import_module(f"pagelm.plugins.bench.{name}").add_parser(bench_sub)
