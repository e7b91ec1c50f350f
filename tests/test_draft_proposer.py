"""``DraftProposer``, the drafting side of speculative decoding (``pagelm.plugins.spec_decode``),
driven through the core's contract, ``propose_step(FinishedStep)``, without an engine: how many
drafts each request may get, the token history it is handed, what it gets back."""

import numpy as np
import pytest

from pagelm.config import EngineConfig
from pagelm.plugins.spec_decode import DraftProposer
from pagelm.sampling_params import SamplingParams
from pagelm.spec_decode import FinishedStep, TargetPass
from pagelm.worker.step_state import CachedRequestState

MAX_MODEL_LEN = 64


class Recording(DraftProposer):
    """Drafts ``k`` copies of each request's last token whatever it may take, and keeps the batches."""

    name = "recording"
    needs_every_step = False

    def __init__(self, config, target, device, dtype) -> None:
        super().__init__(config, target, device, dtype)
        self.batches = []

    def propose(self, batch):
        self.batches.append(batch)
        return [[int(batch.token_ids[i, n - 1])] * self.num_speculative_tokens for i, n in enumerate(batch.num_tokens)]


def make_proposer(max_num_seqs: int = 4, **spec) -> Recording:
    config = EngineConfig(model="(test)", max_num_seqs=max_num_seqs, speculative_config={"method": "recording", "num_speculative_tokens": 3, **spec})
    return Recording(config, None, None, None)


def request(row: int, prompt: list[int], outputs: list[int] = (), max_tokens: int | None = None) -> CachedRequestState:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return CachedRequestState(f"r{row}", prompt + list(outputs), len(prompt), params, [0], False, list(outputs), row=row)


def finished(requests, num_sampled, num_drafts=None, ahead=False) -> FinishedStep:
    n = len(requests)
    num_sampled = np.asarray(num_sampled, dtype=np.int64)
    rows = np.array([r.row for r in requests])
    target = None if ahead else TargetPass(
        input_ids=None, positions=None, hidden_states=None, common=None, last_token_index=np.zeros(n, dtype=np.int64),
        last_token_position=np.zeros(n, dtype=np.int64), next_token_ids=np.zeros(n, dtype=np.int64),
        block_table_cpu=np.zeros((4, 4), dtype=np.int32), rows=rows, block_size=4, build_attention_metadata=None,
    )
    return FinishedStep(
        requests=requests, rows=rows, num_drafts=np.zeros(n, dtype=np.int64) if num_drafts is None else np.asarray(num_drafts),
        num_sampled=num_sampled, num_tokens=np.array([len(r.token_ids) for r in requests]), max_model_len=MAX_MODEL_LEN,
        ahead=ahead, make_target=lambda: target,
    )


def test_drafts_are_capped_by_max_tokens_max_model_len_and_a_chunk_that_sampled_nothing():
    proposer = make_proposer(adaptive=False)
    requests = [
        request(0, [5, 6, 7], [8]),  # room for k = 3
        request(1, [5, 6], [9, 9], max_tokens=4),  # 2 outputs left: one draft + the target's token
        request(2, list(range(1, 63)), [3]),  # 63 of 64 tokens: no room
        request(3, [4, 4, 4]),  # a prefill chunk that stops short: sampled nothing
    ]
    drafts = proposer.propose_step(finished(requests, [1, 1, 1, 0]))
    assert drafts == [[8, 8, 8], [9], [], []]
    assert proposer.batches[0].max_num_drafts.tolist() == [3, 1, 0, 0]


def test_the_token_history_holds_prompt_and_outputs_and_is_copied_incrementally():
    proposer = make_proposer(adaptive=False)
    r = request(1, [10, 11, 12], [13])
    proposer.propose_step(finished([r], [1]))
    assert proposer.batches[-1].token_ids.tolist() == [[10, 11, 12, 13]]
    r.token_ids += [14, 15]
    r.output_token_ids += [14, 15]
    proposer.propose_step(finished([r], [2], num_drafts=[1]))
    assert proposer.batches[-1].token_ids.tolist() == [[10, 11, 12, 13, 14, 15]]
    assert proposer.rows.table_len[1] == 6


def test_a_step_run_ahead_gets_no_drafts_and_propose_is_not_called():
    proposer = make_proposer()
    assert proposer.propose_step(finished([request(0, [1, 2, 3], [4])], [1], ahead=True)) == [[]]
    assert proposer.batches == []


