"""Verifying drafted tokens without changing what the target would produce.

A request with ``d`` drafts owns ``d + 1`` consecutive rows of target logits; row ``j``
scores its ``j``-th new token (after the drafts before it)::

    rows    | r0: x1  x2  x3  bonus | r1: bonus | r2: x1  bonus |
    drafts  |     x1  x2  x3        |           |     x1        |

The rule (Leviathan et al. 2023, Chen et al. 2023): draft ``x_j``, drawn with probability
``q_j(x_j)``, is accepted with probability ``min(1, p_j(x_j) / q_j(x_j))``, where ``p_j`` is
the target's distribution after every sampling knob (penalties, temperature, min-p, top-k,
top-p) has shaped it. At the first rejection a token is drawn from ``norm(max(0, p_j - q_j))``
and the run ends; if all ``d`` are accepted one bonus token is drawn from ``p_d``. Every
token that comes out is then distributed exactly as plain sampling from ``p``. Greedy rows
(``p`` one-hot at the argmax) accept exactly the drafts equal to the target's argmax.

Drafts given without probabilities (n-gram lookup, greedy EAGLE) have a one-hot ``q``. The
rule then reads "accept ``x_j`` with probability ``p_j(x_j)``; on rejection draw from ``p_j``
without ``x_j``", which is what drawing ``t_j ~ p_j`` and accepting iff ``t_j == x_j`` does.
That is how those rows are verified: with the plain sampler, each row's draw keyed on
(seed, output index) as always, so a seeded request emits the very tokens it would without
speculation, and greedy output is identical by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagelm.sample.metadata import SamplingMetadata
from pagelm.sample.sampler import (
    LogprobsTensors,
    Sampler,
    gather_logprobs,
    process_logits,
    sample_from_probs,
    sampling_probs,
)
from pagelm.sampling_params import SAMPLING_EPS


@dataclass(slots=True)
class RejectionSamplerOutput:
    # Per request: its accepted drafts, then the token the target drew (correction or bonus).
    token_ids: list[list[int]]
    num_accepted: list[int]
    # Row-aligned with the logits (request i's tokens are rows ``row_start[i]`` onwards),
    # or None when nobody asked for logprobs.
    logprobs: LogprobsTensors | None


def draft_row_layout(draft_token_ids: list[list[int]]) -> tuple[list[int], list[int]]:
    """``(draft_rows, bonus_rows)`` of the layout above."""
    draft_rows, bonus_rows, row = [], [], 0
    for drafts in draft_token_ids:
        draft_rows.extend(range(row, row + len(drafts)))
        row += len(drafts)
        bonus_rows.append(row)
        row += 1
    return draft_rows, bonus_rows


class RejectionSampler:
    def __init__(self) -> None:
        self.sampler = Sampler()

    def __call__(
        self,
        logits: torch.Tensor,
        md: SamplingMetadata,
        draft_token_ids: list[list[int]],
        generator: torch.Generator | None = None,
        draft_probs: torch.Tensor | None = None,
    ) -> RejectionSamplerOutput:
        """``logits`` [rows, V] float32 in the layout above; ``md`` has one row per logits
        row (a row's output history includes the drafts before it, so penalties, min-tokens
        and seeds see what plain decoding would). ``draft_probs`` [num drafts, V]: each
        draft's ``q`` in row order; None means one-hot (deterministic drafts)."""
        num_rows = sum(len(d) + 1 for d in draft_token_ids)
        assert logits.shape[0] == num_rows, f"{logits.shape[0]} logits rows for {num_rows} draft + bonus rows"
        if draft_probs is None:
            return self._verify_deterministic(logits, md, draft_token_ids, generator)
        return self._verify_probabilistic(logits, md, draft_token_ids, draft_probs, generator)

    def verify_argmax(self, logits: torch.Tensor, draft_token_ids: list[list[int]]) -> RejectionSamplerOutput:
        """Every row greedy with nothing to process (``SamplingMetadata`` would only say so):
        the target's token is each row's argmax, and a draft is accepted while it equals it.
        The same tokens as ``__call__`` with an all-greedy ``md``, without building one."""
        num_rows = sum(len(d) + 1 for d in draft_token_ids)
        assert logits.shape[0] == num_rows, f"{logits.shape[0]} logits rows for {num_rows} draft + bonus rows"
        return _accept_equal(logits.argmax(dim=-1).tolist(), draft_token_ids, None)  # the one host sync

    def _verify_deterministic(self, logits, md, draft_token_ids, generator) -> RejectionSamplerOutput:
        out = self.sampler(logits, md, generator)
        return _accept_equal(out.sampled_token_ids.tolist(), draft_token_ids, out.logprobs)  # the one host sync

    def _verify_probabilistic(self, logits, md, draft_token_ids, draft_probs, generator) -> RejectionSamplerOutput:
        draft_rows, bonus_rows = draft_row_layout(draft_token_ids)
        processed = process_logits(logits, md)
        p = target_probs(processed, md)
        device = logits.device
        flat_drafts = torch.tensor([t for d in draft_token_ids for t in d], dtype=torch.long).to(device)
        d_rows = torch.tensor(draft_rows, dtype=torch.long).to(device)
        b_rows = torch.tensor(bonus_rows, dtype=torch.long).to(device)

        p_draft = p[d_rows]
        p_x = p_draft.gather(1, flat_drafts[:, None]).squeeze(1)
        q_x = draft_probs.gather(1, flat_drafts[:, None]).squeeze(1)
        u = _uniform(len(draft_rows), draft_rows, md.generators, generator, device)
        accept = u * q_x < p_x  # u < p/q, i.e. probability min(1, p/q)
        residual = (p_draft - draft_probs).clamp_min_(0.0)
        mass = residual.sum(dim=1, keepdim=True)
        # p == q leaves no residual, but then the draft is always accepted: any row will do.
        residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_draft)
        recovered = sample_from_probs(residual, _subset(md.generators, draft_rows), generator)
        bonus = sample_from_probs(p[b_rows], _subset(md.generators, bonus_rows), generator)

        accept_l, recovered_l, bonus_l = accept.tolist(), recovered.tolist(), bonus.tolist()
        tokens, accepted, chosen, k = [], [], [], 0
        for i, drafts in enumerate(draft_token_ids):
            a = 0
            while a < len(drafts) and accept_l[k + a]:
                a += 1
            last = recovered_l[k + a] if a < len(drafts) else bonus_l[i]
            run = list(drafts[:a]) + [last]
            tokens.append(run)
            accepted.append(a)
            # Row-aligned tokens for logprobs: rows past the run are not emitted.
            chosen.extend(run + [last] * (len(drafts) - a))
            k += len(drafts)
        logprobs = None
        if md.max_num_logprobs is not None:
            chosen_t = torch.tensor(chosen, dtype=torch.long).to(device)
            logprobs = gather_logprobs(logits.log_softmax(dim=-1), chosen_t, md.max_num_logprobs)
        return RejectionSamplerOutput(tokens, accepted, logprobs)


