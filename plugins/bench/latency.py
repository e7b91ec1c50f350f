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

Speculative decoding: with ``--speculative-config JSON`` (the engine's flag) each row also
reports the mean acceptance length of the timed runs, ``1 + accepted / drafts`` (tokens per
verification step), beside the drafted and accepted token counts; ``--compare spec-off``
first runs the same prompts without speculation in the same process, frees that engine, and
reports the speedup in decode tokens/s; with ``--paired`` both engines stay up, each in a
process of its own, and take turns run by run (``pagelm.plugins.bench.paired``: for
host-bound models, whose speed drifts from minute to minute). Roofline and MBU stay those of plain decoding (one
token per step), so speculation is what takes tokens/s past the roofline. ``--spec-reject-all``
makes every draft wrong after the proposer ran: the overhead when nothing is accepted.

Prompts (``--workload``): ``random`` ids; ``repeat``, a block of random ids repeated
(``--repeat-block-len`` 256 x ``--repeat-count`` 4, 256 output tokens unless
``--output-len``): n-gram drafting's best case once the model copies it; ``code``, standard
library source through the model's tokenizer (for the demo model, ``--model demo``, and an
EAGLE head trained for it).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pagelm.plugins.bench.hf_compare import HFLatency, build_hf_model, hf_generate_latency, release_memory
from pagelm.plugins.bench.kernel_profile import KernelProfile, profile_steps
from pagelm.plugins.bench.paired import EngineProcess, PairedRuns, RunTimes, run_in_turns
from pagelm.plugins.bench.presets import DEMO, PRESETS, resolve_bench_model
from pagelm.plugins.bench.roofline import DecodeCost, decode_avg_context, device_name, measure_copy_bandwidth
from pagelm.plugins.bench.workload import TokenWorkload
from pagelm.plugins.engine_args import add_engine_args, engine_kwargs
from pagelm.spec_decode import DeviceDrafts
from pagelm.spec_decode.stats import acceptance_rate, mean_acceptance_length

WORKLOADS = ("random", "repeat", "code")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "latency", help="decode time per token of static batches, memory-bandwidth utilisation",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arg(p)
    p.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes (default: %(default)s)")
    p.add_argument(
        "--workload", choices=WORKLOADS, default="random",
        help="prompts: random ids, a repeated block of random ids, or stdlib source code (default: %(default)s)",
    )
    p.add_argument(
        "--input-len", type=int, help="prompt tokens per request (default: 128; repeat: block len x count)"
    )
    p.add_argument(
        "--output-len", type=int, help="output tokens per request, EOS ignored (default: 512; repeat: 256)"
    )
    p.add_argument(
        "--repeat-block-len", type=int, default=256, help="repeat: tokens in the repeated block (default: %(default)s)"
    )
    p.add_argument("--repeat-count", type=int, default=4, help="repeat: copies of the block (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per batch size (default: %(default)s)")
    p.add_argument("--iters", type=int, default=3, help="timed runs per batch size (default: %(default)s)")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the random prompts (default: %(default)s)")
    p.add_argument(
        "--compare", choices=["hf", "spec-off"],
        help="also run Hugging Face transformers' generate on the same prompts (hf), or pagelm without "
        "--speculative-config (spec-off: the speedup of speculative decoding)",
    )
    p.add_argument(
        "--paired", action="store_true",
        help="with --compare spec-off: both engines up at once, each in a process of its own, timed run by run in "
        "turns; the speedup is the median over the pairs of runs (for host-bound models, whose speed drifts "
        "from minute to minute)",
    )
    p.add_argument(
        "--spec-reject-all", action="store_true",
        help="shift every draft token id by one after the proposer ran, so that the target rejects it: the "
        "overhead of speculation when nothing is accepted",
    )
    p.add_argument(
        "--random-draft-head", action="store_true",
        help="give the --speculative-config method (eagle or medusa) a head of the model's shapes with random "
        "weights (written once, beside the presets); with \"adaptive\": false every step drafts k and accepts "
        "~none: what a speculative step costs. An eagle head drafts over a draft vocabulary of the first N ids with "
        "\"draft_vocab_size\": N in --speculative-config",
    )
    p.add_argument(
        "--hf-output-len", type=int,
        help="output tokens per HF request (default: --output-len); per-token figures stay comparable",
    )
    p.add_argument(
        "--profile-kernels", type=int, default=0, metavar="N",
        help="after each batch size's timed runs, profile one more run and print its N kernels that take "
        "the most time a step (on the CPU: torch operators), with launches a step and the time no kernel "
        "runs; the whole table goes into --json (0: off)",
    )
    p.add_argument("--json", type=Path, help="write the results to this JSON file")
    add_engine_args(p)
    p.set_defaults(func=run)


