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
drafts at all is plain decode (the one-token graphs). The proposer runs after verification,
eagerly (the EAGLE head's passes are not captured).

Adaptive drafting (``pagelm.spec_decode.backoff``) withholds drafts from requests whose
drafts keep being rejected: the proposer is asked for none for them (``max_num_drafts`` 0),
and a step in which nobody drafts is plain decode again.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from pagelm.attention import CommonAttentionMetadata, GraphSupport
from pagelm.kv_cache import cdiv
from pagelm.sample import RejectionSampler
from pagelm.registry import PluginError
from pagelm.sample.sampler import LogprobsTensors
from pagelm.sampling_params import num_logprobs
from pagelm.spec_decode.backoff import DraftBackoff
from pagelm.spec_decode.proposer import ProposalBatch, Proposer, decode_attention_metadata
from pagelm.worker.cuda_graphs import PAD_TOKEN, CudaGraphRunner, capture_sizes
from pagelm.worker.output import LogprobsLists, ModelRunnerOutput
from pagelm.worker.sampling_inputs import build_sampling_metadata
from pagelm.worker.step_state import host_sync_point

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
    def __init__(self, proposer: Proposer, max_num_reqs: int, max_model_len: int) -> None:
        self.proposer = proposer
        self.num_speculative_tokens = proposer.num_speculative_tokens
        self.max_model_len = max_model_len
        self.rejection_sampler = RejectionSampler()
        # Host token history per block-table row, for proposers that read it (n-gram): the
        # new tokens of a step are copied in before proposing, never the whole history.
        self.token_table = np.zeros((max_num_reqs, max_model_len), dtype=np.int32) if proposer.uses_token_ids else None
        self._table_len = np.zeros(max_num_reqs, dtype=np.int64)
        # Drafts handed out per row by the last proposal: none of them verified in the next
        # step means they were dropped on the way (a grammar allowed none): a miss.
        self._proposed = np.zeros(max_num_reqs, dtype=np.int64)
        # The request state on each block-table row: a different object (a new request, or one
        # resumed after preemption) resets the row's token table and backoff. Weak, so that a
        # finished request's token lists are not kept alive by a row nobody reuses.
        self._row_owner: list[weakref.ref | None] = [None] * max_num_reqs
        spec = proposer.speculative
        self.backoff = DraftBackoff(max_num_reqs, spec.backoff_after, spec.max_backoff_steps) if spec.adaptive else None
        self.graphs: CudaGraphRunner | None = None  # verification graphs (CUDA only)

    # ---- verification graphs -------------------------------------------------------------
    def capture_cuda_graphs(self, runner, pool: tuple[int, int] | None) -> None:
        """Capture verification graphs (``q = 1 + k`` tokens per request) into ``pool``, for
        batch sizes up to ``MAX_VERIFY_GRAPH_BATCH``, when the attention backend can."""
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
        self.graphs = CudaGraphRunner(
            runner.model, runner.buffers, runner.metadata_builder, capture_sizes(max_reqs, max_reqs_by_tokens),
            runner.max_model_len, runner.block_size, query_len=q,
        )
        self.graphs.capture(pool)

    def _graph_step(self, runner, states, starts, counts, drafts) -> VerifyGraphStep | None:
        """The step staged for a verification graph, when every request is a decode (its
        last known token, then its drafts) and a captured size holds the batch; None: run
        it eagerly."""
        graphs = self.graphs
        size = None if graphs is None else graphs.padded_size(len(states))
        if size is None:
            return None
        n, q = len(states), graphs.query_len
        tokens = np.full((n, q), PAD_TOKEN, dtype=np.int64)
        for i, (state, start, count, d) in enumerate(zip(states, starts, counts, drafts)):
            if count != 1 + len(d) or start + 1 != len(state.token_ids):
                return None  # a prefill chunk
            assert count <= q, f"{len(d)} drafts, more than num_speculative_tokens={q - 1}"
            tokens[i, q - count] = state.token_ids[start]
            tokens[i, q - count + 1 :] = d
        seq_lens = np.asarray(starts, dtype=np.int64) + np.asarray(counts, dtype=np.int64)
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=n)
        table_rows = runner.block_table_cpu[rows, : cdiv(int(seq_lens.max()), runner.block_size)]
        if not graphs.load(tokens.reshape(-1), seq_lens, table_rows, size):
            return None
        common = graphs.common_metadata(n, torch.from_numpy(seq_lens.astype(np.int32)))
        common.block_table_cpu = torch.from_numpy(table_rows)
        return VerifyGraphStep(size, q, common, graphs.input_ids[: n * q], graphs.positions[: n * q])

    # ---- verification --------------------------------------------------------------------
    def execute(self, runner, sched, req_ids, states, starts, counts, drafts) -> ModelRunnerOutput:
        """Forward pass, verification and proposal for a step where some requests carry drafts."""
        step = self._graph_step(runner, states, starts, counts, drafts)
        if step is None:
            step = runner.prepare_inputs(states, starts, counts, drafts=drafts)
        graph_out = None
        if isinstance(step, VerifyGraphStep):  # launched first: the host work below overlaps it
            graph_out = self.graphs.replay(step.graph_size)
        num_drafts = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=len(drafts))
        counts_np = np.asarray(counts, dtype=np.int64)
        rows_per_req = num_drafts + 1
        row_start = np.concatenate([[0], np.cumsum(rows_per_req)[:-1]])
        # Logits rows: the last 1 + d_i positions of request i.
        first = first_token_index(step, counts_np) + counts_np - rows_per_req
        logits_indices = np.repeat(first - row_start, rows_per_req) + np.arange(int(rows_per_req.sum()))
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
        md = build_sampling_metadata(rows, runner.eos_token_ids, runner.vocab_size, runner.device)
        index = torch.from_numpy(logits_indices).to(runner.device, non_blocking=True)
        if graph_out is not None:
            hidden, logits = graph_out
            hidden, logits = hidden[: step.num_tokens], logits[index]
        else:
            logits, hidden = runner.compute_logits(step, return_hidden=True, logits_indices=index)
        if sched.structured_output_request_ids:
            # A guided request's 1 + d rows from row_start: what its grammar allows after each
            # prefix of its drafts. The rejection sampler then verifies against masked logits.
            runner.apply_grammar(logits, sched, req_ids, rows_of=row_start.tolist())
        with host_sync_point():  # the verified tokens (and logprobs) come to the host
            verified = self.rejection_sampler(logits, md, [list(d) for d in drafts], runner.generator)
            prompt_logprobs = runner.prompt_logprobs(states, starts, counts, hidden, step.common)
            logprobs = _split_logprobs(verified.logprobs, states, row_start, verified.token_ids, runner.vocab_size)

        if self.backoff is not None:
            num_verified = np.fromiter((len(t) for t in verified.token_ids), dtype=np.int64, count=len(states))
            self.backoff.observe(self._claim_rows(states), num_drafts, np.maximum(num_verified - 1, 0))

        out_ids: list[list[int]] = []
        for state, start, count, tokens in zip(states, starts, counts, verified.token_ids):
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

    # ---- proposal ------------------------------------------------------------------------
    def propose(
        self, runner, step, hidden, states, starts, counts, num_drafts, out_ids, ahead: bool = False
    ) -> list[list[int]]:
        """Drafts for the next step, for every request of this one (``[]`` for none).
        ``ahead``: the next step is already launched (async scheduling), so drafts would come
        too late; the engine launched it only because nobody may draft (``may_draft``)."""
        n = len(states)
        counts_np, starts_np = np.asarray(counts, dtype=np.int64), np.asarray(starts, dtype=np.int64)
        num_drafts = np.zeros(n, dtype=np.int64) if num_drafts is None else num_drafts
        num_out = np.fromiter((len(o) for o in out_ids), dtype=np.int64, count=n)
        sampled = num_out > 0
        # Known tokens after this step (a step launched since then has left a placeholder
        # past them): the step's end, less rejected drafts, plus what it emitted.
        num_tokens = starts_np + counts_np - num_drafts + num_out
        max_drafts = np.where(sampled, self._room(states, num_tokens), 0)
        rows = self._claim_rows(states)
        max_drafts = self._backed_off(rows, max_drafts, num_drafts, sampled)
        assert not (ahead and self.proposer.needs_every_step), f"proposer {self.proposer.name!r} ran behind a launched step"
        if ahead or (not self.proposer.needs_every_step and not max_drafts.any()):
            return [[] for _ in range(n)]

        first = first_token_index(step, counts_np)
        last_index = np.where(sampled, first + counts_np - 1 - num_drafts + num_out - 1, first + counts_np - 1)
        next_tokens = np.fromiter(
            (o[-1] if o else s.token_ids[c + cnt] for o, s, c, cnt in zip(out_ids, states, starts, counts)),
            dtype=np.int64, count=n,
        )

        input_ids, positions, common, hidden = self._target_pass(runner, step, hidden, states, starts_np, rows)
        batch = ProposalBatch(
            req_ids=[s.req_id for s in states],
            max_num_drafts=max_drafts,
            token_ids=self._token_ids(states, rows, num_tokens),
            num_tokens=num_tokens,
            input_ids=input_ids,
            positions=positions,
            hidden_states=hidden,
            common=common,
            last_token_index=last_index,
            last_token_position=starts_np + last_index - first,
            next_token_ids=next_tokens,
            block_table_cpu=runner.block_table_cpu,
            rows=rows,
            block_size=runner.block_size,
            build_attention_metadata=runner.metadata_builder.build,
            extra_args=[s.sampling_params.extra_args for s in states],
        )
        # Proposing is not sync-free yet: its small host-to-device inputs, and the drafts the
        # scheduler needs back (EAGLE).
        with host_sync_point():
            drafts = self._checked(self.proposer.propose(batch), n, max_drafts, runner.vocab_size)
        found = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=n)
        self._proposed[rows] = found
        if self.backoff is not None:  # asked and found nothing: a miss, as a rejected draft is
            empty = (max_drafts > 0) & (found == 0)
            if empty.any():
                self.backoff.observe_empty(rows[empty])
        return drafts

    def _backed_off(self, rows: np.ndarray, max_drafts: np.ndarray, num_drafts: np.ndarray, sampled) -> np.ndarray:
        """``max_drafts`` capped by adaptive drafting, which first counts as misses the drafts
        proposed last time that the scheduler dropped (no room)."""
        if self.backoff is not None:
            dropped = (self._proposed[rows] > 0) & (num_drafts == 0) & sampled
            if dropped.any():
                self.backoff.observe_empty(rows[dropped])
            max_drafts = self.backoff.cap(rows, max_drafts)
        self._proposed[rows] = 0
        return max_drafts

    def _target_pass(self, runner, step, hidden, states, starts_np: np.ndarray, rows: np.ndarray):
        """(input_ids, positions, attention metadata, hidden states) of the target's pass, for
        a proposer that reads it; all None for one that reads only the history (n-gram)."""
        if not self.proposer.uses_target_pass:
            return None, None, None, None
        if step.input_ids is not None:
            return step.input_ids, step.positions, step.common, hidden
        # A CUDA graph replay: its inputs live in the graph's staging.
        input_ids = torch.tensor([s.token_ids[c] for s, c in zip(states, starts_np.tolist())]).to(runner.device)
        positions = torch.from_numpy(starts_np).to(runner.device)
        common = decode_attention_metadata(runner.block_table_cpu, rows, starts_np, runner.block_size, runner.device)
        return input_ids, positions, common, hidden

    def _checked(self, drafts, n: int, max_drafts: np.ndarray, vocab_size: int) -> list[list[int]]:
        """The proposal cut to each request's room, or a ``PluginError`` naming the proposer:
        one list of token ids in the vocabulary per request (a few ints per request, checked
        in one numpy pass)."""
        who = f"proposer {self.proposer.name!r} ({type(self.proposer).__module__}.{type(self.proposer).__qualname__})"
        if not isinstance(drafts, (list, tuple)) or len(drafts) != n:
            got = f"{len(drafts)} lists" if isinstance(drafts, (list, tuple)) else repr(drafts)[:80]
            raise PluginError(f"{who}: propose() must return one list of draft ids per request ({n}), got {got}")
        if not all(isinstance(d, (list, tuple, np.ndarray)) for d in drafts):
            raise PluginError(f"{who}: propose() returned a draft that is not a list of token ids: {drafts!r:.200}")
        drafts = [list(d[: int(m)]) for d, m in zip(drafts, max_drafts)]
        flat = [t for d in drafts for t in d]
        if flat:
            ids = np.asarray(flat)
            if ids.ndim != 1 or ids.dtype.kind not in "iu":
                raise PluginError(f"{who}: propose() returned draft ids that are not integers: {flat[:16]!r:.200}")
            if ids.min() < 0 or ids.max() >= vocab_size:
                raise PluginError(
                    f"{who}: propose() returned draft ids outside the vocabulary [0, {vocab_size}): {flat[:16]}"
                )
        return drafts

    def may_draft(self, states) -> bool:
        """Whether the next proposal may give any of ``states`` (the runner's requests) drafts.
        False lets the engine schedule the next step before the one in flight is finished
        (async scheduling): its proposal is then skipped. Conservative: a request new to its
        row, or near a limit, counts as one that may draft."""
        if self.proposer.needs_every_step:
            return True
        backoff = self.backoff
        if backoff is None:
            return bool(states)
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        if (backoff.resume_step[rows] <= backoff.step).any():
            return True
        return any(self._row_owner[s.row] is None or self._row_owner[s.row]() is not s for s in states)

    def _room(self, states, num_tokens: np.ndarray) -> np.ndarray:
        """Drafts each request may take: k, fewer near max_model_len or max_tokens (all of
        them plus the target's token must fit). A guided request's drafts are checked against
        its grammar when the scheduler stores them."""
        room = np.minimum(self.num_speculative_tokens, self.max_model_len - num_tokens - 1)
        for i, s in enumerate(states):
            p = s.sampling_params
            if p.max_tokens is not None:
                room[i] = min(room[i], p.max_tokens - len(s.output_token_ids) - 1)
        return np.maximum(room, 0)

    def _claim_rows(self, states) -> np.ndarray:
        """The requests' block-table rows, with the per-row state of any row that changed
        hands reset."""
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        for s, row in zip(states, rows.tolist()):
            owner = self._row_owner[row]
            if owner is None or owner() is not s:
                self._row_owner[row] = weakref.ref(s)
                self._table_len[row] = 0
                self._proposed[row] = 0
                if self.backoff is not None:
                    self.backoff.reset(row)
        return rows

    def _token_ids(self, states, rows: np.ndarray, num_tokens: np.ndarray) -> np.ndarray | None:
        """The batch's rows of the token table, after copying in what each request gained."""
        if self.token_table is None:
            return None
        for s, row, end in zip(states, rows.tolist(), num_tokens.tolist()):
            have = int(self._table_len[row])
            if have < end:
                self.token_table[row, have:end] = s.token_ids[have:end]
                self._table_len[row] = end
        return self.token_table[rows, : int(num_tokens.max())]


def first_token_index(step, counts: np.ndarray) -> np.ndarray:
    """Flat index of each request's first scheduled token: packed one after another, or, in a
    verification graph, the last ``counts[i]`` of ``q`` rows per request (padding in front)."""
    if isinstance(step, VerifyGraphStep):
        q = step.query_len
        return np.arange(len(counts), dtype=np.int64) * q + q - counts
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


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
    tensors: LogprobsTensors | None, states, row_start: np.ndarray, out_ids: list[list[int]], vocab_size: int
) -> list[LogprobsLists | None]:
    """Per request, the logprobs rows of the tokens it emits."""
    if tensors is None:
        return [None] * len(states)
    ids, lps, ranks = tensors.token_ids.tolist(), tensors.logprobs.tolist(), tensors.ranks.tolist()
    out: list[LogprobsLists | None] = []
    for s, start, tokens in zip(states, row_start.tolist(), out_ids):
        k = num_logprobs(s.sampling_params.logprobs, vocab_size)
        if k is None or not tokens:
            out.append(None)
            continue
        end = start + len(tokens)
        out.append(LogprobsLists([r[: k + 1] for r in ids[start:end]], [r[: k + 1] for r in lps[start:end]], ranks[start:end]))
    return out
