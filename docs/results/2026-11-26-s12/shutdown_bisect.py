"""Issue 18: which part of a TP=2 engine on CUDA makes LLM.shutdown hang? Each variant builds a
small fp32 Llama engine at TP=2 in a fresh process, generates, and shuts down; the parent
reports whether the process exited and how long shutdown took (about 10 s: NCCL's
teardown did not return and pagelm.distributed gave up on it, TEARDOWN_TIMEOUT). Variants turn off one suspect
each: CUDA graphs (enforce_eager), async scheduling, the symmetric-memory all-reduce.
Run: python3 shutdown_bisect.py [variant ...] (default: all)."""
import json
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    "default": {},
    "eager": {"enforce_eager": True},
    "sync": {"async_scheduling": False},
    "nccl_only": {"disable_custom_all_reduce": True},
    "eager_sync_nccl": {"enforce_eager": True, "async_scheduling": False, "disable_custom_all_reduce": True},
}


def child(model_dir, kw):
    import faulthandler

    from pagelm import LLM, SamplingParams

    faulthandler.dump_traceback_later(55, exit=True)  # where it hangs, on stderr
    t = time.time()
    llm = LLM(model_dir, dtype="float32", tensor_parallel_size=2, seed=0, **kw)
    llm.generate([{"prompt_token_ids": list(range(5, 40))}] * 4, SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)
    print(f"generated at {time.time() - t:.1f} s", flush=True)
    s = time.time()
    llm.shutdown()
    print(f"SHUTDOWN_OK {time.time() - s:.2f} s", flush=True)


def main(names):
    from pagelm.models.testing import build_tiny_model

    d = str(build_tiny_model(Path("/tmp/bisect"), "llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024))
    for name in names:
        t = time.time()
        try:
            p = subprocess.run([sys.executable, __file__, "child", d, json.dumps(VARIANTS[name])],
                               capture_output=True, text=True, timeout=70)
            out = p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() + (e.stderr or b"").decode() + "\nTIMEOUT"
        ok = [l for l in out.splitlines() if "SHUTDOWN_OK" in l]
        print(f"{name:16s} {VARIANTS[name]}: {ok[0] if ok else 'HUNG'} (process {time.time() - t:.0f} s)", flush=True)
        if not ok:
            print("\n".join(l for l in out.splitlines() if 'File "/work' in l or "Thread" in l or "destroy" in l)[-1500:], flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        child(sys.argv[2], json.loads(sys.argv[3]))
    else:
        main(sys.argv[1:] or list(VARIANTS))
