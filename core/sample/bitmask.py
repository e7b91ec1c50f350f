"""Applying a packed allowed-token bitmask to logits (the guided-decoding seam).

The bitmask is xgrammar's layout: ``int32 [num_rows, ceil(vocab / 32)]``, bit ``j % 32`` of
word ``j // 32`` set when token ``j`` is allowed. A row of all ones (``-1``) constrains nothing.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from pagelm.kernels import fused_kernel

_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
# Smaller bitmasks (16 rows of a 128k vocabulary) copy in a few microseconds: a side stream's
# bookkeeping would cost the host more than the copy costs the device.
_SIDE_STREAM_MIN_BYTES = 256 << 10


@functools.cache
def _bit_weights(device: torch.device) -> torch.Tensor:
    return (torch.ones(32, dtype=torch.int64) << torch.arange(32, dtype=torch.int64)).to(device)


@functools.cache
def _copy_stream(device: torch.device) -> "torch.cuda.Stream":
    return torch.cuda.Stream(device)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``int32 [N, W]`` -> ``bool [N, vocab_size]`` (True = allowed)."""
    words = bitmask.to(torch.int64) & 0xFFFFFFFF
    bits = (words[:, :, None] & _bit_weights(bitmask.device)) != 0
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Set disallowed logits to ``-inf`` in place; bitmask row ``i`` masks logits row
    ``rows[i]`` (default: row ``i``). On CUDA (with Triton) one kernel does it, after
    ``upload_bitmask``; elsewhere, torch ops."""
    kernel = fused_kernel("apply_token_bitmask") if logits.is_cuda and _TRITON_AVAILABLE else None
    if kernel is not None:
        kernel(logits, upload_bitmask(bitmask, logits.device), rows)
        return
    apply_token_bitmask_torch(logits, bitmask, rows)


def upload_bitmask(bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``bitmask`` on ``device`` for kernels queued next on the current stream. A large pinned
    one is copied on a side stream, so that the copy overlaps the forward pass still running
    on the current stream (which waits for it); it must stay unchanged until the step's next
    host sync."""
    if bitmask.device == device or bitmask.nbytes < _SIDE_STREAM_MIN_BYTES or not bitmask.is_pinned():
        return bitmask.to(device, non_blocking=True)
    stream = _copy_stream(device)
    current = torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):  # allocated from the side stream's pool: no race with current's
        on_device = bitmask.to(device, non_blocking=True)
    current.wait_stream(stream)
    on_device.record_stream(current)  # freed memory is reused only once current is done with it
    return on_device


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
