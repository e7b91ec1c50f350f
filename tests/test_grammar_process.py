"""The grammar process (``structured_output_process=True``): a child process mirrors the guided
requests' grammars and fills their bitmask rows. Whatever it does or fails to do, the tokens
are those of the worker thread's engine (seeded sampling), and the engine core takes over
the rows it leaves: requests that arrived before it was ready, preemptions, drafts, and the
process dying mid-run."""

import gc
import re

import pytest
import torch
from transformers import AutoTokenizer

from pagelm import LLM, GuidedDecodingParams, SamplingParams

EOS = 1  # the tiny tokenizer's <|eos|>
# On the CPU also on GPU machines (the GPU path: the last test).
ENGINE_ARGS = dict(
    device="cpu", dtype="float32", block_size=8, async_scheduling=True, plugin_config={"xgrammar": {"any_whitespace": False}}
)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""
SCHEMA = {
    "type": "object",
    "properties": {"s": {"type": "array", "items": {"enum": [1, 2]}, "minItems": 2, "maxItems": 6}, "ok": {"type": "boolean"}},
    "required": ["s", "ok"],
}
CONSTRAINTS = [dict(json=SCHEMA), dict(regex=r"(ab|ba){2,8}c"), dict(choice=["la la la", "no"]), dict(grammar=ARITHMETIC), None]


def workload(n: int = 15, max_tokens: int = 48) -> tuple[list[dict], list[SamplingParams]]:
    """Seeded requests under each kind of constraint and none, prompts of different lengths
    (their prefills end in different steps)."""
    params = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=max_tokens,
            guided_decoding=None if c is None else GuidedDecodingParams(**c),
        )
        for i, c in zip(range(n), CONSTRAINTS * n)
    ]
    prompts = [{"prompt_token_ids": list(range(5, 5 + 2 * i + 1))} for i in range(n)]
    return prompts, params


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def process_llm(model_dir, **kw) -> LLM:
    llm = LLM(str(model_dir), structured_output_process=True, **ENGINE_ARGS, **kw)
    assert llm.engine.core.structured_output.use_grammar_process
    return llm


@pytest.mark.parametrize(
    "device, async_scheduling, setting, want",
    [("cuda", True, None, True), ("cuda", False, None, False), ("cpu", True, None, False),
     ("cuda", True, False, False), ("cpu", False, True, True)],
)
def test_the_grammar_process_is_the_default_on_cuda_with_async_scheduling(llama_dir, device, async_scheduling, setting, want):
    from pagelm import EngineConfig
    from pagelm.plugins.structured_output import GrammarManager
    from pagelm.plugins.structured_output.xgrammar_backend import XgrammarBackend

    config = EngineConfig(model=str(llama_dir), structured_output_process=setting)
    manager = XgrammarBackend.make_manager(
        config, 520, frozenset([EOS]), device=torch.device(device), async_scheduling=async_scheduling
    )
    try:  # nothing starts before the first guided request: no CUDA needed to build it
        assert type(manager) is GrammarManager and manager.backend_cls is XgrammarBackend
        assert (manager.use_grammar_process, manager.pin_memory) == (want, device == "cuda")
    finally:
        manager.shutdown()


@pytest.fixture(scope="module")
def thread(llama_dir):
    llm = LLM(str(llama_dir), structured_output_process=False, **ENGINE_ARGS)
    assert not llm.engine.core.structured_output.use_grammar_process
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def process(llama_dir):
    llm = process_llm(llama_dir)
    assert llm.engine.core.structured_output.wait_for_grammar_process(120)
    yield llm
    llm.engine.shutdown()


