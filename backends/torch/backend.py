"""The ``torch`` attention backend: plain torch on CPU and CUDA, the CPU's default.

Every other backend is tested against it, and it is tested against dense causal attention
(``tests/test_torch_backend.py``). It is also what every CPU user and CI runs, so the work of a
step is laid out once in the metadata builder, and each layer then makes a few large torch
calls rather than a loop of small ones per request:

* **decode rows** (one query token each) attend together in one
  ``scaled_dot_product_attention`` call over their blocks, keys and values gathered with one
  ``index_select`` into a buffer the layers share (a padded ``[batch, kv_heads,
  blocks * block_size, head_dim]`` view, each request's head one contiguous matrix; an
  additive mask, made once per step, hides the padding). Grouped-query heads share their
  K/V through ``enable_gqa``, never copied. Rows of a few tokens after a cached prefix (up to
  ``SHORT_QUERY_LEN``: a speculative verification's ``1 + k``) join them, each padded to
  the longest, the mask causal per query row.
* **prefill rows** (more query tokens) run one call each: a prompt with nothing cached
  attends over the step's own keys with ``is_causal`` (no mask); a chunk after a cached
  prefix gathers its blocks and passes the offset causal mask. Both as 4-D tensors, which
  torch's fused CPU kernel needs (3-D ones take its unfused math path).

Attention runs in float32, as the reference always has (a no-op for float32 models).
"""

from __future__ import annotations

import math
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


# Rows of up to this many query tokens after a cached prefix are batched with the decode
# rows (a speculative verification has 1 + k). A verification step of 32 requests went
# through 32 attention calls a layer before, and cost two plain steps on the CPU.
SHORT_QUERY_LEN = 8


@dataclass
class DecodeRows:
    """The step's requests of one query token (decode) or a few after a cached prefix,
    batched, each padded to ``query_len`` rows: which tokens they are (None: tokens
    ``0..n-1``, the whole step, one each), which of the ``n * query_len`` rows are real (None:
    all), their blocks flattened row by row, each query row's position, and which of the
    padded key positions each query row may see (as a bool, and as the float32 mask
    attention adds, 0 or -inf: every layer without a sliding window shares it). A padding
    row repeats its request's last token and sees what it sees."""

    token_index: torch.Tensor | None  # [n * query_len] int64
    real_rows: torch.Tensor | None  # [m] int64 indices into the n * query_len rows
    query_len: int
    block_ids: torch.Tensor  # [n * blocks_per_row] int64
    blocks_per_row: int
    query_pos: torch.Tensor  # [n, query_len] int64, on the block table's device
    visible: torch.Tensor  # [n, query_len, blocks_per_row * block_size] bool
    mask: torch.Tensor  # [n, 1, query_len, blocks_per_row * block_size] float32


@dataclass
class PrefillRow:
    """One request with several query tokens: ``start:end`` in the step, ``seq_len`` with
    what it had cached, and its blocks (None: nothing cached, attend over the step's keys)."""

    start: int
    end: int
    seq_len: int
    block_ids: torch.Tensor | None


