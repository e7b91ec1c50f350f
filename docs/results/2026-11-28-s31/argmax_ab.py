"""Plain decoding, the all-greedy metadata shortcut (ArgmaxMetadata) on and off on one engine,
generates alternated (off: every request marked not argmax_only, so the runner builds the full
SamplingMetadata each step; the tokens are the same). BS, ROUNDS, MODEL (default: the demo
model) from the environment; prints the median of the per-round TPOT ratios off / on."""
import os, statistics
import torch
from pagelm import LLM, SamplingParams

M = os.environ.get("MODEL") or os.path.join(os.environ["PAGELM_CACHE_DIR"], "demo-llama-v1")
bs = int(os.environ.get("BS", "32")); rounds = int(os.environ.get("ROUNDS", "24")); outlen = 256
llm = LLM(M, max_model_len=1024, skip_tokenizer_init=True)
runner = llm.engine.core.runner
real_add = runner._add_state


def add_off(state):
    state = real_add(state)
    state.argmax_only = False
    return state


g = torch.Generator().manual_seed(0)
prompts = [[{"prompt_token_ids": torch.randint(3, 500, (128,), generator=g).tolist()} for _ in range(bs)] for _ in range(rounds + 1)]
sp = SamplingParams(max_tokens=outlen, temperature=0, ignore_eos=True)
ref = [o.outputs[0].token_ids for o in llm.generate(prompts[0], sp, use_tqdm=False)]
runner._add_state = add_off
assert [o.outputs[0].token_ids for o in llm.generate(prompts[0], sp, use_tqdm=False)] == ref, "tokens differ"
tpot = {"on": [], "off": []}
for r in range(1, rounds + 1):
    for mode in (("on", "off") if r % 2 else ("off", "on")):
        runner._add_state = add_off if mode == "off" else real_add
        outs = llm.generate(prompts[r], sp, use_tqdm=False)
        tpot[mode].append(statistics.median((o.metrics.finished_time - o.metrics.first_token_time) / (outlen - 1) for o in outs))
dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
print(f"batch {bs}, {rounds} rounds, {dev}: TPOT median on {1e3 * statistics.median(tpot['on']):.4f} ms, "
      f"off {1e3 * statistics.median(tpot['off']):.4f} ms; median of per-round off/on "
      f"{statistics.median(b / a for a, b in zip(tpot['on'], tpot['off'])):.3f}")