def add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True,
        help=f"model directory, {DEMO!r} (the built-in demo model), or a preset run with random weights and "
        f"no tokenizer: {', '.join(PRESETS)}",
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
    spec: SpecCounts | None = None  # with --speculative-config
    spec_off: SpecOffLatency | None = None  # with --compare spec-off
    paired_speedups: list[float] | None = None  # with --paired: plain TPOT / speculative TPOT, run by run
    kernel_profile: KernelProfile | None = None  # with --profile-kernels

    @property
    def hf_ratio(self) -> float | None:
        return None if self.hf is None else self.decode_tokens_per_s / self.hf.decode_tokens_per_s

    @property
    def speedup(self) -> float | None:
        """Decode tokens/s with speculative decoding over without it: with ``--paired`` the
        median over the pairs of runs, else the ratio of the two engines' medians."""
        if self.paired_speedups:
            return statistics.median(self.paired_speedups)
        return None if self.spec_off is None else self.decode_tokens_per_s / self.spec_off.decode_tokens_per_s


@dataclass
class SpecCounts:
    """Speculative decoding over the timed runs' requests: verification steps with drafts
    ("drafts"), tokens drafted, tokens accepted; tokens per verification step and the share
    of drafted tokens accepted."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    mean_acceptance_length: float | None
    acceptance_rate: float | None

    @classmethod
    def from_outputs(cls, outputs) -> "SpecCounts":
        drafts = sum(o.metrics.spec_num_drafts for o in outputs)
        drafted = sum(o.metrics.spec_num_draft_tokens for o in outputs)
        accepted = sum(o.metrics.spec_num_accepted_tokens for o in outputs)
        return cls.of(drafts, drafted, accepted)

    @classmethod
    def of(cls, drafts: int, drafted: int, accepted: int) -> "SpecCounts":
        return cls(
            drafts, drafted, accepted, mean_acceptance_length(drafts, accepted), acceptance_rate(drafted, accepted)
        )

    @classmethod
    def total(cls, counts: list["SpecCounts"]) -> "SpecCounts":
        """The counts of several runs together."""
        return cls.of(*(sum(getattr(c, f) for c in counts) for f in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")))


@dataclass
class SpecOffLatency:
    """The same runs without speculative decoding (medians, as ``LatencyResult``)."""

    e2e_s: float
    ttft_s: float
    tpot_s: float
    decode_tokens_per_s: float


def resolve_lengths(args: argparse.Namespace) -> None:
    """Fill ``--input-len``/``--output-len`` from the workload's defaults."""
    if args.workload == "repeat":
        input_len = args.repeat_block_len * args.repeat_count
        if args.input_len is not None and args.input_len != input_len:
            raise SystemExit(
                f"--workload repeat: --input-len is --repeat-block-len x --repeat-count = {input_len}, "
                f"not {args.input_len}"
            )
        args.input_len = input_len
        args.output_len = 256 if args.output_len is None else args.output_len
    else:
        args.input_len = 128 if args.input_len is None else args.input_len
        args.output_len = 512 if args.output_len is None else args.output_len


