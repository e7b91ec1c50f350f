"""What one engine step's outputs did, gathered by the output processor for the metrics
(vLLM's ``IterationStats``). The API process collects these while it processes the outputs
anyway, so the engine core's step loop does no extra work per token; with no metrics
(offline ``LLM``) nothing is collected at all.

A request's timeline, as vLLM's request histograms cut it::

    arrival     first scheduled     first token              last token
       |--- queued ---|---- prefill ----|-------- decode --------|
                      |------------- inference ------------------|
       |----------------------------- e2e -----------------------|
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagelm.outputs import RequestMetrics


@dataclass(slots=True)
class FinishedRequestStats:
    """One finished request (one sample of an ``n > 1`` request), in seconds and tokens.
    The intervals are ``None`` when it finished before its first token (a failed request)."""

    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    max_tokens_param: int | None
    e2e_latency: float
    queued_time: float | None = None
    prefill_time: float | None = None
    decode_time: float | None = None
    inference_time: float | None = None
    # Decode time over the tokens after the first (0 for a one-token request, as vLLM).
    mean_time_per_output_token: float | None = None

    @classmethod
    def of(cls, m: RequestMetrics, finish_reason: str, num_prompt_tokens: int, num_cached_tokens: int,
           max_tokens_param: int | None, now: float) -> "FinishedRequestStats":
        stats = cls(finish_reason, num_prompt_tokens, m.num_generation_tokens, num_cached_tokens,
                    max_tokens_param, e2e_latency=now - m.arrival_time)
        if m.first_token_time is None or m.last_token_time is None:
            return stats
        # Scheduled before its first token; a request whose first output carried no
        # schedule time (none today) counts as scheduled on arrival.
        scheduled = m.first_scheduled_time if m.first_scheduled_time is not None else m.arrival_time
        stats.queued_time = max(0.0, scheduled - m.arrival_time)
        stats.prefill_time = max(0.0, m.first_token_time - scheduled)
        stats.decode_time = m.last_token_time - m.first_token_time
        stats.inference_time = max(0.0, m.last_token_time - scheduled)
        gaps = m.num_generation_tokens - 1
        stats.mean_time_per_output_token = stats.decode_time / gaps if gaps > 0 else 0.0
        return stats


@dataclass(slots=True)
class IterationStats:
    """One step's outputs. Prompt tokens count when a request's prefill is done (its first
    token), generation tokens as the engine core produced them."""

    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    # One per output after a request's first: the gap since its previous output. One output
    # is one token, or the accepted run of a speculative step (vLLM counts those the same).
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    # Once per user request (after its last sample): its n and its longest sample.
    n_params: list[int] = field(default_factory=list)
    max_num_generation_tokens: list[int] = field(default_factory=list)

    def observe_tokens(self, num_new_tokens: int, previous_token_time: float | None, now: float,
                       arrival_time: float, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """A request's output with ``num_new_tokens`` tokens arrived at ``now``."""
        self.num_generation_tokens += num_new_tokens
        if previous_token_time is None:
            self.num_prompt_tokens += num_prompt_tokens
            self.num_cached_prompt_tokens += num_cached_tokens
            self.time_to_first_tokens.append(now - arrival_time)
        else:
            self.inter_token_latencies.append(now - previous_token_time)
