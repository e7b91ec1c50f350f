"""EngineCore: the step loop. It owns the scheduler, the KV cache manager and the model
runner; it knows nothing about text (token ids in, token ids out)::

    step():  scheduler.schedule() -> runner.launch() -> runner.finish() -> scheduler.update_from_output()

With async scheduling one step stays in flight and ``step()`` returns the previous step's
outputs; when a step must run synchronously instead, see docs/architecture.md ("Async
scheduling").
"""

from __future__ import annotations

import atexit
import logging
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import AutoConfig

from pagelm.attention import GraphSupport
from pagelm.config import EngineConfig
from pagelm.distributed import destroy_distributed, init_distributed
from pagelm.engine.core_output import EngineCoreOutput
from pagelm.kv_cache import KVCacheManager, make_block_hasher
from pagelm.multimodal import SupportsMultiModal
from pagelm.plugin_manager import get_plugin_manager
from pagelm.registry import raise_problems
from pagelm.request import Request, RequestStatus
from pagelm.sched.encoder_cache import EncoderCacheManager
from pagelm.sched.scheduler import Scheduler
from pagelm.sched.output import SchedulerOutput
from pagelm.executor import Executor, RankDiedError
from pagelm.worker.kv_sizing import num_kv_blocks
from pagelm.worker.pending_step import PendingStep
from pagelm.worker.worker import encode_scheduler_output, freeze_grammar_bitmask, init_message, load_runner, pack

logger = logging.getLogger("pagelm")


