"""``external_launcher``: every rank was started by an outside launcher (``torchrun``), runs
the same script, and builds an engine of its own (vLLM's executor of the same name)::

    torchrun --nproc-per-node 2 script.py      # script: LLM(model, tensor_parallel_size=2,
                                               #   distributed_executor_backend="external_launcher")
    rank 0: LLM -> engine core: scheduler, KV cache manager, runner over its slice --+
    rank 1: LLM -> engine core: scheduler, KV cache manager, runner over its slice --+ collectives

Nothing is started and no message is sent: each rank's scheduler makes the same decisions
from the same requests in the same order (the engine refuses what would make them differ:
guided decoding, whose grammars compile on a thread, and logprobs under pipeline
parallelism, which only rank 0 receives), every rank samples the same tokens, and every
rank's ``generate`` returns the same outputs. The ranks join the world torchrun describes
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: ``env://``), or the one the
script initialised itself; on CUDA a rank uses GPU ``LOCAL_RANK``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from pagelm.executor import Executor


class ExternalLauncherExecutor(Executor):
    name = "external_launcher"
    every_rank_schedules = True

    @classmethod
    def validate(cls, config) -> list[str]:
        if dist.is_initialized():
            world = dist.get_world_size()
        elif {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
            world = int(os.environ["WORLD_SIZE"])
        else:
            return [
                "'external_launcher' runs under torchrun (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT unset, "
                "torch.distributed not initialised): torchrun --nproc-per-node N script.py"
            ]
        problems = []
        if world != config.world_size:
            problems.append(
                f"torchrun started {world} ranks; tensor_parallel_size={config.tensor_parallel_size} x "
                f"pipeline_parallel_size={config.pipeline_parallel_size} needs {config.world_size}"
            )
        if config.data_parallel_size > 1:
            problems.append("'external_launcher' runs one engine over the torchrun world: data_parallel_size must be 1")
        return problems

    def this_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])

    def this_device(self) -> torch.device | None:
        if self.config.resolved_device().type != "cuda":
            return None
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", self.this_rank())))

    def init_method(self) -> str:
        return "env://"

    def start(self, init_message: bytes, init_method: str) -> None:
        pass  # torchrun started every rank

    def send(self, message: bytes) -> None:
        pass  # every rank runs its own engine core

    def shutdown(self) -> None:
        pass  # torchrun ends the ranks
