"""The triton backend on CUDA at realistic shapes (head 128, GQA 32/8, block 16, contexts up to
4k, bfloat16) against the torch reference backend, plus the whole engine's greedy tokens."""

import math

import pytest
import torch

from pagelm import LLM, SamplingParams
from pagelm.attention import AttentionSpec, CommonAttentionMetadata
from pagelm.backends.triton import TritonAttentionBackend
from cuda_helpers import forbid_host_sync

# The harness shared with the CPU tests (tests/ is on sys.path under pytest's default import mode).
from test_triton_backend import engine_tokens, run_both

pytestmark = pytest.mark.gpu

LLAMA_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def test_decode_batch_at_long_context_uses_split_k():
    out, ref, md = run_both([(4095, 1), (1000, 1), (16, 1), (0, 1)], **LLAMA_8B, dtype=torch.bfloat16)
    torch.testing.assert_close(out, ref, **BF16_TOL)
    assert md.num_splits > 1 and md.num_decodes == 4


def test_single_long_decode_is_split_across_programs():
    out, ref, md = run_both([(4095, 1)], **LLAMA_8B, dtype=torch.bfloat16)
    torch.testing.assert_close(out, ref, **BF16_TOL)
    assert md.num_splits >= 8


def test_large_decode_batch_does_not_split():
    # More decodes than SMs: the batch fills the GPU without splitting.
    out, ref, md = run_both([(300 + 7 * i, 1) for i in range(160)], **LLAMA_8B, dtype=torch.bfloat16)
    torch.testing.assert_close(out, ref, **BF16_TOL)
    assert md.num_splits == 1


def test_prefill_batch():
    out, ref, _ = run_both([(0, 1), (0, 517), (0, 1024), (0, 33)], **LLAMA_8B, dtype=torch.bfloat16)
    torch.testing.assert_close(out, ref, **BF16_TOL)


def test_chunked_prefill_over_cached_prefix_mixed_with_long_decodes():
    seqs = [(3000, 512), (4095, 1), (100, 1), (0, 256), (1537, 1)]
    out, ref, md = run_both(seqs, **LLAMA_8B, dtype=torch.bfloat16)
    torch.testing.assert_close(out, ref, **BF16_TOL)
    assert md.num_splits > 1 and md.run_main


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes_and_block_size_32(dtype):
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=4e-3, rtol=4e-3)
    shape = dict(LLAMA_8B, block_size=32)
    out, ref, _ = run_both([(2047, 1), (700, 300), (0, 129)], **shape, dtype=dtype)
    torch.testing.assert_close(out, ref, **tol)


def test_head_dim_64_and_sliding_window():
    out, ref, _ = run_both([(3000, 1), (1500, 200)], num_heads=16, num_kv_heads=4, head_dim=64, block_size=16,
                           dtype=torch.bfloat16, window=1024)
    torch.testing.assert_close(out, ref, **BF16_TOL)


