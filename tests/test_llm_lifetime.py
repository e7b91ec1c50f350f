"""``LLM.shutdown()`` and ``with LLM(...) as llm:`` fire the shutdown hook exactly once, and an
LLM that was shut down refuses new work with a clear error."""

import pytest

from pagelm import LLM, SamplingParams, hookimpl
from pagelm.plugin_manager import get_plugin_manager

PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


class CountsShutdowns:
    def __init__(self):
        self.count = 0

    @hookimpl
    def pagelm_engine_shutdown(self, engine):
        self.count += 1


@pytest.fixture
def counter():
    plugin = CountsShutdowns()
    get_plugin_manager().register(plugin, name="test-counts-shutdowns")
    yield plugin
    get_plugin_manager().unregister("test-counts-shutdowns")


def test_context_manager_shuts_down_once(llama_dir, counter):
    with LLM(str(llama_dir), dtype="float32", device="cpu") as llm:
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], PARAMS, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
        assert counter.count == 0
    assert counter.count == 1


def test_shutdown_twice_fires_the_hook_once_and_generate_then_refuses(llama_dir, counter):
    llm = LLM(str(llama_dir), dtype="float32", device="cpu")
    llm.shutdown()
    llm.shutdown()
    assert counter.count == 1
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], PARAMS, use_tqdm=False)
