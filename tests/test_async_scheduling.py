"""Async scheduling: step N is scheduled and launched before step N-1 is finished. It changes
when the host works, never which tokens come out: every run here is compared with the same
engine run synchronously (``async_scheduling=True`` forces it on the CPU)."""

import argparse
import asyncio
import json
import re
import shutil

import pytest
import torch

from pagelm import LLM, GuidedDecodingParams, SamplingParams, hookimpl
from pagelm.config import EngineConfig
from pagelm.engine.async_llm import AsyncLLM
from pagelm.engine.output_processor import OutputKind
from pagelm.kv_cache import KVCacheManager, make_block_hasher
from pagelm.plugin_manager import get_plugin_manager
from pagelm.plugins.bench.latency import reject_all_drafts
from pagelm.plugins.engine_args import add_engine_args, engine_kwargs
from pagelm.plugins.policies.fcfs import FCFSPolicy
from pagelm.plugins.spec_decode.eagle_train import EagleTrainConfig, train_eagle_head
from pagelm.plugins.spec_decode.ngram import NgramProposer
from pagelm.request import Request, RequestStatus
from pagelm.sched.scheduler import Scheduler
from pagelm.plugins.spec_decode import DraftProposer
from pagelm.spec_decode import DeviceDrafts
from pagelm.worker.output import ModelRunnerOutput
from spec_helpers import count_launches, registered_proposer


def prompts_for(vocab_size, n=10, seed=3):
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(5, vocab_size, (24,), generator=gen).tolist()
    out = []
    for i in range(n):
        tail = torch.randint(5, vocab_size, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen)
        out.append({"prompt_token_ids": (shared if i % 3 == 0 else []) + tail.tolist()})  # prefix-cache hits
    return out


def mixed_params(n=10):
    """Greedy and seeded random requests, with max_tokens from 1 to 28."""
    return [
        SamplingParams(temperature=0.0, max_tokens=1 + 3 * i, ignore_eos=True)
        if i % 2
        else SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=1 + 3 * i, ignore_eos=True)
        for i in range(n)
    ]


def generate(model_dir, prompts, params, **kw):
    llm = LLM(str(model_dir), dtype="float32", block_size=8, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    core = llm.engine.core
    assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks, "KV blocks leaked"
    return [[c.token_ids for c in o.outputs] for o in outs], core


def generate_both(model_dir, prompts, params, **kw):
    sync, _ = generate(model_dir, prompts, params, async_scheduling=False, **kw)
    run_ahead, core = generate(model_dir, prompts, params, async_scheduling=True, **kw)
    assert core.async_scheduling
    return sync, run_ahead, core


@pytest.fixture(scope="module")
def prompts(llama_dir):
    from transformers import AutoConfig

    return prompts_for(AutoConfig.from_pretrained(llama_dir).vocab_size)


# ---- same tokens as the synchronous engine --------------------------------------------------
@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 7},  # chunked prefill
        {"enable_prefix_caching": False},
        {"max_num_seqs": 3},
        {"long_prefill_token_threshold": 5, "max_num_partial_prefills": 2},
    ],
    ids=["default", "chunked", "no-prefix-cache", "max-3-seqs", "partial-prefills"],
)
def test_async_gives_the_same_tokens_greedy_and_seeded(llama_dir, prompts, engine_args):
    sync, run_ahead, core = generate_both(llama_dir, prompts, mixed_params(), **engine_args)
    assert run_ahead == sync
    # Every request ends on max_tokens, which the scheduler sees coming: nothing is wasted.
    assert core.scheduler.num_discarded_tokens == 0


def test_async_gives_the_same_tokens_under_preemption(llama_dir, prompts):
    # 12 blocks x 8 = 96 slots for 10 requests of up to ~80 tokens: constant preemption, also
    # of requests whose step is in flight.
    sync, run_ahead, core = generate_both(llama_dir, prompts, mixed_params(), num_kv_blocks=12, max_model_len=96)
    assert run_ahead == sync
    assert core.scheduler.num_preemptions > 0


