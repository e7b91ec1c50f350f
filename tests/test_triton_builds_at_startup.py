"""Every Triton kernel a run needs is built while the engine starts, none inside a step.

Triton compiles a kernel variant the first time it meets new constexprs or a new
specialisation of an integer argument (a value of 1, a multiple of 16). A variant first met
mid-run costs a step over a second: on an H100 two such builds were 2.4 s of a 10 s nano-vllm
run (docs/benchmarks.md). The engine builds its kernels in the profile run and the CUDA-graph
capture; a batch of mixed steps (prefill chunks beside split-K and plain decodes, every batch
size from 1 up) must then find every variant built. Runs in a fresh interpreter, where the
kernel caches start empty (a build read back from Triton's disk cache still counts).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.gpu

SCRIPT = textwrap.dedent(
    """
    import json, random, sys
    import triton
    from pagelm import LLM, SamplingParams

    llm = LLM(sys.argv[1], attention_backend="triton", device="cuda", dtype="bfloat16", max_model_len=2048,
              max_num_batched_tokens=256, max_num_seqs=48, gpu_memory_utilization=0.3)
    builds = []

    def count(**kw):
        builds.append(kw.get("repr", "?")[:600])
        return False

    triton.knobs.runtime.jit_cache_hook = count  # from here on, every build is one inside a step
    rng = random.Random(0)
    # Long prompts (their decodes split over the KV range) beside short ones, so steps mix
    # prefill chunks with split and plain decodes; lengths end the requests one by one, so every
    # batch size from 48 down to 1 runs.
    lengths = [rng.randint(600, 1500) for _ in range(6)] + [rng.randint(3, 200) for _ in range(42)]
    prompts = [{"prompt_token_ids": [rng.randrange(5, 500) for _ in range(n)]} for n in lengths]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 64), ignore_eos=True) for _ in lengths]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(p.max_tokens for p in params)
    print("BUILDS " + json.dumps(builds))
    """
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_triton_kernel_is_built_inside_a_step(make_model):
    triton = pytest.importorskip("triton")
    if not hasattr(triton, "knobs"):
        pytest.skip("triton.knobs (the compile hooks) arrived in Triton 3.4")
    model_dir = make_model("gpu_qwen3_head128", "qwen3", hidden_size=256, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=128, max_position_embeddings=2048)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir)], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(l for l in result.stdout.splitlines() if l.startswith("BUILDS "))
    builds = json.loads(line[len("BUILDS "):])
    assert builds == [], "\n".join(builds)
