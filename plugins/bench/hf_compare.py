"""The Hugging Face transformers peer of ``--compare hf``: the same architecture and dtype,
random weights, the same prompts. ``generate`` (static batches) is the latency peer;
continuous batching (the manager behind ``generate_batch``) is the throughput peer."""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from pagelm.plugins.bench.workload import TokenWorkload


def build_hf_model(model_dir: str, dtype: torch.dtype, device: torch.device):
    """``AutoModelForCausalLM.from_config`` built on ``device`` directly (an 8B model
    initialises in seconds on a GPU, minutes on the CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def release_memory(device: torch.device, what: str = "HF model") -> None:
    """Return freed tensors' memory to the device once the caller dropped its references, and
    say how much is free for pagelm (its KV pool is sized from what is free)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        print(f"{what} freed: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free", flush=True)


class _TokenClock(StoppingCriteria):
    """A stopping criterion that never stops: it notes when each step's tokens exist, which
    gives HF's TTFT and TPOT the same definitions as pagelm's request metrics."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # generate() syncs every step anyway
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@dataclass
class HFLatency:
    batch_size: int
    output_len: int
    e2e_s: float  # medians over the runs
    ttft_s: float
    tpot_s: float  # (last token time - first token time) / (output_len - 1)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.batch_size / self.tpot_s


@torch.no_grad()
def hf_generate_latency(
    model, prompt_batches: list[list[list[int]]], output_len: int, warmup_batch: list[list[int]]
) -> HFLatency:
    """Greedy ``model.generate`` of exactly ``output_len`` tokens (``min_new_tokens`` keeps EOS
    out) on each batch of equal-length prompts (no padding)."""
    device = model.device

    def generate(prompts: list[list[int]], n: int) -> tuple[float, float, float]:
        ids = torch.tensor(prompts, device=device)
        clock = _TokenClock(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
            do_sample=False, pad_token_id=0, stopping_criteria=StoppingCriteriaList([clock]),
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        end = time.perf_counter()
        assert len(clock.times) == n, f"generate() ran {len(clock.times)} steps, not {n}"
        return end - start, clock.times[0] - start, (clock.times[-1] - clock.times[0]) / (n - 1)

    generate(warmup_batch, min(output_len, 16))
    runs = [generate(p, output_len) for p in prompt_batches]
    e2e, ttft, tpot = (statistics.median(r[i] for r in runs) for i in range(3))
    return HFLatency(len(prompt_batches[0]), output_len, e2e, ttft, tpot)


@torch.no_grad()
def hf_continuous_batching(model, workload: TokenWorkload, temperature: float) -> tuple[float, int]:
    """The workload through transformers' continuous batching. ``generate_batch`` takes one
    ``max_new_tokens`` for all prompts, so requests go to its manager one by one, each with its
    own length and EOS off (``eos_token_id=-1``); the clock runs from the first request queued
    to the last one finished (the manager's warm-up, CUDA graph capture included, is before).
    Returns (seconds, output tokens)."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    # top_k=0: plain temperature sampling (transformers would otherwise default to top-k 50).
    sampling = dict(do_sample=False)
    if temperature > 0:
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    config = GenerationConfig(max_new_tokens=max(workload.output_lens), eos_token_id=-1, pad_token_id=0, **sampling)
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in workload.prompt_token_ids),
        max_generated_length=max(workload.output_lens),
        num_requests=len(workload.output_lens),
    )
    with model.continuous_batching_context_manager(
        generation_config=config, block=True, timeout=5, workload_hints=hints
    ) as manager:
        start = time.perf_counter()
        ids = [
            manager.add_request(p, max_new_tokens=n, eos_token_id=-1)
            for p, n in zip(workload.prompt_token_ids, workload.output_lens)
        ]
        if None in ids:
            raise RuntimeError("transformers' continuous batching manager refused a request")
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped before finishing")
                continue
            if result.is_finished():
                results[result.request_id] = result
        elapsed = time.perf_counter() - start
    failed = [r.error for r in results.values() if r.error is not None]
    if failed:
        raise RuntimeError(f"transformers' continuous batching failed {len(failed)} request(s): {failed[0]}")
    return elapsed, sum(len(r.generated_tokens) for r in results.values())
