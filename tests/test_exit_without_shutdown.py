"""A script that builds a multi-rank engine and never shuts it down must still exit. Before
the engine core registered its ranks' shutdown with ``atexit``, interpreter exit hung for
good: multiprocessing joins the rank processes at exit, and they wait for rank 0's next
message. A real script in a fresh interpreter, ranks over gloo."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent(
    """
    import json
    import sys
    from pagelm import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(sys.argv[1], dtype="float32", **{sys.argv[2]: 2})
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        print("ids", json.dumps(list(out[0].outputs[0].token_ids)), flush=True)
    """
)


@pytest.mark.parametrize("parallel", ["pipeline_parallel_size", "tensor_parallel_size"])
def test_a_script_that_never_calls_shutdown_exits(make_model, tmp_path, parallel):
    model_dir = make_model("exit_llama", "llama")
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script), str(model_dir), parallel], capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-2000:]
    ids_line = [line for line in done.stdout.splitlines() if line.startswith("ids")]
    assert len(ids_line) == 1 and len(json.loads(ids_line[0][4:])) == 4
    # It generated and left: no 10 s teardown timeout, no rank left waiting.
    assert time.monotonic() - start < 120
