"""One Triton kernel for the common random-sampling step on CUDA: temperature, the grammar's
allowed-token bitmask and the exponential race, in a single pass over each row of logits.

The sampler's exponential race draws ``q ~ Exp(1)`` per token and takes
``argmax(softmax(l / T) / q)``. The softmax's normaliser is the same for every token of a row,
and ``log`` is increasing, so the same token is ``argmax(l / T - log q)`` over the allowed
tokens, which needs neither the softmax nor a masked copy of the logits::

    torch path:   mask -> l / T -> softmax -> / q -> argmax      (6 kernels, 5 passes over [N, V])
    this kernel:  argmax over allowed j of  l[j] / T - log q[j]  (1 pass, then an argmax over
                  each row's per-block winners)

The noise ``q`` is drawn before (``Sampler.draw_noise``), as a tensor, so it can be queued with
the forward pass while a guided step's bitmask is still being filled on the host: what is left
once the bitmask is there is one upload and three launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _race_kernel(logits_ptr, logits_stride, noise_ptr, noise_stride, temperature_ptr, bitmask_ptr, bitmask_stride,
                 best_ptr, index_ptr, num_blocks, vocab_size, bitmask_width,
                 HAS_BITMASK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, b): the best score of row ``row`` among columns ``[b * BLOCK, (b + 1) * BLOCK)``
    and its column; the caller reduces the ``num_blocks`` candidates of each row."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    inv_temperature = 1.0 / tl.load(temperature_ptr + row).to(tl.float32)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    valid = cols < vocab_size
    logits = tl.load(logits_ptr + row * logits_stride + cols, mask=valid, other=float("-inf")).to(tl.float32)
    q = tl.load(noise_ptr + row * noise_stride + cols, mask=valid, other=1.0)
    # Exp(1) can round to 0: clamped as the torch path does (log 0 would be -inf -> +inf).
    score = logits * inv_temperature - tl.log(tl.maximum(q, 1.1754943508222875e-38))
    if HAS_BITMASK:
        # Columns past the bitmask (a padded vocab) read as 0: never allowed.
        words = tl.load(bitmask_ptr + row * bitmask_stride + cols // 32, mask=cols // 32 < bitmask_width, other=0)
        valid = valid & (((words >> (cols % 32)) & 1) != 0)
    score = tl.where(valid, score, float("-inf"))
    top = tl.max(score, axis=0)
    # The first column holding the maximum (torch.argmax's choice among ties).
    first = tl.min(tl.where(score == top, cols, vocab_size), axis=0)
    tl.store(best_ptr + row * num_blocks + block, top)
    tl.store(index_ptr + row * num_blocks + block, tl.minimum(first, vocab_size - 1).to(tl.int64))


# Built for the CPU interpreter (TRITON_INTERPRET=1 when this module was imported): tests.
INTERPRETED = not isinstance(_race_kernel, triton.runtime.JITFunction)


def exponential_race_triton(
    logits: torch.Tensor, noise: torch.Tensor, temperature: torch.Tensor, bitmask: torch.Tensor | None
) -> torch.Tensor:
    """``logits`` and ``noise`` [N, V] float32 (last dim contiguous), ``temperature`` [N],
    ``bitmask`` int32 [N, W] (row ``i`` masks row ``i``) or None: the sampled ids [N] int64.
    Blocks of ``BLOCK`` columns run in parallel (a row per program would leave most of the
    GPU idle at small batches); a torch argmax over each row's block winners finishes."""
    n, vocab_size = logits.shape
    assert noise.shape == logits.shape and logits.stride(-1) == 1 and noise.stride(-1) == 1
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    if bitmask is not None:
        assert bitmask.shape[0] == n and bitmask.stride(-1) == 1 and bitmask.device == logits.device
    num_blocks = triton.cdiv(vocab_size, BLOCK)
    best = torch.empty((n, num_blocks), dtype=torch.float32, device=logits.device)
    index = torch.empty((n, num_blocks), dtype=torch.int64, device=logits.device)
    _race_kernel[(n, num_blocks)](
        logits, logits.stride(0), noise, noise.stride(0), temperature,
        bitmask if bitmask is not None else logits, bitmask.stride(0) if bitmask is not None else 0,
        best, index, num_blocks, vocab_size, bitmask.shape[-1] if bitmask is not None else 0,
        HAS_BITMASK=bitmask is not None, BLOCK=BLOCK,
    )
    # The first block holding the row's maximum, then that block's first column.
    return index.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1)