def workload_prompts(
    args: argparse.Namespace, batch_size: int, run: int, vocab_size: int, tokenizer=None
) -> list[list[int]]:
    """The prompts of one run of ``--workload`` (negative ``run`` for warm-ups): the same for
    every engine measured."""
    if args.workload == "random":
        return random_prompts(args.workload_seed, batch_size, args.input_len, vocab_size, run)
    seed = f"{args.workload_seed}/{batch_size}/{run}"
    if args.workload == "repeat":
        w = TokenWorkload.repeated(
            batch_size, args.repeat_block_len, args.repeat_count, args.output_len, vocab_size, seed
        )
    else:
        w = TokenWorkload.code(tokenizer, batch_size, args.input_len, args.output_len, seed)
    return w.prompt_token_ids


def random_prompts(seed: int, batch_size: int, input_len: int, vocab_size: int, run: int) -> list[list[int]]:
    """The prompts of one run (negative ``run`` for warm-ups): the same for pagelm and HF."""
    rng = random.Random(f"{seed}/{batch_size}/{run}")
    high = min(vocab_size, 10000) - 1
    return [[rng.randint(0, high) for _ in range(input_len)] for _ in range(batch_size)]


def measure_pagelm(
    llm, batch_size: int, args: argparse.Namespace, vocab_size: int, tokenizer=None
) -> tuple[float, float, float, SpecCounts]:
    """Median (e2e, TTFT, TPOT) seconds over the timed runs of one batch size, and their
    speculative decoding counts."""
    for i in range(args.warmup):
        timed_generate(llm, batch_size, args, vocab_size, tokenizer, -1 - i)
    e2e, ttft, tpot, timed = [], [], [], []
    for i in range(args.iters):
        run_e2e, run_ttft, run_tpot, outs = timed_generate(llm, batch_size, args, vocab_size, tokenizer, i)
        e2e.append(run_e2e)
        ttft.extend(run_ttft)
        tpot.extend(run_tpot)
        timed.extend(outs)
    return statistics.median(e2e), statistics.median(ttft), statistics.median(tpot), SpecCounts.from_outputs(timed)


def timed_generate(llm, batch_size: int, args: argparse.Namespace, vocab_size: int, tokenizer, run: int):
    """``generate`` the prompts of ``run`` (negative: a warm-up) and time it; returns
    ``(e2e seconds, TTFTs, TPOTs, outputs)``."""
    from pagelm import SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    prompts = workload_prompts(args, batch_size, run, vocab_size, tokenizer)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    e2e = time.perf_counter() - start
    ttft, tpot = [], []
    for out in outs:
        m = out.metrics
        assert len(out.outputs[0].token_ids) == args.output_len, "ignore_eos run stopped early"
        ttft.append(m.first_token_time - m.arrival_time)
        tpot.append((m.finished_time - m.first_token_time) / (args.output_len - 1))
    return e2e, ttft, tpot, outs


def measure_spec_off(
    model_dir: str, kwargs: dict, device, batch_sizes: list[int], args: argparse.Namespace, vocab_size: int,
    tokenizer=None,
) -> dict[int, SpecOffLatency]:
    """Every batch size through an engine without speculative decoding, freed afterwards."""
    from pagelm import LLM

    print("without speculative decoding:", flush=True)
    llm = LLM(model_dir, **{k: v for k, v in kwargs.items() if k != "speculative_config"})
    out = {}
    try:
        for b in batch_sizes:
            e2e, ttft, tpot, _ = measure_pagelm(llm, b, args, vocab_size, tokenizer)
            out[b] = r = SpecOffLatency(e2e, ttft, tpot, b / tpot)
            print(
                f"  batch {b:>4}: e2e {r.e2e_s:8.3f} s  TTFT {1000 * r.ttft_s:8.2f} ms  "
                f"TPOT {1000 * r.tpot_s:7.3f} ms  {r.decode_tokens_per_s:9.1f} tok/s", flush=True,
            )
        return out
    finally:
        llm.engine.shutdown()
        del llm
        release_memory(device, "engine without speculative decoding")


def serve_engine(conn, model_dir: str, kwargs: dict, args: argparse.Namespace, vocab_size: int,
                 reject_all: bool) -> None:
    """``--paired``: one engine in a process of its own (``EngineProcess``), timing a
    ``generate`` for each ``("run", batch_size, run)`` from the parent until ``None``."""
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