class GatherBuffer:
    """Where each layer's ``index_select`` of KV blocks lands: one buffer, grown as needed and
    kept across layers and steps. A fresh tensor per gather cost more than the copy itself
    (16 decodes over 800 keys: 13 MB a layer, 3.7 -> 1.0 ms on one core, from the pages a new
    allocation of that size faults in). A layer's attention has read its gather before the
    next gather writes, so one buffer serves them all."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def take(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A contiguous ``shape`` tensor of ``like``'s dtype and device (contents undefined)."""
        numel = math.prod(shape)
        buf = self._buf
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            # A quarter to spare, so that contexts growing a block at a time do not reallocate
            # every step.
            self._buf = buf = torch.empty(numel + numel // 4, dtype=like.dtype, device=like.device)
        return buf[:numel].view(shape)


@dataclass
class TorchAttentionMetadata:
    common: CommonAttentionMetadata
    decode: DecodeRows | None
    prefills: list[PrefillRow]
    gather_buffer: GatherBuffer


class TorchMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self) -> None:
        self.gather_buffer = GatherBuffer()

    def build(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        # Host copies as Python ints, read once per step: no layer syncs on the device.
        qsl = common.query_start_loc_cpu.tolist()
        seq_lens = common.seq_lens_cpu.tolist()
        block_size = common.block_size
        decodes, prefills = [], []
        for i in range(common.num_reqs):
            start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
            if end - start == 1 or (end - start <= SHORT_QUERY_LEN and seq_len > end - start):
                decodes.append(i)
            elif end > start:
                cached = seq_len > end - start
                blocks = common.block_table[i, : -(-seq_len // block_size)].long() if cached else None
                prefills.append(PrefillRow(start, end, seq_len, blocks))
        decode = _decode_rows(common, decodes, qsl, seq_lens) if decodes else None
        return TorchAttentionMetadata(common, decode, prefills, self.gather_buffer)


def _decode_rows(common: CommonAttentionMetadata, decodes: list[int], qsl: list[int], seq_lens: list[int]) -> DecodeRows:
    """The batched rows of requests ``decodes`` (their query tokens ``qsl[i]:qsl[i + 1]``)."""
    device, block_size = common.block_table.device, common.block_size
    query_lens = [qsl[i + 1] - qsl[i] for i in decodes]
    q = max(query_lens)
    width = -(-max(seq_lens[i] for i in decodes) // block_size)
    rows = torch.tensor(decodes, device=device)
    if q == 1:
        token_index = None if len(decodes) == common.num_actual_tokens else torch.tensor([qsl[i] for i in decodes], device=device)
        real_rows = None
        query_pos = torch.tensor([seq_lens[i] - 1 for i in decodes], device=device)[:, None]
    else:  # row j of request i: its token min(j, len - 1), at position seq_len - len + that
        token_index = torch.tensor([qsl[i] + min(j, n - 1) for i, n in zip(decodes, query_lens) for j in range(q)], device=device)
        real_rows = None if all(n == q for n in query_lens) else torch.tensor(
            [r * q + j for r, n in enumerate(query_lens) for j in range(n)], device=device
        )
        query_pos = torch.tensor(
            [[seq_lens[i] - n + min(j, n - 1) for j in range(q)] for i, n in zip(decodes, query_lens)], device=device
        )
    visible = torch.arange(width * block_size, device=device)[None, None, :] <= query_pos[:, :, None]
    mask = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))
    return DecodeRows(
        token_index=token_index,
        real_rows=real_rows,
        query_len=q,
        block_ids=common.block_table[rows, :width].long().flatten(),
        blocks_per_row=width,
        query_pos=query_pos,
        visible=visible,
        mask=mask[:, None],
    )


class TorchAttentionImpl(AttentionImpl):
    def forward(self, query, key, value, kv_cache, metadata: TorchAttentionMetadata):
        spec = self.spec
        common = metadata.common
        num_tokens = common.num_actual_tokens
        key = key[:num_tokens].view(-1, spec.num_kv_heads, spec.head_dim)
        value = value[:num_tokens].view(-1, spec.num_kv_heads, spec.head_dim)
        slots = common.slot_mapping[:num_tokens]
        # [2, kv_heads, num_blocks * block_size, dim]: a slot is a column per head.
        heads = kv_cache.view(2, spec.num_kv_heads, -1, spec.head_dim)
        heads[0].index_copy_(1, slots, key.transpose(0, 1))
        heads[1].index_copy_(1, slots, value.transpose(0, 1))

        query = query.view(-1, spec.num_heads, spec.head_dim)
        out = torch.empty_like(query)
        if metadata.decode is not None:
            rows = metadata.decode
            n = rows.query_pos.shape[0]
            q = query[:n] if rows.token_index is None else query.index_select(0, rows.token_index)
            o = self._decode(q, kv_cache, rows, metadata.gather_buffer)
            if rows.token_index is None:
                out[:n] = o
            elif rows.real_rows is None:
                out.index_copy_(0, rows.token_index, o)
            else:  # padding rows dropped (each repeats a real one)
                out.index_copy_(0, rows.token_index[rows.real_rows], o[rows.real_rows])
        for row in metadata.prefills:
            q = query[row.start : row.end]
            if row.block_ids is None:
                k, v = key[row.start : row.end].transpose(0, 1), value[row.start : row.end].transpose(0, 1)
            else:
                k, v = _gather(kv_cache, row.block_ids, metadata.gather_buffer)[:, :, : row.seq_len]
            out[row.start : row.end] = self._prefill(q, k, v, row.seq_len)
        return out.view(-1, spec.num_heads * spec.head_dim)

    def _decode(self, q, kv_cache, rows: DecodeRows, buffer: GatherBuffer) -> torch.Tensor:
        """``q`` [n * query_len, heads, dim] -> the same, each row over its request's padded
        blocks, as far as its own position.

        One query row per head, ``enable_gqa``, as before the cache went heads-outermost.
        Going in as ``[n, kv_heads, group, dim]`` (a KV head's query heads as its rows) was
        ~10% faster on its own, but changed the bits enough that the exact logprob
        comparison of a pipelined run with a one-stage one
        (``tests/test_pipeline_parallel.py``) failed; its cause was not pinned down."""
        spec = self.spec
        (n, ql), width = rows.query_pos.shape, rows.visible.shape[2]
        # [2, kv_heads, n, width, dim] -> each of k, v [n, kv_heads, width, dim], every
        # (row, head) a contiguous [width, dim] matrix.
        k, v = _gather(kv_cache, rows.block_ids, buffer).view(2, spec.num_kv_heads, n, width, spec.head_dim).transpose(1, 2)
        mask = rows.mask
        if spec.sliding_window is not None:
            k_pos = torch.arange(width, device=q.device)[None, None, :]
            mask = (rows.visible & (k_pos > rows.query_pos[:, :, None] - spec.sliding_window))[:, None]
        # [n * ql, heads, dim] -> [n, heads, ql, dim] (one token: the view decode always had)
        q4 = q[:, :, None] if ql == 1 else q.view(n, ql, spec.num_heads, spec.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q4.float(),
            k.float(),
            v.float(),
            attn_mask=mask,
            scale=spec.scale,
            enable_gqa=spec.num_heads != spec.num_kv_heads,
        )
        if ql == 1:
            return o[:, :, 0].to(q.dtype)
        return o.transpose(1, 2).reshape(n * ql, spec.num_heads, spec.head_dim).to(q.dtype)

    def _prefill(self, q, k, v, seq_len: int) -> torch.Tensor:
        """One request's ``q`` [L, heads, dim], the last ``L`` of its ``seq_len`` positions,
        over its keys ``k``/``v`` [kv_heads, seq_len, dim].

        The tensors go in as ``[1, heads, L, dim]``: torch's fused CPU kernel takes 4-D inputs
        only, and 3-D ones fell back to the unfused math path (the whole ``L x L`` score
        matrix, GQA heads copied): 3.3x slower on 760-token prompts, the largest part of a
        long prompt's prefill."""
        spec = self.spec
        query_len = q.shape[0]
        mask = None
        if query_len != seq_len or spec.sliding_window is not None:
            mask = _causal_mask(query_len, seq_len, spec.sliding_window, q.device)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None].float(),
            k[None].float(),
            v[None].float(),
            attn_mask=mask,
            is_causal=mask is None,
            scale=spec.scale,
            enable_gqa=spec.num_heads != spec.num_kv_heads,
        )
        return o[0].transpose(0, 1).to(q.dtype)


