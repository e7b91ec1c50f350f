"""Drafts left on the device (``DeviceDrafts``, plugin API 2.19): the engine keeps them in a
``DraftStore`` until the next verification, and the outputs, the drafts verified and the
drafts accepted are those of the same drafts returned as host lists."""

import random

import numpy as np
import pytest
import torch

from pagelm import LLM, SamplingParams
from pagelm.engine.output_processor import OutputKind
from pagelm.sampling_params import GuidedDecodingParams
from pagelm.plugins.spec_decode import DraftProposer
from pagelm.spec_decode import DeviceDrafts
from pagelm.worker.draft_store import DEFERRED, DraftStore
from pagelm.worker.spec_decode import SpecDecodeRunner
from spec_helpers import registered_proposer

K = 3
PREFIX = 6  # the first prompt tokens name a conversation
NUM_BLOCKS = 128  # not sized from free memory: on a GPU the engines of a test share it


class OracleLists(DraftProposer):
    """Drafts the plain run's next tokens (``expected``, keyed by the prompt's first tokens),
    with the last draft wrong at every third position: some drafts accepted, some rejected."""

    name = "oracle_lists"
    needs_every_step = False
    expected: dict[tuple, list[int]] = {}

    def drafts(self, batch) -> list[list[int]]:
        out = []
        for i, (n, m) in enumerate(zip(batch.num_tokens.tolist(), batch.max_num_drafts.tolist())):
            if m == 0:  # a prefill chunk that stops short (its history may not hold the prefix yet)
                out.append([])
                continue
            full = self.expected[tuple(batch.token_ids[i, :PREFIX].tolist())]
            d = list(full[n : n + m])
            if d and n % 3 == 0:
                d[-1] = 3 if d[-1] != 3 else 4
            out.append(d)
        return out

    def propose(self, batch):
        return self.drafts(batch)


class OracleDevice(OracleLists):
    """The same drafts, left on the device (zero padded)."""

    name = "oracle_device"

    def propose(self, batch):
        drafts = self.drafts(batch)
        ids = torch.zeros((batch.num_reqs, K), dtype=torch.long, device=self.device)
        for i, d in enumerate(drafts):
            ids[i, : len(d)] = torch.tensor(d, dtype=torch.long, device=self.device)
        return DeviceDrafts(ids, np.array([len(d) for d in drafts], dtype=np.int64))


def prompts():
    gen = torch.Generator().manual_seed(5)
    return [{"prompt_token_ids": torch.randint(3, 64, (int(n),), generator=gen).tolist()} for n in (9, 40, 17, 70, 12, 33)]


def params(penalty: bool):
    out = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (20, 7, 31, 12)
    ] + [SamplingParams(temperature=0.9, seed=11, max_tokens=25, ignore_eos=True)]
    last = dict(repetition_penalty=1.3) if penalty else {}
    return out + [SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True, **last)]


