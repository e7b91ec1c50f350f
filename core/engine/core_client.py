"""Clients of an engine core that runs its own busy loop, for ``AsyncLLM``, which awaits
``get_output()`` for each step's outputs:

- ``MPCoreClient`` (the default): the core in its own process (msgpack over a Unix socket
  pair), so the API process's HTTP and (de)tokenizing never take the GIL from the step loop;
- ``InprocCoreClient``: the core loop in a thread of this process (no start-up cost).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import select
import socket
import subprocess
import sys
import threading
import weakref
from dataclasses import asdict, dataclass
from typing import Any

import msgpack

from pagelm.config import EngineConfig
from pagelm.engine.core_loop import (
    ABORT,
    ADD,
    SHUTDOWN,
    STOP,
    SchedulerStats,
    core_facts,
    decode_outputs,
    decode_stats,
    encode_request,
    run_core_loop,
)
from pagelm.engine.core_output import EngineCoreOutput
from pagelm.request import Request

logger = logging.getLogger("pagelm")


class EngineDeadError(RuntimeError):
    """The engine core stopped (crashed or its process died); no request can be served."""


class EngineShuttingDown(EngineDeadError):
    """The server is shutting down: no new request is taken, and those still running when
    the drain time is up are ended with this error."""


@dataclass
class CoreStep:
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats


class CoreClient:
    """What both clients share: the engine facts and the output queue."""

    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    eos_token_ids: frozenset[int]
    # The engine core's process id; None when the core runs in this process. Read, not
    # kept: a restarted core is a new process (the server's process metrics follow it).
    pid: int | None = None

    def __init__(self, eos_token_ids: frozenset[int]) -> None:
        self.eos_token_ids = eos_token_ids
        self._outputs: asyncio.Queue | None = None

    def set_facts(self, facts: dict[str, int]) -> None:
        """The engine core's ``core_facts``: what ``LLMEngine`` reads of its core."""
        self.max_model_len, self.vocab_size = facts["max_model_len"], facts["vocab_size"]
        self.num_kv_blocks, self.block_size = facts["num_kv_blocks"], facts["block_size"]

    async def start(self) -> None:
        """Begin delivering outputs to the running event loop."""
        self._outputs = asyncio.Queue()

    async def get_output(self) -> CoreStep:
        return await next_output(self._outputs)

    def add_request(self, request: Request) -> None:
        self._send(ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send(ABORT, list(request_ids))

    def finish_by_stop_string(self, request_ids: list[str]) -> None:
        self._send(STOP, list(request_ids))

    def _send(self, kind: str, payload: Any) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


class InprocCoreClient(CoreClient):
    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int]) -> None:
        from pagelm.engine.engine_core import EngineCore

        super().__init__(eos_token_ids)
        self.core = EngineCore(config, eos_token_ids)
        self.set_facts(core_facts(self.core))
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        await super().start()
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagelm-engine-core", daemon=True)
        self._thread.start()

    def _send(self, kind: str, payload: Any) -> None:
        self._commands.put((kind, payload))

    def _inbox(self, block: bool) -> list:
        items = [self._commands.get()] if block else []
        while True:
            try:
                items.append(self._commands.get_nowait())
            except queue.Empty:
                return items

    def _deliver(self, item: CoreStep | BaseException) -> None:
        self._loop.call_soon_threadsafe(self._outputs.put_nowait, item)

    def _run(self) -> None:
        try:
            run_core_loop(self.core, self._inbox, lambda outs, stats: self._deliver(CoreStep(outs, stats)))
        except Exception as exc:
            logger.exception("engine core crashed")
            self._deliver(EngineDeadError(f"engine core crashed: {exc}"))
        finally:
            self.core.shutdown()

    def shutdown(self) -> None:
        if self._thread is None:
            self.core.shutdown()  # the loop never ran; it would have called this
        elif self._thread.is_alive():
            self._send(SHUTDOWN, None)
            self._thread.join(timeout=10)
        self._thread = threading.Thread()  # marks "shut down"; shutdown() again is a no-op


