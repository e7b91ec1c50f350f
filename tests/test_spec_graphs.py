"""Verification graphs: speculative steps where every request is a decode replay a CUDA graph
of ``q = 1 + k`` query tokens per request, padded in front.

On the CPU the graphs' logic runs without CUDA: the in-graph input derivation is called
eagerly, and the whole engine runs with ``capture``/``replay`` standing in as eager calls of
the captured step (the triton backend under Triton's interpreter), so every host-side path
(staging, padding, logits rows, the proposers' view of the step) is checked here. The ``gpu``
test replays real graphs.
"""

import gc

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pagelm import LLM, SamplingParams
from pagelm.spec_decode import DeviceDrafts
from pagelm.plugins.spec_decode.backoff import DraftBackoff
from pagelm.plugins.spec_decode.eagle_train import EagleTrainConfig, train_eagle_head
from pagelm.plugins.spec_decode import eagle as eagle_proposer
from pagelm.plugins.spec_decode.eagle_graphs import EagleDraftGraphs
from pagelm.plugins.spec_decode import medusa as medusa_proposer
from pagelm.plugins.spec_decode.medusa import MedusaHeads
from pagelm.plugins.spec_decode.medusa_graphs import MedusaDraftGraphs
from pagelm.worker.cuda_graphs import PAD_TOKEN, CudaGraphRunner
from pagelm.worker.input_buffers import InputBuffers
from pagelm.worker.step_state import CachedRequestState

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


# ---- the in-graph inputs --------------------------------------------------------------------


def test_verify_graph_inputs_are_derived_from_tokens_seq_len_and_block_row():
    """q = 4: a request with 3 drafts, one with 1 (two padding tokens in front), one with none
    and a sequence shorter than q (positions clamped at 0), and a padding request."""
    buffers = InputBuffers(max_num_tokens=64, max_num_reqs=4, max_blocks_per_req=8, device=torch.device("cpu"))
    graphs = CudaGraphRunner(
        model=None, buffers=buffers, builder=None, sizes=[1, 2, 4], max_seq_len=32, block_size=4, query_len=4
    )
    block_rows = np.array([[7, 3, 9], [5, 8, 0], [6, 0, 0]], dtype=np.int32)
    tokens = [11, 12, 13, 14, PAD_TOKEN, PAD_TOKEN, 21, 22, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN, 31]
    graphs.load(tokens, np.array([10, 6, 2]), block_rows, size=4)
    graphs._derive_inputs(4)
    assert graphs.input_ids[:16].tolist() == [11, 12, 13, 14, 0, 0, 21, 22, 0, 0, 0, 31, 0, 0, 0, 0]
    assert graphs.positions[:16].tolist() == [6, 7, 8, 9, 2, 3, 4, 5, 0, 0, 0, 1, 0, 0, 0, 0]
    # position 6 -> block index 1 (id 3), offset 2; 8 -> block 9, offset 0; 4 -> block 8; 1 -> block 6
    assert graphs.slot_mapping[:16].tolist() == [
        14, 15, 36, 37, -1, -1, 32, 33, -1, -1, -1, 25, -1, -1, -1, -1,
    ]
    assert graphs.seq_lens[:4].tolist() == [10, 6, 2, 1]
    assert graphs.query_start_loc[:5].tolist() == [0, 4, 8, 12, 16]
    common = graphs.common_metadata(4)
    assert (common.num_actual_tokens, common.max_query_len, common.max_seq_len) == (16, 4, 32)


def test_one_token_graphs_keep_their_staging_layout():
    """q = 1 stages | ids [R] | seq_lens [R] | rows |, as before verification graphs."""
    buffers = InputBuffers(max_num_tokens=16, max_num_reqs=4, max_blocks_per_req=8, device=torch.device("cpu"))
    graphs = CudaGraphRunner(model=None, buffers=buffers, builder=None, sizes=[1, 2, 4], max_seq_len=32, block_size=4)
    graphs.load([11, 22], np.array([10, 2]), np.array([[7, 3, 9], [5, 0, 0]], dtype=np.int32), size=4)
    assert graphs.staging_np[:8].tolist() == [11, 22, PAD_TOKEN, PAD_TOKEN, 10, 2, 0, 0]
    assert graphs.staging_np[8:14].tolist() == [7, 3, 9, 5, 0, 0]


