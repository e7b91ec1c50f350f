"""The rejection sampler is lossless: whatever the drafts and their proposal distribution q,
every emitted token is distributed as the target's p (after temperature / top-k shaping),
and greedy rows accept exactly the drafts that equal the argmax."""

import pytest
import torch
from scipy.stats import chisquare

from pagelm.sample import RejectionSampler, SamplingMetadata

V = 6
TARGET_LOGITS = torch.tensor(
    [[2.0, 1.5, 1.0, 0.5, -1.0, -2.0], [0.0, 1.0, -1.0, 2.0, 0.5, -0.5], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]]
)
# Adversarial proposal: most of its mass where p has least.
Q = torch.tensor([0.02, 0.03, 0.05, 0.1, 0.4, 0.4])
N = 40000
K = 2


def metadata(rows, temperature=1.0, top_k=None):
    return SamplingMetadata(
        temperature=torch.full((rows,), temperature),
        all_greedy=temperature == 0.0,
        all_random=temperature > 0.0,
        top_k=None if top_k is None else torch.full((rows,), top_k, dtype=torch.long),
        max_top_k=top_k,
    )


def expected_probs(logits, temperature=1.0, top_k=None):
    scaled = logits / temperature
    if top_k is not None:
        kth = scaled.topk(top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return scaled.softmax(-1)


def draw(temperature=1.0, top_k=None, with_probs=True, seed=0):
    """N requests with K drafts drawn from Q; returns their emitted token runs."""
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(Q, N * K, replacement=True, generator=gen).view(N, K).tolist()
    logits = TARGET_LOGITS.repeat(N, 1)  # rows: draft 0, draft 1, bonus, per request
    probs = Q.repeat(N * K, 1) if with_probs else None
    out = RejectionSampler()(logits, metadata(N * (K + 1), temperature, top_k), drafts, gen, probs)
    return out


def assert_distributed_as(tokens, p):
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    support = p > 0
    assert counts[~support].sum() == 0, f"tokens outside the target's support: {counts}"
    expected = p[support].double() / p[support].double().sum() * counts.sum()
    stat = chisquare(counts[support], expected)
    assert stat.pvalue > 1e-3, f"counts {counts.tolist()} vs expected {expected.tolist()} (p={stat.pvalue:.2g})"


@pytest.mark.parametrize("with_probs", [True, False], ids=["q-given", "one-hot-q"])
@pytest.mark.parametrize("temperature,top_k", [(1.0, None), (0.7, 4)], ids=["plain", "temperature+top-k"])
def test_every_position_is_distributed_as_the_target(with_probs, temperature, top_k):
    out = draw(temperature, top_k, with_probs)
    for j in range(K + 1):
        p = expected_probs(TARGET_LOGITS[j], temperature, top_k)
        tokens = [run[j] for run in out.token_ids if len(run) > j]
        assert len(tokens) > 100  # enough for the test; adversarial drafts rarely reach the bonus
        assert_distributed_as(tokens, p)


def test_acceptance_probability_is_min_of_one_and_p_over_q():
    out = draw()
    p = expected_probs(TARGET_LOGITS[0])
    want = torch.minimum(torch.ones(V), p / Q)
    rate = sum(a > 0 for a in out.num_accepted) / N
    assert rate == pytest.approx(float((Q * want).sum()), abs=0.015)


def test_runs_are_accepted_drafts_then_one_target_token():
    out = draw(seed=3)
    gen = torch.Generator().manual_seed(3)
    drafts = torch.multinomial(Q, N * K, replacement=True, generator=gen).view(N, K).tolist()
    for run, a, d in zip(out.token_ids, out.num_accepted, drafts):
        assert len(run) == a + 1 and run[:a] == d[:a]


def test_greedy_accepts_exactly_the_drafts_equal_to_the_argmax():
    logits = TARGET_LOGITS.repeat(3, 1)  # argmax per row: 0, 3, 0 (first of ties)
    drafts = [[0, 3], [0, 1], [5, 3]]
    for probs in (None, Q.repeat(6, 1)):
        out = RejectionSampler()(logits, metadata(9, temperature=0.0), drafts, None, probs)
        assert out.token_ids == [[0, 3, 0], [0, 3], [0]]
        assert out.num_accepted == [2, 1, 0]


def test_requests_without_drafts_get_one_token():
    logits = TARGET_LOGITS[:2]
    out = RejectionSampler()(logits, metadata(2, temperature=0.0), [[], []])
    assert out.token_ids == [[0], [3]] and out.num_accepted == [0, 0]


def test_verify_argmax_gives_the_greedy_samplers_tokens():
    """The path for rows with nothing to process: the same runs as the sampler with an
    all-greedy metadata, over random logits and drafts that often agree with the argmax."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        n = int(torch.randint(1, 6, (1,), generator=gen))
        drafts = [torch.randint(0, 3, (int(torch.randint(0, 4, (1,), generator=gen)),), generator=gen).tolist() for _ in range(n)]
        rows = sum(len(d) + 1 for d in drafts)
        logits = torch.randn(rows, 3, generator=gen)
        expected = RejectionSampler()(logits, metadata(rows, temperature=0.0), drafts)
        got = RejectionSampler().verify_argmax(logits, drafts)
        assert (got.token_ids, got.num_accepted, got.logprobs) == (expected.token_ids, expected.num_accepted, None)
    assert RejectionSampler().verify_argmax(TARGET_LOGITS.repeat(3, 1), [[0, 3], [0, 1], [5, 3]]).token_ids == [[0, 3, 0], [0, 3], [0]]
