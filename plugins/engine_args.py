"""Engine flags for the subcommands that build an engine (``serve``, ``generate``, ``bench``):
one flag per ``EngineConfig`` field (``--max-num-seqs`` for ``max_num_seqs``), plus ``--config
file.yaml`` whose keys are the same names. Precedence: defaults < YAML < flags given."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from pagelm.config import EngineConfig

_HELP = {
    "tokenizer": "tokenizer directory (default: the model directory)",
    "dtype": "auto, float32, bfloat16 or float16",
    "device": "auto, cpu, cuda or cuda:N",
    "seed": "engine seed for unseeded sampling",
    "block_size": "tokens per KV cache block",
    "num_kv_blocks": "KV cache blocks (default: sized from memory)",
    "gpu_memory_utilization": "fraction of GPU memory pagelm may use",
    "cpu_kv_cache_space": "bytes of KV cache on CPU when num_kv_blocks is unset",
    "swap_space": "GiB of host memory per GPU for the CPU tier of the KV cache (swap preemption, prefix spill; "
    "0 = none)",
    "num_cpu_blocks": "blocks in the CPU tier of the KV cache (default: sized from --swap-space)",
    "kv_offload": "registered KV offload tier name (see `pagelm plugins`)",
    "preemption_mode": "auto (swap a victim to the CPU tier where copying is cheaper), swap or recompute",
    "max_model_len": "longest sequence (prompt + output); default from config.json",
    "max_num_seqs": "most requests in one step",
    "max_num_batched_tokens": "most tokens in one step (unset: 8192 on CUDA, 2048 on CPU)",
    "enable_prefix_caching": "reuse KV blocks of identical prefixes",
    "long_prefill_token_threshold": "cap on one request's prefill chunk per step (0 = off)",
    "max_num_partial_prefills": "most requests with an unfinished prompt per step",
    "scheduling_policy": "registered scheduling policy name (see `pagelm plugins`)",
    "attention_backend": "registered attention backend name (see `pagelm plugins`) or auto",
    "load_format": "a registered model loader: auto, safetensors or dummy (random weights)",
    "tensor_parallel_size": "ranks that each hold a slice of every layer (one process each)",
    "pipeline_parallel_size": "pipeline stages, each holding a run of layers (one process per stage and tensor rank)",
    "data_parallel_size": "engine replicas behind one API, each with its own scheduler and KV cache",
    "data_parallel_router": "registered router picking each request's replica: round_robin, least_loaded, prefix_affinity",
    "distributed_executor_backend": "how ranks are started: uni (one), mp (local processes), or a registered executor",
    "distributed_timeout": "seconds a collective may wait for the other ranks before the step fails",
    "disable_custom_all_reduce": "tensor parallel on CUDA: NCCL for every all-reduce (default: small ones over "
    "symmetric memory)",
    "enforce_eager": "--enforce-eager: never use CUDA graphs; --no-enforce-eager: require them (unset: when possible)",
    "async_scheduling": "--async-scheduling: schedule the next step while one runs on the device (also on CPU); "
    "--no-async-scheduling: never (unset: with CUDA graphs, without speculative decoding)",
    "skip_tokenizer_init": "load no tokenizer: prompts must be token ids, outputs have no text",
    "trust_remote_code": "run a model directory's own Python code (auto_map) to load its config and tokenizer "
    "(default: off, such a model is an error)",
    "structured_output_backend": "registered guided-decoding backend name (see `pagelm plugins`)",
    "structured_output_cache_bytes": "memory bound of the compiled-grammar cache, in bytes",
    "structured_output_compile_timeout": "seconds one grammar may take to compile before its requests fail",
    "structured_output_process": "--structured-output-process: fill guided bitmasks in a grammar process; "
    "--no-structured-output-process: on a worker thread (unset: the process on CUDA with async scheduling)",
    "max_logprobs": "most logprobs / prompt_logprobs a request may ask for; -1: the vocabulary size",
    "plugin_config": "JSON/YAML mapping of plugin-specific settings",
    "limit_mm_per_prompt": 'most images one prompt may carry, JSON/YAML: {"image": N} (unset: 16)',
    "max_num_encoder_input_tokens": "most image embeddings the vision encoder makes per step "
    "(unset: max_num_batched_tokens, at least 16384)",
    "encoder_cache_size": "image embeddings the encoder cache holds (unset: max_num_batched_tokens, at least 16384)",
    "speculative_config": 'speculative decoding, JSON/YAML: {"method": "ngram"|"eagle"|"medusa", '
    '"num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": n, "model": DIR}',
}


def _flag_type(field: dataclasses.Field) -> Any:
    base = typing.get_type_hints(EngineConfig)[field.name]
    if typing.get_origin(base) in (typing.Union, types.UnionType):  # "int | None" -> int
        base = next(a for a in typing.get_args(base) if a is not type(None))
    if base is bool:
        return "bool"
    if base in (int, float, str):
        return base
    return yaml.safe_load  # dicts


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--config", type=Path, help="YAML file of engine arguments (keys = flag names)")
    for field in dataclasses.fields(EngineConfig):
        if field.name == "model":
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = _flag_type(field)
        default = field.default if field.default is not dataclasses.MISSING else None
        help_text = f"{_HELP.get(field.name, field.name)} (default: {default})"
        if kind == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        else:
            group.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=help_text)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """YAML values overridden by the flags actually given."""
    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    kwargs: dict[str, Any] = {}
    if getattr(args, "config", None):
        loaded = yaml.safe_load(Path(args.config).read_text()) or {}
        loaded = {k.replace("-", "_"): v for k, v in loaded.items()}
        unknown = sorted(set(loaded) - names - {"model"})
        if unknown:
            raise SystemExit(f"{args.config}: unknown engine argument(s) {unknown}")
        kwargs.update(loaded)
    kwargs.update({k: v for k, v in vars(args).items() if k in names})
    return kwargs
