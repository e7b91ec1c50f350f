"""Feasibility (issue 21, session 23): the MLP's two batch-1 GEMVs (gate_up, then down with
silu-mul) as ONE persistent kernel with a grid barrier between them, each program loading
its share of the down weight before the barrier, against today's two GEMV launches.
qwen3-0.6b shapes by default, 28 distinct layers in one CUDA graph.
Usage: python3 mlp_persistent.py [hidden inter layers programs_per_sm]"""
import importlib
import sys

import torch
import triton
import triton.language as tl

gm = importlib.import_module("pagelm.backends.kernels.gemv")
hidden, inter, layers, per_sm = (int(a) for a in sys.argv[1:5]) if len(sys.argv) > 4 else (1024, 3072, 28, 2)
dt, dev = torch.bfloat16, "cuda"
sms = torch.cuda.get_device_properties(0).multi_processor_count


@triton.jit
def _grid_barrier(counter_ptr, target):
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    while tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu") < target:
        pass
    tl.debug_barrier()


@triton.jit
def _mlp_kernel(x_ptr, wgu_ptr, wd_ptr, gu_ptr, y_ptr, counter_ptr, K, I, P,
                BN1: tl.constexpr, BK1: tl.constexpr, BN2: tl.constexpr, BK2: tl.constexpr, BARRIER: tl.constexpr):
    pid = tl.program_id(0)
    # phase 1: gate_up rows [t*BN1, (t+1)*BN1) for t = pid, pid+P, ...  (K == BK1: one chunk)
    rk = tl.arange(0, BK1)
    x = tl.load(x_ptr + rk).to(tl.float32)
    n1 = 2 * I
    for t in range(pid, tl.cdiv(n1, BN1), P):
        rn = t * BN1 + tl.arange(0, BN1)
        w = tl.load(wgu_ptr + rn[:, None].to(tl.int64) * K + rk[None, :])
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        tl.store(gu_ptr + rn, acc.to(gu_ptr.dtype.element_ty))
    # phase 2's weights for this program (one tile of BN2 rows: n2 / BN2 <= P), loaded before the barrier
    rn2 = pid * BN2 + tl.arange(0, BN2)
    m2 = rn2 < K
    rk2 = tl.arange(0, BK2)
    wd0 = tl.load(wd_ptr + rn2[:, None].to(tl.int64) * I + rk2[None, :], mask=m2[:, None], other=0.0)
    if BARRIER:
        _grid_barrier(counter_ptr, P)
    acc2 = tl.zeros((BN2,), dtype=tl.float32)
    wd = wd0
    for k0 in range(0, I, BK2):
        kk = k0 + rk2
        g = tl.load(gu_ptr + kk, cache_modifier=".cg").to(tl.float32)
        u = tl.load(gu_ptr + I + kk, cache_modifier=".cg").to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(tl.bfloat16).to(tl.float32) * u
        acc2 += tl.sum(wd.to(tl.float32) * a.to(tl.bfloat16).to(tl.float32)[None, :], axis=1)
        nk = kk + BK2
        wd = tl.load(wd_ptr + rn2[:, None].to(tl.int64) * I + nk[None, :], mask=m2[:, None] & (nk < I)[None, :], other=0.0)
    tl.store(y_ptr + rn2, acc2.to(y_ptr.dtype.element_ty), mask=m2)


def mlp_persistent(x, wgu, wd, gu, y, counter, programs, barrier=True):
    K, I = hidden, inter
    bn2 = triton.next_power_of_2(triton.cdiv(K, programs))
    return _mlp_kernel[(programs,)](x, wgu, wd, gu, y, counter, K, I, programs, BN1=8, BK1=K, BN2=bn2, BK2=1024,
                                    BARRIER=barrier, num_warps=4)


def resident_per_sm(programs):
    """How many programs of this variant fit on one SM at once (a grid barrier needs them all)."""
    k = mlp_persistent(x, ws[0][0], ws[0][1], gu, ys[0], counters[0], programs, barrier=False)
    torch.cuda.synchronize()
    regs = max(k.n_regs, 1)
    by_regs = 65536 // (regs * 128)
    by_smem = (227 * 1024) // max(k.metadata.shared, 1)
    return min(by_regs, by_smem, 16), regs, k.metadata.shared


ws = [(torch.randn(2 * inter, hidden, device=dev, dtype=dt) * 0.02, torch.randn(hidden, inter, device=dev, dtype=dt) * 0.02)
      for _ in range(layers)]
x = torch.randn(1, hidden, device=dev, dtype=dt)
gu = torch.empty(2 * inter, device=dev, dtype=dt)
ys = [torch.empty(hidden, device=dev, dtype=dt) for _ in range(layers)]
counters = torch.zeros(layers, device=dev, dtype=torch.int32)


def today():
    out = []
    for wgu, wd in ws:
        out.append(gm.gemv(gm.gemv(x, wgu), wd, silu_input=True))
    return out


def fused(programs):
    counters.zero_()
    for i, (wgu, wd) in enumerate(ws):
        mlp_persistent(x, wgu, wd, gu, ys[i], counters[i], programs)
    return ys


def timed(fn, reps=50):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps * 1000


ref = [o.view(-1) for o in today()]
mb = sum(a.numel() * 2 + b.numel() * 2 for a, b in ws) / 2**20
print(f"hidden {hidden} inter {inter} layers {layers}: {mb:.0f} MB of MLP weights; {sms} SMs", flush=True)
usable = []
for ps in (1, 2, 4):
    fit, regs, smem = resident_per_sm(sms * ps)
    print(f"  x{ps}/SM: {regs} registers, {smem} B shared: {fit} programs fit an SM", flush=True)
    if fit >= ps:
        usable.append(ps)
for ps in usable:
    P = sms * ps
    out = fused(P)
    torch.cuda.synchronize()
    err = max((a.float() - b.float()).abs().max().item() for a, b in zip(out, ref))
    print(f"  persistent, {P} programs: max |diff| vs today {err:.3g}", flush=True)
for rnd in range(2):
    t0 = timed(today)
    line = f"[r{rnd}] today (2 GEMV launches a layer): {t0:7.1f} us = {t0 / layers:5.2f} us a layer"
    for ps in usable:
        t = timed(lambda: fused(sms * ps))
        line += f" | persistent x{ps}/SM: {t / layers:5.2f}"
    print(line, flush=True)
