"""Persistent step inputs: device tensors sized once for the largest step, filled every step
from pinned host staging with non-blocking copies.

CUDA graphs capture the addresses of these tensors, so they are never reallocated; a step
writes its values into the host side (numpy views, no Python per element) and one copy per
tensor moves them over. On the CPU the host and device sides are the same tensor.
"""

from __future__ import annotations

import numpy as np
import torch


class _Pair:
    """One persistent input: ``host`` (pinned on CUDA) and ``device``, same shape."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        on_gpu = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=on_gpu)
        self.device = torch.zeros(shape, dtype=dtype, device=device) if on_gpu else self.host
        self.np = self.host.numpy()

    def upload(self, n: int) -> torch.Tensor:
        """Copy the first ``n`` rows to the device (asynchronously) and return that view."""
        if self.device is not self.host:
            self.device[:n].copy_(self.host[:n], non_blocking=True)
        return self.device[:n]


class InputBuffers:
    """The flattened batch of one step::

        input_ids     | r0: tokens[c0:c0+n0] | r1: tokens[c1:c1+n1] | ... | padding |
        positions     | c0 ... c0+n0-1       | c1 ... c1+n1-1       | ... |    0    |
        slot_mapping  block_table[r][pos // block_size] * block_size + pos % block_size  (-1: padding)

    A model with positions of its own (M-RoPE, ``position_rows`` = 3) also gets
    ``row_positions``: a step covering such a request's prompt lays out ``[rows, num_tokens]``
    in its first ``rows * num_tokens`` entries (contiguous, one upload).

    ``block_table`` keeps its full width (``max_blocks_per_req``) on the device so that kernels
    captured in a CUDA graph see one fixed row stride; a step uploads only the columns its
    longest request uses, through a packed staging buffer, then spreads them with one device copy.
    """

    def __init__(
        self,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_req: int,
        device: torch.device,
        position_rows: int = 1,
    ) -> None:
        self.device = device
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs
        self.max_blocks_per_req = max_blocks_per_req
        self.input_ids = _Pair((max_num_tokens,), torch.int64, device)
        self.positions = _Pair((max_num_tokens,), torch.int64, device)
        self.row_positions = _Pair((position_rows * max_num_tokens,), torch.int64, device) if position_rows > 1 else None
        self.slot_mapping = _Pair((max_num_tokens,), torch.int64, device)
        self.query_start_loc = _Pair((max_num_reqs + 1,), torch.int32, device)
        self.seq_lens = _Pair((max_num_reqs,), torch.int32, device)
        self.block_table = torch.zeros((max_num_reqs, max_blocks_per_req), dtype=torch.int32, device=device)
        self._packed_block_table = _Pair((max_num_reqs * max_blocks_per_req,), torch.int32, device)

    def upload_block_table(self, rows: np.ndarray) -> torch.Tensor:
        """``rows`` [n, cols] int32 -> the device table's first ``n`` rows (full width)."""
        n, cols = rows.shape
        packed = self._packed_block_table
        packed.np[: n * cols] = rows.reshape(-1)
        dev = packed.upload(n * cols).view(n, cols)
        self.block_table[:n, :cols].copy_(dev, non_blocking=True)
        return self.block_table[:n]
