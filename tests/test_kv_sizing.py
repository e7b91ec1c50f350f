"""KV pool sizing under scale-out: each rank works out what its own memory holds for its own
layers, and every rank takes the least (``pagelm.worker.kv_sizing``)."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from pagelm import LLM
from pagelm.distributed import destroy_distributed, init_distributed, min_over_ranks
from pagelm.kv_cache import cdiv
from pagelm.worker.kv_sizing import kv_block_bytes, kv_blocks_in_budget

GiB = 2**30


def test_a_card_budget_leaves_the_peak_step_foreign_memory_and_graphs():
    # 80 GiB card at 0.9: 72 GiB ours; the step peaks at 20, 1 GiB is not torch's (context),
    # 0.5 GiB for graphs: 50.5 GiB of 1 MiB blocks.
    blocks = kv_blocks_in_budget(
        total=80 * GiB, free=60 * GiB, reserved=19 * GiB, peak=20 * GiB, utilization=0.9, graphs=GiB // 2,
        per_block=2**20,
    )
    assert blocks == int(50.5 * 1024)


def test_a_budget_is_capped_by_what_is_free_and_never_negative():
    # torch's allocator holds 70 GiB it would not hand back: only the 4 GiB free count.
    assert kv_blocks_in_budget(80 * GiB, 4 * GiB, 70 * GiB, GiB, 0.9, 0, GiB) == 4
    # Another process holds 76 GiB: nothing is left within 0.9 of the card.
    assert kv_blocks_in_budget(80 * GiB, 4 * GiB, 0, GiB, 0.9, 0, GiB) == 0


def test_memory_held_outside_torch_is_warned_about(caplog):
    """Another process's memory shrinks the pool (it counts against the utilization): the log
    says how much, so an empty pool is not a mystery; a CUDA context's worth is not warned of."""
    with caplog.at_level("WARNING", logger="pagelm"):
        kv_blocks_in_budget(80 * GiB, 60 * GiB, 19 * GiB, 20 * GiB, 0.9, 0, GiB)  # 1 GiB: a context
        assert not caplog.records
        kv_blocks_in_budget(80 * GiB, 4 * GiB, 0, GiB, 0.9, 0, GiB)
    assert "76.00 GiB of this GPU is held outside this process's torch allocator" in caplog.text
    assert "gpu_memory_utilization=0.90" in caplog.text


def test_a_stages_block_holds_only_its_layers():
    class Spec:
        num_kv_heads, head_dim = 2, 16

    class Layer:
        spec = Spec()

    # K and V, 2 heads of 16, fp16, 8 tokens: 1 KiB a layer.
    assert kv_block_bytes([Layer()] * 3, 8, torch.float16) == 3 * 1024
    assert kv_block_bytes([Layer()], 8, torch.float16) == 1024


def _rank(rank: int, world: int, init_method: str, values: list[int], out) -> None:
    init_distributed(rank, 1, world, init_method, torch.device("cpu"), 30)
    try:
        out.put((rank, min_over_ranks(values[rank], torch.device("cpu"))))
    finally:
        destroy_distributed()


def test_every_rank_takes_the_least_count_of_any_stage(tmp_path):
    # Three pipeline stages whose memory holds 900, 700 and 800 blocks: all allocate 700.
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init_method = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_rank, args=(r, 3, init_method, [900, 700, 800], out)) for r in range(3)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert got == {0: 700, 1: 700, 2: 700}


def test_pp2_on_the_cpu_sizes_the_pool_for_the_stage_with_the_most_layers(make_model):
    # 3 layers over 2 stages: stage 0 holds 2, stage 1 holds 1, so stage 0's memory holds
    # fewer blocks, and that is the pool (capped at what max_num_seqs sequences need).
    model_dir = make_model("llama-3-layers", "llama", num_hidden_layers=3)
    # A layer's block: K and V, 2 kv heads of 16, float32, 8 tokens = 2 KiB; 30 of stage 0's.
    space = 30 * 2 * 2048
    with LLM(str(model_dir), dtype="float32", pipeline_parallel_size=2, block_size=8, max_model_len=64,
             cpu_kv_cache_space=space) as llm:
        core = llm.engine.core
        per_block = kv_block_bytes(core.runner._kv_layers(), 8, torch.float32)
        assert len(core.runner._kv_layers()) == 2
        assert per_block == 2 * 2048
        assert core.num_kv_blocks == min(30, core.config.max_num_seqs * cdiv(64, 8)) == 30
