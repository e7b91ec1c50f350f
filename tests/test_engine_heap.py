"""An in-process async engine freezes the garbage collector's heap at start-up (so the serving
loop's full collections skip the start-up objects) and thaws it at shutdown: frozen objects in
reference cycles are never collected, so a process that starts and stops engines (a notebook,
a test suite, a server that reloads) would keep every stopped engine's cyclic garbage, and
the objects of everything it did before, out of the collector's reach for good."""

import asyncio
import gc

import pytest

from pagelm import SamplingParams
from pagelm.engine import core_loop
from pagelm.engine.async_llm import AsyncLLM


@pytest.fixture
def thawed(monkeypatch):
    """Start from no frozen heap (another module's engine may have frozen it)."""
    gc.unfreeze()
    monkeypatch.setattr(core_loop, "_num_frozen_heaps", 0)
    yield
    gc.unfreeze()


async def serve(engine, request_id="r"):
    async for out in engine.generate("abc", SamplingParams(max_tokens=3, ignore_eos=True), request_id):
        last = out
    return last


def test_a_shut_down_engine_thaws_the_heap(llama_dir, thawed):
    engine = AsyncLLM.from_model(str(llama_dir), engine_process=False, num_kv_blocks=32, max_model_len=256)
    assert asyncio.run(serve(engine)).finished
    assert gc.get_freeze_count() > 0
    engine.shutdown()
    engine.shutdown()  # idempotent: thaws once
    assert gc.get_freeze_count() == 0 and core_loop._num_frozen_heaps == 0


def test_the_heap_stays_frozen_while_another_engine_serves(llama_dir, thawed):
    first = AsyncLLM.from_model(str(llama_dir), engine_process=False, num_kv_blocks=32, max_model_len=256)
    second = AsyncLLM.from_model(str(llama_dir), engine_process=False, num_kv_blocks=32, max_model_len=256)

    async def go():  # one event loop: each engine's output loop lives on it
        await serve(first)
        await serve(second)
        first.shutdown()
        assert gc.get_freeze_count() > 0 and core_loop._num_frozen_heaps == 1
        return await serve(second, "after")

    try:
        assert asyncio.run(go()).finished
    finally:
        first.shutdown()
        second.shutdown()
    assert gc.get_freeze_count() == 0 and core_loop._num_frozen_heaps == 0
