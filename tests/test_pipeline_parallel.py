"""Pipeline parallelism on the CPU: stages are local processes (the ``mp`` executor) joined over
gloo, each holding its run of decoder layers and their KV cache; hidden states and residual
go from stage to stage. The oracle is the one-stage run: greedy token ids identical in float32
for Llama, Qwen2 and Qwen3, combined with tensor parallelism over fewer key/value heads than
ranks, and under chunked prefill, prefix caching and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from pagelm import LLM, SamplingParams
from pagelm.models.pipeline import MissingLayer, held_by_this_stage
from pagelm.plugins.spec_decode import DraftProposer
from pagelm.plugins.spec_decode.eagle_train import EagleTrainConfig, train_eagle_head
from pagelm.plugins.spec_decode.medusa_train import MedusaTrainConfig, train_medusa_heads
from spec_helpers import registered_proposer

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _prompts(n: int, length: int = 5) -> list[dict]:
    return [{"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(length)]} for i in range(n)]


def _ids(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _run(model_dir, prompts, params=GREEDY, **kw):
    with LLM(str(model_dir), dtype="float32", **kw) as llm:
        return _ids(llm, prompts, params)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_pp2_greedy_equals_one_stage(make_model, arch):
    model_dir = make_model(arch, arch)
    prompts = _prompts(4)
    assert _run(model_dir, prompts, pipeline_parallel_size=2) == _run(model_dir, prompts)


def test_tp2_x_pp2_over_one_kv_head_uneven_layers_and_a_tied_head(make_model):
    # 4 ranks: 2 stages of 2 tensor-parallel ranks. One kv head for 2 ranks, 3 layers over 2
    # stages (2 + 1), a tied LM head on a last stage that does not hold the embedding, and a
    # vocabulary of 517 that does not split evenly.
    model_dir = make_model(
        "llama-pp-odd", "llama", num_key_value_heads=1, num_hidden_layers=3, vocab_size=517, tie_word_embeddings=True
    )
    prompts = _prompts(3)
    with LLM(str(model_dir), dtype="float32", tensor_parallel_size=2, pipeline_parallel_size=2) as llm:
        got = _ids(llm, prompts)
        model = llm.engine.core.runner.model
        layers = model.model.layers
        # Rank 0 is stage 0: the embedding (its half of the vocabulary) and layers 0 and 1.
        assert [isinstance(layer, MissingLayer) for layer in layers] == [False, False, True]
        assert isinstance(model.lm_head, MissingLayer) and isinstance(model.model.norm, MissingLayer)
        assert model.model.embed_tokens.weight.shape == (259, 64)
        assert len(llm.engine.core.runner.kv_caches) == 2
        assert layers[0].self_attn.attn.spec.num_kv_heads == 1
    assert got == _run(model_dir, prompts)


def test_chunked_prefill_prefix_caching_and_preemption_equal_the_plain_run(llama_dir):
    shared = list(range(40, 72))
    prompts = [{"prompt_token_ids": shared + [100 + i, 101, 102 + i]} for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = _run(llama_dir, prompts, params)
    with LLM(str(llama_dir), dtype="float32", pipeline_parallel_size=2, num_kv_blocks=12, block_size=8,
             max_num_batched_tokens=16, max_model_len=64) as llm:
        got = _ids(llm, prompts, params)
        core = llm.engine.core
        assert core.scheduler.num_preemptions > 0 and core.kv_cache_manager.prefix_cache_stats.hits > 0
        assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks
    assert got == plain


def _logprobs_of(outs):
    """Per request: (token ids, each sample's {token: (logprob, rank)}, each prompt position's)."""
    def table(entries):
        if entries is None:
            return None
        return [None if e is None else {t: (round(lp.logprob, 4), lp.rank) for t, lp in e.items()} for e in entries]

    return [(o.outputs[0].token_ids, table(o.outputs[0].logprobs), table(o.prompt_logprobs)) for o in outs]


@pytest.mark.parametrize("tp", [1, 2])
def test_logprobs_and_prompt_logprobs_equal_one_stage(llama_dir, tp):
    # Seeded sampling, top-3 logprobs of each sample, top-2 of each prompt token, prompts
    # cut into 8-token chunks (prompt logprobs of a step that samples nothing) and two
    # micro-batches in flight; one request without any, beside them.
    prompts = [{"prompt_token_ids": [(5 * i + j) % 400 + 3 for j in range(11 + 4 * i)]} for i in range(4)]
    params = [SamplingParams(max_tokens=6, temperature=0.8, seed=i, logprobs=3, prompt_logprobs=2) for i in range(3)]
    params.append(SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    kw = dict(dtype="float32", max_num_batched_tokens=8, max_num_seqs=4)
    with LLM(str(llama_dir), **kw) as llm:
        want = _logprobs_of(llm.generate(prompts, params, use_tqdm=False))
    with LLM(str(llama_dir), pipeline_parallel_size=2, tensor_parallel_size=tp, **kw) as llm:
        got = _logprobs_of(llm.generate(prompts, params, use_tqdm=False))
    assert got == want
    assert len(got[0][1][0]) >= 3 and len(got[0][2][1]) >= 2 and got[3][1] is None and got[3][2] is None


@pytest.mark.parametrize("method", [None, "eagle"])
def test_random_arrivals_aborts_and_preemptions_with_two_batches_in_flight_equal_the_plain_run(
    llama_dir, request, method
):
    """The oracle is the one-stage run of each request alone; the pipelined engine sees
    requests arrive at random steps, some aborted mid-way, a KV pool small enough to
    preempt, 16-token chunks, and two micro-batches in flight; with EAGLE drafts too (a
    request preempted or aborted while its step is in flight is still proposed for when
    that step finishes, from the inputs and block-table rows kept at launch)."""
    # Every step drafts (adaptive off): the untrained head accepts too little for adaptive
    # drafting, whose record then starts later requests backed off, and few drafts get verified.
    spec = None if method is None else {**request.getfixturevalue("eagle_spec"), "adaptive": False}
    rng = random.Random(17)
    prompts = {f"r{i}": [rng.randrange(3, 500) for _ in range(rng.randrange(3, 40))] for i in range(14)}
    params = {rid: SamplingParams(max_tokens=rng.randrange(1, 20), temperature=0.0, ignore_eos=True) for rid in prompts}
    with LLM(str(llama_dir), dtype="float32") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts.values()], list(params.values()), use_tqdm=False)
        plain = dict(zip(prompts, _ids_of(outs)))
    with LLM(str(llama_dir), dtype="float32", pipeline_parallel_size=2, num_kv_blocks=14, block_size=8,
             max_num_batched_tokens=16, max_model_len=64, speculative_config=spec) as llm:
        engine, core = llm.engine, llm.engine.core
        overlapped = []
        launch = core.runner.launch

        def counting_launch(sched, **kw):
            if not sched.is_empty:  # steps already in flight with work in them
                overlapped.append(sum(p.output is None for p in core._batch_queue))
            return launch(sched, **kw)

        core.runner.launch = counting_launch
        arriving, aborted, finished = list(prompts), set(), {}
        while arriving or engine.has_unfinished_requests():
            for _ in range(rng.choice([0, 0, 1, 2])):
                if arriving:
                    rid = arriving.pop(0)
                    engine.add_request(rid, {"prompt_token_ids": prompts[rid]}, params[rid])
            running = [r for r in core.scheduler.requests if r not in aborted]
            if running and rng.random() < 0.08:
                victim = rng.choice(running)
                engine.abort_request([victim])
                aborted.add(victim)
            finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        assert core.scheduler.num_preemptions > 0 and max(overlapped) == 1 and aborted
        assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks
        if spec is not None:
            assert core.scheduler.spec_decoding_stats.num_accepted_tokens > 0
    assert set(finished) == set(prompts) - aborted
    assert finished == {rid: plain[rid] for rid in finished}


def test_the_running_requests_split_into_two_micro_batches(llama_dir):
    prompts = _prompts(8)
    with LLM(str(llama_dir), dtype="float32", pipeline_parallel_size=2) as llm:
        core = llm.engine.core
        launched = []  # (requests in the step, steps with work already in flight)
        launch = core.runner.launch

        def recording_launch(sched, **kw):
            if not sched.is_empty:
                launched.append((len(sched.num_scheduled_tokens), sum(p.output is None for p in core._batch_queue)))
            return launch(sched, **kw)

        core.runner.launch = recording_launch
        got = _ids(llm, prompts)
    assert got == _run(llama_dir, prompts)
    # All 8 prompts are admitted in the first step; from then on each step takes half of
    # the running requests while the other half is in flight.
    assert launched[0] == (8, 0)
    decode_steps = launched[2:]
    assert {size for size, _ in decode_steps} == {4} and all(in_flight == 1 for _, in_flight in decode_steps[1:])


def test_the_oldest_step_is_sampled_inside_the_next_launch_and_each_stage_is_profiled(llama_dir, monkeypatch, caplog):
    # The engine tells every rank to sample the oldest step inside the launch it finishes
    # right after (the last stage does it between the receive and the forward pass);
    # PAGELM_PP_PROFILE=1 times every forward pass of each stage and reports at shutdown.
    monkeypatch.setenv("PAGELM_PP_PROFILE", "1")
    prompts = _prompts(8)
    with LLM(str(llama_dir), dtype="float32", pipeline_parallel_size=2) as llm:
        core = llm.engine.core
        launched = []  # (steps in flight before the launch, the step it samples first, non-empty)
        launch = core.runner.launch

        def recording_launch(sched, **kw):
            oldest = core._batch_queue[0] if core._batch_queue else None
            launched.append((len(core._batch_queue), kw.get("sample_first") is oldest, not sched.is_empty))
            return launch(sched, **kw)

        core.runner.launch = recording_launch
        got = _ids(llm, prompts)
        stage = core.runner.pipeline
        num_forwards = len(stage._profile.spans)
    assert got == _run(llama_dir, prompts)
    assert all(same for _, same, _ in launched)
    assert sum(queued == 1 for queued, _, _ in launched) > 0  # decodes launched with one step in flight
    assert num_forwards == sum(work for _, _, work in launched) > 0
    assert stage._sends == [] and stage._profile is None  # closed: sends waited, profile reported
    assert any(f"stage 0: {num_forwards} forward passes" in r.getMessage() for r in caplog.records)


def _ids_of(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_weights_are_assigned_to_stages_by_layer_index():
    # Stage 1 of 2 over layers [2, 4): its layers, the final norm and the LM head.
    held = [
        name for name in [
            "model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "model.layers.2.mlp.down_proj.weight",
            "model.layers.3.self_attn.q_proj.weight", "model.layers.12.input_layernorm.weight", "model.norm.weight",
            "lm_head.weight",
        ]
        if held_by_this_stage(name, (2, 4), first=False, last=True)
    ]
    assert held == [
        "model.layers.2.mlp.down_proj.weight", "model.layers.3.self_attn.q_proj.weight", "model.norm.weight",
        "lm_head.weight",
    ]


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"pipeline_parallel_size": 3}, "pipeline_parallel_size=3 is more than the model's 2 layers"),
        ({"pipeline_parallel_size": 2, "distributed_executor_backend": "uni"}, "'uni' runs one rank"),
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be >= 1"),
    ],
)
def test_bad_pipeline_config_is_a_clear_error(llama_dir, kw, match):
    with pytest.raises(Exception, match=match):
        LLM(str(llama_dir), dtype="float32", **kw)
    assert not torch.distributed.is_initialized()


class _ReadsHidden(DraftProposer):
    """A third-party proposer that reads the target's pass and does not say it can live on
    the last pipeline stage alone."""

    name = "reads-hidden"

    def propose(self, batch):
        return [[] for _ in range(batch.num_reqs)]


def test_a_proposer_reading_the_target_pass_without_pipeline_support_is_refused(llama_dir):
    match = (r"speculative_config \(method='reads-hidden'\) does not run under pipeline parallelism "
             r"\(pipeline_parallel_size=2\): its proposer reads the target's forward pass and does not set "
             r"supports_pipeline_parallel")
    with registered_proposer(_ReadsHidden), pytest.raises(ValueError, match=match):
        LLM(str(llama_dir), dtype="float32", pipeline_parallel_size=2,
            speculative_config={"method": "reads-hidden", "num_speculative_tokens": 2})
    assert not torch.distributed.is_initialized()


def test_guided_decoding_equals_one_stage(llama_dir):
    # The last stage masks with the bitmask rank 0 collected when it scheduled the step: with
    # two micro-batches in flight, each over guided requests of its own.
    import re

    from transformers import AutoTokenizer

    from pagelm import GuidedDecodingParams

    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    regexes = [r"(ab|ba){2,6}c", r"[a-z]{5,9}", r"(la |na ){1,4}no"]
    prompts = [{"prompt_token_ids": tokenizer.encode(t)} for t in ("abbaab" * 3, "xyz", "la la na ", "q")]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, guided_decoding=GuidedDecodingParams(regex=r))
        for r in regexes + [regexes[0]]
    ]
    prompts.append({"prompt_token_ids": [40, 41, 42]})  # unconstrained, beside them
    params.append(SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    kw = dict(dtype="float32", plugin_config={"xgrammar": {"any_whitespace": False}})
    with LLM(str(llama_dir), **kw) as llm:
        want = llm.generate(prompts, params, use_tqdm=False)
    with LLM(str(llama_dir), pipeline_parallel_size=2, **kw) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for out, regex in zip(got, regexes + [regexes[0]]):
        assert re.fullmatch(regex, out.outputs[0].text), out.outputs[0].text


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
REPEATING = [{"prompt_token_ids": [40, 41, 42, 43, 44] * 6}, {"prompt_token_ids": [7, 8, 9] * 8},
             {"prompt_token_ids": [3, 4]}, {"prompt_token_ids": [60, 61, 62] * 5}]


@pytest.mark.parametrize("tp", [1, 2])
def test_ngram_drafts_under_pp2_give_the_one_stage_tokens(llama_dir, tp):
    # The last stage verifies each step's drafts and broadcasts the accepted tokens; rank 0's
    # proposer drafts from them. Two micro-batches in flight, some steps verifying drafts,
    # some plain; logprobs of the verified rows reach rank 0. tp=2: 4 ranks, the last
    # stage's first rank broadcasts.
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    kw = dict(dtype="float32", block_size=8)
    with LLM(str(llama_dir), **kw) as llm:
        want = llm.generate(REPEATING, params, use_tqdm=False)
    with LLM(str(llama_dir), pipeline_parallel_size=2, tensor_parallel_size=tp, speculative_config=NGRAM, **kw) as llm:
        got = llm.generate(REPEATING, params, use_tqdm=False)
    assert _logprobs_of(got) == _logprobs_of(want)
    assert sum(o.metrics.spec_num_draft_tokens for o in got) > 0
    assert sum(o.metrics.spec_num_accepted_tokens for o in got) > 0


def test_async_scheduling_under_pp2_equals_the_plain_run(llama_dir):
    # Under PP the micro-batches in flight are the run-ahead: async_scheduling=True is taken
    # (with n-gram drafts, chunked prefill and preemption beside it) and the tokens are the plain run's.
    prompts = REPEATING + _prompts(3, length=9)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = _run(llama_dir, prompts, params)
    with LLM(str(llama_dir), dtype="float32", pipeline_parallel_size=2, async_scheduling=True, block_size=8,
             num_kv_blocks=16, max_num_batched_tokens=16, max_model_len=64, speculative_config=NGRAM) as llm:
        got = _ids(llm, prompts, params)
        core = llm.engine.core
        assert core.async_scheduling and core.scheduler.num_preemptions > 0
        assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks
    assert got == plain


@pytest.fixture(scope="module")
def eagle_spec(llama_dir, tmp_path_factory):
    """An EAGLE head for the tiny Llama: the trainer's initialisation, untrained (a working
    head, not a good one; it still gets drafts accepted on these prompts)."""
    head = tmp_path_factory.mktemp("pp_eagle")
    train_eagle_head(llama_dir, head, EagleTrainConfig(steps=0), log=lambda *_: None)
    return {"method": "eagle", "num_speculative_tokens": 2, "model": str(head)}


@pytest.mark.parametrize("tp", [1, 2])
def test_eagle_drafts_under_pp2_give_the_one_stage_tokens_and_drafts(llama_dir, eagle_spec, tp):
    # The head lives on the last stage (its own copy of the embedding, which that stage
    # lacks), reads the hidden states there and sends its drafts to rank 0; the last stage
    # verifies them. Two micro-batches in flight and 16-token prompt chunks: a step that
    # ends a prompt is proposed for when the engine finishes it, after the next step was
    # launched over the same input buffers. tp=2: the head's layer is split over the last
    # stage's two ranks, and its first rank sends.
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    # Without adaptive drafting a request's drafts depend on its own tokens only, not on
    # which micro-batch it rode in: each request's are the one-stage head's.
    spec = {**eagle_spec, "adaptive": False}
    kw = dict(dtype="float32", block_size=8, max_num_batched_tokens=16)
    with LLM(str(llama_dir), **kw) as llm:
        want = llm.generate(REPEATING, params, use_tqdm=False)
    with LLM(str(llama_dir), speculative_config=spec, **kw) as llm:
        one_stage = llm.generate(REPEATING, params, use_tqdm=False)
    with LLM(str(llama_dir), pipeline_parallel_size=2, tensor_parallel_size=tp, speculative_config=spec, **kw) as llm:
        got = llm.generate(REPEATING, params, use_tqdm=False)
        runner = llm.engine.core.runner
        # Rank 0 (stage 0) holds no head and no KV cache for one: only its own layers'.
        assert runner.spec.proposer is None and len(runner.kv_caches) == len(runner.model.model.stage_layers)
    assert _logprobs_of(got) == _logprobs_of(want)
    drafted = [(o.metrics.spec_num_draft_tokens, o.metrics.spec_num_accepted_tokens) for o in got]
    assert drafted == [(o.metrics.spec_num_draft_tokens, o.metrics.spec_num_accepted_tokens) for o in one_stage]
    assert sum(d for d, _ in drafted) > 0 and sum(a for _, a in drafted) > 0


def test_medusa_drafts_under_pp2_give_the_one_stage_tokens(llama_dir, tmp_path):
    # The heads read the last stage's hidden states (no KV cache, no embedding).
    train_medusa_heads(llama_dir, tmp_path / "heads", MedusaTrainConfig(steps=0), log=lambda *_: None)
    spec = {"method": "medusa", "num_speculative_tokens": 2, "model": str(tmp_path / "heads")}
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    kw = dict(dtype="float32", block_size=8)
    with LLM(str(llama_dir), **kw) as llm:
        want = llm.generate(REPEATING, params, use_tqdm=False)
    with LLM(str(llama_dir), pipeline_parallel_size=2, speculative_config=spec, **kw) as llm:
        got = llm.generate(REPEATING, params, use_tqdm=False)
    assert _logprobs_of(got) == _logprobs_of(want)
    assert sum(o.metrics.spec_num_draft_tokens for o in got) > 0
    assert sum(o.metrics.spec_num_accepted_tokens for o in got) > 0
