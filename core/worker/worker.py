"""A rank other than 0 under tensor or pipeline parallelism: its own model runner over its
slice of the weights (its heads of its stage's layers), driven by rank 0's messages (``pagelm.executor``).

Rank 0 sends, in order: ``init`` (the config and what rank 0 decided while loading), then
``size_kv`` (each rank works out what its memory holds; all take the least) / ``kv_cache``
/ ``graphs`` as it makes those runner calls, then one ``step`` per
step with the ``SchedulerOutput`` (under pipeline parallelism also a ``finish`` when rank 0
finishes the oldest step in flight), ``drop`` after a step failed on rank 0 (its steps in
flight are dropped, as rank 0 drops its own), and ``shutdown``. A rank runs each step as rank 0 does
and samples the same tokens (same logits after the gather, same seeds), which keeps its
runner's copy of every request's tokens in step; only rank 0's are returned. Messages are
msgpack, never pickle.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable
from pathlib import Path

import msgpack
import torch

from pagelm.attention import attention_layers
from pagelm.attention.selector import select_attention_backend
from pagelm.config import EngineConfig
from pagelm.distributed import destroy_distributed, init_distributed, parallel_state
from pagelm.kv_offload import KVTransfers
from pagelm.multimodal import MultiModalProcessor, SupportsMultiModal
from pagelm.plugin_manager import get_plugin_manager
from pagelm.sampling_params import SamplingParams
from pagelm.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from pagelm.worker.kv_sizing import num_kv_blocks
from pagelm.worker.model_runner import ModelRunner
from pagelm.worker.pending_step import PendingStep

logger = logging.getLogger("pagelm")


def pack(kind: str, *args) -> bytes:
    return msgpack.packb([kind, *args])


def init_message(config: EngineConfig, eos_token_ids, dtype: torch.dtype, max_model_len: int) -> bytes:
    return pack("init", dataclasses.asdict(config), sorted(eos_token_ids), str(dtype).removeprefix("torch."), max_model_len)


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank ``r``'s device: on CUDA the ``r``-th GPU from the configured one (rank 0's: a
    data-parallel replica starts past the GPUs of the replicas before it), else the CPU."""
    device = config.resolved_device()
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


def load_runner(config, hf_config, device, dtype, eos_token_ids, max_model_len) -> tuple[ModelRunner, list]:
    """(runner, attention layers): the model (this rank's slice of it) loaded by the
    configured loader, its attention backend chosen (every rank chooses the same), in a
    runner; with ``speculative_config``, the proposer too (every rank builds its own: a draft
    model's layers are split over the ranks like the target's, and every rank verifies and
    proposes each step as rank 0 does; under pipeline parallelism a proposer that reads the
    target's pass lives on the last stage alone, which sends its drafts to rank 0). The
    layers include the proposer's (KV caches)."""
    plugins = get_plugin_manager()
    model = plugins.collect("model loader").get(config.load_format).load(config, hf_config, device, dtype)
    layers = attention_layers(model)
    backend_cls = select_attention_backend(config, plugins.collect("attention backend"), layers[0].spec, dtype, device)
    runner = ModelRunner(
        config, model, backend_cls, device, dtype, eos_token_ids, hf_config.get_text_config().vocab_size, max_model_len,
        _mm_processor(config, hf_config, model),
    )
    if config.speculative_config is not None:
        proposer_cls = plugins.collect("speculative proposer").get(config.speculative.method)
        on_last_stage = config.pipeline_parallel_size > 1 and proposer_cls.uses_target_pass
        proposer = None  # drafts come from the last stage
        if not on_last_stage or parallel_state().is_last_stage:
            proposer = proposer_cls(config, model, device, dtype)
            layers = layers + list(proposer.attention_layers())
        runner.enable_speculative_decoding(proposer, drafts_from_last_stage=on_last_stage)
    return runner, layers


def _mm_processor(config, hf_config, model) -> MultiModalProcessor | None:
    """A vision-language model's processor (no tokenizer: the runner only asks it for the
    profiling pass's dummy images), made only where that pass runs (CUDA)."""
    if not isinstance(model, SupportsMultiModal) or config.resolved_device().type != "cuda":
        return None
    return model.multimodal_processor(Path(config.model), hf_config, None)


