"""Faults under tensor and pipeline parallelism: a rank that raises or dies is named, the
requests in flight get that error instead of hanging, the engine is reported dead (the
server's /health turns 503 on ``dead_error``) and ``AsyncLLM`` comes back with fresh ranks."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from pagelm import LLM, SamplingParams
from pagelm.engine.async_llm import AsyncLLM
from pagelm.engine.core_client import EngineDeadError
from pagelm.worker.worker import pack

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPT = {"prompt_token_ids": [3, 4, 5, 6, 7]}


def test_a_rank_that_raises_is_named_by_llm(llama_dir):
    with LLM(str(llama_dir), dtype="float32", pipeline_parallel_size=2, distributed_timeout=20) as llm:
        # Rank 1 gets a message it does not know: its worker loop raises and the rank exits.
        llm.engine.core.executor.send(pack("no-such-message"))
        llm.engine.core.executor._procs[0].join(20)
        with pytest.raises(RuntimeError, match=r"rank 1 \(tensor-parallel rank 0 of pipeline stage 1\) is not running \(exit code 1\)"):
            llm.generate(PROMPT, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("kw", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_a_rank_killed_mid_stream_fails_the_request_and_the_engine_comes_back(llama_dir, kw):
    engine = AsyncLLM.from_model(str(llama_dir), engine_process=False, dtype="float32", distributed_timeout=20, **kw)
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def main():
        received, start = 0, None
        with pytest.raises(EngineDeadError, match=r"rank 1 \(tensor-parallel rank \d of pipeline stage \d\) is not running"):
            async for out in engine.generate(PROMPT, long, "victim"):
                received += len(out.outputs[0].token_ids)
                if start is None:  # the first tokens are out: kill rank 1 mid-generation
                    (proc,) = engine.core.core.executor._procs
                    os.kill(proc.pid, signal.SIGKILL)
                    start = time.monotonic()
        assert time.monotonic() - start < 20 and received < 400
        assert engine.dead_error is not None  # /health: 503
        while engine.dead_error is not None:  # restarting: a fresh core with fresh ranks
            await asyncio.sleep(0.2)
        ids = []
        async for out in engine.generate(PROMPT, GREEDY, "after"):
            ids += out.outputs[0].token_ids
        return ids

    loop = asyncio.new_event_loop()
    try:
        ids = loop.run_until_complete(asyncio.wait_for(main(), 180))
    finally:
        engine.shutdown()
        loop.close()
    assert len(ids) == 10 and engine.num_engine_restarts == 1
