"""Data parallelism: ``data_parallel_size`` engine cores behind the one-core interface that
``LLMEngine`` and ``AsyncLLM`` drive (the ``pagelm_register_data_parallel`` hook), with a
router plugin (``pagelm.plugins.routers.router``) picking the replica of each new request::

    add_request(r) --router.route(r, loads)--> replica i    (remembered: r's aborts, stop
    abort / stop by request id ----------------> replica i      strings and outputs are i's)
    step() / get_output() <------- every replica's outputs, merged

Each replica is a whole engine: its scheduler, KV cache and, with tensor or pipeline
parallelism, its own ranks on GPUs of its own (replica ``i`` starts at
``cuda:(base + i * world_size)``). Offline (``LLM``) the replicas are engine cores of this
process stepped in turn; ``AsyncLLM`` (the server) runs each in its own process, so they run
at once. A step that fails on one replica fails that replica's requests only (its own core
loop); a replica whose process dies takes the engine down (``AsyncLLM`` restarts it).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import Any

import torch

from pagelm.config import EngineConfig
from pagelm.engine.core_client import CoreStep, EngineDeadError, next_output
from pagelm.engine.core_loop import SchedulerStats
from pagelm.engine.core_output import EngineCoreOutput
from pagelm.plugin_manager import get_plugin_manager
from pagelm.plugins.routers.router import ReplicaLoad
from pagelm.registry import raise_problems
from pagelm.request import Request


def replica_config(config: EngineConfig, index: int) -> EngineConfig:
    """Replica ``index``'s config: one replica's worth, on its own GPUs."""
    device = config.device
    if config.resolved_device().type == "cuda":
        base = int(device.partition(":")[2] or 0)
        device = f"cuda:{base + index * config.world_size}"
    return dataclasses.replace(config, data_parallel_size=1, device=device)


def on_device(device: str | torch.device | None):
    """Replicas of one process are on different GPUs: while one starts or steps, its GPU is
    the current device, where CUDA graphs are captured and Triton launches its kernels."""
    device = torch.device(device) if device and str(device).startswith("cuda:") else None
    return torch.cuda.device(device) if device is not None else nullcontext()


class DataParallelCore:
    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int], core_factory: Callable[..., Any]) -> None:
        n = config.data_parallel_size
        router_cls = get_plugin_manager().collect("router").get(config.data_parallel_router)
        problems = router_cls.validate(config)
        in_process = not getattr(core_factory, "runs_in_own_process", False)
        if in_process and config.world_size > 1:
            problems.append(
                "replicas in one process cannot each have tensor/pipeline-parallel ranks (one torch.distributed "
                "group per process): use AsyncLLM or `pagelm serve`, which run each replica in its own process"
            )
        raise_problems(f"data_parallel_size={n}", problems)
        self.router = router_cls(config, n)
        self.replicas: list[Any] = []
        self._tasks: list[asyncio.Task] = []  # before the replicas: a failed start shuts down
        try:
            for i in range(n):
                replica = replica_config(config, i)
                with on_device(replica.device if in_process else "cpu"):  # a process sets its own
                    self.replicas.append(core_factory(replica, eos_token_ids))
        except BaseException:
            self.shutdown()
            raise
        first = self.replicas[0]
        self.max_model_len, self.vocab_size = first.max_model_len, first.vocab_size
        self.eos_token_ids = first.eos_token_ids
        self.num_kv_blocks = sum(r.num_kv_blocks for r in self.replicas)
        self.block_size = config.block_size
        # request id -> (replica, prompt tokens it has yet to prefill: 0 once it has output)
        self.owner: dict[str, tuple[int, int]] = {}
        self._unfinished = [0] * n
        self._pending_prompt = [0] * n
        self._stats = [SchedulerStats(num_free_blocks=r.num_kv_blocks, num_kv_blocks=r.num_kv_blocks) for r in self.replicas]
        self._outputs: asyncio.Queue | None = None

    # ---- requests ------------------------------------------------------------------------
    def loads(self) -> list[ReplicaLoad]:
        return [ReplicaLoad(u, p) for u, p in zip(self._unfinished, self._pending_prompt)]

    def add_request(self, request: Request) -> None:
        i = self.router.route(request, self.loads())
        if not (isinstance(i, int) and 0 <= i < len(self.replicas)):
            raise ValueError(
                f"router {self.router.name!r} chose replica {i!r} for request {request.request_id}; "
                f"it must be an int in [0, {len(self.replicas)})"
            )
        self.replicas[i].add_request(request)
        prompt = len(request.prompt_token_ids)
        self.owner[request.request_id] = (i, prompt)
        self._unfinished[i] += 1
        self._pending_prompt[i] += prompt

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for i, ids in self._by_replica(request_ids).items():
            self.replicas[i].abort_requests(ids)
            for req_id in ids:
                self._forget(req_id)

    def finish_by_stop_string(self, request_ids: Iterable[str]) -> None:
        for i, ids in self._by_replica(request_ids).items():
            self.replicas[i].finish_by_stop_string(ids)

    def _by_replica(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for req_id in request_ids:
            if req_id in self.owner:
                out.setdefault(self.owner[req_id][0], []).append(req_id)
        return out

    def _forget(self, req_id: str) -> None:
        i, pending = self.owner.pop(req_id)
        self._unfinished[i] -= 1
        self._pending_prompt[i] -= pending
        self.router.request_finished(req_id, i)

    def _account(self, outputs: list[EngineCoreOutput]) -> None:
        """Keep the loads the router sees: a request's first output ends its prefill, its
        last one its stay."""
        for out in outputs:
            entry = self.owner.get(out.request_id)
            if entry is None:
                continue
            if out.finish_reason is not None:
                self._forget(out.request_id)
            elif entry[1] and out.new_token_ids:
                self._pending_prompt[entry[0]] -= entry[1]
                self.owner[out.request_id] = (entry[0], 0)

    # ---- offline: replicas in this process ----------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def step(self) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        for i, replica in enumerate(self.replicas):
            if replica.has_unfinished_requests():
                try:
                    with on_device(replica.device):
                        outputs += replica.step()
                except Exception as exc:
                    raise RuntimeError(f"data-parallel replica {i}: {type(exc).__name__}: {exc}") from exc
        self._account(outputs)
        return outputs

    # ---- async: replicas in their own processes (CoreClient) -------------------------------
    async def start(self) -> None:
        self._outputs = asyncio.Queue()
        for i, replica in enumerate(self.replicas):
            await replica.start()
            self._tasks.append(asyncio.create_task(self._pump(i), name=f"pagelm-dp-replica-{i}"))

    async def _pump(self, i: int) -> None:
        """Forward replica ``i``'s steps, with the stats of all replicas summed."""
        try:
            while True:
                step = await self.replicas[i].get_output()
                self._stats[i] = step.stats
                self._account(step.outputs)
                self._outputs.put_nowait(CoreStep(step.outputs, sum_stats(self._stats)))
        except EngineDeadError as exc:
            self._outputs.put_nowait(EngineDeadError(f"data-parallel replica {i}: {exc}"))
        except Exception as exc:  # a bug here must fail the requests, not leave them waiting
            self._outputs.put_nowait(EngineDeadError(f"data-parallel replica {i}: {type(exc).__name__}: {exc}"))

    async def get_output(self) -> CoreStep:
        return await next_output(self._outputs)

    def shutdown(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for replica in self.replicas:
            with on_device(getattr(replica, "device", "cpu")):  # an in-process core's
                replica.shutdown()


def sum_stats(stats: list) -> Any:
    """The replicas' stats as one engine's: counts and totals summed, lists position by
    position, nested stats (the KV tier's) field by field; a per-block size and a share of a
    cache are not sums (the largest, the mean)."""
    total = type(stats[0])()
    for field in dataclasses.fields(total):
        values = [getattr(s, field.name) for s in stats]
        if dataclasses.is_dataclass(values[0]):
            summed = sum_stats(values)
        elif isinstance(values[0], list):
            width = max(map(len, values))
            summed = [sum(v[k] for v in values if k < len(v)) for k in range(width)]
        elif field.name in _NOT_SUMMED:
            summed = _NOT_SUMMED[field.name](values)
        else:
            summed = sum(values)
        setattr(total, field.name, summed)
    return total


_NOT_SUMMED: dict[str, Callable[[list], Any]] = {
    "block_bytes": max,
    "encoder_cache_usage": lambda values: sum(values) / len(values),
}
