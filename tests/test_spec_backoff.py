"""Adaptive drafting: a request whose drafts keep being rejected stops drafting, with
exponential backoff and aligned probes; accepted drafts keep it drafting; outputs never
change; the knobs are checked at start-up."""

import numpy as np
import pytest

from pagelm import LLM, SamplingParams
from pagelm.plugins.bench.latency import reject_all_drafts
from pagelm.plugins.spec_decode import DraftProposer
from pagelm.spec_decode import FinishedStep, SpeculativeConfig
from pagelm.plugins.spec_decode.backoff import DraftBackoff
from spec_helpers import registered_proposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
REPETITIVE = [{"prompt_token_ids": [40 + i, 41, 42, 43, 44] * 8} for i in range(4)]
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


# ---- the backoff schedule -------------------------------------------------------------------


def run_schedule(backoff: DraftBackoff, accepted: list[int | None], row: int = 0) -> list[int]:
    """Drive one row through steps: ``accepted[t]`` is what step t's verification accepted
    (None: nothing drafted to verify); returns the max drafts granted after each step."""
    rows = np.array([row])
    granted = []
    for a in accepted:
        if a is not None:
            backoff.observe(rows, np.array([3]), np.array([a]))
        granted.append(int(backoff.cap(rows, np.array([3]))[0]))
    return granted


def test_two_misses_in_a_row_back_off_with_doubling_pauses_between_aligned_probes():
    backoff = DraftBackoff(4, backoff_after=2, max_backoff_steps=32)
    granted = []
    for _ in range(80):  # always verify what was granted, always rejected
        accepted = 0 if granted and granted[-1] else None
        granted += run_schedule(backoff, [accepted])
    drafted = [t for t, g in enumerate(granted) if g]
    # Drafts at 0 and 1 (misses at 1, 2), then probes on multiples of 2, 4, 8, 16, 32.
    assert drafted == [0, 1, 4, 8, 16, 32, 64]
    assert backoff.num_skipped == 80 - len(drafted)


def test_the_pause_stops_doubling_at_max_backoff_steps():
    backoff = DraftBackoff(1, backoff_after=1, max_backoff_steps=4)
    granted = []
    for _ in range(40):
        granted += run_schedule(backoff, [0 if granted and granted[-1] else None])
    drafted = [t for t, g in enumerate(granted) if g]
    assert drafted == [0, 2, 4, 8, 12, 16, 20, 24, 28, 32, 36]


def test_an_accepted_draft_resets_the_request_to_drafting_every_step():
    backoff = DraftBackoff(1, backoff_after=2, max_backoff_steps=32)
    # The probe at step 4 drafts one token; it is accepted, and k drafts come back.
    assert run_schedule(backoff, [None, 0, 0, None, None, 1, None, 0]) == [3, 3, 0, 0, 1, 3, 3, 3]


def test_a_probe_drafts_one_token_and_a_miss_ends_it():
    backoff = DraftBackoff(1, backoff_after=2, max_backoff_steps=32)
    granted = []
    for _ in range(40):
        granted += run_schedule(backoff, [0 if granted and granted[-1] else None])
    # Two misses with k drafts, then probes of one draft each (steps 4, 8, 16, 32).
    assert [(t, g) for t, g in enumerate(granted) if g] == [(0, 3), (1, 3), (4, 1), (8, 1), (16, 1), (32, 1)]
    # A probe is no more than the request may take: no room, no probe.
    backoff = DraftBackoff(1, backoff_after=1, max_backoff_steps=2)
    backoff.observe(np.array([0]), np.array([3]), np.array([0]))
    assert [int(backoff.cap(np.array([0]), np.array([0]))[0]) for _ in range(3)] == [0, 0, 0]


def test_requests_on_other_rows_are_not_affected_and_reset_clears_a_row():
    backoff = DraftBackoff(2, backoff_after=1, max_backoff_steps=32)
    backoff.observe(np.array([0, 1]), np.array([3, 3]), np.array([0, 2]))
    assert backoff.cap(np.array([0, 1]), np.array([3, 3])).tolist() == [0, 3]
    backoff.reset(0)
    assert backoff.cap(np.array([0, 1]), np.array([3, 3])).tolist() == [3, 3]


