"""Prompt lookup (the ``ngram`` proposer): the longest suffix that occurred before, at its
latest occurrence, proposes what followed it; a short continuation repeats with its period."""

import numpy as np
import pytest

from pagelm.plugins.spec_decode.ngram import ngram_drafts


def drafts(rows, min_n=1, max_n=3, k=3):
    width = max(len(r) for r in rows)
    tokens = np.zeros((len(rows), width), dtype=np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    out, num = ngram_drafts(tokens, np.array([len(r) for r in rows]), min_n, max_n, k)
    return [row[:n] for row, n in zip(out.tolist(), num.tolist())]


def test_the_longest_suffix_wins():
    # "3" alone last occurred before 9; "2 3" occurred before 4 5 6.
    assert drafts([[1, 2, 3, 4, 5, 6, 3, 9, 8, 2, 3]]) == [[4, 5, 6]]


def test_the_latest_occurrence_of_a_suffix_wins():
    assert drafts([[5, 6, 1, 5, 6, 2, 7, 7, 5, 6]], max_n=2) == [[2, 7, 7]]


def test_a_repeating_pattern_is_extended_with_its_period():
    assert drafts([[9, 4, 8, 4, 8, 4]], k=4) == [[8, 4, 8, 4]]


def test_no_match_below_the_minimum_length_proposes_nothing():
    assert drafts([[1, 2, 3, 9, 3]], min_n=2, max_n=3) == [[]]
    assert drafts([[1, 2, 3, 9, 3]], min_n=1, max_n=3) == [[9, 3, 9]]


def test_rows_of_a_batch_are_independent_and_padding_never_matches():
    rows = [[7, 1, 2, 7], [3, 0, 0, 0, 0, 0, 0, 3], [0]]
    assert drafts(rows, k=2) == [[1, 2], [0, 0], []]


def test_requests_with_no_draft_budget_are_not_looked_up(monkeypatch):
    """A request backed off by adaptive drafting (or with no room) costs the lookup nothing."""
    import pagelm.plugins.spec_decode.ngram as ngram
    from pagelm.config import EngineConfig
    from pagelm.plugins.spec_decode import ProposalBatch

    config = EngineConfig(model="(test)", speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                              "prompt_lookup_min": 1})
    proposer = ngram.NgramProposer(config, None, None, None)
    looked_up = []
    lookup = ngram.ngram_drafts
    monkeypatch.setattr(ngram, "ngram_drafts", lambda tokens, *a: looked_up.append(tokens.tolist()) or lookup(tokens, *a))
    tokens = np.array([[7, 1, 2, 7], [5, 6, 5, 0], [4, 3, 4, 0]], dtype=np.int32)
    batch = ProposalBatch(
        req_ids=["a", "b", "c"], max_num_drafts=np.array([2, 0, 2]), token_ids=tokens, num_tokens=np.array([4, 3, 3]),
        **dict.fromkeys(["input_ids", "positions", "hidden_states", "common", "last_token_index", "last_token_position",
                         "next_token_ids", "block_table_cpu", "rows", "block_size", "build_attention_metadata"]),
    )
    assert proposer.propose(batch) == [[1, 2], [], [3, 4]]
    assert looked_up == [[[7, 1, 2, 7], [4, 3, 4, 0]]]


def brute_force_lookup(history: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, one request at a time: the longest suffix (``max_n`` down to
    ``min_n``) found earlier, its latest occurrence, the ``k`` tokens after it (repeated with
    the match's period when they run into the end)."""
    L = len(history)
    for n in range(max_n, min_n - 1, -1):
        if L < n + 1:
            continue
        suffix = history[L - n :]
        for end in range(L - 2, n - 2, -1):  # the match ends before the last token
            if history[end - n + 1 : end + 1] == suffix:
                period = L - 1 - end
                return [history[end + 1 + i % period] for i in range(k)]
    return []


@pytest.mark.parametrize("seed", range(5))
def test_batched_lookup_matches_the_definition_on_random_histories(seed):
    gen = np.random.default_rng(seed)
    B, W, k = 16, 120, 4
    lengths = gen.integers(1, W + 1, size=B)
    tokens = np.zeros((B, W), dtype=np.int32)
    for b in range(B):
        vocab = int(gen.integers(2, 6))  # few symbols: many matches of every length
        tokens[b, : lengths[b]] = gen.integers(0, vocab, size=lengths[b])
    for min_n, max_n in [(1, 1), (1, 4), (2, 5), (3, 3)]:
        drafts, num = ngram_drafts(tokens, lengths, min_n, max_n, k)
        for b in range(B):
            want = brute_force_lookup(tokens[b, : lengths[b]].tolist(), min_n, max_n, k)
            assert drafts[b, : num[b]].tolist() == want, (b, min_n, max_n)
