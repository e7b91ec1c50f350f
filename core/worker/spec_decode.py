"""The model runner's side of speculative decoding: drafts verified in the same flattened
batch as every other token, and the proposer's view of the step.

A request with drafts ``d1..dk`` is scheduled ``1 + k`` tokens (its last known token, then
the drafts); the logits of all ``1 + k`` positions are computed, one row each::

    input_ids   | r0: prefill chunk ...... | r1: x  d1 d2 d3 | r2: y |
    logits rows                          p0  ^  ^  ^  ^         ^
                                             r1: 4 rows       r2: 1 row

The rejection sampler turns them into the accepted drafts plus one token of the target's.

On CUDA, a step where every request is a decode (its last known token, then 0..k drafts)
replays a *verification graph*: ``q = 1 + k`` query tokens per request, a request with fewer
drafts padded in front (``CudaGraphRunner`` has the layout), logits for all ``q`` rows, of
which the rejection sampler reads each request's last ``1 + d``::

    graph rows  | r1: x  d1 d2 d3 | r2: -  -  -  y |      (q = 4; - = padding, slot -1)

Steps mixing prefill chunks with drafts run eagerly, as do batches above the largest
captured size and backends whose ``graph_support`` is not ``ALWAYS`` (FlashInfer). A step with no
drafts at all is plain decode (the one-token graphs). The proposer runs after verification
(it may replay graphs of its own, ``Proposer.capture_cuda_graphs``: EAGLE's drafting
passes): it gets the step as a ``FinishedStep``
(``pagelm.spec_decode.proposer``) and says which requests draft how many tokens; the engine
checks what it returns. Drafts it leaves on the device (``DeviceDrafts``) stay there
(``pagelm.worker.draft_store``) when nothing on the host must read them before the next
verification: that step takes them by a device copy, and the host waits for the drafting
only with the verification itself.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import torch

from pagelm.attention import CommonAttentionMetadata, GraphSupport
from pagelm.kv_cache import cdiv
from pagelm.sample import RejectionSampler
from pagelm.sample.sampler import LogprobsTensors
from pagelm.sampling_params import num_logprobs
from pagelm.spec_decode.proposer import (
    DeviceDrafts,
    DraftGraphSetup,
    FinishedStep,
    Proposer,
    TargetPass,
    VerificationBuffers,
    checked_device_drafts,
    checked_drafts,
    decode_attention_metadata,
)
from pagelm.worker.cuda_graphs import PAD_TOKEN, CudaGraphRunner, capture_sizes
from pagelm.worker.draft_store import DEFERRED, DraftStore
from pagelm.worker.output import LogprobsLists, ModelRunnerOutput
from pagelm.worker.pending_step import logprobs_lists
from pagelm.worker.sampling_inputs import build_sampling_metadata, to_device
from pagelm.worker.step_state import StepInputs, host_sync_point

logger = logging.getLogger("pagelm")

# Verification graphs are captured for batches up to this size. Each captured size keeps its
# own [size * q, vocab] logits alive (about 100 MB over the sizes 1..32 at q = 4 and a
# 152k vocabulary in bf16), and each costs a capture at start-up; past 32 requests of q
# tokens a step is large enough that launch overhead matters much less.
MAX_VERIFY_GRAPH_BATCH = 32


@dataclass
class VerifyGraphStep:
    """A verification step as a replay of a captured graph: the ``n`` real requests' view of
    the graph's buffers (``q`` rows each, padding in front), which the graph fills when it
    replays. ``common.query_start_loc_cpu`` is ``arange * q``; host copies are real."""

    graph_size: int
    query_len: int  # q
    common: CommonAttentionMetadata
    input_ids: torch.Tensor  # [n * q]
    positions: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.common.num_actual_tokens


@dataclass(slots=True)
class _DraftRow:
    """One verification row: the request's state as plain decoding would see it when
    sampling this token (its outputs so far plus the drafts before it), for the sampling
    metadata (penalties, min_tokens, seeds keyed on the output index)."""

    sampling_params: object
    output_token_ids: list[int] | _Length
    num_prompt_tokens: int
    token_ids: list[int]
    logits_row: torch.Tensor | None  # the request's (logit_bias, allowed_token_ids, bad_words)


class SpecDecodeRunner:
    """The model runner's speculative part: verification steps (graph or eager), the
    rejection sampler, and handing each finished step to the proposer. It calls only public
    ``ModelRunner`` methods and attributes; the runner calls ``execute``, ``propose``,
    ``capture_cuda_graphs`` / ``release_cuda_graphs``, ``keep_in_flight`` and its
    ``proposer``'s ``may_draft`` / ``attention_layers``."""

    def __init__(
        self, proposer: Proposer | None, num_speculative_tokens: int, max_model_len: int,
        drafts_from_last_stage: bool = False,
    ) -> None:
        # None: a pipeline stage before the last, whose drafts come from the last stage.
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        # Pipeline parallelism with a proposer that reads the target's pass: it lives on the
        # last stage, which sends each proposal to rank 0 (``PipelineStage.share_drafts``).
        self.drafts_from_last_stage = drafts_from_last_stage
        # Whether a launched step's inputs must outlive later launches: the last stage
        # proposes from a step when the engine finishes it, after later steps are launched.
        self.keeps_launched_steps = drafts_from_last_stage and proposer is not None
        self.rejection_sampler = RejectionSampler()
        self.graphs: CudaGraphRunner | None = None  # verification graphs (CUDA only)
        self.store: DraftStore | None = None  # drafts kept on the device (made at the first)

    # ---- verification graphs -------------------------------------------------------------
    def capture_cuda_graphs(self, runner, pool: tuple[int, int] | None) -> None:
        """Capture verification graphs (``q = 1 + k`` tokens per request) into ``pool``, for
        batch sizes up to ``MAX_VERIFY_GRAPH_BATCH``, when the attention backend can; then
        let the proposer capture its own (``Proposer.capture_cuda_graphs``)."""
        self._capture_verify_graphs(runner, pool)
        if self.proposer is not None:
            self.proposer.capture_cuda_graphs(DraftGraphSetup(
                builder=runner.metadata_builder,
                graph_support=runner.backend.graph_support,
                sizes=capture_sizes(runner.max_num_reqs, runner.config.max_num_batched_tokens),
                max_model_len=runner.max_model_len,
                block_size=runner.block_size,
                max_blocks_per_req=runner.buffers.max_blocks_per_req,
                device=runner.device,
                pool=pool,
                verify_buffers=self._verify_buffers(),
            ))

    def _verify_buffers(self) -> dict[int, VerificationBuffers]:
        """Each verification graph's tensors, for a proposer's graphs to read in-graph (one
        variant per size: a backend with variants leaves each its own outputs)."""
        graphs = self.graphs
        if graphs is None or graphs.variants != ("",):
            return {}
        q = graphs.query_len
        return {
            size: VerificationBuffers(
                input_ids=graphs.input_ids[: size * q],
                positions=graphs.positions[: size * q],
                hidden_states=graphs.outputs[(size, "")][0],
                slot_mapping=graphs.slot_mapping[: size * q],
                seq_lens=graphs.seq_lens[:size],
            )
            for size in graphs.sizes
            if (size, "") in graphs.outputs
        }

    def _capture_verify_graphs(self, runner, pool: tuple[int, int] | None) -> None:
        if runner.backend.graph_support != GraphSupport.ALWAYS:
            logger.info(
                "attention backend %r has no verification graphs: steps verifying drafts run eagerly",
                runner.backend.name,
            )
            return
        q = 1 + self.num_speculative_tokens
        max_reqs = min(runner.max_num_reqs, MAX_VERIFY_GRAPH_BATCH)
        max_reqs_by_tokens = runner.config.max_num_batched_tokens // q
        if min(max_reqs, max_reqs_by_tokens) < 1:
            return
        draft_source = None
        if self.proposer is not None and self._may_keep_on_device(runner, ()):
            # Made now, so that the graphs gather the drafts kept there themselves.
            self.store = DraftStore(runner.max_num_reqs, self.num_speculative_tokens, runner.vocab_size, runner.device)
            draft_source = (self.store.ids.view(-1), runner.vocab_size)
        self.graphs = CudaGraphRunner(
            runner.model, runner.buffers, runner.metadata_builder, capture_sizes(max_reqs, max_reqs_by_tokens),
            runner.max_model_len, runner.block_size, query_len=q, draft_source=draft_source,
        )
        self.graphs.capture(pool)

    def release_cuda_graphs(self) -> None:
        self.graphs = None
        if self.proposer is not None:
            self.proposer.release_cuda_graphs()

    def _graph_step(self, runner, states, starts, counts, drafts) -> VerifyGraphStep | None:
        """The step staged for a verification graph, when every request is a decode (its
        last known token, then its drafts) and a captured size holds the batch; None: run
        it eagerly."""
        graphs = self.graphs
        size = None if graphs is None else graphs.padded_size(len(states))
        if size is None:
            return None
        n, q = len(states), graphs.query_len
        # Plain lists, one pass: numpy item writes and small-array calls cost more here.
        ids: list[int] = []  # q per request, padding in front
        at: list[int] = []  # flat positions of drafts kept on the device (staged as padding)
        sources: list[int] = []  # and where each sits in the store (``DraftStore.ids``, flat)
        rows: list[int] = []
        for i, (state, start, count, d) in enumerate(zip(states, starts, counts, drafts)):
            if count != 1 + len(d) or start + 1 != len(state.token_ids):
                return None  # a prefill chunk
            assert count <= q, f"{len(d)} drafts, more than num_speculative_tokens={q - 1}"
            if count < q:
                ids.extend([PAD_TOKEN] * (q - count))
            ids.append(state.token_ids[start])
            rows.append(state.row)
            if len(d) and d[0] == DEFERRED:  # the graph takes these from the store
                first = i * q + q - count + 1
                at.extend(range(first, first + len(d)))
                sources.extend(self.store.sources_of(state.row, len(d)))
                ids.extend([PAD_TOKEN] * len(d))
            else:
                ids.extend(d)
        seq_lens = np.array([s + c for s, c in zip(starts, counts)], dtype=np.int64)
        table_rows = runner.block_table_cpu[rows, : cdiv(int(seq_lens.max()), runner.block_size)]
        gather = None
        if at:
            if graphs.draft_source is None:
                return None
            gather = (np.array(at, dtype=np.int64), np.array(sources, dtype=np.int64))
        if not graphs.load(ids, seq_lens, table_rows, size, drafts=gather):
            return None
        common = graphs.common_metadata(n, torch.from_numpy(seq_lens.astype(np.int32)))
        common.block_table_cpu = torch.from_numpy(table_rows)
        return VerifyGraphStep(size, q, common, graphs.input_ids[: n * q], graphs.positions[: n * q])

    # ---- verification --------------------------------------------------------------------
    def execute(self, runner, sched, req_ids, states, starts, counts, drafts) -> ModelRunnerOutput:
        """Forward pass, verification and proposal for a step where some requests carry drafts."""
        deferred = self.store is not None and DraftStore.is_deferred(drafts)
        req_rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states)) if deferred else None
        step = self._graph_step(runner, states, starts, counts, drafts)
        if step is None:
            if deferred:  # an eager step reads its drafts on the host: wait for them now
                with host_sync_point():
                    drafts, deferred = self.store.resolve(self.proposer, drafts, req_rows), False
            step = runner.prepare_inputs(states, starts, counts, drafts=drafts)
        graph_out = None
        if isinstance(step, VerifyGraphStep):  # launched first: the host work below overlaps it
            graph_out = self.graphs.replay(step.graph_size)
        num_drafts = [len(d) for d in drafts]
        firsts, row_start, logits_rows = _logits_rows(step, counts, num_drafts)
        md = None  # every row an argmax of the raw logits: none needed
        if runner.pipeline is not None or sched.structured_output_request_ids or not all(s.argmax_only for s in states):
            md = self._sampling_metadata(runner, states, drafts)
        # A greedy step replayed as a graph was judged in it (``CudaGraphRunner.verdict``): the
        # host reads the argmax and the matches, not the logits and not the drafts.
        verdict = self.graphs.verdict(step.num_tokens) if md is None and graph_out is not None else None
        if graph_out is not None:
            hidden, logits = graph_out
            hidden = hidden[: step.num_tokens]
            # Every row of the step's output, in order (each request verifies k drafts, no
            # padding): taken as it is, with no index to upload.
            every_row = logits_rows[-1] == len(logits_rows) - 1
            if verdict is None:
                logits = logits[: len(logits_rows)] if every_row else logits[to_device(logits_rows, torch.long, runner.device)]
        else:
            index = to_device(logits_rows, torch.long, runner.device)
            logits, hidden = runner.compute_logits(step, return_hidden=True, logits_indices=index)
        if sched.structured_output_request_ids and logits is not None:
            # A guided request's 1 + d rows from row_start: what its grammar allows after each
            # prefix of its drafts. The rejection sampler then verifies against masked logits.
            runner.apply_grammar(logits, sched, req_ids, rows_of=row_start)
        with host_sync_point():  # the verified tokens (and logprobs) come to the host
            if verdict is not None:
                token_ids = self._judged(verdict, step.query_len, counts, num_drafts, drafts if deferred else None, req_rows)
                logprobs_t = None
                prompt_logprobs = runner.prompt_logprobs(states, starts, counts, hidden, firsts)
            else:
                if deferred:  # the drafting ran before this step on the device: its drafts are in
                    drafts = self.store.resolve(self.proposer, drafts, req_rows)
                if runner.pipeline is None:
                    draft_lists = [list(d) for d in drafts]
                    if md is None:
                        verified = self.rejection_sampler.verify_argmax(logits, draft_lists)
                    else:
                        verified = self.rejection_sampler(logits, md, draft_lists, runner.generator)
                    token_ids, logprobs_t = verified.token_ids, verified.logprobs
                    prompt_logprobs = runner.prompt_logprobs(states, starts, counts, hidden, firsts)
                else:
                    token_ids, logprobs_t, prompt_logprobs = self._verify_pipelined(
                        runner, logits, md, drafts, states, starts, counts, hidden, firsts
                    )
            logprobs = _split_logprobs(logprobs_t, states, row_start, token_ids, runner.vocab_size)

        out_ids: list[list[int]] = []
        for state, start, count, tokens in zip(states, starts, counts, token_ids):
            if start + count >= len(state.token_ids):  # reached the end: the sample is real
                state.token_ids.extend(tokens)
                state.output_token_ids.extend(tokens)
                out_ids.append(tokens)
            else:  # a prefill chunk that stops short (it has no drafts)
                out_ids.append([])
        logprobs = [lp if tokens else None for lp, tokens in zip(logprobs, out_ids)]
        out = ModelRunnerOutput(req_ids, out_ids, logprobs, prompt_logprobs)
        out.draft_token_ids = self.propose(runner, step, hidden, states, starts, counts, num_drafts, out_ids)
        return out

    @staticmethod
    def _sampling_metadata(runner, states, drafts):
        """One metadata row per verification row: request ``i``'s ``1 + d_i`` rows, row ``j``
        seeing its outputs then its first ``j`` drafts, as plain decoding would."""
        # Penalties and bad words read each row's output history; otherwise only its length
        # matters (seeds keyed on the output index, min_tokens), and no history is copied.
        history = any(_reads_history(s.sampling_params) for s in states)
        rows = [
            _DraftRow(
                s.sampling_params, _outputs_at(s.output_token_ids, d, j, history), s.num_prompt_tokens, s.token_ids,
                s.logits_row,
            )
            for s, d in zip(states, drafts)
            for j in range(len(d) + 1)
        ]
        return build_sampling_metadata(rows, runner.eos_token_ids, runner.vocab_size, runner.device)

    def _judged(self, verdict, q: int, counts, num_drafts, kept_drafts, req_rows) -> list[list[int]]:
        """Each request's tokens from a verification graph's ``verdict`` (one host read): its
        leading drafts that equal the target's argmax, then the argmax after them. A draft
        gathered from the store out of the vocabulary (``kept_drafts``: the step's drafts, when
        some were kept on the device) is reported as the host check would, naming the proposer."""
        best, match, out_of_vocab = verdict.tolist()
        if kept_drafts is not None and any(out_of_vocab):
            self.store.resolve(self.proposer, kept_drafts, req_rows)  # raises: it names the proposer
        tokens = []
        for i, (count, d) in enumerate(zip(counts, num_drafts)):
            row = i * q + q - count  # the request's first row (padding in front)
            a = 0
            while a < d and match[row + a]:
                a += 1
            tokens.append(best[row : row + a + 1])
        return tokens

    def _verify_pipelined(self, runner, logits, md, drafts, states, starts, counts, hidden, first):
        """Pipeline parallelism: the last stage (``logits`` not None) verifies; its tokens
        reach every rank and its logprobs and prompt logprobs rank 0 (``PipelineStage``).
        Returns (token ids per request, logprobs rows or None, prompt logprobs lists)."""
        verified, prompt_tensors = None, {}
        if logits is not None:
            verified = self.rejection_sampler(logits, md, [list(d) for d in drafts], runner.generator)
            prompt_tensors = runner.prompt_logprobs_tensors(states, starts, counts, hidden, first)
        token_ids = runner.pipeline.share_verified(
            None if verified is None else verified.token_ids, [len(d) for d in drafts]
        )
        logprobs, prompt_tensors = runner.pipeline.share_logprobs(
            None if verified is None else verified.logprobs, sum(len(d) + 1 for d in drafts), md.max_num_logprobs,
            prompt_tensors, runner.prompt_logprobs_rows(states, starts, counts),
        )
        return token_ids, logprobs, {r: logprobs_lists(t) for r, t in prompt_tensors.items()}

    # ---- proposal ------------------------------------------------------------------------
    def propose(
        self, runner, step, hidden, states, starts, counts, num_drafts, out_ids, ahead: bool = False
    ) -> list[list[int]]:
        """Drafts for the next step, for every request of this one (``[]`` for none), from
        the proposer, checked. ``ahead``: the next step is already launched (async
        scheduling), so drafts would come too late; the engine launched it only because the
        proposer said nobody may draft (``Proposer.may_draft``)."""
        n = len(states)
        if self.proposer is None:  # a stage before the last: rank 0 receives the last stage's
            return runner.pipeline.share_drafts(None, n, self.num_speculative_tokens)
        assert not (ahead and self.proposer.needs_every_step), f"proposer {self.proposer.name!r} ran behind a launched step"
        drafted = [0] * n if num_drafts is None else num_drafts
        sampled = [len(o) for o in out_ids]
        rows = np.array([s.row for s in states], dtype=np.int64)
        finished = FinishedStep(
            requests=states,
            rows=rows,
            num_drafts=np.array(drafted, dtype=np.int64),
            num_sampled=np.array(sampled, dtype=np.int64),
            # Known tokens after this step (a step launched since then has left a placeholder
            # past them): the step's end, less rejected drafts, plus what it emitted.
            num_tokens=np.array([s + c - d + m for s, c, d, m in zip(starts, counts, drafted, sampled)], dtype=np.int64),
            max_model_len=self.max_model_len,
            ahead=ahead,
        )
        if not ahead or self.proposer.needs_ahead_target:
            finished.make_target = lambda: self._target_pass(runner, step, hidden, finished, starts, counts, out_ids)
        with host_sync_point():  # a proposer that returns lists reads its drafts on the host
            drafts = self.proposer.propose_step(finished)
        if isinstance(drafts, DeviceDrafts):
            drafts = checked_device_drafts(self.proposer, drafts, n, runner.device)
            if self._may_keep_on_device(runner, states):
                if self.store is None:
                    self.store = DraftStore(runner.max_num_reqs, self.num_speculative_tokens, runner.vocab_size, runner.device)
                return self.store.keep(rows, drafts)
            with host_sync_point():  # read on the host before the next step: the proposal's one sync
                drafts = drafts.tolist()
        drafts = checked_drafts(self.proposer, drafts, n, runner.vocab_size)
        if self.drafts_from_last_stage:
            return runner.pipeline.share_drafts(drafts, n, self.num_speculative_tokens)
        return drafts

    def _may_keep_on_device(self, runner, states) -> bool:
        """Whether drafts may stay on the device until the next verification: nothing on
        the host reads them before (a guided request's grammar checks its drafts when the
        scheduler stores them; penalties and bad words read them as output history), and
        one GPU drafts them (other ranks would verify drafts of their own)."""
        if runner.pipeline is not None or runner.config.world_size != 1 or self.drafts_from_last_stage:
            return False
        for s in states:
            p = s.sampling_params
            if p.guided_decoding is not None or (not s.argmax_only and _reads_history(p)):
                return False
        return True

    @property
    def keeps_steps_in_flight(self) -> bool:
        """Whether a step in flight must keep its forward pass when the next one launches:
        its proposal, made after that launch, reads it (``Proposer.needs_ahead_target``)."""
        return self.proposer is not None and self.proposer.needs_ahead_target

    def keep_in_flight(self, runner, pending) -> None:
        """Before the next launch (async scheduling), which rewrites the input buffers and the
        graph outputs, and before its new requests take block-table rows: keep what the
        proposal for ``pending`` reads. A graph step's inputs are rebuilt from the host
        (``_target_pass``), so its block rows and hidden states are all it keeps."""
        step = pending.inputs
        if step is None or pending.hidden is None:
            return
        if step.graph_size is None:
            pending.inputs = self.keep_inputs(runner, step, pending.states)
            return
        rows = np.fromiter((s.row for s in pending.states), dtype=np.int64, count=len(pending.states))
        pending.inputs = dataclasses.replace(step, block_table_rows=runner.block_table_cpu[rows])
        pending.hidden = pending.hidden.clone()  # a view of the graph's output, which the next replay rewrites

    def keep_inputs(self, runner, step: StepInputs, states) -> StepInputs:
        """A copy of a launched step's inputs that later launches leave alone (they rewrite
        the persistent buffers and may give a freed block-table row to another request),
        for a proposal made when the engine finishes the step (pipeline parallelism)."""
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        common = step.common
        kept = dataclasses.replace(
            common,
            **{f: getattr(common, f).clone() for f in (
                "query_start_loc", "seq_lens", "block_table", "slot_mapping", "query_start_loc_cpu", "seq_lens_cpu",
            )},
        )
        return dataclasses.replace(
            step, common=kept,
            input_ids=None if step.input_ids is None else step.input_ids.clone(),
            positions=None if step.positions is None else step.positions.clone(),
            block_table_rows=runner.block_table_cpu[rows],
        )

    def _target_pass(self, runner, step, hidden, finished: FinishedStep, starts, counts, out_ids) -> TargetPass:
        """The step's forward pass as the proposer sees it; its device tensors only for a
        proposer that reads them (a graph replay's inputs live in the graph's staging, so
        they are uploaded again)."""
        states, rows, n = finished.requests, finished.rows, finished.num_reqs
        # Per request (plain lists: a few requests' worth of numpy calls cost more): the last
        # verified token's row, before the rejected drafts (accepted: sampled - 1), its
        # position, and the token after it.
        last_index, last_position, next_tokens = [], [], []
        for first, start, count, drafted, o, state in zip(
            first_token_index(step, counts), starts, counts, finished.num_drafts.tolist(), out_ids, states
        ):
            last = first + count - 1 - (drafted - len(o) + 1 if o else 0)
            last_index.append(last)
            last_position.append(start + last - first)
            next_tokens.append(o[-1] if o else state.token_ids[start + count])
        # The requests' block-table rows: the runner's, or those kept at launch.
        table, table_rows = runner.block_table_cpu, rows
        if isinstance(step, StepInputs) and step.block_table_rows is not None:
            table, table_rows = step.block_table_rows, np.arange(n)
        input_ids = positions = common = None
        if not self.proposer.uses_target_pass:
            hidden = None
        elif step.input_ids is not None:
            input_ids, positions, common = step.input_ids, step.positions, step.common
        else:
            input_ids = to_device([s.token_ids[c] for s, c in zip(states, starts)], torch.long, runner.device)
            starts_np = np.array(starts, dtype=np.int64)
            positions = torch.from_numpy(starts_np).to(runner.device, non_blocking=True)
            common = decode_attention_metadata(table, table_rows, starts_np, runner.block_size, runner.device)
        return TargetPass(
            input_ids=input_ids,
            positions=positions,
            hidden_states=hidden,
            common=common,
            last_token_index=np.array(last_index, dtype=np.int64),
            last_token_position=np.array(last_position, dtype=np.int64),
            next_token_ids=np.array(next_tokens, dtype=np.int64),
            block_table_cpu=table,
            rows=table_rows,
            block_size=runner.block_size,
            build_attention_metadata=runner.metadata_builder.build,
        )


