"""Scale-out on two GPUs over NCCL: tensor- and pipeline-parallel greedy outputs against the
one-GPU run (pipeline parallelism also with each stage's CUDA graphs against one eager GPU).
Skipped without two CUDA devices.

In float32 on a tiny model every token must be identical. On a real-shape bf16 model (Qwen3
0.6B's shapes, random weights) pipeline parallelism runs the very same kernels per layer and
must be identical too; tensor parallelism sums partial products in another order, so the test
prints where each prompt first diverges (``-1``: never) and requires the first tokens to agree.
"""

from __future__ import annotations

import pytest
import torch

from pagelm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [(11 * i + 7 * j) % 500 + 5 for j in range(n)]} for i, n in enumerate((3, 40, 17, 130))]

QWEN3_0_6B_SHAPES = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, max_position_embeddings=4096,
)


def _run(model_dir, dtype, prompts=PROMPTS, **kw):
    with LLM(str(model_dir), device="cuda", dtype=dtype, gpu_memory_utilization=0.3, **kw) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), -1)


@pytest.mark.parametrize("kw", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_gpus_float32_greedy_identical_to_one(make_model, arch, kw):
    model_dir = make_model(f"gpu2_{arch}", arch)
    assert _run(model_dir, "float32", **kw) == _run(model_dir, "float32")


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}],
                         ids=["plain", "ngram"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_pp2_with_cuda_graphs_greedy_identical_to_one_gpu_eager(make_model, arch, spec):
    """Each stage replays its captured decode graph between the receive and the send
    (``PipelineStage.replay``); batches of 1..6 decodes hit several captured sizes, padded."""
    model_dir = make_model(f"gpu2_{arch}", arch)
    prompts = PROMPTS + [{"prompt_token_ids": [40, 41, 42, 43] * 5}, {"prompt_token_ids": [9, 8] * 7}]
    want = _run(model_dir, "float32", prompts=prompts, enforce_eager=True)
    with LLM(str(model_dir), device="cuda", dtype="float32", gpu_memory_utilization=0.3, pipeline_parallel_size=2,
             enforce_eager=False, speculative_config=spec) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        graphs = llm.engine.core.runner.cuda_graphs
        assert graphs is not None and graphs.num_replays > 0  # stage 0's graphs replayed
    assert got == want


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_pp2_eagle_with_cuda_graphs_greedy_identical_to_one_gpu_eager(make_model, arch, tmp_path):
    """The EAGLE head on the last stage proposes from graph-replayed decode steps (their
    inputs rebuilt from the host, the block-table rows kept at launch) and sends its drafts
    to rank 0; drafts are verified eagerly. Tokens = one eager GPU without drafts."""
    _eagle_with_graphs_equals_one_gpu_eager(make_model(f"gpu2_{arch}", arch), tmp_path, pipeline_parallel_size=2)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_eagle_with_cuda_graphs_and_async_scheduling_greedy_identical_to_one_gpu_eager(make_model, arch, tmp_path):
    """Both ranks run the head's passes (split like the target's layers) under CUDA graphs and
    async scheduling, the defaults on CUDA: steps where nobody drafts run ahead, and the other
    rank keeps them in flight and finishes them in rank 0's order (it hung in the head's first
    all-reduce before). Tokens = one eager GPU without drafts."""
    assert _eagle_with_graphs_equals_one_gpu_eager(make_model(f"gpu2_{arch}", arch), tmp_path, tensor_parallel_size=2)


def _eagle_with_graphs_equals_one_gpu_eager(model_dir, tmp_path, **parallel) -> bool:
    """An untrained EAGLE head (k=2) drafting under ``parallel`` with CUDA graphs gives the
    tokens of one eager GPU without drafts, and drafts; returns whether the engine ran with
    async scheduling."""
    from pagelm.plugins.spec_decode.eagle_train import EagleTrainConfig, train_eagle_head

    train_eagle_head(model_dir, tmp_path / "head", EagleTrainConfig(steps=0), log=lambda *_: None)
    spec = {"method": "eagle", "num_speculative_tokens": 2, "model": str(tmp_path / "head")}
    prompts = PROMPTS + [{"prompt_token_ids": [40, 41, 42, 43] * 5}, {"prompt_token_ids": [9, 8] * 7}]
    want = _run(model_dir, "float32", prompts=prompts, enforce_eager=True)
    with LLM(str(model_dir), device="cuda", dtype="float32", gpu_memory_utilization=0.3, enforce_eager=False,
             speculative_config=spec, **parallel) as llm:
        async_scheduling = llm.engine.core.async_scheduling
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics.spec_num_draft_tokens for o in outs) > 0
    return async_scheduling


