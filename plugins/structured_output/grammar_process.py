"""The grammar process: a child process that keeps a mirror of every guided request's grammar
and fills their rows of the batch bitmask in memory that both map, so that no grammar work
holds the engine's GIL.

Why a process: with a worker thread, the xgrammar calls release the GIL but the thread still
needs it around them. On the H100 host at batch 64 its accept + fill took 0.5 ms of CPU and
1.28 ms of wall time, and every stage of the step loop beside it ran 20-50% slower: a decode
step that is GPU-bound unconstrained (1.70 ms, llama-3.2-1b) became host-bound (1.9-2.0 ms).
Across a process boundary the step loop pays a pipe message each way::

    engine core (GrammarManager)                   grammar process (serve)
      submit:          add(slot, params) ───────►  compile (its own cache), new matcher
      prepare_bitmask: step(slots, tokens) ─────►  accept the tokens, fill rows 0..n-1
                                                   of the shared bitmask
      _finish_job:     ◄─────── (unfilled rows, rejected rows)
      release:         release(slot) ───────────►  drop the matcher

The mirror is an accelerator, not the owner: the engine core still compiles every grammar
(errors, time limits, the ``WAITING_FOR_GRAMMAR`` state) and keeps its own matcher per request,
which it brings up to date only when it needs it (a row the process did not fill: a request
added before the process was ready, a grammar it is still compiling; drafts to check). If the
process dies, the engine core does all the work itself from then on.

The process is started with ``python -m`` (not ``multiprocessing``: its spawn would re-import
the user's ``__main__``), talks over two pipes (``multiprocessing.connection`` framing of
msgpack messages, never pickle: the backend class goes by its import path, the config as
plain data, a constraint as its kind and canonical spec), and ends when the engine closes
the pipe. Its bitmask is a file in ``/dev/shm`` that both map; on
CUDA machines the engine registers it as pinned memory, so its upload stays asynchronous.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import importlib
import json
import logging
import mmap
import os
import subprocess
import sys
import tempfile
import weakref
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import msgpack
import torch

from pagelm.config import EngineConfig
from pagelm.sampling_params import GuidedDecodingParams
from pagelm.plugins.structured_output.grammar import GrammarOffload

if TYPE_CHECKING:
    from pagelm.plugins.structured_output.backend import GrammarBackend

logger = logging.getLogger("pagelm")

_COMPILE_WORKERS = 2


def _map(path: str, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size < nbytes:
            os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


class _Wire:
    """One direction of a pipe carrying msgpack messages (lists of plain data)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def send(self, message: list) -> None:
        self.conn.send_bytes(msgpack.packb(message))

    def recv(self) -> list:
        return msgpack.unpackb(self.conn.recv_bytes())

    def poll(self, timeout: float) -> bool:
        return self.conn.poll(timeout)

    def close(self) -> None:
        self.conn.close()


def _constraint(params: "GuidedDecodingParams") -> list[str]:
    """A constraint as [kind, canonical spec]: also a JSON schema holding integers past 64
    bits (valid JSON) crosses msgpack as text."""
    return [params.kind, params.spec]


def _params(kind: str, spec: str) -> "GuidedDecodingParams":
    if kind == "json_object":
        return GuidedDecodingParams(json_object=True)
    if kind == "choice":
        return GuidedDecodingParams(choice=json.loads(spec))
    return GuidedDecodingParams(**{kind: spec})


def _bitmask_view(buffer: mmap.mmap, rows: int, words: int) -> torch.Tensor:
    return torch.frombuffer(buffer, dtype=torch.int32, count=rows * words).view(rows, words)


