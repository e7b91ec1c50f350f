"""What a drafting proposer keeps per block-table row between steps: which request is on the
row, its token history, and how many drafts it was last handed.

The runner keeps one state object per running request on one row until the request finishes
or is preempted; a different object on a row (a new request, or one resumed after
preemption, possibly on the row it had) starts the row afresh. The history is copied in
incrementally, only the tokens a request gained since the last step::

    token_table[row]   | prompt ............ | outputs so far | (zeros)
                                              table_len[row] ^   ^ num_tokens: copied in now
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np

from pagelm.spec_decode.proposer import RequestView


class DraftRows:
    def __init__(self, max_num_reqs: int) -> None:
        # Weak, so that a finished request's token lists are not kept alive by a row nobody reuses.
        self._owner: list[weakref.ref | None] = [None] * max_num_reqs
        # Drafts handed out per row by the last proposal: none of them verified in the next
        # step means they were dropped on the way (no room, or a grammar allowed none).
        self.proposed = np.zeros(max_num_reqs, dtype=np.int64)
        # Host token history per row, allocated on first use (its width is max_model_len).
        self.token_table: np.ndarray | None = None
        self.table_len = np.zeros(max_num_reqs, dtype=np.int64)

    def is_new(self, request: RequestView) -> bool:
        """Whether ``request`` is not (yet) the one this state was kept for on its row."""
        owner = self._owner[request.row]
        return owner is None or owner() is not request

    def claim(self, requests: Sequence[RequestView]) -> list[int]:
        """Take each request's row, resetting a row that changed hands; returns those rows."""
        fresh = []
        for request in requests:
            if self.is_new(request):
                row = request.row
                self._owner[row] = weakref.ref(request)
                self.table_len[row] = 0
                self.proposed[row] = 0
                fresh.append(row)
        return fresh

    def history(
        self, requests: Sequence[RequestView], rows: np.ndarray, num_tokens: np.ndarray, max_model_len: int
    ) -> np.ndarray:
        """The requests' rows of the token table ``[n, max(num_tokens)]``, after copying in
        what each gained (its first ``num_tokens[i]`` tokens are its known ones)."""
        if self.token_table is None:
            self.token_table = np.zeros((len(self.table_len), max_model_len), dtype=np.int32)
        for request, row, end in zip(requests, rows.tolist(), num_tokens.tolist()):
            have = int(self.table_len[row])
            if have < end:
                self.token_table[row, have:end] = request.token_ids[have:end]
                self.table_len[row] = end
        return self.token_table[rows, : int(num_tokens.max())]