def generate(model, ps, method=None, **kw):
    spec = None if method is None else {"method": method, "num_speculative_tokens": K, "adaptive": False}
    llm = LLM(str(model), dtype="float32", max_num_seqs=4, max_num_batched_tokens=48, num_kv_blocks=NUM_BLOCKS,
              speculative_config=spec, **kw)
    outs = llm.generate(prompts(), ps, use_tqdm=False)
    core = llm.engine.core
    assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks
    return core, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("penalty", [False, True], ids=["device", "a-penalty-reads-drafts"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_device_drafts_verify_as_the_same_drafts_as_lists(llama_dir, penalty, async_scheduling):
    model = llama_dir
    ps = params(penalty)
    _, plain = generate(model, ps)
    OracleLists.expected = {tuple(p["prompt_token_ids"][:PREFIX]): p["prompt_token_ids"] + list(o) for p, o in zip(prompts(), plain)}
    runs = {}
    for cls in (OracleLists, OracleDevice):
        with registered_proposer(cls):
            core, tokens = generate(model, ps, cls.name, async_scheduling=async_scheduling)
        stats = core.scheduler.spec_decoding_stats
        runs[cls.name] = (tokens, stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, core.runner.spec.store)
    assert runs["oracle_lists"][0] == plain and runs["oracle_device"][0] == plain
    assert runs["oracle_lists"][1:4] == runs["oracle_device"][1:4]
    _, num_drafts, drafted, accepted, store = runs["oracle_device"]
    assert 0 < accepted < drafted
    assert runs["oracle_lists"][4] is None
    # The penalised request's steps read their drafts on the host; the others' stay on the device.
    assert store is not None


def test_a_guided_request_reads_its_drafts_on_the_host(llama_dir):
    pytest.importorskip("xgrammar")
    model = llama_dir
    ps = params(False)
    _, plain = generate(model, ps)
    OracleLists.expected = {tuple(p["prompt_token_ids"][:PREFIX]): p["prompt_token_ids"] + list(o) for p, o in zip(prompts(), plain)}
    with registered_proposer(OracleDevice):
        llm = LLM(str(model), dtype="float32", max_num_seqs=4, num_kv_blocks=NUM_BLOCKS,
                  speculative_config={"method": "oracle_device", "num_speculative_tokens": K})
        spec = llm.engine.core.runner.spec
        kept = []
        keep = spec._may_keep_on_device
        spec._may_keep_on_device = lambda runner, states: kept.append(keep(runner, states)) or kept[-1]
        guided = SamplingParams(temperature=0.0, max_tokens=4, guided_decoding=GuidedDecodingParams(regex="[ab]{4}"))
        outs = llm.generate([prompts()[1], prompts()[0]], [guided, ps[0]], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == plain[0]
    # On the device before the guided request joins (once its grammar compiles), then read
    # on the host while it runs.
    assert kept[0] is True and False in kept


def test_the_store_fills_a_verification_graphs_inputs_on_the_device():
    """What a verification graph runs on (``CudaGraphRunner`` with ``draft_source``, its
    in-graph prologue run eagerly on CPU): each deferred request's drafts from its row,
    clamped into the vocabulary, with slots for them as for staged ids; host values as kept."""
    from pagelm.worker.cuda_graphs import PAD_TOKEN, CudaGraphRunner
    from pagelm.worker.input_buffers import InputBuffers

    store = DraftStore(max_rows=4, num_speculative_tokens=K, vocab_size=50, device=torch.device("cpu"))
    first = store.keep(np.array([2, 0]), DeviceDrafts(torch.tensor([[7, 8, 9], [4, 0, 0]]), np.array([3, 1])))
    assert first == [[DEFERRED] * 3, [DEFERRED]]
    # A later proposal for row 1 alone leaves rows 0 and 2 as they were.
    assert store.keep(np.array([1]), DeviceDrafts(torch.tensor([[60, 5]]), np.array([2]))) == [[DEFERRED] * 2]
    q = 1 + K
    buffers = InputBuffers(max_num_tokens=16, max_num_reqs=4, max_blocks_per_req=8, device=torch.device("cpu"))
    graphs = CudaGraphRunner(model=None, buffers=buffers, builder=None, sizes=[1, 2, 4], max_seq_len=128,
                             block_size=4, query_len=q, draft_source=(store.ids.view(-1), 50))
    # Rows 2, 1 and 0 with 3, 2 and 1 drafts (padding in front), then a request with a host draft.
    drafts = [[DEFERRED] * 3, [DEFERRED] * 2, [DEFERRED] * 1, [33]]
    rows = np.array([2, 1, 0, 3])
    P = PAD_TOKEN
    tokens = np.array([[11, P, P, P], [P, 12, P, P], [P, P, 13, P], [P, P, 14, 33]]).reshape(-1)
    at = np.array([1, 2, 3, q + 2, q + 3, 2 * q + 3])
    sources = store.sources(rows, np.array([3, 2, 1, 0]))
    block_rows = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]], dtype=np.int32)
    assert graphs.load(tokens, np.array([10, 10, 10, 10]), block_rows, size=4, drafts=(at, sources))
    graphs._derive_inputs(4)
    assert graphs.input_ids.view(4, q).tolist() == [[11, 7, 8, 9], [0, 12, 49, 5], [0, 0, 13, 4], [0, 0, 14, 33]]
    # Every draft position stores its key, padding does not: positions 6..9, 9 in the row's
    # third block at offset 1; the second request's 7 and 8 at the ends of its second and third.
    assert graphs.slot_mapping.view(4, q)[:, 3].tolist() == [3 * 4 + 1, 6 * 4 + 1, 9 * 4 + 1, 12 * 4 + 1]
    assert graphs.slot_mapping.view(4, q)[1].tolist() == [-1, 5 * 4 + 3, 6 * 4 + 0, 6 * 4 + 1]
    # A step with nothing deferred stages no source: last step's are cleared.
    assert graphs.load(tokens.clip(min=P), np.array([10, 10, 10, 10]), block_rows, size=4)
    graphs._derive_inputs(4)
    assert graphs.input_ids.view(4, q)[0].tolist() == [11, 0, 0, 0]
    with pytest.raises(Exception, match=r"outside the vocabulary \[0, 50\): \[7, 8, 9, 60, 5, 4\]"):
        store.resolve(_named(), drafts[:3], rows[:3])
    assert store.resolve(_named(), [[DEFERRED] * 2, [1, 2]], np.array([2, 3])) == [[7, 8], [1, 2]]