def measure_paired(
    model_dir: str, kwargs: dict, batch_sizes: list[int], args: argparse.Namespace, vocab_size: int
) -> dict[int, PairedRuns]:
    """``--paired``: an engine without speculative decoding (half the memory fraction) and
    one with it (what remains of the whole fraction), each in a process of its own, timed
    in turns (``pagelm.plugins.bench.paired``)."""
    fraction = kwargs.get("gpu_memory_utilization", 0.9)
    plain_kwargs = {k: v for k, v in kwargs.items() if k != "speculative_config"}
    plain_kwargs["gpu_memory_utilization"] = fraction / 2
    print("paired runs: an engine without speculative decoding and one with it, in turns", flush=True)
    plain = EngineProcess("plain", serve_engine, model_dir, plain_kwargs, args, vocab_size, False)
    try:
        spec = EngineProcess("speculative", serve_engine, model_dir, kwargs, args, vocab_size, args.spec_reject_all)
        try:
            return run_in_turns(plain, spec, batch_sizes, args.warmup, args.iters)
        finally:
            spec.close()
    finally:
        plain.close()


def measure_hf(
    model_dir: str, dtype, device, batch_sizes: list[int], args: argparse.Namespace, vocab_size: int,
    tokenizer=None,
) -> dict[int, HFLatency]:
    output_len = args.hf_output_len or args.output_len
    print(f"HF transformers generate: {output_len} output tokens per request", flush=True)
    model = build_hf_model(model_dir, dtype, device)
    try:
        out = {}
        for b in batch_sizes:
            runs = [workload_prompts(args, b, i, vocab_size, tokenizer) for i in range(args.iters)]
            warm = workload_prompts(args, b, -1, vocab_size, tokenizer)
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
    resolve_lengths(args)
    if args.output_len < 2 or args.input_len < 1 or args.iters < 1:
        raise SystemExit("--output-len must be >= 2 (TPOT needs two tokens), --input-len and --iters >= 1")
    model_dir, kwargs = resolve_bench_model(args.model, engine_kwargs(args))
    if args.random_draft_head:
        kwargs["speculative_config"] = with_random_draft_head(model_dir, kwargs.get("speculative_config"))
    config = EngineConfig.from_kwargs(model_dir, **kwargs)
    if (args.compare == "spec-off" or args.spec_reject_all) and config.speculative is None:
        raise SystemExit("--compare spec-off and --spec-reject-all measure speculative decoding: "
                         "give --speculative-config JSON")
    if args.paired and args.compare != "spec-off":
        raise SystemExit("--paired times speculative and plain decoding in turns: give it with --compare spec-off")
    if args.profile_kernels < 0 or (args.profile_kernels and args.paired):
        raise SystemExit("--profile-kernels must be >= 0 (the rows to print), and profiles this process's "
                         "engine: not with --paired")
    if max(batch_sizes) > config.max_num_seqs:
        raise SystemExit(f"batch size {max(batch_sizes)} > max_num_seqs={config.max_num_seqs}: raise --max-num-seqs")
    hf_config = AutoConfig.from_pretrained(model_dir)
    device, dtype = config.resolved_device(), config.resolved_dtype(hf_config)
    vocab_size = hf_config.vocab_size
    max_model_len = config.max_model_len or getattr(hf_config, "max_position_embeddings", None)
    if max_model_len is not None and args.input_len + args.output_len > max_model_len:
        raise SystemExit(
            f"{args.input_len} prompt + {args.output_len} output tokens exceed max_model_len={max_model_len}: "
            "shorten the workload or raise --max-model-len"
        )
    tokenizer = load_tokenizer(model_dir, kwargs) if args.workload == "code" else None

    cost = DecodeCost.from_hf_config(hf_config, dtype)
    # 1 GiB on a GPU; 256 MiB on the CPU (past any cache, quick in tests).
    copy_bytes, copy_iters = (1 << 30, 20) if device.type == "cuda" else (1 << 28, 5)
    bandwidth = measure_copy_bandwidth(device, copy_bytes, copy_iters)
    print(
        f"{args.model} on {device_name(device)}, {dtype}: weights read per step {cost.weight_bytes / 1e9:.3f} GB, "
        f"KV {cost.kv_bytes_per_token / 1e3:.1f} kB/token; copy bandwidth {bandwidth / 1e9:.1f} GB/s",
        flush=True,
    )
    hf = measure_hf(model_dir, dtype, device, batch_sizes, args, vocab_size, tokenizer) if args.compare == "hf" else {}
    avg_context = decode_avg_context(args.input_len, args.output_len)

    def result(b, e2e, ttft, tpot, spec, spec_off, paired_speedups=None) -> LatencyResult:
        step_bytes = cost.bytes_per_step(b, avg_context)
        return LatencyResult(
            b, args.input_len, args.output_len, e2e, ttft, tpot, b / tpot, step_bytes,
            step_bytes / tpot, step_bytes / tpot / bandwidth, b * bandwidth / step_bytes, hf.get(b),
            spec if config.speculative is not None else None, spec_off, paired_speedups,
        )

    results = []
    if args.paired:
        print(f"with speculative decoding: {config.speculative.describe()}", flush=True)
        for b, runs in measure_paired(model_dir, kwargs, batch_sizes, args, vocab_size).items():
            plain = [t for r in runs.plain for t in r.tpot_s]
            off = SpecOffLatency(
                statistics.median(r.e2e_s for r in runs.plain), statistics.median(t for r in runs.plain for t in r.ttft_s),
                statistics.median(plain), b / statistics.median(plain),
            )
            results.append(result(
                b, statistics.median(r.e2e_s for r in runs.spec), statistics.median(t for r in runs.spec for t in r.ttft_s),
                statistics.median(t for r in runs.spec for t in r.tpot_s), SpecCounts.total([r.spec for r in runs.spec]),
                off, runs.speedups,
            ))
            print_row(results[-1])
    else:
        spec_off = {}
        if args.compare == "spec-off":
            spec_off = measure_spec_off(model_dir, kwargs, device, batch_sizes, args, vocab_size, tokenizer)
        if config.speculative is not None:
            print(f"with speculative decoding: {config.speculative.describe()}", flush=True)
        llm = LLM(model_dir, **kwargs)
        if args.spec_reject_all:
            reject_all_drafts(llm, vocab_size)
        for b in batch_sizes:
            e2e, ttft, tpot, spec = measure_pagelm(llm, b, args, vocab_size, tokenizer)
            results.append(result(b, e2e, ttft, tpot, spec, spec_off.get(b)))
            print_row(results[-1])
            if args.profile_kernels:
                results[-1].kernel_profile = profile_steps(
                    lambda: timed_generate(llm, b, args, vocab_size, tokenizer, args.iters), args.output_len, device,
                )
                results[-1].kernel_profile.print(args.profile_kernels, tpot)

    if args.json:
        args.json.write_text(json.dumps({
            "benchmark": "latency", "model": args.model, "device": device_name(device), "dtype": str(dtype),
            "copy_bandwidth": bandwidth, "weight_bytes": cost.weight_bytes,
            "kv_bytes_per_token": cost.kv_bytes_per_token, "engine_args": kwargs,
            "workload": workload_description(args),
            "speculative_config": kwargs.get("speculative_config"), "spec_reject_all": args.spec_reject_all,
            "paired": args.paired,
            "results": [{**asdict(r), "hf_ratio": r.hf_ratio, "speedup": r.speedup} for r in results],
        }, indent=2))
    return 0