class EngineCore:
    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.config = config
        plugins = get_plugin_manager()
        plugins.notify("pagelm_configure", config=config)
        self.plugins = plugins

        # Plugin names first: a typo fails before any weight is read.
        if config.attention_backend != "auto":
            plugins.collect("attention backend").get(config.attention_backend)
        policy_cls = plugins.collect("scheduling policy").get(config.scheduling_policy)
        # No guided-decoding plugin at all: the engine runs, guided requests are refused.
        backends = plugins.collect("structured output backend")
        structured_output_cls = backends.get(config.structured_output_backend) if len(backends) else None
        raise_problems(f"scheduling_policy={config.scheduling_policy!r}", policy_cls.validate(config))
        proposer_cls = self._proposer_class(plugins)
        loader = plugins.collect("model loader").get(config.load_format)
        self.offload_cls = self._kv_offload_class(plugins)

        config.model = loader.resolve(config.model)  # a hub id becomes its local snapshot
        path = Path(config.model)
        self.hf_config = AutoConfig.from_pretrained(path, trust_remote_code=config.trust_remote_code)
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype(self.hf_config)
        self.max_model_len = self._max_model_len()
        # A vision-language model's config nests the language model's (text_config).
        self.vocab_size = self.hf_config.get_text_config().vocab_size
        self.eos_token_ids = eos_token_ids
        self.executor = self._start_ranks(plugins, proposer_cls)
        try:
            use_cuda_graphs = self._load()
        except BaseException:
            self._stop_ranks()
            raise
        self.block_hasher = make_block_hasher(config.block_size)
        self.kv_cache_manager = KVCacheManager(
            self.num_kv_blocks, config.block_size, config.enable_prefix_caching, self._kv_offload_tier()
        )
        self.async_scheduling = self._use_async_scheduling(use_cuda_graphs, proposer_cls)
        self.structured_output = None if structured_output_cls is None else structured_output_cls.make_manager(
            config, self.vocab_size, eos_token_ids, device=self.device, async_scheduling=self.async_scheduling
        )
        self.multimodal = isinstance(self.runner.model, SupportsMultiModal)
        self.scheduler = Scheduler(
            config, self.kv_cache_manager, policy_cls(config), self.max_model_len, self.structured_output,
            num_lookahead_tokens=0 if proposer_cls is None else proposer_cls.num_lookahead_slots(config),
            encoder_cache=EncoderCacheManager(config.encoder_cache_embeddings) if self.multimodal else None,
        )
        # req_id -> when it was first scheduled, until its first output carries it out.
        self._first_scheduled: dict[str, float] = {}
        # Async scheduling: the step launched and not finished yet (a guided one maybe not
        # sampled yet: ``PendingStep.awaits_sampling``).
        self._in_flight: PendingStep | None = None
        # Set while the other ranks have been sent a step that rank 0 has not launched yet: a
        # failure then leaves them inside its collectives, out of step with rank 0 for good.
        self._others_ahead = False
        # Pipeline parallelism: the steps launched and not finished, oldest first.
        self._batch_queue: deque[PendingStep] | None = deque() if config.pipeline_parallel_size > 1 else None
        logger.info(
            "pagelm engine: %s on %s/%s, %d KV blocks of %d tokens, backend=%s, policy=%s, cuda_graphs=%s, "
            "async_scheduling=%s, speculative=%s",
            path.name, self.device, self.dtype, self.num_kv_blocks, config.block_size,
            self.runner.backend.name, policy_cls.name, use_cuda_graphs, self.async_scheduling,
            config.speculative.describe() if config.speculative else "off",
        )
        plugins.notify("pagelm_engine_started", engine=self)

    def _load(self) -> bool:
        """The model on every rank, its KV cache sized and allocated, graphs captured;
        whether CUDA graphs are used."""
        config = self.config
        # A draft model (EAGLE) shares the target's embedding and LM head; its attention
        # layers (among ``layers``) get KV caches next to the target's.
        self.runner, layers = load_runner(
            config, self.hf_config, self.device, self.dtype, self.eos_token_ids, self.max_model_len
        )
        use_cuda_graphs = self._use_cuda_graphs(self.runner.backend)
        self.num_kv_blocks = self._num_kv_blocks(layers)
        if self.num_kv_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {self.num_kv_blocks} blocks x {config.block_size} = "
                f"{self.num_kv_blocks * config.block_size} tokens, less than one max_model_len="
                f"{self.max_model_len} sequence; lower max_model_len, raise gpu_memory_utilization "
                "or num_kv_blocks, or lower max_num_batched_tokens / max_num_seqs (activations); "
                "on a GPU, memory other processes hold counts against gpu_memory_utilization "
                "(the 'KV sizing' log line says how much)"
            )
        self._on_other_ranks("kv_cache", self.num_kv_blocks)
        self.runner.initialize_kv_cache(self.num_kv_blocks)
        self.num_cpu_blocks = 0
        if self.offload_cls is not None:
            self.num_cpu_blocks = config.num_cpu_blocks
            if self.num_cpu_blocks is None:  # sized from swap_space (GiB)
                self.num_cpu_blocks = int(config.swap_space * 2**30 // self._block_bytes())
            self._on_other_ranks("kv_offload", self.num_cpu_blocks)
            self.runner.initialize_kv_offload(self.offload_cls, self.num_cpu_blocks)
        if use_cuda_graphs:
            self._on_other_ranks("graphs")
            self.runner.capture_cuda_graphs()
        return use_cuda_graphs

    def _stop_ranks(self) -> None:
        """The ranks told to stop first, then every rank leaves the process group at the same
        time: NCCL's teardown waits for the peers, so rank 0 joining the ranks before leaving
        (while they wait for it inside theirs) hung a TP=2 engine's shutdown on two H100s."""
        atexit.unregister(self._stop_ranks)
        if self.executor is not None:
            try:
                self._on_other_ranks("shutdown")
            except Exception:  # a rank already gone: the executor's shutdown reaps it
                pass
            if hasattr(self, "runner"):  # not when loading failed
                self.runner.release_cuda_graphs()  # before NCCL's teardown, which waits for them
            destroy_distributed()
            self.executor.shutdown()
            self.executor = None

    def _start_ranks(self, plugins, proposer_cls) -> Executor | None:
        """The other ranks started by the configured executor, this process joined to them as
        rank 0 (None: one rank)."""
        config = self.config
        executor_cls = plugins.collect("executor").get(config.executor_backend)
        problems = executor_cls.validate(config)
        if (
            config.pipeline_parallel_size > 1 and proposer_cls is not None and proposer_cls.uses_target_pass
            and not proposer_cls.supports_pipeline_parallel
        ):
            # It reads the target's hidden states, which only the last stage has, and has not
            # said it can live there alone (``Proposer.supports_pipeline_parallel``).
            problems.append(
                f"speculative_config (method={config.speculative.method!r}) does not run under pipeline parallelism "
                f"(pipeline_parallel_size={config.pipeline_parallel_size}): its proposer reads the target's forward "
                "pass and does not set supports_pipeline_parallel; 'ngram', 'eagle' and 'medusa' do run there"
            )
        raise_problems(f"distributed_executor_backend={config.executor_backend!r}", problems)
        if config.world_size == 1:
            return None
        executor = executor_cls(config)
        self.device = executor.this_device() or self.device
        init_method = executor.init_method()
        executor.start(init_message(config, self.eos_token_ids, self.dtype, self.max_model_len), init_method)
        try:
            init_distributed(
                executor.this_rank(), config.tensor_parallel_size, config.pipeline_parallel_size, init_method,
                self.device, config.distributed_timeout, not config.disable_custom_all_reduce,
            )
        except BaseException:
            executor.shutdown()
            raise
        # A script that never shuts its engine down must still exit: at interpreter exit
        # multiprocessing joins the ranks, which wait for rank 0's next message forever
        # (atexit runs this first: it was registered after multiprocessing's own hook).
        atexit.register(self._stop_ranks)
        return executor

    def _on_other_ranks(self, kind: str, *args) -> None:
        """Have every other rank make the runner call rank 0 makes next (in order)."""
        if self.executor is not None:
            self.executor.send(pack(kind, *args))

    def _proposer_class(self, plugins):
        """The speculative proposer ``speculative_config`` names, checked (None: off)."""
        raw = self.config.speculative_config
        if raw is None:
            return None
        proposers = plugins.collect("speculative proposer")
        method = raw.get("method") if isinstance(raw, dict) else None
        # The method first: with an unknown one the other keys' problems are beside the point.
        if isinstance(method, str) and method not in proposers:
            raise ValueError(
                f"speculative_config.method={method!r} is not a registered proposer; "
                f"registered: {', '.join(proposers.names()) or '(none)'}"
            )
        spec = self.config.speculative  # a ValueError naming the bad key
        proposer_cls = proposers.get(spec.method)
        raise_problems(f"speculative_config (method={spec.method!r})", proposer_cls.validate(self.config))
        return proposer_cls

    def _kv_offload_class(self, plugins):
        """The registered second KV tier ``kv_offload`` names, checked (None: no tier)."""
        if not self.config.kv_offload_enabled:
            return None
        offload_cls = plugins.collect("kv offload").get(self.config.kv_offload)
        raise_problems(f"kv_offload={self.config.kv_offload!r}", offload_cls.validate(self.config))
        return offload_cls

    def _block_bytes(self) -> int:
        """One KV block of every layer on this rank."""
        return sum(c.numel() * c.element_size() for c in self.runner.kv_caches) // self.num_kv_blocks

    def _kv_offload_tier(self):
        if self.offload_cls is None:
            return None
        # A token's forward pass: about two flops per weight (all ranks' slices).
        num_params = sum(p.numel() for p in self.runner.model.parameters()) * self.config.world_size
        return self.offload_cls.make_tier(self.config, self.num_cpu_blocks, self._block_bytes(), 2.0 * num_params)

    def _use_cuda_graphs(self, backend_cls) -> bool:
        """Graphs need CUDA and a graph-safe backend. ``enforce_eager=False`` demands them, so
        a combination that cannot have them is an error rather than a silent fallback."""
        possible = self.device.type == "cuda" and backend_cls.graph_support != GraphSupport.NEVER
        if self.config.enforce_eager is False and not possible:
            why = "they need a CUDA device" if self.device.type != "cuda" else (
                f"attention backend {backend_cls.name!r} is not CUDA-graph safe"
            )
            raise ValueError(f"enforce_eager=False asks for CUDA graphs, but {why}; leave enforce_eager unset or True")
        return possible and not self.config.enforce_eager

    def _use_async_scheduling(self, use_cuda_graphs: bool, proposer_cls) -> bool:
        """By default where it pays: with CUDA graphs the host work between steps would leave
        the GPU idle. A proposer that must see every step (a draft model) keeps it off."""
        if proposer_cls is not None and proposer_cls.needs_every_step:
            if self.config.async_scheduling:
                raise ValueError(
                    f"async_scheduling=True is not supported with speculative_config.method="
                    f"{proposer_cls.name!r}: its proposer runs after every step (needs_every_step); "
                    "leave async_scheduling unset or False"
                )
            return False
        if self.config.async_scheduling is not None:
            return self.config.async_scheduling
        # Under pipeline parallelism the micro-batches in flight (``_step_pipelined``) are the
        # run-ahead: async_scheduling=True is accepted and changes nothing there.
        return use_cuda_graphs and self.config.pipeline_parallel_size == 1

    def _max_model_len(self) -> int:
        limit = getattr(self.hf_config.get_text_config(), "max_position_embeddings", None)
        want = self.config.max_model_len
        if want is None:
            if limit is None:
                raise ValueError("config.json has no max_position_embeddings: pass max_model_len")
            return limit
        if limit is not None and want > limit:
            raise ValueError(f"max_model_len={want} exceeds the model's max_position_embeddings={limit}")
        return want

    def _num_kv_blocks(self, layers) -> int:
        """``num_kv_blocks``, or the least number of blocks any rank's memory holds for its
        layers (every rank works out its own: ``pagelm.worker.kv_sizing``)."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        self._on_other_ranks("size_kv")
        return num_kv_blocks(self.config, self.runner, layers, self.max_model_len)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request, or raise ``ValueError`` with nothing queued. The API process has
        validated it already; these checks keep a bad one (a bug there) from the step loop."""
        self._check_request(request)
        request.attach_block_hasher(self.block_hasher)
        self.scheduler.add_request(request)

    def _check_request(self, request: Request) -> None:
        ids = request.prompt_token_ids
        if not ids:
            raise ValueError(f"request {request.request_id}: the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id}: {len(ids)} prompt tokens leave no room under max_model_len={self.max_model_len}"
            )
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"request {request.request_id}: prompt token ids must be in [0, {self.vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(request.sampling_params, name)
            # Past the vocabulary the step's top-k raises, failing every request in the batch.
            if k is not None and not -1 <= k <= self.vocab_size:
                raise ValueError(f"request {request.request_id}: {name} must be -1 or in [0, {self.vocab_size}], got {k}")
        if self.executor is not None and self.executor.every_rank_schedules:
            self._check_request_for_independent_ranks(request)
        if request.max_tokens is not None and request.max_tokens < 1:
            raise ValueError(f"request {request.request_id}: max_tokens must be >= 1, got {request.max_tokens}")
        if request.mm_features:
            self._check_images(request)

    def _check_request_for_independent_ranks(self, request: Request) -> None:
        """Every rank schedules for itself (``Executor.every_rank_schedules``): what would make
        the ranks' schedules or outputs differ is refused."""
        params, backend = request.sampling_params, self.config.executor_backend
        if params.guided_decoding is not None:
            raise ValueError(
                f"request {request.request_id}: guided decoding does not run with distributed_executor_backend="
                f"{backend!r} (each rank compiles grammars on a thread of its own, so the ranks could schedule "
                "differently); use 'mp' or 'ray'"
            )
        if self.config.pipeline_parallel_size > 1 and (params.logprobs is not None or params.prompt_logprobs is not None):
            raise ValueError(
                f"request {request.request_id}: logprobs and prompt_logprobs do not run with distributed_executor_backend="
                f"{backend!r} under pipeline parallelism (only rank 0 receives them); use 'mp' or 'ray'"
            )

    def _check_images(self, request: Request) -> None:
        """Images need a vision-language model on one rank without speculative decoding, and
        each must fit the encoder's step budget and cache (else it could never be scheduled)."""
        if not self.multimodal:
            raise ValueError(f"request {request.request_id}: the model {self.hf_config.architectures} takes no images")
        if self.executor is not None or self.runner.spec is not None:
            raise ValueError(
                f"request {request.request_id}: images do not run with tensor parallelism or speculative decoding yet"
            )
        ids, previous_end = request.prompt_token_ids, 0
        limit = min(self.scheduler.encoder_budget, self.config.encoder_cache_embeddings)
        for f in request.mm_features:
            if not previous_end <= f.offset < f.end <= len(ids) or f.length < 1:
                raise ValueError(f"request {request.request_id}: image placeholders [{f.offset}, {f.end}) are not "
                                 f"ordered inside the {len(ids)}-token prompt")
            if f.length > limit:
                raise ValueError(
                    f"request {request.request_id}: an image needs {f.length} embeddings; max_num_encoder_input_tokens "
                    f"and encoder_cache_size allow {limit} (raise them)"
                )
            previous_end = f.end

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self._forget_finished(self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED))

    def finish_by_stop_string(self, request_ids: Iterable[str]) -> None:
        self._forget_finished(self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED))

    def _forget_finished(self, requests: list[Request]) -> None:
        """Tell the plugins each request finished (reason: its status's finish reason)."""
        for req in requests:
            self._first_scheduled.pop(req.request_id, None)
            self.plugins.notify("pagelm_request_finished", request=req, reason=req.status.finish_reason)

    def fail_all(self, error: str) -> list[EngineCoreOutput]:
        """End every request with ``error`` after a step raised (nobody knows which request
        caused it): all blocks go back, and the prefix cache, which may name blocks whose KV
        was never written, is emptied. The loop serves on. The other ranks drop their steps
        in flight with rank 0's: a rank that finished one instead would run a proposer's
        collectives alone."""
        self._in_flight = None
        if self._batch_queue is not None:
            self._batch_queue.clear()
        self.runner.drop_in_flight()
        self._on_other_ranks("drop")
        failed = self.scheduler.fail_all()
        self.kv_cache_manager.reset_after_failure()
        self._forget_finished(failed)
        return [EngineCoreOutput(r.request_id, [], finish_reason="error", error=error) for r in failed]

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or a step in flight whose outputs ``step()`` has yet to return."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None or bool(self._batch_queue)

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Run a step; return the outputs of the steps finished meanwhile: this one (synchronous),
        the previous one (async), or both (async, when this one must run synchronously)."""
        if self.executor is None:
            return self._step()
        try:
            return self._step() if self._batch_queue is None else self._step_pipelined()
        except Exception as exc:
            # A collective that failed because a rank died says only "connection closed":
            # name the rank instead (the RuntimeError chains the original).
            self.executor.check_ranks()
            if self._others_ahead:
                # The other ranks are in this step's forward pass, waiting in collectives rank 0
                # will never join: no later step can meet theirs. Fatal, as a dead rank is (the
                # loop stops; AsyncLLM starts the engine again).
                self._others_ahead = False
                raise RankDiedError(
                    f"rank 0 failed to launch a step the other ranks had started ({type(exc).__name__}: {exc}); "
                    "the ranks are out of step"
                ) from exc
            raise

    def _launch_on_every_rank(self, kind: str, *args) -> None:
        """Tell the other ranks to launch a step rank 0 launches next (``_others_ahead`` until
        rank 0's own launch returns)."""
        if self.executor is not None:
            self._on_other_ranks(kind, *args)
            self._others_ahead = True

    def _step(self) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        if self._in_flight is not None and self.runner.may_draft_next():
            # Speculative decoding: the drafts of the step about to be scheduled come from the
            # proposal after the step in flight, so that one is finished first.
            outputs = self._finish_in_flight()
        sched_out = self._schedule()
        guided = bool(sched_out.structured_output_request_ids)
        run_ahead = (
            self.async_scheduling and not sched_out.is_empty and not sched_out.needs_previous_tokens
            and not sched_out.scheduled_spec_decode_tokens  # verification runs synchronously
            and not (guided and self.executor is not None)  # its bitmask is collected already
        )
        # Launched also when nothing is scheduled: the runner drops finished requests' state.
        # The other ranks get every step, run ahead or not, in the order rank 0 launches them;
        # a guided step goes with its bitmask, which needs the previous step's tokens.
        if self.executor is not None:
            if guided and self._in_flight is not None:
                outputs += self._finish_in_flight()
            freeze_grammar_bitmask(sched_out)
            # With how rank 0 runs it, so that every rank launches and finishes its steps in
            # the same order (``run_worker``): a rank that finished each step before taking
            # the next would leave its GPU idle while it prepares the next, and rank 0's GPU
            # waiting for it in the step's first all-reduce.
            self._launch_on_every_rank(
                "step", encode_scheduler_output(sched_out), run_ahead, run_ahead and self._in_flight is not None
            )
        if run_ahead:
            # A guided step's bitmask needs the previous step's tokens: its forward pass is
            # queued now, its sampling in the next launch or the next _finish.
            previous, self._in_flight = self._in_flight, self.runner.launch(sched_out, defer_sampling=guided)
            self._others_ahead = False
            # The device runs the step just launched while the host finishes the previous one.
            return outputs + self._finish(previous) if previous is not None else outputs
        if self._in_flight is not None:  # its tokens are this step's inputs on the host
            outputs += self._finish(self._in_flight)
            self._in_flight = None
        launched = self.runner.launch(sched_out)
        self._others_ahead = False
        return outputs + self._finish(launched)

    def _step_pipelined(self) -> list[EngineCoreOutput]:
        """Pipeline parallelism: launch a step over the requests not already in flight, and
        finish the oldest step once ``pipeline_parallel_size`` are in flight or nothing more
        could be scheduled; the stages work on different steps meanwhile. Every rank is told
        to launch and to finish in this order (``pagelm.worker.pipeline_stage``)."""
        queue = self._batch_queue
        if len(queue) < self.config.pipeline_parallel_size:
            sched_out = self._schedule()
            # A request is in one step at a time, so its grammar has its tokens already.
            freeze_grammar_bitmask(sched_out)
            # The oldest step is finished right after this launch: the last stage samples it
            # and shares its ids between receiving this step's input and running it, so that
            # rank 0 schedules its requests' next step while the last stage runs this one
            # (sampled after this step's forward pass, the ids reached rank 0 only once the
            # last stage had run both micro-batches, and the first stage waited meanwhile).
            finishes_next = bool(queue) and (sched_out.is_empty or len(queue) + 1 >= self.config.pipeline_parallel_size)
            self._launch_on_every_rank("step", encode_scheduler_output(sched_out), finishes_next)
            oldest = queue[0] if finishes_next else None
            queue.append(self.runner.launch(sched_out, defer_sampling=True, sample_first=oldest))
            self._others_ahead = False
            if not sched_out.is_empty and len(queue) < self.config.pipeline_parallel_size:
                return []
        self._on_other_ranks("finish")
        pending = queue.popleft()
        if pending.output is None and pending.sampled_host is None:  # every rank takes part in the broadcast of its ids
            self.runner.sample(pending)
        return self._finish(pending)

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's next step, noting when each request was first scheduled (a request
        resumed after preemption keeps its first time)."""
        landed = self.runner.poll_loads()
        if landed:  # loads from the KV tier that landed since the last step: schedule them now
            self.scheduler.loads_landed(landed)
        sched_out = self.scheduler.schedule()
        if sched_out.scheduled_new_reqs:
            now = time.time()
            for new in sched_out.scheduled_new_reqs:
                self._first_scheduled.setdefault(new.req_id, now)
        return sched_out

    def _finish_in_flight(self) -> list[EngineCoreOutput]:
        """Finish the step in flight before the next one is scheduled. The other ranks of a
        tensor-parallel group finish theirs with it: a proposer drafts when its step is
        finished, and its passes' collectives must meet theirs."""
        if self.executor is not None and self._batch_queue is None:
            self._on_other_ranks("finish")
        pending, self._in_flight = self._in_flight, None
        return self._finish(pending)

    def _finish(self, pending: PendingStep) -> list[EngineCoreOutput]:
        """Wait for a launched step's tokens and account for them (an empty step too: it
        reports requests that failed before running, e.g. a grammar that did not compile)."""
        if pending.awaits_sampling:
            self.runner.sample(pending)
        runner_out = self.runner.finish(pending)
        outputs, finished = self.scheduler.update_from_output(pending.sched, runner_out)
        if self._first_scheduled:
            for out in outputs:
                out.first_scheduled_time = self._first_scheduled.pop(out.request_id, None)
        self._forget_finished(finished)
        return outputs

    def shutdown(self) -> None:
        if self.structured_output is not None:
            self.structured_output.shutdown()
        self._stop_ranks()
        self.plugins.notify("pagelm_engine_shutdown", engine=self)