def test_a_greedy_verification_is_judged_in_the_graph_as_the_host_would():
    """``CudaGraphRunner.verdict`` (the argmax and the matches, worked out in the graph) gives
    each request the tokens the rejection sampler gives from the logits and the drafts read
    back; a kept draft outside the vocabulary is reported naming the proposer."""
    from pagelm.registry import PluginError
    from pagelm.sample import RejectionSampler
    from pagelm.worker.cuda_graphs import PAD_TOKEN, CudaGraphRunner
    from pagelm.worker.input_buffers import InputBuffers

    vocab, q = 50, 1 + K
    store = DraftStore(max_rows=4, num_speculative_tokens=K, vocab_size=vocab, device=torch.device("cpu"))
    store.keep(np.array([2, 0]), DeviceDrafts(torch.tensor([[7, 8, 9], [4, 0, 0]]), np.array([3, 1])))
    buffers = InputBuffers(max_num_tokens=16, max_num_reqs=4, max_blocks_per_req=8, device=torch.device("cpu"))
    graphs = CudaGraphRunner(model=None, buffers=buffers, builder=None, sizes=[1, 2, 4], max_seq_len=128,
                             block_size=4, query_len=q, draft_source=(store.ids.view(-1), vocab))
    spec = SpecDecodeRunner(_named(), K, max_model_len=128)
    spec.store = store
    # Rows 2 and 0 with 3 and 1 kept drafts, then a request with a host draft: padding in front.
    drafts = [[DEFERRED] * 3, [DEFERRED], [33]]
    host_drafts = [[7, 8, 9], [4], [33]]
    rows, counts, P = np.array([2, 0, 3]), [4, 2, 2], PAD_TOKEN
    tokens = np.array([[11, P, P, P], [P, P, 13, P], [P, P, 14, 33]]).reshape(-1)
    at, sources = np.array([1, 2, 3, q + 3]), store.sources(rows, np.array([3, 1, 0]))
    block_rows = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=np.int32)
    assert graphs.load(tokens, np.array([10, 10, 10]), block_rows, size=4, drafts=(at, sources))
    graphs._derive_inputs(4)
    # The target's argmax row by row: 7, 8 accepted and 5 in place of 9; 4 accepted, then 11;
    # 12 in place of 33. Random logits elsewhere.
    logits = torch.randn(4 * q, vocab, generator=torch.Generator().manual_seed(0))
    for row, token in ((0, 7), (1, 8), (2, 5), (q + 2, 4), (q + 3, 11), (2 * q + 2, 12)):
        logits[row, token] = 100.0
    graphs._judge(3 * q, logits[: 3 * q])
    judged = spec._judged(graphs.verdict(3 * q), q, counts, [3, 1, 1], drafts, rows)
    real_rows = [0, 1, 2, 3, q + 2, q + 3, 2 * q + 2, 2 * q + 3]
    assert judged == RejectionSampler().verify_argmax(logits[real_rows], host_drafts).token_ids
    assert judged == [[7, 8, 5], [4, 11], [12]]
    # A kept draft outside the vocabulary: the graph clamps it, the host names the proposer.
    store.keep(np.array([0]), DeviceDrafts(torch.tensor([[60, 0, 0]]), np.array([1])))
    assert graphs.load(tokens, np.array([10, 10, 10]), block_rows, size=4, drafts=(at, sources))
    graphs._derive_inputs(4)
    graphs._judge(3 * q, logits[: 3 * q])
    assert graphs.verdict(3 * q)[2].tolist() == [0] * (q + 3) + [1] + [0] * q
    with pytest.raises(PluginError, match=r"proposer 'p' .* outside the vocabulary \[0, 50\)"):
        spec._judged(graphs.verdict(3 * q), q, counts, [3, 1, 1], drafts, rows)


