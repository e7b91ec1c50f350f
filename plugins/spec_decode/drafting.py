"""``DraftProposer``: the drafting every proposer needs, around the one thing that differs
between them, ``propose(batch)``. The built-in ``ngram``, ``eagle`` and ``medusa`` use it, and
so may a third-party proposer (the core's contract, ``pagelm.Proposer.propose_step``, is lower
level).

After each step it decides how many drafts each request may get, and asks ``propose`` for
at most that many::

    propose_step(step)   claim rows       a request new to its row starts it afresh
                         observe          adaptive drafting learns what verification accepted
                         max_num_drafts   k, less near max_model_len / max_tokens, 0 for a
                                          request that sampled nothing or is backed off
                         skip             nobody may draft, or the next step is already
                                          launched: no drafts, and no ``propose`` unless the
                                          proposer must see every step (a draft model's KV:
                                          ``needs_every_step`` / ``needs_ahead_target``)
                         propose(batch)   ProposalBatch: the step, the caps, the token history
                         cut              each request's drafts cut to its max_num_drafts

    skip_ahead(requests)  a step run ahead with nothing to follow: the engine leaves its
    step_skipped(...)     proposal out (no ``FinishedStep``, no target kept) and, once the
                          step is finished, has it only counted

Adaptive drafting (``pagelm.plugins.spec_decode.backoff``) withholds drafts from requests
whose drafts keep being rejected; a step in which nobody drafts is plain decode again.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np

from pagelm.plugins.spec_decode.backoff import DraftBackoff
from pagelm.plugins.spec_decode.rows import DraftRows
from pagelm.spec_decode.proposer import DeviceDrafts, FinishedStep, Proposer, RequestView, TargetPass

_TARGET_FIELDS = tuple(f.name for f in fields(TargetPass))
# Up to this many requests, the checks made every step (``may_draft``, ``skip_ahead``) index
# the per-row arrays one request at a time: a numpy call costs 3-10 us in the engine's loop
# however small its input, several of them a third of a small model's 0.4 ms GPU step. On
# the CPU machine both checks took 105 us a step at 32 requests in numpy, 50 us this way.
SCALAR_BATCH = 64


@dataclass(kw_only=True)
class ProposalBatch(TargetPass):
    """One step, as a ``DraftProposer`` sees it after verification: the target's pass
    (``TargetPass``: for model-based proposers such as EAGLE, which read its hidden states
    and write their own KV at its slots), how many drafts each request may get, and the
    host-side token history. Row ``i`` is the ``i``-th request of the step's batch (every
    scheduled request, also those that get no drafts)."""

    req_ids: list[str]
    # [n] at most this many drafts for request i; 0: none (unfinished prefill chunk, backed
    # off after rejected drafts (adaptive drafting), or no room left before
    # max_model_len / max_tokens). A proposer does no drafting work for such a request.
    max_num_drafts: np.ndarray
    # [n, width] int32, prompt + every accepted output token, zero padded (None unless the
    # proposer sets ``uses_token_ids``); and [n] lengths.
    token_ids: np.ndarray | None
    num_tokens: np.ndarray
    # [n] each request's ``SamplingParams.extra_args`` (per-request data for plugins; None
    # where the request has none).
    extra_args: list[dict[str, Any] | None] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


class DraftProposer(Proposer):
    """A proposer that implements ``propose(batch)``; the drafting around it is this class's."""

    # Whether ``propose`` reads ``ProposalBatch.token_ids`` (a host token table is kept for it).
    uses_token_ids: ClassVar[bool] = True
    # A draft model with a KV cache of its own (``needs_ahead_target``) that can draft over
    # stale KV sets it: steps in which every request is backed off
    # (``DraftBackoff.deep``) then do not come to ``propose``. False keeps it called for
    # every step.
    skips_deep_backoff: ClassVar[bool] = False

    def __init__(self, config, target, device, dtype) -> None:
        super().__init__(config, target, device, dtype)
        spec = self.speculative
        self.rows = DraftRows(config.max_num_seqs)
        self.backoff = DraftBackoff(config.max_num_seqs, spec.backoff_after, spec.max_backoff_steps) if spec.adaptive else None
        # What the last full checks of a quiet stretch found (``_QuietBatch``): ``may_draft``
        # False for the runner's requests, ``skip_ahead`` True for a step's; ``propose_step``
        # (the only thing that changes what they read) drops both.
        self._quiet_draft: _QuietBatch | None = None
        self._quiet_skip: _QuietBatch | None = None

    @abstractmethod
    def propose(self, batch: ProposalBatch) -> list[list[int]] | DeviceDrafts:
        """Draft token ids for every request of ``batch``, in its order: at most
        ``batch.max_num_drafts[i]`` for request ``i`` (``[]``: no drafts), as host lists or,
        made on the device, as ``DeviceDrafts`` (the engine need not wait for them). Called once per
        step, after verification, for every step (also those with nothing to draft, so a
        draft model can keep its KV cache in step with the target's), unless
        ``needs_every_step`` and ``needs_ahead_target`` are both False. A step run ahead
        comes with every ``max_num_drafts`` 0."""

    def propose_step(self, step: FinishedStep) -> list[list[int]] | DeviceDrafts:
        rows, n = step.rows, step.num_reqs
        self._quiet_draft = self._quiet_skip = None
        fresh = self.rows.claim(step.requests)
        if self.backoff is not None and fresh:
            self.backoff.reset(fresh)
        slump_starts = self.backoff.num_slump_starts if self.backoff is not None else 0
        max_drafts = self._max_drafts_one_by_one(step) if n <= SCALAR_BATCH else self._max_drafts(step)
        # A request that starts backed off (the drafter's record is poor) is followed for
        # the step that completed its prompt, so that a draft model has the prompt's KV.
        started = self.backoff is not None and self.backoff.num_slump_starts != slump_starts
        if not max_drafts.any() and not (self.needs_every_step or started or self._follows(rows)):
            return [[] for _ in range(n)]
        target = step.target
        batch = ProposalBatch(
            **{name: getattr(target, name) for name in _TARGET_FIELDS},
            req_ids=[s.req_id for s in step.requests],
            max_num_drafts=max_drafts,
            token_ids=self.rows.history(step.requests, rows, step.num_tokens, step.max_model_len) if self.uses_token_ids else None,
            num_tokens=step.num_tokens,
            extra_args=[s.sampling_params.extra_args for s in step.requests],
        )
        proposal = self.propose(batch)
        if isinstance(proposal, DeviceDrafts):
            counts = np.asarray(proposal.num_drafts)
            if counts.shape != (n,):  # malformed: the engine rejects it with an error naming this proposer
                return proposal
            drafts = DeviceDrafts(proposal.token_ids, np.minimum(counts, max_drafts))
            found = drafts.num_drafts
        else:
            drafts = _cut(proposal, max_drafts)
            if drafts is None:  # malformed: the engine rejects it with an error naming this proposer
                return proposal
            found = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=n)
        self.rows.proposed[rows] = found
        if self.backoff is not None:  # asked and found nothing: a miss, as a rejected draft is
            empty = (max_drafts > 0) & (found == 0)
            if empty.any():
                self.backoff.observe_empty(rows[empty])
        return drafts

    def may_draft(self, requests: Sequence[RequestView]) -> bool:
        """Conservative: a request new to its row, or near a limit, counts as one that may draft."""
        if self.needs_every_step:
            return True
        backoff = self.backoff
        if backoff is None:
            return bool(requests)
        quiet = self._quiet_draft
        if quiet is not None and backoff.step < quiet.until and quiet.holds(requests):
            return False
        self._quiet_draft = None
        if len(requests) <= SCALAR_BATCH:
            resume, step = backoff.resume_step, backoff.step
            until = min((int(resume[s.row]) for s in requests), default=step + 1)
        else:
            rows = np.fromiter((s.row for s in requests), dtype=np.int64, count=len(requests))
            until = int(backoff.resume_step[rows].min())
        if until <= backoff.step or any(self.rows.is_new(s) for s in requests):
            return True
        if requests:  # nobody may draft before the earliest resume step, if nobody joins
            self._quiet_draft = _QuietBatch(requests, until)
        return False

    def skip_ahead(self, requests: Sequence[RequestView]) -> bool:
        """The proposal of a step run ahead is left out (``step_skipped`` counts the step)
        when ``propose_step`` would do nothing with it but count it: adaptive drafting is on,
        no request of the step is new to its row, none had drafts dropped before it
        (``_max_drafts`` counts those), and nothing follows the step (``_follows``: a
        proposer without a KV cache of its own, or EAGLE with every request deeply backed
        off)."""
        backoff = self.backoff
        if backoff is None or self.needs_every_step or not requests:
            return False
        quiet = self._quiet_skip
        if quiet is not None and quiet.holds(requests):
            return True
        if len(requests) <= SCALAR_BATCH:
            follows = self.needs_ahead_target
            if follows and not self.skips_deep_backoff:
                return False
            proposed, misses, after = self.rows.proposed, backoff.misses, backoff.backoff_after
            for s in requests:
                row = s.row
                if proposed[row] or (follows and misses[row] < after) or self.rows.is_new(s):
                    return False
            until = min(int(backoff.resume_step[s.row]) for s in requests)
        else:
            rows = np.fromiter((s.row for s in requests), dtype=np.int64, count=len(requests))
            if self._follows(rows) or self.rows.proposed[rows].any() or any(self.rows.is_new(s) for s in requests):
                return False
            until = int(backoff.resume_step[rows].min())
        self._quiet_skip = _QuietBatch(requests, until)
        return True

    def step_skipped(self, requests: Sequence[RequestView]) -> None:
        """Counted as ``propose_step`` counts a step whose requests all sampled and none may
        draft (``DraftBackoff.skip``): before the earliest resume step of the requests that
        ``skip_ahead`` last checked, every one of them is a backed-off request-step."""
        quiet, backoff = self._quiet_skip, self.backoff
        if quiet is not None and backoff.step < quiet.until and quiet.holds(requests):
            backoff.skip_all(len(requests))
            return
        backoff.skip([s.row for s in requests], one_by_one=len(requests) <= SCALAR_BATCH)

    def _follows(self, rows: np.ndarray) -> bool:
        """Whether a step in which nobody drafts still goes to ``propose`` (a draft model
        writes its KV for it: ``needs_ahead_target``). Not when the proposer
        ``skips_deep_backoff`` and every request in the step is backed off
        (``DraftBackoff.deep``): the step is then plain decoding, and the draft model's KV at
        its positions is left stale. Outputs stay exact (drafts are verified); what the stale
        KV costs is acceptance, when those requests probe again."""
        if not self.needs_ahead_target:
            return False
        return not (self.skips_deep_backoff and self.backoff is not None and self.backoff.deep(rows))

    def _max_drafts(self, step: FinishedStep) -> np.ndarray:
        """Drafts each request of ``step`` may get for the next one: ``k`` for a request that
        sampled, capped by adaptive drafting (after it has learnt from this step's
        verification, and counted as misses the drafts proposed last time that the scheduler
        dropped) and by the room left (``_room_of``); none for a step run ahead."""
        rows, backoff = step.rows, self.backoff
        sampled = step.num_sampled > 0
        max_drafts = np.where(sampled, self.num_speculative_tokens, 0)
        if backoff is not None:
            if step.num_drafts.any():  # what this step's verification accepted
                backoff.observe(rows, step.num_drafts, np.maximum(step.num_sampled - 1, 0))
            dropped = (self.rows.proposed[rows] > 0) & (step.num_drafts == 0) & sampled
            if dropped.any():
                backoff.observe_empty(rows[dropped])
            max_drafts = backoff.cap(rows, max_drafts)
        self.rows.proposed[rows] = 0
        if step.ahead:  # drafts would come too late
            return np.zeros_like(max_drafts)
        if max_drafts.any():
            room = [self._room_of(s, t, step.max_model_len) for s, t in zip(step.requests, step.num_tokens.tolist())]
            max_drafts = np.minimum(max_drafts, room)
        return max_drafts

    def _max_drafts_one_by_one(self, step: FinishedStep) -> np.ndarray:
        """``_max_drafts`` a request at a time (``SCALAR_BATCH``): the same caps and the same
        changes to the backoff's state, without a numpy call per quantity."""
        k, backoff, proposed = self.num_speculative_tokens, self.backoff, self.rows.proposed
        out = []
        for s, row, drafted, sampled, known in zip(
            step.requests, step.rows.tolist(), step.num_drafts.tolist(), step.num_sampled.tolist(),
            step.num_tokens.tolist(),
        ):
            m = k if sampled > 0 else 0
            if backoff is not None:
                if drafted:
                    backoff.observe_row(row, drafted, max(sampled - 1, 0))
                elif sampled > 0 and proposed[row] > 0:  # dropped before verification
                    backoff.empty_row(row)
                m = backoff.cap_row(row, m)
            proposed[row] = 0
            if step.ahead:
                m = 0
            elif m:
                m = min(m, self._room_of(s, known, step.max_model_len))
            out.append(m)
        if backoff is not None:
            backoff.end_step()
        return np.array(out, dtype=np.int64)

    def _room_of(self, request: RequestView, num_tokens: int, max_model_len: int) -> int:
        """Drafts a request with ``num_tokens`` known tokens may take: k, fewer near
        max_model_len or max_tokens (all of them plus the target's token must fit). A guided
        request's drafts are checked against its grammar when the scheduler stores them."""
        room = min(self.num_speculative_tokens, max_model_len - num_tokens - 1)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - len(request.output_token_ids) - 1)
        return max(room, 0)