def _accept_equal(sampled: list[int], draft_token_ids: list[list[int]], logprobs) -> RejectionSamplerOutput:
    """One-hot drafts against the target's draws ``sampled`` (one per row): each request's
    drafts up to the first that differs from the draw at its row, then that row's draw."""
    tokens, accepted, row = [], [], 0
    for drafts in draft_token_ids:
        a = 0
        while a < len(drafts) and sampled[row + a] == drafts[a]:
            a += 1
        tokens.append(sampled[row : row + a + 1])
        accepted.append(a)
        row += len(drafts) + 1
    return RejectionSamplerOutput(tokens, accepted, logprobs)


def target_probs(processed_logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """``p`` for every row: the sampling distribution, one-hot at the argmax for greedy rows."""
    if md.all_greedy:
        probs = torch.zeros_like(processed_logits)
        return probs.scatter_(1, processed_logits.argmax(dim=1, keepdim=True), 1.0)
    probs = sampling_probs(processed_logits, md)
    if not md.all_random:
        greedy = torch.zeros_like(probs).scatter_(1, processed_logits.argmax(dim=1, keepdim=True), 1.0)
        probs = torch.where((md.temperature < SAMPLING_EPS)[:, None], greedy, probs)
    return probs


def _subset(generators: dict[int, torch.Generator], rows: list[int]) -> dict[int, torch.Generator]:
    """Seeded rows' generators, re-indexed to positions within ``rows``."""
    return {i: generators[r] for i, r in enumerate(rows) if r in generators}


def _uniform(n, rows, generators, generator, device) -> torch.Tensor:
    u = torch.rand(n, device=device, generator=generator)
    for i, r in enumerate(rows):
        if r in generators:
            u[i] = torch.rand(1, device=device, generator=generators[r])[0]
    return u