def _add_requests(runner, specs):
    """specs: (token_ids, num_computed) per request -> states, starts."""
    states, starts = [], []
    next_block = 1
    for i, (tokens, computed) in enumerate(specs):
        blocks = list(range(next_block, next_block + -(-(len(tokens) + 4) // runner.block_size)))
        next_block += len(blocks) + 3  # not contiguous across requests
        states.append(runner._add_state(CachedRequestState(
            req_id=f"r{i}", token_ids=list(tokens), num_prompt_tokens=len(tokens) - 2,
            sampling_params=SamplingParams(), block_ids=blocks, need_prompt_logprobs=False,
        )))
        starts.append(computed)
    return states, starts


def test_verify_graph_real_rows_equal_the_eager_steps_inputs(llama_dir):
    """The graph's rows of each request's real tokens hold exactly the ids, positions and
    slots of the eager flattened step; its seq_lens are the eager ones."""
    llm = LLM(str(llama_dir), device="cpu", dtype="float32", block_size=4, speculative_config=NGRAM)
    runner = llm.engine.core.runner
    spec = runner.spec
    spec.graphs = CudaGraphRunner(
        runner.model, runner.buffers, runner.metadata_builder, [1, 2, 4], runner.max_model_len,
        runner.block_size, query_len=4,
    )
    states, starts = _add_requests(runner, [(list(range(10, 23)), 12), (list(range(40, 46)), 5), ([7, 8], 1)])
    drafts = [(50, 51, 52), (60,), ()]
    counts = [1 + len(d) for d in drafts]
    step = spec._graph_step(runner, states, starts, counts, drafts)
    assert step is not None and step.graph_size == 4 and step.num_tokens == 12
    spec.graphs._derive_inputs(step.graph_size)
    eager = runner.prepare_inputs(states, starts, counts, allow_graph=False, drafts=drafts)

    rows = np.concatenate([np.arange(4 * i + 4 - c, 4 * i + 4) for i, c in enumerate(counts)])
    assert step.input_ids[rows].tolist() == eager.input_ids.tolist()
    assert step.positions[rows].tolist() == eager.positions.tolist()
    assert step.common.slot_mapping[rows].tolist() == eager.common.slot_mapping.tolist()
    assert step.common.seq_lens.tolist() == eager.common.seq_lens.tolist() == [16, 7, 2]
    assert step.common.seq_lens_cpu.tolist() == [16, 7, 2]
    padding = np.setdiff1d(np.arange(12), rows)
    assert (step.common.slot_mapping[padding] == -1).all()
    for state in states:
        runner._remove_state(state.req_id)


def test_a_step_with_a_prefill_chunk_is_not_a_graph_step(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", dtype="float32", block_size=4, speculative_config=NGRAM)
    runner = llm.engine.core.runner
    runner.spec.graphs = CudaGraphRunner(
        runner.model, runner.buffers, runner.metadata_builder, [1, 2, 4], runner.max_model_len,
        runner.block_size, query_len=4,
    )
    # r1 has computed 3 of its 6 tokens: a one-token chunk of its prompt, not a decode.
    states, starts = _add_requests(runner, [(list(range(10, 23)), 12), (list(range(40, 46)), 3)])
    assert runner.spec._graph_step(runner, states, starts, [3, 1], [(50, 51), ()]) is None
    for state in states:
        runner._remove_state(state.req_id)


# ---- the whole engine, graphs replayed eagerly on the CPU -----------------------------------


@pytest.fixture(scope="module")
def triton_on_cpu():
    """On CPU: the triton backend under Triton's interpreter (graph-safe, unlike torch). These
    tests emulate graphs by replaying their captured layout eagerly; on CUDA the real graphs
    are tested (``test_ngram_greedy_tokens_are_identical_with_and_without_cuda_graphs``)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("graph emulation for the CPU; CUDA runs the real graphs")
    from triton_interpreter import interpreted_kernels

    with interpreted_kernels(
        "pagelm.backends.kernels.rotary", "pagelm.backends.triton.paged_attention", "pagelm.backends.triton.kv_store"
    ):
        yield


@pytest.fixture
def eager_graphs(monkeypatch):
    """``capture`` keeps the metadata a capture would (built once per size, as the graph
    replays it) and ``replay`` runs the captured step eagerly."""

    def capture(self, pool=None):
        self._captured = {size: self.builder.build_for_cudagraph(self.common_metadata(size)) for size in self.sizes}
        if self.stage is None:  # a graph's outputs stay where the capture put them, replay after replay
            config = self.model.config
            for size in self.sizes:
                rows = size * self.query_len
                self.outputs[(size, "")] = (torch.zeros(rows, config.hidden_size), torch.zeros(rows, config.vocab_size))
        return pool

    def replay(self, size):
        self.num_replays += 1
        out = self._step(size, self._captured[size])
        if (size, "") not in self.outputs:
            return out
        kept = self.outputs[(size, "")]
        for t, new in zip(kept, out):
            t.copy_(new)
        return kept

    monkeypatch.setattr(CudaGraphRunner, "capture", capture)
    monkeypatch.setattr(CudaGraphRunner, "replay", replay)
    # The EAGLE head's drafting graphs (opt-in): the same emulation.
    monkeypatch.setattr(eagle_proposer, "DRAFT_GRAPHS_ENABLED", True)
    monkeypatch.setattr(EagleDraftGraphs, "capture", capture_drafting)
    monkeypatch.setattr(EagleDraftGraphs, "replay", replay_drafting)
    # Medusa's heads pass: captured is a no-op, a replay runs the recorded step eagerly.
    monkeypatch.setattr(medusa_proposer, "DRAFT_GRAPHS_ENABLED", True)
    monkeypatch.setattr(MedusaDraftGraphs, "capture", lambda self, pool=None: None)
    monkeypatch.setattr(MedusaDraftGraphs, "replay", replay_medusa)


def capture_drafting(self, pool=None):
    self._captured = {size: self.metadata(size) for size in self.sizes}


def replay_drafting(self, size):
    self.num_replays += 1
    return self._step(size, *self._captured[size])


def replay_medusa(self, size):
    self.num_replays += 1
    return self._step(size)


PROMPTS = [
    {"prompt_token_ids": [40, 41, 42, 43, 44] * 6},  # n-gram drafts from the start
    {"prompt_token_ids": list(range(100, 117))},  # none until the output repeats
    {"prompt_token_ids": [11, 12, 13] * 4},
    {"prompt_token_ids": list(range(200, 240))},  # chunked next to verification steps
]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 14, 23, 9)]


def _plain_tokens(model_dir):
    llm = LLM(str(model_dir), dtype="float32", block_size=8)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


class _Staged(list):
    """The ids staged for each verification graph, and how many of those steps gathered
    drafts kept on the device."""

    num_gathered = 0


def _graph_run(model_dir, speculative_config):
    """Greedy tokens with verification graphs (replayed eagerly), the runner, and the tokens
    staged for each verification replay ([n, q] per step)."""
    llm = LLM(str(model_dir), dtype="float32", block_size=8, attention_backend="triton", max_num_seqs=8,
              max_num_batched_tokens=32, speculative_config=speculative_config)
    runner = llm.engine.core.runner
    runner.capture_cuda_graphs()
    graphs = runner.spec.graphs
    staged = _Staged()
    load = graphs.load

    def recording_load(input_ids, seq_lens, block_rows, size, *rest, **kw):
        staged.append(np.asarray(input_ids).reshape(len(block_rows), -1))
        staged.num_gathered += kw.get("drafts") is not None
        return load(input_ids, seq_lens, block_rows, size, *rest, **kw)

    graphs.load = recording_load
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm, staged


def test_ngram_greedy_tokens_are_unchanged_by_verification_graphs(make_model, triton_on_cpu, eager_graphs):
    model = make_model("spec_llama", "llama")
    tokens, llm, staged = _graph_run(model, NGRAM)
    runner = llm.engine.core.runner
    assert tokens == _plain_tokens(model)
    assert runner.spec.graphs.query_len == 4 and runner.spec.graphs.sizes == [1, 2, 4, 8]
    assert runner.spec.graphs.num_replays == len(staged) > 0
    assert runner.cuda_graphs.num_replays > 0  # steps without any draft: one-token graphs
    # Some replays padded a request that had fewer than k drafts.
    assert any((rows[:, 0] == PAD_TOKEN).any() for rows in staged)
    assert llm.engine.core.scheduler.spec_decoding_stats.num_accepted_tokens > 0


def test_greedy_steps_are_judged_in_the_graph_and_processed_ones_sampled_with_the_same_tokens(
    make_model, triton_on_cpu, eager_graphs, monkeypatch
):
    """A verification graph step whose requests all take the argmax of raw logits is judged
    by the graph's verdict (``SpecDecodeRunner._judged``); one with a request whose logits
    are processed (a penalty, a logit bias with min_tokens) goes through the rejection
    sampler. The shorter requests carry the processing, so one run takes both paths; its
    tokens are those of decoding without speculation."""
    from pagelm.sample import RejectionSampler
    from pagelm.worker.spec_decode import SpecDecodeRunner

    model = make_model("spec_llama", "llama")
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, presence_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={5: 2.0}, min_tokens=2),
    ]
    plain = LLM(str(model), dtype="float32", block_size=8)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    judged, sampled = [], []
    judge, sample = SpecDecodeRunner._judged, RejectionSampler.__call__
    monkeypatch.setattr(SpecDecodeRunner, "_judged", lambda self, *a: judged.append(1) or judge(self, *a))
    monkeypatch.setattr(RejectionSampler, "__call__", lambda self, *a, **k: sampled.append(1) or sample(self, *a, **k))
    llm = LLM(str(model), dtype="float32", block_size=8, attention_backend="triton", max_num_seqs=8,
              max_num_batched_tokens=32, speculative_config=NGRAM)
    llm.engine.core.runner.capture_cuda_graphs()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == expected
    assert judged and sampled
    assert llm.engine.core.scheduler.spec_decoding_stats.num_accepted_tokens > 0


def test_eagle_drafts_the_same_from_a_verification_graph_step(make_model, tmp_path, triton_on_cpu, eager_graphs):
    """EAGLE reads the step's inputs, hidden states and layout: from a graph's padded rows
    it drafts exactly what it drafts from the eager step."""
    model = make_model("spec_llama", "llama")
    train_eagle_head(model, tmp_path / "head", EagleTrainConfig(steps=0), log=lambda *_: None)
    _drafts_the_same_with_and_without_graphs(model, {"method": "eagle", "num_speculative_tokens": 3, "model": str(tmp_path / "head")})


@pytest.mark.parametrize("follows_deep_backoff", [True, False], ids=["head-follows-every-step", "deep-backoff-skipped"])
def test_eagle_drafting_graphs_draft_what_the_eager_passes_draft(
    make_model, tmp_path, triton_on_cpu, eager_graphs, monkeypatch, follows_deep_backoff
):
    """The head's graphs (padded batches, every pass over every row): the whole proposal
    after a verification graph step, passes 2..k after any other step. Every proposal has
    exactly the drafts of the eager passes (over the requests still drafting), step by
    step, and the tokens are those of decoding without speculation. With the head made to
    follow every step (as before deep backoff), the steps after which nobody drafts replay
    pass 1 alone; by default such steps, once every request is deeply backed off, skip the
    head in both runs alike."""
    if follows_deep_backoff:
        monkeypatch.setattr(DraftBackoff, "deep", lambda self, rows: False)
    model = make_model("spec_llama", "llama")
    train_eagle_head(model, tmp_path / "head", EagleTrainConfig(steps=0), log=lambda *_: None)
    config = {"method": "eagle", "num_speculative_tokens": 3, "model": str(tmp_path / "head")}
    def graphs_state(proposer, graphs):
        if graphs:
            assert proposer.graphs.sizes == proposer.step_graphs.sizes == [1, 2, 4, 8]
            assert proposer.step_graphs.query_len == 4
            assert proposer.graphs.num_replays > 0 and proposer.step_graphs.num_replays > 0
            # Pass 1 reads each verification graph's step where its replay left it (2.23).
            assert sorted(proposer.step_graphs.sources) == [1, 2, 4, 8]
            # After decode steps every pass is one graph; a step after which nobody drafts
            # (backed off) replays pass 1 alone.
            assert proposer.decode_graphs.query_len == 1 and proposer.decode_graphs.num_replays > 0
            assert sorted(proposer.kv_graphs) == [1, 4]
            if follows_deep_backoff:
                assert proposer.kv_graphs[1].num_replays > 0
        else:
            assert proposer.graphs is None and proposer.step_graphs is None and not proposer.kv_graphs

    proposals = _proposals_with_and_without_graphs(model, config, graphs_state)
    assert proposals[True] == proposals[False]
    assert sum(len(d) for step in proposals[True] for d in step) > 0
    # Some proposals capped a request below k (near max_tokens): the graph's rows past a
    # request's cap are cut, as the eager passes never compute them.
    assert any(0 < len(d) < 3 for step in proposals[True] for d in step)


def test_eagle_pass_one_reads_the_verification_graphs_step_where_the_replay_left_it(
    make_model, tmp_path, triton_on_cpu, eager_graphs
):
    """Every step drafts and verifies (no adaptive drafting): after each verification graph
    step the head's whole-proposal graph copies that step (ids, positions, hidden states,
    slots, lengths) in-graph from the verification graph's buffers (plugin API 2.23), no
    copy from the host; its drafts are the eager passes' at every step."""
    from safetensors.torch import load_file, save_file

    model = make_model("spec_llama", "llama")
    train_eagle_head(model, tmp_path / "head", EagleTrainConfig(steps=0), log=lambda *_: None)
    # The untrained head reads the embedding alone (fc = [I | 0]): give it the hidden states too.
    weights = load_file(tmp_path / "head" / "model.safetensors")
    fc = weights["fc.weight"]
    fc[:, fc.shape[0] :] = 0.5 * torch.randn(fc.shape[0], fc.shape[1] - fc.shape[0], generator=torch.Generator().manual_seed(0))
    save_file(weights, tmp_path / "head" / "model.safetensors")
    config = {"method": "eagle", "num_speculative_tokens": 3, "model": str(tmp_path / "head"), "adaptive": False}
    copies = []

    def graphs_state(proposer, graphs):
        if graphs:
            step = proposer.step_graphs
            assert sorted(step.sources) == [1, 2, 4, 8] and step.num_replays > 10
            # The verification graph's step was already where pass 1 reads it.
            assert copies and not any(copies)

    from pagelm.plugins.spec_decode.eagle_graphs import EagleDraftGraphs

    load_step = EagleDraftGraphs.load_step

    def recording_load_step(self, target, max_drafts, block_rows, size):
        if self.query_len and self.query_len > 1:
            copies.append(target.hidden_states.data_ptr() != self.sources[size].hidden_states.data_ptr())
        return load_step(self, target, max_drafts, block_rows, size)

    EagleDraftGraphs.load_step = recording_load_step
    try:
        proposals = _proposals_with_and_without_graphs(model, config, graphs_state)
    finally:
        EagleDraftGraphs.load_step = load_step
    assert proposals[True] == proposals[False]
    assert sum(len(d) for step in proposals[True] for d in step) > 30


def test_eagle_drafting_graphs_with_a_draft_vocabulary_draft_what_the_eager_passes_draft(make_model, tmp_path, triton_on_cpu, eager_graphs):
    """A head with a draft vocabulary (16 of the 512 ids): the graphs' argmax over its rows,
    mapped back to target ids in-graph, drafts exactly what the eager passes draft, only ids
    of the vocabulary, and the tokens are those of decoding without speculation."""
    model = make_model("spec_llama", "llama")
    train_eagle_head(model, tmp_path / "head", EagleTrainConfig(steps=0, num_prompts=16, gen_len=32, draft_vocab_size=16),
                     log=lambda *_: None)
    config = {"method": "eagle", "num_speculative_tokens": 3, "model": str(tmp_path / "head")}
    vocab = {}

    def graphs_state(proposer, graphs):
        vocab[graphs] = set(proposer.lm_head.vocab.tolist())
        if graphs:
            assert proposer.graphs.num_replays > 0 and proposer.step_graphs.num_replays > 0

    proposals = _proposals_with_and_without_graphs(model, config, graphs_state)
    assert proposals[True] == proposals[False]
    drafted = {t for step in proposals[True] for d in step for t in d}
    assert len(vocab[True]) == 16 and drafted and drafted <= vocab[True]


def _proposals_with_and_without_graphs(model, config, graphs_state):
    """Every proposal (``propose``'s drafts, step by step) of a run with the drafting graphs
    captured and of one without, keyed True / False. Both runs' tokens are those of decoding
    without speculation; ``graphs_state(proposer, graphs)`` asserts what each run's graphs did."""
    proposals = {}
    for graphs in (True, False):
        llm = LLM(str(model), dtype="float32", block_size=8, attention_backend="triton", max_num_seqs=8,
                  max_num_batched_tokens=32, speculative_config=config)
        runner = llm.engine.core.runner
        if graphs:
            runner.capture_cuda_graphs()
        proposer = runner.spec.proposer
        seen = proposals[graphs] = []
        propose = proposer.propose

        def recording_propose(batch, propose=propose, seen=seen):
            drafts = propose(batch)
            # Read now: a graph's drafts are a view of its output, which the next replay rewrites.
            seen.append(drafts.tolist() if isinstance(drafts, DeviceDrafts) else drafts)
            return drafts

        proposer.propose = recording_propose
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        assert tokens == _plain_tokens(model)
        graphs_state(proposer, graphs)
        del llm, runner, proposer
        gc.collect()
    return proposals


def _medusa_heads_dir(path, hidden_size=64):
    heads = MedusaHeads(hidden_size, 3, 1)
    with torch.no_grad():
        torch.manual_seed(0)
        heads.weight.normal_(std=0.1)
    path.mkdir()
    save_file(heads.checkpoint_weights(), str(path / "model.safetensors"))
    (path / "config.json").write_text('{"medusa_num_heads": 3, "medusa_num_layers": 1}')
    return path


def test_medusa_drafts_the_same_from_a_verification_graph_step(make_model, tmp_path, triton_on_cpu, eager_graphs):
    """Medusa reads each request's last verified hidden state: from a graph's padded rows the
    same one as from the eager step."""
    model = make_model("spec_llama", "llama")
    heads = _medusa_heads_dir(tmp_path / "heads")
    _drafts_the_same_with_and_without_graphs(model, {"method": "medusa", "num_speculative_tokens": 3, "model": str(heads)})


def test_medusa_drafting_graphs_draft_what_the_eager_pass_drafts(make_model, tmp_path, triton_on_cpu, eager_graphs):
    """The heads' graphs (padded batches, all k heads on every row, cut on the host) give
    every proposal exactly the drafts of the eager pass, and the tokens are those of
    decoding without speculation."""
    model = make_model("spec_llama", "llama")
    config = {"method": "medusa", "num_speculative_tokens": 3, "model": str(_medusa_heads_dir(tmp_path / "heads"))}
    def graphs_state(proposer, graphs):
        if graphs:
            assert proposer.graphs.sizes == [1, 2, 4, 8] and proposer.graphs.num_replays > 0
        else:
            assert proposer.graphs is None

    proposals = _proposals_with_and_without_graphs(model, config, graphs_state)
    assert proposals[True] == proposals[False]
    assert sum(len(d) for step in proposals[True] for d in step) > 0
    assert any(0 < len(d) < 3 for step in proposals[True] for d in step)  # capped below k: cut on the host


def _drafts_the_same_with_and_without_graphs(model, config):
    tokens, llm, staged = _graph_run(model, config)
    assert tokens == _plain_tokens(model)
    assert llm.engine.core.runner.spec.graphs.num_replays > 0
    graph_stats = llm.engine.core.scheduler.spec_decoding_stats
    del llm
    gc.collect()

    eager = LLM(str(model), dtype="float32", block_size=8, attention_backend="triton", max_num_seqs=8,
                max_num_batched_tokens=32, speculative_config=config)
    eager.generate(PROMPTS, PARAMS, use_tqdm=False)
    eager_stats = eager.engine.core.scheduler.spec_decoding_stats
    assert (graph_stats.num_drafts, graph_stats.num_draft_tokens, graph_stats.num_accepted_tokens) == (
        eager_stats.num_drafts, eager_stats.num_draft_tokens, eager_stats.num_accepted_tokens,
    )


# ---- real graphs ----------------------------------------------------------------------------

# Real head sizes and GQA, as tests/test_gpu_fast_path.py.
GPU_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, head_dim=128)


@pytest.mark.gpu
def test_ngram_greedy_tokens_are_identical_with_and_without_cuda_graphs(make_model):
    """float32 on CUDA: eager steps, then real graphs (one-token and verification)."""
    model_dir = make_model("fast_qwen3", "qwen3", **GPU_SHAPE)
    prompts = [{"prompt_token_ids": ([7 + i, 8 + i, 9 + i, 10 + i] * 30)[: 40 + 17 * i]} for i in range(5)]
    gen = torch.Generator().manual_seed(0)
    prompts += [{"prompt_token_ids": torch.randint(5, 500, (30 + 20 * i,), generator=gen).tolist()} for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=30 + 9 * i, ignore_eos=True) for i in range(10)]
    outs, graph_replays = {}, {}
    for eager in (True, None):
        llm = LLM(str(model_dir), device="cuda", dtype="float32", attention_backend="triton", enforce_eager=eager,
                  gpu_memory_utilization=0.3, max_num_seqs=16, speculative_config=NGRAM)
        runner = llm.engine.core.runner
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        graph_replays[eager] = None if runner.spec.graphs is None else runner.spec.graphs.num_replays
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    assert graph_replays[True] is None
    assert graph_replays[None] > 0
    assert outs[True] == outs[None]


@pytest.mark.gpu
@pytest.mark.parametrize("draft_vocab_size", [None, 256], ids=["full-vocab", "draft-vocab"])
def test_eagle_greedy_tokens_are_identical_with_drafting_graphs_eagerly_and_without_speculation(
    make_model, tmp_path, monkeypatch, draft_vocab_size
):
    """float32 on CUDA: no speculation, EAGLE with every pass eager (``enforce_eager``), and
    EAGLE with real graphs (decode, verification, and the head's drafting: whole proposals
    and passes 2..k; under async scheduling) give the same greedy tokens; also with a head
    drafting over a draft vocabulary (half the ids: its argmax and id map in the graphs)."""
    monkeypatch.setattr(eagle_proposer, "DRAFT_GRAPHS_ENABLED", True)
    model_dir = make_model("fast_qwen3", "qwen3", **GPU_SHAPE)
    # A head trained briefly (an untrained one has nothing accepted, and adaptive drafting then
    # backs every request off, so no step has 1 + k tokens each and the step graphs never
    # replay): on the CPU this gives ~20 accepted drafts and ~80 uniform 1 + k steps.
    cfg = EagleTrainConfig(steps=60, num_prompts=32, gen_len=48, draft_vocab_size=draft_vocab_size)
    train_eagle_head(model_dir, tmp_path / "head", cfg, log=lambda *_: None)
    eagle = {"method": "eagle", "num_speculative_tokens": 3, "model": str(tmp_path / "head"), "adaptive": False}
    prompts = [{"prompt_token_ids": ([7 + i, 8 + i, 9 + i, 10 + i] * 30)[: 40 + 17 * i]} for i in range(5)]
    gen = torch.Generator().manual_seed(0)
    prompts += [{"prompt_token_ids": torch.randint(5, 500, (30 + 20 * i,), generator=gen).tolist()} for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=30 + 9 * i, ignore_eos=True) for i in range(10)]
    outs, replays, accepted = {}, {}, {}
    for name, spec, eager in (("plain", None, None), ("eager", eagle, True), ("graphs", eagle, None)):
        llm = LLM(str(model_dir), device="cuda", dtype="float32", attention_backend="triton", enforce_eager=eager,
                  gpu_memory_utilization=0.3, max_num_seqs=16, speculative_config=spec)
        core, proposer = llm.engine.core, None
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if spec is not None:
            proposer = core.runner.spec.proposer
            assert proposer.lm_head.size == draft_vocab_size
            replays[name] = None if proposer.graphs is None else (proposer.graphs.num_replays, proposer.step_graphs.num_replays)
            accepted[name] = core.scheduler.spec_decoding_stats.num_accepted_tokens
            if name == "graphs":
                assert core.async_scheduling
        del llm, core, proposer
        gc.collect()
        torch.cuda.empty_cache()
    assert replays["eager"] is None and min(replays["graphs"]) > 0
    assert accepted["eager"] > 0 and accepted["graphs"] > 0
    assert outs["eager"] == outs["plain"]
    assert outs["graphs"] == outs["plain"]