def test_rows_that_may_not_draft_anyway_are_not_counted_as_skipped():
    backoff = DraftBackoff(2, backoff_after=1, max_backoff_steps=32)
    backoff.observe(np.array([0, 1]), np.array([3, 3]), np.array([0, 0]))
    assert backoff.cap(np.array([0, 1]), np.array([0, 3])).tolist() == [0, 0]
    assert backoff.num_skipped == 1


def test_a_proposal_that_finds_nothing_counts_as_a_miss():
    backoff = DraftBackoff(4, backoff_after=2, max_backoff_steps=8)
    rows = np.array([1])
    for _ in range(2):  # two proposals in a row found nothing for row 1
        assert backoff.cap(rows, np.array([3]))[0] == 3
        backoff.observe_empty(rows)
    assert backoff.resume_step[1] > backoff.step and backoff.misses[1] == 2
    assert backoff.cap(rows, np.array([3]))[0] == 0
    assert backoff.misses[0] == backoff.resume_step[0] == 0  # other rows untouched
    backoff.observe(rows, np.array([3]), np.array([1]))  # a hit clears it
    assert backoff.cap(rows, np.array([3]))[0] == 3


def test_deeply_backed_off_means_every_request_is_pausing_or_probing():
    backoff = DraftBackoff(2, backoff_after=2, max_backoff_steps=32)
    rows = np.array([0, 1])
    for misses in range(1, 4):
        backoff.observe(rows[:1], np.array([3]), np.array([0]))
        assert backoff.deep(rows[:1]) == (misses >= 2), misses
    assert not backoff.deep(rows)  # row 1 drafts every step: the step is followed
    assert not backoff.deep(rows[:0])
    backoff.observe(rows[:1], np.array([1]), np.array([1]))  # a probe hits: drafting every step again
    assert not backoff.deep(rows[:1])


def test_an_empty_verification_is_a_miss_only_while_the_gain_is_low():
    """A drafter whose verifications accept drafts often enough keeps drafting through a few
    empty ones; a new request's first two empty verifications are two misses."""
    good = DraftBackoff(1, backoff_after=2, max_backoff_steps=32)
    rows = np.array([0])
    # gain 0.3 -> 0.98 1.23 0.92 0.69 1.27 0.95 0.71 0.78 0.59 0.44 0.33 0.25 (< MIN_GAIN) 0.19
    granted = run_schedule(good, [None, 3, 2, 0, 0, 3, 0, 0, 1, 0, 0, 0, 0, 0])
    assert granted == [3] * 13 + [0] and good.misses[0] == 2  # misses at the 4th and 5th 0 in a row
    fresh = DraftBackoff(1, backoff_after=2, max_backoff_steps=32)
    assert run_schedule(fresh, [None, 0, 0]) == [3, 3, 0]


def test_a_probe_that_hits_is_on_probation():
    backoff = DraftBackoff(1, backoff_after=2, max_backoff_steps=32)
    # miss, miss, pause, the probe hits (drafting again), an empty verification with the gain
    # still at 0.28, then one below MIN_GAIN: one miss pauses it again (two without probation).
    assert run_schedule(backoff, [None, 0, 0, None, None, 1, 0, 0, None]) == [3, 3, 0, 0, 1, 3, 3, 0, 1]


