"""Adaptive drafting: a request whose drafts do not pay stops drafting for a while, with
exponential backoff, so that speculation costs little where it does not pay.

Each request keeps its *gain*, a moving average of the drafts its verifications accepted
(``GAIN_ALPHA``; from ``GAIN_START``). A *miss* is a verification that accepted none of
its drafts while the gain is below ``MIN_GAIN``, a proposal that found no drafts for it, or
drafts dropped before verification (a guided request's grammar allowed none of them;
``observe_empty``). After ``backoff_after`` misses in a row it gets no drafts for up to
``period`` steps, then drafts one token (a *probe*); each further miss doubles ``period``
(2, 4, 8, ... up to ``max_backoff_steps``), and an accepted draft puts it back to drafting
every step, on probation after a probe (its next miss pauses it again)::

    step       1     2     3  4  5     6  7  8  9     10 .. 16  17
    verifies   miss  miss  -  -  miss  -  -  -  miss  -  .. -   hit    (backoff_after = 2)
    period           2           4              8                 drafts every step again

Why a gain and not misses alone: with the demo model's trained EAGLE head on code, 45% of
verifications accept nothing, yet after two such in a row the next still accepts 0.56
drafts on average, which pays wherever a speculative step costs less than 1.5 plain ones.
Counting every empty verification as a miss withheld drafts from 40% of its steps and cut
its tokens per step from 2.08 (no backoff) to 1.76; with the gain, 1.97. A drafter that
never hits still stops after its first two verifications, as before.

A probe that hits puts the request on probation at the pause it had: if its next
verification misses, it pauses again for that same ``period``, not from 2 again. One lucky
draft of a drafter that does not pay costs one verification of ``k`` drafts, not a second
climb through 2, 4, 8, ... (with every draft rejected at batch 32 on the demo model, a single
lucky probe at step 128 had cost six more verification steps of the whole batch).

*The drafter's record* (proposer-wide): the drafts its verifications accepted, against the
verifications (a proposal that found nothing counts as one with none accepted), over roughly
the last ``RECORD_WINDOW``. While it is below ``MIN_GAIN`` a verification, a new request
starts backed off: once its prompt is in (a draft model's KV follows the prefill) it pauses
for ``FIRST_BACKOFF_STEPS << SLUMP_LEVEL`` steps, then probes. Each new request of a server
whose drafter does not pay would otherwise spend two verifications of ``k`` drafts and probes
after 2, 4 and 8 steps learning what the requests before it learnt. A drafter that pays
(EAGLE's trained head: 1.3 drafts a verification) never comes near the mark; a request it
would serve waits at most ``2 << SLUMP_LEVEL`` steps for its first probe, and an accepted probe
brings back the full ``k``.

Probes are drafted on steps that are multiples of ``period``, on one step count for all requests,
so backed-off requests that arrived at different times probe on the same steps: a step that
verifies anyone's drafts runs the whole batch through the ``1 + k``-token verification
graph, and probes scattered over steps would make nearly every step such a step.

A draft model with a KV cache of its own that sets ``skips_deep_backoff`` (EAGLE) does not
follow steps in which every request is backed off (``deep``; ``DraftProposer``): between
probes those steps cost what plain decoding costs.
"""

from __future__ import annotations

import numpy as np

# The first backoff period, in steps; it doubles with each miss after that.
FIRST_BACKOFF_STEPS = 2
# Drafts a probe may have: one answers whether the drafter pays again, at the least cost of
# drafting and verification; an accepted one brings back the full ``k``.
PROBE_DRAFTS = 1
# The gain: each verification moves it a quarter of the way to the drafts it accepted. A new
# request starts low enough that two empty verifications are two misses; an empty one counts
# as a miss only below ``MIN_GAIN`` accepted drafts a verification, the break-even point of a
# speculative step that costs 1.25 plain ones (issue 21 asks for at most 1.3).
GAIN_ALPHA = 0.25
GAIN_START = 0.3
MIN_GAIN = 0.25
# The drafter's record: both of its sums halve at the end of a step once the verifications
# pass this, so that it spans roughly the last 32-64 of them; below ``RECORD_MIN``
# verifications it is not read (a new engine drafts).
RECORD_WINDOW = 64
RECORD_MIN = 8
# A request that starts while the drafter's record is below ``MIN_GAIN`` starts at this
# level of backoff: its first probe after ``FIRST_BACKOFF_STEPS << SLUMP_LEVEL`` (64) steps.
# Each probe is a verification step of the whole batch (1.1 ms on the demo model at batch 32
# on the H200, against a 0.64 ms plain step); from level 3 (16 steps) a useless drafter's
# requests probed 4-5 times in 256 tokens, from level 5 twice or three times: 0.93 -> 0.97x
# of plain decoding at batch 32, 0.95 -> 1.0x at batch 1 (docs/results/2026-11-28-s31/).
SLUMP_LEVEL = 5