@pytest.mark.gpu
def test_medusa_greedy_tokens_are_identical_with_drafting_graphs_eagerly_and_without_speculation(make_model, tmp_path, monkeypatch):
    """float32 on CUDA: no speculation, Medusa with its heads' pass eager (``enforce_eager``),
    and Medusa with real graphs (decode, verification, and the heads' pass; under async
    scheduling) give the same greedy tokens."""
    from pagelm.plugins.spec_decode.medusa_train import MedusaTrainConfig, train_medusa_heads

    monkeypatch.setattr(medusa_proposer, "DRAFT_GRAPHS_ENABLED", True)
    model_dir = make_model("fast_qwen3", "qwen3", **GPU_SHAPE)
    # Trained briefly, so that some drafts are accepted and verification graphs replay.
    train_medusa_heads(model_dir, tmp_path / "heads", MedusaTrainConfig(steps=60, num_prompts=32, gen_len=48),
                       log=lambda *_: None)
    spec = {"method": "medusa", "num_speculative_tokens": 3, "model": str(tmp_path / "heads"), "adaptive": False}
    prompts = [{"prompt_token_ids": ([7 + i, 8 + i, 9 + i, 10 + i] * 30)[: 40 + 17 * i]} for i in range(5)]
    gen = torch.Generator().manual_seed(0)
    prompts += [{"prompt_token_ids": torch.randint(5, 500, (30 + 20 * i,), generator=gen).tolist()} for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=30 + 9 * i, ignore_eos=True) for i in range(10)]
    outs, replays, drafted = {}, {}, {}
    for name, config, eager in (("plain", None, None), ("eager", spec, True), ("graphs", spec, None)):
        llm = LLM(str(model_dir), device="cuda", dtype="float32", attention_backend="triton", enforce_eager=eager,
                  gpu_memory_utilization=0.3, max_num_seqs=16, speculative_config=config)
        core, proposer = llm.engine.core, None
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if config is not None:
            proposer = core.runner.spec.proposer
            replays[name] = None if proposer.graphs is None else proposer.graphs.num_replays
            drafted[name] = core.scheduler.spec_decoding_stats.num_draft_tokens
        del llm, core, proposer
        gc.collect()
        torch.cuda.empty_cache()
    assert replays["eager"] is None and replays["graphs"] > 0
    assert drafted["eager"] > 0 and drafted["graphs"] > 0
    assert outs["eager"] == outs["plain"]
    assert outs["graphs"] == outs["plain"]


