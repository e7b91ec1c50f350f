"""Turns engine-core outputs into ``RequestOutput``s: detokenize, stop strings, logprobs,
metrics, and fan-in of the ``n`` samples of one prompt."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagelm.engine.core_output import EngineCoreOutput
from pagelm.engine.detokenizer import IncrementalDetokenizer
from pagelm.engine.iteration_stats import FinishedRequestStats, IterationStats
from pagelm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput, SampleLogprobs
from pagelm.sampling_params import SamplingParams
from pagelm.worker.output import LogprobsLists


class OutputKind(enum.Enum):
    FINAL_ONLY = "final"  # offline LLM.generate: one output per request, at the end
    DELTA = "delta"  # streaming: only what is new since the last output


@dataclass
class ParentRequest:
    """The user's request when ``n > 1``: children ``0_<id>``, ``1_<id>``, ... share the prompt."""

    request_id: str
    n: int
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    num_finished: int = 0
    # The longest sample so far (vLLM's request_max_num_generation_tokens).
    max_num_generation_tokens: int = 0


class RequestState:
    def __init__(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, tokenizer,
        output_kind: OutputKind, arrival_time: float, parent: ParentRequest | None = None, index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.output_kind = output_kind
        self.parent = parent
        self.index = index
        # No tokenizer (skip_tokenizer_init): token ids only, the text stays empty.
        self.detokenizer = None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        self.token_ids: list[int] = []
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = [None] if params.prompt_logprobs is not None else None
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self._sent_text_len = 0
        # Streaming with stop strings holds back text that could still turn out to be the
        # start of a stop string (and be cut), so deltas always add up to the final text.
        self._stop_holdback = (
            max(len(x) for x in params.stop) - 1 if params.stop and not params.include_stop_str_in_output else 0
        )
        self._sent_tokens = 0
        self._sent_logprobs = 0

    def _decode(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _to_dicts(self, lists: LogprobsLists) -> list[dict[int, Logprob]]:
        out = []
        for ids, lps, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
            entry = {ids[0]: Logprob(lps[0], rank, self._decode(ids[0]))}
            for r, (tid, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
                entry.setdefault(tid, Logprob(lp, r, self._decode(tid)))
            out.append(entry)
        return out

    def apply(self, out: EngineCoreOutput, now: float) -> str | None:
        """Fold one step's output in; returns a stop string if one ended the request."""
        self.num_cached_tokens = out.num_cached_tokens
        if out.first_scheduled_time is not None:
            self.metrics.first_scheduled_time = out.first_scheduled_time
        if out.new_prompt_logprobs is not None and self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(self._to_dicts(out.new_prompt_logprobs))
        self.error = self.error or out.error  # finish reason "error": e.g. its grammar did not compile
        if out.num_draft_tokens:
            self.metrics.spec_num_drafts += 1
            self.metrics.spec_num_draft_tokens += out.num_draft_tokens
            self.metrics.spec_num_accepted_tokens += out.num_accepted_tokens
        if not out.new_token_ids:
            if out.error is not None:  # failed before producing output
                self.finish_reason = out.finish_reason
                self.metrics.finished_time = now
            return None
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.last_token_time = now
        new_ids, new_logprobs = out.new_token_ids, out.new_logprobs
        stop_str = None if self.detokenizer is None else self.detokenizer.update(self._text_ids(out))
        if stop_str is not None and self.detokenizer.num_tokens_used < len(new_ids):
            # A stop string inside a run of accepted drafts: the request ends at its token.
            new_ids = new_ids[: self.detokenizer.num_tokens_used]
            new_logprobs = None if new_logprobs is None else new_logprobs.head(len(new_ids))
        self.token_ids.extend(new_ids)
        self.metrics.num_generation_tokens = len(self.token_ids)
        if self.logprobs is not None and new_logprobs is not None:
            self.logprobs.extend(self._to_dicts(new_logprobs))
            self.cumulative_logprob += sum(lps[0] for lps in new_logprobs.logprobs)
        if stop_str is not None:
            self.finish_reason, self.stop_reason = "stop", stop_str
        elif out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        if self.finish_reason is not None:
            self.metrics.finished_time = now
        return stop_str

    def _text_ids(self, out: EngineCoreOutput) -> list[int]:
        """The step's tokens whose text joins the output: all but a stop token that ended the
        request (EOS or one of ``stop_token_ids``, even when special tokens are not skipped),
        unless ``include_stop_str_in_output``, as in vLLM."""
        stopped_by_token = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
        if stopped_by_token and not self.detokenizer.include_stop_str_in_output:
            return out.new_token_ids[:-1]
        return out.new_token_ids

    def completion(self) -> CompletionOutput:
        """The whole completion so far (FINAL_ONLY) or only the new part (DELTA)."""
        text = "" if self.detokenizer is None else self.detokenizer.output_text
        if self.output_kind == OutputKind.FINAL_ONLY:
            token_ids, logprobs = list(self.token_ids), self.logprobs
        else:
            end = len(text) if self.finish_reason is not None else len(text) - self._stop_holdback
            end = max(end, self._sent_text_len)
            text, token_ids = text[self._sent_text_len : end], self.token_ids[self._sent_tokens :]
            logprobs = None if self.logprobs is None else self.logprobs[self._sent_logprobs :]
            self._sent_text_len, self._sent_tokens = end, len(self.token_ids)
            self._sent_logprobs = len(self.logprobs or [])
        return CompletionOutput(
            index=self.index, text=text, token_ids=token_ids, cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs, finish_reason=self.finish_reason, stop_reason=self.stop_reason,
        )


class OutputProcessor:
    def __init__(self) -> None:
        self.states: dict[str, RequestState] = {}
        # n > 1: parent id -> ids of its unfinished children.
        self.parent_children: dict[str, list[str]] = {}

    def add_request(self, state: RequestState) -> None:
        self.states[state.request_id] = state
        if state.parent is not None:
            self.parent_children.setdefault(state.parent.request_id, []).append(state.request_id)

    def _forget(self, state: RequestState) -> None:
        del self.states[state.request_id]
        if state.parent is not None:
            siblings = self.parent_children[state.parent.request_id]
            siblings.remove(state.request_id)
            if not siblings:
                del self.parent_children[state.parent.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Forget requests, each ``n > 1`` parent id standing for its unfinished children;
        returns the ids of those that were still running."""
        ids = (i for req_id in request_ids for i in self.parent_children.get(req_id, (req_id,)))
        live = [i for i in dict.fromkeys(ids) if i in self.states]
        for req_id in live:
            self._forget(self.states[req_id])
        return live

    def process_outputs(
        self, outputs: list[EngineCoreOutput], stats: IterationStats | None = None
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the user-facing outputs and the ids the engine core must abort because a
        stop string ended them here. ``stats`` (when given) gathers the step for the metrics."""
        now = time.time()
        results: list[RequestOutput] = []
        to_abort: list[str] = []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue
            previous_token_time = state.metrics.last_token_time
            if state.apply(out, now) is not None and not out.finished:
                to_abort.append(out.request_id)
            finished = state.finish_reason is not None
            if finished:
                self._forget(state)
            result = self._make_output(state, finished)
            if result is not None:
                results.append(result)
            if stats is not None:
                _observe(stats, state, out, previous_token_time, now, finished)
        return results, to_abort

    def _make_output(self, state: RequestState, finished: bool) -> RequestOutput | None:
        if state.output_kind == OutputKind.FINAL_ONLY and not finished:
            return None
        completion = state.completion()
        request_id, completions, all_done = state.request_id, [completion], finished
        parent = state.parent
        if parent is not None:
            request_id = parent.request_id
            if state.output_kind == OutputKind.FINAL_ONLY:
                parent.completions[state.index] = completion
                parent.num_finished += 1
                if parent.num_finished < parent.n:
                    return None
                completions = [parent.completions[i] for i in range(parent.n)]
            else:
                parent.num_finished += finished
                all_done = parent.num_finished == parent.n
        return RequestOutput(
            request_id=request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs, outputs=completions, finished=all_done, metrics=state.metrics,
            num_cached_tokens=state.num_cached_tokens, error=state.error,
        )


def _observe(stats: IterationStats, state: RequestState, out: EngineCoreOutput,
             previous_token_time: float | None, now: float, finished: bool) -> None:
    """Fold one request's output into the step's stats (after ``_make_output``, which counts
    the finished samples of an ``n > 1`` request)."""
    m = state.metrics
    if out.new_token_ids:
        stats.observe_tokens(len(out.new_token_ids), previous_token_time, now, m.arrival_time,
                             len(state.prompt_token_ids), out.num_cached_tokens)
    if not finished:
        return
    stats.finished_requests.append(FinishedRequestStats.of(
        m, state.finish_reason, len(state.prompt_token_ids), state.num_cached_tokens, state.params.max_tokens, now,
    ))
    parent = state.parent
    if parent is None:
        stats.n_params.append(1)
        stats.max_num_generation_tokens.append(m.num_generation_tokens)
        return
    parent.max_num_generation_tokens = max(parent.max_num_generation_tokens, m.num_generation_tokens)
    if parent.num_finished == parent.n:
        stats.n_params.append(parent.n)
        stats.max_num_generation_tokens.append(parent.max_num_generation_tokens)