def with_random_draft_head(model_dir: str, spec: dict | None) -> dict:
    """``--random-draft-head``: the speculative config with ``model`` set to a random head of
    ``model_dir``'s shapes (``pagelm.plugins.spec_decode.random_heads``); its
    ``draft_vocab_size`` key, if any, goes into the head (a draft vocabulary of that many ids)."""
    from pagelm.plugins.bench.presets import default_presets_dir
    from pagelm.plugins.spec_decode.random_heads import METHODS, random_draft_head

    method = (spec or {}).get("method")
    if method not in METHODS:
        raise SystemExit(f"--random-draft-head needs --speculative-config with method {' or '.join(METHODS)}, got {method!r}")
    if spec.get("model"):
        raise SystemExit("--random-draft-head makes the head: leave 'model' out of --speculative-config")
    k = int(spec.get("num_speculative_tokens", 1))
    spec = dict(spec)
    vocab = spec.pop("draft_vocab_size", None)
    if vocab is not None and (method != "eagle" or not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1):
        raise SystemExit(f"draft_vocab_size is an eagle head's, an integer >= 1; got {vocab!r} for {method}")
    name = f"{Path(model_dir).name}-{method}" + ("" if vocab is None else f"-vocab{vocab}")
    out = default_presets_dir() / "random-heads" / name
    vocab_note = "" if vocab is None else f", draft vocabulary of {vocab} ids"
    print(f"random {method} head of {Path(model_dir).name}'s shapes{vocab_note}: {out}", flush=True)
    head = random_draft_head(model_dir, method, out, num_heads=max(k, 1), draft_vocab_size=vocab)
    return {**spec, "model": str(head)}