def run_worker(
    message: bytes, rank: int, world_size: int, init_method: str, recv: Callable[[], bytes],
    device: torch.device | None = None,
) -> None:
    """A rank's whole life: join the group, load, then serve rank 0's messages until
    ``shutdown`` (or until ``recv`` raises ``EOFError``: rank 0 is gone). ``device``: where
    the executor placed the rank (default ``rank_device``: the ``rank``-th GPU of this host)."""
    from transformers import AutoConfig

    _, config_data, eos, dtype, max_model_len = msgpack.unpackb(message)
    config = EngineConfig(**config_data)
    device = rank_device(config, rank) if device is None else device
    assert world_size == config.world_size
    init_distributed(
        rank, config.tensor_parallel_size, config.pipeline_parallel_size, init_method, device,
        config.distributed_timeout, not config.disable_custom_all_reduce,
    )
    runner = None
    try:
        hf_config = AutoConfig.from_pretrained(config.model, trust_remote_code=config.trust_remote_code)
        runner, layers = load_runner(config, hf_config, device, getattr(torch, dtype), frozenset(eos), max_model_len)
        # Pipeline parallelism: the steps launched and not finished, oldest first.
        in_flight = deque() if config.pipeline_parallel_size > 1 else None
        # Otherwise the step launched and not finished (rank 0 ran it ahead).
        pending: PendingStep | None = None
        while True:
            try:
                kind, *args = msgpack.unpackb(recv(), strict_map_key=False)
            except EOFError:
                return
            if kind == "shutdown":
                return
            if kind == "step" and in_flight is None:
                pending = run_step(runner, pending, decode_scheduler_output(args[0]), *args[1:])
                continue
            if kind == "drop":  # rank 0's step failed: its steps in flight are dropped, not finished
                pending = None
                if in_flight is not None:
                    in_flight.clear()
                runner.drop_in_flight()
                continue
            if pending is not None:  # rank 0 finishes its step in flight before anything else
                runner.finish(pending)
                pending = None
            if kind == "finish" and in_flight is None:  # that was rank 0's finish
                continue
            if kind == "step":  # pipeline: launched now, finished by its own message
                oldest = in_flight[0] if args[1] else None  # finished next: sampled inside this launch
                in_flight.append(runner.launch(decode_scheduler_output(args[0]), defer_sampling=True, sample_first=oldest))
            elif kind == "finish":
                finish_pipelined(runner, in_flight.popleft())
            elif kind == "kv_cache":
                runner.initialize_kv_cache(args[0])
            elif kind == "size_kv":  # this rank's own count; every rank takes the least
                num_kv_blocks(config, runner, layers, max_model_len)
            elif kind == "kv_offload":
                runner.initialize_kv_offload(get_plugin_manager().collect("kv offload").get(config.kv_offload), args[0])
            elif kind == "graphs":
                runner.capture_cuda_graphs()
            else:
                raise ValueError(f"rank {rank}: unknown message {kind!r}")
    except Exception:
        logger.exception("pagelm rank %d failed; it stops (rank 0 names it when its next step fails)", rank)
        raise
    finally:
        if runner is not None:
            runner.release_cuda_graphs()  # before NCCL's teardown, which waits for them
        destroy_distributed()


def run_step(
    runner: ModelRunner, previous: PendingStep | None, sched, run_ahead: bool = False, previous_in_flight: bool = False
) -> PendingStep | None:
    """One step on a rank of a tensor-parallel group, in rank 0's order (``EngineCore._step``):
    a step run ahead is launched before the previous one is finished and stays in flight; any
    other is launched once the previous one is finished, and finished at once. Returns the
    step left in flight. (Every rank keeps the same order: a proposer's collectives happen
    when its step is finished, and the collectives of all ranks must match.)"""
    if previous is not None and not previous_in_flight:
        runner.finish(previous)
        previous = None
    launched = runner.launch(sched)
    if previous is not None:
        runner.finish(previous)
    if run_ahead:
        return launched
    runner.finish(launched)
    return None


def finish_pipelined(runner: ModelRunner, pending: PendingStep):
    """Finish a step launched with its sampling deferred (pipeline parallelism): every rank
    takes part in the broadcast of its sampled ids, then reads them."""
    if pending.output is None and pending.sampled_host is None:  # not sampled inside a later launch
        runner.sample(pending)
    return runner.finish(pending)