class _QuietBatch:
    """Requests a full check found quiet (nobody may draft, or the step's proposal may be
    left out), and the earliest step at which one of them resumes drafting. The engine asks
    ``may_draft`` and ``skip_ahead`` about every step; in a stretch where every request is
    backed off their answers do not change until a request joins or leaves, a resume step
    comes, or ``propose_step`` runs (it drops these). Recognising the same requests takes
    one C-level pass over their ids instead of a Python check per request (at 32 requests on
    the CPU machine the three checks took 14.2 us a step, 4.6 us this way), and nothing at all
    when they come as the list seen last: the engine's list, the same until a request joins or
    leaves (plugin API 2.24; 3.8 -> 0.8 us a step for the runner's ``may_draft_next``). The
    requests are held, so that their ids cannot pass to new objects meanwhile."""

    __slots__ = ("requests", "ids", "until", "seen")

    def __init__(self, requests: Sequence[RequestView], until: int) -> None:
        self.requests = tuple(requests)
        self.ids = list(map(id, self.requests))
        self.until = until
        self.seen = requests  # the last sequence found to hold them

    def holds(self, requests: Sequence[RequestView]) -> bool:
        if requests is self.seen:  # the engine's list of them, unchanged (``Proposer.may_draft``)
            return True
        if len(requests) == len(self.ids) and list(map(id, requests)) == self.ids:
            self.seen = requests
            return True
        return False


def _cut(drafts: Any, max_num_drafts: np.ndarray) -> list[list[int]] | None:
    """Each request's drafts cut to its ``max_num_drafts``; None when ``drafts`` is not one
    sequence of ids per request."""
    try:
        return [list(d[: int(m)]) for d, m in zip(drafts, max_num_drafts, strict=True)]
    except (TypeError, ValueError):
        return None
