"""The model runner: turns a ``SchedulerOutput`` into one flattened forward pass and samples.

It keeps per-request token ids and block ids between steps (the scheduler sends only what
changed) and each request's row of a persistent CPU block table; every step it writes
``input_ids``, ``positions``, ``slot_mapping``, ``query_start_loc``, ``seq_lens`` and the
block table into persistent buffers (``InputBuffers``: pinned staging, non-blocking copies),
runs the model (or replays a CUDA graph for a decode batch), samples the last token of every
request and returns plain lists.

A step is ``launch`` (queue all of that, and the copy of the sampled ids to host memory) then
``finish`` (wait for that copy: the one host sync per step); with async scheduling the
engine launches the next step before finishing this one (see
``pagelm.worker.pending_step``).

Start-up, in the order ``EngineCore`` calls it: ``profile_run`` (peak memory of a worst-case
step, to size the KV pool), ``initialize_kv_cache``, ``capture_cuda_graphs``.
"""

from __future__ import annotations

import gc
import itertools
import logging

import numpy as np
import torch
from torch import nn

from pagelm.attention import (
    AttentionBackend,
    CommonAttentionMetadata,
    ForwardContext,
    attention_layers,
    forward_context,
)
from pagelm.config import EngineConfig
from pagelm.distributed import parallel_state
from pagelm.kv_cache import cdiv
from pagelm.kv_offload import KVCopier, KVOffload
from pagelm.kernels import fused_kernel
from pagelm.multimodal import MultiModalProcessor, SupportsMultiModal
from pagelm.sample import Sampler, SamplerOutput, SamplingMetadata
from pagelm.sample.bitmask import apply_token_bitmask, upload_bitmask
from pagelm.sample.request_logits import build_logits_row
from pagelm.sample.sampler import LogprobsTensors
from pagelm.sampling_params import SamplingParams, num_logprobs
from pagelm.sched.output import SchedulerOutput
from pagelm.worker import cpu_threads
from pagelm.worker.cuda_graphs import CudaGraphRunner, capture_sizes
from pagelm.worker.input_buffers import InputBuffers
from pagelm.worker.pipeline_stage import PipelineStage
from pagelm.worker.output import LogprobsLists, ModelRunnerOutput
from pagelm.worker.pending_step import PLACEHOLDER_TOKEN, PendingStep, logprobs_lists
from pagelm.worker.step_state import CachedRequestState, StepInputs, host_sync_point
from pagelm.worker.sampling_inputs import ArgmaxMetadata, argmax_only, build_sampling_metadata, to_device
from pagelm.worker.spec_decode import SpecDecodeRunner

