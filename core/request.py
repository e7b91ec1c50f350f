"""Request: one sequence as the engine core sees it (token ids, progress, state)."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagelm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagelm.multimodal import MultiModalFeature


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    # Guided decoding: its grammar is compiling; the scheduler does not see it until then.
    WAITING_FOR_GRAMMAR = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Admitted with KV in the second tier: its blocks are being loaded back, not yet scheduled.
    WAITING_FOR_KV = enum.auto()
    # Everything after this is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # Failed before producing output (e.g. its grammar did not compile); ``Request.error`` says why.
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}

BlockHasher = Callable[["Request"], list[bytes]]


class Request:
    """Token ids and progress of one sequence.

    ``num_computed_tokens`` counts the tokens whose KV is in the cache; the scheduler gives
    each running request ``num_tokens - num_computed_tokens`` more this step (or a chunk of
    them)::

        | prompt_token_ids            | output_token_ids      |
        | computed (KV cached)   | new this step            |
        0                 num_computed_tokens          num_tokens

    With async scheduling a step is scheduled before the one in flight has sampled: each
    token sampled but not yet seen is an output placeholder, and a decode's next input is
    its placeholder (the runner takes its id from the device)::

        | prompt_token_ids        | output_token_ids   | placeholders |
        0                                          num_tokens      num_tokens_with_placeholders
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        max_tokens: int | None = None,
        block_hasher: BlockHasher | None = None,
        mm_features: list[MultiModalFeature] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # Images in the prompt, by offset (pagelm.multimodal); empty for text.
        self.mm_features: list[MultiModalFeature] = list(mm_features or ())
        # Effective output budget: SamplingParams.max_tokens capped by max_model_len.
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        # Guided decoding: the structured-output manager's state for this request (opaque to
        # the core), set once its grammar is ready.
        self.grammar: Any = None
        self.output_token_ids: list[int] = []
        # Steps scheduled that sample this request's next token and whose token has not come
        # back yet (``update_from_output`` turns each into a real token).
        self.num_output_placeholders = 0
        # Speculative decoding: drafts proposed for this request's next step (not yet tokens
        # of the request: block hashes and stop checks never see them).
        self.spec_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache at first admission (reported to users).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Preemptions since it last produced a token (the scheduler's progress guard), and
        # its token count at the last preemption.
        self.num_stalled_preemptions = 0
        self.num_output_tokens_at_preemption = 0
        # Prompt logprobs skip the prefix cache (their logits must be computed).
        self.skip_prefix_cache = sampling_params.prompt_logprobs is not None
        self.prompt_logprobs_done = sampling_params.prompt_logprobs is None
        # Prompt positions whose logprobs were reported (1 .. this): a request recomputed
        # after a preemption scores them again, and they must not be reported twice.
        self.num_prompt_logprobs_reported = 0
        # Its next sample reads its previous tokens on the host (penalties count them, a bad
        # word of several tokens matches the output's tail): with async scheduling a step that
        # has such a request runs synchronously.
        self.reads_output_history = (
            sampling_params.presence_penalty != 0.0
            or sampling_params.frequency_penalty != 0.0
            or sampling_params.repetition_penalty != 1.0
            or bool(sampling_params.bad_word_prefixes)
        )
        self._block_hasher = block_hasher
        self.block_hashes: list[bytes] = []
        self._update_block_hashes()

    # ---- tokens --------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self._all_token_ids) + self.num_output_placeholders

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        self._update_block_hashes()

    def attach_block_hasher(self, block_hasher: BlockHasher) -> None:
        """Hash this request's full blocks from now on. The engine core does it as the request
        arrives, in its own process, so that a prompt is hashed once, where the prefix cache
        reads the hashes (the API process never hashes)."""
        if self._block_hasher is None:
            self._block_hasher = block_hasher
            self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    # ---- state ---------------------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def use_structured_output(self) -> bool:
        return self.sampling_params.guided_decoding is not None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
