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
