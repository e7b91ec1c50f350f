"""The scheduler: one token-budget loop over running, then waiting requests.

There are no prefill and decode phases. Each step every running request is offered the
tokens it still lacks (1 for a decode, a chunk for a prefill) until the budget
(``max_num_batched_tokens``) or ``max_num_seqs`` runs out; the policy plugin orders the
waiting queue and picks preemption victims.

A step that samples a request's next token leaves an output placeholder on it until
``update_from_output`` brings the token. With async scheduling the next step is scheduled
while one is in flight: a decode's pending token is its next input, and a request whose
token turns out to end it has its next step's token discarded.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagelm.config import EngineConfig
from pagelm.engine.core_output import EngineCoreOutput
from pagelm.kv_cache import KVCacheManager
from pagelm.registry import PluginError
from pagelm.request import Request, RequestStatus
from pagelm.sched.encoder_cache import EncoderCacheManager
from pagelm.sched.output import CachedRequestData, KVTransfers, NewRequestData, SchedulerOutput
from pagelm.sched.policy import SchedulingPolicy
from pagelm.spec_decode.stats import SpecDecodingStats
from pagelm.structured_output import StructuredOutputManager
from pagelm.worker.output import LogprobsLists, ModelRunnerOutput

logger = logging.getLogger("pagelm")

# With nothing to run but grammars compiling, schedule() waits this long for a compile
# instead of spinning (new requests are picked up after at most this delay).
_IDLE_GRAMMAR_WAIT_S = 0.005


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv_cache_manager: KVCacheManager,
        policy: SchedulingPolicy,
        max_model_len: int,
        structured_output: StructuredOutputManager | None = None,
        num_lookahead_tokens: int = 0,
        encoder_cache: EncoderCacheManager | None = None,
    ) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.policy = policy
        self.waiting = policy.make_queue()
        self.max_model_len = max_model_len
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_last_step: set[str] = set()
        self.num_preemptions = 0
        # Tokens computed for requests that had ended (EOS, stop, abort) before their step
        # came back: the price of scheduling a step while the previous one is in flight.
        self.num_discarded_tokens = 0
        # Steps scheduled and not yet updated, oldest first, with their requests and where each
        # one's chunk starts: a late token goes to the request it was computed for, never to a
        # new one reusing its id.
        self._unupdated_steps: deque[tuple[SchedulerOutput, list[tuple[Request, int]]]] = deque()
        # Guided decoding: grammars compile off the step loop; a request joins the waiting
        # queue once its grammar is ready, or fails with the compile's error.
        self.structured_output = structured_output
        self._failed: list[Request] = []
        # Speculative decoding: KV slots reserved past a step's tokens for the proposer's own
        # writes (EAGLE's KV at draft positions), and acceptance counters since start.
        self.num_lookahead_tokens = num_lookahead_tokens
        self.spec_decoding_stats = SpecDecodingStats()
        # Preemptions in a row without a new token after which a request is no longer a victim.
        self.max_stalled_preemptions = config.max_stalled_preemptions
        # Pipeline parallelism keeps several steps in flight, each over requests of its own: a
        # request whose sampled token is still in flight waits for it (nobody could feed it
        # to the first stage) instead of riding on a placeholder as with async scheduling.
        self.await_samples = config.pipeline_parallel_size > 1
        # Multimodal models: the images' embeddings the runner holds, and the embeddings the
        # encoder may make per step (None: a text-only model).
        self.encoder_cache = encoder_cache
        self.encoder_budget = config.encoder_budget
        # Second KV tier: requests whose KV is being loaded back from it (admitted, holding
        # their blocks, not yet scheduled), the loads the runner has reported landed but no
        # step has waited for yet, and those requests until their first step is scheduled
        # (the runner has not seen them).
        self._loading: dict[str, Request] = {}
        self._load_waits: list[str] = []
        self._unsent: set[str] = set()
        # Loads of requests aborted while loading, not reported yet: the engine steps on
        # until they land, so that the tier gets their sources back.
        self._abandoned_loads: set[str] = set()

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        if request.use_structured_output:
            if self.structured_output is None:
                raise ValueError(f"request {request.request_id}: guided decoding needs a structured-output backend plugin")
            if not self.structured_output.submit(request):  # not cached: compiling
                request.status = RequestStatus.WAITING_FOR_GRAMMAR
                self.requests[request.request_id] = request
                return
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step loop (abort, stop string); frees their blocks."""
        done = []
        for req_id in request_ids:
            req = self.requests.get(req_id)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
                self._unsent.discard(req_id)
            elif req.status == RequestStatus.WAITING_FOR_KV:
                del self._loading[req_id]
                self._load_waits.append(req_id)  # its blocks are reused only after its load
                self._abandoned_loads.add(req_id)
            elif req.status != RequestStatus.WAITING_FOR_GRAMMAR:
                self.waiting.remove(req)
            req.status = status
            self._free(req)
            done.append(req)
        return done

    def fail_all(self) -> list[Request]:
        """End every request with ``FINISHED_ERROR`` and free its blocks, whatever state a
        failed step left the queues in (``EngineCore.fail_all``)."""
        failed = list(self.requests.values())
        self.running.clear()
        self.waiting = self.policy.make_queue()
        self._unupdated_steps.clear()
        self._loading.clear()
        self._load_waits.clear()
        self._unsent.clear()
        self._abandoned_loads.clear()
        for req in failed:
            req.status = RequestStatus.FINISHED_ERROR
            self._free(req)
        if self.encoder_cache is not None:  # the failed step may not have encoded what it allocated
            self.encoder_cache.evict_all()
        return failed

    def _free(self, request: Request) -> None:
        # With async scheduling a step in flight may still compute this request (its token is
        # discarded). Its blocks are free to reuse at once all the same: the device runs steps
        # in launch order, so that step's KV writes land before any later step writes or reads
        # the blocks. The same holds for preemption.
        if request.use_structured_output:
            self.structured_output.release(request)
        if request.mm_features:
            self.encoder_cache.free(request.request_id)
        self.kv.free(request)
        self._finished_since_last_step.add(request.request_id)
        del self.requests[request.request_id]

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        compiling = self.structured_output.num_waiting_for_grammar if self.structured_output else 0
        return len(self.waiting) + compiling + len(self._loading)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._abandoned_loads)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.structured_output is not None and self.structured_output.has_pending:
            self._take_compiled_grammars()
        out = SchedulerOutput(finished_req_ids=self._finished_since_last_step)
        self._finished_since_last_step = set()
        step = _StepState(budget=self.config.max_num_batched_tokens)
        if self.encoder_cache is not None:
            self.encoder_cache.begin_step(self.encoder_budget)
        self._schedule_running(out, step)
        # A running request had to give way for KV room: the pool is tight, admit nobody.
        if not out.preempted_req_ids:
            self._schedule_waiting(out, step)
        self._finalize(out, step)
        return out

    def _take_compiled_grammars(self) -> None:
        """Queue the requests whose grammar has compiled; fail those whose compile failed."""
        idle = not self.running and not len(self.waiting)  # nothing else to do: wait, don't spin
        ready, failed = self.structured_output.poll(_IDLE_GRAMMAR_WAIT_S if idle else 0.0)
        for req in ready:
            req.status = RequestStatus.WAITING
            self.waiting.add(req)
        for req in failed:  # reported by the next update_from_output
            req.status = RequestStatus.FINISHED_ERROR
            self._free(req)
            self._failed.append(req)

    def _schedule_running(self, out: SchedulerOutput, step: "_StepState") -> None:
        # With pipeline parallelism each of the pp steps in flight takes its share of the
        # running requests, so that the stages always have a micro-batch to work on.
        limit = len(self.running)
        if self.await_samples:
            limit = -(-limit // self.config.pipeline_parallel_size)
        # Decodes first, then unfinished prefills: a long prompt never starves decodes.
        for req in sorted(self.running, key=lambda r: r.num_tokens_with_placeholders - r.num_computed_tokens > 1):
            if step.budget == 0 or len(out.num_scheduled_tokens) >= limit:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if req.num_output_placeholders and (self.await_samples or self._placeholders_reach_limit(req)):
                continue  # its token in flight is its last (never past max_tokens), or its input
            # Drafts ride after the known tokens; a short budget trims them first.
            chunk = self._plan_chunk(req, req.num_computed_tokens, step, len(req.spec_token_ids))
            if chunk is None:
                continue
            num_new, encodes, partial = chunk
            lookahead = self._num_lookahead(req, req.num_computed_tokens + num_new, partial)
            blocks = self._allocate_or_preempt(req, num_new, lookahead, out, step)
            if blocks is None:
                continue
            if encodes is not None:
                self.encoder_cache.commit(req, encodes)
            step.book(req, num_new, partial, out)
            step.new_block_ids[req.request_id] = [b.block_id for b in blocks]
            if req.request_id in self._unsent:  # loaded from the tier: its first step
                self._unsent.discard(req.request_id)
                out.scheduled_new_reqs.append(self._new_request_data(req))
            num_drafts = req.num_computed_tokens + num_new - req.num_tokens_with_placeholders
            if num_drafts > 0:
                out.scheduled_spec_decode_tokens[req.request_id] = req.spec_token_ids[:num_drafts]

    def _schedule_waiting(self, out: SchedulerOutput, step: "_StepState") -> None:
        """Admit waiting requests in policy order; one with KV in the second tier is admitted
        to load it, and scheduled once it lands. When the head does not fit (KV blocks or
        ``max_num_seqs``) the policy may name a running request to preempt for it."""
        while len(self.waiting) and step.budget > 0:
            req = self.waiting.peek()
            if req.request_id in out.preempted_req_ids or req.num_output_placeholders:
                # It gave way this very step (taking it back now would only thrash), or with
                # several steps in flight (pipeline) one of them still owes it a token.
                break
            hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            if self._loading and self._hits_loading(hits):
                break  # its prefix is still being loaded for another request: soon
            if num_hit_tokens > len(hits) * self.kv.block_size:  # KV in the second tier
                if self._start_load(req, hits, num_hit_tokens):
                    continue
            else:
                chunk = self._plan_chunk(req, num_hit_tokens, step)
                if chunk is None:
                    break
                num_new, encodes, partial = chunk
                if len(self.running) + len(self._loading) < self.config.max_num_seqs:
                    lookahead = self._num_lookahead(req, num_hit_tokens + num_new, partial)
                    if self.kv.allocate_slots(req, num_new, lookahead, hits, num_hit_tokens) is not None:
                        self._admit(req, num_hit_tokens, out)
                        if encodes is not None:
                            self.encoder_cache.commit(req, encodes)
                        step.book(req, num_new, partial, out)
                        continue
            victim = self._victim_for_waiting(req)
            if victim is None:
                break
            self._preempt(victim, out, step)

    def _admit(self, req: Request, num_hit_tokens: int, out: SchedulerOutput) -> None:
        self._take_from_waiting(req, num_hit_tokens)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.scheduled_new_reqs.append(self._new_request_data(req))

    def _take_from_waiting(self, req: Request, num_hit_tokens: int) -> None:
        # A request preempted with a step in flight gets that step's token before its next
        # schedule(): it is never admitted the step it gave way.
        assert req.num_output_placeholders == 0, f"{req.request_id} admitted with a token in flight"
        self.waiting.pop()
        if req.num_cached_tokens < 0:  # first admission: report prefix hits to the user
            req.num_cached_tokens = num_hit_tokens
            self.kv.prefix_cache_stats.record(req.num_tokens, num_hit_tokens)
        req.num_computed_tokens = num_hit_tokens

    def _new_request_data(self, req: Request) -> NewRequestData:
        return NewRequestData(
            req_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=list(req.output_token_ids),
            sampling_params=req.sampling_params,
            block_ids=self.kv.get_block_ids(req.request_id),
            num_computed_tokens=req.num_computed_tokens,
            need_prompt_logprobs=not req.prompt_logprobs_done,
            mm_features=req.mm_features,
        )

    # ---- loads from the second KV tier ---------------------------------------------------
    def _start_load(self, req: Request, hits: list, num_hit_tokens: int) -> bool:
        """Admit the waiting head ``req`` without scheduling it: take its GPU hits and blocks
        for its KV in the tier, whose copies the runner queues behind this step, and park it
        until the runner reports them landed (``update_from_output``). Other requests' steps
        run meanwhile instead of waiting for the copies. False: no room (nothing changed)."""
        if len(self.running) + len(self._loading) >= self.config.max_num_seqs:
            return False
        if self.kv.allocate_slots(req, 0, 0, hits, num_hit_tokens) is None:
            return False
        self._take_from_waiting(req, num_hit_tokens)
        req.status = RequestStatus.WAITING_FOR_KV
        self._loading[req.request_id] = req
        return True

    def _hits_loading(self, hits: list) -> bool:
        """Whether a prefix hit is a block a load has yet to fill (registered in the prefix
        cache when the load was queued)."""
        if not hits:
            return False
        loading = {b for req_id in self._loading for b in self.kv.get_block_ids(req_id)}
        return any(b.block_id in loading for b in hits)

    def loads_landed(self, req_ids: list[str]) -> None:
        """The runner reports these requests' KV in the GPU pool: they run from the next step,
        whose forward pass waits for their copies on every rank."""
        self.kv.loads_landed(req_ids)
        for req_id in req_ids:
            self._abandoned_loads.discard(req_id)
            req = self._loading.pop(req_id, None)
            if req is None:  # aborted meanwhile
                continue
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._unsent.add(req_id)
            self._load_waits.append(req_id)

    def _finalize(self, out: SchedulerOutput, step: "_StepState") -> None:
        new_ids = {r.req_id for r in out.scheduled_new_reqs}
        scheduled = []
        for req_id, num_new in out.num_scheduled_tokens.items():
            req = self.requests[req_id]
            scheduled.append((req, req.num_computed_tokens))
            if req_id not in new_ids:
                out.scheduled_cached_reqs.append(
                    CachedRequestData(req_id, step.new_block_ids[req_id], req.num_computed_tokens)
                )
            samples = req.num_computed_tokens + num_new >= req.num_tokens_with_placeholders
            if req.grammar is not None and samples:
                out.structured_output_request_ids.append(req_id)  # it samples: mask its logits
                out.grammar_bitmask = self.structured_output.grammar_bitmask
            if req.reads_output_history:
                out.needs_previous_tokens = True
            if req.mm_features and (images := self.encoder_cache.assign_encodes(req, req.num_computed_tokens, num_new)):
                out.scheduled_encoder_inputs[req_id] = images
            # Progress is booked at scheduling time; the runner reads the pre-step value.
            req.num_computed_tokens += num_new
            if samples:
                req.num_output_placeholders += 1
            if req.mm_features:
                self.encoder_cache.release_computed(req)
        if self.encoder_cache is not None:
            out.free_encoder_identifiers = self.encoder_cache.end_step()
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        out.kv_transfers = self.kv.take_transfers()
        if self._load_waits:
            if out.kv_transfers is None:
                out.kv_transfers = KVTransfers()
            out.kv_transfers.waits, self._load_waits = self._load_waits, []
        assert out.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
        self._unupdated_steps.append((out, scheduled))

    def _plan_chunk(self, req: Request, num_computed: int, step: "_StepState", num_drafts: int = 0):
        """``(num_new, images to encode, partial)`` for ``req``'s tokens from ``num_computed``
        on, within the budget and ``long_prefill_token_threshold``; ``partial``: its prefill
        is unfinished after them. None when it gets nothing this step: its next image waits
        for encoder budget or cache room, or ``max_num_partial_prefills`` are under way."""
        num_new = min(req.num_tokens_with_placeholders + num_drafts - num_computed, step.budget)
        if self.config.long_prefill_token_threshold:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        encodes = None
        if req.mm_features:
            num_new, encodes = self.encoder_cache.plan(req, num_computed, num_new)
            if num_new == 0:
                return None
        partial = num_computed + num_new < req.num_tokens_with_placeholders
        if partial and len(step.partial_ids) >= self.config.max_num_partial_prefills:
            return None
        return num_new, encodes, partial

    def _num_lookahead(self, req: Request, end: int, partial: bool) -> int:
        """Slots past ``end`` (this step's last token) the proposer may write while drafting;
        none for an unfinished prefill chunk, which drafts nothing, or past max_model_len."""
        lookahead = self.num_lookahead_tokens
        if partial or not lookahead:
            return 0
        room = self.max_model_len - end  # compared, not min/max: once per request and step
        return lookahead if room >= lookahead else max(room, 0)

    def _placeholders_reach_limit(self, req: Request) -> bool:
        """Whether the tokens in flight take ``req`` to ``max_tokens`` or ``max_model_len``."""
        if req.num_tokens_with_placeholders >= self.max_model_len:
            return True
        return req.max_tokens is not None and req.num_output_tokens + req.num_output_placeholders >= req.max_tokens

    def _allocate_or_preempt(
        self, req: Request, num_new: int, lookahead: int, out: SchedulerOutput, step: "_StepState"
    ):
        """Allocate slots for ``req``, preempting policy-chosen victims until it fits.
        Returns the new blocks, or None if ``req`` itself was preempted."""
        while True:
            blocks = self.kv.allocate_slots(req, num_new, lookahead)
            if blocks is not None:
                return blocks
            victim = self._victim_for_room()
            self._preempt(victim, out, step)
            if victim is req:
                return None

    def _preempt(self, req: Request, out: SchedulerOutput, step: "_StepState") -> None:
        """Free the victim's GPU blocks and queue it again. Swapped (``preemption_mode`` swap,
        or auto where copying is cheaper) its computed tokens' KV waits in the second tier and
        is loaded back when it is admitted; recomputed it forgets its progress. A token still
        in flight keeps its placeholder: ``update_from_output`` appends it, and the request
        computes it with the rest when it is admitted again.

        A request booked earlier in this step registered the blocks its chunk fills in the
        prefix cache; nobody writes them now, so they leave the cache, and a request admitted
        this step on a hit of one of them gives way too (it would read KV nobody wrote)."""
        self.running.remove(req)
        self._unsent.discard(req.request_id)
        step.unbook(req, out)
        unwritten = self.kv.uncache_unwritten(req)
        mode = self.config.preemption_mode
        if mode == "recompute" or not self.kv.swap_out(req, force=mode == "swap"):
            self.kv.free(req)
        req.num_computed_tokens = 0  # a swapped one's count is the tier's, until it is loaded back
        if req.mm_features:
            self.encoder_cache.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.spec_token_ids = []
        req.num_preemptions += 1
        self._count_stall(req)
        self.num_preemptions += 1
        self.waiting.prepend(req)
        out.preempted_req_ids.add(req.request_id)
        for other in self._hit_unwritten(unwritten, out):
            self._preempt(other, out, step)

    def _hit_unwritten(self, blocks: list, out: SchedulerOutput) -> list[Request]:
        """Requests admitted this step that took prefix hits on ``blocks``."""
        if not blocks:
            return []
        ids = {b.block_id for b in blocks}
        hit = []
        for new in out.scheduled_new_reqs:
            other = self.requests[new.req_id]
            num_hit_blocks = other.num_computed_tokens // self.kv.block_size
            if not ids.isdisjoint(self.kv.get_block_ids(other.request_id)[:num_hit_blocks]):
                hit.append(other)
        return hit

    # ---- progress whatever the policy does ----------------------------------------------
    def _count_stall(self, req: Request) -> None:
        """Count preemptions since ``req`` last produced a token; at the limit it stops being
        a victim until it finishes, so a policy that keeps picking it cannot stall the engine."""
        if self._protected(req):
            return
        if req.num_output_tokens != req.num_output_tokens_at_preemption:
            req.num_output_tokens_at_preemption = req.num_output_tokens
            req.num_stalled_preemptions = 0
        req.num_stalled_preemptions += 1
        if req.num_stalled_preemptions == self.max_stalled_preemptions:
            logger.warning(
                "request %s was preempted %d times without producing a token (scheduling_policy=%r); "
                "it is no longer preempted until it finishes",
                req.request_id, req.num_stalled_preemptions, self.config.scheduling_policy,
            )

    def _protected(self, req: Request) -> bool:
        return req.num_stalled_preemptions >= self.max_stalled_preemptions

    def _victim_for_room(self) -> Request:
        """The policy's victim when a running request needs KV room, unless that victim is
        protected: then the newest unprotected running request, or the newest of all if
        every one is protected. The oldest running request is then never the victim while
        another runs, so it always finishes: progress."""
        victim = self.policy.select_victim(self.running)
        self._check_victim(victim)
        if not self._protected(victim):
            return victim
        unprotected = [r for r in self.running if not self._protected(r)]
        return (unprotected or self.running)[-1]

    def _victim_for_waiting(self, req: Request) -> Request | None:
        """The policy's victim in favour of the waiting head ``req``; a protected one is
        refused (the head waits)."""
        victim = self.policy.select_victim_for(req, self.running)
        if victim is None:
            return None
        self._check_victim(victim)
        return None if self._protected(victim) else victim

    def _check_victim(self, victim: Request) -> None:
        if victim not in self.running:
            raise PluginError(
                f"scheduling_policy={self.config.scheduling_policy!r} ({type(self.policy).__module__}."
                f"{type(self.policy).__qualname__}) chose a victim that is not running: {victim!r}"
            )

    # ---- after the forward pass ----------------------------------------------------------
    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> tuple[list[EngineCoreOutput], list[Request]]:
        """Turn the step's placeholders into the sampled tokens, check stop conditions, free
        finished requests (preempted ones too: their token came back after they gave way)."""
        outputs = [EngineCoreOutput(r.request_id, [], finish_reason="error", error=r.error) for r in self._failed]
        finished, self._failed = self._failed, []
        if runner_out.finished_loads:
            self.loads_landed(runner_out.finished_loads)
        index = {req_id: i for i, req_id in enumerate(runner_out.req_ids)}
        draft_ids = runner_out.draft_token_ids
        if sched_out.structured_output_request_ids:
            self._advance_grammars(sched_out, runner_out, index)
        for req, start in self._scheduled_requests(sched_out):
            req_id = req.request_id
            if req.is_finished:  # it ended (EOS, stop, abort) while this step was in flight
                self.num_discarded_tokens += sched_out.num_scheduled_tokens[req_id]
                continue
            i = index[req_id]
            prompt_lps = self._unreported_prompt_logprobs(req, start, runner_out.prompt_logprobs.get(req_id))
            # A step that did not reach the end of the request (a prefill chunk) sampled
            # nothing: with async scheduling its placeholder belongs to the step after it,
            # which the runner's empty list for this one tells apart.
            new_ids = runner_out.sampled_token_ids[i] if req.num_output_placeholders else []
            if new_ids:
                req.num_output_placeholders -= 1
                req.prompt_logprobs_done = True
            was_running = req.status == RequestStatus.RUNNING
            drafts = sched_out.scheduled_spec_decode_tokens.get(req_id, ())
            num_accepted = len(new_ids) - 1 if drafts else 0
            if drafts:
                # Rejected drafts' KV slots are simply overwritten by later steps.
                req.num_computed_tokens -= len(drafts) - num_accepted
                self.spec_decoding_stats.observe(len(drafts), num_accepted)
            if new_ids:
                new_ids = self._append_output_tokens(req, new_ids)
                if req.grammar is not None:
                    self._finish_by_grammar(req, new_ids)
            # A request with no drafts now nor before (backed off: most of a useless drafter's
            # steps) has nothing to store.
            if draft_ids and (draft_ids[i] or req.spec_token_ids) and not req.is_finished:
                req.spec_token_ids = self._room_for_drafts(req, draft_ids[i])
            if not new_ids and prompt_lps is None:
                continue
            logprobs = runner_out.logprobs[i] if new_ids and runner_out.logprobs else None
            outputs.append(_core_output(req, new_ids, logprobs, prompt_lps, len(drafts), num_accepted))
            if req.is_finished:
                if was_running:
                    self.running.remove(req)
                else:  # preempted while its step was in flight
                    self.waiting.remove(req)
                self._free(req)
                finished.append(req)
        return outputs, finished

    @staticmethod
    def _unreported_prompt_logprobs(req: Request, start: int, prompt_lps: LogprobsLists | None) -> LogprobsLists | None:
        """The rows of ``prompt_lps`` for prompt positions not reported yet. A chunk starting
        at ``start`` scores positions ``start+1 ..``; recomputed after a preemption, a request
        scores from position 1 again::

            | reported: 1 .. num_prompt_logprobs_reported | new |
                      | this chunk: start+1 .. start+n          |
        """
        if prompt_lps is None:
            return None
        num_seen = req.num_prompt_logprobs_reported - start
        req.num_prompt_logprobs_reported = max(req.num_prompt_logprobs_reported, start + len(prompt_lps.ranks))
        return None if num_seen >= len(prompt_lps.ranks) else prompt_lps.skip(num_seen)

    def _scheduled_requests(self, sched_out: SchedulerOutput) -> list[tuple[Request, int]]:
        """The requests ``schedule()`` gave ``sched_out``, with their computed tokens then
        (steps before it that were never updated are forgotten)."""
        while self._unupdated_steps:
            out, requests = self._unupdated_steps.popleft()
            if out is sched_out:
                return requests
        raise ValueError("update_from_output: this SchedulerOutput was not scheduled here, or was already updated")

    def _append_output_tokens(self, req: Request, new_ids: list[int]) -> list[int]:
        """Append the step's tokens, so that an EOS, a stop token or ``max_tokens`` inside an
        accepted run of drafts ends the request right there. Returns those kept. A run is
        checked token by token first and appended once (one block-hash update per step)."""
        num_outputs, num_tokens = req.num_output_tokens, req.num_tokens
        for n, token in enumerate(new_ids, start=1):
            stop = self._stop(req, token, num_outputs + n, num_tokens + n)
            if stop is not None:
                new_ids = new_ids[:n]
                req.append_output_token_ids(new_ids)
                req.status, reason = stop
                if reason is not None:
                    req.stop_reason = reason
                return new_ids
        req.append_output_token_ids(new_ids)
        return new_ids

    def _room_for_drafts(self, req: Request, drafts: list[int]) -> list[int]:
        """Drafts capped so that even if all are accepted, the step's output (drafts + one)
        stays within ``max_tokens`` and ``max_model_len``; a guided request's cut to what its
        grammar allows after the tokens just sampled (a rejected draft, and every draft after
        it, could never be emitted: they are not verified)."""
        if not drafts:
            return []
        room = self.max_model_len - req.num_tokens - 1
        if req.max_tokens is not None:
            room = min(room, req.max_tokens - req.num_output_tokens - 1)
        drafts = list(drafts[: max(room, 0)])
        if drafts and req.grammar is not None:
            drafts = self.structured_output.validate_drafts(req, drafts)
        return drafts

    def _advance_grammars(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput, index: dict) -> None:
        """Hand the guided requests' samples to their grammars and start the grammar work on them
        (accept, then fill the next step's bitmask) before the rest of the step's accounting:
        under async scheduling the next step's sampling waits for that bitmask. A request
        that ended (EOS, an error, finished while the step was in flight) is left out; one
        that ends in the accounting below (max_tokens) only wasted its grammar a token."""
        for req_id in sched_out.structured_output_request_ids:
            req = self.requests.get(req_id)
            if req is None or req.is_finished or req.error is not None or not req.num_output_placeholders:
                continue
            new_ids = runner_out.sampled_token_ids[index[req_id]]
            if new_ids and new_ids[-1] not in req.eos_token_ids:
                self.structured_output.accept_tokens(req, new_ids)
        self.structured_output.prepare_bitmask()

    def _finish_by_grammar(self, req: Request, new_ids: list[int]) -> None:
        """The grammar's verdict on the sampled tokens (``_advance_grammars`` handed them over).
        A grammar allows EOS only where it is complete: sampling EOS ends the request."""
        if req.error is not None:  # its grammar rejected the previous tokens
            req.status = RequestStatus.FINISHED_ERROR
        elif new_ids[-1] in req.eos_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED

    def _stop(self, req: Request, token: int, num_outputs: int, num_tokens: int):
        """Whether ``req`` ends once ``token`` is its ``num_outputs``-th output (``num_tokens``
        in all): ``(status, stop_reason)``, or None."""
        params = req.sampling_params
        if num_outputs >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if token in params.all_stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if (req.max_tokens is not None and num_outputs >= req.max_tokens) or num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None


@dataclass(slots=True)
class _StepState:
    """What one ``schedule()`` call has handed out so far."""

    budget: int
    partial_ids: set[str] = field(default_factory=set)  # unfinished prefills booked
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)

    def book(self, req: Request, num_new: int, partial: bool, out: SchedulerOutput) -> None:
        out.num_scheduled_tokens[req.request_id] = num_new
        self.budget -= num_new
        if partial:
            self.partial_ids.add(req.request_id)

    def unbook(self, req: Request, out: SchedulerOutput) -> None:
        """Undo ``book`` for a request preempted later in the same step."""
        self.budget += out.num_scheduled_tokens.pop(req.request_id, 0)
        out.scheduled_spec_decode_tokens.pop(req.request_id, None)
        self.new_block_ids.pop(req.request_id, None)
        self.partial_ids.discard(req.request_id)
        out.scheduled_new_reqs = [r for r in out.scheduled_new_reqs if r.req_id != req.request_id]


def _core_output(
    req: Request, new_ids: list[int], logprobs, prompt_lps, num_drafts: int, num_accepted: int
) -> EngineCoreOutput:
    """What one step gave ``req``, for the API side."""
    return EngineCoreOutput(
        request_id=req.request_id,
        new_token_ids=new_ids,
        new_logprobs=logprobs if logprobs is None else logprobs.head(len(new_ids)),
        new_prompt_logprobs=prompt_lps,
        finish_reason=req.status.finish_reason,
        stop_reason=req.stop_reason,
        num_cached_tokens=max(req.num_cached_tokens, 0),
        error=req.error,
        num_draft_tokens=num_drafts,
        num_accepted_tokens=num_accepted,
    )
