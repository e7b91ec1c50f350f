"""Adaptive drafting: a request whose drafts keep being rejected stops drafting for a while,
with exponential backoff, so that speculation costs little where it does not pay.

A *miss* is a verification step in which the request had drafts and accepted none, a
proposal that found no drafts for it, or drafts dropped before verification (a guided
request's grammar allowed none of them; ``observe_empty``). After
``backoff_after`` misses in a row it gets no drafts for up to ``period`` steps, then drafts
once (a *probe*); each further miss doubles ``period`` (2, 4, 8, ... up to
``max_backoff_steps``), and any accepted draft puts it back to drafting every step::

    step       1     2     3  4  5     6  7  8  9     10 .. 16  17
    verifies   miss  miss  -  -  miss  -  -  -  miss  -  .. -   hit    (backoff_after = 2)
    period           2           4              8                 drafts every step again

Probes are drafted on steps that are multiples of ``period``, on one step count for all requests,
so backed-off requests that arrived at different times probe on the same steps: a step that
verifies anyone's drafts runs the whole batch through the ``1 + k``-token verification
graph, and probes scattered over steps would make nearly every step such a step.

A request is *deeply* backed off after ``DEEP_BACKOFF_MISSES`` misses past ``backoff_after``
(pauses of 8 steps and more) or once its pause reaches ``max_backoff_steps``. A draft model
with a KV cache of its own that sets ``skips_deep_backoff`` (EAGLE) does not follow steps in
which every request is deeply backed off (``DraftProposer``): between probes those steps
cost what plain decoding costs.
"""

from __future__ import annotations

import numpy as np

# The first backoff period, in steps; it doubles with each miss after that.
FIRST_BACKOFF_STEPS = 2
# Misses past ``backoff_after`` after which a request is *deeply* backed off (periods of 8
# steps and more): a draft model stops writing its KV for steps in which only such requests
# run (``DraftBackoff.deep``).
DEEP_BACKOFF_MISSES = 2
# Drafts a probe may have: one answers whether the drafter pays again, at the least cost of
# drafting and verification; an accepted one brings back the full ``k``.
PROBE_DRAFTS = 1


class DraftBackoff:
    """Per block-table row: the misses in a row of the request on it, and the step from which
    it drafts again. ``reset(row)`` when a new request (or a resumed one) takes the row."""

    def __init__(self, max_num_reqs: int, backoff_after: int, max_backoff_steps: int) -> None:
        assert backoff_after >= 1 and max_backoff_steps >= 1
        self.backoff_after = backoff_after
        self.max_backoff_steps = max_backoff_steps
        self.misses = np.zeros(max_num_reqs, dtype=np.int64)
        self.resume_step = np.zeros(max_num_reqs, dtype=np.int64)
        self.is_deep = np.zeros(max_num_reqs, dtype=bool)  # ``deep``, per row, kept by ``_miss``
        self.step = 0  # the step being run; ``cap`` ends it
        self.num_skipped = 0  # request-steps that could have drafted but were backed off

    def reset(self, row: int | list[int]) -> None:
        self.misses[row] = 0
        self.resume_step[row] = 0
        self.is_deep[row] = False

    def observe(self, rows: np.ndarray, num_drafts: np.ndarray, num_accepted: np.ndarray) -> None:
        """This step's verification: request ``rows[i]`` had ``num_drafts[i]`` drafts and
        accepted ``num_accepted[i]`` of them (rows without drafts are left as they are)."""
        drafted = num_drafts > 0
        hit = rows[drafted & (num_accepted > 0)]
        self.misses[hit] = 0
        self.resume_step[hit] = 0
        self.is_deep[hit] = False
        self._miss(rows[drafted & (num_accepted == 0)])

    def observe_empty(self, rows: np.ndarray) -> None:
        """The proposer was asked for drafts for ``rows`` and found none (no n-gram match): a
        miss too. Such a request gains nothing from the step, yet an engine with a request
        that may draft cannot run the next step ahead (async scheduling)."""
        self._miss(rows)

    def _miss(self, missed: np.ndarray) -> None:
        self.misses[missed] += 1
        over = self.misses[missed] - self.backoff_after
        backed = missed[over >= 0]
        over = over[over >= 0]
        period = np.minimum(FIRST_BACKOFF_STEPS << np.minimum(over, 30), self.max_backoff_steps)
        self.resume_step[backed] = (self.step // period + 1) * period
        self.is_deep[backed] = (over >= DEEP_BACKOFF_MISSES) | (period >= self.max_backoff_steps)

    def deep(self, rows: np.ndarray) -> bool:
        """Whether every request on ``rows`` is deeply backed off: ``DEEP_BACKOFF_MISSES``
        misses in a row past ``backoff_after`` (or its period at ``max_backoff_steps``).
        Their drafts have missed at least four times running, so what a draft model's KV
        would buy them is little. Keeping it in step cost a head pass per step: on the CPU,
        with every draft rejected, EAGLE ran at 0.55x of no speculation with it and 0.75x
        (batch 1) / 0.91x (batch 32) without (the demo model, 256 tokens)."""
        return len(rows) > 0 and bool(self.is_deep[rows].all())

    def cap(self, rows: np.ndarray, max_drafts: np.ndarray) -> np.ndarray:
        """``max_drafts`` (per request of the step, for the next one) with backed-off requests'
        set to 0. The step's last call: it ends the step."""
        capped = np.where(self.resume_step[rows] > self.step, 0, max_drafts)
        self.num_skipped += int(np.count_nonzero(capped < max_drafts))
        self.step += 1
        probing = (self.misses[rows] >= self.backoff_after) & (capped > PROBE_DRAFTS)
        if probing.any():
            capped[probing] = PROBE_DRAFTS
        return capped
