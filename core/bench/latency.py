"""``pagelm bench latency``: decode speed of one static batch, against the memory roofline.

For each batch size, ``LLM.generate`` runs that many random prompts of ``--input-len`` token
ids, greedy, ``--output-len`` tokens each with EOS ignored (fresh prompts every run, so the
prefix cache never helps). From each request's metrics::

    TTFT = first token time - arrival time
    TPOT = (finished time - first token time) / (output_len - 1)      decode time per token

and the medians over requests and runs are reported, with decode tokens/s = batch / TPOT.
One decode step must read every weight once (lm_head in full, one embedding row per sequence)
and the KV cache of the batch at the mean decode context, input_len + output_len / 2; that
over TPOT is the bandwidth achieved, and over the copy bandwidth measured on the device at
start-up it is the memory-bandwidth utilisation (MBU). Roofline tokens/s = batch x copy
bandwidth / bytes per step.

``--compare hf`` runs the same prompts through Hugging Face ``model.generate`` (same
architecture and dtype, random weights) first, frees it, then runs pagelm.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pagelm.bench.hf_compare import HFLatency, build_hf_model, hf_generate_latency, release_memory
from pagelm.bench.presets import PRESETS, resolve_bench_model
from pagelm.bench.roofline import DecodeCost, decode_avg_context, device_name, measure_copy_bandwidth
from pagelm.cli.engine_args import add_engine_args, engine_kwargs


def add_parser(sub) -> None:
    p = sub.add_parser(
        "latency", help="decode time per token of static batches, memory-bandwidth utilisation",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arg(p)
    p.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default: %(default)s)")
    p.add_argument(
        "--output-len", type=int, default=512, help="output tokens per request, EOS ignored (default: %(default)s)"
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per batch size (default: %(default)s)")
    p.add_argument("--iters", type=int, default=3, help="timed runs per batch size (default: %(default)s)")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the random prompts (default: %(default)s)")
    p.add_argument("--compare", choices=["hf"], help="also run Hugging Face transformers' generate on the same prompts")
    p.add_argument(
        "--hf-output-len", type=int,
        help="output tokens per HF request (default: --output-len); per-token figures stay comparable",
    )
    p.add_argument("--json", type=Path, help="write the results to this JSON file")
    add_engine_args(p)
    p.set_defaults(func=run)


def add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True,
        help=f"model directory, or a preset run with random weights and no tokenizer: {', '.join(PRESETS)}",
    )


@dataclass
class LatencyResult:
    batch_size: int
    input_len: int
    output_len: int
    e2e_s: float  # median wall time of one generate() of the batch
    ttft_s: float
    tpot_s: float
    decode_tokens_per_s: float
    bytes_per_step: float
    achieved_bandwidth: float  # bytes per step / TPOT, bytes/s
    mbu: float
    roofline_tokens_per_s: float
    hf: HFLatency | None = None

    @property
    def hf_ratio(self) -> float | None:
        return None if self.hf is None else self.decode_tokens_per_s / self.hf.decode_tokens_per_s


def random_prompts(seed: int, batch_size: int, input_len: int, vocab_size: int, run: int) -> list[list[int]]:
    """The prompts of one run (negative ``run`` for warm-ups): the same for pagelm and HF."""
    rng = random.Random(f"{seed}/{batch_size}/{run}")
    high = min(vocab_size, 10000) - 1
    return [[rng.randint(0, high) for _ in range(input_len)] for _ in range(batch_size)]


def measure_pagelm(
    llm, batch_size: int, args: argparse.Namespace, vocab_size: int
) -> tuple[float, float, float]:
    """Median (e2e, TTFT, TPOT) seconds over the timed runs of one batch size."""
    from pagelm import SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    def generate(run: int):
        prompts = random_prompts(args.workload_seed, batch_size, args.input_len, vocab_size, run)
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    for i in range(args.warmup):
        generate(-1 - i)
    e2e, ttft, tpot = [], [], []
    for i in range(args.iters):
        start = time.perf_counter()
        outs = generate(i)
        e2e.append(time.perf_counter() - start)
        for out in outs:
            m = out.metrics
            assert len(out.outputs[0].token_ids) == args.output_len, "ignore_eos run stopped early"
            ttft.append(m.first_token_time - m.arrival_time)
            tpot.append((m.finished_time - m.first_token_time) / (args.output_len - 1))
    return statistics.median(e2e), statistics.median(ttft), statistics.median(tpot)


def measure_hf(
    model_dir: str, dtype, device, batch_sizes: list[int], args: argparse.Namespace, vocab_size: int
) -> dict[int, HFLatency]:
    output_len = args.hf_output_len or args.output_len
    print(f"HF transformers generate: {output_len} output tokens per request", flush=True)
    model = build_hf_model(model_dir, dtype, device)
    try:
        out = {}
        for b in batch_sizes:
            runs = [random_prompts(args.workload_seed, b, args.input_len, vocab_size, i) for i in range(args.iters)]
            warm = random_prompts(args.workload_seed, b, args.input_len, vocab_size, -1)
            out[b] = hf_generate_latency(model, runs, output_len, warm)
            r = out[b]
            print(
                f"  batch {b}: TTFT {1000 * r.ttft_s:.2f} ms  TPOT {1000 * r.tpot_s:.3f} ms  "
                f"{r.decode_tokens_per_s:.1f} tok/s", flush=True,
            )
        return out
    finally:
        del model
        release_memory(device)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from pagelm import LLM
    from pagelm.config import EngineConfig

    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if args.output_len < 2 or args.input_len < 1 or args.iters < 1:
        raise SystemExit("--output-len must be >= 2 (TPOT needs two tokens), --input-len and --iters >= 1")
    model_dir, kwargs = resolve_bench_model(args.model, engine_kwargs(args))
    config = EngineConfig.from_kwargs(model_dir, **kwargs)
    if max(batch_sizes) > config.max_num_seqs:
        raise SystemExit(f"batch size {max(batch_sizes)} > max_num_seqs={config.max_num_seqs}: raise --max-num-seqs")
    hf_config = AutoConfig.from_pretrained(model_dir)
    device, dtype = config.resolved_device(), config.resolved_dtype(hf_config)
    vocab_size = hf_config.vocab_size

    cost = DecodeCost.from_hf_config(hf_config, dtype)
    # 1 GiB on a GPU; 256 MiB on the CPU (past any cache, quick in tests).
    copy_bytes, copy_iters = (1 << 30, 20) if device.type == "cuda" else (1 << 28, 5)
    bandwidth = measure_copy_bandwidth(device, copy_bytes, copy_iters)
    print(
        f"{args.model} on {device_name(device)}, {dtype}: weights read per step {cost.weight_bytes / 1e9:.3f} GB, "
        f"KV {cost.kv_bytes_per_token / 1e3:.1f} kB/token; copy bandwidth {bandwidth / 1e9:.1f} GB/s",
        flush=True,
    )
    hf = measure_hf(model_dir, dtype, device, batch_sizes, args, vocab_size) if args.compare == "hf" else {}

    llm = LLM(model_dir, **kwargs)
    avg_context = decode_avg_context(args.input_len, args.output_len)
    results = []
    for b in batch_sizes:
        e2e, ttft, tpot = measure_pagelm(llm, b, args, vocab_size)
        step_bytes = cost.bytes_per_step(b, avg_context)
        results.append(LatencyResult(
            b, args.input_len, args.output_len, e2e, ttft, tpot, b / tpot, step_bytes,
            step_bytes / tpot, step_bytes / tpot / bandwidth, b * bandwidth / step_bytes, hf.get(b),
        ))
        print_row(results[-1])

    if args.json:
        args.json.write_text(json.dumps({
            "benchmark": "latency", "model": args.model, "device": device_name(device), "dtype": str(dtype),
            "copy_bandwidth": bandwidth, "weight_bytes": cost.weight_bytes,
            "kv_bytes_per_token": cost.kv_bytes_per_token, "engine_args": kwargs,
            "results": [{**asdict(r), "hf_ratio": r.hf_ratio} for r in results],
        }, indent=2))
    return 0


def print_row(r: LatencyResult) -> None:
    line = (
        f"batch {r.batch_size:>4}: e2e {r.e2e_s:8.3f} s  TTFT {1000 * r.ttft_s:8.2f} ms  "
        f"TPOT {1000 * r.tpot_s:7.3f} ms  {r.decode_tokens_per_s:9.1f} tok/s  "
        f"roofline {r.roofline_tokens_per_s:9.1f} tok/s  MBU {r.mbu:6.1%}"
    )
    if r.hf is not None:
        line += f"  | HF {r.hf.decode_tokens_per_s:8.1f} tok/s, pagelm/HF {r.hf_ratio:6.2f}x"
    print(line, flush=True)
