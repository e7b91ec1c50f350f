"""What users get back: ``RequestOutput`` with one ``CompletionOutput`` per sample (vLLM's
shapes and names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagelm.spec_decode.stats import acceptance_rate, mean_acceptance_length


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    # Speculative decoding (0 when off): verification rounds ("drafts"), tokens drafted in
    # them, and how many of those the target accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def spec_mean_acceptance_length(self) -> float | None:
        """Tokens per verification round: 1 + accepted / rounds (None without drafts)."""
        return mean_acceptance_length(self.spec_num_drafts, self.spec_num_accepted_tokens)

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens (None without drafts)."""
        return acceptance_rate(self.spec_num_draft_tokens, self.spec_num_accepted_tokens)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # finish_reason "error": why the request failed (e.g. its grammar did not compile).
    error: str | None = None
    extra: dict = field(default_factory=dict)