def _gather(kv_cache: torch.Tensor, block_ids: torch.Tensor, buffer: GatherBuffer) -> torch.Tensor:
    """Keys and values of blocks ``block_ids`` as one ``[2, kv_heads, len * block_size, dim]``
    tensor, in ``buffer``: one ``index_select`` for keys and values and every head (several
    times faster on the CPU than indexing with a tensor), each block of a head one contiguous
    row of ``block_size * dim``."""
    _, kv_heads, num_blocks, block_size, dim = kv_cache.shape
    rows = kv_cache.view(2 * kv_heads, num_blocks, block_size * dim)
    out = buffer.take((2 * kv_heads, block_ids.shape[0], block_size * dim), like=kv_cache)
    torch.index_select(rows, 1, block_ids, out=out)
    return out.view(2, kv_heads, -1, dim)


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
        # Heads outermost: a head's block is one contiguous [block_size, dim] tile, so a gather
        # of blocks hands attention each (request, head)'s keys as one contiguous matrix.
        return (2, num_kv_heads, num_blocks, block_size, head_dim)

    @classmethod
    def make_metadata_builder(cls, device: torch.device) -> TorchMetadataBuilder:
        return TorchMetadataBuilder()

    @classmethod
    def make_impl(cls, spec: AttentionSpec) -> TorchAttentionImpl:
        return TorchAttentionImpl(spec)
