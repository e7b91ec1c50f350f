"""What the model runner hands back each step: plain Python lists, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LogprobsLists:
    """Per position: column 0 is the chosen token, then the top-k; ``ranks`` is the chosen
    token's rank in the full distribution (1 = most likely)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def head(self, n: int) -> "LogprobsLists":
        """The first ``n`` positions (a run of accepted drafts cut short by a stop)."""
        if n >= len(self.ranks):
            return self
        return LogprobsLists(self.token_ids[:n], self.logprobs[:n], self.ranks[:n])

    def skip(self, n: int) -> "LogprobsLists":
        """All but the first ``n`` positions (prompt positions already reported)."""
        if n <= 0:
            return self
        return LogprobsLists(self.token_ids[n:], self.logprobs[n:], self.ranks[n:])


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # One list per request; empty for a request whose prefill chunk did not reach its end.
    # Several tokens when drafts were verified: the accepted drafts, then the target's token.
    sampled_token_ids: list[list[int]]
    # Per request (None when the request asked for none): logprobs of each sampled token.
    logprobs: list[LogprobsLists | None] = field(default_factory=list)
    # req_id -> prompt logprobs for the prompt tokens this step's chunk predicts.
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Speculative decoding: per request, the drafts proposed for the next step (empty when
    # none); an empty list overall when speculative decoding is off.
    draft_token_ids: list[list[int]] = field(default_factory=list)
    # With a second KV tier: requests whose loads from the tier have landed in the GPU pool
    # since the last report (the scheduler may now schedule them; see KVTransfers).
    finished_loads: list[str] = field(default_factory=list)
