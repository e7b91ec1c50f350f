"""The out-of-tree example plugin (docs/examples/pagelm-fairshare) installs with pip, is
discovered through its entry point, listed by `pagelm plugins`, selected by name, and passes
its own tests (which use pagelm's conformance kit).

It is installed with ``pip install --target`` into a temporary folder put on PYTHONPATH of
subprocesses, so the test environment itself is never changed."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "pagelm-fairshare"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fairshare")
    # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
    source = shutil.copytree(EXAMPLE, tmp / "src", ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = tmp / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site), str(source)],
        check=True,
    )
    yield tmp, site
    shutil.rmtree(tmp, ignore_errors=True)


def run_python(site, cwd, *args):
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("PAGELM_PLUGINS", None)
    env.pop("PAGELM_DISABLE_PLUGIN_AUTOLOAD", None)
    result = subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_pagelm_plugins_lists_the_installed_example(installed):
    tmp, site = installed
    rows = json.loads(run_python(site, tmp, "-c", "from pagelm.cli import main; main(['plugins', '--json'])"))
    row = next(r for r in rows if r["name"] == "fairshare")
    assert row["kind"] == "scheduling policy"
    assert row["registers"] == {"scheduling policy": ["fairshare"]}
    assert (row["package"], row["version"], row["plugin_api"], row["status"]) == ("pagelm-fairshare", "0.1.0", "2.0", "loaded")


def test_llm_applies_the_example_policy(installed, llama_dir):
    tmp, site = installed
    script = textwrap.dedent(
        f"""
        import json
        from pagelm import LLM, SamplingParams
        llm = LLM({str(llama_dir)!r}, dtype="float32", max_num_seqs=1, scheduling_policy="fairshare")
        tenants = ["a", "a", "a", "b", "b"]
        prompts = [{{"prompt_token_ids": [5 + i] * 6}} for i in range(5)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False, cache_salt=tenants)
        order = sorted(range(5), key=lambda i: outs[i].metrics.first_token_time)
        print(json.dumps([tenants[i] + str(i) for i in order]))
        """
    )
    order = json.loads(run_python(site, tmp, "-c", script).strip().splitlines()[-1])
    # Submitted a0 a1 a2 b3 b4; one at a time, the tenants take turns.
    assert order == ["a0", "b3", "a1", "b4", "a2"]


def test_the_example_packages_own_tests_pass(installed):
    tmp, site = installed
    out = run_python(site, tmp, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE / "tests"))
    assert "4 passed" in out
