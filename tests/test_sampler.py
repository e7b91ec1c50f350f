"""The sampler's behaviour, one knob at a time, on hand-made logits rows."""

from __future__ import annotations

import math

import pytest
import torch

from pagelm.sample import LogprobsTensors, Sampler, SamplingMetadata
from pagelm.sample.sampler import apply_top_k_top_p, apply_top_k_without_sort, cdf_index, exponential_race, inverse_cdf

NEG_INF = float("-inf")


def make_md(temperatures: list[float], **kw) -> SamplingMetadata:
    temperature = torch.tensor(temperatures, dtype=torch.float32)
    greedy = [t < 1e-5 for t in temperatures]
    return SamplingMetadata(temperature=temperature, all_greedy=all(greedy), all_random=not any(greedy), **kw)


def sample(logits: list[list[float]] | torch.Tensor, md: SamplingMetadata, seed: int = 0):
    logits = torch.as_tensor(logits, dtype=torch.float32)
    return Sampler()(logits, md, torch.Generator().manual_seed(seed))


def test_greedy_takes_argmax():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(1))
    out = sample(logits, make_md([0.0] * 8))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None


def test_greedy_does_not_modify_callers_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    md = make_md([0.0], allowed_token_mask=torch.tensor([[True, False, False]]))
    Sampler()(logits, md)
    assert logits.tolist() == [[1.0, 2.0, 3.0]]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    # Token 0 (prompt) 3.0 -> 1.5; token 2 (output) -0.5 -> -1.0; token 1 unseen stays 2.0.
    md = make_md(
        [0.0],
        prompt_token_ids=torch.tensor([[0, 4]]),  # 4 == vocab_size: padding
        output_token_ids=[[2]],
        repetition_penalties=torch.tensor([2.0]),
    )
    assert sample([[3.0, 2.0, -0.5, -0.8]], md).sampled_token_ids.tolist() == [1]


def test_repetition_penalty_pushes_seen_negative_below_unseen():
    # Without penalty token 2 (-0.5) beats token 3 (-0.8); seen token 2 becomes -1.0.
    md = make_md(
        [0.0],
        output_token_ids=[[2]],
        repetition_penalties=torch.tensor([2.0]),
        allowed_token_mask=torch.tensor([[False, False, True, True]]),
    )
    assert sample([[3.0, 2.0, -0.5, -0.8]], md).sampled_token_ids.tolist() == [3]


def test_frequency_penalty_subtracts_penalty_times_count():
    # Token 0 appears 3 times: 5.0 - 0.5 * 3 = 3.5 < 4.0 (token 1, seen once: 4.5 - 0.5 = 4.0).
    md = make_md([0.0], output_token_ids=[[0, 0, 0, 1]], frequency_penalties=torch.tensor([0.5]))
    assert sample([[5.0, 4.5, 3.9]], md).sampled_token_ids.tolist() == [1]


def test_presence_penalty_subtracts_once_regardless_of_count():
    # Both seen tokens lose exactly 1.0: 5.0 -> 4.0, 4.5 -> 3.5; unseen 3.9 stays below 4.0.
    md = make_md([0.0], output_token_ids=[[0, 0, 0, 1]], presence_penalties=torch.tensor([1.0]))
    assert sample([[5.0, 4.5, 3.9]], md).sampled_token_ids.tolist() == [0]
    md = make_md([0.0], output_token_ids=[[0, 0, 0, 1]], presence_penalties=torch.tensor([1.2]))
    assert sample([[5.0, 4.5, 3.9]], md).sampled_token_ids.tolist() == [2]


def test_top_k_one_at_temperature_one_is_argmax():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(2))
    md = make_md([1.0] * 16, top_k=torch.full((16,), 1, dtype=torch.int32))
    for seed in range(5):
        assert torch.equal(sample(logits, md, seed).sampled_token_ids, logits.argmax(-1))


def test_top_k_zero_means_off_for_that_row():
    # Row 0 has top_k=1 (always argmax); row 1 has top_k=0 over a flat row, so draws vary.
    logits = torch.zeros(2, 8)
    logits[0, 5] = 0.1
    md = make_md([1.0, 1.0], top_k=torch.tensor([1, 0]))
    draws = [sample(logits, md, seed).sampled_token_ids.tolist() for seed in range(40)]
    assert {d[0] for d in draws} == {5}
    assert len({d[1] for d in draws}) > 4


def test_top_k_without_sort_masks_exactly_like_the_sort_path():
    # Integer logits tie often; rows: off, k=1, mid k, k past the vocab, tied k-th values.
    logits = torch.randint(-20, 20, (6, 300), generator=torch.Generator().manual_seed(4)).float()
    logits[5, :40] = 25.0
    top_k = torch.tensor([0, 1, 17, 100, 1000, 10])
    expected = apply_top_k_top_p(logits, top_k, None)
    assert torch.equal(apply_top_k_top_p(logits, top_k, None, max_top_k=1000), expected)
    assert torch.equal(apply_top_k_without_sort(logits, top_k, 1000), expected)
    assert (expected[5] > float("-inf")).sum() == 40  # all 40 tied with the 10th largest kept


