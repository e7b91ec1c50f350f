"""The symmetric-memory all-reduce is used only where every rank's process has the same
rendezvous history: torch numbers a process's rendezvous in the keys it exchanges, so a rank
0 that served an earlier TP engine and freshly spawned ranks would wait on different keys
until the distributed timeout (two H100s: 300 s, then NCCL). The agreement is a real
collective here, over gloo between spawned processes."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from pagelm import distributed
from pagelm.distributed import destroy_distributed, init_distributed


def _rank(rank: int, world: int, init_method: str, counts: list[int], out) -> None:
    distributed._symm_rendezvous_count = counts[rank]
    init_distributed(rank, 1, world, init_method, torch.device("cpu"), 30)
    try:
        out.put((rank, distributed._symm_histories_agree(torch.device("cpu"))))
    finally:
        destroy_distributed()


def _agree(tmp_path, name: str, counts: list[int]) -> dict[int, bool]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init_method = f"file://{tmp_path / name}"
    procs = [ctx.Process(target=_rank, args=(r, len(counts), init_method, counts, out)) for r in range(len(counts))]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    return got


def test_ranks_use_symmetric_memory_only_when_their_rendezvous_histories_match(tmp_path):
    # Fresh processes everywhere, or the same history everywhere: symmetric memory.
    assert _agree(tmp_path, "fresh", [0, 0]) == {0: True, 1: True}
    assert _agree(tmp_path, "same", [2, 2]) == {0: True, 1: True}
    # Rank 0 served an engine before (one rendezvous), the other rank is new: every rank
    # takes NCCL, not only the one that knows.
    assert _agree(tmp_path, "rank0_used", [1, 0]) == {0: False, 1: False}
    assert _agree(tmp_path, "three", [0, 0, 3]) == {0: False, 1: False, 2: False}