class DraftBackoff:
    """Per block-table row: the gain and the misses in a row of the request on it, and the
    step from which it drafts again. ``reset(row)`` when a new request (or a resumed one) takes the row."""

    def __init__(self, max_num_reqs: int, backoff_after: int, max_backoff_steps: int) -> None:
        assert backoff_after >= 1 and max_backoff_steps >= 1
        self.backoff_after = backoff_after
        self.max_backoff_steps = max_backoff_steps
        self.misses = np.zeros(max_num_reqs, dtype=np.int64)
        self.resume_step = np.zeros(max_num_reqs, dtype=np.int64)
        self.gain = np.full(max_num_reqs, GAIN_START)
        # The pause a probe that hit was at, as a doubling count: where its next miss resumes.
        self.level = np.zeros(max_num_reqs, dtype=np.int64)
        # Whether the request has sampled since it took the row (``_start``: the record is
        # read when it first could draft, after its prompt).
        self.started = np.ones(max_num_reqs, dtype=bool)
        # The drafter's record: accepted drafts and verifications, float sums halved now and
        # then (``end_step``), and this step's, integers, added to them when the step ends.
        self.record_accepted = 0.0
        self.record_verifications = 0.0
        self._step_accepted = 0
        self._step_verifications = 0
        # Requests started backed off (``_start``), ever: a step that started any is followed
        # by a draft model, for their prompt's KV (``DraftProposer.propose_step``).
        self.num_slump_starts = 0
        self.step = 0  # the step being run; ``cap`` ends it
        self.num_skipped = 0  # request-steps that could have drafted but were backed off

    def reset(self, row: int | list[int]) -> None:
        self.misses[row] = 0
        self.resume_step[row] = 0
        self.gain[row] = GAIN_START
        self.level[row] = 0
        self.started[row] = False

    def in_slump(self) -> bool:
        """Whether the drafter's recent verifications accepted fewer than ``MIN_GAIN`` drafts
        each (over at least ``RECORD_MIN`` of them): new requests then start backed off."""
        return self.record_verifications >= RECORD_MIN and self.record_accepted < MIN_GAIN * self.record_verifications

    def observe(self, rows: np.ndarray, num_drafts: np.ndarray, num_accepted: np.ndarray) -> None:
        """This step's verification: request ``rows[i]`` had ``num_drafts[i]`` drafts and
        accepted ``num_accepted[i]`` of them (rows without drafts are left as they are)."""
        drafted = num_drafts > 0
        rows, accepted = rows[drafted], num_accepted[drafted]
        self._step_accepted += int(accepted.sum())
        self._step_verifications += len(rows)
        gain = self.gain[rows] = (1 - GAIN_ALPHA) * self.gain[rows] + GAIN_ALPHA * accepted
        hit = rows[accepted > 0]
        # After a probe, on probation at the pause it had: its next miss pauses it again, so
        # that a lucky draft does not buy a drafter that does not pay ``backoff_after`` more
        # rounds of k drafts, nor a climb through the short pauses again.
        probed = self.misses[hit] >= self.backoff_after
        self.level[hit] = np.where(probed, self.level[hit] + self.misses[hit] - self.backoff_after, 0)
        self.misses[hit] = np.where(probed, self.backoff_after - 1, 0)
        self.resume_step[hit] = 0
        self._miss(rows[(accepted == 0) & (gain < MIN_GAIN)])

    def observe_row(self, row: int, num_drafts: int, num_accepted: int) -> None:
        """``observe`` for one row that had drafts (``DraftProposer`` for small batches)."""
        self._step_accepted += num_accepted
        self._step_verifications += 1
        gain = self.gain[row] = (1 - GAIN_ALPHA) * self.gain[row] + GAIN_ALPHA * num_accepted
        if num_accepted > 0:
            misses = int(self.misses[row])
            if misses >= self.backoff_after:
                self.level[row] += misses - self.backoff_after
                self.misses[row] = self.backoff_after - 1
            else:
                self.level[row] = self.misses[row] = 0
            self.resume_step[row] = 0
        elif gain < MIN_GAIN:
            self.miss_row(row)

    def empty_row(self, row: int) -> None:
        """``observe_empty`` for one row."""
        self._step_verifications += 1
        self.miss_row(row)

    def miss_row(self, row: int) -> None:
        """A miss of one row (``_miss``)."""
        misses = self.misses[row] = self.misses[row] + 1
        over = int(misses) - self.backoff_after
        if over >= 0:
            self.resume_step[row] = self._resume_after(over + int(self.level[row]))

    def observe_empty(self, rows: np.ndarray) -> None:
        """The proposer was asked for drafts for ``rows`` and found none (no n-gram match): a
        miss too. Such a request gains nothing from the step, yet an engine with a request
        that may draft cannot run the next step ahead (async scheduling)."""
        self._step_verifications += len(rows)
        self._miss(rows)

    def _miss(self, missed: np.ndarray) -> None:
        self.misses[missed] += 1
        over = self.misses[missed] - self.backoff_after
        backed = missed[over >= 0]
        level = over[over >= 0] + self.level[backed]
        period = np.minimum(FIRST_BACKOFF_STEPS << np.minimum(level, 30), self.max_backoff_steps)
        self.resume_step[backed] = (self.step // period + 1) * period

    def _start(self, rows: np.ndarray | list[int]) -> None:
        """Requests on ``rows`` could draft for the first time (their prompt is in): while the
        drafter is in a slump (``in_slump``) they start backed off at ``SLUMP_LEVEL``, probing
        first at the next multiple of its pause, with no gain to their name."""
        self.started[rows] = True
        if self.in_slump():
            self.num_slump_starts += len(rows)
            self.misses[rows] = self.backoff_after
            self.level[rows] = SLUMP_LEVEL
            self.gain[rows] = 0.0
            self.resume_step[rows] = self._resume_after(SLUMP_LEVEL)

    def _resume_after(self, level: int) -> int:
        """The step a request paused at ``level`` (doublings of ``FIRST_BACKOFF_STEPS``, up
        to ``max_backoff_steps``) probes again: the next multiple of its pause (``_miss`` is
        the same over many rows)."""
        period = min(FIRST_BACKOFF_STEPS << min(level, 30), self.max_backoff_steps)
        return (self.step // period + 1) * period

    def deep(self, rows: np.ndarray) -> bool:
        """Whether every request on ``rows`` is backed off (pausing between probes, or
        probing). A draft model's KV would buy them little: keeping it in step cost a head
        pass per step. On the CPU, with every draft rejected (the demo model, 256 tokens),
        EAGLE ran at 0.55x of no speculation following every step and 0.75x (batch 1) /
        0.91x (batch 32) skipping all steps where nobody drafts; skipping only after four
        misses running (session 25) cost the trained head no acceptance, and from the
        first pause (this) neither: 1.80 tokens a step either way."""
        return len(rows) > 0 and bool((self.misses[rows] >= self.backoff_after).all())

    def skip(self, rows: list[int], one_by_one: bool) -> None:
        """A step whose proposal was left out (``DraftProposer.step_skipped``: every request of
        it sampled, none may draft), counted as ``cap`` counts one; ``one_by_one`` for a few
        rows, where indexing each costs less than a numpy call."""
        if one_by_one:
            self.num_skipped += sum(1 for r in rows if self.resume_step[r] > self.step)
        else:
            self.num_skipped += int(np.count_nonzero(self.resume_step[np.asarray(rows)] > self.step))
        self.end_step()

    def skip_all(self, num_rows: int) -> None:
        """``skip`` for ``num_rows`` rows all backed off past this step."""
        self.num_skipped += num_rows
        self.end_step()

    def cap(self, rows: np.ndarray, max_drafts: np.ndarray) -> np.ndarray:
        """``max_drafts`` (per request of the step, for the next one) with backed-off requests'
        set to 0, and a probe's to ``PROBE_DRAFTS``. The step's last call: it ends the step."""
        starting = ~self.started[rows] & (max_drafts > 0)
        if starting.any():
            self._start(rows[starting])
        capped = np.where(self.resume_step[rows] > self.step, 0, max_drafts)
        self.num_skipped += int(np.count_nonzero(capped < max_drafts))
        self.end_step()
        probing = (self.misses[rows] >= self.backoff_after) & (capped > PROBE_DRAFTS)
        if probing.any():
            capped[probing] = PROBE_DRAFTS
        return capped

    def cap_row(self, row: int, max_drafts: int) -> int:
        """``cap`` for one row, without ending the step: ``end_step`` once every row of the
        step is capped."""
        if max_drafts and not self.started[row]:
            self._start([row])
        capped = 0 if self.resume_step[row] > self.step else max_drafts
        if capped < max_drafts:
            self.num_skipped += 1
        if capped > PROBE_DRAFTS and self.misses[row] >= self.backoff_after:
            capped = PROBE_DRAFTS
        return capped

    def end_step(self) -> None:
        """The step's verifications go into the drafter's record (halved once it spans more
        than ``RECORD_WINDOW``), and the clock ticks."""
        if self._step_verifications:
            self.record_accepted += self._step_accepted
            self.record_verifications += self._step_verifications
            self._step_accepted = self._step_verifications = 0
            if self.record_verifications > RECORD_WINDOW:
                self.record_accepted *= 0.5
                self.record_verifications *= 0.5
        self.step += 1