class GrammarProcess(GrammarOffload):
    """The engine core's handle on the grammar process (what ``XgrammarBackend.offload``
    returns). Not thread-safe: the step loop's thread uses it."""

    def __init__(
        self,
        backend_cls: type["GrammarBackend"],
        config: "EngineConfig",
        vocab_size: int,
        eos_token_ids: frozenset[int],
        rows: int,
        *,
        pin_memory: bool = False,
    ) -> None:
        words = -(-vocab_size // 32)
        # A file in memory (tmpfs) both processes map: multiprocessing's SharedMemory would
        # start a resource-tracker process on each side.
        tmpfs = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, self._path = tempfile.mkstemp(prefix="pagelm-bitmask-", dir=tmpfs)
        os.close(fd)
        buffer = _map(self._path, rows * words * 4)
        # Rows the process fills; the engine core fills the rows it left, in place.
        self.bitmask = _bitmask_view(buffer, rows, words)
        pinned = pin_memory and _pin(self.bitmask)
        # Unpinned before the memory can be unmapped, also when the engine is dropped without
        # a shutdown: CUDA would keep the range registered, and a later pinned allocation at
        # that address fails ("already mapped"). The finalizer holds the mapping until then.
        self._unpin = weakref.finalize(self, _unpin, buffer, self.bitmask.data_ptr() if pinned else None)
        self._unpin.atexit = False
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(to_child_r), str(from_child_w)],
            pass_fds=(to_child_r, from_child_w), close_fds=True,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._send = _Wire(Connection(to_child_w, readable=False))
        self._recv = _Wire(Connection(from_child_r, writable=False))
        backend_path = f"{backend_cls.__module__}:{backend_cls.__qualname__}"
        self._send.send([
            list(sys.path), backend_path, dataclasses.asdict(config), vocab_size, sorted(eos_token_ids),
            self._path, rows, words,
        ])
        self._ready = False
        self.alive = True

    def wait_ready(self, timeout: float) -> bool:
        if not self._ready and self.alive:
            try:
                if self._recv.poll(timeout):
                    status, detail = self._recv.recv()
                    if status == "ready":
                        self._ready = True
                    else:
                        self._died(f"could not start: {detail}")
            except (EOFError, OSError) as exc:
                self._died(repr(exc))
        return self._ready and self.alive

    def add(self, slot: int, params: "GuidedDecodingParams") -> None:
        self._post(["add", slot, *_constraint(params)])

    def release(self, slot: int) -> None:
        self._post(["release", slot])

    def step(self, slots: list[int], tokens: list[list[int]]) -> None:
        self._post(["step", slots, tokens])

    def result(self) -> tuple[list[int] | None, list[int]]:
        if self.alive:
            try:
                return self._recv.recv()
            except (EOFError, OSError) as exc:
                self._died(repr(exc))
        return None, []

    def _post(self, message: list) -> None:
        if self.alive:
            try:
                self._send.send(message)
            except OSError as exc:
                self._died(repr(exc))

    def _died(self, why: str) -> None:
        if self.alive:
            logger.warning("the grammar process stopped (%s); the engine core fills the bitmask itself", why)
        self.alive = False

    def close(self) -> None:
        self.alive = False
        for conn in (self._send, self._recv):
            conn.close()  # the process sees EOF and exits
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._unpin()
        with contextlib.suppress(FileNotFoundError):  # the process removes it once mapped
            os.unlink(self._path)


def _pin(bitmask: torch.Tensor) -> bool:
    """Register ``bitmask``'s memory with CUDA as pinned (False if that failed)."""
    try:
        err = torch.cuda.cudart().cudaHostRegister(bitmask.data_ptr(), bitmask.nbytes, 0)
    except Exception as exc:  # no CUDA runtime
        logger.warning("could not pin the grammar process's bitmask: %r", exc)
        return False
    ok = int(getattr(err, "value", err)) == 0
    if not ok:
        logger.warning("could not pin the grammar process's bitmask: cudaHostRegister returned %s", err)
    return ok


def _unpin(buffer: mmap.mmap, pinned_ptr: int | None) -> None:
    """The finalizer: ``buffer`` is only held, so that it is unmapped after this."""
    if pinned_ptr is not None:
        torch.cuda.cudart().cudaHostUnregister(pinned_ptr)


# ---- the process ---------------------------------------------------------------------------