def test_async_gives_the_same_seeded_samples_for_n3(llama_dir, prompts):
    params = SamplingParams(n=3, temperature=1.0, top_k=40, seed=1234, max_tokens=12, ignore_eos=True)
    sync, run_ahead, _ = generate_both(llama_dir, prompts[:4], params, max_num_batched_tokens=16)
    assert run_ahead == sync
    assert all(len(set(map(tuple, samples))) > 1 for samples in run_ahead), "the 3 samples should differ"


def test_stop_tokens_mid_run_discard_at_most_one_token_each(llama_dir, prompts):
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    full, _ = generate(llama_dir, prompts, greedy)
    # Each request stops on the token it would sample 4th (or later, where it repeats).
    params = [SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[f[0][3]]) for f in full]
    sync, run_ahead, core = generate_both(llama_dir, prompts, params)
    assert run_ahead == sync
    assert all(len(r[0]) < 20 for r in run_ahead)
    # The step scheduled while a stopping token was in flight computes one token that is
    # never emitted; no more than that per request.
    assert 0 < core.scheduler.num_discarded_tokens <= len(prompts)


def test_eos_mid_run_gives_the_same_tokens(llama_dir, prompts, tmp_path):
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    full, _ = generate(llama_dir, prompts, greedy)
    eos = full[0][0][2]  # a token the first request samples third
    model_dir = shutil.copytree(llama_dir, tmp_path / "llama_eos")
    gen_config = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**gen_config, "eos_token_id": eos}))
    # min_tokens counts the outputs before a token, the one in flight included.
    params = [SamplingParams(temperature=0.0, max_tokens=16, min_tokens=4 * (i % 2)) for i in range(len(prompts))]
    sync, run_ahead, _ = generate_both(model_dir, prompts, params, num_kv_blocks=12, max_model_len=96)
    assert run_ahead == sync
    assert run_ahead[0][0] == full[0][0][: full[0][0].index(eos) + 1]


def test_logprobs_and_prompt_logprobs_arrive_with_their_tokens(llama_dir, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, prompt_logprobs=1, ignore_eos=True)

    def run(async_scheduling):
        llm = LLM(str(llama_dir), dtype="float32", block_size=8, max_num_batched_tokens=16,
                  async_scheduling=async_scheduling)
        return llm.generate(prompts[:4], params, use_tqdm=False)

    for a, b in zip(run(False), run(True)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids)
        for x, y in zip(a.prompt_logprobs[1:] + a.outputs[0].logprobs, b.prompt_logprobs[1:] + b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            assert all(x[t].logprob == pytest.approx(y[t].logprob, abs=1e-5) for t in x)


# ---- steps that need the previous token on the host ---------------------------------------
def test_penalties_run_synchronously_next_to_plain_requests(llama_dir, prompts):
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    penalised = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3,
                               presence_penalty=0.5, frequency_penalty=0.4)
    params = [penalised if i == 2 else plain for i in range(6)]
    sync, _ = generate(llama_dir, prompts[:6], params, async_scheduling=False)

    llm = LLM(str(llama_dir), dtype="float32", block_size=8, async_scheduling=True)
    core = llm.engine.core
    launches = []  # (request ids of the step, whether a step was in flight at its launch)
    launch = core.runner.launch

    def spy(sched, **kwargs):
        launches.append((set(sched.num_scheduled_tokens), core._in_flight is not None))
        return launch(sched, **kwargs)

    core.runner.launch = spy
    outs = llm.generate(prompts[:6], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == sync
    penalised_id = outs[2].request_id
    with_it = [in_flight for req_ids, in_flight in launches if penalised_id in req_ids]
    without_it = [in_flight for req_ids, in_flight in launches if req_ids and penalised_id not in req_ids]
    assert with_it and not any(with_it), "a step with penalties ran ahead of the one in flight"
    assert any(without_it), "the plain requests' steps should run ahead once the penalised one is done"


def test_guided_requests_run_ahead_sampling_after_the_previous_step_and_follow_their_grammar(llama_dir):
    """A step with guided requests queues its forward pass while the previous step is in
    flight, and samples once that step's tokens advanced the grammars: the same tokens as the
    synchronous engine. The regex completes early, so a finished request is still in the
    step launched after its last token (its bitmask row allows anything; its sample is
    discarded)."""
    pattern = r"[0-9]{3}-[a-z]{2}"
    guided = SamplingParams(temperature=1.0, seed=5, max_tokens=32, guided_decoding=GuidedDecodingParams(regex=pattern))
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 9, 11]} for i in range(4)]
    outs, guided_launches = {}, []
    for async_scheduling in (False, True):
        llm = LLM(str(llama_dir), dtype="float32", async_scheduling=async_scheduling,
                  plugin_config={"xgrammar": {"any_whitespace": False}})
        core = llm.engine.core
        launch = core.runner.launch

        def spy(sched, **kwargs):
            if sched.structured_output_request_ids:
                guided_launches.append((async_scheduling, core._in_flight is not None, kwargs.get("defer_sampling", False)))
            return launch(sched, **kwargs)

        core.runner.launch = spy
        outs[async_scheduling] = llm.generate(prompts, [guided, plain, guided, plain], use_tqdm=False)
        assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks
    assert [o.outputs[0].token_ids for o in outs[True]] == [o.outputs[0].token_ids for o in outs[False]]
    assert all(re.fullmatch(pattern, outs[True][i].outputs[0].text) for i in (0, 2))
    async_launches = [(ahead, deferred) for a, ahead, deferred in guided_launches if a]
    assert any(ahead and deferred for ahead, deferred in async_launches)
    assert not any(deferred for a, _, deferred in guided_launches if not a)


NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


class EveryStep(DraftProposer):
    """A proposer that must see every step (as a draft model does): never drafts."""

    name = "every_step"

    def propose(self, batch):
        return [[] for _ in range(batch.num_reqs)]


@pytest.fixture()
def every_step():
    with registered_proposer(EveryStep):
        yield


def test_async_scheduling_by_default_follows_cuda_graphs_and_the_proposer(llama_dir, every_step):
    plain = LLM(str(llama_dir), dtype="float32").engine.core
    speculative = LLM(str(llama_dir), dtype="float32", speculative_config=NGRAM).engine.core
    assert not plain.async_scheduling and not speculative.async_scheduling  # CPU: no graphs
    assert plain._use_async_scheduling(True, None)
    assert speculative._use_async_scheduling(True, NgramProposer)
    assert not speculative._use_async_scheduling(True, EveryStep)
    assert EngineConfig(model="unused", async_scheduling=True, speculative_config=NGRAM)


def test_async_scheduling_with_a_proposer_that_needs_every_step_is_an_error(llama_dir, every_step):
    spec = {"method": "every_step", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="async_scheduling=True is not supported with speculative_config.method='every_step'"):
        LLM(str(llama_dir), dtype="float32", async_scheduling=True, speculative_config=spec)
    assert not LLM(str(llama_dir), dtype="float32", speculative_config=spec).engine.core.async_scheduling


