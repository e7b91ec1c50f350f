"""The batch-1 GEMVs of a decoder stack alone, as a CUDA graph (issue 21, session 23):
qwen3-0.6b's (or another shape's) four projections per layer, chained with their prologues
(norm into qkv and gate_up, silu-mul into down), replayed and timed with CUDA events.
Variants: the L2 prefetch of the next weight at several caps, and every layer reading the
same weights (L2-resident: what the chain costs when no weight comes from HBM).
Usage: python3 gemv_chain.py [hidden inter q_out layers]"""
import importlib
import sys

import torch

gm = importlib.import_module("pagelm.backends.kernels.gemv")
hidden, inter, qkv_out, layers = (int(a) for a in sys.argv[1:5]) if len(sys.argv) > 4 else (1024, 3072, 4096, 28)
dt, dev = torch.bfloat16, "cuda"
q_in = qkv_out // 2 if hidden == 1024 else hidden  # o_proj input: heads * head_dim


def weights(n):
    return [dict(qkv=torch.randn(qkv_out, hidden, device=dev, dtype=dt) * 0.02,
                 o=torch.randn(hidden, q_in, device=dev, dtype=dt) * 0.02,
                 gate_up=torch.randn(2 * inter, hidden, device=dev, dtype=dt) * 0.02,
                 down=torch.randn(hidden, inter, device=dev, dtype=dt) * 0.02) for _ in range(n)]


norm_w = torch.ones(hidden, device=dev, dtype=dt)
x0 = torch.randn(1, hidden, device=dev, dtype=dt)


def chain(ws, prefetch):
    h, res = x0, None
    order = [w[name] for w in ws for name in ("qkv", "o", "gate_up", "down")]
    nxt = {id(a): b for a, b in zip(order, order[1:])}
    pf = lambda w: {"prefetch": nxt[id(w)]} if prefetch and id(w) in nxt else {}
    for w in ws:
        qkv, res = gm.gemv(h, w["qkv"], norm=(norm_w, 1e-6, res), **pf(w["qkv"]))
        a = gm.gemv(qkv[:, :q_in].contiguous() if False else qkv[:, :q_in], w["o"], **pf(w["o"]))
        gu, res = gm.gemv(a, w["gate_up"], norm=(norm_w, 1e-6, res), **pf(w["gate_up"]))
        h = gm.gemv(gu, w["down"], silu_input=True, **pf(w["down"]))
    return h


def time_graph(ws, prefetch, reps=50):
    chain(ws, prefetch)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain(ws, prefetch)
    for _ in range(5):
        g.replay()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps * 1000  # us per chain


distinct, same = weights(layers), weights(1) * layers
mb_layer = sum(t.numel() * 2 for t in distinct[0].values()) / 2**20
print(f"shape hidden={hidden} inter={inter} qkv={qkv_out} layers={layers}: {mb_layer:.1f} MB a layer", flush=True)
for rnd in range(2):
    for label, ws, cap in [("distinct, no prefetch", distinct, 0), ("distinct, prefetch 16 MB", distinct, 16),
                           ("distinct, prefetch 64 KB", distinct, 1 / 16), ("distinct, prefetch 2 MB", distinct, 2),
                           ("same weights every layer (L2)", same, 0)]:
        gm.L2_PREFETCH_BYTES = int(cap * 2**20) // 16 * 16
        t = time_graph(ws, cap > 0)
        print(f"[r{rnd}] {label:32s} {t:8.1f} us a chain, {t / layers:6.2f} us a layer, "
              f"{mb_layer * layers * 2**20 / (t * 1e-6) / 1e12:5.2f} TB/s", flush=True)
