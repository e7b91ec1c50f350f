"""Issue 18: where a PP=2 engine's shutdown waits (NCCL's teardown gives up after 10 s).
A small fp32 Llama at PP=2 generates, then shuts down while a watcher thread, 3 s into the
shutdown, dumps the native and Python stacks of this process (rank 0) and of its child
processes (rank 1) with py-spy. Run: python3 pp_shutdown.py [eager|graphs]"""
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from pagelm import LLM, SamplingParams
from pagelm.models.testing import build_tiny_model


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids = (task / "children").read_text().split()
        out += [int(k) for k in kids]
    return out


def dump(pids, tag):
    for pid in pids:
        r = subprocess.run(["py-spy", "dump", "--native", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
        print(f"===== {tag}: py-spy dump of pid {pid} (rc {r.returncode})\n{r.stdout[-12000:]}\n{r.stderr[-2000:]}", flush=True)


def main(variant: str):
    d = build_tiny_model(Path("/tmp/ppsd/llama"), "llama")
    me = os.getpid()
    llm = LLM(str(d), device="cuda", dtype="float32", gpu_memory_utilization=0.3, pipeline_parallel_size=2,
              enforce_eager=(variant == "eager"))
    kids = [p for p in children(me)]
    print(f"{variant}: rank 0 pid {me}, children {kids}", flush=True)
    outs = llm.generate([{"prompt_token_ids": [5 + i, 7, 9] * (i + 1)} for i in range(4)],
                        SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), use_tqdm=False)
    print(f"{variant}: generated {[len(o.outputs[0].token_ids) for o in outs]}", flush=True)
    done = threading.Event()

    def watch():
        if not done.wait(3.0):
            dump([me] + [k for k in kids if Path(f"/proc/{k}").exists()], f"{variant} 3 s into shutdown")

    threading.Thread(target=watch, daemon=True).start()
    t = time.time()
    llm.shutdown()
    done.set()
    print(f"{variant}: shutdown took {time.time() - t:.2f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "graphs")
