"""The memory roofline of decoding: the bytes one decode step must read, and the device's
measured copy bandwidth. Their quotient bounds decode speed; memory-bandwidth utilisation
(MBU) is how close a measured step comes to it::

    bytes per step = weights (lm_head as a full vocab x hidden read, embedding rows per sequence)
                   + KV cache at the sequences' context (K and V, every layer)
    MBU            = bytes per step / time per step / copy bandwidth
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig


@dataclass(frozen=True)
class DecodeCost:
    """What one decode step reads, from the model's shapes alone (any engine, any weights)."""

    weight_bytes: int  # every weight except the embedding table; lm_head counted in full
    embedding_row_bytes: int  # one embedding row: each sequence reads one per step
    kv_bytes_per_token: int  # K and V of one token over all layers

    @classmethod
    def from_hf_config(cls, hf_config: PretrainedConfig, dtype: torch.dtype) -> "DecodeCost":
        with torch.device("meta"):  # shapes only: no memory, no init
            model = AutoModelForCausalLM.from_config(hf_config)
        # parameters() lists a tied lm_head once, as the embedding table.
        total = sum(p.numel() for p in model.parameters())
        hidden, vocab = hf_config.hidden_size, hf_config.vocab_size
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        # Tied: the table is read in full once, as lm_head. Untied: the embedding table is
        # only looked up (rows, below) and lm_head is a parameter of its own.
        weights = total if tied else total - vocab * hidden
        head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
        kv_per_token = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim
        itemsize = dtype.itemsize
        return cls(weights * itemsize, hidden * itemsize, kv_per_token * itemsize)

    def bytes_per_step(self, batch_size: int, avg_context_len: float) -> float:
        """Bytes read by one decode step of ``batch_size`` sequences holding ``avg_context_len``
        tokens of KV each."""
        return (
            self.weight_bytes
            + batch_size * self.embedding_row_bytes
            + batch_size * avg_context_len * self.kv_bytes_per_token
        )


def decode_avg_context(input_len: int, output_len: int) -> float:
    """Mean KV length over the decode steps of one request: the step that makes output token
    ``i`` (2..output_len) reads ``input_len + i - 1`` tokens of KV, on average
    ``input_len + output_len / 2``."""
    return input_len + output_len / 2


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Bytes per second of a device-to-device tensor copy, reads plus writes (2 x size per
    copy): the bandwidth a memory-bound kernel can expect, rather than the datasheet's."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch and warm-up
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1000
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes * iters / seconds


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"