def test_drafts_kept_on_the_device_verify_in_graphs_as_the_same_drafts_as_lists(make_model, triton_on_cpu, eager_graphs):
    """Drafts kept on the device (``DeviceDrafts``) reach a verification graph through its
    staging (which the graph derives its tokens and KV slots from): the drafts verified and
    accepted, and the tokens, are those of the same drafts given as lists."""
    from test_spec_device_drafts import PREFIX, OracleDevice, OracleLists
    from spec_helpers import registered_proposer

    model = make_model("spec_llama", "llama")
    plain = _plain_tokens(model)
    OracleLists.expected = {tuple(p["prompt_token_ids"][:PREFIX]): p["prompt_token_ids"] + list(o) for p, o in zip(PROMPTS, plain)}
    assert len(OracleLists.expected) == len(PROMPTS)
    runs = {}
    for cls in (OracleLists, OracleDevice):
        with registered_proposer(cls):
            tokens, llm, staged = _graph_run(model, {"method": cls.name, "num_speculative_tokens": 3, "adaptive": False})
        core = llm.engine.core
        stats = core.scheduler.spec_decoding_stats
        runs[cls.name] = (tokens, stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        assert core.runner.spec.graphs.num_replays == len(staged) > 0
        assert (staged.num_gathered > 0) == (cls is OracleDevice)
    assert runs["oracle_device"] == runs["oracle_lists"]
    assert runs["oracle_device"][0] == plain and 0 < runs["oracle_device"][3] < runs["oracle_device"][2]