logger = logging.getLogger("pagelm")


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model: nn.Module,
        backend: type[AttentionBackend],
        device: torch.device,
        dtype: torch.dtype,
        eos_token_ids: frozenset[int],
        vocab_size: int,
        max_model_len: int,
        mm_processor: MultiModalProcessor | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.backend = backend
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_reqs = config.max_num_seqs
        self.requests: dict[str, CachedRequestState] = {}
        # ``requests``' keys and values as lists, made again only once a request joins or
        # leaves (``_request_views``): a step over all of them in that order reuses the list,
        # so that a proposer recognises the same requests by the list's identity.
        self._views: tuple[list[str], list[CachedRequestState]] | None = None
        max_blocks_per_req = cdiv(max_model_len, self.block_size)
        self.block_table_cpu = np.zeros((self.max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self._free_rows = list(range(self.max_num_reqs - 1, -1, -1))
        self._arange = np.arange(self.max_num_reqs + 1, dtype=np.int32)
        # Models with positions of their own (M-RoPE): rows of positions a prompt step feeds.
        self.position_rows = model.position_rows if isinstance(model, SupportsMultiModal) else 1
        self.buffers = InputBuffers(
            config.max_num_batched_tokens, self.max_num_reqs, max_blocks_per_req, device, self.position_rows
        )
        self.metadata_builder = backend.make_metadata_builder(device)
        self.metadata_builder.configure(config)
        self.kv_caches: list[torch.Tensor] = []
        # The second KV tier's copies (pagelm.kv_offload; None: no tier, nothing per step).
        self.kv_copier: KVCopier | None = None
        self.cuda_graphs: CudaGraphRunner | None = None
        self.sampler = Sampler()
        self.argmax_metadata = ArgmaxMetadata(device)
        self.generator = torch.Generator(device=device).manual_seed(config.seed)
        # Pipeline parallelism: this rank's stage (None: the whole model is here).
        self.pipeline = PipelineStage(model, dtype, device) if parallel_state().pp_size > 1 else None
        # Speculative decoding (enable_speculative_decoding): verification and proposals.
        self.spec: SpecDecodeRunner | None = None
        # The last step launched, until it is finished: the next step reads its samples.
        self._in_flight: PendingStep | None = None
        # Recorded once a step's host-to-device input copies are queued: the next step waits
        # for it before it rewrites the pinned staging those copies read.
        self._inputs_uploaded = torch.cuda.Event() if device.type == "cuda" else None
        # The stream every step runs on, held so that events are recorded on it directly:
        # ``Event.record()`` looks the current stream up in Python (device index, availability
        # checks, a new Stream object), tens of microseconds a step on a host-bound model.
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        # Vision-language models: each image's embeddings by identifier, from the step that
        # encodes it until the scheduler evicts it (``SchedulerOutput.free_encoder_identifiers``);
        # how many images the encoder has run on; running requests that have images.
        self.encoder_cache: dict[str, torch.Tensor] = {}
        # A vision-language model's processor, here only for the profiling pass's dummy images.
        self.mm_processor = mm_processor
        self.num_encoded_images = 0
        self._num_mm_requests = 0
        # Requests with positions of their own (pagelm.multimodal.RequestPositions), and per
        # block-table row the shift of their tokens past the prompt and their prompt length
        # (both 0 for every other row), so a step finds them without a loop over requests.
        self._num_positioned = 0
        self._position_delta = np.zeros(self.max_num_reqs, dtype=np.int64)
        self._positioned_len = np.zeros(self.max_num_reqs, dtype=np.int64)

    def enable_speculative_decoding(self, proposer, drafts_from_last_stage: bool = False) -> None:
        """Verify drafts and ask ``proposer`` for new ones every step. Before the KV cache is
        allocated: a draft model's attention layers get caches too. ``drafts_from_last_stage``
        (pipeline parallelism): the proposer lives on the last stage (``proposer`` None on
        the others), which sends its drafts to rank 0."""
        self.spec = SpecDecodeRunner(
            proposer, self.config.speculative.num_speculative_tokens, self.max_model_len, drafts_from_last_stage
        )

    def _kv_layers(self) -> list:
        """Every paged attention layer: the model's, then the proposer's (a draft model)."""
        extra = self.spec.proposer.attention_layers() if self.spec is not None and self.spec.proposer is not None else []
        return attention_layers(self.model) + list(extra)

    # ---- start-up ------------------------------------------------------------------------
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate every layer's paged cache and bind the backend's implementation to it."""
        self.kv_caches = []
        for idx, layer in enumerate(self._kv_layers()):
            spec = layer.spec
            shape = self.backend.get_kv_cache_shape(num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
            cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.layer_idx, layer.impl, layer.kv_cache = idx, self.backend.make_impl(spec), cache
            self.kv_caches.append(cache)
        self.metadata_builder.bind_layers([layer.spec for layer in self._kv_layers()], self.dtype)

    def initialize_kv_offload(self, offload_cls: type[KVOffload], num_blocks: int) -> None:
        """The second KV tier's memory on this rank, shaped like the GPU cache, and its copier."""
        spec = self._kv_layers()[0].spec
        shapes = [self.backend.get_kv_cache_shape(n, self.block_size, spec.num_kv_heads, spec.head_dim) for n in (1, 2)]
        block_dim = next(d for d, (a, b) in enumerate(zip(*shapes)) if a != b)
        self.kv_copier = offload_cls.make_copier(self.config, num_blocks, self.kv_caches, block_dim)

    def _release_kv_cache(self) -> None:
        for layer in self._kv_layers():
            layer.kv_cache = None
        self.kv_caches = []

    @torch.inference_mode()
    def profile_run(self) -> int:
        """Run a worst-case step on dummy data (``max_num_batched_tokens`` prompt tokens over
        up to ``max_num_seqs`` requests, then the sampler with top-k/top-p, which sorts the
        vocab, over all of their logits) and return the peak bytes torch allocated, minus the
        small KV cache the step needed: weights + activations, what the KV pool must leave.
        A vision-language model first runs its encoder on the largest image batch a step may
        encode (``profile_encoder``); the encoder cache is counted apart
        (``encoder_cache_bytes``)."""
        assert self.device.type == "cuda", "profiling sizes the GPU KV pool"
        num_tokens = min(self.config.max_num_batched_tokens, self.max_num_reqs * self.max_model_len)
        num_reqs = min(self.max_num_reqs, num_tokens)
        counts = [num_tokens // num_reqs + (i < num_tokens % num_reqs) for i in range(num_reqs)]
        num_blocks = sum(cdiv(c, self.block_size) for c in counts)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.initialize_kv_cache(num_blocks)
        kv_bytes = sum(c.numel() * c.element_size() for c in self.kv_caches)
        states, next_block = [], 0
        for i, count in enumerate(counts):
            blocks = list(range(next_block, next_block + cdiv(count, self.block_size)))
            next_block += len(blocks)
            states.append(self._add_state(CachedRequestState(
                req_id=f"profile-{i}", token_ids=[0] * count, num_prompt_tokens=count,
                sampling_params=SamplingParams(), block_ids=blocks, need_prompt_logprobs=False,
            )))
        try:
            self.profile_encoder()
            step = self.prepare_inputs(states, [0] * num_reqs, counts, allow_graph=False)
            logits = self.compute_logits(step)
            md = SamplingMetadata(
                temperature=torch.ones(num_reqs, device=self.device), all_greedy=False, all_random=True,
                top_k=torch.full((num_reqs,), 50, device=self.device),
                top_p=torch.full((num_reqs,), 0.9, device=self.device),
            )
            if logits is not None:  # None: an earlier pipeline stage
                self.sampler(logits, md, self.generator)
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        finally:
            for state in states:
                self._remove_state(state.req_id)
            self._release_kv_cache()
            torch.cuda.empty_cache()
        return peak - kv_bytes

    def encoder_profile_embeddings(self) -> int:
        """The most embeddings one step may encode: its encoder budget, and no more than the
        encoder cache holds (every image a step encodes has room there at once). 0 for a
        model that takes no images."""
        if not isinstance(self.model, SupportsMultiModal):
            return 0
        return min(self.config.encoder_budget, self.config.encoder_cache_embeddings)

    @torch.inference_mode()
    def profile_encoder(self) -> int:
        """Run the vision encoder once on dummy images that make ``encoder_profile_embeddings``
        embeddings (the processor's ``dummy_inputs``: the largest images it makes) and drop
        the result; the embeddings it made (0: nothing to profile)."""
        num_embeddings = self.encoder_profile_embeddings()
        if not num_embeddings:
            return 0
        features = self.mm_processor.dummy_features(num_embeddings) if self.mm_processor is not None else []
        if not features:
            logger.warning("KV sizing: %s gives no dummy images; the vision encoder's activations are not "
                           "counted (lower gpu_memory_utilization if images run out of memory)",
                           type(self.model).__name__)
            return 0
        embeds = self.model.get_multimodal_embeddings(features)
        made = sum(e.shape[0] for e in embeds)
        del embeds
        return made

    def encoder_cache_bytes(self) -> int:
        """What the encoder cache may hold on the device once full: ``encoder_cache_size``
        embeddings of the language model's width in the model's dtype (0: no images)."""
        if not isinstance(self.model, SupportsMultiModal):
            return 0
        hidden = self.model.get_input_embeddings().weight.shape[-1]
        return self.config.encoder_cache_embeddings * hidden * self.dtype.itemsize

    def release_cuda_graphs(self) -> None:
        """Drop the captured graphs and let the device finish. Called by every rank before it
        leaves the process group: on two H100s a TP=2 engine's ``destroy_process_group``
        never returned while graphs holding NCCL's all-reduce were alive (with
        ``enforce_eager`` it took 1.5 s)."""
        self.cuda_graphs = None
        if self.spec is not None:
            self.spec.release_cuda_graphs()
        if self.pipeline is not None:
            self.pipeline.close()
        if self.device.type == "cuda":
            gc.collect()  # a graph's memory goes with its last reference
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def capture_cuda_graphs(self) -> None:
        sizes = capture_sizes(self.max_num_reqs, self.config.max_num_batched_tokens)
        self.cuda_graphs = CudaGraphRunner(
            self.model, self.buffers, self.metadata_builder, sizes, self.max_model_len, self.block_size,
            variants=self.metadata_builder.cudagraph_variants(self.config), position_offsets=self.position_rows > 1,
            stage=self.pipeline,
        )
        pool = self.cuda_graphs.capture()
        # Graphs of steps verifying drafts and the proposer's own, in the same memory pool
        # (under pipeline parallelism both run eagerly: verification graphs hold no stage
        # boundary).
        if self.spec is not None and self.pipeline is None:
            self.spec.capture_cuda_graphs(self, pool)

    # ---- request state -------------------------------------------------------------------
    def _add_state(self, state: CachedRequestState) -> CachedRequestState:
        assert self._free_rows, "more running requests than max_num_seqs"
        state.row = self._free_rows.pop()
        state.logits_row = build_logits_row(state.sampling_params, self.vocab_size, self.device)
        state.argmax_only = argmax_only(state.sampling_params, state.logits_row)
        self.block_table_cpu[state.row, : len(state.block_ids)] = state.block_ids
        self.requests[state.req_id] = state
        self._views = None
        self._num_mm_requests += bool(state.mm_features)
        if state.mm_features and self.position_rows > 1:
            state.positions = self.model.get_input_positions(state.num_prompt_tokens, state.mm_features)
        if state.positions is not None:
            self._num_positioned += 1
            self._position_delta[state.row] = state.positions.delta
            self._positioned_len[state.row] = state.positions.num_tokens
        return state

    def _remove_state(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self._views = None
            self._free_rows.append(state.row)
            self._num_mm_requests -= bool(state.mm_features)
            if state.positions is not None:
                self._num_positioned -= 1
                self._position_delta[state.row] = self._positioned_len[state.row] = 0

    def _request_views(self) -> tuple[list[str], list[CachedRequestState]]:
        """The running requests' ids and states, in ``requests``' order: the same two lists
        (never changed in place) until a request joins or leaves."""
        if self._views is None:
            self._views = (list(self.requests), list(self.requests.values()))
        return self._views

    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self._remove_state(req_id)
        for new in sched.scheduled_new_reqs:
            self._add_state(CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                need_prompt_logprobs=new.need_prompt_logprobs,
                output_token_ids=list(new.output_token_ids),
                mm_features=new.mm_features,
            ))
        for cached in sched.scheduled_cached_reqs:
            if cached.new_block_ids:
                state = self.requests[cached.req_id]
                n = len(state.block_ids)
                self.block_table_cpu[state.row, n : n + len(cached.new_block_ids)] = cached.new_block_ids
                state.block_ids.extend(cached.new_block_ids)

    # ---- one step ------------------------------------------------------------------------
    def drop_in_flight(self) -> None:
        """Forget the step in flight (a step failed: its requests are being failed)."""
        self._in_flight = None
        if self.pipeline is not None:
            self.pipeline.reset()

    @torch.inference_mode()
    def launch(
        self, sched: SchedulerOutput, defer_sampling: bool = False, sample_first: PendingStep | None = None
    ) -> PendingStep:
        """Queue one step on the device: its inputs, the forward pass, sampling, and the copy of
        the sampled ids to host memory; return without waiting for it. Each request that
        samples gets a placeholder at the end of its token list until ``finish``.
        ``defer_sampling``: stop after the forward pass; ``sample`` queues the rest (guided
        requests under async scheduling, whose bitmask waits for the previous step).
        ``sample_first`` (pipeline parallelism: the oldest step in flight, finished right after
        this launch): the last stage samples and shares it between receiving this step's input
        and running this step's part of the forward pass."""
        in_flight = self._in_flight
        if in_flight is not None and self.spec is not None and self.spec.keeps_steps_in_flight and not in_flight.skip_proposal:
            self.spec.keep_in_flight(self, in_flight)  # before this step takes its rows and buffers
        self._update_states(sched)
        if self.kv_copier is not None:  # copies between the tiers first (also in an empty step)
            self.kv_copier.before_step(sched)
        req_ids = list(sched.num_scheduled_tokens)
        if not req_ids:
            return PendingStep.done(sched, ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        num_computed = {r.req_id: r.num_computed_tokens for r in sched.scheduled_new_reqs}
        num_computed.update({r.req_id: r.num_computed_tokens for r in sched.scheduled_cached_reqs})
        views = self._request_views()
        states = views[1] if req_ids == views[0] else [self.requests[r] for r in req_ids]
        starts = [num_computed[r] for r in req_ids]
        counts = [sched.num_scheduled_tokens[r] for r in req_ids]

        spec_tokens = sched.scheduled_spec_decode_tokens
        if spec_tokens:  # some requests verify drafts: see pagelm.worker.spec_decode
            drafts = [spec_tokens.get(r, ()) for r in req_ids]
            return PendingStep.done(sched, self.spec.execute(self, sched, req_ids, states, starts, counts, drafts))
        previous, self._in_flight = self._in_flight, None
        if self._inputs_uploaded is not None:
            with host_sync_point():  # the previous step's uploads have read the pinned staging
                self._inputs_uploaded.synchronize()
        mm_embeds = self._multimodal_inputs(sched, states, starts, counts) if self._num_mm_requests else None
        step = self.prepare_inputs(states, starts, counts, allow_graph=mm_embeds is None)
        step.mm_embeds = mm_embeds
        # Before this step's placeholders: seeds and min_tokens count the outputs before it.
        if all(s.argmax_only for s in states):
            md = self.argmax_metadata.get(len(states))
        else:
            md = build_sampling_metadata(states, self.eos_token_ids, self.vocab_size, self.device)
        if previous is not None:
            feeds = self._feed_index(previous, states, starts, counts)
            if previous.awaits_sampling:
                # Its grammars have had until now (this step's host work is done): queue its
                # sampling, whose ids feed this step's forward pass.
                self.sample(previous)
            if feeds is not None:
                self._feed_samples(previous, step, feeds)
        if self._inputs_uploaded is not None:
            self._inputs_uploaded.record(self.stream)
        if (
            sample_first is not None and sample_first.output is None and sample_first.sampled_host is None
            and self.pipeline is not None and self.pipeline.is_last
        ):
            self.pipeline.before_forward = lambda: self.sample(sample_first)
        logits, hidden = self.compute_logits(step, return_hidden=True)
        pending = PendingStep(sched, req_ids, states, self._add_placeholders(states, starts, counts))
        if self.spec is not None and self.spec.keeps_launched_steps:  # proposed from after later launches
            step = self.spec.keep_inputs(self, step, states)
        pending.inputs, pending.hidden, pending.starts, pending.counts = step, hidden, starts, counts
        pending.logits, pending.sampling_metadata = logits, md
        if logits is not None and logits.is_cuda and self.pipeline is None:  # the race's noise needs no logit: queued now, with the forward pass
            pending.noise = self.sampler.draw_noise(logits, md, self.generator)
        # Pipeline stages keep several steps in flight, over requests of their own: none feeds
        # another, each is sampled when the engine finishes it.
        self._in_flight = pending if self.pipeline is None else None
        if not defer_sampling:
            self.sample(pending)
        return pending

    @torch.inference_mode()
    def sample(self, pending: PendingStep) -> None:
        """Queue a launched step's sampling (its grammar bitmask first) and the copy of the
        sampled ids to the host."""
        sched, step, md = pending.sched, pending.inputs, pending.sampling_metadata
        logits, pending.logits = pending.logits, None
        noise, pending.noise = pending.noise, None
        if self.pipeline is not None:
            self._sample_pipelined(pending, logits, md)
            return
        constrained = sched.structured_output_request_ids
        fusable = noise is not None and Sampler.race_fusable(md) and constrained in ([], pending.req_ids)
        race = fused_kernel("exponential_race") if fusable else None
        if race is not None:
            # One kernel: temperature, the grammar's bitmask when every request has one, the
            # race over the noise drawn at launch.
            bitmask = sched.grammar_bitmask(constrained) if constrained else None
            if bitmask is not None:
                bitmask = upload_bitmask(bitmask, self.device)  # overlaps the forward pass
            sampled = SamplerOutput(race(logits, noise, md.temperature, bitmask), None)
        else:
            if constrained:
                self.apply_grammar(logits, sched, pending.req_ids)
            sampled = self.sampler(logits, md, self.generator, noise)
        prompt_logprobs = self.prompt_logprobs_tensors(
            pending.states, pending.starts, pending.counts, pending.hidden, _packed_starts(pending.counts)
        )
        pending.copy_to_host(sampled.sampled_token_ids, sampled.logprobs, prompt_logprobs, self.stream)
        if self.spec is None:  # only the proposer reads them
            pending.inputs = pending.hidden = None

    def _sample_pipelined(self, pending: PendingStep, logits: torch.Tensor | None, md) -> None:
        """The last stage samples (``logits`` None elsewhere; guided requests masked with the
        bitmask the step brought) and shares the ids with every rank, and its logprobs with
        rank 0."""
        sampled, prompt_logprobs = None, {}
        rows = self.prompt_logprobs_rows(pending.states, pending.starts, pending.counts)
        if logits is not None:
            if pending.sched.structured_output_request_ids:  # the bitmask came with the step
                self.apply_grammar(logits, pending.sched, pending.req_ids)
            sampled = self.sampler(logits, md, self.generator)
            prompt_logprobs = self.prompt_logprobs_tensors(
                pending.states, pending.starts, pending.counts, pending.hidden, _packed_starts(pending.counts)
            )
        num_reqs = len(pending.req_ids)
        ids = self.pipeline.share_samples(None if sampled is None else sampled.sampled_token_ids, num_reqs)
        logprobs, prompt_logprobs = self.pipeline.share_logprobs(
            None if sampled is None else sampled.logprobs, num_reqs, md.max_num_logprobs, prompt_logprobs, rows
        )
        pending.copy_to_host(ids, logprobs, prompt_logprobs, self.stream)
        if self.spec is None or not self.spec.keeps_launched_steps:  # else the proposer reads them
            pending.inputs = pending.hidden = None

    @torch.inference_mode()
    def finish(self, pending: PendingStep) -> ModelRunnerOutput:
        """Wait for a launched step's samples (the one host sync per step) and return them as
        plain lists; they replace the step's placeholders in the token lists. With a second
        KV tier, also the loads from it that have landed since the last step (a step with
        nothing to compute waits for the oldest one instead of letting the engine spin)."""
        out = pending.output if pending.output is not None else self._collect(pending)
        if self.kv_copier is not None:
            done = self.kv_copier.finished_loads(wait=pending.sched.is_empty)
            if done is None:  # a copier whose steps wait for their own loads
                transfers = pending.sched.kv_transfers
                done = [req_id for req_id, _ in transfers.loads] if transfers is not None else []
            out.finished_loads = done
        return out

    def poll_loads(self) -> list[str]:
        """Loads from the KV tier that have landed since the last report, without waiting
        (the engine asks before it schedules, so a load that lands mid-step is not a step
        late; a copier of plugin API 2.17 reports nothing here)."""
        if self.kv_copier is None:
            return []
        return self.kv_copier.finished_loads(wait=False) or []

    def _collect(self, pending: PendingStep) -> ModelRunnerOutput:
        if self._in_flight is pending:
            self._in_flight = None  # the next step finds all of its inputs on the host
        with host_sync_point():
            pending.wait()
        sampled_ids = pending.sampled_host.tolist()
        logprobs = _split_logprobs(pending.logprobs_host, pending.states, self.vocab_size)
        prompt_logprobs = {r: logprobs_lists(t) for r, t in pending.prompt_logprobs_host.items()}

        out_ids: list[list[int]] = []
        for state, position, token in zip(pending.states, pending.sample_positions, sampled_ids):
            if position < 0:  # a prefill chunk that stops short: nothing to sample yet
                out_ids.append([])
                continue
            state.token_ids[position] = token
            state.output_token_ids[position - state.num_prompt_tokens] = token
            out_ids.append([token])
        out = ModelRunnerOutput(pending.req_ids, out_ids, logprobs, prompt_logprobs)
        if pending.skip_proposal:  # no drafts, and nothing for the proposer to follow
            # draft_token_ids stays empty: no request has drafts stored (``skip_ahead`` saw
            # none proposed), so the scheduler has none to replace.
            self.spec.proposer.step_skipped(pending.states)
        elif self.spec is not None:  # ahead: a later step is launched already (async scheduling)
            ahead = self._in_flight is not None
            out.draft_token_ids = self.spec.propose(
                self, pending.inputs, pending.hidden, pending.states, pending.starts, pending.counts, None, out_ids,
                ahead=ahead,
            )
        return out

    def may_draft_next(self) -> bool:
        """Whether the proposal after the step in flight may give any request drafts: then
        it must be finished before the next step is scheduled (speculative decoding)."""
        if self.spec is None:
            return False
        proposer = self.spec.proposer
        if proposer is None or proposer.may_draft(self._request_views()[1]):
            return True
        pending = self._in_flight
        if pending is not None and pending.sample_positions and min(pending.sample_positions) >= 0:
            pending.skip_proposal = proposer.skip_ahead(pending.states)
        return False

    @staticmethod
    def _add_placeholders(states, starts, counts) -> list[int]:
        """A placeholder for the token each request samples this step (one whose step reaches
        the end of its tokens); returns where each went (-1: this step samples nothing)."""
        positions = []
        for state, start, count in zip(states, starts, counts):
            if start + count >= len(state.token_ids):
                positions.append(len(state.token_ids))
                state.token_ids.append(PLACEHOLDER_TOKEN)
                state.output_token_ids.append(PLACEHOLDER_TOKEN)
            else:
                positions.append(-1)
        return positions

    def _multimodal_inputs(self, sched: SchedulerOutput, states, starts, counts):
        """Drop the embeddings the scheduler evicted, encode the images it scheduled, and
        gather the embeddings of this step's placeholder positions in token order, with the
        mask of those positions (None: the step covers no image position)."""
        for identifier in sched.free_encoder_identifiers:
            self.encoder_cache.pop(identifier, None)
        if sched.scheduled_encoder_inputs:
            features = [
                self.requests[req_id].mm_features[i]
                for req_id, indices in sched.scheduled_encoder_inputs.items() for i in indices
            ]
            for feature, embeds in zip(features, self.model.get_multimodal_embeddings(features)):
                assert embeds.shape[0] == feature.length, f"{feature.identifier}: {embeds.shape[0]} != {feature.length}"
                self.encoder_cache[feature.identifier] = embeds
            self.num_encoded_images += len(features)
        pieces, is_mm, flat = [], None, 0
        for state, start, count in zip(states, starts, counts):
            for feature in state.mm_features:
                if feature.overlaps(start, start + count):
                    lo, hi = max(start, feature.offset), min(start + count, feature.end)
                    pieces.append(self.encoder_cache[feature.identifier][lo - feature.offset : hi - feature.offset])
                    if is_mm is None:
                        is_mm = np.zeros(sum(counts), dtype=bool)
                    is_mm[flat + lo - start : flat + hi - start] = True
            flat += count
        if not pieces:
            return None
        return torch.cat(pieces), torch.from_numpy(is_mm).to(self.device, non_blocking=True)

    def _feed_index(self, previous: PendingStep, states, starts, counts) -> torch.Tensor | None:
        """Which of this step's input ids are samples of ``previous`` (a step not finished
        yet; async scheduling): ``[2, n]`` (flat input index, row of ``previous.sampled``) on
        the device, or None. Host work only, so it goes before a deferred sampling."""
        dst, src = previous.feeds(states, starts, counts)
        return to_device([dst, src], torch.long, self.device) if dst else None

    def _feed_samples(self, previous: PendingStep, step: StepInputs, index: torch.Tensor) -> None:
        """Copy ``previous``'s samples device to device into this step's input ids, over the
        placeholders the host wrote (``index`` from ``_feed_index``)."""
        token_ids = previous.sampled.index_select(0, index[1])
        if step.input_ids is None:  # a CUDA graph replay reads its staged copy
            self.cuda_graphs.feed_input_ids(index[0], token_ids)
        else:
            step.input_ids.index_copy_(0, index[0], token_ids)

    def compute_logits(self, step: StepInputs, return_hidden: bool = False, logits_indices: torch.Tensor | None = None):
        """Queue the forward pass and the LM head over each request's last token (or over
        the hidden rows ``logits_indices``: drafts and the positions verifying them)."""
        n = step.num_reqs
        if step.graph_size is not None:
            if self.pipeline is None:
                hidden, logits = self.cuda_graphs.replay(step.graph_size)
            else:  # this stage's graph, between the receive and the send
                out = self.pipeline.replay(self.cuda_graphs, step.graph_size, n)
                if out is None:  # an earlier stage: the next one has its output
                    return (None, None) if return_hidden else None
                hidden, logits = out
            return (logits[:n], hidden[:n]) if return_hidden else logits[:n]
        else:
            attn_metadata = self.metadata_builder.build(step.common)
            with forward_context(ForwardContext(attn_metadata=attn_metadata)), cpu_threads.forward_threads(len(step.input_ids)):
                if self.pipeline is not None:
                    hidden = self.pipeline.forward(self.model, step.input_ids, step.positions)
                    if hidden is None:  # an earlier stage: the next one has its output
                        return (None, None) if return_hidden else None
                elif step.mm_embeds is None:
                    hidden = self.model(step.input_ids, step.positions)
                else:
                    embeds = self.model.merge_multimodal_embeddings(step.input_ids, *step.mm_embeds)
                    hidden = self.model(step.input_ids, step.positions, inputs_embeds=embeds)
        if logits_indices is not None:
            last_hidden = hidden[logits_indices]
        elif step.uniform_decode:
            last_hidden = hidden[:n]
        else:
            last_hidden = hidden[step.common.query_start_loc[1:].long() - 1]
        logits = self.model.compute_logits(last_hidden)
        return (logits, hidden) if return_hidden else logits

    def apply_grammar(
        self, logits: torch.Tensor, sched: SchedulerOutput, req_ids: list[str], rows_of: list[int] | None = None
    ) -> None:
        """Mask the logits of ``sched``'s guided requests with their grammar bitmask.
        ``rows_of[i]``: the (first) logits row of ``req_ids[i]`` (default ``i``; differs when
        drafts add rows); a request verifying drafts has one row each after its first,
        masked with what its grammar allows after them."""
        constrained, drafts = sched.structured_output_request_ids, sched.scheduled_spec_decode_tokens
        guided_drafts = [drafts.get(r, ()) for r in constrained] if drafts else None
        bitmask = sched.grammar_bitmask(constrained, guided_drafts)
        if bitmask is None:
            return
        rows = None  # every request constrained: bitmask row i is logits row i
        if constrained != req_ids or rows_of is not None:
            index = {r: (i if rows_of is None else rows_of[i]) for i, r in enumerate(req_ids)}
            if guided_drafts is None:
                logits_rows = [index[r] for r in constrained]
            else:
                logits_rows = [index[r] + j for r, d in zip(constrained, guided_drafts) for j in range(1 + len(d))]
            rows = torch.tensor(logits_rows, dtype=torch.long).to(self.device, non_blocking=True)
        apply_token_bitmask(logits, bitmask, rows=rows)

    def prepare_inputs(self, states, starts, counts, allow_graph: bool = True, drafts=None) -> StepInputs:
        """Write the flattened batch into the persistent buffers (see ``InputBuffers``).
        ``drafts[i]``: draft tokens that follow request ``i``'s known tokens (speculative)."""
        num_reqs = len(states)
        num_tokens = sum(counts)
        assert num_tokens <= self.buffers.max_num_tokens, "step larger than max_num_batched_tokens"
        uniform_decode = num_tokens == num_reqs
        counts_np = np.asarray(counts, dtype=np.int64)
        starts_np = np.asarray(starts, dtype=np.int64)

        graphable = allow_graph and uniform_decode and self.cuda_graphs is not None
        if graphable and not self._in_own_prompt(states, starts_np):
            graph_size = self.cuda_graphs.padded_size(num_reqs)
            step = self._prepare_graph_inputs(states, starts_np, graph_size) if graph_size is not None else None
            if step is not None:  # None: the backend wants this batch eager
                return step

        rows, positions = self._write_tokens(states, starts, counts, starts_np, counts_np, uniform_decode, drafts)
        position_rows = self._write_positions(states, starts, counts, starts_np, counts_np, rows, positions)
        return self._upload_inputs(rows, starts_np, counts_np, uniform_decode, position_rows)

    def _in_own_prompt(self, states, starts_np: np.ndarray) -> bool:
        """Whether a request of the step with positions of its own (M-RoPE) computes a
        prompt token (a one-token chunk): its positions are columns of its table, which a
        decode graph (``seq_len - 1 + delta``) does not have, so the step runs eagerly."""
        if not self._num_positioned:
            return False
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        return bool((starts_np < self._positioned_len[rows]).any())

    def _write_tokens(
        self, states, starts, counts, starts_np, counts_np, uniform_decode: bool, drafts
    ) -> tuple[np.ndarray, np.ndarray]:
        """The host side of ``prepare_inputs``: query starts, sequence lengths, token ids
        and slots of the flattened batch, in the buffers' host arrays. Returns the requests'
        block-table rows and each token's index in its request (its slot's position)."""
        b, bs = self.buffers, self.block_size
        num_reqs, num_tokens = len(states), int(counts_np.sum())
        qsl = b.query_start_loc.np
        if uniform_decode:
            qsl[: num_reqs + 1] = self._arange[: num_reqs + 1]
        else:
            qsl[0] = 0
            qsl[1 : num_reqs + 1] = np.cumsum(counts_np)
        b.seq_lens.np[:num_reqs] = starts_np + counts_np
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=num_reqs)
        if uniform_decode:
            positions = starts_np
            block_rows = rows
            b.input_ids.np[:num_reqs] = [s.token_ids[c] for s, c in zip(states, starts)]
        else:
            req_index = np.repeat(np.arange(num_reqs), counts_np)
            positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(
                qsl[:num_reqs].astype(np.int64) - starts_np, counts_np
            )
            block_rows = rows[req_index]
            pieces = (s.token_ids[c : c + n] for s, c, n in zip(states, starts, counts))
            if drafts is not None:  # a request's slice ends at its known tokens; drafts follow
                pieces = (itertools.chain(p, d) for p, d in zip(pieces, drafts))
            b.input_ids.np[:num_tokens] = np.fromiter(
                itertools.chain.from_iterable(pieces), dtype=np.int64, count=num_tokens
            )
        b.slot_mapping.np[:num_tokens] = (
            self.block_table_cpu[block_rows, positions // bs].astype(np.int64) * bs + positions % bs
        )
        return rows, positions

    def _write_positions(self, states, starts, counts, starts_np, counts_np, rows, positions: np.ndarray) -> int:
        """The positions the model's rotary embedding reads, in the buffers' host arrays:
        each token's index, except for requests with positions of their own
        (``CachedRequestState.positions``): their prompt tokens take their columns, later
        tokens their index + delta. Returns the rows written: 1 (``positions``), or
        ``position_rows`` (``row_positions``) when a request's chunk lies in its prompt."""
        b = self.buffers
        num_tokens = int(counts_np.sum())
        if not self._num_positioned:
            b.positions.np[:num_tokens] = positions
            return 1
        shifted = positions + np.repeat(self._position_delta[rows], counts_np)
        in_prompt = np.flatnonzero(starts_np < self._positioned_len[rows])
        if in_prompt.size == 0:  # decode, or text after every prompt: one row does
            b.positions.np[:num_tokens] = shifted
            return 1
        k, qsl = self.position_rows, b.query_start_loc.np
        out = b.row_positions.np[: k * num_tokens].reshape(k, num_tokens)
        out[:] = shifted
        for i in in_prompt.tolist():
            own, start = states[i].positions, starts[i]
            end = min(start + counts[i], own.num_tokens)
            out[:, qsl[i] : qsl[i] + end - start] = own.positions[:, start:end]
        return k

    def _upload_inputs(
        self, rows: np.ndarray, starts_np, counts_np, uniform_decode: bool, position_rows: int = 1
    ) -> StepInputs:
        """The device side of ``prepare_inputs``: the written arrays and the block-table rows
        uploaded, and the attention metadata every backend builds from."""
        b, bs = self.buffers, self.block_size
        num_reqs, num_tokens = len(rows), int(counts_np.sum())
        max_seq_len = int(starts_np.max()) + 1 if uniform_decode else int(b.seq_lens.np[:num_reqs].max())
        table_rows = self.block_table_cpu[rows, : cdiv(max_seq_len, bs)]
        block_table = b.upload_block_table(table_rows)
        input_ids = b.input_ids.upload(num_tokens)
        if position_rows == 1:
            positions_dev = b.positions.upload(num_tokens)
        else:
            positions_dev = b.row_positions.upload(position_rows * num_tokens).view(position_rows, num_tokens)
        slot_mapping = b.slot_mapping.upload(num_tokens)
        seq_lens_dev = b.seq_lens.upload(num_reqs)
        query_start_loc = b.query_start_loc.upload(num_reqs + 1)
        common = CommonAttentionMetadata(
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=1 if uniform_decode else int(counts_np.max()),
            max_seq_len=max_seq_len,
            query_start_loc=query_start_loc[: num_reqs + 1],
            seq_lens=seq_lens_dev[:num_reqs],
            block_table=block_table,
            slot_mapping=slot_mapping[:num_tokens],
            query_start_loc_cpu=b.query_start_loc.host[: num_reqs + 1],
            seq_lens_cpu=b.seq_lens.host[:num_reqs],
            block_size=bs,
            block_table_cpu=torch.from_numpy(table_rows),
        )
        return StepInputs(
            num_reqs, num_tokens, common, input_ids[:num_tokens], positions_dev[..., :num_tokens], uniform_decode
        )

    def _prepare_graph_inputs(self, states, starts_np: np.ndarray, graph_size: int) -> StepInputs | None:
        """A decode batch for a captured graph: the token, ``seq_len`` and block-table row of
        each request are all the graph needs (see ``CudaGraphRunner``). None: the attention
        backend declined the graph for this batch."""
        num_reqs = len(states)
        seq_lens = starts_np + 1
        max_cols = cdiv(int(starts_np.max()) + 1, self.block_size)
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=num_reqs)
        input_ids = [s.token_ids[c] for s, c in zip(states, starts_np.tolist())]
        table_rows = self.block_table_cpu[rows, :max_cols]
        deltas = self._position_delta[rows] if self._num_positioned else None
        if not self.cuda_graphs.load(input_ids, seq_lens, table_rows, graph_size, deltas):
            return None
        common = self.cuda_graphs.common_metadata(graph_size)
        return StepInputs(num_reqs, num_reqs, common, None, None, True, graph_size)

    def prompt_logprobs(self, states, starts, counts, hidden, first_index) -> dict[str, LogprobsLists]:
        """``prompt_logprobs_tensors`` on the host (a device read: inside a host sync point)."""
        tensors = self.prompt_logprobs_tensors(states, starts, counts, hidden, first_index)
        return {req_id: logprobs_lists(t) for req_id, t in tensors.items()}

    def prompt_logprobs_tensors(self, states, starts, counts, hidden, first_index) -> dict[str, LogprobsTensors]:
        """Logits at position ``p`` score prompt token ``p + 1``; a chunk ``[c, c+n)`` scores
        prompt tokens ``c+1 .. min(c+n, P-1)``. ``first_index[i]``: the row of ``hidden`` of
        request ``i``'s first token (from the step's own counts: the input buffers' host
        copies belong to the latest step launched, maybe a later one). Queued on the device,
        no host sync."""
        out = {}
        index = {state.req_id: (int(first), state, start) for state, start, first in zip(states, starts, first_index)}
        for req_id, num, k in self.prompt_logprobs_rows(states, starts, counts):
            first, state, start = index[req_id]
            logits = self.model.compute_logits(hidden[first : first + num])
            targets = to_device(state.token_ids[start + 1 : start + 1 + num], torch.long, logits.device)
            out[req_id] = chosen_and_top_logprobs(torch.log_softmax(logits.float(), dim=-1), targets, k)
        return out

    def prompt_logprobs_rows(self, states, starts, counts) -> list[tuple[str, int, int]]:
        """(request, prompt positions scored this step, top tokens) for each request that
        wants prompt logprobs and has positions to score in this step."""
        rows = []
        for state, start, count in zip(states, starts, counts):
            if not state.need_prompt_logprobs:
                continue
            num = min(start + count, state.num_prompt_tokens - 1) - start
            if num > 0:
                rows.append((state.req_id, num, num_logprobs(state.sampling_params.prompt_logprobs, self.vocab_size)))
        return rows


def _packed_starts(counts: list[int]) -> np.ndarray:
    """Flat index of each request's first token in a step whose requests are packed in order."""
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64) if counts else np.zeros(0, dtype=np.int64)


def chosen_and_top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> LogprobsTensors:
    """Chosen token first, then the top ``k``; rank = 1 + count of strictly likelier tokens."""
    chosen_lp = logprobs.gather(1, chosen[:, None])
    ranks = (logprobs > chosen_lp).sum(dim=1) + 1
    top_lp, top_ids = logprobs.topk(k, dim=1) if k > 0 else (logprobs[:, :0], chosen[:, None][:, :0])
    ids = torch.cat([chosen[:, None], top_ids], dim=1)
    lps = torch.cat([chosen_lp, top_lp], dim=1)
    return LogprobsTensors(ids, lps, ranks)


def _split_logprobs(tensors, states, vocab_size: int) -> list[LogprobsLists | None]:
    if tensors is None:
        return [None] * len(states)
    ids, lps, ranks = tensors.token_ids.tolist(), tensors.logprobs.tolist(), tensors.ranks.tolist()
    out = []
    for i, s in enumerate(states):
        k = num_logprobs(s.sampling_params.logprobs, vocab_size)
        out.append(None if k is None else LogprobsLists([ids[i][: k + 1]], [lps[i][: k + 1]], [ranks[i]]))
    return out
