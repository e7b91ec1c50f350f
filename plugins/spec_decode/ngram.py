"""``ngram``: prompt lookup decoding. A request's newest ``n`` tokens are looked up earlier in
its own history (prompt and output), for ``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``; the tokens that followed the longest match's latest occurrence are
the drafts. Free to run, and strong wherever output copies its context (code edits,
extraction, summaries quoting the source, repetitive text)::

    history   ... a  b  c  d  e  f  ...  a  b  c |        suffix "a b c" (n = 3)
                  ^^^^^^^ latest earlier match      drafts: d e f (k = 3)

A continuation shorter than ``k`` (the match ends just before the suffix: a repeating
pattern) is repeated with its period, so ``x y x y x`` drafts ``y x y``.
"""

from __future__ import annotations

import numpy as np

from pagelm import hookimpl
from pagelm.plugins.spec_decode.drafting import DraftProposer, ProposalBatch

PAGELM_PLUGIN_API = "2.25"


class NgramProposer(DraftProposer):
    name = "ngram"
    needs_every_step = False  # nothing to keep between steps: the history is the state
    uses_target_pass = False

    def __init__(self, config, target, device, dtype) -> None:
        super().__init__(config, target, device, dtype)
        self.min_n, self.max_n = lookup_range(self.speculative)

    @classmethod
    def validate(cls, config) -> list[str]:
        lo, hi = lookup_range(config.speculative)
        if lo > hi:
            return [f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"]
        return []

    def propose(self, batch: ProposalBatch) -> list[list[int]]:
        want = batch.max_num_drafts > 0
        drafts = [[] for _ in range(batch.num_reqs)]
        if not want.any():
            return drafts
        index = np.flatnonzero(want)
        tokens, num_found = ngram_drafts(
            batch.token_ids[index], batch.num_tokens[index], self.min_n, self.max_n, self.num_speculative_tokens
        )
        for i, row, n in zip(index.tolist(), tokens.tolist(), num_found.tolist()):
            drafts[i] = row[:n]
        return drafts


def lookup_range(spec) -> tuple[int, int]:
    """(min, max) suffix length; one given sets both, neither gives vLLM's 5 and 5."""
    lo, hi = spec.prompt_lookup_min, spec.prompt_lookup_max
    if lo is None and hi is None:
        return 5, 5
    return (lo if lo is not None else hi), (hi if hi is not None else lo)


def ngram_drafts(
    tokens: np.ndarray, lengths: np.ndarray, min_n: int, max_n: int, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Batched prompt lookup over ``tokens`` [B, W] (row ``b`` valid up to ``lengths[b]``).

    Returns ``(drafts [B, k], num_drafts [B])``: 0 drafts where no suffix of length
    ``>= min_n`` occurs earlier. The candidates are the positions ``(b, j)`` holding the
    request's last token (found in one pass over the batch); each longer suffix keeps those
    whose preceding token matches too, so the work after that pass is proportional to the
    candidates, not to the history. The longest ``n`` with a match wins, at its latest
    occurrence.
    """
    B, W = tokens.shape
    lengths = lengths.astype(np.int64)
    rows = np.arange(B)
    last = tokens[rows, np.maximum(lengths - 1, 0)]
    r, j = np.nonzero(tokens == last[:, None])
    # A match must end before the last token (something has to follow it).
    keep = j < lengths[r] - 1
    r, j = r[keep], j[keep]
    best_end = np.full(B, -1, dtype=np.int64)
    for n in range(1, max_n + 1):
        if n > 1:  # the suffix's n-th token from the end must match the one before j too
            keep = (j >= n - 1) & (lengths[r] >= n + 1)
            r, j = r[keep], j[keep]
            keep = tokens[r, j - n + 1] == tokens[r, lengths[r] - n]
            r, j = r[keep], j[keep]
        if r.size == 0:
            break
        if n >= min_n:
            latest = np.full(B, -1, dtype=np.int64)
            np.maximum.at(latest, r, j)
            best_end = np.where(latest >= 0, latest, best_end)
    found = best_end >= 0
    period = np.where(found, lengths - 1 - best_end, 1)  # tokens between the match and the end
    index = best_end[:, None] + 1 + np.arange(k)[None, :] % period[:, None]
    drafts = tokens[rows[:, None], np.where(found[:, None], index, 0)]
    return drafts, np.where(found, k, 0)


@hookimpl
def pagelm_register_proposers(registry) -> None:
    registry.add(NgramProposer.name, NgramProposer)