class _Mirror:
    """The process's side: matchers by slot, compiles, and the step."""

    def __init__(self, backend, cache_bytes: int, bitmask: torch.Tensor) -> None:
        from pagelm.plugins.structured_output.cache import GrammarCache

        self.backend = backend
        self.bitmask = bitmask
        self.cache = GrammarCache(cache_bytes)
        self.compiles: dict[tuple[str, str], concurrent.futures.Future] = {}
        self.pool = concurrent.futures.ThreadPoolExecutor(_COMPILE_WORKERS, thread_name_prefix="pagelm-grammar")
        self.grammars: dict[int, Any] = {}  # slot -> matcher (None: out of step, never filled)
        self.waiting: dict[int, tuple[tuple[str, str], list[int]]] = {}  # slot -> (key, tokens so far)

    def add(self, slot: int, params: "GuidedDecodingParams") -> None:
        key = (params.kind, params.spec)
        compiled = self.cache.get(key)
        if compiled is not None:
            self.grammars[slot] = compiled.new_grammar()
            return
        if key not in self.compiles:
            self.compiles[key] = self.pool.submit(self.backend.compile, params)
        self.waiting[slot] = (key, [])

    def release(self, slot: int) -> None:
        self.grammars.pop(slot, None)
        self.waiting.pop(slot, None)

    def step(self, slots: list[int], tokens: list[list[int]]) -> tuple[list[int], list[int]]:
        self._take_compiled()
        rows, grammars, moves, unfilled = [], [], [], []
        for row, (slot, toks) in enumerate(zip(slots, tokens)):
            grammar = self.grammars.get(slot)
            if grammar is None:
                if slot in self.waiting:
                    self.waiting[slot][1].extend(toks)
                unfilled.append(row)
            else:
                rows.append(row)
                grammars.append(grammar)
                moves.append(toks)
        accepted = self.backend.batch_accept_tokens(grammars, moves) if grammars else []
        rejected = [row for row, ok in zip(rows, accepted) if not ok]
        if grammars:
            self.backend.fill_bitmasks(grammars, self.bitmask, rows=rows)
        return unfilled, rejected

    def _take_compiled(self) -> None:
        """Matchers for the slots whose grammar has compiled, brought up to their tokens (a
        compile that failed leaves its slots out of step: the engine core fails them too)."""
        done = {}
        for key, future in list(self.compiles.items()):
            if future.done():
                del self.compiles[key]
                done[key] = future.result() if future.exception() is None else None
                if done[key] is not None:
                    self.cache.put(key, done[key])
        for slot, (key, toks) in list(self.waiting.items()):
            if key in done:
                del self.waiting[slot]
                grammar = done[key].new_grammar() if done[key] is not None else None
                if grammar is not None and toks and not grammar.accept_tokens(toks):
                    grammar = None
                self.grammars[slot] = grammar


def serve(recv: _Wire, send: _Wire) -> None:
    search_path, backend_path, config_data, vocab_size, eos_token_ids, path, rows, words = recv.recv()
    sys.path[:] = search_path  # before the backend's module is imported
    buffer = _map(path, rows * words * 4)
    os.unlink(path)  # both sides map it now; the memory goes with the last mapping
    try:
        module, _, qualname = backend_path.partition(":")
        backend_cls = importlib.import_module(module)
        for name in qualname.split("."):
            backend_cls = getattr(backend_cls, name)
        config = EngineConfig(**config_data)
        backend = backend_cls.build(config, vocab_size, frozenset(eos_token_ids))
    except Exception as exc:
        send.send(["failed", f"{type(exc).__name__}: {exc}"])
        return
    mirror = _Mirror(backend, config.structured_output_cache_bytes, _bitmask_view(buffer, rows, words))
    send.send(["ready", None])
    while True:
        try:
            message = recv.recv()
        except (EOFError, OSError):  # the engine closed the pipe
            break
        kind = message[0]
        if kind == "step":
            send.send(list(mirror.step(message[1], message[2])))
        elif kind == "add":
            mirror.add(message[1], _params(message[2], message[3]))
        elif kind == "release":
            mirror.release(message[1])
    # Nothing to tear down for anyone: leave at once, not after a compile still running.
    os._exit(0)


if __name__ == "__main__":
    serve(_Wire(Connection(int(sys.argv[1]), writable=False)), _Wire(Connection(int(sys.argv[2]), readable=False)))
