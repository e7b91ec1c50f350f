"""Applying a packed allowed-token bitmask to logits (the guided-decoding seam).

The bitmask is xgrammar's layout: ``int32 [num_rows, ceil(vocab / 32)]``, bit ``j % 32`` of
word ``j // 32`` set when token ``j`` is allowed. A row of all ones (``-1``) constrains nothing.
"""

from __future__ import annotations

import importlib.util

import torch

_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
_BITS = None


def _bit_weights(device: torch.device) -> torch.Tensor:
    global _BITS
    if _BITS is None or _BITS.device != device:
        _BITS = (torch.ones(32, dtype=torch.int64) << torch.arange(32, dtype=torch.int64)).to(device)
    return _BITS


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``int32 [N, W]`` -> ``bool [N, vocab_size]`` (True = allowed)."""
    words = bitmask.to(torch.int64) & 0xFFFFFFFF
    bits = (words[:, :, None] & _bit_weights(bitmask.device)) != 0
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Set disallowed logits to ``-inf`` in place; bitmask row ``i`` masks logits row
    ``rows[i]`` (default: row ``i``). On CUDA (with Triton) one kernel does it; elsewhere, torch ops."""
    if logits.is_cuda and _TRITON_AVAILABLE:
        from pagelm.sample.triton_bitmask import apply_token_bitmask_triton

        apply_token_bitmask_triton(logits, bitmask.to(logits.device, non_blocking=True), rows)
        return
    apply_token_bitmask_torch(logits, bitmask, rows)


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """The reference: unpack to a bool mask, ``masked_fill``."""
    allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
    if logits.shape[-1] > allowed.shape[-1]:  # padded vocab: the tail is never allowed
        pad = torch.zeros(allowed.shape[0], logits.shape[-1] - allowed.shape[-1], dtype=torch.bool, device=logits.device)
        allowed = torch.cat([allowed, pad], dim=1)
    if rows is None:  # bitmask row i masks logits row i
        logits[: allowed.shape[0]].masked_fill_(~allowed, float("-inf"))
    else:
        target = logits[rows]
        logits[rows] = target.masked_fill(~allowed, float("-inf"))
