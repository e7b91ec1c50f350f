"""Usage: EAGLE_HEAD=eagle-demo python host_gap.py 1,32
CPU, demo model + trained EAGLE head, eager: per verification step, the host time between the
verified tokens reaching the host (sync 1) and the drafting being launched (EAGLE.propose entry):
on CUDA the GPU waits for all of it before the drafting graph, then syncs again (sync 2)."""
import sys, time, statistics
import numpy as np
from pagelm import LLM, SamplingParams
from pagelm.plugins.demo.model import ensure_demo_model
from pagelm.sample.rejection_sampler import RejectionSampler
from pagelm.plugins.spec_decode.eagle import EagleProposer
from transformers import AutoTokenizer
import inspect, os
path = ensure_demo_model(progress=False)
tok = AutoTokenizer.from_pretrained(path)
ids = tok(inspect.getsource(os))["input_ids"]
marks = {}
gaps = []
orig_v = RejectionSampler._verify_deterministic
def v(self, *a, **k):
    r = orig_v(self, *a, **k)
    marks["synced"] = time.perf_counter()
    return r
orig_p = EagleProposer.propose
def p(self, batch):
    if "synced" in marks:
        gaps.append(time.perf_counter() - marks.pop("synced"))
    return orig_p(self, batch)
RejectionSampler._verify_deterministic = v
EagleProposer.propose = p
spec = {"method": "eagle", "num_speculative_tokens": 3, "model": os.environ.get("EAGLE_HEAD", "eagle-demo")}
llm = LLM(str(path), speculative_config=spec, max_model_len=1024, max_num_seqs=32)
params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
for b in [int(x) for x in sys.argv[1].split(",")]:
    prompts = [{"prompt_token_ids": ids[i * 50 : i * 50 + 128]} for i in range(b)]
    llm.generate(prompts, params, use_tqdm=False)
    gaps.clear()
    llm.generate(prompts, params, use_tqdm=False)
    print(f"batch {b}: {len(gaps)} verification steps; host time from the verified tokens on the host to the "
          f"drafting launch: median {statistics.median(gaps)*1e3:.3f} ms, mean {statistics.mean(gaps)*1e3:.3f} ms")
