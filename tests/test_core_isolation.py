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
