"""The ``ray`` executor on a local CPU Ray cluster: rank 1 is a Ray actor placed by a
placement group, joined to rank 0 over gloo. Tensor parallelism through it gives the token
ids of the one-rank run; a rank whose actor dies is named. Skipped without ray installed
(``pip install 'pagelm[ray]'``)."""

from __future__ import annotations

import time

import pytest

from pagelm import LLM, SamplingParams

ray = pytest.importorskip("ray")

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(5)]} for i in range(3)]


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _ids(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_tp2_through_ray_equals_one_rank_and_returns_its_bundles(llama_dir, ray_cluster):
    with LLM(str(llama_dir), dtype="float32") as llm:
        plain = _ids(llm)
    with LLM(str(llama_dir), dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray") as llm:
        # Rank 1 holds the placement group's one bundle: one CPU of the cluster's two.
        assert ray.available_resources().get("CPU", 0) <= 1
        assert _ids(llm) == plain
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2


def test_a_dead_ray_rank_is_named(llama_dir, ray_cluster):
    with LLM(str(llama_dir), dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray",
             distributed_timeout=20) as llm:
        (actor,) = llm.engine.core.executor._actors
        ray.kill(actor)
        time.sleep(1)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 \(tensor-parallel rank 1 of pipeline stage 0\) is not running"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 20
