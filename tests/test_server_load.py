"""Load on a real server over loopback: a thousand concurrent streaming clients, round after
round, and a storm of clients that hang up mid-stream. Nothing may be lost, duplicated or
leaked: every stream ends whole, the engine ends each round idle with every KV block free, and
the server's memory stays flat from round to round."""

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from test_server import API_KEY, MODEL, metrics, running_server, wait_for

CLIENTS = 1000
ROUNDS = 3
MAX_TOKENS = 6
NUM_BLOCKS = 512
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(llama_dir):
    with running_server(
        str(llama_dir), "--api-key", API_KEY, "--served-model-name", MODEL, "--num-kv-blocks", str(NUM_BLOCKS),
        "--max-model-len", "512", "--max-num-seqs", "256",
    ) as url:
        yield url


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` and all its descendants (the engine core)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
        total += int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) * 1024
    return total


def server_pid(url: str) -> int:
    """The pid listening on ``url``'s port (the ``pagelm serve`` process)."""
    port = int(url.rsplit(":", 1)[1])
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":  # LISTEN
                inodes.add(fields[9])
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                target = str(fd.readlink())
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    return int(proc.name)
        except (FileNotFoundError, PermissionError):
            continue
    raise AssertionError(f"no process listens on {url}")


async def stream_one(http: httpx.AsyncClient, i: int, hang_up_after: int | None = None) -> dict:
    """One streamed completion; what came back: the id(s), text, finish reason, usage, and
    whether ``[DONE]`` ended it. ``hang_up_after``: close the connection after that many
    content chunks."""
    body = {
        "model": MODEL, "prompt": f"client {i % 7}:", "max_tokens": MAX_TOKENS, "temperature": 0,
        "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True},
    }
    got = {"ids": set(), "text": "", "finish": None, "usage": None, "done": False}
    chunks = 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                got["done"] = True
                break
            event = json.loads(line[6:])
            assert "error" not in event, event
            got["ids"].add(event["id"])
            if event.get("usage"):
                got["usage"] = event["usage"]
            for choice in event["choices"]:
                got["text"] += choice["text"]
                got["finish"] = choice["finish_reason"] or got["finish"]
                chunks += bool(choice["text"])
            if hang_up_after is not None and chunks >= hang_up_after:
                break
    return got


def run_clients(url: str, n: int, hang_up_after: int | None = None) -> list[dict]:
    async def main():
        limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, headers=AUTH, limits=limits, timeout=300) as http:
            return await asyncio.gather(*(stream_one(http, i, hang_up_after) for i in range(n)))

    return asyncio.run(main())


def test_a_thousand_concurrent_streams_round_after_round(server):
    expected = {}
    for i in range(7):  # greedy: every client with the same prompt gets the same text
        r = httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=60, json={
            "model": MODEL, "prompt": f"client {i}:", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        })
        expected[i] = r.json()["choices"][0]["text"]
    pid = server_pid(server)
    before = metrics(server)
    memory, seconds = [], []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        results = run_clients(server, CLIENTS)
        seconds.append(time.perf_counter() - start)
        assert all(r["done"] and r["finish"] == "length" for r in results)
        assert [r["text"] for r in results] == [expected[i % 7] for i in range(CLIENTS)]
        assert all(r["usage"]["completion_tokens"] == MAX_TOKENS for r in results)
        ids = [r["ids"] for r in results]
        assert all(len(s) == 1 for s in ids) and len(set().union(*ids)) == CLIENTS  # none mixed, none shared
        assert wait_for(lambda: metrics(server)["pagelm:num_free_kv_blocks"] == NUM_BLOCKS)
        after = metrics(server)
        assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
        memory.append(rss_bytes(pid))
    served = after["vllm:request_success_total{finished_reason=length}"]
    served -= before.get("vllm:request_success_total{finished_reason=length}", 0)
    assert served == ROUNDS * CLIENTS
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == ROUNDS * CLIENTS * MAX_TOKENS
    print(f"rounds of {CLIENTS} streams: {[round(s, 1) for s in seconds]} s; server RSS {[m >> 20 for m in memory]} MiB")
    # The first round warms every pool and cache up; later rounds must not keep growing.
    growth = memory[-1] - memory[0]
    assert growth < 0.05 * memory[0], f"server memory by round: {[m >> 20 for m in memory]} MiB"


def test_a_disconnect_storm_leaves_nothing_running(server):
    before = metrics(server)
    storm = 200
    # Long requests, dropped after their first token: each must be aborted and its blocks freed.
    async def main():
        limits = httpx.Limits(max_connections=storm + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server, headers=AUTH, limits=limits, timeout=300) as http:
            async def drop(i):
                body = {"model": MODEL, "prompt": f"storm {i}", "max_tokens": 400, "stream": True, "ignore_eos": True}
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            return True  # leaving the block hangs up
            return await asyncio.gather(*(drop(i) for i in range(storm)))

    assert all(asyncio.run(main()))
    abort = "vllm:request_success_total{finished_reason=abort}"
    assert wait_for(lambda: metrics(server).get(abort, 0) - before.get(abort, 0) == storm, timeout=60)
    assert wait_for(lambda: metrics(server)["pagelm:num_free_kv_blocks"] == NUM_BLOCKS, timeout=30)
    after = metrics(server)
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    # The server serves on: a normal request right after.
    r = httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=60,
                   json={"model": MODEL, "prompt": "after", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
