"""The Triton bitmask kernel (guided decoding's logits mask on CUDA) masks exactly what the torch
reference masks: selected rows only, padded vocab columns never allowed, any float dtype.
Without CUDA it runs under Triton's CPU interpreter, set up for this module only."""

import pytest
import torch

pytest.importorskip("triton")

from pagelm.sample.bitmask import apply_token_bitmask_torch  # noqa: E402
from triton_interpreter import interpreted_kernels  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


@pytest.fixture(scope="module")
def kernel():
    with interpreted_kernels("pagelm.backends.kernels.bitmask", fresh=True) as (module,):
        yield module.apply_token_bitmask_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_rows", [False, True])
def test_kernel_masks_what_the_torch_reference_masks(kernel, dtype, with_rows):
    gen = torch.Generator().manual_seed(0)
    vocab, padded = 300, 352  # the logits are wider than the bitmask's 10 words (320 columns)
    logits = torch.randn(5, padded, generator=gen).to(DEVICE, dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), generator=gen, dtype=torch.int32)
    bitmask[1] = -1  # a row that allows the whole vocab
    rows = torch.tensor([4, 0, 2], device=DEVICE) if with_rows else None
    expected = logits.clone()
    apply_token_bitmask_torch(expected, bitmask.to(DEVICE), rows)
    kernel(logits, bitmask.to(DEVICE), rows)
    assert torch.equal(logits, expected)
    masked = [4, 0, 2] if with_rows else [0, 1, 2]
    assert torch.isinf(logits[masked[1], 320:]).all()  # padded columns: never allowed
    untouched = [r for r in range(5) if r not in masked]
    assert not torch.isinf(logits[untouched]).any()


@pytest.mark.skipif(not ON_GPU, reason="the side-stream copy of a pinned bitmask is CUDA's")
def test_a_pinned_bitmask_copied_beside_a_running_forward_pass_masks_the_same():
    from pagelm.sample.bitmask import apply_token_bitmask

    gen = torch.Generator().manual_seed(1)
    vocab = 128256
    logits = torch.randn(64, vocab, generator=gen).to(DEVICE)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (64, vocab // 32), generator=gen, dtype=torch.int32).pin_memory()
    expected = logits.clone()
    apply_token_bitmask_torch(expected, bitmask.to(DEVICE))
    busy = torch.randn(4096, 4096, device=DEVICE)
    for _ in range(8):  # the forward pass, still running on the current stream
        busy = busy @ busy
    apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)