def test_tp2_bf16_all_reduce_inside_the_gemv_identical_to_the_all_reduce_kernel(make_model, monkeypatch):
    """At batch 1 over two ranks each row-parallel GEMV sums its output with the other rank's
    itself (``gemv(all_reduce=...)``), under CUDA graphs and async scheduling. Both ways sum
    the same two bf16 partials, so every token of a bf16 model of real shapes equals the run
    whose all-reduce is a kernel of its own (``PAGELM_FUSED_ALL_REDUCE=0``, which the other
    rank's process inherits). Prompts go one at a time: every decode step is batch 1."""
    model_dir = make_model("gpu2_qwen3_0.6b_shapes", "qwen3", dtype=torch.bfloat16, **QWEN3_0_6B_SHAPES)
    runs = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("PAGELM_FUSED_ALL_REDUCE", fused)
        runs[fused], made = _run_batch_1_tp2(model_dir)
        assert made == (fused == "1"), "the fused all-reduce was (not) used as asked"
    assert runs["1"] == runs["0"]


def _run_batch_1_tp2(model_dir) -> tuple[list[list[int]], bool]:
    """Each prompt alone at TP=2 (bf16, CUDA graphs): the tokens, and whether rank 0 made the
    buffers of both exchange sites. A function of its own so that the engine is gone (its KV cache
    freed) before the next one sizes its cache."""
    import pagelm.distributed as distributed

    with LLM(str(model_dir), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, tensor_parallel_size=2,
             enforce_eager=False) as llm:
        tokens = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
        made = {site for (dtype, site), buffers in distributed._fused_buffers.items() if buffers is not None}
        return tokens, made == {0, 1}  # o_proj, down_proj


def test_real_shape_bf16_pp2_identical_and_tp2_first_divergence(make_model):
    model_dir = make_model("gpu2_qwen3_0.6b_shapes", "qwen3", dtype=torch.bfloat16, **QWEN3_0_6B_SHAPES)
    one = _run(model_dir, "bfloat16")
    assert _run(model_dir, "bfloat16", pipeline_parallel_size=2) == one
    tp = _run(model_dir, "bfloat16", tensor_parallel_size=2)
    divergence = [_first_divergence(a, b) for a, b in zip(one, tp)]
    print(f"bf16 qwen3-0.6b shapes, TP=2 vs TP=1: first diverging position per prompt {divergence}")
    assert all(d == -1 or d >= 1 for d in divergence)


def test_two_gpus_data_parallel_replicas_in_processes_equal_one(make_model):
    """The server's path: each replica's engine core in its own process, on its own GPU."""
    import asyncio

    from pagelm.engine.async_llm import AsyncLLM

    model_dir = make_model("gpu2_llama", "llama")

    async def run(engine):
        async def one(prompt, request_id):
            ids = []
            async for out in engine.generate(prompt, GREEDY, request_id):
                ids += out.outputs[0].token_ids
            return ids

        return list(await asyncio.gather(*(one(p, f"r{i}") for i, p in enumerate(PROMPTS))))

    loop = asyncio.new_event_loop()
    engine = AsyncLLM.from_model(
        str(model_dir), device="cuda", dtype="float32", gpu_memory_utilization=0.3, data_parallel_size=2
    )
    try:
        got = loop.run_until_complete(run(engine))
    finally:
        engine.shutdown()
        loop.close()
    assert got == _run(model_dir, "float32")


def test_two_gpus_data_parallel_replicas_in_one_process_equal_one(make_model):
    """The offline path (``LLM``, ``pagelm bench throughput --data-parallel-size 2``): both
    replicas' engine cores in this process, each on its own GPU with its own CUDA graphs."""
    model_dir = make_model("gpu2_llama", "llama")

    def dp2():  # the engine is gone when it returns: the one-GPU run sizes its KV pool after it
        with LLM(str(model_dir), device="cuda", dtype="float32", gpu_memory_utilization=0.3, data_parallel_size=2) as llm:
            devices = sorted(str(r.device) for r in llm.engine.core.replicas)
            return devices, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]

    devices, got = dp2()
    assert devices == ["cuda:0", "cuda:1"]
    assert got == _run(model_dir, "float32")
