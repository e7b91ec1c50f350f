"""The engine core in its own process: ``python -m pagelm.engine.core_proc FD``.

The API process passes one end of a Unix socket pair as file descriptor ``FD``. Everything on
it is msgpack (never pickle)::

    API -> core:  ["init", engine_config_dict, eos_token_ids]   once, first
                  ["add", encoded_request] | ["abort", ids] | ["stop", ids] | ["shutdown", None]
    core -> API:  ["ready", {max_model_len, vocab_size, num_kv_blocks, block_size}]
                  ["out", encoded_outputs, encoded_stats]        after every step
                  ["error", exception_type_name, message]         start-up failure or crash

The process exits when the socket closes, so it never outlives the API process.
"""

from __future__ import annotations

import logging
import select
import socket
import sys
import traceback

import msgpack

from pagelm.config import EngineConfig
from pagelm.engine.core_loop import (
    ADD,
    REJECT,
    SHUTDOWN,
    core_facts,
    decode_request,
    encode_outputs,
    encode_stats,
    freeze_heap,
    run_core_loop,
)

logger = logging.getLogger("pagelm")


class MsgSocket:
    """msgpack messages over a stream socket, for the engine core's side.

    Step outputs never make the step loop wait for the API process: ``publish`` sends what the
    socket takes now and keeps the rest; outputs published while earlier ones are still queued
    merge into one message. ``recv(block=False)`` never waits."""

    def __init__(self, sock: socket.socket, unpacker: msgpack.Unpacker | None = None) -> None:
        self.sock = sock
        self.unpacker = unpacker or msgpack.Unpacker()
        self.packer = msgpack.Packer()
        self._out = bytearray()  # encoded, not yet taken by the socket
        self._outputs: list | None = None  # published outputs not yet encoded
        self._stats: list | None = None

    def send(self, msg) -> None:
        """Send one message, after everything published before it (blocking)."""
        self._encode_pending()
        self.sock.sendall(bytes(self._out) + self.packer.pack(msg))
        self._out.clear()

    def publish(self, outputs: list, stats: list) -> None:
        if self._outputs is None:
            self._outputs = outputs
        else:
            self._outputs.extend(outputs)
        self._stats = stats
        self._flush()

    def _encode_pending(self) -> None:
        if self._outputs is not None:
            self._out += self.packer.pack(["out", self._outputs, self._stats])
            self._outputs = None

    def _flush(self) -> None:
        while True:
            if not self._out:
                self._encode_pending()
                if not self._out:
                    return
            try:
                sent = self.sock.send(self._out, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return  # the API process is behind: keep stepping, merge later outputs
            del self._out[:sent]

    def recv(self, block: bool) -> list:
        """Every whole message that has arrived; with ``block``, at least one (while waiting,
        queued outputs keep going out)."""
        while True:
            msgs = self._read_available()
            if msgs or not block:
                return msgs
            self._flush()
            writing = bool(self._out) or self._outputs is not None
            readable, writable, _ = select.select([self.sock], [self.sock] if writing else [], [])
            if writable:
                self._flush()

    def _read_available(self) -> list:
        msgs: list = []
        while True:
            try:
                data = self.sock.recv(1 << 16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return msgs
            if not data:
                raise EOFError("the API process closed the engine core socket")
            self.unpacker.feed(data)
            msgs.extend(self.unpacker)


def serve(conn: MsgSocket) -> int:
    from pagelm.engine.engine_core import EngineCore  # heavy: torch, the model

    try:
        kind, config_dict, eos = conn.recv(block=True)[0]
        assert kind == "init", kind
        config = EngineConfig(**config_dict)
        share_cpu(config)
        use_own_gpu(config)
        core = EngineCore(config, frozenset(eos))
    except Exception as exc:  # a bad config or model: tell the API process why, then exit
        conn.send(["error", type(exc).__name__, str(exc)])
        return 1
    conn.send(["ready", core_facts(core)])
    freeze_heap()

    def inbox(block: bool) -> list:
        try:
            msgs = conn.recv(block)
        except EOFError:
            return [(SHUTDOWN, None)]
        return [_decode_command(kind, p) for kind, p in msgs]

    def publish(outputs, stats) -> None:
        conn.publish(encode_outputs(outputs), encode_stats(stats))

    try:
        run_core_loop(core, inbox, publish)
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the API process is gone
    except Exception as exc:
        logger.error("engine core crashed:\n%s", traceback.format_exc())
        try:
            conn.send(["error", type(exc).__name__, f"engine core crashed: {exc}"])
        except OSError:
            pass
        return 1
    finally:
        core.shutdown()
    return 0


def _decode_command(kind: str, payload) -> tuple:
    """An ADD's payload becomes a Request; one that does not (a field the API process should
    have rejected) becomes a REJECT of that request alone."""
    if kind != ADD:
        return kind, payload
    try:
        return ADD, decode_request(payload)
    except Exception as exc:
        req_id = payload[0] if isinstance(payload, list) and payload and isinstance(payload[0], str) else "?"
        return REJECT, (req_id, f"invalid request: {type(exc).__name__}: {exc}")


def share_cpu(config: EngineConfig) -> None:
    """On CPU, leave one core to the API process for short steps: idle OpenMP threads spin,
    and a spinning thread on every core starves the event loop that feeds this one. Long
    steps (many prompt tokens) take every core (``pagelm.worker.cpu_threads``)."""
    import os

    import torch

    from pagelm.worker.cpu_threads import StepThreads, set_step_threads

    if "OMP_NUM_THREADS" in os.environ or config.resolved_device().type != "cpu":
        return
    every_core = torch.get_num_threads()
    set_step_threads(StepThreads(few=max(1, min(every_core, (os.cpu_count() or 1) - 1)), many=every_core))


def use_own_gpu(config: EngineConfig) -> None:
    """A core on ``cuda:N`` (a data-parallel replica's, from N = 1 on) makes N this process's
    current GPU before building anything: Triton launches its kernels, and CUDA graphs are
    captured, on the current GPU, which is otherwise GPU 0 ("Pointer argument cannot be
    accessed from Triton" on two H100s)."""
    import torch

    device = config.resolved_device()
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [core] %(message)s")
    sock = socket.socket(fileno=int(argv[0]))
    return serve(MsgSocket(sock))


if __name__ == "__main__":
    sys.exit(main())
