"""Offline A/B: 16 requests of 64 random prompt tokens, 128 greedy tokens each (EOS ignored),
LLM.generate on the demo-shaped model with the runner in the engine core ("uni") and in a
process of its own ("mp"), alternated; one torch thread in each (as `pagelm serve` gives
the engine core on 2 cores). Prints wall seconds and output tokens/s per run.

    /work/venv-ha/bin/python docs/results/2026-11-27-s16/offline_ab.py [MODEL] [PAIRS]
"""

import sys
import time

import torch


def main() -> None:
    from pagelm import LLM, SamplingParams

    model = sys.argv[1] if len(sys.argv) > 1 else "/tmp/h9/demo_shaped"
    pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 2000, (64,), generator=gen).tolist()} for _ in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    outputs = {}
    for backend in ["uni", "mp"] * pairs:
        with open("/proc/loadavg") as f:
            load = f.read().split()[0]
        with LLM(model, dtype="float32", attention_backend="torch", max_model_len=1024, max_num_seqs=16,
                 distributed_executor_backend=backend) as llm:
            llm.generate(prompts[:2], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
        ids = [o.outputs[0].token_ids for o in outs]
        assert outputs.setdefault(backend, ids) == ids
        print(f"{backend:4s} load {load}  {wall:6.2f} s  {16 * 128 / wall:7.1f} out tok/s", flush=True)
    print("greedy ids identical between uni and mp:", outputs["uni"] == outputs["mp"])


if __name__ == "__main__":
    main()
