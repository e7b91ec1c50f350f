"""``pagelm bench offload``: what the CPU tier of the KV cache buys (docs/kv_offload.md).

Two workloads of random token ids (EOS ignored), each run twice in one process, one engine
after the other, with every engine flag given applied to both:

- ``pressure``: ``--num-seqs`` prompts of ``--input-len`` ids, ``--output-len`` tokens each,
  through a GPU KV pool ``--pool-fraction`` (default a quarter) of what the whole batch needs,
  so requests keep being preempted. ``preemption_mode=recompute`` without a tier, then
  ``preemption_mode=swap`` with one; reported: output and total tokens/s, preemptions, blocks
  swapped, and the swap / recompute throughput ratio.
- ``chat``: ``--conversations`` multi-turn conversations of ``--turns`` turns, each turn
  ``--user-len`` new user ids after the whole conversation so far, answered with
  ``--reply-len`` tokens. ``--concurrency`` conversations are in flight; the next turn sent is
  the next conversation's, round robin, so by the time a conversation comes back the others
  have pushed its blocks out of a GPU pool sized ``--pool-fraction`` of all conversations'
  final contexts (at least what the conversations in flight need at their longest). Without a
  tier, then with one big enough for every conversation; reported:
  prefix-cache hit rate, TTFT p50 / p90 (send to first token) and tokens/s. Each engine first
  runs ``--concurrency`` other conversations through every turn, untimed: kernels compile for
  each new shape on first use (a second or more on a cold cache), which otherwise lands in
  whichever run meets the shape first.

The GPU pool is ``--num-kv-blocks`` when given; the tier ``--num-cpu-blocks`` or
``--swap-space`` when given, else sized to hold the workload.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from pagelm.plugins.bench.hf_compare import release_memory
from pagelm.plugins.bench.latency import add_model_arg
from pagelm.plugins.bench.presets import resolve_bench_model
from pagelm.plugins.bench.roofline import device_name
from pagelm.plugins.engine_args import add_engine_args, engine_kwargs


def add_parser(sub) -> None:
    p = sub.add_parser(
        "offload", help="the CPU KV tier: swap vs recompute under memory pressure; multi-turn chat with and without",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arg(p)
    p.add_argument("--workload", choices=["pressure", "chat"], default="pressure", help="(default: %(default)s)")
    p.add_argument("--pool-fraction", type=float, default=0.25,
                   help="GPU KV pool as a fraction of what the workload needs (default: %(default)s)")
    p.add_argument("--num-seqs", type=int, default=64, help="pressure: requests (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=2048, help="pressure: prompt ids (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=1024, help="pressure: output tokens (default: %(default)s)")
    p.add_argument("--conversations", type=int, default=32, help="chat: conversations (default: %(default)s)")
    p.add_argument("--turns", type=int, default=6, help="chat: turns per conversation (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=8, help="chat: conversations in flight (default: %(default)s)")
    p.add_argument("--user-len", type=int, default=512, help="chat: new user ids per turn (default: %(default)s)")
    p.add_argument("--reply-len", type=int, default=128, help="chat: tokens per answer (default: %(default)s)")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the workload (default: %(default)s)")
    p.add_argument("--json", type=Path, help="write the results to this JSON file")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from pagelm.config import EngineConfig

    model_dir, kwargs = resolve_bench_model(args.model, engine_kwargs(args))
    config = EngineConfig.from_kwargs(model_dir, **kwargs)
    hf_config = AutoConfig.from_pretrained(model_dir)
    device = config.resolved_device()
    bench = _pressure if args.workload == "pressure" else _chat
    results = bench(args, model_dir, kwargs, config.block_size, min(hf_config.vocab_size, 10000), device)
    for r in results:
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
    base, tier = results
    if args.workload == "pressure":
        print(f"swap / recompute throughput (total tok/s): {tier['total_tokens_per_s'] / base['total_tokens_per_s']:.2f}x")
    else:
        print(f"TTFT p50 without / with the CPU tier: {base['ttft_p50_s'] / tier['ttft_p50_s']:.2f}x; prefix hit "
              f"rate {100 * base['prefix_hit_rate']:.1f}% -> {100 * tier['prefix_hit_rate']:.1f}%")
    if args.json:
        args.json.write_text(json.dumps({
            "benchmark": "offload", "model": args.model, "workload": args.workload, "device": device_name(device),
            "engine_args": kwargs, "results": results,
        }, indent=2))
    return 0


def _blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _tier_args(kwargs: dict, num_blocks: int) -> dict:
    """The tier the user gave, else one of ``num_blocks``."""
    if kwargs.get("num_cpu_blocks") or kwargs.get("swap_space"):
        return {}
    return {"num_cpu_blocks": num_blocks}


def _engine(model_dir: str, kwargs: dict, **overrides):
    from pagelm import LLM

    return LLM(model_dir, **{**kwargs, **overrides})


def _counters(core) -> dict[str, int]:
    """The engine's preemption and tier totals now (the timed part reports differences)."""
    from pagelm.kv_offload import KVOffloadStats

    tier = core.kv_cache_manager.offload
    s = tier.stats() if tier is not None else KVOffloadStats()
    return {"preemptions": core.scheduler.num_preemptions, "swap_preemptions": s.num_swap_preemptions,
            "blocks_swapped_out": s.blocks_swapped_out, "blocks_swapped_in": s.blocks_swapped_in,
            "tier_hit_blocks": s.hit_blocks}


def _since(core, before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in _counters(core).items()}


