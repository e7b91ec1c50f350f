"""Engine configuration: one dataclass whose field names are the `LLM` keyword arguments,
the CLI's long flags and the YAML keys. Checked once, before any weight is loaded."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}
# Integer settings and their least value (a field that may be None takes its default then).
_AT_LEAST = {
    "num_kv_blocks": 1, "max_model_len": 1, "max_num_seqs": 1, "max_num_batched_tokens": 1,
    "max_num_partial_prefills": 1, "max_stalled_preemptions": 1, "num_cpu_blocks": 0,
    "structured_output_cache_bytes": 0, "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
    "data_parallel_size": 1, "max_num_encoder_input_tokens": 1, "encoder_cache_size": 1,
}

# max_num_batched_tokens when it is not given, by device type. On a CPU a smaller step is
# faster per token as well as earlier (16 x 768-token prompts on 2 cores: 428 out tok/s at
# 8192, 446 at 4096, 470 at 2048; docs/benchmarks.md), as vLLM's CPU build also takes a
# smaller step than its GPU one. Chunked prefill is always on, so a prompt longer than the
# step is split, never refused.
_DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cuda": 8192, "cpu": 2048}


def default_max_num_batched_tokens(device_type: str) -> int:
    """The step's token budget on ``device_type`` ("cpu" or "cuda") when none is given."""
    return _DEFAULT_MAX_NUM_BATCHED_TOKENS[device_type]


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    # Bytes of KV cache to reserve on CPU when num_kv_blocks is not given.
    cpu_kv_cache_space: int = 1 << 30
    max_model_len: int | None = None
    max_num_seqs: int = 256
    # Most tokens one step schedules; None: by device (default_max_num_batched_tokens).
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    scheduling_policy: str = "fcfs"
    # A second KV tier in host memory (pagelm.kv_offload): swap_space GiB of it (vLLM's name;
    # 0 = off), or num_cpu_blocks blocks; kv_offload names the registered tier (built in:
    # "cpu"). preemption_mode: "recompute" frees a victim's blocks, "swap" copies them to the
    # tier when it has room, "auto" whichever costs less per victim (recompute without a tier).
    swap_space: float = 0.0
    num_cpu_blocks: int | None = None
    kv_offload: str = "cpu"
    preemption_mode: str = "auto"
    # Progress whatever the policy does: a request preempted this many times in a row
    # without producing a token is no longer a victim until it finishes.
    max_stalled_preemptions: int = 8
    # "auto": the usable registered backend with the highest auto_priority for the device
    # (built-in: triton, then flashinfer, then torch on CUDA; torch on CPU; logged at start-up).
    attention_backend: str = "auto"
    load_format: str = "auto"
    # None: CUDA graphs for decode when the device and the attention backend allow them;
    # True: never; False: required (a backend that is not graph safe is then an error).
    enforce_eager: bool | None = None
    # Schedule and launch each step while the previous one runs on the device, so that the
    # host work between steps (outputs, the next schedule, its inputs) overlaps the GPU.
    # None: on where CUDA graphs are used; True: on, also on CPU; False: off. With speculative
    # decoding only steps in which nobody may draft run ahead, and not at all with a proposer
    # that must see every step (EAGLE: True is then an error).
    async_scheduling: bool | None = None
    # No tokenizer at all (vLLM's name): prompts must be token ids and outputs carry token ids
    # with empty text. For model directories without tokenizer files (benchmark presets).
    skip_tokenizer_init: bool = False
    # Let a model directory's own Python code (``auto_map`` in config.json or
    # tokenizer_config.json) run while its config and tokenizer load, as vLLM's flag. Off:
    # such a model is an error, and transformers never asks on the terminal.
    trust_remote_code: bool = False
    # Guided decoding: the registered backend that compiles grammars (checked at start-up;
    # its library only when a request first uses it), the compiled-grammar cache's memory
    # bound, and how long one compile may take before its requests fail.
    structured_output_backend: str = "xgrammar"
    structured_output_cache_bytes: int = 512 << 20
    structured_output_compile_timeout: float = 30.0
    # Advance the guided requests' grammars and fill their bitmask rows in the backend's
    # offload (xgrammar's: a child process) instead of a thread of the engine's: the
    # step loop then never waits for the GIL on grammar work. None: on where the engine runs
    # on CUDA with async scheduling (there the host time of a step is what it costs).
    structured_output_process: bool | None = None
    # Speculative decoding: {"method": "ngram" | "eagle" | "medusa", "num_speculative_tokens":
    # k, ...} (see pagelm.spec_decode.config); None = off.
    speculative_config: dict[str, Any] | None = None
    # Most logprobs (and prompt_logprobs) one request may ask for, as vLLM's max_logprobs:
    # each is a top-k over the vocabulary every step. -1: up to the vocabulary size.
    max_logprobs: int = 20
    # Scale-out, with vLLM's names: ranks that each hold a slice of every layer (tensor
    # parallel), stages that each hold a run of layers (pipeline parallel), whole engine
    # replicas behind one API (data parallel), and the registered executor that starts the
    # ranks beside the engine core's own (None: "uni" for one rank, "mp" for local
    # processes otherwise). Collectives that wait longer than distributed_timeout seconds
    # fail the step (a rank died).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    # With data_parallel_size > 1: the registered router that picks each request's replica
    # (built in: round_robin, least_loaded, prefix_affinity; see pagelm.plugins.routers.router).
    data_parallel_router: str = "least_loaded"
    distributed_executor_backend: str | None = None
    distributed_timeout: float = 300.0
    # Tensor parallel on CUDA: small all-reduces over symmetric memory instead of NCCL
    # (pagelm.distributed); True keeps NCCL for every all-reduce.
    disable_custom_all_reduce: bool = False
    # Vision-language models (pagelm.multimodal): images one prompt may carry per modality
    # (None: {"image": 16}), embeddings the vision encoder may make per step, and embeddings
    # the encoder cache holds (None: max_num_batched_tokens, at least 16,384, so that one
    # large image always fits).
    limit_mm_per_prompt: dict[str, int] | None = None
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None
    # Extra, plugin-specific settings (e.g. a policy's knobs) pass through untouched.
    plugin_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = default_max_num_batched_tokens(self._device_type())
        problems = self.problems()
        if problems:
            raise ValueError("invalid engine config: " + "; ".join(problems))

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(
                f"unknown engine argument(s) {unknown}; known arguments: {sorted(names - {'model'})}"
            )
        return cls(model=model, **kwargs)

    def problems(self) -> list[str]:
        out = []
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            out.append(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            out.append(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            out.append(f"block_size must be a power of two in [1, 128], got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            out.append(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name, least in _AT_LEAST.items():
            value = getattr(self, name)
            if value is not None and value < least:
                out.append(f"{name} must be >= {least}, got {value}")
        if self.long_prefill_token_threshold < 0:
            out.append(
                f"long_prefill_token_threshold must be >= 0 (0 = off), got {self.long_prefill_token_threshold}"
            )
        if not self.swap_space >= 0:
            out.append(f"swap_space must be >= 0 GiB (0 = no CPU tier), got {self.swap_space}")
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            out.append(f"preemption_mode must be 'auto', 'swap' or 'recompute', got {self.preemption_mode!r}")
        elif self.preemption_mode == "swap" and not self.kv_offload_enabled:
            out.append("preemption_mode='swap' needs a CPU tier: set swap_space (GiB) > 0 or num_cpu_blocks > 0")
        if not self.structured_output_compile_timeout > 0:
            out.append(
                f"structured_output_compile_timeout must be > 0 seconds, got {self.structured_output_compile_timeout}"
            )
        if self.max_logprobs < -1:
            out.append(f"max_logprobs must be >= 0, or -1 for the vocabulary size, got {self.max_logprobs}")
        if self.limit_mm_per_prompt is not None:
            if not isinstance(self.limit_mm_per_prompt, dict) or any(
                k != "image" or not isinstance(v, int) or v < 0 for k, v in self.limit_mm_per_prompt.items()
            ):
                out.append(f"limit_mm_per_prompt must be like {{'image': N}} with N >= 0, got {self.limit_mm_per_prompt!r}")
        if not self.distributed_timeout > 0:
            out.append(f"distributed_timeout must be > 0 seconds, got {self.distributed_timeout}")
        # load_format names a registered model loader, looked up when the engine starts, as
        # speculative_config is checked when the engine starts, after its method is looked up
        # among the registered proposers (EngineCore._proposer_class).
        return out

    @property
    def kv_offload_enabled(self) -> bool:
        """Whether the engine has a second KV tier (``swap_space`` or ``num_cpu_blocks``)."""
        return bool(self.num_cpu_blocks) if self.num_cpu_blocks is not None else self.swap_space > 0

    @property
    def encoder_budget(self) -> int:
        """Embeddings the vision encoder may make per step (``max_num_encoder_input_tokens``)."""
        return self.max_num_encoder_input_tokens or max(self.max_num_batched_tokens, 16384)

    @property
    def encoder_cache_embeddings(self) -> int:
        """Embeddings the encoder cache holds (``encoder_cache_size``)."""
        return self.encoder_cache_size or max(self.max_num_batched_tokens, 16384)

    @property
    def image_limit(self) -> int:
        """The most images one prompt may carry (``limit_mm_per_prompt``)."""
        from pagelm.multimodal import DEFAULT_IMAGE_LIMIT

        return (self.limit_mm_per_prompt or {}).get("image", DEFAULT_IMAGE_LIMIT)

    @property
    def world_size(self) -> int:
        """Ranks of one engine: every stage's tensor-parallel ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"

    @property
    def speculative(self):
        """``speculative_config`` parsed (a ``SpeculativeConfig``), or None when off."""
        if self.speculative_config is None:
            return None
        from pagelm.spec_decode.config import SpeculativeConfig

        return SpeculativeConfig.from_dict(self.speculative_config)

    def _device_type(self) -> str:
        """``"cpu"`` or ``"cuda"``, as ``resolved_device`` will pick (without its check)."""
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return "cpu" if self.device == "cpu" else "cuda"

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} was asked for but CUDA is not available")
        return dev

    def resolved_dtype(self, hf_config: Any) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        name = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(name, torch.dtype):
            return name
        if isinstance(name, str) and name in _DTYPES:
            return _DTYPES[name]
        return torch.float32
