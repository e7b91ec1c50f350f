"""The async engine: streaming deltas, continuous batching across callers, abort, the engine
core in its own process, and what LLMEngine gives it (parent aborts, stop-string hold-back)."""

import asyncio

import pytest

from pagelm import LLM, SamplingParams
from pagelm.engine.async_llm import AsyncLLM, EngineDeadError
from pagelm.engine.output_processor import OutputKind


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module: the engine's output loop and socket live on it."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(llama_dir, loop):
    """One engine core process for the module."""
    eng = AsyncLLM.from_model(str(llama_dir), num_kv_blocks=128, max_model_len=512)
    yield eng
    eng.shutdown()
    loop.run_until_complete(asyncio.sleep(0))


def run(loop, coro):
    return loop.run_until_complete(coro)


async def collect(engine, prompt, params, request_id, **kw):
    texts, outs = {}, []
    async for out in engine.generate(prompt, params, request_id, **kw):
        outs.append(out)
        for c in out.outputs:
            texts[c.index] = texts.get(c.index, "") + c.text
    return texts, outs


async def wait_all_blocks_free(engine, timeout=10.0):
    for _ in range(int(timeout / 0.02)):
        if engine.stats.num_free_blocks == engine.stats.num_kv_blocks and engine.stats.num_running == 0:
            return True
        await asyncio.sleep(0.02)
    return False


def test_streamed_deltas_add_up_to_the_final_output(engine, loop):
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)

    async def go():
        texts, outs = await collect(engine, "def fib(n):", params, "delta")
        final = [o async for o in engine.generate("def fib(n):", params, "final", output_kind=OutputKind.FINAL_ONLY)]
        return texts, outs, final

    texts, outs, final = run(loop, go())
    assert len(final) == 1 and final[0].finished
    assert texts[0] == final[0].outputs[0].text
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 24
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])


def test_requests_join_a_running_batch(engine, loop):
    """A request added while another streams is served in the same steps (it finishes first)."""
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def go():
        order = []

        async def consume(rid, params):
            async for out in engine.generate("x = 1", params, rid):
                if out.finished:
                    order.append(rid)

        first = asyncio.create_task(consume("long", long))
        await asyncio.sleep(0.05)
        await consume("short", short)
        await first
        return order

    assert run(loop, go()) == ["short", "long"]


def test_n_samples_stream_with_their_indexes(engine, loop):
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=1, ignore_eos=True)
    texts, outs = run(loop, collect(engine, "import os", params, "fan"))
    assert sorted(texts) == [0, 1, 2]
    assert outs[-1].finished and outs[-1].request_id == "fan"
    assert sum(len(c.token_ids) for o in outs for c in o.outputs) == 18


def test_abort_frees_the_blocks_and_ends_the_stream(engine, loop):
    params = SamplingParams(n=2, max_tokens=400, temperature=0, ignore_eos=True)

    async def go():
        seen = []

        async def consume():
            async for out in engine.generate("while True:", params, "doomed"):
                seen.append(out)

        task = asyncio.create_task(consume())
        while len(seen) < 2:
            await asyncio.sleep(0.005)
        assert engine.stats.num_free_blocks < engine.stats.num_kv_blocks
        await engine.abort("doomed")
        await asyncio.wait_for(task, 5)
        freed = await wait_all_blocks_free(engine)
        return seen, freed

    seen, freed = run(loop, go())
    assert freed
    assert not seen[-1].finished
    assert not engine.engine.output_processor.states


def test_leaving_the_stream_early_aborts_the_request(engine, loop):
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    async def go():
        stream = engine.generate("for i in range(10):", params, "walkaway")
        async for _ in stream:
            break
        await stream.aclose()
        return await wait_all_blocks_free(engine)

    assert run(loop, go())
    assert "walkaway" not in engine.engine.output_processor.states


def test_bad_request_raises_and_the_engine_keeps_serving(engine, loop):
    async def go():
        with pytest.raises(ValueError, match="at most 511"):
            async for _ in engine.generate({"prompt_token_ids": [5] * 600}, SamplingParams(), "too-long"):
                pass
        return await collect(engine, "ok", SamplingParams(max_tokens=2, ignore_eos=True), "after")

    texts, outs = run(loop, go())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) <= 2


