"""Where a chat turn's TTFT goes with the CPU tier (issue 20, plugin API 2.18 loads): the chat
workload of `pagelm bench offload --workload chat` (tier run only), with each request's
timeline: added, load queued, load's copies on the GPU (events), load reported, first
scheduled, first token. (Session 33: ``NOWAIT=1`` drops the copier's waits for the step in
flight, unsafe in general, to measure what a load that starts at once would buy;
the host time of each launch, finish, copier call and schedule is logged.) (`PRIORITY=1`: for the session-18 copier with one side stream, at
the highest priority; the copier now has two streams at the highest priority.)

    python chat_timeline.py OUT.json
"""
import argparse, json, os, statistics, sys, time
from collections import defaultdict

import torch

from pagelm.plugins.bench import offload as B
from pagelm.plugins.bench.presets import resolve_bench_model
from pagelm.plugins.kv_offload import copier as C
from pagelm.sched import scheduler as S

T = defaultdict(dict)
GPU = []  # (req_id, start event, end event, blocks)


def now():
    return time.perf_counter()


STEPS = []  # (time, tokens scheduled, new requests, loads queued, waits)
orig_schedule = S.Scheduler.schedule
def schedule(self):
    out = orig_schedule(self)
    t = out.kv_transfers
    STEPS.append((now(), out.total_num_scheduled_tokens, len(out.scheduled_new_reqs),
                  len(t.loads) if t else 0, len(t.waits) if t else 0, len(self.running)))
    return out
S.Scheduler.schedule = schedule

orig_start = S.Scheduler._start_load
def _start_load(self, req, hits, n):
    ok = orig_start(self, req, hits, n)
    if ok:
        T[req.request_id]["load_queued"] = now()
        T[req.request_id]["load_tokens"] = n - len(hits) * self.kv.block_size
    return ok
S.Scheduler._start_load = _start_load

orig_landed = S.Scheduler.loads_landed
def _loads_landed(self, ids):
    t = now()
    for r in ids:
        T[r].setdefault("landed", t)
    return orig_landed(self, ids)
S.Scheduler.loads_landed = _loads_landed

orig_new = S.Scheduler._new_request_data
def _new_request_data(self, req):
    T[req.request_id].setdefault("first_sched", now())
    return orig_new(self, req)
S.Scheduler._new_request_data = _new_request_data


def _copy_in(self, transfers):
    if self.load_stream is None:
        return orig_copy_in(self, transfers)
    start = 0
    for req_id, n in transfers.loads:
        a = torch.cuda.Event(enable_timing=True); a.record(self.load_stream)
        self._copy_in_blocks(transfers.swap_in[start:start + n])
        start += n
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.load_stream)
        self._load_events[req_id] = event
        self._pending.append((req_id, event))
        GPU.append((req_id, a, event, n))
    self._copy_in_blocks(transfers.swap_in[start:])
    return start < len(transfers.swap_in)
orig_copy_in = C.CPUCopier._copy_in
C.CPUCopier._copy_in = _copy_in

# Host time inside the engine step's parts (session 33): a host sync in any of them stalls
# the async pipeline.
HOST = []  # (time, what, ms)
def timed(cls, name, what):
    orig = getattr(cls, name)
    def wrapper(*a, **k):
        t = now()
        try:
            return orig(*a, **k)
        finally:
            HOST.append((t, what, (now() - t) * 1e3))
    setattr(cls, name, wrapper)
from pagelm.worker import model_runner as MR
timed(MR.ModelRunner, "launch", "launch")
timed(MR.ModelRunner, "finish", "finish")
timed(C.CPUCopier, "before_step", "copier")
timed(S.Scheduler, "schedule", "schedule")

if os.environ.get("NOWAIT"):
    _orig_wait_stream = torch.cuda.Stream.wait_stream
    _current = torch.cuda.current_stream
    def wait_stream(self, other):
        # the copier's side streams skip waiting for the compute stream (the step in flight)
        if other == _current(other.device) and getattr(self, "_copier_side", False):
            return
        return _orig_wait_stream(self, other)
    torch.cuda.Stream.wait_stream = wait_stream


