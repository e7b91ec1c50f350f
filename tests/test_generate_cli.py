"""``pagelm generate``, a command the ``generate`` plugin adds to the dispatcher: it prints each
prompt's completion, the same text ``LLM.generate`` makes."""

from __future__ import annotations

import subprocess
import sys

from pagelm import LLM, SamplingParams


def test_generate_command_prints_the_offline_completion(llama_dir):
    prompts = ["hello there", "the quick brown"]
    llm = LLM(str(llama_dir), num_kv_blocks=64, max_model_len=64)
    expected = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))]
    llm.shutdown()
    cmd = [sys.executable, "-c", "import sys; from pagelm.cli import main; sys.exit(main())", "generate", str(llama_dir)]
    for p in prompts:
        cmd += ["--prompt", p]
    cmd += ["--max-tokens", "6", "--num-kv-blocks", "64", "--max-model-len", "64"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    blocks = out.stdout.split("--- ")[1:]
    assert [b.split("\n", 1)[0] for b in blocks] == [repr(p) for p in prompts]
    assert [b.split("\n", 1)[1].rstrip("\n") for b in blocks] == expected
