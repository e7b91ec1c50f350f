"""The typed per-step context through which attention layers get this step's metadata.

The runner wraps each forward pass in ``with forward_context(ctx):``; layers read it with
``get_forward_context()``. A ``ContextVar`` (not a module global) keeps concurrent engines in
one process apart.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    attn_metadata: Any  # the backend's metadata object for this step


_current: ContextVar[ForwardContext | None] = ContextVar("pagelm_forward_context", default=None)


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def get_forward_context() -> ForwardContext:
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError("attention layer called outside a pagelm forward_context")
    return ctx