def test_the_process_fills_the_rows_and_the_tokens_are_the_worker_threads(thread, process):
    prompts, params = workload()
    manager = process.engine.core.structured_output
    before = manager.rows_filled_by_process
    want = thread.generate(prompts, params, use_tqdm=False)
    got = process.generate(prompts, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    assert {o.outputs[0].finish_reason for o in got} <= {"stop", "length"}
    assert re.fullmatch(r"(ab|ba){2,8}c", got[1].outputs[0].text) and got[2].outputs[0].text in ("la la la", "no")
    # Nearly every guided row came from the process: the first row of each request is filled
    # where its grammar was compiled (here), and so may a few while the process compiles.
    guided_rows = sum(len(o.outputs[0].token_ids) for o, p in zip(got, params) if p.guided_decoding)
    assert manager.rows_filled_by_process - before > guided_rows // 2
    assert not manager._lag  # released with their requests


def test_requests_that_arrive_before_the_process_is_ready_stay_with_the_engine_core(llama_dir, thread):
    prompts, params = workload()
    want = token_ids(thread.generate(prompts, params, use_tqdm=False))
    llm = process_llm(llama_dir)
    try:
        manager = llm.engine.core.structured_output
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == want  # started by them
        assert manager.wait_for_grammar_process(120)
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == want
        assert manager.rows_filled_by_process > 0
    finally:
        llm.engine.shutdown()


def test_a_process_that_dies_mid_run_is_taken_over_by_the_engine_core(llama_dir, thread, monkeypatch, caplog):
    prompts, params = workload()
    want = token_ids(thread.generate(prompts, params, use_tqdm=False))
    llm = process_llm(llama_dir)
    try:
        manager = llm.engine.core.structured_output
        assert manager.wait_for_grammar_process(120)
        prepare, steps = manager.prepare_bitmask, []

        def kill_on_the_tenth_step():
            steps.append(1)
            if len(steps) == 10:
                manager._process._proc.kill()
                manager._process._proc.wait()
            prepare()

        monkeypatch.setattr(manager, "prepare_bitmask", kill_on_the_tenth_step)
        with caplog.at_level("WARNING", logger="pagelm"):
            assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == want
        assert 0 < manager.rows_filled_by_process and not manager._process.alive
        assert "the grammar process stopped" in caplog.text
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == want  # all here now
    finally:
        llm.engine.shutdown()


def test_the_same_tokens_under_preemption(llama_dir):
    # 12 blocks x 8 = 96 slots for 15 requests of up to ~80 tokens: constant preemption, and
    # the requests coming back are rows out of the process's order.
    prompts, params = workload()
    kw = dict(num_kv_blocks=12, max_model_len=96)
    thread = LLM(str(llama_dir), structured_output_process=False, **ENGINE_ARGS, **kw)
    want = token_ids(thread.generate(prompts, params, use_tqdm=False))
    thread.engine.shutdown()
    llm = process_llm(llama_dir, **kw)
    try:
        core = llm.engine.core
        assert core.structured_output.wait_for_grammar_process(120)
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == want
        assert core.scheduler.num_preemptions > 0 and core.structured_output.rows_filled_by_process > 0
        assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks, "KV blocks leaked"
    finally:
        llm.engine.shutdown()


def test_guided_requests_with_ngram_drafts_give_the_tokens_of_the_worker_thread(llama_dir):
    # Drafts are checked and their rows filled by the engine core's grammars (caught up with
    # the process first); the process fills the next-token rows.
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    prompts = [{"prompt_token_ids": tokenizer.encode("abbaab" * 4)}, {"prompt_token_ids": [5, 6, 7]}] * 4
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=64, guided_decoding=GuidedDecodingParams(regex=r"(ab|ba){2,20}c"))
        for i in range(8)
    ]
    kw = dict(speculative_config=NGRAM)
    thread = LLM(str(llama_dir), structured_output_process=False, **ENGINE_ARGS, **kw)
    want = thread.generate(prompts, params, use_tqdm=False)
    thread.engine.shutdown()
    llm = process_llm(llama_dir, **kw)
    try:
        assert llm.engine.core.structured_output.wait_for_grammar_process(120)
        got = llm.generate(prompts, params, use_tqdm=False)
        assert token_ids(got) == token_ids(want)
        assert sum(o.metrics.spec_num_accepted_tokens for o in got) > 0
        assert llm.engine.core.structured_output.rows_filled_by_process > 0
    finally:
        llm.engine.shutdown()


