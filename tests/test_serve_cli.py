"""`pagelm serve` / `pagelm bench` around the server: flags, model resolution (demo model, hub
ids that fail fast offline), and server behaviour checked in-process through ASGI (errors in
the middle of a stream, /health once the engine is dead)."""

import asyncio
import os
import subprocess
import sys
import time

import httpx
import pytest

from pagelm.cli import build_parser
from pagelm.models.hub import ModelResolutionError, resolve_model
from pagelm.outputs import CompletionOutput, RequestOutput


def _subparser(*path):
    parser = build_parser()
    for name in path:
        action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = action.choices[name]
    return parser


@pytest.mark.parametrize("path", [("serve",), ("bench", "serve")])
def test_help_documents_every_flag(path):
    parser = _subparser(*path)
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert {"--max-num-seqs", "--config", "--block-size"} <= {s for a in flags for s in a.option_strings}
    undocumented = [a.option_strings for a in flags if not (a.help and a.help.strip())]
    assert undocumented == []


def test_serve_flags_and_yaml_config_are_engine_arguments(tmp_path):
    from pagelm.plugins.engine_args import engine_kwargs

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("max_num_seqs: 8\nblock_size: 32\n")
    args = build_parser().parse_args(["serve", "m", "--config", str(cfg), "--block-size", "8", "--port", "9"])
    assert engine_kwargs(args) == {"max_num_seqs": 8, "block_size": 8}
    assert args.port == 9 and args.model == "m"


def test_serve_without_a_model_uses_the_demo_model(monkeypatch, llama_dir):
    import pagelm.plugins.demo.model
    from pagelm.plugins.server.cli import resolve_serve_model

    monkeypatch.setattr(pagelm.plugins.demo.model, "ensure_demo_model", lambda *a, **k: llama_dir)
    assert resolve_serve_model(None) == (str(llama_dir), "pagelm-demo")


def test_local_directory_resolves_to_itself(llama_dir):
    assert resolve_model(str(llama_dir)) == str(llama_dir)


def test_path_that_is_not_a_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelResolutionError, match="not a local model directory"):
        resolve_model(str(tmp_path / "missing" / "deep" / "dir"))


def test_hub_id_fails_fast_when_the_hub_cannot_be_reached(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # nothing cached
    start = time.time()
    with pytest.raises(ModelResolutionError, match="some-org/some-model"):
        resolve_model("some-org/some-model", timeout=2.0)
    assert time.time() - start < 15


def test_serve_hub_id_offline_exits_with_a_clear_message(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    start = time.time()
    r = subprocess.run(
        [sys.executable, "-c", "import sys; from pagelm.cli import main; sys.exit(main())",
         "serve", "some-org/some-model", "--port", "1"],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert r.returncode != 0
    assert "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache" in r.stderr
    assert time.time() - start < 30


# ---- the app, in-process ----------------------------------------------------------------------


@pytest.fixture
def app_engine(llama_dir):
    from pagelm.engine.async_llm import AsyncLLM
    from pagelm.plugins.server.app import build_app

    engine = AsyncLLM.from_model(str(llama_dir), engine_process=False, num_kv_blocks=64, max_model_len=256)
    yield build_app(engine, model_name="m"), engine
    engine.shutdown()


async def _asgi(app, engine, method, path, **kw):
    await engine.start()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        return await http.request(method, path, **kw)


def test_error_in_the_middle_of_a_stream_ends_with_an_error_chunk_and_done(app_engine):
    app, engine = app_engine

    async def broken(prompt, params, request_id, **kw):
        yield RequestOutput(request_id, None, [1], None, [CompletionOutput(0, "partial", [7], None, None)], False)
        raise RuntimeError("boom")

    engine.generate = broken
    r = asyncio.run(_asgi(app, engine, "POST", "/v1/completions", json={"prompt": "x", "stream": True}))
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200
    assert '"partial"' in events[0]
    assert '"error"' in events[-2] and "boom" in events[-2] and '"internal_error"' in events[-2]
    assert events[-1] == "[DONE]"


def test_health_is_503_once_the_engine_core_died(app_engine):
    """A step that raises fails the requests in the engine (a 500: the server's fault, not
    the input's) and the engine serves on; steps that keep raising (a lost device) stop the
    engine core: then /health is 503 (here with no restart allowed)."""
    from pagelm.engine.core_loop import MAX_CONSECUTIVE_STEP_FAILURES

    app, engine = app_engine
    engine.max_engine_restarts = 0

    def crash():
        raise RuntimeError("device lost")

    async def go():
        assert (await _asgi(app, engine, "GET", "/health")).status_code == 200
        engine.core.core.step = crash
        failures = []
        for _ in range(MAX_CONSECUTIVE_STEP_FAILURES):
            failures.append(await _asgi(app, engine, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2}))
            if len(failures) < MAX_CONSECUTIVE_STEP_FAILURES:  # still serving between them
                assert (await _asgi(app, engine, "GET", "/health")).status_code == 200
        await asyncio.sleep(0.2)
        return failures, await _asgi(app, engine, "GET", "/health")

    failures, health = asyncio.run(go())
    for r in failures:
        assert r.status_code == 500 and "device lost" in r.json()["error"]["message"], r.json()
    assert health.status_code == 503 and health.json()["error"]["type"] == "service_unavailable"