def speculative_prompts(vocab_size):
    """Repetitive prompts (n-gram drafts get accepted) and random ones (drafts rejected)."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for i in range(8):
        if i % 2:
            block = torch.randint(5, vocab_size, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen)
            out.append({"prompt_token_ids": block.tolist() * 6})
        else:
            out.append({"prompt_token_ids": torch.randint(5, vocab_size, (20 + i,), generator=gen).tolist()})
    return out


def speculative_run(model_dir, prompts, params, async_scheduling, reject_all=False, **kw):
    """Token ids and per-request draft counts, and how many launches ran ahead of the step
    before them and how many steps verified drafts."""
    llm = LLM(str(model_dir), dtype="float32", block_size=8, async_scheduling=async_scheduling, **kw)
    core = llm.engine.core
    if reject_all:
        reject_all_drafts(llm, core.vocab_size)
    counts = count_launches(core)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks, "KV blocks leaked"
    counts["preemptions"] = core.scheduler.num_preemptions
    tokens = [o.outputs[0].token_ids for o in outs]
    drafts = [(o.metrics.spec_num_draft_tokens, o.metrics.spec_num_accepted_tokens) for o in outs]
    return tokens, drafts, counts


@pytest.mark.parametrize("reject_all", [False, True])
def test_speculative_engine_runs_ahead_where_nobody_drafts_with_the_same_outputs_and_drafts(llama_dir, reject_all):
    """Steps in which adaptive drafting has backed every request off run ahead; the others
    (drafts to verify, or a proposal due) run synchronously. The drafts, their verification
    and the tokens are those of the synchronous engine."""
    prompts = speculative_prompts(256)
    params = mixed_params(len(prompts))
    params = [SamplingParams(**{**p.__dict__, "max_tokens": 40 + 3 * i}) for i, p in enumerate(params)]
    spec = {**NGRAM, "max_backoff_steps": 8}
    kw = dict(speculative_config=spec, enable_prefix_caching=True, max_num_batched_tokens=64, reject_all=reject_all)
    want, want_drafts, sync_counts = speculative_run(llama_dir, prompts, params, False, **kw)
    got, got_drafts, counts = speculative_run(llama_dir, prompts, params, True, **kw)
    assert got == want
    assert got_drafts == want_drafts
    assert counts["verify"] == sync_counts["verify"] > 0
    assert sync_counts["ahead"] == 0 and counts["ahead"] > 0.3 * max(p.max_tokens for p in params)
    if not reject_all:
        assert sum(accepted for _, accepted in got_drafts) > 0


def test_speculative_engine_runs_ahead_through_preemption(llama_dir):
    prompts = speculative_prompts(256)
    params = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)] * len(prompts)
    kw = dict(speculative_config={**NGRAM, "max_backoff_steps": 4}, num_kv_blocks=24, max_model_len=128, reject_all=True)
    want, _, _ = speculative_run(llama_dir, prompts, params, False, **kw)
    got, _, counts = speculative_run(llama_dir, prompts, params, True, **kw)
    assert got == want
    assert counts["ahead"] > 0 and counts["preemptions"] > 0


def recorded_proposals(proposer) -> dict[tuple[str, int], list[int]]:
    """Wrap ``proposer.propose`` to record, from now on, each request's drafts by (request,
    tokens known when proposed). Returns the live record."""
    seen: dict[tuple[str, int], list[int]] = {}
    propose = proposer.propose

    def recording(batch):
        drafts = propose(batch)
        lists = drafts.tolist() if isinstance(drafts, DeviceDrafts) else drafts
        for req_id, num_tokens, d in zip(batch.req_ids, batch.num_tokens.tolist(), lists):
            if d:
                seen[(req_id, num_tokens)] = list(d)
        return drafts

    proposer.propose = recording
    return seen


def test_eagle_runs_ahead_where_nobody_drafts_and_keeps_its_kv_cache_in_step(llama_dir, tmp_path):
    """With every request backed off, EAGLE's engine runs steps ahead; the head still writes
    its KV for those steps (their target pass comes with them), so every later proposal (the
    probes) drafts what the synchronous engine's does, and the tokens are the same."""
    train_eagle_head(llama_dir, tmp_path / "head", EagleTrainConfig(steps=0), log=lambda *_: None)
    spec = {"method": "eagle", "num_speculative_tokens": 3, "model": str(tmp_path / "head"), "max_backoff_steps": 8}
    prompts = speculative_prompts(256)
    params = [SamplingParams(temperature=0.0, max_tokens=40 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    runs = {}
    for async_scheduling in (False, True):
        llm = LLM(str(llama_dir), dtype="float32", block_size=8, async_scheduling=async_scheduling,
                  max_num_batched_tokens=64, speculative_config=spec)
        core = llm.engine.core
        proposals = recorded_proposals(core.runner.spec.proposer)
        reject_all_drafts(llm, core.vocab_size)  # every request backs off: steps run ahead
        counts = count_launches(core)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks, "KV blocks leaked"
        runs[async_scheduling] = tokens, proposals, counts
    (want, want_proposals, sync_counts), (got, got_proposals, counts) = runs[False], runs[True]
    assert got == want
    assert got_proposals == want_proposals and len(want_proposals) > 2 * len(prompts)
    assert counts["verify"] == sync_counts["verify"] > 0
    assert sync_counts["ahead"] == 0 and counts["ahead"] > 0.3 * max(p.max_tokens for p in params)


def test_eagle_may_run_ahead_by_default(llama_dir):
    from pagelm.plugins.spec_decode.eagle import EagleProposer

    speculative = LLM(str(llama_dir), dtype="float32", speculative_config=NGRAM).engine.core
    assert speculative._use_async_scheduling(True, EagleProposer)


class FinishedRecorder:
    def __init__(self):
        self.finished = []

    @hookimpl
    def pagelm_request_finished(self, request, reason):
        self.finished.append((request.request_id, reason))


def test_metrics_and_finished_hooks_with_async_scheduling(llama_dir, prompts):
    recorder = FinishedRecorder()
    get_plugin_manager().register(recorder, name="test-async-finished")
    try:
        llm = LLM(str(llama_dir), dtype="float32", block_size=8, async_scheduling=True)
        params = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * 3
        outs = llm.generate(prompts[:3], params, use_tqdm=False)
    finally:
        get_plugin_manager().unregister(name="test-async-finished")
    assert sorted(recorder.finished) == [(o.request_id, "length") for o in outs]
    for out in outs:
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_async_scheduling_flag_on_the_command_line():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--async-scheduling"])) == {"async_scheduling": True}
    assert engine_kwargs(parser.parse_args(["--no-async-scheduling"])) == {"async_scheduling": False}
    assert "async_scheduling" not in engine_kwargs(parser.parse_args([]))


# ---- the loop's order ----------------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_step_launches_the_next_step_before_finishing_the_previous(llama_dir, async_scheduling):
    llm = LLM(str(llama_dir), dtype="float32", block_size=8, async_scheduling=async_scheduling)
    core = llm.engine.core
    events, steps = [], []  # steps: the scheduler outputs launched, numbered in order
    launch, update = core.runner.launch, core.scheduler.update_from_output

    def number(sched):
        return next((n for n, s in enumerate(steps) if s is sched), None)

    def spy_launch(sched, **kwargs):
        if not sched.is_empty:
            steps.append(sched)
            events.append(("launch", number(sched)))
        return launch(sched, **kwargs)

    def spy_update(sched, runner_out):
        if number(sched) is not None:
            events.append(("update", number(sched)))
        return update(sched, runner_out)

    core.runner.launch, core.scheduler.update_from_output = spy_launch, spy_update
    out = llm.generate({"prompt_token_ids": list(range(10, 30))}, SamplingParams(max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    assert len(steps) == 8  # a prefill and 7 decodes
    at = {event: i for i, event in enumerate(events)}
    next_launched_first = [at[("launch", n + 1)] < at[("update", n)] for n in range(len(steps) - 1)]
    assert next_launched_first == [async_scheduling] * (len(steps) - 1)


def test_has_unfinished_requests_while_a_step_is_in_flight(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", block_size=8, async_scheduling=True)
    engine, core = llm.engine, llm.engine.core
    engine.add_request("a", {"prompt_token_ids": list(range(10, 20))}, SamplingParams(max_tokens=1))
    assert core.step() == []  # the prefill is launched; nothing is finished yet
    core.abort_requests(["a"])
    assert not core.scheduler.has_unfinished_requests()
    assert core.has_unfinished_requests()  # its step is still in flight
    assert core.step() == []  # drained: an aborted request's token is never emitted
    assert not core.has_unfinished_requests()
    assert core.scheduler.num_discarded_tokens == 10
    assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks


# ---- aborts mid-run ------------------------------------------------------------------------
def test_aborts_mid_run_lose_and_repeat_no_token(llama_dir, prompts):
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    full, _ = generate(llama_dir, prompts, greedy)
    llm = LLM(str(llama_dir), dtype="float32", block_size=8, async_scheduling=True, num_kv_blocks=16,
              max_model_len=96)
    engine, core = llm.engine, llm.engine.core
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy, output_kind=OutputKind.DELTA)
    streamed = {str(i): [] for i in range(len(prompts))}
    num_steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed[out.request_id].extend(out.outputs[0].token_ids)
        num_steps += 1
        if num_steps in (4, 9):
            engine.abort_request([str(num_steps % 7), str(num_steps % 7 + 3)])  # "4", "7"; "2", "5"
    while core.has_unfinished_requests():
        core.step()
    aborted = {"4", "7", "2", "5"}
    for req_id, tokens in streamed.items():
        expected = full[int(req_id)][0]
        if req_id in aborted:
            assert tokens == expected[: len(tokens)] and len(tokens) < len(expected)
        else:
            assert tokens == expected
    assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks


def test_async_llm_abort_with_async_scheduling_frees_every_block(llama_dir):
    params = SamplingParams(n=2, max_tokens=300, temperature=0, ignore_eos=True)

    async def go():
        engine = AsyncLLM.from_model(str(llama_dir), engine_process=False, num_kv_blocks=64, max_model_len=512,
                                     async_scheduling=True)
        try:
            seen = []

            async def consume():
                async for out in engine.generate("while True:", params, "doomed"):
                    seen.append(out)

            task = asyncio.create_task(consume())
            while len(seen) < 3:
                await asyncio.sleep(0.005)
            await engine.abort("doomed")
            await asyncio.wait_for(task, 5)
            for _ in range(500):
                stats = engine.stats
                if stats.num_free_blocks == stats.num_kv_blocks and stats.num_running == 0:
                    break
                await asyncio.sleep(0.01)
            kept = [o async for o in engine.generate("x", SamplingParams(max_tokens=5, temperature=0), "after")]
            return seen, engine.stats, kept
        finally:
            engine.shutdown()

    seen, stats, kept = asyncio.run(go())
    assert not seen[-1].finished
    assert stats.num_free_blocks == stats.num_kv_blocks
    assert kept[-1].finished and sum(len(o.outputs[0].token_ids) for o in kept) == 5  # streamed deltas


# ---- the scheduler's placeholders ----------------------------------------------------------
BS = 4


def make_scheduler(num_blocks=64):
    config = EngineConfig(model="unused", block_size=BS)
    return Scheduler(config, KVCacheManager(num_blocks, BS, True), FCFSPolicy(config), max_model_len=1024)


def make_request(req_id, n_prompt, max_tokens=8, base=0, eos=frozenset()):
    params = SamplingParams(max_tokens=max_tokens)
    return Request(req_id, list(range(base, base + n_prompt)), params, eos_token_ids=eos,
                   block_hasher=make_block_hasher(BS))


def runner_output(out, tokens):
    """``tokens[req_id]`` for requests whose step reached their end (the runner's rule)."""
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(ids, [[tokens[r]] if r in tokens else [] for r in ids])


def test_an_in_flight_decode_is_scheduled_its_pending_token():
    sched = make_scheduler()
    req = make_request("a", 6)
    sched.add_request(req)
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"a": 6} and req.num_output_placeholders == 1
    second = sched.schedule()  # before the first step's token is known
    assert second.num_scheduled_tokens == {"a": 1}
    assert second.scheduled_cached_reqs[0].num_computed_tokens == 6  # its input: the pending token
    assert req.num_output_placeholders == 2
    sched.update_from_output(first, runner_output(first, {"a": 42}))
    assert req.output_token_ids == [42] and req.num_output_placeholders == 1
    sched.update_from_output(second, runner_output(second, {"a": 43}))
    assert req.output_token_ids == [42, 43] and req.num_output_placeholders == 0
    assert req.num_computed_tokens == 7  # the KV of 43 comes with the next step


def test_placeholders_never_schedule_past_max_tokens():
    sched = make_scheduler()
    req = make_request("a", 5, max_tokens=2)
    sched.add_request(req)
    first = sched.schedule()
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"a": 1}
    assert sched.schedule().is_empty  # two tokens in flight: max_tokens is reached
    sched.update_from_output(first, runner_output(first, {"a": 8}))
    _, finished = sched.update_from_output(second, runner_output(second, {"a": 9}))
    assert finished == [req] and req.status == RequestStatus.FINISHED_LENGTH
    assert req.output_token_ids == [8, 9]
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and sched.num_discarded_tokens == 0


def test_a_request_stopping_while_its_next_step_is_in_flight_has_that_token_discarded():
    sched = make_scheduler()
    req = make_request("a", 5, eos=frozenset({2}))
    sched.add_request(req)
    first = sched.schedule()
    second = sched.schedule()
    outputs, finished = sched.update_from_output(first, runner_output(first, {"a": 2}))  # EOS
    assert finished == [req] and outputs[0].new_token_ids == [2]
    assert sched.kv.num_free_blocks == sched.kv.num_blocks  # freed at once; see Scheduler._free
    outputs, _ = sched.update_from_output(second, runner_output(second, {"a": 77}))
    assert outputs == [] and req.output_token_ids == [2]
    assert sched.num_discarded_tokens == 1


def test_a_request_preempted_while_in_flight_keeps_its_token():
    # 4 blocks of 4: "a" fills 2 (8 tokens), "b" the other 2.
    sched = make_scheduler(num_blocks=4)
    a, b = make_request("a", 8), make_request("b", 5, base=100)
    sched.add_request(a)
    sched.add_request(b)
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"a": 8, "b": 5}
    second = sched.schedule()  # "a" needs a third block for its pending token: "b" gives way
    assert "b" in second.preempted_req_ids and b.status == RequestStatus.PREEMPTED
    outputs, _ = sched.update_from_output(first, runner_output(first, {"a": 11, "b": 12}))
    assert {o.request_id: o.new_token_ids for o in outputs} == {"a": [11], "b": [12]}
    assert b.output_token_ids == [12] and b.num_output_placeholders == 0 and b.num_computed_tokens == 0
    sched.update_from_output(second, runner_output(second, {"a": 13}))
    while b.status != RequestStatus.RUNNING:  # "a" runs until it ends; then "b" comes back
        out = sched.schedule()
        sched.update_from_output(out, runner_output(out, {r: 1 for r in out.num_scheduled_tokens}))
    assert b.num_computed_tokens == 6  # prompt and its kept token, recomputed


def test_a_request_preempted_while_in_flight_whose_token_ends_it_leaves_the_waiting_queue():
    sched = make_scheduler(num_blocks=4)
    a, b = make_request("a", 8), make_request("b", 5, base=100, eos=frozenset({3}))
    sched.add_request(a)
    sched.add_request(b)
    first = sched.schedule()
    second = sched.schedule()
    assert b.status == RequestStatus.PREEMPTED
    _, finished = sched.update_from_output(first, runner_output(first, {"a": 11, "b": 3}))  # b: EOS
    assert finished == [b] and b.status == RequestStatus.FINISHED_STOPPED
    assert len(sched.waiting) == 0 and "b" not in sched.requests
    sched.update_from_output(second, runner_output(second, {"a": 13}))
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_late_token_never_goes_to_a_new_request_reusing_the_id():
    sched = make_scheduler()
    old = make_request("a", 5)
    sched.add_request(old)
    first = sched.schedule()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # aborted while in flight
    new = make_request("a", 6, base=50)
    sched.add_request(new)
    second = sched.schedule()
    outputs, _ = sched.update_from_output(first, runner_output(first, {"a": 99}))
    assert outputs == [] and new.output_token_ids == [] and new.num_output_placeholders == 1
    outputs, _ = sched.update_from_output(second, runner_output(second, {"a": 7}))
    assert new.output_token_ids == [7] and outputs[0].new_token_ids == [7]