def test_a_probe_that_hits_then_misses_pauses_again_at_the_pause_it_had():
    """One lucky probe costs one verification of k drafts: the next miss resumes the pause
    the probe was at (8 steps here), not a second climb from 2."""
    backoff = DraftBackoff(1, backoff_after=2, max_backoff_steps=128)
    rows, granted = np.array([0]), []
    for t in range(80):  # always rejected, except the probe drafted at step 16
        if granted and granted[-1]:
            backoff.observe(rows, np.array([granted[-1]]), np.array([int(t == 17)]))
        granted.append(int(backoff.cap(rows, np.array([3]))[0]))
    drafted = [(t, g) for t, g in enumerate(granted) if g]
    assert drafted == [(0, 3), (1, 3), (4, 1), (8, 1), (16, 1), (17, 3), (24, 1), (32, 1), (64, 1)]
    # Two hits in a row clear the memory: the next misses start from a pause of 2 again.
    backoff.observe(rows, np.array([1]), np.array([1]))
    backoff.observe(rows, np.array([3]), np.array([2]))
    assert (backoff.misses[0], backoff.level[0]) == (0, 0)


def test_while_the_drafter_does_not_pay_a_new_request_starts_backed_off_after_its_prompt():
    backoff = DraftBackoff(4, backoff_after=2, max_backoff_steps=128)
    rows = np.array([0, 1])
    assert not backoff.in_slump()
    backoff.observe(rows, np.array([3, 3]), np.array([0, 0]))  # too few verifications to judge by
    backoff.end_step()
    assert not backoff.in_slump()
    for i in range(3):
        backoff.observe(rows, np.array([3, 3]), np.array([0, int(i == 0)]))
        backoff.end_step()
    assert backoff.in_slump()  # 1 accepted over 8 verifications: below 0.25 a verification
    backoff.reset(2)
    assert backoff.cap(np.array([2]), np.array([0]))[0] == 0  # its prompt is not in yet
    assert backoff.misses[2] == 0 and not backoff.deep(np.array([2]))
    step, granted = backoff.step, []
    for _ in range(300):  # every probe rejected
        if granted and granted[-1]:
            backoff.observe(np.array([2]), np.array([granted[-1]]), np.array([0]))
        granted.append(int(backoff.cap(np.array([2]), np.array([3]))[0]))
    assert backoff.num_slump_starts == 1 and backoff.deep(np.array([2]))
    # Probes of one draft from the 64-step pause on (4 steps had passed), then every 128
    # (max_backoff_steps).
    probes = [step + t for t, g in enumerate(granted) if g]
    assert probes == [64, 128, 256] and all(granted[p - step] == 1 for p in probes)
    # A drafter that pays: a new request drafts k from its first step.
    for _ in range(8):
        backoff.observe(rows, np.array([3, 3]), np.array([2, 3]))
        backoff.end_step()
    backoff.reset(3)
    assert not backoff.in_slump() and backoff.cap(np.array([3]), np.array([3]))[0] == 3


# ---- through the engine ---------------------------------------------------------------------


class NeverRight(DraftProposer):
    """Drafts ``speculative_config["token"]``, k times: never accepted where the target never
    produces that token."""

    name = "never_right"

    def propose(self, batch):
        token = self.speculative.options["token"]
        return [[token] * int(m) for m in batch.max_num_drafts]


@pytest.fixture()
def never_right():
    with registered_proposer(NeverRight):
        yield


def generate(model_dir, prompts, params=LONG, **kw):
    llm = LLM(str(model_dir), dtype="float32", block_size=8, **kw)
    spec = llm.engine.core.runner.spec
    calls = {"verify": 0}
    if spec is not None:
        execute = spec.execute
        spec.execute = lambda *a: calls.__setitem__("verify", calls["verify"] + 1) or execute(*a)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs], calls["verify"]


@pytest.fixture(scope="module")
def plain(llama_dir):
    """The non-speculative outputs of REPETITIVE, and a token none of them contains."""
    _, tokens, _ = generate(llama_dir, REPETITIVE)
    unused = next(t for t in range(1, 1000) if all(t not in out for out in tokens))
    return tokens, unused


