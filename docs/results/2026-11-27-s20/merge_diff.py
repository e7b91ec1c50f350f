"""The in-kernel split merge (PAGELM_SPLIT_REDUCE_FUSION=1, opt-in) against the reduce launch,
for the GPU test cases that fail bit-identity on the H100: is the fused output the same bits
launch after launch (no race), and how far is it from the reduce launch's? Also the reduce
launch against itself. Run from the repo root: python3 docs/results/2026-11-27-s20/merge_diff.py"""
import sys

import torch

sys.path.insert(0, "tests")
from test_triton_backend import decode_batch  # noqa: E402

from pagelm.backends.triton import paged_attention as pa  # noqa: E402

SHAPES = {"qwen3_0_6b": dict(num_heads=16, num_kv_heads=8, head_dim=128),
          "llama_8b": dict(num_heads=32, num_kv_heads=8, head_dim=128)}
SEQS = {"batch1_4k": [4095], "batch1_640": [640], "batch4": [4095, 1000, 16, 1],
        "batch32": [100 + 127 * i for i in range(32)]}


def run(case, scratch, splits, fuse, shape):
    out = torch.empty_like(case["query"])
    pa.split_decode_attention(out, *case.values(), scratch, num_decodes=case["seq_lens"].numel(), num_splits=splits,
                              scale=shape["head_dim"] ** -0.5, sliding_window=None, fuse_reduce=fuse, **shape)
    return out


for sname, shape in SHAPES.items():
    for qname, seqs in SEQS.items():
        splits = max(2, min(32, 132 // len(seqs)))
        case = decode_batch(seqs, **shape, dtype=torch.bfloat16)
        scratch = pa.SplitScratch.allocate(len(seqs) * splits, shape["num_heads"], shape["head_dim"], "cuda")
        ref = run(case, scratch, splits, False, shape)
        ref_same = all(torch.equal(run(case, scratch, splits, False, shape), ref) for _ in range(50))
        fused = [run(case, scratch, splits, True, shape) for _ in range(200)]
        distinct = len({f.float().sum().item() for f in fused}) if not all(torch.equal(f, fused[0]) for f in fused) else 1
        d = (fused[0].float() - ref.float()).abs()
        ulp = (ref.float().abs().clamp_min(1e-30) * 2 ** -7)  # one bf16 ulp, roughly
        print(f"{sname:10s} {qname:10s} splits {splits:2d}: reduce launch repeatable {ref_same}; fused: "
              f"{distinct} distinct outputs over 200 launches; vs reduce: {int((d > 0).sum())} of {d.numel()} "
              f"elements differ, max |d| {d.max().item():.3g}, max in ulps {(d / ulp).max().item():.2f}; "
              f"counters zero {not scratch.counter.any().item()}", flush=True)
