"""One Triton kernel for the common random-sampling step on CUDA: temperature, the grammar's
allowed-token bitmask and the exponential race, in a single pass over each row of logits.

The sampler's exponential race draws ``q ~ Exp(1)`` per token and takes
``argmax(softmax(l / T) / q)``. The softmax's normaliser is the same for every token of a row,
and ``log`` is increasing, so the same token is ``argmax(l / T - log q)`` over the allowed
tokens, which needs neither the softmax nor a masked copy of the logits::

    torch path:   mask -> l / T -> softmax -> / q -> argmax      (6 kernels, 5 passes over [N, V])
    this kernel:  argmax over allowed j of  l[j] / T - log q[j]  (1 kernel, 1 pass)

The noise ``q`` is drawn before (``Sampler.draw_noise``), as a tensor, so it can be queued with
the forward pass while a guided step's bitmask is still being filled on the host: what is left
once the bitmask is there is one upload and this one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _race_kernel(logits_ptr, logits_stride, noise_ptr, noise_stride, temperature_ptr, bitmask_ptr, bitmask_stride,
                 out_ptr, vocab_size, bitmask_width, HAS_BITMASK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    inv_temperature = 1.0 / tl.load(temperature_ptr + row).to(tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
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
        better = score > best  # per lane: the first maximum in vocab order wins ties
        best_index = tl.where(better, cols, best_index)
        best = tl.where(better, score, best)
    top = tl.max(best, axis=0)
    # The smallest index among the lanes holding the maximum (torch.argmax's first maximum).
    winner = tl.min(tl.where(best == top, best_index, vocab_size), axis=0)
    tl.store(out_ptr + row, winner.to(tl.int64))


def exponential_race_triton(
    logits: torch.Tensor, noise: torch.Tensor, temperature: torch.Tensor, bitmask: torch.Tensor | None
) -> torch.Tensor:
    """``logits`` and ``noise`` [N, V] float32 (last dim contiguous), ``temperature`` [N],
    ``bitmask`` int32 [N, W] (row ``i`` masks row ``i``) or None: the sampled ids [N] int64."""
    n, vocab_size = logits.shape
    assert noise.shape == logits.shape and logits.stride(-1) == 1 and noise.stride(-1) == 1
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    if bitmask is not None:
        assert bitmask.shape[0] == n and bitmask.stride(-1) == 1 and bitmask.device == logits.device
    _race_kernel[(n,)](
        logits, logits.stride(0), noise, noise.stride(0), temperature,
        bitmask if bitmask is not None else logits, bitmask.stride(0) if bitmask is not None else 0,
        out, vocab_size, bitmask.shape[-1] if bitmask is not None else 0,
        HAS_BITMASK=bitmask is not None, BLOCK=BLOCK,
    )
    return out