def test_the_mirror_holds_tokens_while_it_compiles_and_leaves_a_grammar_that_failed(llama_dir):
    # The process's side, in this process: both compile workers held busy, so the compile is
    # still queued when the first tokens come (the row is left, the tokens kept for later).
    import threading

    from pagelm import EngineConfig
    from pagelm.plugins.structured_output.xgrammar_backend import XgrammarBackend
    from pagelm.sample.bitmask import unpack_bitmask
    from pagelm.plugins.structured_output.grammar_process import _COMPILE_WORKERS, _Mirror

    vocab = 520
    config = EngineConfig(model=str(llama_dir), **{k: v for k, v in ENGINE_ARGS.items() if k != "device"})
    backend = XgrammarBackend(config, AutoTokenizer.from_pretrained(llama_dir), vocab, frozenset([EOS]))
    bitmask = torch.zeros(4, (vocab + 31) // 32, dtype=torch.int32)
    mirror = _Mirror(backend, 1 << 30, bitmask)
    held = threading.Event()
    for _ in range(_COMPILE_WORKERS):
        mirror.pool.submit(held.wait)
    regex = GuidedDecodingParams(regex="[a-c]{2}x[0-9]{3}")
    mirror.add(7, regex)
    mirror.add(8, GuidedDecodingParams(regex="[a-c]{2}(x"))  # does not compile
    tokens = AutoTokenizer.from_pretrained(llama_dir).encode("abx12")
    assert mirror.step([7, 8, -1], [tokens[:2], tokens[:2], [5]]) == ([0, 1, 2], [])  # all left
    held.set()
    for future in list(mirror.compiles.values()):
        future.exception()  # wait
    assert mirror.step([7, 8], [tokens[2:], tokens[2:]]) == ([1], [])  # 7 caught up; 8 out of step
    reference = backend.compile(regex).new_grammar()
    assert reference.accept_tokens(tokens)
    want = torch.zeros(1, bitmask.shape[1], dtype=torch.int32)
    reference.fill_bitmask(want, 0)
    assert torch.equal(unpack_bitmask(bitmask[:1], vocab), unpack_bitmask(want, vocab))
    assert mirror.step([7], [[EOS]]) == ([], [0])  # a token its grammar rejects
    mirror.release(7)
    assert mirror.step([7], [[5]]) == ([0], [])
    mirror.pool.shutdown()


@pytest.mark.gpu
def test_on_cuda_the_process_is_the_default_and_gives_the_worker_threads_tokens(llama_dir):
    # CUDA + async scheduling: the process fills a pinned bitmask. Engines dropped without a
    # shutdown unpin it first: a stale registration made later pinned allocations fail.
    prompts, params = workload()
    args = dict(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, plugin_config=ENGINE_ARGS["plugin_config"])
    thread = LLM(str(llama_dir), structured_output_process=False, **args)
    want = token_ids(thread.generate(prompts, params, use_tqdm=False))
    thread.engine.shutdown()
    del thread  # each engine sizes its KV pool from what is free
    gc.collect()
    torch.cuda.empty_cache()
    for _ in range(2):
        llm = LLM(str(llama_dir), **args)
        manager = llm.engine.core.structured_output
        assert llm.engine.core.async_scheduling and manager.use_grammar_process
        assert manager.wait_for_grammar_process(120) and manager._process.bitmask.is_pinned()
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == want
        assert manager.rows_filled_by_process > 0
        del llm, manager  # no shutdown
        gc.collect()
        torch.cuda.empty_cache()
        torch.empty(1 << 20, pin_memory=True)  # a pinned allocation after the drop
