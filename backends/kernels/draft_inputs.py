"""Triton kernels for the speculative graphs' in-graph bookkeeping: what a draft head's CUDA
graph (``EagleDraftGraphs``) derives between its passes, and the verification graph's gather
of drafts kept on the device (``gather_drafts``, ``CudaGraphRunner``). In torch ops each is a dozen or more small kernels of 1-2 us: on an H200
with the demo model at batch 1 (k = 3), 102 kernels and 190 us of GPU time a proposal, 40
of those kernels bookkeeping like this. Here each is one program per request.

``draft_step_inputs``, before pass 1 (the step the target just ran, ``q`` rows a request)::

    input id of row t:   the token sampled after the request's last verified row (t = last
                         index), else the step's id at t + 1 (the head reads token p + 1 at
                         position p; a padding id -1 reads as 0)
    slot, seq_len:       the step's, or -1 and 1 for a padding request (real 0)

``draft_pass_inputs``, before pass ``j`` (one token a request)::

    position:            min(p* + j, max_model_len - 1)     (p*: the last verified position)
    seq_len, slot:       position + 1 and its slot through the block table while the request
                         drafts more than j tokens, else 1 and -1 (it stores nothing)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _draft_step_kernel(
    step_ids_ptr,  # int64 [R * Q]: the step's input ids (-1 padding)
    step_slots_ptr,  # int64 [R * Q]
    step_seq_lens_ptr,  # int32 [R]
    last_index_ptr,  # int64 [R]: each request's last verified row (flat)
    next_token_ptr,  # int64 [R]
    real_ptr,  # int64 [R]: 0 for a padding request
    input_ids_ptr,  # int64 [R * Q] out
    slots_ptr,  # int64 [R * Q] out (may be step_slots_ptr)
    seq_lens_ptr,  # int32 [R] out (may be step_seq_lens_ptr)
    num_tokens,
    Q: tl.constexpr,
    Q_PAD: tl.constexpr,
):
    r = tl.program_id(0)
    j = tl.arange(0, Q_PAD)
    mask = j < Q
    t = r * Q + j
    nxt = tl.where(t + 1 < num_tokens, t + 1, 0)  # torch.roll(ids, -1)
    ids = tl.maximum(tl.load(step_ids_ptr + nxt, mask=mask, other=0), 0)
    last = tl.load(last_index_ptr + r)
    ids = tl.where(t == last, tl.load(next_token_ptr + r), ids)
    real = tl.load(real_ptr + r) != 0
    slots = tl.load(step_slots_ptr + t, mask=mask, other=-1)
    seq_len = tl.load(step_seq_lens_ptr + r)
    tl.store(input_ids_ptr + t, ids, mask=mask)
    tl.store(slots_ptr + t, tl.where(real, slots, -1), mask=mask)
    tl.store(seq_lens_ptr + r, tl.where(real, seq_len, 1))


def draft_step_inputs(
    step_input_ids: torch.Tensor,
    step_slot_mapping: torch.Tensor,
    step_seq_lens: torch.Tensor,
    last_index: torch.Tensor,
    next_token: torch.Tensor,
    real: torch.Tensor,
    input_ids: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    size: int,
    query_len: int,
) -> None:
    """Pass 1's inputs for ``size`` requests of ``query_len`` rows (see the module doc)."""
    _draft_step_kernel[(size,)](
        step_input_ids, step_slot_mapping, step_seq_lens, last_index, next_token, real,
        input_ids, slot_mapping, seq_lens, size * query_len,
        Q=query_len, Q_PAD=triton.next_power_of_2(query_len), num_warps=1,
    )


@triton.jit
def _draft_pass_kernel(
    last_positions_ptr,  # int64 [R]
    max_drafts_ptr,  # int64 [R]
    block_table_ptr,  # int32 [R, max_blocks]
    positions_ptr,  # int64 [R] out
    seq_lens_ptr,  # int32 [R] out
    slots_ptr,  # int64 [R] out
    size,
    j,
    max_position,
    stride_block_table,
    R_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    r = tl.arange(0, R_PAD)
    mask = r < size
    positions = tl.minimum(tl.load(last_positions_ptr + r, mask=mask, other=0) + j, max_position)
    drafting = tl.load(max_drafts_ptr + r, mask=mask, other=0) > j
    block = tl.load(block_table_ptr + r * stride_block_table + positions // BLOCK_SIZE, mask=mask, other=0)
    slots = tl.where(drafting, block.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE, -1)
    tl.store(positions_ptr + r, positions, mask=mask)
    tl.store(seq_lens_ptr + r, tl.where(drafting, positions + 1, 1).to(tl.int32), mask=mask)
    tl.store(slots_ptr + r, slots, mask=mask)


def draft_pass_inputs(
    last_positions: torch.Tensor,
    max_drafts: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    size: int,
    j: int,
    max_model_len: int,
    block_size: int,
) -> None:
    """Pass ``j``'s positions, seq_lens and slots for ``size`` requests (see the module doc)."""
    _draft_pass_kernel[(1,)](
        last_positions, max_drafts, block_table, positions, seq_lens, slot_mapping,
        size, j, max_model_len - 1, block_table.stride(0),
        R_PAD=triton.next_power_of_2(size), BLOCK_SIZE=block_size, num_warps=1,
    )


@triton.jit
def _gather_drafts_kernel(
    staging_ptr,  # int64: [R * Q ids | ... | R * Q draft sources at sources_offset | ...]
    source_ptr,  # int64: the drafts kept on the device, flat
    out_of_vocab_ptr,  # int64 [R * Q] out (when HAS_VERDICT)
    sources_offset,
    num_tokens,
    vocab_size,
    HAS_VERDICT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = t < num_tokens
    src = tl.load(staging_ptr + sources_offset + t, mask=mask, other=-1)
    kept = src >= 0
    drafts = tl.load(source_ptr + tl.maximum(src, 0), mask=mask & kept, other=0)
    if HAS_VERDICT:
        bad = kept & ((drafts < 0) | (drafts >= vocab_size))
        tl.store(out_of_vocab_ptr + t, bad.to(tl.int64), mask=mask)
    drafts = tl.minimum(tl.maximum(drafts, 0), vocab_size - 1)
    staged = tl.load(staging_ptr + t, mask=mask, other=0)
    tl.store(staging_ptr + t, tl.where(kept, drafts, staged), mask=mask)


def gather_drafts(
    staging: torch.Tensor, source: torch.Tensor, out_of_vocab: torch.Tensor | None, *, sources_offset: int,
    num_tokens: int, vocab_size: int,
) -> None:
    """A verification graph's staged ids, each one with a draft source (``>= 0`` at
    ``sources_offset + t``) replaced by ``source[that]`` clamped into the vocabulary;
    ``out_of_vocab[t]`` 1 where it lay outside (``CudaGraphRunner``)."""
    block = 128
    _gather_drafts_kernel[(triton.cdiv(num_tokens, block),)](
        staging, source, staging if out_of_vocab is None else out_of_vocab, sources_offset, num_tokens, vocab_size,
        HAS_VERDICT=out_of_vocab is not None, BLOCK=block, num_warps=1,
    )
