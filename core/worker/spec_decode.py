"""The model runner's side of speculative decoding: drafts verified in the same flattened
batch as every other token, and the proposer's view of the step.

A request with drafts ``d1..dk`` is scheduled ``1 + k`` tokens (its last known token, then
the drafts); the logits of all ``1 + k`` positions are computed, one row each::

    input_ids   | r0: prefill chunk ...... | r1: x  d1 d2 d3 | r2: y |
    logits rows                          p0  ^  ^  ^  ^         ^
                                             r1: 4 rows       r2: 1 row

The rejection sampler turns them into the accepted drafts plus one token of the target's.
Such steps run eagerly: CUDA graphs cover uniform one-token decode steps only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagelm.sample import RejectionSampler
from pagelm.sample.sampler import LogprobsTensors
from pagelm.spec_decode.proposer import ProposalBatch, Proposer, decode_attention_metadata
from pagelm.worker.output import LogprobsLists, ModelRunnerOutput
from pagelm.worker.sampling_inputs import build_sampling_metadata


@dataclass(slots=True)
class _DraftRow:
    """One verification row: the request's state as plain decoding would see it when
    sampling this token (its outputs so far plus the drafts before it), for the sampling
    metadata (penalties, min_tokens, seeds keyed on the output index)."""

    sampling_params: object
    output_token_ids: list[int] | _Length
    num_prompt_tokens: int
    token_ids: list[int]


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
        self._table_owner: list[str | None] = [None] * max_num_reqs

    # ---- verification --------------------------------------------------------------------
    def execute(self, runner, sched, req_ids, states, starts, counts, drafts, step) -> ModelRunnerOutput:
        """Forward pass, verification and proposal for a step where some requests carry drafts."""
        num_drafts = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=len(drafts))
        qsl = np.concatenate([[0], np.cumsum(counts)])
        rows_per_req = num_drafts + 1
        row_start = np.concatenate([[0], np.cumsum(rows_per_req)[:-1]])
        # Logits rows: the last 1 + d_i positions of request i.
        first = qsl[1:] - rows_per_req
        logits_indices = np.repeat(first - row_start, rows_per_req) + np.arange(int(rows_per_req.sum()))
        # Penalties read each row's output history; otherwise only its length matters (seeds
        # keyed on the output index, min_tokens), and no history is copied.
        history = any(_uses_penalties(s.sampling_params) for s in states)
        rows = [
            _DraftRow(s.sampling_params, _outputs_at(s.output_token_ids, d, j, history), s.num_prompt_tokens, s.token_ids)
            for s, d in zip(states, drafts)
            for j in range(len(d) + 1)
        ]
        md = build_sampling_metadata(rows, runner.eos_token_ids, runner.vocab_size, runner.device)
        index = torch.from_numpy(logits_indices).to(runner.device, non_blocking=True)
        logits, hidden = runner._logits(step, return_hidden=True, logits_indices=index)
        if sched.structured_output_request_ids and runner.structured_output is not None:
            # Guided requests carry no drafts: one row each, at row_start.
            runner._apply_grammar(logits, sched.structured_output_request_ids, req_ids, rows_of=row_start.tolist())
        with _host_sync_point():  # the verified tokens (and logprobs) come to the host
            verified = self.rejection_sampler(logits, md, [list(d) for d in drafts], runner.generator)
            prompt_logprobs = runner._prompt_logprobs(states, starts, counts, hidden, step.common)
            logprobs = _split_logprobs(verified.logprobs, states, row_start, verified.token_ids)

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
    def propose(self, runner, step, hidden, states, starts, counts, num_drafts, out_ids) -> list[list[int]]:
        """Drafts for the next step, for every request of this one (``[]`` for none)."""
        n = len(states)
        counts_np = np.asarray(counts, dtype=np.int64)
        starts_np = np.asarray(starts, dtype=np.int64)
        if num_drafts is None:
            num_drafts = np.zeros(n, dtype=np.int64)
        qsl = np.concatenate([[0], np.cumsum(counts_np)])
        num_out = np.fromiter((len(o) for o in out_ids), dtype=np.int64, count=n)
        sampled = num_out > 0
        last_index = np.where(sampled, qsl[:-1] + counts_np - 1 - num_drafts + num_out - 1, qsl[1:] - 1)
        next_tokens = np.fromiter(
            (o[-1] if o else s.token_ids[c + cnt] for o, s, c, cnt in zip(out_ids, states, starts, counts)),
            dtype=np.int64, count=n,
        )
        num_tokens = np.fromiter((len(s.token_ids) for s in states), dtype=np.int64, count=n)
        max_drafts = np.where(sampled, self._room(states, num_tokens), 0)
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=n)

        input_ids, positions, common = step.input_ids, step.positions, step.common
        if input_ids is None:  # a CUDA graph replay: its inputs live in the graph's staging
            positions_np = starts_np
            input_ids = torch.tensor([s.token_ids[c] for s, c in zip(states, starts)]).to(runner.device)
            positions = torch.from_numpy(positions_np).to(runner.device)
            common = decode_attention_metadata(
                runner.block_table_cpu, rows, positions_np, runner.block_size, runner.device
            )
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
            last_token_position=starts_np + last_index - qsl[:-1],
            next_token_ids=next_tokens,
            block_table_cpu=runner.block_table_cpu,
            rows=rows,
            block_size=runner.block_size,
            build_attention_metadata=runner.metadata_builder.build,
        )
        # Proposing is not sync-free yet: its small host-to-device inputs, and the drafts the
        # scheduler needs back (EAGLE).
        with _host_sync_point():
            drafts = self.proposer.propose(batch)
        assert len(drafts) == n, f"proposer {self.proposer.name!r} returned {len(drafts)} draft lists for {n} requests"
        return [list(d[: int(m)]) for d, m in zip(drafts, max_drafts)]

    def _room(self, states, num_tokens: np.ndarray) -> np.ndarray:
        """Drafts each request may take: k, fewer near max_model_len or max_tokens (all of
        them plus the target's token must fit), none under a grammar."""
        room = np.minimum(self.num_speculative_tokens, self.max_model_len - num_tokens - 1)
        for i, s in enumerate(states):
            p = s.sampling_params
            if p.guided_decoding is not None:
                room[i] = 0
            elif p.max_tokens is not None:
                room[i] = min(room[i], p.max_tokens - len(s.output_token_ids) - 1)
        return np.maximum(room, 0)

    def _token_ids(self, states, rows: np.ndarray, num_tokens: np.ndarray) -> np.ndarray | None:
        """The batch's rows of the token table, after copying in what each request gained."""
        if self.token_table is None:
            return None
        for s, row in zip(states, rows.tolist()):
            if self._table_owner[row] != s.req_id:  # a new (or resumed) request on this row
                self._table_owner[row], self._table_len[row] = s.req_id, 0
            have = int(self._table_len[row])
            if have < len(s.token_ids):
                self.token_table[row, have : len(s.token_ids)] = s.token_ids[have:]
                self._table_len[row] = len(s.token_ids)
        return self.token_table[rows, : int(num_tokens.max())]


def _host_sync_point():
    from pagelm.worker.model_runner import host_sync_point  # the runner imports this module

    return host_sync_point()


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


def _uses_penalties(p) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _split_logprobs(
    tensors: LogprobsTensors | None, states, row_start: np.ndarray, out_ids: list[list[int]]
) -> list[LogprobsLists | None]:
    """Per request, the logprobs rows of the tokens it emits."""
    if tensors is None:
        return [None] * len(states)
    ids, lps, ranks = tensors.token_ids.tolist(), tensors.logprobs.tolist(), tensors.ranks.tolist()
    out: list[LogprobsLists | None] = []
    for s, start, tokens in zip(states, row_start.tolist(), out_ids):
        k = s.sampling_params.logprobs
        if k is None or not tokens:
            out.append(None)
            continue
        end = start + len(tokens)
        out.append(LogprobsLists([r[: k + 1] for r in ids[start:end]], [r[: k + 1] for r in lps[start:end]], ranks[start:end]))
    return out
