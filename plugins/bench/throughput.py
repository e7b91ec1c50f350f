"""``pagelm bench throughput``: one offline batch of many requests through ``LLM.generate``.

Workloads (token ids, EOS ignored, so every request makes exactly its output length):

- ``nano-vllm``: nano-vllm's ``bench.py`` draw for draw: 256 sequences, ``random.seed(0)``,
  prompt lengths uniform in [100, 1024] of ids uniform in [0, 10000], output lengths uniform in
  [100, 1024], temperature 0.6: 142,827 prompt and 133,966 output tokens.
- ``fixed``: ``--num-seqs`` prompts of exactly ``--input-len`` ids, ``--output-len`` each.
- ``shared-prefix``: ``--num-seqs`` prompts of one shared ``--prefix-len``-id system prompt
  followed by ``--input-len`` ids of their own, ``--output-len`` each (the prefix cache serves
  the prefix; with ``--plugin-config '{"flashinfer": {"cascade_attention_min_blocks": N}}'``
  vs without, cascade attention on vs off).

Reported: wall time of the timed ``generate`` (after a short warm-up), requests/s, output
tokens/s (nano-vllm's figure) and total (prompt + output) tokens/s.

``--compare hf`` first runs the workload (or its first ``--hf-num-seqs`` requests) through
Hugging Face transformers' continuous batching, the engine behind ``generate_batch``, with
each request's own output length; then frees it and runs pagelm.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pagelm.plugins.bench.hf_compare import build_hf_model, hf_continuous_batching, release_memory
from pagelm.plugins.bench.latency import add_model_arg
from pagelm.plugins.bench.presets import resolve_bench_model
from pagelm.plugins.bench.roofline import device_name
from pagelm.plugins.bench.workload import TokenWorkload
from pagelm.plugins.engine_args import add_engine_args, engine_kwargs


def add_parser(sub) -> None:
    p = sub.add_parser(
        "throughput", help="offline throughput of one large batch (nano-vllm's workload or fixed shapes)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arg(p)
    p.add_argument(
        "--workload", choices=["nano-vllm", "fixed", "shared-prefix"], default="nano-vllm",
        help="request shapes (default: %(default)s)",
    )
    p.add_argument(
        "--prefix-len", type=int, default=2048, help="shared-prefix: tokens every prompt shares (default: %(default)s)"
    )
    p.add_argument("--num-seqs", type=int, default=256, help="requests (default: %(default)s)")
    p.add_argument(
        "--input-len", type=int, default=1024,
        help="prompt tokens: exact (fixed), the most (nano-vllm) or after the prefix (shared-prefix) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--output-len", type=int, default=1024,
        help="output tokens: exact (fixed) or the most (nano-vllm) (default: %(default)s)",
    )
    p.add_argument(
        "--temperature", type=float, default=0.6,
        help="sampling temperature, 0 = greedy (default: %(default)s, nano-vllm's)",
    )
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the workload (default: %(default)s)")
    p.add_argument("--compare", choices=["hf"], help="also run Hugging Face transformers' continuous batching")
    p.add_argument(
        "--hf-num-seqs", type=int, help="give HF only the first N requests (default: all); tokens/s stay comparable"
    )
    p.add_argument("--json", type=Path, help="write the results to this JSON file")
    add_engine_args(p)
    p.set_defaults(func=run)


@dataclass
class ThroughputResult:
    target: str  # "pagelm" or "hf"
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def as_dict(self) -> dict:
        return {
            **asdict(self), "requests_per_s": self.num_requests / self.elapsed_s,
            "output_tokens_per_s": self.output_tokens_per_s, "total_tokens_per_s": self.total_tokens_per_s,
        }


def make_workload(args: argparse.Namespace, vocab_size: int) -> TokenWorkload:
    if args.workload == "nano-vllm":
        return TokenWorkload.nano_vllm(args.num_seqs, args.input_len, args.output_len, args.workload_seed)
    if args.workload == "shared-prefix":
        return TokenWorkload.shared_prefix(
            args.num_seqs, args.prefix_len, args.input_len, args.output_len, vocab_size, args.workload_seed
        )
    return TokenWorkload.fixed(args.num_seqs, args.input_len, args.output_len, vocab_size, args.workload_seed)


def measure_pagelm(llm, workload: TokenWorkload, warmup: TokenWorkload, temperature: float) -> ThroughputResult:
    from pagelm import SamplingParams

    # Warm-up (kernels, allocator, CUDA graphs), like nano-vllm's, on other prompts than the
    # timed ones: the prefix cache must not start warm.
    warm = [{"prompt_token_ids": p} for p in warmup.prompt_token_ids]
    llm.generate(warm, SamplingParams(max_tokens=warmup.output_lens[0], ignore_eos=True), use_tqdm=False)
    prompts = [{"prompt_token_ids": p} for p in workload.prompt_token_ids]
    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=n) for n in workload.output_lens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert output_tokens == workload.num_output_tokens, "an ignore_eos request stopped early"
    return ThroughputResult("pagelm", len(outs), workload.num_prompt_tokens, output_tokens, elapsed)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from pagelm import LLM
    from pagelm.config import EngineConfig

    model_dir, kwargs = resolve_bench_model(args.model, engine_kwargs(args))
    config = EngineConfig.from_kwargs(model_dir, **kwargs)
    hf_config = AutoConfig.from_pretrained(model_dir)
    device, dtype = config.resolved_device(), config.resolved_dtype(hf_config)
    workload = make_workload(args, hf_config.vocab_size)
    print(
        f"{args.model} on {device_name(device)}, {dtype}: workload {args.workload}, {len(workload.output_lens)} "
        f"requests, {workload.num_prompt_tokens} prompt and {workload.num_output_tokens} output tokens",
        flush=True,
    )
    results = []
    if args.compare == "hf":
        hf_workload = workload.head(args.hf_num_seqs) if args.hf_num_seqs else workload
        model = build_hf_model(model_dir, dtype, device)
        elapsed, output_tokens = hf_continuous_batching(model, hf_workload, args.temperature)
        results.append(
            ThroughputResult("hf", len(hf_workload.output_lens), hf_workload.num_prompt_tokens, output_tokens, elapsed)
        )
        print_row(results[-1])
        del model
        release_memory(device)

    llm = LLM(model_dir, **kwargs)
    if args.workload == "shared-prefix":
        # A shared prefix of its own (not the timed one's, which must not start cached), over
        # enough requests that cascade attention engages, so that its kernels are built
        # (FlashInfer JIT) before the clock starts.
        warmup = TokenWorkload.shared_prefix(32, args.prefix_len, 16, 16, hf_config.vocab_size, args.workload_seed + 1)
    else:
        warmup = TokenWorkload.fixed(8, min(args.input_len, 128), 16, hf_config.vocab_size, args.workload_seed + 1)
    results.append(measure_pagelm(llm, workload, warmup, args.temperature))
    print_row(results[-1])
    if args.compare == "hf":
        print(f"pagelm / HF (output tokens/s): {results[1].output_tokens_per_s / results[0].output_tokens_per_s:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({
            "benchmark": "throughput", "model": args.model, "workload": args.workload, "device": device_name(device),
            "dtype": str(dtype), "temperature": args.temperature, "engine_args": kwargs,
            "results": [r.as_dict() for r in results],
        }, indent=2))
    return 0


def print_row(r: ThroughputResult) -> None:
    print(
        f"{r.target:>7}: {r.num_requests} requests, {r.prompt_tokens} prompt + {r.output_tokens} output tokens "
        f"in {r.elapsed_s:.2f} s: {r.num_requests / r.elapsed_s:.2f} req/s, "
        f"{r.output_tokens_per_s:.1f} output tok/s, {r.total_tokens_per_s:.1f} total tok/s",
        flush=True,
    )
