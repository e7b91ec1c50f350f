"""The reference attention backend: plain torch, CPU and CUDA, one request at a time.

Every other backend is tested against this one, so it favours obviousness over speed: K/V
are scattered into the paged cache through ``slot_mapping``, then each request gathers its
blocks through its ``block_table`` row and runs masked attention in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagelm.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
)


@dataclass
class TorchAttentionMetadata:
    common: CommonAttentionMetadata
    # Host copies as Python ints: the per-request loop below must not sync on every layer.
    query_start_loc: list[int]
    seq_lens: list[int]


class TorchMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        return TorchAttentionMetadata(
            common=common,
            query_start_loc=common.query_start_loc_cpu.tolist(),
            seq_lens=common.seq_lens_cpu.tolist(),
        )


class TorchAttentionImpl(AttentionImpl):
    def forward(self, query, key, value, kv_cache, metadata: TorchAttentionMetadata):
        spec = self.spec
        common = metadata.common
        num_tokens = common.num_actual_tokens
        key = key[:num_tokens].view(-1, spec.num_kv_heads, spec.head_dim)
        value = value[:num_tokens].view(-1, spec.num_kv_heads, spec.head_dim)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        block_size = key_cache.shape[1]
        slots = common.slot_mapping[:num_tokens]
        key_cache.view(-1, spec.num_kv_heads, spec.head_dim).index_copy_(0, slots, key)
        value_cache.view(-1, spec.num_kv_heads, spec.head_dim).index_copy_(0, slots, value)

        query = query.view(-1, spec.num_heads, spec.head_dim)
        out = torch.empty_like(query)
        group = spec.num_heads // spec.num_kv_heads
        qsl, seq_lens = metadata.query_start_loc, metadata.seq_lens
        for i in range(common.num_reqs):
            start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
            if end == start:
                continue
            num_blocks = -(-seq_len // block_size)
            blocks = common.block_table[i, :num_blocks].long()
            k = key_cache[blocks].reshape(-1, spec.num_kv_heads, spec.head_dim)[:seq_len]
            v = value_cache[blocks].reshape(-1, spec.num_kv_heads, spec.head_dim)[:seq_len]
            q = query[start:end]
            mask = _causal_mask(end - start, seq_len, spec.sliding_window, q.device)
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1).float(),
                k.transpose(0, 1).repeat_interleave(group, dim=0).float(),
                v.transpose(0, 1).repeat_interleave(group, dim=0).float(),
                attn_mask=mask,
                scale=spec.scale,
            )
            out[start:end] = o.transpose(0, 1).to(out.dtype)
        return out.view(-1, spec.num_heads * spec.head_dim)


def _causal_mask(query_len: int, seq_len: int, sliding_window: int | None, device) -> torch.Tensor:
    """Query ``i`` sits at position ``seq_len - query_len + i`` and sees keys at or before it
    (and, with a sliding window ``w``, only the last ``w`` of them)::

        keys ->   0 1 2 3 4 5
        q@4     [ x x x x x . ]
        q@5     [ x x x x x x ]
    """
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    supports_sliding_window = True
    # The CPU's backend, and the last resort on CUDA.
    auto_priority = {"cpu": 100, "cuda": 0}

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim):
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @classmethod
    def make_metadata_builder(cls, device: torch.device) -> TorchMetadataBuilder:
        return TorchMetadataBuilder()

    @classmethod
    def make_impl(cls, spec: AttentionSpec) -> TorchAttentionImpl:
        return TorchAttentionImpl(spec)
