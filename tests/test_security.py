"""Security properties that are not about one bad request (those are in
test_hostile_inputs.py): the API key is compared in constant time, no pickle travels between
pagelm's processes, cache_salt isolates the prefix cache, and a model's own Python code does
not run unless asked for. docs/security.md maps each to the vLLM advisory class it answers."""

import ast
import asyncio
import hmac
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagelm import LLM, SamplingParams
from pagelm.config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]


# ---- the API key: hmac.compare_digest (CVE-2025-59425 class) ----------------------------------


def _call(middleware, headers: list[tuple[bytes, bytes]], path: str = "/v1/completions") -> int:
    """The status the middleware answers a request with (200: it let it through)."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path, "method": "POST", "headers": headers, "query_string": b""}
    asyncio.run(middleware(scope, receive, send))
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


async def _ok_app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def test_the_api_key_is_compared_in_constant_time(monkeypatch):
    """Every decision goes through hmac.compare_digest (a plain == returns at the first
    differing byte, which leaks the key's prefix through response times)."""
    from pagelm.plugins.server.app import APIKeyMiddleware

    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    middleware = APIKeyMiddleware(_ok_app, api_key="s3cret-key")
    expected = b"Bearer s3cret-key"
    cases = {
        b"Bearer s3cret-key": 200,
        b"Bearer s3cret-kez": 401,  # same length, last byte differs
        b"Bearer s3cret": 401,  # a prefix
        b"Bearer s3cret-key-and-more": 401,
        b"bearer s3cret-key": 401,
        b"": 401,
    }
    for given, status in cases.items():
        calls.clear()
        assert _call(middleware, [(b"authorization", given)]) == status, given
        assert calls == [(given, expected)], given
    calls.clear()
    assert _call(middleware, []) == 401 and calls == [(b"", expected)]  # no header at all
    calls.clear()
    assert _call(middleware, [], path="/health") == 200 and calls == []  # probes need no key


def test_the_api_key_middleware_never_compares_the_key_with_eq():
    source = (ROOT / "plugins/server/app.py").read_text()
    cls = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == "APIKeyMiddleware")
    compares = [ast.unparse(n) for n in ast.walk(cls) if isinstance(n, ast.Compare) and "expected" in ast.unparse(n)]
    assert compares == []


# ---- no pickle between processes (CVE-2025-32444 / 30165 class) ------------------------------

# Every file that moves messages between pagelm's processes: the API process and the engine
# core, rank 0 and the tensor-parallel ranks, the engine core and the grammar process.
IPC_FILES = [
    "core/engine/core_client.py", "core/engine/core_proc.py", "core/engine/core_loop.py", "core/executor.py",
    "core/distributed.py", "core/worker/worker.py", "plugins/executors/__init__.py", "plugins/executors/mp.py",
    "plugins/structured_output/grammar_process.py",
]
PICKLING_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "joblib", "shelve", "marshal"}
# torch.distributed collectives that pickle their Python objects.
OBJECT_COLLECTIVES = {
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list", "send_object_list",
    "recv_object_list",
}
# multiprocessing's spawn bootstrap pickles the Process object (its target function and args:
# bytes, ints, a pipe end) once, to a child through an inherited pipe that nothing else can
# write to; every message after that is msgpack bytes (send_bytes / recv_bytes).
SPAWN_BOOTSTRAP = {"plugins/executors/mp.py"}


def pickle_uses(source: str, allow_spawn: bool = False) -> list[str]:
    """What in ``source`` would put pickle on an inter-process channel."""
    tree = ast.parse(source)
    found = []
    connections = set()  # names bound to multiprocessing Connection objects
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            found += [f"imports {n}" for n in names if n.split(".")[0] in PICKLING_MODULES]
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = ast.unparse(node.value.func)
            if func.split(".")[-1] in ("Pipe", "Connection", "Client") or func.endswith(".accept"):
                for target in node.targets:
                    elts = target.elts if isinstance(target, ast.Tuple) else [target]
                    connections |= {ast.unparse(e) for e in elts}
        elif isinstance(node, ast.arg) and node.annotation is not None and "Connection" in ast.unparse(node.annotation):
            connections.add(node.arg)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        name = func.split(".")[-1]
        base = func.rsplit(".", 1)[0] if "." in func else ""
        if func in ("torch.load", "load") and not any(
            k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True for k in node.keywords
        ):
            found.append(f"{func}(...) without weights_only=True")
        elif name in OBJECT_COLLECTIVES or name in ("send_pyobj", "recv_pyobj"):
            found.append(f"{func}(...) pickles")
        elif name in ("send", "recv") and base in connections:
            found.append(f"{func}(...) on a multiprocessing Connection pickles (use send_bytes / recv_bytes)")
        elif name in ("Queue", "SimpleQueue", "JoinableQueue") and base not in ("queue", "asyncio"):
            found.append(f"{func}() is a multiprocessing queue, which pickles")
        elif name == "Process" and not allow_spawn:
            found.append(f"{func}(...) spawns through pickle")
    return found


@pytest.mark.parametrize("path", IPC_FILES)
def test_no_pickle_on_the_inter_process_message_path(path):
    assert pickle_uses((ROOT / path).read_text(), allow_spawn=path in SPAWN_BOOTSTRAP) == []


