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


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # One list per request; empty for a request whose prefill chunk did not reach its end.
    sampled_token_ids: list[list[int]]
    # Per request (None when the request asked for none): logprobs of each sampled token.
    logprobs: list[LogprobsLists | None] = field(default_factory=list)
    # req_id -> prompt logprobs for the prompt tokens this step's chunk predicts.
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
