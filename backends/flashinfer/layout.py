"""One step's batch in FlashInfer's terms, computed on the host with numpy: which requests go
to the decode wrapper and which to the prefill wrapper, and each part's KV as a page table
(``indptr``, ``indices``, ``last_page_len``)::

    requests:   | r0 decode | r1 decode | r2 prefill chunk | r3 prefill |
                  num_decodes = 2: the leading run of one-token requests
    r2's pages: indices[indptr[2]:indptr[3]] = block_table[2, :cdiv(seq_len, block_size)]
                last_page_len = tokens in its last page (1 .. block_size)

With cascade attention the first ``num_common_prefix_blocks`` blocks, identical in every
row (``common_prefix_blocks``), become one page table of their own (the shared level,
attended once by every query token); each request's own table then starts after them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class PageTable:
    indptr: np.ndarray  # int32 [rows + 1]
    indices: np.ndarray  # int32 [indptr[-1]]
    last_page_len: np.ndarray  # int32 [rows], 1 .. block_size

    @property
    def num_rows(self) -> int:
        return len(self.last_page_len)


def common_prefix_blocks(
    block_table: np.ndarray, num_computed_tokens: np.ndarray, block_size: int, min_blocks: int
) -> int:
    """Leading block-table columns identical in every row and cached before this step (every
    request has computed past them, so all of its new tokens come after them): the prefix that
    cascade attention reads once for the batch. 0 when fewer than ``min_blocks`` (0: off) or
    fewer than two requests::

        r0: | 4 5 6 | 7 1 |      3 common blocks, if each request has computed
        r1: | 4 5 6 | 9 2 |      at least 3 * block_size tokens
    """
    if min_blocks <= 0 or len(block_table) < 2:
        return 0
    limit = int(num_computed_tokens.min()) // block_size
    if limit < min_blocks:
        return 0
    same = (block_table[:, :limit] == block_table[0, :limit]).all(axis=0)
    num = limit if same.all() else int(same.argmin())
    return num if num >= min_blocks else 0


def page_table(block_table: np.ndarray, kv_lens: np.ndarray, block_size: int, first_block: int = 0) -> PageTable:
    """Row ``i`` covers ``kv_lens[i]`` tokens held by ``block_table[i, first_block:]``."""
    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    assert (kv_lens >= 1).all(), "every request attends at least one key"
    num_pages = (kv_lens + block_size - 1) // block_size
    indptr = np.zeros(len(kv_lens) + 1, dtype=np.int32)
    np.cumsum(num_pages, out=indptr[1:])
    width = int(num_pages.max()) if len(num_pages) else 0
    cols = block_table[:, first_block : first_block + width]
    assert cols.shape[1] == width, "the block table is narrower than the sequences it describes"
    indices = cols[np.arange(width)[None, :] < num_pages[:, None]].astype(np.int32)  # row-major: row by row
    last_page_len = (kv_lens - (num_pages - 1) * block_size).astype(np.int32)
    return PageTable(indptr, indices, last_page_len)


def padded_decode_table(
    block_table: np.ndarray, seq_lens: np.ndarray, block_size: int, num_padded: int
) -> PageTable:
    """A decode batch of ``len(block_table)`` requests padded to ``num_padded`` rows, as a
    captured graph replays it: each padding row attends one key in block 0 (its output is
    discarded; block 0 always exists)."""
    num_reqs = len(block_table)
    real = page_table(block_table, seq_lens[:num_reqs], block_size)
    num_pad = num_padded - num_reqs
    indptr = np.concatenate([real.indptr, real.indptr[-1] + np.arange(1, num_pad + 1, dtype=np.int32)])
    indices = np.concatenate([real.indices, np.zeros(num_pad, dtype=np.int32)])
    last_page_len = np.concatenate([real.last_page_len, np.ones(num_pad, dtype=np.int32)])
    return PageTable(indptr.astype(np.int32), indices, last_page_len)


def shared_prefix_table(prefix_blocks: np.ndarray, block_size: int) -> PageTable:
    """Cascade's shared level: the common prefix's (full) blocks as one row."""
    return PageTable(
        indptr=np.array([0, len(prefix_blocks)], dtype=np.int32),
        indices=np.asarray(prefix_blocks, dtype=np.int32),
        last_page_len=np.array([block_size], dtype=np.int32),
    )


@dataclass
class StepLayout:
    num_decodes: int  # requests [0, num_decodes) have one query token: the decode wrapper
    num_decode_tokens: int  # == num_decodes
    decode: PageTable | None
    prefill_qo_indptr: np.ndarray | None  # int32 [num_prefills + 1], from the first prefill token
    prefill: PageTable | None
    shared: PageTable | None  # cascade: the common prefix, one row for the whole batch

    def tables(self) -> list[PageTable]:
        return [t for t in (self.decode, self.prefill, self.shared) if t is not None]


def step_layout(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    num_common_prefix_blocks: int = 0,
) -> StepLayout:
    """Split the step at the end of its leading decodes (the scheduler puts decodes first; a
    decode found after a prefill simply goes through the prefill wrapper, which handles any
    query length) and describe each part's pages, after the shared prefix if there is one."""
    num_reqs = len(seq_lens)
    query_lens = np.diff(query_start_loc[: num_reqs + 1])
    longer = np.flatnonzero(query_lens != 1)
    num_decodes = int(longer[0]) if len(longer) else num_reqs
    skip = num_common_prefix_blocks
    kv_lens = np.asarray(seq_lens, dtype=np.int64) - skip * block_size
    decode = page_table(block_table[:num_decodes], kv_lens[:num_decodes], block_size, skip) if num_decodes else None
    prefill_qo_indptr = prefill = None
    if num_decodes < num_reqs:
        qsl = np.asarray(query_start_loc[num_decodes : num_reqs + 1], dtype=np.int64)
        prefill_qo_indptr = (qsl - qsl[0]).astype(np.int32)
        prefill = page_table(block_table[num_decodes:num_reqs], kv_lens[num_decodes:], block_size, skip)
    shared = shared_prefix_table(block_table[0, :skip], block_size) if skip else None
    return StepLayout(num_decodes, num_decodes, decode, prefill_qo_indptr, prefill, shared)
