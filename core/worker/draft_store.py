"""Drafts kept on the device between the step that proposed them and the step that verifies
them (``DeviceDrafts``), so that the host does not wait for the drafting before it schedules
and stages the next step.

The engine's scheduler sees ``DEFERRED`` in place of each draft: it counts drafts and cuts
them to what fits, never reads them. The store keeps each request's drafts on its block-table
row, and the next verification takes them from there::

    proposal t    ids[row, :w] = drafts            (a device copy)
    verify t+1    graph input_ids <- ids[row, :c]   (in the graph, from staged indices into ids,
                                                     clamped into the vocabulary:
                                                     ``CudaGraphRunner.draft_source``)
                  greedy requests only: judged in the graph (``CudaGraphRunner.verdict``);
                  the host reads the argmax and the matches, never the drafts
                  otherwise: host values <- a copy to pinned memory (``resolve``, with the
                                                     verification: the rejection sampler
                                                     compares them)

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
        self.copied = torch.cuda.Event() if cuda else None  # the host copy, made by resolve
        self.stream = torch.cuda.current_stream(device) if cuda else None  # held: see ModelRunner.stream

    def keep(self, rows: np.ndarray, drafts: DeviceDrafts) -> list[list[int]]:
        """Keep ``drafts`` (one row per request, on block-table ``rows``); the scheduler's
        placeholders for them."""
        counts = drafts.num_drafts.tolist()
        width = max(counts, default=0)
        if width == 0:
            return [[] for _ in range(len(counts))]
        n = len(counts)
        row_list = rows.tolist()
        first = row_list[0]
        if n == 1 or row_list == list(range(first, first + n)):  # one slice: no index to upload
            self.ids[first : first + n, :width].copy_(drafts.token_ids[:, :width])
        else:
            rows_t = torch.from_numpy(rows).to(self.device, non_blocking=True)
            self.ids[rows_t, :width] = drafts.token_ids[:, :width].to(torch.long)
        return [[DEFERRED] * c for c in counts]

    @staticmethod
    def is_deferred(drafts) -> bool:
        return any(len(d) and d[0] == DEFERRED for d in drafts)

    def sources_of(self, row: int, count: int) -> range:
        """Flat indices into ``ids`` of the first ``count`` drafts kept on ``row``."""
        k = self.ids.shape[1]
        return range(row * k, row * k + count)

    def sources(self, rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """``sources_of`` the requests on ``rows``, ``counts[i]`` each, in request order."""
        return np.array(
            [i for row, count in zip(rows.tolist(), counts.tolist()) for i in self.sources_of(row, count)], dtype=np.int64
        )

    def resolve(self, proposer: Proposer, drafts, rows: np.ndarray) -> list[list[int]]:
        """``drafts`` with every ``DEFERRED`` list replaced by its values (waits for the
        copy of the proposal to the host), checked against the vocabulary."""
        if self.copied is not None:  # copied now, when a step wants them: a greedy graph step never does
            self.host.copy_(self.ids, non_blocking=True)
            self.copied.record(self.stream)
            self.copied.synchronize()
        kept = self.host.numpy()[rows]
        if len(kept) and (kept.min() < 0 or kept.max() >= self.vocab_size):  # rare: name the culprit
            check_draft_ids(proposer, [int(t) for d, r in zip(drafts, kept) for t in _values(d, r)], self.vocab_size)
        return [_values(d, r) for d, r in zip(drafts, kept.tolist())]


def _values(drafts, kept_row) -> list:
    """A request's drafts: its kept row's first ``len(drafts)`` when they are ``DEFERRED``."""
    return list(kept_row[: len(drafts)]) if len(drafts) and drafts[0] == DEFERRED else list(drafts)
