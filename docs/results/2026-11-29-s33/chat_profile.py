"""Where the GPU's time goes while a batch of chat turns comes back to the CPU tier (issue 20,
session 33): the chat workload of `pagelm bench offload --workload chat` (tier run only, after
the same warm-up as the bench), with torch.profiler (CUDA activity) over the 300 ms after the
first turn-3 request arrives. Prints, per CUDA stream, the union of its kernels' and copies'
busy time, the union over all streams, and the kernels that took the most time.

    python chat_profile.py
"""
import json, os, random, time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from pagelm.plugins.bench.offload import _blocks, _drive_chat, _engine
from pagelm.plugins.bench.presets import resolve_bench_model
import argparse

E = os.environ.get
WINDOW = float(E("WINDOW", 0.3))
conv, nturns, conc, user, reply, maxlen, bs = 32, 6, 8, 512, 128, 4096, 16
ns = argparse.Namespace(model="llama-3.1-8b", conversations=conv, turns=nturns, concurrency=conc, user_len=user,
                        reply_len=reply, workload_seed=0, pool_fraction=0.25, max_model_len=maxlen)
model_dir, kwargs = resolve_bench_model("llama-3.1-8b", {"max_model_len": maxlen, "block_size": bs})
final_len = nturns * (user + reply)
needed = conv * _blocks(final_len, bs)
llm = _engine(model_dir, kwargs, num_kv_blocks=max(int(needed * 0.25), conc * (_blocks(final_len, bs) + 1)), num_cpu_blocks=needed)
rng = random.Random(0)
turns = [[[rng.randrange(200) for _ in range(user)] for _ in range(nturns)] for _ in range(conv)]
warm_rng = random.Random(1)
warm = [[[warm_rng.randrange(200) for _ in range(user)] for _ in range(nturns)] for _ in range(conv)]
print("warm-up:", json.dumps(_drive_chat(llm, warm, ns)))

engine = llm.engine
prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
state = {"start": None, "done": False}
orig_add = engine.add_request
def add_request(req_id, *a, **k):
    if req_id.endswith("-3") and state["start"] is None:
        prof.start()
        state["start"] = time.perf_counter()
    return orig_add(req_id, *a, **k)
engine.add_request = add_request
orig_step = engine.step
def step():
    out = orig_step()
    if state["start"] is not None and not state["done"] and time.perf_counter() - state["start"] > WINDOW:
        torch.cuda.synchronize()
        prof.stop()
        state["done"] = True
    return out
engine.step = step
print("timed:", json.dumps(_drive_chat(llm, turns, ns)))

path = "/tmp/chat_trace.json"
prof.export_chrome_trace(path)
events = json.load(open(path))["traceEvents"]
gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
t0 = min(e["ts"] for e in gpu)
t1 = max(e["ts"] + e["dur"] for e in gpu)


def union(intervals):
    total, end = 0.0, -1e30
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


by_stream = defaultdict(list)
for e in gpu:
    by_stream[e["args"].get("stream")].append((e["ts"], e["ts"] + e["dur"], e))
print(f"window {(t1 - t0) / 1e3:.1f} ms of GPU activity")
print(f"busy, any stream: {union([(a, b) for v in by_stream.values() for a, b, _ in v]) / 1e3:.1f} ms")
for s, v in sorted(by_stream.items(), key=lambda kv: -len(kv[1])):
    kinds = defaultdict(float)
    for a, b, e in v:
        kinds[e["cat"] + (":" + e["name"][:24] if e["cat"] == "gpu_memcpy" else "")] += e["dur"] / 1e3
    print(f"stream {s}: {len(v)} ops, busy {union([(a, b) for a, b, _ in v]) / 1e3:.1f} ms;",
          {k: round(x, 1) for k, x in sorted(kinds.items(), key=lambda kv: -kv[1])[:4]})
compute = max(by_stream, key=lambda s: sum(e["dur"] for _, _, e in by_stream[s] if e["cat"] == "kernel"))
names = defaultdict(lambda: [0, 0.0])
for a, b, e in by_stream[compute]:
    names[e["name"][:90]][0] += 1
    names[e["name"][:90]][1] += e["dur"] / 1e3
print(f"compute stream {compute}: top kernels (calls, ms)")
for n, (c, ms) in sorted(names.items(), key=lambda kv: -kv[1][1])[:14]:
    print(f"  {ms:8.1f} {c:5d}  {n}")
# the compute stream's idle gaps over 1 ms
v = sorted((a, b) for a, b, _ in by_stream[compute])
gaps, end = [], v[0][1]
for a, b in v[1:]:
    if a - end > 1000:
        gaps.append(((end - t0) / 1e3, (a - end) / 1e3))
    end = max(end, b)
print("compute-stream gaps over 1 ms (at ms, length ms):", [(round(x, 1), round(y, 1)) for x, y in gaps][:30])