def test_sampler_with_max_top_k_draws_the_same_tokens():
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(5))
    top_k = torch.tensor([1, 5, 20, 50, 0, 3, 40, 20])
    with_hint = make_md([1.0] * 8, top_k=top_k, max_top_k=50)
    without = make_md([1.0] * 8, top_k=top_k)
    for seed in range(5):
        tokens = sample(logits, with_hint, seed).sampled_token_ids
        assert torch.equal(tokens, sample(logits, without, seed).sampled_token_ids)


def test_tiny_top_p_keeps_only_the_most_likely_token():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(3))
    md = make_md([1.0] * 16, top_p=torch.full((16,), 1e-6))
    for seed in range(5):
        assert torch.equal(sample(logits, md, seed).sampled_token_ids, logits.argmax(-1))


def test_top_p_keeps_smallest_set_reaching_p():
    # probs [0.5, 0.3, 0.15, 0.05]: top_p=0.8 keeps {0, 1} (0.5 + 0.3 reaches 0.8).
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    md = make_md([1.0], top_p=torch.tensor([0.8]))
    draws = {sample(logits, md, seed).sampled_token_ids.item() for seed in range(200)}
    assert draws == {0, 1}


def test_min_p_drops_tokens_below_fraction_of_max_prob():
    # probs [0.5, 0.3, 0.15, 0.05], min_p=0.25 -> threshold 0.125: token 3 dropped, 2 kept.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    md = make_md([1.0], min_p=torch.tensor([0.25]))
    draws = {sample(logits, md, seed).sampled_token_ids.item() for seed in range(300)}
    assert draws == {0, 1, 2}


def test_min_tokens_forbids_eos():
    # EOS (id 1) is the argmax, but row 0 is under min_tokens; row 1 is not.
    logits = [[0.0, 9.0, 1.0], [0.0, 9.0, 1.0]]
    md = make_md([0.0, 0.0], banned_token_ids={0: {1}})
    assert sample(logits, md).sampled_token_ids.tolist() == [2, 1]


def test_allowed_token_mask_forces_only_allowed_token():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(4))
    mask = torch.zeros(3, 20, dtype=torch.bool)
    mask[0, 7] = mask[1, 0] = mask[2, 19] = True
    for temperatures in ([0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 2.0]):
        out = sample(logits, make_md(temperatures, allowed_token_mask=mask))
        assert out.sampled_token_ids.tolist() == [7, 0, 19]


def test_mixed_batch_greedy_rows_take_argmax():
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(5))
    md = make_md([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    out = sample(logits, md)
    assert out.sampled_token_ids[0::2].tolist() == logits.argmax(-1)[0::2].tolist()


def test_seeded_row_is_independent_of_batch_composition():
    vocab = 1000
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(6))

    alone = sample(row[None], make_md([1.0], generators={0: torch.Generator().manual_seed(42)}), seed=0)

    others = torch.randn(5, vocab, generator=torch.Generator().manual_seed(7))
    batch = torch.cat([others[:3], row[None], others[3:]])
    md = make_md([1.0, 0.0, 0.7, 1.0, 1.3, 1.0], generators={3: torch.Generator().manual_seed(42)})
    in_batch = sample(batch, md, seed=123)

    assert in_batch.sampled_token_ids[3].item() == alone.sampled_token_ids[0].item()


def test_seeded_rows_repeat_across_runs_with_same_seed():
    logits = torch.zeros(1, 1000)  # flat: every token equally likely
    draws = [
        sample(logits, make_md([1.0], generators={0: torch.Generator().manual_seed(9)}), seed=s).sampled_token_ids.item()
        for s in range(3)
    ]
    assert len(set(draws)) == 1


def test_logprobs_columns_and_ranks_match_log_softmax_of_raw_logits():
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(8))
    # Penalties and temperature must not leak into the reported (raw) logprobs.
    md = make_md(
        [0.0, 1.0, 0.5, 2.0],
        max_num_logprobs=3,
        output_token_ids=[[1], [2], [3], [4]],
        frequency_penalties=torch.tensor([1.0, 1.0, 1.0, 1.0]),
    )
    out = sample(logits, md)
    lp = out.logprobs
    assert isinstance(lp, LogprobsTensors)
    assert lp.token_ids.shape == lp.logprobs.shape == (4, 4)

    expected = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert torch.equal(lp.token_ids[:, 0], sampled)
    assert torch.allclose(lp.logprobs[:, 0], expected.gather(1, sampled[:, None])[:, 0])
    top_vals, top_ids = expected.topk(3, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top_ids)
    assert torch.allclose(lp.logprobs[:, 1:], top_vals)
    sorted_ids = expected.argsort(dim=-1, descending=True)
    expected_ranks = [sorted_ids[i].tolist().index(sampled[i].item()) + 1 for i in range(4)]
    assert lp.ranks.tolist() == expected_ranks