def test_may_draft_is_false_only_before_steps_that_propose_nothing():
    """Every draft rejected: the request backs off; whenever ``may_draft`` says no (the engine
    may then run the next step ahead), the next proposal neither drafts nor calls ``propose``."""
    proposer = make_proposer(backoff_after=1, max_backoff_steps=8)
    r = request(0, [1, 2, 3], [4])
    assert proposer.may_draft([r])  # new to its row
    drafts = proposer.propose_step(finished([r], [1]))
    withheld = 0
    for _ in range(30):
        may_draft, calls = proposer.may_draft([r]), len(proposer.batches)
        r.token_ids.append(7)
        r.output_token_ids.append(7)
        drafts = proposer.propose_step(finished([r], [1], num_drafts=[len(drafts[0])]))  # all rejected
        if not may_draft:
            withheld += 1
            assert drafts == [[]] and len(proposer.batches) == calls
    assert withheld > 15 and proposer.backoff.num_skipped >= withheld
    assert proposer.may_draft([request(1, [1, 2], [3])])  # a newcomer may draft


@pytest.mark.parametrize("seed", range(3))
def test_quiet_stretches_answer_as_the_full_checks_would(seed):
    """``may_draft`` / ``skip_ahead`` / ``step_skipped`` remember a quiet stretch
    (``_QuietBatch``); over random joins, leaves, hits and misses their answers and counts
    equal those of the full checks made afresh. As the engine does, a join or leave comes as
    a new list (``Proposer.may_draft``); an unchanged set comes as that same list or, now and
    then, as a copy (a step's own list of the same requests)."""
    rng = np.random.default_rng(seed)
    proposer = make_proposer(max_num_seqs=8, backoff_after=1, max_backoff_steps=16)
    active, free, drafts, quiet_answers, views = [], list(range(8)), {}, 0, None
    for _ in range(400):
        if free and (not active or rng.random() < 0.05):  # a request joins
            active.append(request(free.pop(), [1, 2, 3], [4]))
        elif len(active) > 1 and rng.random() < 0.04:  # one leaves
            gone = active.pop(int(rng.integers(len(active))))
            free.append(gone.row)
            drafts.pop(gone.row, None)
        for gone in [r for r in active if len(r.token_ids) > MAX_MODEL_LEN - 8]:  # finished
            active.remove(gone)
            free.append(gone.row)
            drafts.pop(gone.row, None)
        if views is None or list(map(id, views)) != list(map(id, active)):
            views = list(active)  # joined or left: a new list
        seen = lambda: views if rng.random() < 0.7 else list(views)  # noqa: E731
        may_draft = proposer.may_draft(seen())
        quiet_answers += proposer._quiet_draft is not None
        proposer._quiet_draft = None
        assert may_draft == proposer.may_draft(list(active))
        for r in active:
            r.token_ids.append(7)
            r.output_token_ids.append(7)
        if may_draft:
            hits = [int(rng.random() < 0.05) for _ in active]  # drafts mostly rejected
            num_drafts = [len(drafts.get(r.row, [])) for r in active]
            out = proposer.propose_step(finished(active, [1 + min(h, d) for h, d in zip(hits, num_drafts)], num_drafts))
            drafts = {r.row: d for r, d in zip(active, out)}
            continue
        skip = proposer.skip_ahead(seen())
        proposer._quiet_skip, cached = None, proposer._quiet_skip
        assert skip == proposer.skip_ahead(list(active))
        proposer._quiet_skip = cached
        if skip:
            backoff = proposer.backoff
            want = backoff.num_skipped + sum(int(backoff.resume_step[r.row] > backoff.step) for r in active)
            proposer.step_skipped(seen())
            assert backoff.num_skipped == want
        else:
            drafts = dict(zip((r.row for r in active), proposer.propose_step(finished(active, [1] * len(active), ahead=True))))
    assert quiet_answers > 100  # the remembered answers were put to the test


@pytest.mark.parametrize("bad", [None, [5], [[1], [2]]])
def test_a_malformed_proposal_is_handed_back_for_the_engine_to_reject(bad):
    """The engine's check (``checked_drafts``) names the proposer; the base class neither
    fixes nor hides a malformed proposal."""
    proposer = make_proposer()
    proposer.propose = lambda batch: bad
    assert proposer.propose_step(finished([request(0, [1, 2, 3], [4])], [1])) is bad
