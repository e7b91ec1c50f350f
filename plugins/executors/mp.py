"""Local executors. ``uni``: the engine core's rank is the only one. ``mp``: ranks 1..N-1 are
processes of this host (spawned, so CUDA and torch start clean in each), each fed rank 0's
messages through its own pipe as raw bytes."""

from __future__ import annotations

import multiprocessing

from pagelm.executor import Executor, RankDiedError, describe_rank
from pagelm.worker.worker import run_worker


class UniExecutor(Executor):
    name = "uni"

    @classmethod
    def validate(cls, config) -> list[str]:
        if config.world_size > 1:
            return [
                f"'uni' runs one rank; tensor_parallel_size={config.tensor_parallel_size} x pipeline_parallel_size="
                f"{config.pipeline_parallel_size} needs 'mp' (or 'ray')"
            ]
        return []

    def start(self, init_message: bytes, init_method: str) -> None:
        pass

    def send(self, message: bytes) -> None:
        pass

    def shutdown(self) -> None:
        pass


class MultiprocessingExecutor(Executor):
    name = "mp"

    def __init__(self, config) -> None:
        super().__init__(config)
        self._procs: list[multiprocessing.Process] = []
        self._pipes = []

    def start(self, init_message: bytes, init_method: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        world = self.config.world_size
        for rank in range(1, world):
            recv_end, send_end = ctx.Pipe(duplex=False)
            # Not a daemon: the engine core may itself run in a daemonic process's stead (a
            # daemon cannot start children). A rank whose pipe closes (EOFError) exits.
            proc = ctx.Process(
                target=_serve, args=(init_message, rank, world, init_method, recv_end), name=f"pagelm-rank-{rank}"
            )
            proc.start()
            recv_end.close()
            self._procs.append(proc)
            self._pipes.append(send_end)

    def send(self, message: bytes) -> None:
        self._raise_if_dead(wait=0)
        for pipe in self._pipes:
            pipe.send_bytes(message)

    def check_ranks(self) -> None:
        self._raise_if_dead(wait=2.0)

    def _raise_if_dead(self, wait: float) -> None:
        """``wait``: seconds each rank may take to finish exiting (its sockets closed first)."""
        for rank, proc in enumerate(self._procs, start=1):
            if wait:
                proc.join(timeout=wait)
            if not proc.is_alive():
                raise RankDiedError(f"{describe_rank(self.config, rank)} is not running (exit code {proc.exitcode})")

    def shutdown(self) -> None:
        for pipe in self._pipes:
            try:
                pipe.close()  # the rank reads EOF and exits
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs, self._pipes = [], []


def _serve(init_message: bytes, rank: int, world: int, init_method: str, conn) -> None:
    run_worker(init_message, rank, world, init_method, conn.recv_bytes)
