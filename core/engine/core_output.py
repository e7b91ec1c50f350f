"""What the engine core reports per request per step."""

from __future__ import annotations

from dataclasses import dataclass

from pagelm.worker.output import LogprobsLists


# How a request's error starts when the engine failed it, not its input (a step raised):
# the API side reports it as a server error (500), not as bad input (400).
ENGINE_FAULT = "the engine step failed"


class EngineStepError(RuntimeError):
    """The engine failed a request because a step raised (``ENGINE_FAULT``); it serves on."""


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Set on a request's first output: when the scheduler first admitted it.
    first_scheduled_time: float | None = None
    # finish_reason "error": why the request failed (e.g. its grammar did not compile).
    error: str | None = None
    # Speculative decoding, this step: drafts verified and how many of them were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