def reject_all_drafts(llm, vocab_size: int) -> None:
    """``--spec-reject-all``: the proposer drafts as usual (its cost is paid), then each draft
    token id is shifted by one, so greedy verification rejects it unless the target happens
    to pick that neighbour. A random-weight model cannot stand in for "nothing accepted": it
    soon repeats itself, and n-gram drafts for it are right."""
    proposer = llm.engine.core.runner.spec.proposer
    propose = proposer.propose

    def shifted(batch):
        drafts = propose(batch)
        if isinstance(drafts, DeviceDrafts):  # shifted where they are
            return DeviceDrafts((drafts.token_ids + 1) % vocab_size, drafts.num_drafts)
        return [[(t + 1) % vocab_size for t in d] for d in drafts]

    proposer.propose = shifted


def workload_description(args: argparse.Namespace) -> dict:
    out = {"name": args.workload, "input_len": args.input_len, "output_len": args.output_len,
           "seed": args.workload_seed}
    if args.workload == "repeat":
        out.update(block_len=args.repeat_block_len, repeats=args.repeat_count)
    return out


def load_tokenizer(model_dir: str, kwargs: dict):
    """The model's tokenizer, for ``--workload code``."""
    from transformers import AutoTokenizer

    if kwargs.get("skip_tokenizer_init"):
        raise SystemExit("--workload code needs the model's tokenizer: a model directory with one, not a preset")
    try:
        return AutoTokenizer.from_pretrained(kwargs.get("tokenizer") or model_dir)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--workload code needs the model's tokenizer: {e}") from e


def print_row(r: LatencyResult) -> None:
    line = (
        f"batch {r.batch_size:>4}: e2e {r.e2e_s:8.3f} s  TTFT {1000 * r.ttft_s:8.2f} ms  "
        f"TPOT {1000 * r.tpot_s:7.3f} ms  {r.decode_tokens_per_s:9.1f} tok/s  "
        f"roofline {r.roofline_tokens_per_s:9.1f} tok/s  MBU {r.mbu:6.1%}"
    )
    if r.spec is not None:
        length = "-" if r.spec.mean_acceptance_length is None else f"{r.spec.mean_acceptance_length:.2f}"
        line += (
            f"  | acceptance length {length} "
            f"(drafted {r.spec.num_draft_tokens}, accepted {r.spec.num_accepted_tokens})"
        )
    if r.spec_off is not None:
        line += f"  | spec off {r.spec_off.decode_tokens_per_s:8.1f} tok/s, speedup {r.speedup:5.2f}x"
        if r.paired_speedups:
            line += f" (median of {len(r.paired_speedups)} pairs)"
    if r.hf is not None:
        line += f"  | HF {r.hf.decode_tokens_per_s:8.1f} tok/s, pagelm/HF {r.hf_ratio:6.2f}x"
    print(line, flush=True)