_ERROR_TYPES = {"ValueError": ValueError, "TypeError": TypeError, "FileNotFoundError": FileNotFoundError}


class _CoreProtocol(asyncio.Protocol):
    """Feeds the socket's bytes to the msgpack unpacker; one queue item per message."""

    def __init__(self, client: "MPCoreClient", unpacker: msgpack.Unpacker) -> None:
        self.client = client
        self.unpacker = unpacker

    def data_received(self, data: bytes) -> None:
        self.unpacker.feed(data)
        for msg in self.unpacker:
            self.client._on_message(msg)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client._on_connection_lost(exc)


class MPCoreClient(CoreClient):
    """Starts ``python -m pagelm.engine.core_proc`` and waits until its model is loaded."""

    # Each core its own process: data-parallel replicas may each have their own ranks.
    runs_in_own_process = True

    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int]) -> None:
        super().__init__(eos_token_ids)
        self._packer = msgpack.Packer()
        self._unpacker = msgpack.Unpacker()
        self._transport: asyncio.Transport | None = None
        self._closing = False
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagelm.engine.core_proc", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self._sock = ours
        # Kill the core if this object is dropped without shutdown() (e.g. a failed start).
        self._finalizer = weakref.finalize(self, _stop_process, self.proc, ours)
        self._sock.sendall(self._packer.pack(["init", asdict(config), sorted(eos_token_ids)]))
        self.set_facts(self._wait_ready())

    def _wait_ready(self) -> dict:
        while True:
            readable, _, _ = select.select([self._sock], [], [], 0.5)
            data = self._sock.recv(1 << 16) if readable else b""
            if not data:
                if readable or self.proc.poll() is not None:  # the socket closed, or the process exited
                    code = self.proc.wait(timeout=10)
                    self._finalizer()
                    raise RuntimeError(f"the engine core process exited with code {code} while starting")
                continue
            self._unpacker.feed(data)
            for msg in self._unpacker:
                if msg[0] == "ready":
                    return msg[1]
                if msg[0] == "error":
                    self._finalizer()
                    raise _ERROR_TYPES.get(msg[1], RuntimeError)(msg[2])

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        # Same unpacker: bytes read during the handshake stay parsed in order.
        self._transport, _ = await loop.create_unix_connection(
            lambda: _CoreProtocol(self, self._unpacker), sock=self._sock
        )

    def _on_message(self, msg: list) -> None:
        if msg[0] == "out":
            self._outputs.put_nowait(CoreStep(decode_outputs(msg[1]), decode_stats(msg[2])))
        elif msg[0] == "error":
            self._outputs.put_nowait(EngineDeadError(msg[2]))
        else:
            logger.warning("unexpected message from the engine core: %r", msg[0])

    def _on_connection_lost(self, exc: Exception | None) -> None:
        if not self._closing:
            code = self.proc.poll()
            self._outputs.put_nowait(EngineDeadError(f"the engine core process died (exit code {code})"))

    def _send(self, kind: str, payload: Any) -> None:
        if kind == ADD:
            payload = encode_request(payload)
        data = self._packer.pack([kind, payload])
        if self._transport is not None:
            if not self._transport.is_closing():
                self._transport.write(data)
        else:
            self._sock.sendall(data)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        try:
            self._send(SHUTDOWN, None)
        except OSError:
            pass
        if self._transport is not None:
            self._transport.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._finalizer()


def _stop_process(proc: subprocess.Popen, sock: socket.socket) -> None:
    sock.close()
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def next_output(queue: asyncio.Queue) -> CoreStep:
    """The next step's outputs from ``queue``; an error put there is raised, and stays for
    every later caller too (the engine is dead for all of them)."""
    item = await queue.get()
    if isinstance(item, BaseException):
        queue.put_nowait(item)
        raise item
    return item
