"""Acceptance counters for speculative decoding, kept by the scheduler (aggregate) and per
request, in vLLM's terms: a *draft* is one verification of ``k`` drafted tokens; the mean
acceptance length is the tokens a draft yields, ``1 + accepted / drafts`` (the +1 is the token
the target samples after the accepted run)."""

from __future__ import annotations

from dataclasses import dataclass, field


def mean_acceptance_length(num_drafts: int, num_accepted_tokens: int) -> float | None:
    """Tokens per verification: ``1 + accepted / drafts`` (None without drafts)."""
    return 1.0 + num_accepted_tokens / num_drafts if num_drafts else None


def acceptance_rate(num_draft_tokens: int, num_accepted_tokens: int) -> float | None:
    """Accepted / drafted tokens (None without drafts)."""
    return num_accepted_tokens / num_draft_tokens if num_draft_tokens else None


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [j]: drafts whose token at position j (0-based) was accepted.
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos.extend([0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos)))
        for j in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[j] += 1

    @property
    def mean_acceptance_length(self) -> float | None:
        return mean_acceptance_length(self.num_drafts, self.num_accepted_tokens)

    @property
    def acceptance_rate(self) -> float | None:
        return acceptance_rate(self.num_draft_tokens, self.num_accepted_tokens)