# ---- SchedulerOutput on the wire ------------------------------------------------------------


def freeze_grammar_bitmask(s: SchedulerOutput) -> None:
    """Collect a guided step's bitmask now (rank 0, before the step is sent: the ranks that
    sample mask their logits with it) and have ``s.grammar_bitmask`` return it: the rows the
    runner asks for (``ModelRunner.apply_grammar``: the guided requests, and their drafts when
    the step verifies any). A copy: the manager reuses its buffer in the next step, and under
    pipeline parallelism this one is sampled only after later steps are scheduled."""
    constrained, drafts = s.structured_output_request_ids, s.scheduled_spec_decode_tokens
    if not constrained or s.grammar_bitmask is None:
        return
    bitmask = s.grammar_bitmask(constrained, [drafts.get(r, ()) for r in constrained] if drafts else None)
    s.grammar_bitmask = _FrozenBitmask(bitmask.clone())


class _FrozenBitmask:
    """A step's grammar bitmask, collected once: what ``SchedulerOutput.grammar_bitmask``
    returns on every rank (the runner asks for the rows the bitmask was collected for)."""

    def __init__(self, bitmask: torch.Tensor) -> None:
        self.bitmask = bitmask

    def __call__(self, request_ids, drafts=None) -> torch.Tensor:
        return self.bitmask

    def to_wire(self) -> list:
        return [list(self.bitmask.shape), self.bitmask.numpy().tobytes()]

    @classmethod
    def from_wire(cls, data: list) -> "_FrozenBitmask":
        shape, raw = data
        return cls(torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(shape))


def encode_scheduler_output(s: SchedulerOutput) -> list:
    """Plain data for msgpack. A guided step's bitmask travels as its raw int32 words
    (``freeze_grammar_bitmask`` collects it first), drafts as lists of ids."""
    assert not s.structured_output_request_ids or isinstance(s.grammar_bitmask, _FrozenBitmask), (
        "a guided step is sent with its bitmask: freeze_grammar_bitmask first"
    )
    bitmask = s.grammar_bitmask.to_wire() if s.structured_output_request_ids else None
    return [
        [[r.req_id, r.prompt_token_ids, r.output_token_ids, r.sampling_params.to_wire(), r.block_ids,
          r.num_computed_tokens, r.need_prompt_logprobs] for r in s.scheduled_new_reqs],
        [[r.req_id, r.new_block_ids, r.num_computed_tokens] for r in s.scheduled_cached_reqs],
        list(s.num_scheduled_tokens.items()), s.total_num_scheduled_tokens,
        sorted(s.finished_req_ids), sorted(s.preempted_req_ids), s.needs_previous_tokens,
        None if s.kv_transfers is None else [s.kv_transfers.swap_out, s.kv_transfers.swap_in, s.kv_transfers.loads, s.kv_transfers.waits],
        s.structured_output_request_ids, bitmask, list(s.scheduled_spec_decode_tokens.items()),
    ]


def decode_scheduler_output(data: list) -> SchedulerOutput:
    new, cached, num_scheduled, total, finished, preempted, needs_previous, transfers, guided, bitmask, drafts = data
    return SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData(req_id, prompt, output, SamplingParams(**params), blocks, computed, prompt_lp)
            for req_id, prompt, output, params, blocks, computed, prompt_lp in new
        ],
        scheduled_cached_reqs=[CachedRequestData(*r) for r in cached],
        num_scheduled_tokens=dict(num_scheduled),
        total_num_scheduled_tokens=total,
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
        needs_previous_tokens=needs_previous,
        kv_transfers=None if transfers is None else _decode_transfers(*transfers),
        structured_output_request_ids=guided,
        grammar_bitmask=None if bitmask is None else _FrozenBitmask.from_wire(bitmask),
        scheduled_spec_decode_tokens=dict(drafts),
    )


def _decode_transfers(swap_out: list, swap_in: list, loads: list, waits: list) -> KVTransfers:
    return KVTransfers([tuple(p) for p in swap_out], [tuple(p) for p in swap_in], [tuple(p) for p in loads], list(waits))
