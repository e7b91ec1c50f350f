"""The triton backend gives the torch reference backend's results: its kernels on paged,
shuffled blocks (decode, prefill, chunked prefill over a cached prefix, GQA, split-K decode,
block boundaries, dtypes) and the whole engine's greedy tokens.

Without CUDA the kernels run on the CPU under Triton's interpreter. TRITON_INTERPRET is read
when a kernel is decorated, so it is set (for this module only) before the kernel modules are
first imported; shapes stay small because the interpreter is slow.
"""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from pagelm import LLM, SamplingParams  # noqa: E402
from pagelm.attention import AttentionSpec  # noqa: E402
from pagelm.testing.conformance import paged_metadata  # noqa: E402
from triton_interpreter import interpreted_kernels  # noqa: E402
from pagelm.backends.torch import TorchAttentionBackend  # noqa: E402
from pagelm.backends.triton import TritonAttentionBackend  # noqa: E402
from pagelm.backends.triton.backend import TritonMetadataBuilder  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter():
    """On CPU: TRITON_INTERPRET=1 while this module runs, with the kernels decorated under it."""
    with interpreted_kernels(
        "pagelm.backends.kernels.rotary", "pagelm.backends.triton.paged_attention", "pagelm.backends.triton.kv_store"
    ):
        yield


