"""``pagelm simulate``: compare scheduling policies on a request trace without a GPU.

    pagelm simulate --make-trace bursty --num-requests 10000 --seed 0 -o trace.jsonl
    pagelm simulate --trace trace.jsonl --policy fcfs,priority,sjf --plot out.png

The trace is replayed through the real scheduler and KV cache manager; a cost model stands
in for the model. Trace format: see ``pagelm.plugins.sim.trace`` and docs/plugins.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml


def add_parser(sub) -> None:
    p = sub.add_parser(
        "simulate",
        help="replay a request trace through the scheduler with a cost model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", type=Path, help="JSON-lines trace to replay")
    p.add_argument("--policy", default="fcfs", help="comma-separated scheduling policies (default: fcfs)")
    p.add_argument("--plot", type=Path, help="write a PNG of queues, running requests and KV usage")
    p.add_argument("--json", type=Path, help="write the per-policy figures as JSON")
    gen = p.add_argument_group("trace generation")
    gen.add_argument("--make-trace", metavar="KIND", help="write a synthetic trace (bursty, poisson) and exit")
    gen.add_argument("--num-requests", type=int, default=10000)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("-o", "--output", type=Path, help="where --make-trace writes")
    eng = p.add_argument_group("engine (EngineConfig names)")
    eng.add_argument("--block-size", type=int, default=16)
    eng.add_argument("--num-kv-blocks", type=int, default=8192)
    eng.add_argument("--max-num-seqs", type=int, default=256)
    eng.add_argument("--max-num-batched-tokens", type=int, default=8192)
    eng.add_argument("--long-prefill-token-threshold", type=int, default=0)
    eng.add_argument("--max-num-partial-prefills", type=int, default=1)
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    eng.add_argument("--plugin-config", type=yaml.safe_load, default={}, help="YAML/JSON mapping, e.g. '{sjf: {aging_tokens_per_s: 50}}'")
    cost = p.add_argument_group("cost model (per step)")
    cost.add_argument("--step-overhead-ms", type=float, default=5.0)
    cost.add_argument("--per-token-ms", type=float, default=0.03)
    cost.add_argument("--per-context-token-ms", type=float, default=0.00004)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagelm.plugins.sim import CostModel, SimConfig, load_trace, make_trace, save_trace, simulate
    from pagelm.plugins.sim.report import format_results, plot_results

    if args.make_trace:
        if args.output is None:
            raise SystemExit("--make-trace needs -o/--output")
        trace = make_trace(args.make_trace, args.num_requests, args.seed)
        save_trace(trace, args.output)
        print(f"wrote {len(trace)} requests ({args.make_trace}, seed {args.seed}) to {args.output}")
        return 0
    if args.trace is None:
        raise SystemExit("pass --trace FILE (or --make-trace KIND -o FILE)")
    trace = load_trace(args.trace)
    if not trace:
        raise SystemExit(f"{args.trace} holds no requests")
    config = SimConfig(
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_partial_prefills=args.max_num_partial_prefills,
        enable_prefix_caching=args.enable_prefix_caching,
        plugin_config=args.plugin_config or {},
    )
    cost = CostModel(args.step_overhead_ms, args.per_token_ms, args.per_context_token_ms)
    policies = [name.strip() for name in args.policy.split(",") if name.strip()]
    results = [simulate(trace, policy, config, cost) for policy in policies]
    print(f"trace: {args.trace} ({len(trace)} requests over {trace[-1].arrival_time:.1f}s)")
    print(format_results(results))
    if args.json:
        figures = {r.policy: {**r.summary(), "ttft_p99_by_priority": r.ttft_p99_by_priority()} for r in results}
        args.json.write_text(json.dumps(figures, indent=2))
    if args.plot:
        plot_results(results, args.plot)
        print(f"plot: {args.plot}")
    return 0
