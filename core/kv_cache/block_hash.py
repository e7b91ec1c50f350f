"""Chained block hashes for prefix caching.

Only full blocks are hashed. Each hash covers the parent block's hash, the block's token ids
and extra keys: the request's ``cache_salt`` (first block) and the identifier of every image
whose placeholders the block holds, so equal tokens at different positions, under different
salts, or standing for different images never share a cache entry::

    h0 = sha256(b"" | tokens[0:B] | salt)     h1 = sha256(h0 | tokens[B:2B] | images in it)   ...
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagelm.request import Request

BlockHash = bytes


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b""
) -> BlockHash:
    h = hashlib.sha256()
    h.update(parent_hash or b"\x00")
    h.update(array("q", token_ids).tobytes())
    h.update(len(extra_keys).to_bytes(4, "little"))
    h.update(extra_keys)
    return h.digest()


def make_block_hasher(block_size: int):
    """Returns ``hasher(request) -> new hashes``: the hashes of full blocks that the request
    has gained since it was last called (called once at creation and after each append)."""

    def hasher(request: "Request") -> list[BlockHash]:
        tokens = request.all_token_ids
        start = len(request.block_hashes)
        parent = request.block_hashes[-1] if start else None
        new: list[BlockHash] = []
        for i in range(start, len(tokens) // block_size):
            lo, hi = i * block_size, (i + 1) * block_size
            extra = request.cache_salt.encode() if i == 0 and request.cache_salt else b""
            if request.mm_features:  # the images with placeholders in this block
                extra += b"".join(f.identifier.encode() for f in request.mm_features if f.overlaps(lo, hi))
            parent = hash_block_tokens(parent, tokens[lo:hi], extra)
            new.append(parent)
        return new

    return hasher