def main():
    out = sys.argv[1]
    E = os.environ.get
    model, conv, nturns, conc = E("MODEL", "llama-3.1-8b"), int(E("CONV", 32)), int(E("TURNS", 6)), int(E("CONC", 8))
    user, reply, maxlen, bs = int(E("USER", 512)), int(E("REPLY", 128)), int(E("MAXLEN", 4096)), int(E("BS", 16))
    ns = argparse.Namespace(model=model, conversations=conv, turns=nturns, concurrency=conc, user_len=user,
                            reply_len=reply, workload_seed=0, pool_fraction=0.25, max_model_len=maxlen)
    from pagelm.plugins.bench.offload import _blocks, _drive_chat, _engine
    import random
    model_dir, kwargs = resolve_bench_model(model, {"max_model_len": maxlen, "block_size": bs})
    rng = random.Random(0)
    vocab = 200
    turns = [[[rng.randrange(vocab) for _ in range(user)] for _ in range(nturns)] for _ in range(conv)]
    final_len = nturns * (user + reply)
    needed = conv * _blocks(final_len, bs)
    num_kv_blocks = max(int(needed * 0.25), conc * (_blocks(final_len, bs) + 1))
    llm = _engine(model_dir, kwargs, num_kv_blocks=num_kv_blocks, num_cpu_blocks=needed)
    copier = llm.engine.core.runner.kv_copier
    copier.stream._copier_side = True
    copier.load_stream._copier_side = True
    if os.environ.get("PRIORITY"):
        lo, hi = torch.cuda.Stream.priority_range()
        copier.stream = torch.cuda.Stream(copier.device, priority=min(lo, hi))
        print("side stream priority", copier.stream.priority)
    engine = llm.engine
    orig_add = engine.add_request
    def add_request(req_id, *a, **k):
        T[req_id]["added"] = now()
        return orig_add(req_id, *a, **k)
    engine.add_request = add_request
    orig_step = engine.step
    def step():
        outs = orig_step()
        t = now()
        for o in outs:
            if o.outputs[0].token_ids:
                T[o.request_id].setdefault("first_token", t)
        return outs
    engine.step = step
    # Warm up first (kernels compile for new shapes on first use: over a second each on a cold
    # Triton cache), on other conversations, then time.
    warm_rng = random.Random(1)
    warm = [[[warm_rng.randrange(vocab) for _ in range(user)] for _ in range(nturns)] for _ in range(conv)]
    print("warm-up:", json.dumps(_drive_chat(llm, warm, ns)))
    T.clear(); GPU.clear(); STEPS.clear(); HOST.clear()
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
    mem0 = {k: torch.cuda.memory_stats().get(k) for k in keys}
    res = _drive_chat(llm, turns, ns)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    gpu = {}
    for req_id, a, b, n in GPU:
        gpu[req_id] = (a.elapsed_time(b), n)
    rows = []
    for r, d in T.items():
        if "first_token" not in d or "added" not in d:
            continue
        row = {"req": r, **{k: (v - d["added"]) * 1e3 for k, v in d.items() if k not in ("added", "load_tokens")}}
        row["load_tokens"] = d.get("load_tokens", 0)
        if r in gpu:
            row["gpu_copy_ms"], row["blocks"] = gpu[r]
        rows.append(row)
    print(json.dumps(res))
    def med(k):
        v = [x[k] for x in rows if k in x]
        return (round(statistics.median(v), 1), round(statistics.quantiles(v, n=10)[-1], 1)) if len(v) > 2 else None
    for k in ("load_queued", "landed", "first_sched", "first_token", "gpu_copy_ms"):
        print(k, "p50/p90 ms:", med(k))
    bw = [x["blocks"] * copier.cpu_cache[0].numel() * copier.cpu_cache.element_size() / (x["gpu_copy_ms"] / 1e3) / 1e9 for x in rows if "gpu_copy_ms" in x]
    print("copy GB/s p50:", round(statistics.median(bw), 1) if bw else None)
    # one lockstep batch in full
    for x in sorted(rows, key=lambda x: x["req"])[:0]:
        pass
    late = sorted([x for x in rows if x["req"].endswith("-3")], key=lambda x: int(x["req"].split("-")[0]))[:8]
    for x in late:
        print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in x.items()})
    # the steps around turn 3's batch
    t0 = min(T[x["req"]]["added"] for x in late)
    for st in STEPS:
        if -5e-3 < st[0] - t0 < 0.3:
            print("step", round((st[0] - t0) * 1e3, 1), "ms: tokens", st[1], "new", st[2], "loads", st[3], "waits", st[4], "running", st[5])
    print("allocator in the timed run:", {k: (torch.cuda.memory_stats().get(k) or 0) - (mem0[k] or 0) for k in keys})
    for what in ("launch", "finish", "copier", "schedule"):
        v = [ms for _, w, ms in HOST if w == what]
        print(what, "calls", len(v), "total ms", round(sum(v), 1), "p50", round(statistics.median(v), 2),
              "max", round(max(v), 1), "over 5 ms:", sum(x > 5 for x in v))
    json.dump({"rows": rows, "steps": [(a - t0,) + tuple(b) for a, *b in STEPS],
               "host": [(a - t0, w, ms) for a, w, ms in HOST]}, open(out, "w"))


main()
