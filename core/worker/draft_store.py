"""Drafts kept on the device between the step that proposed them and the step that verifies
them (``DeviceDrafts``), so that the host does not wait for the drafting before it schedules
and stages the next step.

The engine's scheduler sees ``DEFERRED`` in place of each draft: it counts drafts and cuts
them to what fits, never reads them. The store keeps each request's drafts on its block-table
row, and the next verification takes them from there::

    proposal t    ids[row, :w] = drafts            (device copy, then a copy to pinned host)
    verify t+1    graph input_ids <- ids[row, :c]   (in the graph, from staged indices into ids,
                                                     clamped into the vocabulary:
                                                     ``CudaGraphRunner.draft_source``)
                  host values   <- the pinned copy  (waited for with the verification: the
                                                     rejection sampler compares them)

A row is rewritten only by a proposal for the request on it, so a request not scheduled in
the step after its proposal still finds its drafts there later.
"""

from __future__ import annotations

import numpy as np
import torch

from pagelm.spec_decode.proposer import DeviceDrafts, Proposer, check_draft_ids

# What the scheduler holds in place of a draft kept on the device.
DEFERRED = -2


class DraftStore:
    def __init__(self, max_rows: int, num_speculative_tokens: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.ids = torch.zeros((max_rows, num_speculative_tokens), dtype=torch.long, device=device)
        cuda = device.type == "cuda"
        self.host = torch.zeros((max_rows, num_speculative_tokens), dtype=torch.long, pin_memory=cuda) if cuda else self.ids
        self.copied = torch.cuda.Event() if cuda else None  # the host copy of the latest proposal
        self.stream = torch.cuda.current_stream(device) if cuda else None  # held: see ModelRunner.stream

    def keep(self, rows: np.ndarray, drafts: DeviceDrafts) -> list[list[int]]:
        """Keep ``drafts`` (one row per request, on block-table ``rows``); the scheduler's
        placeholders for them."""
        counts = drafts.num_drafts
        width = int(counts.max()) if len(counts) else 0
        if width == 0:
            return [[] for _ in range(len(counts))]
        first, n = int(rows[0]), len(rows)
        if n == 1 or rows.tolist() == list(range(first, first + n)):  # one slice: no index to upload
            self.ids[first : first + n, :width].copy_(drafts.token_ids[:, :width])
        else:
            rows_t = torch.from_numpy(rows).to(self.device, non_blocking=True)
            self.ids[rows_t, :width] = drafts.token_ids[:, :width].to(torch.long)
        if self.copied is not None:
            self.host.copy_(self.ids, non_blocking=True)
            self.copied.record(self.stream)
        return [[DEFERRED] * c for c in counts.tolist()]

    @staticmethod
    def is_deferred(drafts) -> bool:
        return any(len(d) and d[0] == DEFERRED for d in drafts)

    def sources(self, rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Flat indices into ``ids`` of the drafts of requests on ``rows``, ``counts[i]`` each,
        in request order."""
        k = self.ids.shape[1]
        return np.repeat(rows * k, counts) + _ranges(counts)

    def resolve(self, proposer: Proposer, drafts, rows: np.ndarray) -> list[list[int]]:
        """``drafts`` with every ``DEFERRED`` list replaced by its values (waits for the
        copy of the proposal to the host), checked against the vocabulary."""
        if self.copied is not None:
            self.copied.synchronize()
        kept = self.host.numpy()[rows]
        if len(kept) and (kept.min() < 0 or kept.max() >= self.vocab_size):  # rare: name the culprit
            check_draft_ids(proposer, [int(t) for d, r in zip(drafts, kept) for t in _values(d, r)], self.vocab_size)
        return [_values(d, r) for d, r in zip(drafts, kept.tolist())]


def _values(drafts, kept_row) -> list:
    """A request's drafts: its kept row's first ``len(drafts)`` when they are ``DEFERRED``."""
    return list(kept_row[: len(drafts)]) if len(drafts) and drafts[0] == DEFERRED else list(drafts)


def _ranges(counts: np.ndarray) -> np.ndarray:
    """``[0..counts[0]), [0..counts[1]), ...`` concatenated."""
    ends = np.cumsum(counts)
    return np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(ends - counts, counts)