def test_engine_core_in_a_thread_serves_too(llama_dir):
    eng = AsyncLLM.from_model(str(llama_dir), engine_process=False, num_kv_blocks=64, max_model_len=256)
    try:
        texts, outs = asyncio.run(collect(eng, "abc", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), "t"))
        ref = LLM(str(llama_dir), num_kv_blocks=64, max_model_len=256).generate(
            "abc", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False
        )[0]
        assert texts[0] == ref.outputs[0].text
        assert eng.core.core.kv_cache_manager.num_free_blocks == eng.core.num_kv_blocks
    finally:
        eng.shutdown()


def test_a_dead_engine_core_fails_requests_and_is_reported(llama_dir):
    eng = AsyncLLM.from_model(str(llama_dir), num_kv_blocks=32, max_model_len=256)

    async def go():
        await eng.start()
        stream = eng.generate("x", SamplingParams(max_tokens=200, ignore_eos=True), "victim")
        await stream.__anext__()
        eng.core.proc.kill()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            async for _ in eng.generate("y", SamplingParams(), "late"):
                pass

    try:
        asyncio.run(go())
        assert eng.dead_error is not None
    finally:
        eng.shutdown()


def test_engine_core_start_up_errors_reach_the_caller(llama_dir):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        AsyncLLM.from_model(str(llama_dir), max_model_len=100_000)


# ---- what LLMEngine provides for it --------------------------------------------------------


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), num_kv_blocks=128, max_model_len=512)


def test_aborting_a_parent_id_aborts_all_its_children(llm):
    engine = llm.engine
    engine.add_request("parent", "hello", SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.core.kv_cache_manager.num_free_blocks < engine.core.num_kv_blocks
    engine.abort_request(["parent"])
    engine.step()
    assert not engine.has_unfinished_requests() and not engine.core.has_unfinished_requests()
    assert engine.output_processor.parent_children == {}
    assert engine.core.kv_cache_manager.num_free_blocks == engine.core.num_kv_blocks


def test_delta_stream_holds_back_a_possible_stop_string(llm):
    """A stop string that spans deltas is cut from the stream as from the final text."""
    engine = llm.engine
    base = llm.generate("x = ", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    text = base[0].outputs[0].text
    for start in range(2, 8):
        stop = text[start : start + 4]
        if not stop.strip():
            continue
        params = SamplingParams(temperature=0, max_tokens=20, stop=[stop], ignore_eos=True)
        engine.add_request("s", "x = ", params, output_kind=OutputKind.DELTA)
        streamed = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                streamed += out.outputs[0].text
        assert streamed == text[: text.find(stop)], stop


def test_engine_core_never_waits_on_a_slow_reader_and_loses_no_output():
    """With nobody reading, publish() returns at once; queued outputs merge, in order."""
    import socket

    import msgpack

    from pagelm.engine.core_loop import SchedulerStats, decode_outputs, encode_outputs, encode_stats
    from pagelm.engine.core_output import EngineCoreOutput
    from pagelm.engine.core_proc import MsgSocket

    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    conn = MsgSocket(ours)
    for step in range(2000):  # far more than the socket buffer holds
        conn.publish(encode_outputs([EngineCoreOutput("r", [step])]), encode_stats(SchedulerStats(num_running=step)))
    assert conn._out or conn._outputs  # some are still queued, and publish() did not block
    received, unpacker = [], msgpack.Unpacker()
    theirs.setblocking(False)
    while len(received) < 2000:
        try:
            unpacker.feed(theirs.recv(1 << 16))
        except BlockingIOError:
            conn.recv(block=False)  # the core's loop turns: queued bytes go out
            conn._flush()
            continue
        for kind, outs, stats in unpacker:
            received += [o.new_token_ids[0] for o in decode_outputs(outs)]
    assert received == list(range(2000))
    assert stats[0] == 1999  # the newest stats ride with the merged outputs
    ours.close()
    theirs.close()
