"""EngineCore: the step loop. It owns the scheduler, the KV cache manager and the model
runner; it knows nothing about text (token ids in, token ids out)::

    step():  scheduler.schedule() -> runner.execute_model() -> scheduler.update_from_output()
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from pagelm.attention import attention_layers
from pagelm.config import EngineConfig
from pagelm.engine.core_output import EngineCoreOutput
from pagelm.kv_cache import KVCacheManager, cdiv
from pagelm.model_loader import load_hf_config, load_model, resolve_model_path
from pagelm.plugin_manager import get_plugin_manager
from pagelm.request import Request, RequestStatus
from pagelm.sched.scheduler import Scheduler
from pagelm.worker.model_runner import ModelRunner

logger = logging.getLogger("pagelm")


class EngineCore:
    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.config = config
        plugins = get_plugin_manager()
        plugins.hook.pagelm_configure(config=config)
        self.plugins = plugins

        # Resolve plugin names first: a typo fails before any weight is read.
        backend_cls = plugins.attention_backends().get(config.attention_backend)
        policy_cls = plugins.scheduling_policies().get(config.scheduling_policy)
        problems = policy_cls.validate(config)
        if problems:
            raise ValueError(f"scheduling_policy={config.scheduling_policy!r}: " + "; ".join(problems))

        path = resolve_model_path(config.model)
        self.hf_config = load_hf_config(path)
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype(self.hf_config)
        self.max_model_len = self._max_model_len()
        self.vocab_size = self.hf_config.vocab_size
        model = load_model(config, path, self.hf_config, self.device, self.dtype)
        layers = attention_layers(model)
        problems = backend_cls.validate(config, layers[0].spec, self.dtype, self.device)
        if problems:
            raise ValueError(f"attention_backend={config.attention_backend!r}: " + "; ".join(problems))

        self.num_kv_blocks = self._num_kv_blocks(layers, list(model.parameters()))
        if self.num_kv_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {self.num_kv_blocks} blocks x {config.block_size} = "
                f"{self.num_kv_blocks * config.block_size} tokens, less than one max_model_len="
                f"{self.max_model_len} sequence; lower max_model_len or raise num_kv_blocks"
            )
        self.kv_cache_manager = KVCacheManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv_cache_manager, policy_cls(config), self.max_model_len)
        self.eos_token_ids = eos_token_ids
        # req_id -> when it was first scheduled, until its first output carries it out.
        self._first_scheduled: dict[str, float] = {}
        self.runner = ModelRunner(
            config,
            model,
            backend_cls,
            self.device,
            self.dtype,
            self.num_kv_blocks,
            eos_token_ids,
            self.hf_config.vocab_size,
        )
        logger.info(
            "pagelm engine: %s on %s/%s, %d KV blocks of %d tokens, backend=%s, policy=%s",
            path.name, self.device, self.dtype, self.num_kv_blocks, config.block_size,
            backend_cls.name, policy_cls.name,
        )
        plugins.hook.pagelm_engine_started(engine=self)

    def _max_model_len(self) -> int:
        limit = getattr(self.hf_config, "max_position_embeddings", None)
        want = self.config.max_model_len
        if want is None:
            if limit is None:
                raise ValueError("config.json has no max_position_embeddings: pass max_model_len")
            return limit
        if limit is not None and want > limit:
            raise ValueError(f"max_model_len={want} exceeds the model's max_position_embeddings={limit}")
        return want

    def _num_kv_blocks(self, layers, model_params) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_token = sum(2 * l.spec.num_kv_heads * l.spec.head_dim for l in layers) * self.dtype.itemsize
        per_block = per_token * cfg.block_size
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Leave room for activations of the largest step and the sampler's logits.
            hidden = self.hf_config.hidden_size
            inter = getattr(self.hf_config, "intermediate_size", 4 * hidden)
            activations = cfg.max_num_batched_tokens * (4 * hidden + 2 * inter) * 4 * 2
            logits = cfg.max_num_seqs * self.hf_config.vocab_size * 4 * 4
            reserve = activations + logits
            # Our share of the card (minus our weights), but never more than is free now:
            # other engines in this process or on this GPU keep what they hold.
            weights = sum(p.numel() * p.element_size() for p in model_params)
            budget = min(total * cfg.gpu_memory_utilization - weights, free) - reserve
            return max(int(budget // per_block), 0)
        needed = cfg.max_num_seqs * cdiv(self.max_model_len, cfg.block_size)
        return max(1, min(cfg.cpu_kv_cache_space // per_block, needed))

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for req in self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED):
            self._first_scheduled.pop(req.request_id, None)
            self.plugins.hook.pagelm_request_finished(request=req, reason="abort")

    def finish_by_stop_string(self, request_ids: Iterable[str]) -> None:
        for req in self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED):
            self.plugins.hook.pagelm_request_finished(request=req, reason="stop")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        sched_out = self.scheduler.schedule()
        if sched_out.scheduled_new_reqs:
            now = time.time()
            for new in sched_out.scheduled_new_reqs:  # resumed after preemption: keep the first time
                self._first_scheduled.setdefault(new.req_id, now)
        if sched_out.is_empty:
            # Nothing runnable: still let the runner drop finished requests' state.
            self.runner.execute_model(sched_out)
            return []
        runner_out = self.runner.execute_model(sched_out)
        outputs, finished = self.scheduler.update_from_output(sched_out, runner_out)
        if self._first_scheduled:
            for out in outputs:
                out.first_scheduled_time = self._first_scheduled.pop(out.request_id, None)
        for req in finished:
            self.plugins.hook.pagelm_request_finished(request=req, reason=req.status.finish_reason)
        return outputs

    def shutdown(self) -> None:
        self.plugins.hook.pagelm_engine_shutdown(engine=self)
