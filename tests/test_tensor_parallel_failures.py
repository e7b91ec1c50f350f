"""A step that fails on rank 0 under tensor parallelism (TP=2 over gloo on the CPU): the
requests in the engine fail and the ranks stay in step for the next ones, or, where they
cannot (the other rank already runs a step rank 0 did not launch), the engine says so at
once instead of hanging in a collective."""

from __future__ import annotations

import pytest

from pagelm import LLM, SamplingParams
from pagelm.executor import RankDiedError
from pagelm.kv_cache import make_block_hasher
from pagelm.plugins.spec_decode.eagle_train import EagleTrainConfig, train_eagle_head
from pagelm.request import Request

PROMPT = [40, 41, 42, 43, 44] * 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _engine(model_dir, **kw) -> LLM:
    # A failure that desynchronised the ranks would otherwise wait out the default 300 s.
    return LLM(str(model_dir), dtype="float32", block_size=8, distributed_timeout=60, **kw)


def _run(core, req_id: str, steps: int | None = None) -> list[int]:
    """Step until ``req_id`` finishes (or ``steps`` steps); its tokens."""
    tokens: list[int] = []
    for _ in range(steps or 200):
        for out in core.step():
            if out.request_id == req_id:
                tokens += out.new_token_ids
                if out.finish_reason is not None:
                    return tokens
    assert steps is not None, f"{req_id} did not finish"
    return tokens


def _add(core, req_id: str) -> None:
    core.add_request(Request(req_id, PROMPT, GREEDY, block_hasher=make_block_hasher(8)))


def _fail_schedule_once(core, when) -> None:
    """Fault injection: rank 0's next ``schedule()`` at which ``when()`` holds raises."""
    schedule, fired = core.scheduler.schedule, []

    def failing_schedule():
        if not fired and when():
            fired.append(1)
            raise RuntimeError("injected fault")
        return schedule()

    core.scheduler.schedule = failing_schedule


def test_a_step_failing_while_one_is_in_flight_drops_it_on_every_rank(llama_dir, tmp_path):
    """EAGLE, async scheduling: a schedule() that raises while a step run ahead is in flight.
    Rank 0 drops that step; the other rank used to finish it at the next message, running
    the head's drafting passes, and their all-reduces, alone."""
    expected = _engine(llama_dir).generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    train_eagle_head(llama_dir, tmp_path / "head", EagleTrainConfig(steps=0), log=lambda *_: None)
    llm = _engine(llama_dir, tensor_parallel_size=2, async_scheduling=True,
                  speculative_config={"method": "eagle", "num_speculative_tokens": 2, "model": str(tmp_path / "head")})
    core = llm.engine.core
    try:
        _add(core, "a")
        _fail_schedule_once(core, when=lambda: core._in_flight is not None)  # with a step in flight
        with pytest.raises(RuntimeError, match="injected fault"):
            _run(core, "a")
        failed = core.fail_all("injected fault")  # what the core loop does
        assert [(o.request_id, o.finish_reason) for o in failed] == [("a", "error")]

        _add(core, "b")  # served as if nothing had happened, on both ranks
        assert _run(core, "b") == expected
        assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks
    finally:
        llm.shutdown()


def test_a_step_failing_with_pipeline_stages_in_flight_drops_them_on_every_rank(llama_dir):
    """PP=2: a schedule() that raises while the stages hold steps in flight. The other rank
    kept its own queue of them and finished the stale ones at rank 0's next ``finish``."""
    expected = _engine(llama_dir).generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm = _engine(llama_dir, pipeline_parallel_size=2)
    core = llm.engine.core
    try:
        _add(core, "a")
        _add(core, "a2")
        _fail_schedule_once(core, when=lambda: bool(core._batch_queue))  # with steps in the stages
        with pytest.raises(RuntimeError, match="injected fault"):
            _run(core, "a")
        assert sorted(o.request_id for o in core.fail_all("injected fault")) == ["a", "a2"]
        _add(core, "b")
        assert _run(core, "b") == expected
        assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks
    finally:
        llm.shutdown()


def test_a_launch_failing_after_the_other_ranks_started_the_step_is_fatal_at_once(llama_dir):
    """Rank 0 sent the step, then its own launch raised: the other rank is inside the step's
    all-reduces and no later step can meet them. The engine stops with an error that says so
    (the loop treats it as a dead rank: AsyncLLM starts the engine again)."""
    llm = _engine(llama_dir, tensor_parallel_size=2)
    core = llm.engine.core
    try:
        _add(core, "a")
        _run(core, "a", steps=3)
        launch = core.runner.launch

        def failing_launch(sched, **kwargs):
            raise RuntimeError("injected fault")

        core.runner.launch = failing_launch
        with pytest.raises(RankDiedError, match=r"rank 0 failed to launch a step the other ranks had started .*injected fault.*out of step"):
            core.step()
        core.runner.launch = launch
    finally:
        llm.shutdown()