def test_forward_makes_no_host_sync():
    """CUDA graphs will capture forward: it must launch kernels only (the builder may sync)."""
    num_blocks = 256
    spec = AttentionSpec(32, 8, 128, 1 / math.sqrt(128))
    impl = TritonAttentionBackend.make_impl(spec)
    builder = TritonAttentionBackend.make_metadata_builder(torch.device("cuda"))
    cache = torch.zeros(TritonAttentionBackend.get_kv_cache_shape(num_blocks, 16, 8, 128), dtype=torch.bfloat16,
                        device="cuda")
    qsl = torch.tensor([0, 1, 41], dtype=torch.int32)
    lens = torch.tensor([3001, 50], dtype=torch.int32)
    table = torch.arange(2 * 200, dtype=torch.int32).view(2, 200) % num_blocks
    slots = torch.cat([torch.tensor([table[0, 3000 // 16] * 16 + 3000 % 16]),
                       table[1, torch.arange(10, 50) // 16].long() * 16 + torch.arange(10, 50) % 16])
    common = CommonAttentionMetadata(
        num_reqs=2, num_actual_tokens=41, max_query_len=40, max_seq_len=3001, query_start_loc=qsl.cuda(),
        seq_lens=lens.cuda(), block_table=table.cuda(), slot_mapping=slots.long().cuda(), query_start_loc_cpu=qsl,
        seq_lens_cpu=lens, block_size=16,
    )
    md = builder.build(common)
    assert md.num_splits > 1
    q = torch.randn(41, 32 * 128, dtype=torch.bfloat16, device="cuda")
    kv = torch.randn(41, 8 * 128, dtype=torch.bfloat16, device="cuda")
    impl.forward(q, kv, kv, cache, md)  # compile first: compilation may sync
    torch.cuda.synchronize()
    with forbid_host_sync():
        impl.forward(q, kv, kv, cache, md)


def test_engine_greedy_tokens_match_torch_backend(make_model):
    # Head 128, GQA 4:1; a 1500-token prompt makes its decodes take the split-K path.
    model_dir = make_model("gpu_llama_head128", "llama", hidden_size=512, num_attention_heads=4,
                           num_key_value_heads=1, max_position_embeddings=2048)
    prompts = [{"prompt_token_ids": [5 + (7 * i) % 500 for i in range(n)]} for n in (3, 300, 1500)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def tokens(backend):
        llm = LLM(str(model_dir), attention_backend=backend, device="cuda", dtype="float32",
                  gpu_memory_utilization=0.3, max_num_batched_tokens=512)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    assert tokens("triton") == tokens("torch")


def test_engine_on_the_tiny_model_matches(llama_dir):
    assert engine_tokens(llama_dir, "triton") == engine_tokens(llama_dir, "torch")


# ---- split-K decode merged in the split kernel (one launch) ------------------------------------

QWEN3_06B = dict(num_heads=16, num_kv_heads=8, head_dim=128)


def split_decode(out, case, scratch, num_splits, fuse, shape):
    from pagelm.backends.triton import paged_attention as pa

    pa.split_decode_attention(
        out, *case.values(), scratch, num_decodes=case["seq_lens"].numel(), num_splits=num_splits,
        scale=1 / math.sqrt(shape["head_dim"]), sliding_window=None, fuse_reduce=fuse, **shape,
    )


@pytest.mark.parametrize("shape", [QWEN3_06B, dict(num_heads=32, num_kv_heads=8, head_dim=128)], ids=["qwen3_0_6b", "llama_8b"])
@pytest.mark.parametrize("seq_lens", [[4095], [640], [4095, 1000, 16, 1], [100 + 127 * i for i in range(32)]],
                         ids=["batch1_4k", "batch1_640", "batch4", "batch32"])
def test_split_k_merge_in_kernel_is_repeatable_and_equals_the_reduce_launch(shape, seq_lens):
    """The last-split merge (atomic counter, acquire/release) gives the same bits launch after
    launch (a race would show as a stale partial now and then), the reduce launch's bf16
    output to within one rounding, and leaves every counter at zero. (It is the same
    arithmetic, compiled in another kernel: with Triton 3.6 on an H100 and an H200 one or two
    elements of 2,048-16,384 round the other way in two of these cases, the same elements
    every launch; docs/benchmarks.md.)"""
    from pagelm.backends.triton import paged_attention as pa
    from pagelm.backends.triton.backend import TritonMetadataBuilder
    from test_triton_backend import decode_batch, reference_decode

    builder = TritonMetadataBuilder(torch.device("cuda"))
    num_splits = max(2, min(builder.max_splits, builder.target_programs // len(seq_lens)))
    case = decode_batch(seq_lens, **shape, dtype=torch.bfloat16)
    scratch = pa.SplitScratch.allocate(len(seq_lens) * num_splits, shape["num_heads"], shape["head_dim"], "cuda")
    expected = torch.empty_like(case["query"])
    split_decode(expected, case, scratch, num_splits, False, shape)
    ref = reference_decode(case, **shape, query_len=1).flatten(1)
    torch.testing.assert_close(expected.float(), ref, **BF16_TOL)
    first = torch.empty_like(expected)
    split_decode(first, case, scratch, num_splits, True, shape)
    assert_within_one_rounding(first, expected)
    out = torch.empty_like(expected)
    for _ in range(200):
        out.fill_(float("nan"))
        split_decode(out, case, scratch, num_splits, True, shape)
        assert torch.equal(out, first)
    assert not scratch.counter.any()


def assert_within_one_rounding(out: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16 outputs equal but for a last-bit rounding here and there (a stale or missing split
    would be off by far more)."""
    diff = (out.float() - expected.float()).abs()
    one_ulp = expected.float().abs() * 2.0**-7 + 1e-6
    assert bool((diff <= one_ulp).all()), f"max |d| {diff.max().item():.3g}"
    assert int((diff > 0).sum()) <= max(2, out.numel() // 1000), int((diff > 0).sum())


def test_split_k_merge_in_kernel_replays_in_a_cuda_graph():
    """Captured once at batch 4 with 32 splits, replayed over new queries and lengths written
    into the captured buffers: each replay gives an eager fused run's bits, and the reduce
    launch's output to within one rounding."""
    from pagelm.backends.triton import paged_attention as pa
    from test_triton_backend import decode_batch

    shape, num_splits = QWEN3_06B, 32
    case = decode_batch([4000, 3000, 2000, 1000], **shape, dtype=torch.bfloat16)
    scratch = pa.SplitScratch.allocate(4 * num_splits, shape["num_heads"], shape["head_dim"], "cuda")
    out = torch.empty_like(case["query"])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        split_decode(out, case, scratch, num_splits, True, shape)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        split_decode(out, case, scratch, num_splits, True, shape)
    for seed in range(1, 6):
        new = decode_batch([4000, 3000, 2000, 1000], **shape, dtype=torch.bfloat16, seed=seed)
        case["query"].copy_(new["query"])
        case["seq_lens"].copy_(torch.tensor([4000 - 300 * seed, 17 * seed, 2000, 1], dtype=torch.int32))
        graph.replay()
        eager, expected = torch.empty_like(out), torch.empty_like(out)
        split_decode(eager, case, scratch, num_splits, True, shape)
        split_decode(expected, case, scratch, num_splits, False, shape)
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        assert_within_one_rounding(out, expected)
        assert not scratch.counter.any()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_with_cuda_graphs_same_tokens_with_and_without_the_merge_fusion(make_model, arch, monkeypatch):
    """bf16 with decode graphs (batch 1 splits 32 ways): greedy tokens with the merge in the
    split kernel equal those with the reduce launch (PAGELM_SPLIT_REDUCE_FUSION)."""
    from pagelm.backends.triton import paged_attention as pa

    model_dir = make_model(f"gpu_{arch}_split_merge", arch)
    prompts = [{"prompt_token_ids": [5 + (7 * i) % 500 for i in range(n)]} for n in (3, 300)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def tokens():
        llm = LLM(str(model_dir), attention_backend="triton", dtype="bfloat16", device="cuda",
                  gpu_memory_utilization=0.3)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    monkeypatch.setattr(pa, "SPLIT_REDUCE_FUSION_DISABLED", False)
    fused = tokens()
    monkeypatch.setattr(pa, "SPLIT_REDUCE_FUSION_DISABLED", True)
    assert tokens() == fused