def _named():
    class P:
        name = "p"

    return P()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_arrivals_aborts_and_preemptions_with_device_drafts_lose_no_token(llama_dir, seed):
    """Requests arrive at random steps, some are aborted mid-run, and a small KV pool preempts
    others (their drafts, kept on the device, are dropped with them): every request's tokens
    are the plain run's (a prefix of them when aborted), every block returns, and the drafts
    verified and accepted are those of the same drafts as lists under the same schedule
    (verification is lossless whatever the drafts: only the acceptance shows a wrong one)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    ps = [{"prompt_token_ids": torch.randint(3, 64, (rng.randint(8, 40),), generator=gen).tolist()} for _ in range(10)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(8, 40), ignore_eos=True) for _ in ps]
    plain = [o.outputs[0].token_ids for o in LLM(str(llama_dir), dtype="float32", num_kv_blocks=NUM_BLOCKS).generate(
        ps, params, use_tqdm=False)]
    # Distinct prompts' first tokens name them; the oracle drafts the plain run, every third position's last draft wrong.
    OracleLists.expected = {tuple(p["prompt_token_ids"][:PREFIX]): p["prompt_token_ids"] + list(o) for p, o in zip(ps, plain)}
    assert len(OracleLists.expected) == len(ps)
    arrivals = sorted(rng.randint(0, 12) for _ in ps)
    aborts = {rng.randint(2, 20): str(i) for i in rng.sample(range(len(ps)), 3)}
    runs = {}
    for cls in (OracleLists, OracleDevice):
        with registered_proposer(cls):
            llm = LLM(str(llama_dir), dtype="float32", block_size=8, num_kv_blocks=14, max_model_len=96, max_num_seqs=6,
                      speculative_config={"method": cls.name, "num_speculative_tokens": K, "adaptive": False})
            engine, core = llm.engine, llm.engine.core
            streamed = {str(i): [] for i in range(len(ps))}
            step = added = 0
            while added < len(ps) or engine.has_unfinished_requests():
                while added < len(ps) and arrivals[added] <= step:
                    engine.add_request(str(added), ps[added], params[added], output_kind=OutputKind.DELTA)
                    added += 1
                for out in engine.step():
                    streamed[out.request_id].extend(out.outputs[0].token_ids)
                if step in aborts:
                    engine.abort_request([aborts[step]])
                step += 1
            stats = core.scheduler.spec_decoding_stats
            runs[cls.name] = (streamed, stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
            assert core.scheduler.num_preemptions > 0 and stats.num_accepted_tokens > 0
            assert core.kv_cache_manager.num_free_blocks == core.num_kv_blocks
            assert (core.runner.spec.store is not None) == (cls is OracleDevice)
    assert runs["oracle_device"] == runs["oracle_lists"]
    for i, tokens in enumerate(runs["oracle_device"][0].values()):
        if str(i) in aborts.values():
            assert tokens == plain[i][: len(tokens)]
        else:
            assert tokens == plain[i]


def test_the_store_keeps_drafts_of_consecutive_and_scattered_rows_alike():
    """``keep`` writes consecutive rows as one slice and others by an index: the same ids
    either way, other rows untouched."""
    store = DraftStore(max_rows=5, num_speculative_tokens=K, vocab_size=50, device=torch.device("cpu"))
    store.keep(np.array([1, 2, 3]), DeviceDrafts(torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]]), np.array([3, 2, 1])))
    store.keep(np.array([4, 0]), DeviceDrafts(torch.tensor([[11, 12], [13, 14]]), np.array([2, 2])))
    assert store.ids.tolist() == [[13, 14, 0], [1, 2, 3], [4, 5, 6], [7, 8, 9], [11, 12, 0]]
