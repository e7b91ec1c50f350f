import os, sys, torch
sys.path.insert(0, "/tmp/s26/site"); import sitecustomize  # noqa
from pagelm import LLM, SamplingParams
M = "/work/main/demo-cache/demo-llama-v1"
spec = {"method": "eagle", "num_speculative_tokens": 3, "model": "/work/main/eagle-demo", "max_backoff_steps": int(os.environ.get("MAXB", "32")), "adaptive": os.environ.get("ADAPT", "1") == "1", "backoff_after": int(os.environ.get("BA", "2"))}
llm = LLM(M, max_model_len=1024, speculative_config=spec)
bs = int(os.environ.get("BS", "1"))
import pagelm.plugins.bench.latency as lat
# the bench's code workload prompts
src = open(lat.__file__).read()
tok = llm.get_tokenizer() if hasattr(llm, "get_tokenizer") else None
g = torch.Generator().manual_seed(0)
text = open("/work/main/plugins/spec_decode/eagle.py").read()
ids = llm.engine.tokenizer.encode(text) if hasattr(llm.engine, "tokenizer") else None
from pagelm.plugins.bench.latency import TokenWorkload
ws = [TokenWorkload.code(llm.get_tokenizer(), bs, 128, 256, f"0/{bs}/{run}").prompt_token_ids for run in range(6)]
ps = [{"prompt_token_ids": p} for w in ws for p in w]; bs = len(ps)
sp = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
core = llm.engine.core; n = [0]; orig = core.step
if os.environ.get("REJECT") == "1":
    from pagelm.plugins.bench.latency import reject_all_drafts
    reject_all_drafts(llm, core.runner.vocab_size)
prop = core.runner.spec.proposer; dsteps = [0]; o2 = prop.propose_step
def ps_(st):
    dsteps[0] += bool(st.num_drafts.any()); return o2(st)
prop.propose_step = ps_
def step(*a, **k):
    n[0] += 1; return orig(*a, **k)
core.step = step
for p in ps:
    llm.generate([p], sp, use_tqdm=False)
bs = 1
bs_total = len(ps)
print(os.environ.get("NAME"), "bs", bs, "steps", n[0], "tokens/step %.3f" % (256 * bs_total / n[0]), "drafting steps", dsteps[0], "skipped", getattr(core.runner.spec.proposer.backoff, "num_skipped", None))