def _logits_rows(step, counts: list[int], num_drafts: list[int]) -> tuple[list[int], list[int], list[int]]:
    """For a verification step: each request's first row in the step's output
    (``first_token_index``), where its logits rows start among the rows verified, and
    those rows: the last ``1 + d_i`` of request ``i``'s positions. Plain lists: a few
    requests' worth of numpy calls cost more than the loop."""
    firsts = first_token_index(step, counts)
    row_start, rows = [], []
    for first, count, d in zip(firsts, counts, num_drafts):
        row_start.append(len(rows))
        end = first + count
        rows.extend(range(end - 1 - d, end))
    return firsts, row_start, rows


def first_token_index(step, counts: list[int]) -> list[int]:
    """Flat index of each request's first scheduled token: packed one after another, or, in a
    verification graph, the last ``counts[i]`` of ``q`` rows per request (padding in front)."""
    if isinstance(step, VerifyGraphStep):
        q = step.query_len
        return [i * q + q - count for i, count in enumerate(counts)]
    firsts, at = [], 0
    for count in counts:
        firsts.append(at)
        at += count
    return firsts


class _Length:
    """Stands in for an output history whose tokens nobody reads: its length only."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def _outputs_at(outputs: list[int], drafts, j: int, history: bool):
    """A verification row's output history: the request's outputs, then its first ``j`` drafts."""
    if j == 0:
        return outputs
    return outputs + list(drafts[:j]) if history else _Length(len(outputs) + j)


def _reads_history(p) -> bool:
    return (
        p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
        or bool(p.bad_word_prefixes)
    )


def _split_logprobs(
    tensors: LogprobsTensors | None, states, row_start: list[int], out_ids: list[list[int]], vocab_size: int
) -> list[LogprobsLists | None]:
    """Per request, the logprobs rows of the tokens it emits."""
    if tensors is None:
        return [None] * len(states)
    ids, lps, ranks = tensors.token_ids.tolist(), tensors.logprobs.tolist(), tensors.ranks.tolist()
    out: list[LogprobsLists | None] = []
    for s, start, tokens in zip(states, row_start, out_ids):
        k = num_logprobs(s.sampling_params.logprobs, vocab_size)
        if k is None or not tokens:
            out.append(None)
            continue
        end = start + len(tokens)
        out.append(LogprobsLists([r[: k + 1] for r in ids[start:end]], [r[: k + 1] for r in lps[start:end]], ranks[start:end]))
    return out