def run_both(seqs, num_heads, num_kv_heads, head_dim, block_size, *, dtype=torch.float32, window=None,
             min_tokens_per_split=None, seed=0, graph_metadata=False):
    """seqs: list of (num_cached, num_new). Both backends write the cached tokens' K/V in a
    first step, then run the new tokens in a second; returns (triton, torch) outputs of the
    second step, plus the metadata the triton builder made for it."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()  # shuffled blocks
    tables = [[perm.pop() for _ in range(-(-(c + n) // block_size))] for c, n in seqs]
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qkv = [
        tuple(
            torch.randn(c + n, h, head_dim, generator=gen, device=DEVICE).to(dtype)
            for h in (num_heads, num_kv_heads, num_kv_heads)
        )
        for c, n in seqs
    ]
    spec = AttentionSpec(num_heads, num_kv_heads, head_dim, 1 / math.sqrt(head_dim), window)
    shapes = {
        name: backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        for name, backend in (("triton", TritonAttentionBackend), ("torch", TorchAttentionBackend))
    }

    builder = TritonAttentionBackend.make_metadata_builder(DEVICE)
    if min_tokens_per_split is not None:
        builder.min_tokens_per_split = min_tokens_per_split
    runs = {
        "triton": (
            TritonAttentionBackend.make_impl(spec), builder, torch.zeros(shapes["triton"], dtype=dtype, device=DEVICE)
        ),
        "torch": (
            TorchAttentionBackend.make_impl(spec),
            TorchAttentionBackend.make_metadata_builder(DEVICE),
            torch.zeros(shapes["torch"], dtype=dtype, device=DEVICE),
        ),
    }

    def step(ranges):
        common = paged_metadata(block_table, ranges, block_size, DEVICE)
        q, k, v = (torch.cat([x[j][lo:hi] for x, (lo, hi) in zip(qkv, ranges)]).flatten(1) for j in range(3))
        outs, mds = {}, {}
        for name, (impl, bld, cache) in runs.items():
            # graph_metadata: the triton builder plans as for a CUDA-graph replay of a uniform
            # batch (every request the same query length), from the batch shape alone.
            uniform = graph_metadata and name == "triton" and ranges[0][0] > 0
            mds[name] = bld.build_for_cudagraph(common) if uniform else bld.build(common)
            outs[name] = impl.forward(q, k, v, cache, mds[name]).view(-1, num_heads, head_dim)
        return outs, mds

    if any(c for c, _ in seqs):
        step([(0, c) for c, _ in seqs])
    outs, mds = step([(c, c + n) for c, n in seqs])
    # The store kernel wrote exactly what index_copy_ wrote (only the used slots are compared:
    # unused ones are zero in both). The torch cache keeps heads outermost.
    torch_cache = runs["torch"][2].permute(0, 2, 3, 1, 4)  # -> [2, blocks, block_size, kv_heads, dim]
    torch.testing.assert_close(runs["triton"][2], torch_cache, atol=0, rtol=0)
    return outs["triton"], outs["torch"], mds["triton"]


TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def check(seqs, num_heads, num_kv_heads, head_dim, block_size, *, dtype=torch.float32, **kw):
    out, ref, md = run_both(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype=dtype, **kw)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    return md


@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_batch_of_mixed_lengths(block_size):
    check([(0, 1), (0, 7), (0, 40)], num_heads=2, num_kv_heads=2, head_dim=64, block_size=block_size)


def test_prefill_spanning_several_query_blocks_with_gqa():
    # Group 4 -> 16 query tokens per program: the 40- and 23-token prompts take several
    # q-blocks each, starting at offsets that are not multiples of 16.
    check([(0, 5), (0, 40), (0, 23), (9, 18)], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16)


def test_decode_over_cached_context_with_gqa():
    md = check([(16, 1), (31, 1), (5, 1), (47, 1)], num_heads=4, num_kv_heads=1, head_dim=64, block_size=16)
    assert md.num_splits == 1  # short contexts: no split-K


def test_chunked_prefill_over_cached_prefix_mixed_with_decode():
    check([(20, 9), (0, 12), (40, 1)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16)


@pytest.mark.parametrize("block_size", [16, 32])
def test_block_boundary_lengths(block_size):
    b = block_size
    seqs = [(b - 1, 1), (b, 1), (0, b), (0, b + 1), (b - 1, 2)]
    check(seqs, num_heads=2, num_kv_heads=1, head_dim=64, block_size=b)


def test_split_k_decode_matches():
    # 121 keys = 4 tiles of 32, so four splits do real work and the reduce must weigh them.
    md = check([(120, 1), (70, 1), (7, 1)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
               min_tokens_per_split=16)
    assert md.num_splits > 1 and not md.run_main  # all three through the split-K launch
    assert md.decode_req_idx.tolist() == [0, 1, 2]


def test_split_k_decodes_mixed_with_chunked_prefill():
    md = check([(20, 9), (100, 1), (0, 12), (40, 1)], num_heads=4, num_kv_heads=1, head_dim=64, block_size=16,
               min_tokens_per_split=16)
    assert md.num_splits > 1 and md.run_main
    assert md.decode_req_idx.tolist() == [1, 3]


def test_verification_batch_splits_every_query_token():
    """A speculative verification step as its CUDA graph plans it: 4 query tokens per request,
    each split like a decode over the keys up to its own position (causal inside the run)."""
    md = check([(70, 4), (33, 4)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, graph_metadata=True)
    assert md.num_splits > 1 and md.split_query_len == 4 and not md.run_main


def test_split_k_with_more_splits_than_key_tiles():
    # 2 key tiles cut into 4 splits: two splits are empty and must weigh nothing.
    md = check([(40, 1)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=16, min_tokens_per_split=10)
    assert md.num_splits == 4


def test_head_dim_128():
    check([(24, 8), (40, 1)], num_heads=2, num_kv_heads=1, head_dim=128, block_size=16)


def test_group_that_is_not_a_power_of_two():
    check([(10, 6), (21, 1)], num_heads=3, num_kv_heads=1, head_dim=64, block_size=16, min_tokens_per_split=8)


def test_sliding_window_masks_old_keys():
    check([(30, 5), (0, 20), (45, 1)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=16, window=6)


def test_sliding_window_with_split_k_decode():
    check([(100, 1), (25, 1)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=16, window=40,
          min_tokens_per_split=8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    check([(20, 9), (40, 1), (0, 5)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_split_k(dtype):
    check([(100, 1), (0, 5)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=32, dtype=dtype,
          min_tokens_per_split=16)


# ---- split-K decode in one launch: the last split of a (token, KV head) merges ----------------


def decode_batch(seq_lens, num_heads, num_kv_heads, head_dim, dtype, *, query_len=1, block_size=16, seed=0):
    """A paged cache holding ``seq_lens`` keys per request (shuffled blocks), and the last
    ``query_len`` positions of each request as the split launch's query tokens."""
    gen = torch.Generator().manual_seed(seed)
    tables = [-(-max(s, 1) // block_size) for s in seq_lens]
    num_blocks = sum(tables) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(tables)
    block_table = torch.tensor([[perm.pop() for _ in range(n)] + [0] * (width - n) for n in tables], dtype=torch.int32)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    num_tokens = len(seq_lens) * query_len
    query = torch.randn(num_tokens, num_heads * head_dim, generator=gen).to(dtype)
    case = dict(
        query=query, key_cache=cache[0], value_cache=cache[1], block_table=block_table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.arange(0, num_tokens + 1, query_len, dtype=torch.int32),
        decode_req_idx=torch.arange(len(seq_lens), dtype=torch.int32),
    )
    return {k: v.to(DEVICE) for k, v in case.items()}


def reference_decode(case, num_heads, num_kv_heads, head_dim, query_len):
    """float32 softmax attention of each query token over the keys up to its position."""
    group = num_heads // num_kv_heads
    block_size = case["key_cache"].shape[1]
    q = case["query"].float().view(-1, num_heads, head_dim)
    out = torch.zeros_like(q)
    for r, seq_len in enumerate(case["seq_lens"].tolist()):
        pos = torch.arange(seq_len, device=DEVICE)
        slots = case["block_table"][r, pos // block_size].long(), pos % block_size
        k, v = (case[name][slots].float().repeat_interleave(group, 1) for name in ("key_cache", "value_cache"))
        for j in range(query_len):
            visible = seq_len - query_len + j + 1
            if visible <= 0:
                continue  # a CUDA-graph padding token: no key, zeros
            s = torch.einsum("hd,nhd->hn", q[r * query_len + j], k[:visible]) / math.sqrt(head_dim)
            out[r * query_len + j] = torch.einsum("hn,nhd->hd", s.softmax(-1), v[:visible])
    return out


# (seq_lens, num_heads, num_kv_heads, head_dim, dtype, num_splits, query_len). Decode tiles are
# 32 keys: 32/33, 64/65, 128/129 keys sit on either side of a tile (and so split) boundary.
SPLIT_CASES = {
    "batch1_qwen3_heads_bf16": ([97], 4, 2, 128, torch.bfloat16, 4, 1),
    "batch5_split_boundaries_group4": ([32, 33, 64, 65, 1], 4, 1, 64, torch.float32, 2, 1),
    "batch3_mha_head128_more_splits_than_tiles": ([129, 128, 40], 2, 2, 128, torch.float32, 8, 1),
    "batch2_group3_three_splits_bf16": ([70, 33], 3, 1, 64, torch.bfloat16, 3, 1),
    "padding_request_without_keys": ([0, 50], 4, 2, 64, torch.float32, 2, 1),
    "verification_4_tokens": ([70, 33], 4, 2, 64, torch.float32, 4, 4),
}


@pytest.mark.parametrize("case_id", list(SPLIT_CASES))
def test_split_k_merged_in_kernel_equals_the_reduce_launch(case_id):
    """One launch (the last split merges) gives exactly the two-launch result, matches a
    float32 reference, leaves every counter at zero and so runs again (next layer) unchanged."""
    from pagelm.backends.triton import paged_attention as pa

    seq_lens, num_heads, num_kv_heads, head_dim, dtype, num_splits, query_len = SPLIT_CASES[case_id]
    shape = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    rows = len(seq_lens) * query_len
    scratch = pa.SplitScratch.allocate(rows * num_splits, num_heads, head_dim, DEVICE)
    for seed in (0, 1):  # two launches on the same scratch: the counters must have reset
        case = decode_batch(seq_lens, **shape, dtype=dtype, query_len=query_len, seed=seed)
        outs = {}
        for fuse in (True, False):
            outs[fuse] = torch.full_like(case["query"], float("nan"))
            pa.split_decode_attention(
                outs[fuse], *case.values(), scratch, num_decodes=len(seq_lens), num_splits=num_splits,
                scale=1 / math.sqrt(head_dim), sliding_window=None, query_len=query_len, fuse_reduce=fuse, **shape,
            )
            assert not scratch.counter.any()
        assert torch.equal(outs[True], outs[False])
        ref = reference_decode(case, **shape, query_len=query_len).flatten(1)
        torch.testing.assert_close(outs[True].float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


class LaunchCounter:
    """Stands in for a kernel: counts ``kernel[grid](...)`` launches and runs them."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("fuse", [True, False], ids=["one_launch", "reduce_launch"])
def test_split_k_decode_launches(fuse, monkeypatch):
    from pagelm.backends.triton import paged_attention as pa

    monkeypatch.setattr(pa, "SPLIT_REDUCE_FUSION_DISABLED", not fuse)
    main, reduce = LaunchCounter(pa._paged_attention_kernel), LaunchCounter(pa._reduce_splits_kernel)
    monkeypatch.setattr(pa, "_paged_attention_kernel", main)
    monkeypatch.setattr(pa, "_reduce_splits_kernel", reduce)
    md = check([(120, 1), (70, 1)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, min_tokens_per_split=16)
    assert md.num_splits > 1 and not md.run_main
    # The first step (the prompts) is one main launch; the decode step one split launch,
    # plus the reduce when the merge is not fused.
    assert (main.launches, reduce.launches) == (2, 0 if fuse else 1)


def test_split_count_follows_context_length_and_batch_size():
    builder = TritonMetadataBuilder(DEVICE, target_programs=64)
    assert builder.num_splits(num_decodes=1, max_decode_seq_len=200) == 1  # short: one program is enough
    assert builder.num_splits(num_decodes=1, max_decode_seq_len=4096) == 16  # 256 keys per split
    assert builder.num_splits(num_decodes=1, max_decode_seq_len=1 << 20) == builder.max_splits
    assert builder.num_splits(num_decodes=16, max_decode_seq_len=4096) == 4  # the batch fills the GPU
    assert builder.num_splits(num_decodes=64, max_decode_seq_len=4096) == 1


def test_validate_accepts_a_cpu_model_only_under_the_interpreter(monkeypatch):
    spec = AttentionSpec(4, 2, 64, 0.125)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonAttentionBackend.validate(None, spec, torch.float32, torch.device("cpu")) == []
    monkeypatch.delenv("TRITON_INTERPRET")
    (problem,) = TritonAttentionBackend.validate(None, spec, torch.float32, torch.device("cpu"))
    assert "TRITON_INTERPRET=1" in problem


def test_validate_names_the_extra_when_triton_is_missing(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    spec = AttentionSpec(4, 2, 64, 0.125)
    problems = TritonAttentionBackend.validate(None, spec, torch.float16, torch.device("cuda"))
    assert any("pagelm[triton]" in p for p in problems)


def test_plugin_registers_and_explains_itself_without_triton():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # as if triton were not installed: importing it fails
        import torch
        from pagelm.attention import AttentionSpec
        from pagelm.plugin_manager import get_plugin_manager
        backend = get_plugin_manager().collect("attention backend").get("triton")
        print(backend.validate(None, AttentionSpec(4, 2, 64, 0.125), torch.float16, torch.device("cuda")))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pip install 'pagelm[triton]'" in result.stdout


# ---- the whole engine -------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]


def engine_tokens(model_dir, backend, **kw):
    llm = LLM(str(model_dir), attention_backend=backend, dtype="float32", device=DEVICE.type, **kw)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def torch_tokens(llama_dir):
    return engine_tokens(llama_dir, "torch", max_num_batched_tokens=16)


def test_engine_greedy_tokens_match_torch_backend(llama_dir, torch_tokens):
    # A 16-token budget chunks the 40-token prompt over several steps next to decodes.
    assert engine_tokens(llama_dir, "triton", max_num_batched_tokens=16) == torch_tokens


def test_engine_greedy_tokens_match_with_split_k_decode(llama_dir, torch_tokens, monkeypatch):
    from pagelm.backends.triton import paged_attention

    launches = []
    split_decode = paged_attention.split_decode_attention

    def counted(*args, **kwargs):
        launches.append(kwargs)
        return split_decode(*args, **kwargs)

    monkeypatch.setattr(paged_attention, "split_decode_attention", counted)
    monkeypatch.setattr(TritonMetadataBuilder, "min_tokens_per_split", 8)
    assert engine_tokens(llama_dir, "triton", max_num_batched_tokens=16) == torch_tokens
    assert launches and max(kw["num_splits"] for kw in launches) > 1


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_greedy_tokens_with_split_k_merged_in_kernel_or_not(make_model, arch, monkeypatch):
    """Split-K decodes (a low split threshold) give the torch backend's greedy tokens with
    the merge in the split kernel and with the reduce launch (``PAGELM_SPLIT_REDUCE_FUSION``)."""
    from pagelm.backends.triton import paged_attention as pa

    model_dir = make_model(f"{arch}_split_merge", arch)
    expected = engine_tokens(model_dir, "torch", max_num_batched_tokens=16)
    monkeypatch.setattr(TritonMetadataBuilder, "min_tokens_per_split", 8)
    reduce = LaunchCounter(pa._reduce_splits_kernel)
    monkeypatch.setattr(pa, "_reduce_splits_kernel", reduce)
    for fuse in (True, False):
        monkeypatch.setattr(pa, "SPLIT_REDUCE_FUSION_DISABLED", not fuse)
        reduce.launches = 0
        assert engine_tokens(model_dir, "triton", max_num_batched_tokens=16) == expected
        assert (reduce.launches > 0) != fuse


def test_engine_greedy_tokens_match_with_sliding_window(make_model):
    model_dir = make_model("mistral_window8", "mistral", sliding_window=8)
    assert engine_tokens(model_dir, "triton") == engine_tokens(model_dir, "torch")