@pytest.mark.parametrize("snippet, what", [
    ("import pickle\npickle.dumps(x)", "imports pickle"),
    ("from cloudpickle import dumps", "imports cloudpickle"),
    ("import torch\nstate = torch.load(f)", "without weights_only"),
    ("import torch\nstate = torch.load(f, weights_only=False)", "without weights_only"),
    ("from multiprocessing import Pipe\na, b = Pipe()\na.send({'x': 1})", "on a multiprocessing Connection"),
    ("from multiprocessing.connection import Connection\ndef f(conn: Connection):\n    return conn.recv()",
     "on a multiprocessing Connection"),
    ("import torch.distributed as dist\ndist.broadcast_object_list([x])", "pickles"),
    ("import multiprocessing as mp\nq = mp.Queue()", "multiprocessing queue"),
    ("sock.send_pyobj(x)", "pickles"),
    ("import multiprocessing\nmultiprocessing.get_context('spawn').Process(target=f, args=(x,))", "spawns"),
])
def test_the_pickle_scan_finds_each_kind_of_use(snippet, what):
    """The scan above is only worth something if it catches these."""
    found = pickle_uses(snippet)
    assert any(what in f for f in found), found


def test_the_pickle_scan_passes_msgpack_and_raw_bytes():
    ok = textwrap.dedent("""
        import msgpack, queue, torch
        from multiprocessing import Pipe
        a, b = Pipe(duplex=False)
        b.send_bytes(msgpack.packb([1, 2]))
        msgpack.unpackb(a.recv_bytes())
        q = queue.SimpleQueue()
        state = torch.load(f, weights_only=True)
    """)
    assert pickle_uses(ok) == []


# ---- cache_salt isolates the prefix cache --------------------------------------------------


def test_cache_salt_isolates_prefix_cache_hits(llama_dir):
    """Same prompt, different salts: no hit across salts (nor with no salt); same salt: a hit
    on every full block but the last token's."""
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, max_model_len=128)
    prompt = {"prompt_token_ids": list(range(5, 5 + 17))}  # four full blocks and one token
    params = SamplingParams(max_tokens=1)

    def cached(salt):
        return llm.generate([prompt], params, use_tqdm=False, cache_salt=salt)[0].num_cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # another salt: none of tenant-a's blocks
    assert cached(None) == 0  # no salt: none either
    assert cached("tenant-a") == 16  # the same salt: every full block
    assert cached("tenant-b") == 16
    assert cached(None) == 16


def test_block_hashes_are_sha256_chained_with_the_salt_in_the_first_block():
    from pagelm.kv_cache.block_hash import hash_block_tokens

    h = hash_block_tokens(None, [1, 2, 3, 4], b"salt")
    import hashlib
    from array import array

    expected = hashlib.sha256(b"\x00" + array("q", [1, 2, 3, 4]).tobytes() + (4).to_bytes(4, "little") + b"salt")
    assert h == expected.digest()
    assert hash_block_tokens(None, [1, 2, 3, 4], b"other") != h != hash_block_tokens(None, [1, 2, 3, 4])


# ---- trust_remote_code is off by default ---------------------------------------------------

EVIL_MODULE = '''
import os
from pathlib import Path
Path(os.environ["PAGELM_TEST_MARKER"]).write_text("remote code ran")
from transformers import LlamaConfig
class EvilConfig(LlamaConfig):
    model_type = "pagelm-evil"
'''


@pytest.fixture
def model_with_remote_code(llama_dir, tmp_path, monkeypatch):
    """A copy of the tiny model whose config.json names its own code (``auto_map``) for a model
    type transformers does not know: loading it needs that code, which writes a marker."""
    model = tmp_path / "evil-model"
    shutil.copytree(llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="pagelm-evil", auto_map={"AutoConfig": "evil_config.EvilConfig"})
    (model / "config.json").write_text(json.dumps(config))
    (model / "evil_config.py").write_text(EVIL_MODULE)
    marker = tmp_path / "marker"
    monkeypatch.setenv("PAGELM_TEST_MARKER", str(marker))
    return model, marker


def test_trust_remote_code_defaults_to_false():
    assert EngineConfig(model="m").trust_remote_code is False
    from pagelm.plugins.engine_args import add_engine_args, engine_kwargs
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([])).get("trust_remote_code", False) is False
    assert engine_kwargs(parser.parse_args(["--trust-remote-code"]))["trust_remote_code"] is True


def test_a_model_s_own_code_does_not_run_by_default(model_with_remote_code):
    model, marker = model_with_remote_code
    with pytest.raises(ValueError, match="trust_remote_code"):
        LLM(str(model), device="cpu")
    assert not marker.exists()


def test_the_remote_code_fixture_does_run_when_trusted(model_with_remote_code, tmp_path):
    """The oracle for the test above: the same directory runs its code once trusted (in a child
    process, with its own module cache)."""
    model, marker = model_with_remote_code
    code = f"from transformers import AutoConfig; AutoConfig.from_pretrained({str(model)!r}, trust_remote_code=True)"
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=120)
    assert marker.read_text() == "remote code ran"