def test_rejected_drafts_back_off_to_a_small_fraction_of_steps(llama_dir, never_right, plain):
    want, unused = plain
    spec = {"method": "never_right", "num_speculative_tokens": 3, "token": unused}
    llm, got, verify_steps = generate(llama_dir, REPETITIVE, speculative_config=spec)
    assert got == want
    stats = llm.engine.core.scheduler.spec_decoding_stats
    assert stats.num_accepted_tokens == 0
    # 200 steps at batch 4: drafts at 2 steps, then probes every 2, 4, ... 32 steps.
    assert 0 < verify_steps < 0.1 * LONG.max_tokens
    assert llm.engine.core.runner.spec.proposer.backoff.num_skipped > 0.8 * 4 * LONG.max_tokens


def test_without_adaptive_every_step_verifies_rejected_drafts(llama_dir, never_right, plain):
    want, unused = plain
    spec = {"method": "never_right", "num_speculative_tokens": 3, "token": unused, "adaptive": False}
    llm, got, verify_steps = generate(llama_dir, REPETITIVE, speculative_config=spec)
    assert got == want
    assert llm.engine.core.runner.spec.proposer.backoff is None
    # Every step after the prefill verifies drafts (the last step has no room for any).
    assert verify_steps == LONG.max_tokens - 2
    assert llm.engine.core.scheduler.spec_decoding_stats.num_drafts == 4 * (LONG.max_tokens - 2)


