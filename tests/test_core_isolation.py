"""The engine core loop serves everyone else when one request cannot be taken: a request it
rejects fails alone, with an error output, and the loop runs on."""

from __future__ import annotations

import pytest

from pagelm.config import EngineConfig
from pagelm.engine.core_loop import ADD, SHUTDOWN, encode_request, run_core_loop
from pagelm.engine.core_proc import _decode_command
from pagelm.engine.engine_core import EngineCore
from pagelm.kv_cache import make_block_hasher
from pagelm.request import Request
from pagelm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def core(llama_dir):
    core = EngineCore(EngineConfig(model=str(llama_dir), device="cpu", max_model_len=128))
    yield core
    core.shutdown()


def _request(req_id: str, prompt: list[int], params: SamplingParams = GREEDY) -> Request:
    return Request(req_id, prompt, params, block_hasher=make_block_hasher(16))


def _serve(core: EngineCore, batches: list[list[tuple]]) -> dict:
    """Run the core loop over ``batches`` of commands; returns {req_id: (tokens, last finish
    reason, errors)}."""
    batches = list(batches) + [[(SHUTDOWN, None)]]
    results: dict[str, tuple[list[int], str | None, list[str]]] = {}

    def inbox(block: bool) -> list:
        return batches.pop(0) if batches and (block or len(batches) > 1) else []

    def publish(outputs, stats) -> None:
        for out in outputs:
            tokens, _, errors = results.get(out.request_id, ([], None, []))
            errors = errors + [out.error] if out.error else errors
            results[out.request_id] = (tokens + list(out.new_token_ids), out.finish_reason, errors)

    run_core_loop(core, inbox, publish)
    return results


def test_a_request_the_core_rejects_fails_alone_and_the_loop_runs_on(core):
    vocab = core.vocab_size
    results = _serve(core, [
        [(ADD, _request("bad", [3, vocab + 5])), (ADD, _request("good", [3, 4, 5]))],
        [(ADD, _request("later", [7, 8]))],
    ])
    tokens, reason, errors = results["bad"]
    assert (tokens, reason) == ([], "error") and len(errors) == 1 and f"[0, {vocab})" in errors[0]
    assert results["good"][1] == "length" and len(results["good"][0]) == 4
    assert results["later"][1] == "length" and len(results["later"][0]) == 4
    assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks


def test_a_duplicate_request_id_is_rejected_without_touching_the_first(core):
    results = _serve(core, [[(ADD, _request("same", [3, 4, 5])), (ADD, _request("same", [9, 9]))]])
    tokens, reason, errors = results["same"]
    assert len(errors) == 1 and "already in the engine" in errors[0]
    assert (len(tokens), reason) == (4, "length")  # the first one ran to the end
    assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks


def test_a_payload_that_does_not_decode_becomes_a_reject_of_that_request():
    payload = encode_request(_request("r1", [1, 2, 3]))
    payload[2]["temperature"] = -1.0  # what a buggy or hostile API process could send
    kind, (req_id, error) = _decode_command(ADD, payload)
    assert (kind, req_id) == ("reject", "r1")
    assert "temperature" in error


def test_engine_core_add_request_raises_with_nothing_queued(core):
    with pytest.raises(ValueError, match="max_model_len"):
        core.add_request(_request("long", [5] * 200))
    assert not core.scheduler.has_unfinished_requests()


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_more_logprobs_than_the_vocabulary_is_refused_at_the_core_with_nothing_queued(core, name):
    """A bad API process could send it: in the step, top-k past the vocabulary would fail
    every request of the batch."""
    with pytest.raises(ValueError, match=rf"{name} must be -1 or in \[0, 512\], got 513"):
        core.add_request(_request("many", [1, 2, 3], SamplingParams(max_tokens=2, **{name: 513})))
    assert not core.scheduler.has_unfinished_requests()
    results = _serve(core, [[(ADD, _request("after", [1, 2, 3]))]])
    assert len(results["after"][0]) == 4


# ---- a failing step, a dead engine core ---------------------------------------------------


from pagelm.engine.output_processor import OutputKind  # noqa: E402


def _run(loop, coro):
    return loop.run_until_complete(coro)


async def _generate(engine, prompt, request_id, max_tokens=8):
    out = None
    async for out in engine.generate(
        {"prompt_token_ids": prompt}, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id,
        output_kind=OutputKind.FINAL_ONLY,
    ):
        pass
    return out


def test_a_step_that_raises_fails_the_requests_in_it_and_the_engine_serves_on(llama_dir):
    """A step exception stopped the core loop for good: every later request got a 500."""
    import asyncio

    from pagelm.engine.async_llm import AsyncLLM

    loop = asyncio.new_event_loop()
    engine = AsyncLLM.from_model(str(llama_dir), engine_process=False, num_kv_blocks=64, max_model_len=256)
    core = engine.core.core
    launch = core.runner.launch
    injected = []

    def failing_launch(sched, **kwargs):  # fault injection: the step with "boom" in it raises
        if "boom" in sched.num_scheduled_tokens and not injected:
            injected.append(1)
            raise RuntimeError("injected fault")
        return launch(sched, **kwargs)

    core.runner.launch = failing_launch
    try:
        from pagelm.engine.core_output import EngineStepError

        with pytest.raises(EngineStepError, match="the engine step failed: RuntimeError: injected fault"):
            _run(loop, _generate(engine, [5, 6, 7], "boom"))
        assert engine.is_running
        out = _run(loop, _generate(engine, [5, 6, 7], "after"))  # served as if nothing happened
        assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"
        assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks
    finally:
        engine.shutdown()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


def test_a_killed_engine_core_process_is_replaced_and_serving_resumes(llama_dir):
    """After the core process died the API side answered 500/503 forever, with a zombie."""
    import asyncio
    import os
    import signal
    import time

    from pagelm.engine.async_llm import AsyncLLM
    from pagelm.engine.core_client import EngineDeadError

    loop = asyncio.new_event_loop()
    engine = AsyncLLM.from_model(str(llama_dir), num_kv_blocks=64, max_model_len=256)
    try:
        before = _run(loop, _generate(engine, [5, 6, 7], "before"))
        dead = engine.core.proc

        async def kill_mid_request():
            stream = engine.generate(
                {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=240, ignore_eos=True), "in-flight",
                output_kind=OutputKind.DELTA,
            )
            await stream.__anext__()  # running: its first token is out, 239 to go
            os.kill(dead.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            deadline = time.time() + 120
            while not engine.is_running:
                assert time.time() < deadline, "the engine core was not restarted"
                await asyncio.sleep(0.1)

        _run(loop, kill_mid_request())
        assert dead.poll() == -signal.SIGKILL  # reaped, not a zombie
        assert engine.core.proc.pid != dead.pid and engine.num_engine_restarts == 1
        after = _run(loop, _generate(engine, [5, 6, 7], "after"))
        assert after.outputs[0].token_ids == before.outputs[0].token_ids  # greedy, same engine
        assert engine.stat_loggers["prometheus"].engine_restarts._value.get() == 1
    finally:
        engine.shutdown()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