def test_zero_logprobs_returns_only_the_sampled_column():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    lp = sample(logits, make_md([0.0], max_num_logprobs=0)).logprobs
    assert lp.token_ids.tolist() == [[1]]
    assert lp.ranks.tolist() == [1]
    assert lp.logprobs[0, 0].item() == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item())


def test_sampling_distribution_matches_softmax():
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0])
    draws = 20_000
    md = make_md([1.0] * draws)
    tokens = sample(logits.expand(draws, 4), md, seed=11).sampled_token_ids
    freq = torch.bincount(tokens, minlength=4).float() / draws
    assert torch.allclose(freq, logits.softmax(-1), atol=0.02)


def test_temperature_sharpens_distribution():
    # At T=0.5 the probs are softmax(2 * logits).
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0])
    draws = 20_000
    tokens = sample(logits.expand(draws, 4), make_md([0.5] * draws), seed=12).sampled_token_ids
    freq = torch.bincount(tokens, minlength=4).float() / draws
    assert torch.allclose(freq, (logits / 0.5).softmax(-1), atol=0.02)
    assert math.isclose(freq.sum().item(), 1.0)


def test_cpu_draws_by_inverse_cdf_and_the_noise_still_decides_when_given():
    # On the CPU the sampler takes one uniform per row (inverse CDF); noise drawn beforehand
    # (what CUDA queues at launch) still runs the exponential race over exactly that noise.
    logits = torch.tensor([[1.0, 0.0, -0.5, 2.0], [0.3, 0.2, 0.1, 0.0]])
    md = make_md([1.0, 1.0])
    got = Sampler()(logits, md, torch.Generator().manual_seed(5)).sampled_token_ids
    want = inverse_cdf(logits.softmax(-1), {}, torch.Generator().manual_seed(5))
    assert got.tolist() == want.tolist()
    noise = torch.tensor([[1.0, 1.0, 1.0, 1e-6], [1e-6, 1.0, 1.0, 1.0]])
    assert Sampler()(logits, md, None, noise).sampled_token_ids.tolist() == [3, 0]
    assert exponential_race(logits.softmax(-1), {}, None, noise).tolist() == [3, 0]


def test_inverse_cdf_never_lands_on_a_zero_probability_token():
    # The target is held under the row's total even at u = 1 (past what rand gives, where a
    # rounding of u * total would land): the last token with mass is found, not the
    # zero-probability ones after it, nor an index past the row.
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0, 0.0], [0.1, 0.0, 0.2, 0.0, 0.0, 0.0]])
    assert cdf_index(probs, torch.ones(2, 1)).tolist() == [3, 2]
    assert cdf_index(probs, torch.full((2, 1), 1.0 - 2.0**-24)).tolist() == [3, 2]
    assert cdf_index(probs, torch.zeros(2, 1)).tolist() == [1, 0]
    # A row with no mass (softmax of all -inf: NaN) gets an id in range all the same.
    nan_row = torch.full((1, 6), float("-inf")).softmax(-1)
    assert 0 <= cdf_index(nan_row, torch.full((1, 1), 0.5)).item() < 6
    # Unnormalised rows (the rejection sampler's residuals) sample in proportion.
    draws = 20_000
    rows = torch.tensor([0.0, 2.0, 0.0, 6.0]).expand(draws, 4)
    freq = torch.bincount(inverse_cdf(rows, {}, torch.Generator().manual_seed(3)), minlength=4).float() / draws
    assert freq[0] == 0 and freq[2] == 0
    assert torch.allclose(freq, torch.tensor([0.0, 0.25, 0.0, 0.75]), atol=0.02)


def test_an_argmax_only_batch_shares_one_metadata_per_size():
    """``ArgmaxMetadata``: made once per batch size, all greedy, and sampling with it is the argmax."""
    from pagelm.worker.sampling_inputs import ArgmaxMetadata

    cache = ArgmaxMetadata(torch.device("cpu"))
    md = cache.get(4)
    assert cache.get(4) is md and cache.get(3) is not md and cache.get(3).temperature.shape == (3,)
    assert md.all_greedy and not md.all_random and md.temperature.tolist() == [0.0] * 4
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(2))
    assert torch.equal(sample(logits, md).sampled_token_ids, logits.argmax(-1))


def test_an_all_greedy_batch_samples_as_the_full_metadata_would(llama_dir, monkeypatch):
    """Through the engine: a batch of greedy requests with nothing else set skips
    ``build_sampling_metadata``; the same requests asking for logprobs (not argmax-only) build it,
    and their tokens are the same."""
    import pagelm.worker.model_runner as model_runner
    from pagelm import LLM, SamplingParams

    built = []
    real = model_runner.build_sampling_metadata
    monkeypatch.setattr(model_runner, "build_sampling_metadata", lambda *a: built.append(len(a[0])) or real(*a))
    llm = LLM(str(llama_dir), dtype="float32", block_size=8)
    prompts = [{"prompt_token_ids": [1, 5, 9, 200 + i]} for i in range(3)]
    ids = lambda params: [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]  # noqa: E731
    greedy = ids(SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert built == []
    with_logprobs = ids(SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1))
    assert built and with_logprobs == greedy
    llm.shutdown()