def test_bench_reject_all_backs_off_ngram_drafts(llama_dir, plain):
    want, _ = plain
    llm = LLM(str(llama_dir), dtype="float32", block_size=8, speculative_config=NGRAM)
    reject_all_drafts(llm, llm.engine.core.vocab_size)
    outs = llm.generate(REPETITIVE, LONG, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    for out in outs:
        assert out.metrics.spec_num_accepted_tokens == 0
        assert 0 < out.metrics.spec_num_drafts < 0.2 * LONG.max_tokens


def test_accepted_ngram_drafts_keep_every_step_drafting(make_model):
    model = make_model("spec_llama", "llama")
    prompts = [{"prompt_token_ids": [40, 41, 42, 43, 44] * 8}]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    _, want, fixed_steps = generate(model, prompts, params, speculative_config={**NGRAM, "adaptive": False})
    llm, got, verify_steps = generate(model, prompts, params, speculative_config=NGRAM)
    assert got == want
    stats = llm.engine.core.scheduler.spec_decoding_stats
    assert stats.mean_acceptance_length > 3.0, stats
    assert verify_steps == fixed_steps
    # At most a step where the lookup had found nothing twice in a row (misses too).
    assert llm.engine.core.runner.spec.proposer.backoff.num_skipped <= 1


def test_a_new_request_on_a_backed_off_row_drafts_from_its_first_step(llama_dir, never_right, plain):
    _, unused = plain
    spec = {"method": "never_right", "num_speculative_tokens": 3, "token": unused}
    llm = LLM(str(llama_dir), dtype="float32", block_size=8, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (first,) = llm.generate(REPETITIVE[:1], params, use_tqdm=False)
    backoff = llm.engine.core.runner.spec.proposer.backoff
    assert backoff.resume_step[0] > backoff.step  # still backed off when it finished
    # The next request takes the same row (free rows are a stack) and starts afresh.
    (second,) = llm.generate(REPETITIVE[1:2], params, use_tqdm=False)
    assert second.metrics.spec_num_drafts == first.metrics.spec_num_drafts == 4


def test_a_different_request_state_on_a_row_resets_it(llama_dir):
    """A request resumed after preemption comes back as a new state object, possibly on the
    row it had: its backoff (and token history) start over."""
    from pagelm.worker.step_state import CachedRequestState

    llm = LLM(str(llama_dir), dtype="float32", block_size=8, speculative_config=NGRAM)
    proposer = llm.engine.core.runner.spec.proposer

    def state():
        return CachedRequestState("r", [1, 2, 3], 3, SamplingParams(), [0], False, row=0)

    def after_step(request):
        one = np.array([1])
        return FinishedStep(
            requests=[request], rows=np.array([0]), num_drafts=np.array([0]), num_sampled=one, num_tokens=np.array([3]),
            max_model_len=64, ahead=True,
        )

    before = state()
    assert proposer.propose_step(after_step(before)) == [[]]
    proposer.backoff.observe(np.array([0]), np.array([3]), np.array([0]))
    proposer.backoff.observe(np.array([0]), np.array([3]), np.array([0]))
    proposer.rows.table_len[0] = 3
    proposer.propose_step(after_step(before))  # the same request: kept
    assert proposer.backoff.misses[0] == 2 and proposer.rows.table_len[0] == 3
    proposer.propose_step(after_step(state()))
    assert proposer.backoff.misses[0] == 0 and proposer.backoff.resume_step[0] == 0
    assert proposer.rows.table_len[0] == 0


# ---- configuration --------------------------------------------------------------------------


def test_adaptive_drafting_is_on_by_default():
    config = SpeculativeConfig.from_dict(NGRAM)
    assert (config.adaptive, config.backoff_after, config.max_backoff_steps) == (True, 2, 128)
    assert "adaptive" not in config.options
    config = SpeculativeConfig.from_dict({**NGRAM, "adaptive": False, "backoff_after": 3, "max_backoff_steps": 8})
    assert (config.adaptive, config.backoff_after, config.max_backoff_steps) == (False, 3, 8)


@pytest.mark.parametrize("bad,message", [
    ({"adaptive": "yes"}, r"speculative_config.adaptive must be true or false, got 'yes'"),
    ({"backoff_after": 0}, r"speculative_config.backoff_after must be an integer >= 1, got 0"),
    ({"backoff_after": 1.5}, r"speculative_config.backoff_after must be an integer >= 1, got 1.5"),
    ({"max_backoff_steps": -4}, r"speculative_config.max_backoff_steps must be an integer >= 1, got -4"),
    ({"max_backoff_steps": True}, r"speculative_config.max_backoff_steps must be an integer >= 1, got True"),
])
def test_malformed_backoff_settings_are_rejected_before_loading(llama_dir, bad, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(llama_dir), speculative_config={**NGRAM, **bad})


class NeverRightFollower(NeverRight):
    """``NeverRight`` as a draft model with a KV cache of its own would be: every step comes
    to ``propose`` (``needs_ahead_target``), drafting or not."""

    name = "never_right_follower"
    needs_every_step = False
    needs_ahead_target = True
    skips_deep_backoff = True

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.calls = 0

    def propose(self, batch):
        self.calls += 1
        return super().propose(batch)


class AlwaysFollower(NeverRightFollower):
    name = "always_follower"
    skips_deep_backoff = False


def test_a_draft_model_stops_following_steps_where_everyone_is_deeply_backed_off(llama_dir, plain):
    want, unused = plain
    calls = {}
    for proposer_cls in (NeverRightFollower, AlwaysFollower):
        spec = {"method": proposer_cls.name, "num_speculative_tokens": 3, "token": unused}
        with registered_proposer(proposer_cls):
            llm, got, verify_steps = generate(llama_dir, REPETITIVE, speculative_config=spec)
        assert got == want
        proposer = llm.engine.core.runner.spec.proposer
        assert proposer.backoff.deep(np.arange(4))
        calls[proposer_cls.skips_deep_backoff] = proposer.calls
    # Followed while anyone drafts (the first few steps), then only for the probes: as many
    # calls as steps that draft (each verified in the next), far fewer than the 200 steps.
    # Without ``skips_deep_backoff`` every step after the prefill comes to ``propose``.
    assert verify_steps <= calls[True] < 0.1 * LONG.max_tokens
    assert calls[False] >= LONG.max_tokens - 2


def test_requests_after_a_drafter_that_did_not_pay_start_backed_off(llama_dir, plain):
    """The second batch of a proposer whose drafts were all rejected starts backed off: far
    fewer verifications than the first, the same tokens; a draft model follows the steps
    that complete its prompts (so that it has their KV), and no other until the probes."""
    want, unused = plain
    spec = {"method": NeverRightFollower.name, "num_speculative_tokens": 3, "token": unused}
    with registered_proposer(NeverRightFollower):
        llm = LLM(str(llama_dir), dtype="float32", block_size=8, speculative_config=spec)
        proposer = llm.engine.core.runner.spec.proposer
        calls = []
        propose = proposer.propose
        proposer.propose = lambda batch: calls.append(batch.max_num_drafts.tolist()) or propose(batch)
        drafts, followed = [], []
        for _ in range(2):
            calls.clear()
            outs = llm.generate(REPETITIVE, LONG, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == want
            drafts.append(sum(o.metrics.spec_num_drafts for o in outs))
            followed.append(list(calls))
    assert proposer.backoff.num_slump_starts == len(REPETITIVE)
    # First batch: two verifications of k drafts each, then probes after 2, 4, ... steps.
    # Second: probes only, the first after 64 steps.
    assert drafts[1] <= 0.5 * drafts[0], drafts
    assert followed[1][0] == [0] * len(REPETITIVE)  # the prefill step, followed, nothing drafted
    assert all(any(caps) for caps in followed[1][1:])  # then only the probes


# ---- steps run ahead whose proposal is left out ----------------------------------------------


def run_ahead_counts(model_dir, spec, skip: bool, monkeypatch):
    """Every draft rejected under async scheduling: outputs, each request's drafts, the
    backoff's step count and skipped request-steps, and the proposals made."""
    with monkeypatch.context() as m:
        if not skip:  # every proposal made, every check in numpy: the engine before 2.22
            from pagelm.plugins.spec_decode import drafting

            m.setattr(DraftProposer, "skip_ahead", lambda self, requests: False)
            m.setattr(drafting, "SCALAR_BATCH", 0)
        llm = LLM(str(model_dir), dtype="float32", block_size=8, speculative_config=spec, async_scheduling=True)
        reject_all_drafts(llm, llm.engine.core.vocab_size)
        proposer = llm.engine.core.runner.spec.proposer
        calls = []
        propose_step = proposer.propose_step
        proposer.propose_step = lambda step: calls.append(step.ahead) or propose_step(step)
        outs = llm.generate(REPETITIVE, LONG, use_tqdm=False)
    return (
        [o.outputs[0].token_ids for o in outs], [o.metrics.spec_num_drafts for o in outs],
        proposer.backoff.step, proposer.backoff.num_skipped, calls,
    )


@pytest.mark.parametrize("scalar_batch", [64, 0], ids=["one-by-one", "numpy"])
@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_a_step_run_ahead_with_nothing_to_follow_is_only_counted(
    llama_dir, plain, method, scalar_batch, tmp_path, monkeypatch
):
    """With every request backed off, the proposal of a step run ahead does nothing but
    count the step (EAGLE's head does not follow deeply backed-off steps): the engine leaves
    it out. Same tokens, same drafts at the same steps, same counts as making it; the
    per-step checks give the same answers one request at a time and in numpy."""
    from pagelm.plugins.spec_decode import drafting

    monkeypatch.setattr(drafting, "SCALAR_BATCH", scalar_batch)
    if method == "eagle":
        from pagelm.plugins.spec_decode.eagle_train import EagleTrainConfig, train_eagle_head

        train_eagle_head(llama_dir, tmp_path / "head", EagleTrainConfig(steps=0), log=lambda *_: None)
        spec = {"method": "eagle", "num_speculative_tokens": 3, "model": str(tmp_path / "head")}
    else:
        spec = NGRAM
    want, _ = plain
    tokens, drafts, steps, skipped, calls = run_ahead_counts(llama_dir, spec, True, monkeypatch)
    base_tokens, base_drafts, base_steps, base_skipped, base_calls = run_ahead_counts(llama_dir, spec, False, monkeypatch)
    assert tokens == base_tokens == want
    assert drafts == base_drafts and all(0 < d < 0.2 * LONG.max_tokens for d in drafts)
    assert (steps, skipped) == (base_steps, base_skipped)
    # Without the skip most proposals are of steps run ahead; with it none are made for them
    # (nor for the last step, finished once nothing is left to schedule).
    assert sum(base_calls) > 0.7 * LONG.max_tokens
    assert sum(calls) == 0 and len(calls) < 0.1 * len(base_calls)


# ---- the per-step caps, one request at a time and in numpy -------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_caps_one_request_at_a_time_equal_the_numpy_caps(seed):
    """``DraftProposer._max_drafts_one_by_one`` (small batches) against ``_max_drafts``: random
    steps over random rows (drafts verified and accepted, prefill chunks, drafts dropped
    before verification, steps run ahead, requests near max_tokens / max_model_len) give
    the same caps and leave the backoff and the rows in the same state."""
    import copy
    import types

    from pagelm.plugins.spec_decode.rows import DraftRows

    rng = np.random.default_rng(seed)
    num_rows, k, max_model_len = 12, 3, 64

    class Caps(DraftProposer):
        def propose(self, batch):
            raise AssertionError("only the caps are asked")

    def proposer():
        p = Caps.__new__(Caps)
        p.num_speculative_tokens = k
        p.rows = DraftRows(num_rows)
        p.backoff = DraftBackoff(num_rows, backoff_after=2, max_backoff_steps=16)
        return p

    one, vec = proposer(), proposer()
    requests = [
        types.SimpleNamespace(row=r, sampling_params=types.SimpleNamespace(max_tokens=int(rng.integers(20, 60))),
                              output_token_ids=[])
        for r in range(num_rows)
    ]
    top_level = 0
    for it in range(300):
        picked = rng.choice(num_rows, size=int(rng.integers(1, num_rows + 1)), replace=False)
        reqs = [requests[r] for r in picked]
        for r in picked[rng.random(len(picked)) < 0.05]:  # a new request takes the row
            one.backoff.reset(int(r))
            vec.backoff.reset(int(r))
        for r in reqs:
            r.output_token_ids = [0] * int(rng.integers(0, 60))
        n = len(reqs)
        num_drafts = np.where(rng.random(n) < 0.5, rng.integers(0, k + 1, n), 0)
        num_sampled = np.where(rng.random(n) < 0.1, 0, 1 + (rng.random(n) * (num_drafts + 1)).astype(np.int64))
        num_sampled = np.minimum(num_sampled, num_drafts + 1)
        if 100 <= it < 200:  # a stretch where the drafter does not pay: new requests start backed off
            num_sampled = np.minimum(num_sampled, np.where(rng.random(n) < 0.95, 1, 2))
        step = FinishedStep(
            requests=reqs, rows=picked.astype(np.int64), num_drafts=num_drafts, num_sampled=num_sampled,
            num_tokens=rng.integers(10, max_model_len, n), max_model_len=max_model_len, ahead=bool(rng.random() < 0.1),
        )
        got, want = one._max_drafts_one_by_one(step), vec._max_drafts(copy.copy(step))
        assert got.tolist() == want.tolist()
        # The next proposal hands out what was capped (some of it dropped before verification).
        found = np.where(rng.random(n) < 0.8, got, 0)
        one.rows.proposed[picked] = vec.rows.proposed[picked] = found
        for a, b in ((one.backoff, vec.backoff), (one.rows, vec.rows)):
            for name in ("misses", "resume_step", "gain", "level", "started", "proposed", "table_len"):
                if hasattr(a, name):
                    assert np.array_equal(getattr(a, name), getattr(b, name)), name
        assert (one.backoff.step, one.backoff.num_skipped) == (vec.backoff.step, vec.backoff.num_skipped)
        record = ("record_accepted", "record_verifications", "num_slump_starts")
        assert [getattr(one.backoff, r) for r in record] == [getattr(vec.backoff, r) for r in record]
        top_level = max(top_level, int(vec.backoff.level.max()))
    assert vec.backoff.num_skipped > 0 and (vec.backoff.misses >= 2).any() and (vec.backoff.gain > 0.3).any()
    assert vec.backoff.num_slump_starts > 0 and top_level >= 3
