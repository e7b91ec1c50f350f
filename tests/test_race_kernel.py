"""The one-kernel exponential race (``pagelm.backends.kernels.race``), under the Triton CPU
interpreter: the token the torch sampler's race picks for the same noise, and samples from
exactly the masked, temperature-scaled softmax."""

import pytest
import torch

pytest.importorskip("triton")

from pagelm.sample.bitmask import unpack_bitmask  # noqa: E402
from pagelm.sample.sampler import draw_race_noise  # noqa: E402
from triton_interpreter import interpreted_kernels  # noqa: E402

MODULE = "pagelm.backends.kernels.race"


@pytest.fixture(scope="module")
def race():
    """The kernel, compiled on a GPU (tensors moved there and back), else interpreted."""
    with interpreted_kernels(MODULE, fresh=True) as (module,):
        kernel = module.exponential_race_triton
        if torch.cuda.is_available():
            yield lambda *args: kernel(*(a.cuda() if a is not None else None for a in args)).cpu()
        else:
            yield kernel


def random_bitmask(n, vocab, gen, density=0.3):
    allowed = torch.rand(n, vocab, generator=gen) < density
    allowed[:, 0] = True  # every row allows something
    padded = torch.zeros(n, (vocab + 31) // 32 * 32, dtype=torch.bool)
    padded[:, :vocab] = allowed
    weights = torch.ones(32, dtype=torch.int64) << torch.arange(32)
    words = (padded.view(n, -1, 32).long() * weights).sum(-1)
    return words.to(torch.int64).where(words < 2**31, words - 2**32).to(torch.int32), allowed


@pytest.mark.parametrize("vocab", [7, 2048, 5000])
def test_same_token_as_the_torch_race_for_the_same_noise(race, vocab):
    gen = torch.Generator().manual_seed(vocab)
    n = 6
    logits = torch.randn(n, vocab, generator=gen) * 3
    temperature = torch.tensor([1.0, 0.5, 2.0, 0.7, 1.3, 1.0])
    noise = draw_race_noise(logits, {}, gen)
    bitmask, allowed = random_bitmask(n, vocab, gen)
    assert torch.equal(unpack_bitmask(bitmask, vocab), allowed)
    for mask in (None, bitmask):
        masked = logits if mask is None else logits.masked_fill(~allowed, float("-inf"))
        want = ((masked / temperature[:, None]).softmax(-1) / noise).argmax(-1)
        got = race(logits, noise, temperature, mask)
        assert got.dtype == torch.int64
        assert torch.equal(got, want), (got, want)
        if mask is not None:
            assert allowed[torch.arange(n), got].all()


def test_samples_follow_the_masked_softmax(race):
    """Chi-square over 4,000 rows of one small distribution: the kernel's tokens come from
    softmax(l / T) restricted to the allowed tokens, renormalised."""
    gen = torch.Generator().manual_seed(0)
    vocab, n, temperature = 12, 4000, 0.8
    logits = torch.randn(vocab, generator=gen).expand(n, vocab).contiguous()
    bitmask, allowed = random_bitmask(1, vocab, gen, density=0.6)
    want = (logits[0] / temperature).masked_fill(~allowed[0], float("-inf")).softmax(-1)
    got = race(logits, draw_race_noise(logits, {}, gen), torch.full((n,), temperature), bitmask.expand(n, -1).contiguous())
    counts = torch.bincount(got, minlength=vocab).double()
    assert counts[~allowed[0]].sum() == 0
    expected = want * n
    keep = expected > 0
    chi2 = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    # 99.9% quantile of chi-square with (allowed - 1) <= 11 degrees of freedom is 31.3.
    assert chi2 < 31.3, (chi2, counts, expected)