# ---- memory pressure: swap vs recompute ------------------------------------------------------


def _pressure(args, model_dir: str, kwargs: dict, block_size: int, vocab: int, device) -> list[dict]:
    from pagelm import SamplingParams

    rng = random.Random(args.workload_seed)
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_seqs)]
    needed = args.num_seqs * _blocks(args.input_len + args.output_len, block_size)
    num_kv_blocks = kwargs.get("num_kv_blocks") or max(
        int(needed * args.pool_fraction), _blocks(args.input_len + args.output_len, block_size)
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = [[rng.randrange(vocab) for _ in range(32)] for _ in range(4)]
    print(f"{args.model} on {device_name(device)}: {args.num_seqs} x ({args.input_len} + {args.output_len}) tokens "
          f"need {needed} KV blocks; the GPU pool holds {num_kv_blocks}", flush=True)
    results = []
    for mode, tier in (("recompute", {}), ("swap", _tier_args(kwargs, needed))):
        extra = {"enable_prefix_caching": False} if "enable_prefix_caching" not in kwargs else {}
        llm = _engine(model_dir, kwargs, num_kv_blocks=num_kv_blocks, preemption_mode=mode, **tier, **extra)
        llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(max_tokens=8), use_tqdm=False)
        core = llm.engine.core
        before = _counters(core)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        results.append({
            "preemption_mode": mode, "elapsed_s": elapsed, "output_tokens_per_s": output_tokens / elapsed,
            "total_tokens_per_s": (output_tokens + args.num_seqs * args.input_len) / elapsed,
            **_since(core, before),
        })
        llm.shutdown()
        del llm, core, outs
        release_memory(device, "engine")
    return results


# ---- multi-turn chat: with and without the tier ---------------------------------------------


def _chat(args, model_dir: str, kwargs: dict, block_size: int, vocab: int, device) -> list[dict]:
    rng = random.Random(args.workload_seed)
    turns = [[[rng.randrange(vocab) for _ in range(args.user_len)] for _ in range(args.turns)]
             for _ in range(args.conversations)]
    final_len = args.turns * (args.user_len + args.reply_len)
    needed = args.conversations * _blocks(final_len, block_size)
    # At least room for every conversation in flight at its longest: turns never preempt.
    num_kv_blocks = kwargs.get("num_kv_blocks") or max(
        int(needed * args.pool_fraction), args.concurrency * (_blocks(final_len, block_size) + 1)
    )
    print(f"{args.model} on {device_name(device)}: {args.conversations} conversations x {args.turns} turns, "
          f"{final_len} tokens each at the end: {needed} KV blocks; the GPU pool holds {num_kv_blocks}", flush=True)
    warm_rng = random.Random(args.workload_seed + 1)
    warmup = [[[warm_rng.randrange(vocab) for _ in range(args.user_len)] for _ in range(args.turns)]
              for _ in range(args.concurrency)]
    results = []
    for label, tier in (("no tier", {}), ("cpu tier", _tier_args(kwargs, needed))):
        llm = _engine(model_dir, kwargs, num_kv_blocks=num_kv_blocks, **tier)
        _drive_chat(llm, warmup, args)  # untimed: every shape the timed run meets, compiled
        results.append({"run": label, **_drive_chat(llm, turns, args)})
        llm.shutdown()
        del llm
        release_memory(device, "engine")
    return results


def _drive_chat(llm, turns: list[list[list[int]]], args) -> dict:
    """Closed loop: ``concurrency`` turns in flight; each finished turn frees a slot for the
    next one in turn-major round-robin order (conversation c's turn t+1 after its turn t)."""
    from pagelm import SamplingParams
    from pagelm.engine.output_processor import OutputKind

    engine, core = llm.engine, llm.engine.core
    params = SamplingParams(temperature=0.0, max_tokens=args.reply_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4] * 4}], SamplingParams(max_tokens=4), use_tqdm=False)
    history: list[list[int]] = [[] for _ in turns]
    order = [(c, t) for t in range(args.turns) for c in range(len(turns))]
    busy: set[int] = set()
    sent: dict[str, float] = {}
    ttfts: list[float] = []
    stats = core.kv_cache_manager.prefix_cache_stats
    queries0, hits0, before = stats.queries, stats.hits, _counters(core)
    next_turn, output_tokens, prompt_tokens = 0, 0, 0
    start = time.perf_counter()
    while next_turn < len(order) or engine.has_unfinished_requests():
        while next_turn < len(order) and len(busy) < args.concurrency and order[next_turn][0] not in busy:
            c, t = order[next_turn]
            history[c] += turns[c][t]
            req_id = f"{c}-{t}"
            engine.add_request(req_id, {"prompt_token_ids": list(history[c])}, params, output_kind=OutputKind.DELTA)
            sent[req_id] = time.perf_counter()
            prompt_tokens += len(history[c])
            busy.add(c)
            next_turn += 1
        for out in engine.step():
            c = int(out.request_id.split("-")[0])
            new = list(out.outputs[0].token_ids)
            if out.request_id in sent and new:
                ttfts.append(time.perf_counter() - sent.pop(out.request_id))
            history[c] += new
            output_tokens += len(new)
            if out.finished:
                busy.discard(c)
    elapsed = time.perf_counter() - start
    ttfts.sort()
    return {
        "elapsed_s": elapsed, "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "prefix_hit_rate": (stats.hits - hits0) / max(stats.queries - queries0, 1),
        "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        **_since(core, before),
    }
