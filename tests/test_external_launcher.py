"""``distributed_executor_backend="external_launcher"``: ``torchrun`` starts every rank, each
runs the same script and builds an engine of its own over torchrun's world (gloo on the CPU
here). Every rank's ``generate`` returns the tokens of the one-rank run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from pagelm import LLM, SamplingParams

PROMPTS = [[(7 * i + j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(4)]
SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from pagelm import LLM, SamplingParams

    model, out, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llm = LLM(model, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="external_launcher",
              **extra)
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.9, seed=7, logprobs=2)] * 2
    outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[4])], params, use_tqdm=False)
    rank = os.environ["RANK"]
    result = {
        "ids": [o.outputs[0].token_ids for o in outs],
        "logprobs": [[sorted(lp) for lp in o.outputs[0].logprobs or []] for o in outs],
        "rank0_of_engine": llm.engine.core.executor.this_rank(),
    }
    llm.shutdown()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    """
)


def _torchrun(tmp_path, model_dir, extra: dict) -> list[dict]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
        str(model_dir), str(tmp_path), json.dumps(extra), json.dumps(PROMPTS),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def _one_rank(model_dir, **extra):
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.9, seed=7, logprobs=2)] * 2
    with LLM(str(model_dir), dtype="float32", **extra) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [[sorted(lp) for lp in o.outputs[0].logprobs or []] for o in outs]


def test_torchrun_tp2_every_rank_returns_the_one_rank_outputs(llama_dir, tmp_path):
    ranks = _torchrun(tmp_path, llama_dir, {})
    ids, logprobs = _one_rank(llama_dir)
    assert [r["rank0_of_engine"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["ids"] == ids and r["logprobs"] == logprobs


def test_torchrun_with_preemption_and_chunked_prefill_stays_in_step(llama_dir, tmp_path):
    # A pool too small for every request and 8-token chunks: each rank's scheduler preempts
    # and chunks alike, or the collectives would not meet.
    extra = dict(num_kv_blocks=6, block_size=4, max_num_batched_tokens=8, max_model_len=24)
    ranks = _torchrun(tmp_path, llama_dir, extra)
    ids, _ = _one_rank(llama_dir, **extra)
    assert ranks[0]["ids"] == ranks[1]["ids"] == ids


def test_external_launcher_outside_torchrun_is_a_clear_error(llama_dir, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="'external_launcher' runs under torchrun"):
        LLM(str(llama_dir), dtype="float32", tensor_parallel_size=2, distributed_executor_backend="external_launcher")
