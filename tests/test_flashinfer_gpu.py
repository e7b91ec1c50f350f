"""The flashinfer backend on CUDA with FlashInfer 0.5.3: its kernels against the torch
reference at realistic shapes (head 128, GQA 32/8 with tensor-core decode and 16/8 with the
CUDA-core one, block 16, contexts up to 4k, bfloat16), cascade over a shared prefix, a
captured decode graph re-planned before each replay; then the whole engine: triton vs
flashinfer on 64 prompts, CUDA graphs on vs off, cascade on vs off.

Greedy tokens from two bf16 engines are compared with ``assert_same_greedy``: identical,
except that a prompt may part ways at a near-tie (both engines rank the other's token within
``TIE`` nats of their own: bf16 rounding in a different kernel flips such ties on a random-weight
model, and after that the contexts differ). A real error is not a tie: it shows up as a
divergence at a decided position, or as logprobs further apart than bf16 noise.

The first run on a fresh machine JIT-compiles FlashInfer's kernels (~1-2 minutes per module:
bf16 x head 128 prefill/tensor-core decode, CUDA-core decode, sliding window, head 64).
"""

import gc
import logging
import math

import pytest
import torch

from pagelm import LLM, SamplingParams
from pagelm.attention import AttentionSpec, CommonAttentionMetadata
from pagelm.backends.flashinfer import FlashInferAttentionBackend
from pagelm.backends.torch import TorchAttentionBackend
from cuda_helpers import forbid_host_sync

# The harness shared with the CPU tests (tests/ is on sys.path under pytest's default import mode).
from test_flashinfer_backend import run_against_torch

pytestmark = pytest.mark.gpu
flashinfer = pytest.importorskip("flashinfer")

LLAMA_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)  # group 4: tensor-core decode
QWEN3_06B = dict(num_heads=16, num_kv_heads=8, head_dim=128, block_size=16)  # group 2: CUDA-core decode
BF16 = dict(dtype=torch.bfloat16, device="cuda")
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def check(seqs, shape=LLAMA_8B, **kw):
    out, ref, md, builder = run_against_torch(seqs, **shape, **BF16, **kw)
    torch.testing.assert_close(out, ref, **BF16_TOL)
    return md, builder


# =============================================================================================
# kernels against the torch reference
# =============================================================================================


def test_decode_batch_with_tensor_core_decode_for_gqa():
    md, builder = check([(4095, 1), (1000, 1), (16, 1), (0, 1)])
    (group,) = builder.groups.values()
    assert group.use_tensor_cores and md.num_decode_tokens == 4


def test_decode_batch_with_cuda_core_decode_for_a_small_group():
    md, builder = check([(4095, 1), (300, 1), (31, 1)], QWEN3_06B)
    assert not next(iter(builder.groups.values())).use_tensor_cores


def test_large_decode_batch():
    check([(300 + 7 * i, 1) for i in range(160)])


def test_prefill_batch():
    md, _ = check([(0, 517), (0, 1), (0, 1024), (0, 33)])
    assert md.num_decode_tokens == 0  # the one-token prompt after a prefill goes with the prefills


def test_chunked_prefill_over_a_cached_prefix_mixed_with_decodes():
    md, _ = check([(4095, 1), (100, 1), (1537, 1), (3000, 512), (0, 256), (33, 3)])
    assert md.num_decode_tokens == 3


def test_mixed_batch_with_the_small_group():
    check([(2000, 1), (700, 300), (0, 129)], QWEN3_06B)


def test_block_size_32():
    check([(2047, 1), (700, 300), (0, 129)], dict(LLAMA_8B, block_size=32))


def test_sliding_window():
    check([(3000, 1), (1500, 200), (0, 700)], window=1024)


def test_cascade_decode_over_a_long_shared_prefix():
    # 64 requests over one 2048-token prefix (128 shared blocks), own tails of 1..300 tokens.
    seqs = [(2048 + (37 * i) % 300, 1) for i in range(64)]
    md, builder = check(seqs, shared_blocks=128)
    assert md.cascade and builder.num_cascade_steps == 1


def test_cascade_with_decodes_and_a_chunked_prefill():
    md, _ = check([(1030, 1), (1100, 1), (1500, 400), (1024, 7)], shared_blocks=64)
    assert md.cascade and md.num_decode_tokens == 2


def test_cascade_with_the_small_group():
    md, _ = check([(600 + 11 * i, 1) for i in range(24)], QWEN3_06B, shared_blocks=32)
    assert md.cascade


def test_conformance_kit():
    from pagelm.testing.conformance import check_attention_kernels

    check_attention_kernels("flashinfer", device="cuda", dtype=torch.bfloat16)


def _cache_pair(num_blocks, block_size, num_kv_heads, head_dim):
    """The same random KV in flashinfer's [blocks, 2, block_size, kv_heads, ...] and torch's
    [2, kv_heads, blocks, block_size, ...] layouts."""
    fi_cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, device="cuda").to(torch.bfloat16)
    return fi_cache, fi_cache.permute(1, 3, 0, 2, 4).contiguous()


def _decode_common(seq_lens, table, block_size, slot_buffer=None):
    n = len(seq_lens)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    pos = (lens - 1).long()
    slots = table[torch.arange(n), pos // block_size].long() * block_size + pos % block_size
    qsl = torch.arange(n + 1, dtype=torch.int32)
    return CommonAttentionMetadata(
        num_reqs=n, num_actual_tokens=n, max_query_len=1, max_seq_len=int(lens.max()), query_start_loc=qsl.cuda(),
        seq_lens=lens.cuda(), block_table=table.cuda(), slot_mapping=slots.cuda(), query_start_loc_cpu=qsl,
        seq_lens_cpu=lens, block_size=block_size, block_table_cpu=table,
    )


def test_captured_decode_graph_replays_the_plan_made_before_each_replay():
    spec, bs, size, width, num_blocks = AttentionSpec(32, 8, 128, 1 / math.sqrt(128)), 16, 8, 200, 1600
    builder = FlashInferAttentionBackend.make_metadata_builder(torch.device("cuda"))
    builder.bind_layers([spec], torch.bfloat16)
    impl, ref_impl = FlashInferAttentionBackend.make_impl(spec), TorchAttentionBackend.make_impl(spec)
    fi_cache, ref_cache = _cache_pair(num_blocks, bs, 8, 128)
    # The runner's persistent buffers, as the graph sees them.
    slot_buf = torch.full((size,), -1, dtype=torch.int64, device="cuda")
    table_buf = torch.zeros(size, width, dtype=torch.int32, device="cuda")
    q_buf = torch.zeros(size, 32 * 128, dtype=torch.bfloat16, device="cuda")
    kv_buf = torch.zeros(size, 8 * 128, dtype=torch.bfloat16, device="cuda")
    ones, qsl = torch.ones(size, dtype=torch.int32), torch.arange(size + 1, dtype=torch.int32)
    capture = CommonAttentionMetadata(
        num_reqs=size, num_actual_tokens=size, max_query_len=1, max_seq_len=width * bs,
        query_start_loc=qsl.cuda(), seq_lens=ones.cuda(), block_table=table_buf, slot_mapping=slot_buf,
        query_start_loc_cpu=qsl, seq_lens_cpu=ones, block_size=bs,
    )
    md = builder.build_for_cudagraph(capture)
    impl.forward(q_buf, kv_buf, kv_buf, fi_cache, md)  # warm-up (JIT) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = impl.forward(q_buf, kv_buf, kv_buf, fi_cache, md)

    gen = torch.Generator().manual_seed(0)
    for seq_lens in ([3001, 17, 1, 480, 1999], [100 + 350 * i for i in range(8)]):
        n = len(seq_lens)
        table = torch.randperm(num_blocks, generator=gen)[: n * width].view(n, width).int()
        common = _decode_common(seq_lens, table, bs)
        slot_buf.fill_(-1)
        slot_buf[:n].copy_(common.slot_mapping)
        table_buf[:n].copy_(common.block_table)
        q, kv = torch.randn(n, 32 * 128, generator=gen).cuda(), torch.randn(n, 8 * 128, generator=gen).cuda()
        q_buf[:n], kv_buf[:n] = q.to(torch.bfloat16), kv.to(torch.bfloat16)
        padded = CommonAttentionMetadata(
            **{**common.__dict__, "num_reqs": size, "seq_lens_cpu": torch.tensor(seq_lens + [1] * (size - n),
                                                                                 dtype=torch.int32)}
        )
        assert builder.prepare_cudagraph_replay(padded, n)
        graph.replay()
        ref_md = TorchAttentionBackend.make_metadata_builder(None).build(common)
        want = ref_impl.forward(q_buf[:n], kv_buf[:n], kv_buf[:n], ref_cache, ref_md)
        torch.testing.assert_close(out[:n], want, **BF16_TOL)


def test_forward_makes_no_host_sync():
    """Graphs capture forward: it must only launch kernels (planning, in the builder, may sync)."""
    for seqs, shared in (([(3000, 1), (10, 40)], 0), ([(1100, 1), (1030, 1), (1500, 40)], 64)):
        out, ref, md, builder = run_against_torch(seqs, **LLAMA_8B, **BF16, shared_blocks=shared)
        spec = next(iter(builder.groups))
        impl = FlashInferAttentionBackend.make_impl(spec)
        n = md.num_actual_tokens
        cache = torch.zeros(FlashInferAttentionBackend.get_kv_cache_shape(1000, 16, 8, 128), dtype=torch.bfloat16,
                            device="cuda")
        q = torch.randn(n, 32 * 128, dtype=torch.bfloat16, device="cuda")
        kv = torch.randn(n, 8 * 128, dtype=torch.bfloat16, device="cuda")
        impl.forward(q, kv, kv, cache, md)
        torch.cuda.synchronize()
        with forbid_host_sync():
            impl.forward(q, kv, kv, cache, md)


# =============================================================================================
# the engine
# =============================================================================================

TIE = 0.25  # nats: bf16 noise between two kernels on a random-weight model (0.125 seen)


def assert_same_greedy(a, b, names=("a", "b"), max_diverging=None):
    """Greedy outputs of two engines on the same prompts (``logprobs=2``): identical tokens,
    except a prompt may part ways at a near-tie; chosen tokens' logprobs agree within bf16
    noise up to there. Returns how many prompts parted ways."""
    diverged, diffs = [], []
    for i, (oa, ob) in enumerate(zip(a, b)):
        ca, cb = oa.outputs[0], ob.outputs[0]
        ta, tb = ca.token_ids, cb.token_ids
        j = next((k for k, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        diffs += [abs(ca.logprobs[k][ta[k]].logprob - cb.logprobs[k][tb[k]].logprob) for k in range(j)]
        if j == len(ta):
            assert len(ta) == len(tb)
            continue
        la, lb = ca.logprobs[j], cb.logprobs[j]
        for mine, theirs, lp, who in ((ta[j], tb[j], la, names[0]), (tb[j], ta[j], lb, names[1])):
            assert theirs in lp and lp[mine].logprob - lp[theirs].logprob < TIE, (
                f"prompt {i}, token {j}: {names[0]} chose {ta[j]}, {names[1]} chose {tb[j]}, not a near-tie "
                f"under {who}: {lp}"
            )
        diverged.append(i)
    diffs_t = torch.tensor(diffs or [0.0])
    print(f"{names[0]} vs {names[1]}: {len(a) - len(diverged)}/{len(a)} prompts identical, "
          f"logprob diff mean {diffs_t.mean():.4f} max {diffs_t.max():.4f}; near-tie divergences: {diverged}")
    assert diffs_t.max() < 0.15 and diffs_t.mean() < 0.03
    limit = len(a) // 2 if max_diverging is None else max_diverging
    assert len(diverged) <= limit, f"{len(diverged)} of {len(a)} prompts diverged"
    return len(diverged)


@pytest.fixture(scope="module")
def head128_model(make_model):
    # Head 128, GQA 4:1 (tensor-core decode): the kernels' real code paths on a tiny model.
    return make_model("fi_llama_head128", "llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=4096)


def _generate(model_dir, prompts, max_tokens=16, setup=None, **kw):
    # float16: both backends support it and its rounding noise is 8x below bf16's, so random
    # weights' near-ties rarely flip between kernels (in bf16 about half the prompts part ways).
    llm = LLM(str(model_dir), device="cuda", dtype="float16", gpu_memory_utilization=0.3, max_num_seqs=64,
              **kw)
    if setup is not None:
        setup(llm.engine.core.runner.metadata_builder)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    runner = llm.engine.core.runner
    stats = dict(
        backend=runner.backend.name,
        graph_replays=runner.cuda_graphs.num_replays if runner.cuda_graphs else 0,
        cascade_steps=getattr(runner.metadata_builder, "num_cascade_steps", 0),
        graph_plans=getattr(runner.metadata_builder, "num_graph_plans", 0),
    )
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return outs, stats


def _prompts(n, seed, min_len=5, max_len=600, prefix=()):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len, (n,), generator=gen).tolist()
    return [{"prompt_token_ids": list(prefix) + torch.randint(5, 500, (m,), generator=gen).tolist()} for m in lens]


def test_engine_greedy_tokens_triton_vs_flashinfer_on_64_prompts(head128_model):
    prompts = _prompts(56, seed=1)
    prompts += [{"prompt_token_ids": p["prompt_token_ids"][:200] + [7, 8, 9]} for p in prompts[:8]]  # cache hits
    kw = dict(max_num_batched_tokens=1024)  # long prompts are chunked
    triton, triton_stats = _generate(head128_model, prompts, attention_backend="triton", **kw)
    fi, fi_stats = _generate(head128_model, prompts, attention_backend="flashinfer", **kw)
    assert fi_stats["backend"] == "flashinfer" and fi_stats["graph_replays"] > 0
    assert_same_greedy(triton, fi, ("triton", "flashinfer"))


def test_cuda_graphs_on_and_off_give_the_same_tokens(head128_model):
    # Requests of different lengths finish at different steps: decode batches of 24..1,
    # padded to captured sizes, each replay re-planned.
    prompts = _prompts(24, seed=2, max_len=1500)
    outs = {}
    for eager in (True, None):
        outs[eager], stats = _generate(head128_model, prompts, max_tokens=40, attention_backend="flashinfer",
                                       enforce_eager=eager)
        if eager is None:
            assert stats["graph_replays"] > 0 and stats["graph_plans"] > stats["graph_replays"]
        else:
            assert stats["graph_replays"] == 0
    assert_same_greedy(outs[True], outs[None], ("eager", "graphs"))


def test_cascade_on_and_off_give_the_same_tokens(head128_model):
    system = torch.randint(5, 500, (512,), generator=torch.Generator().manual_seed(3)).tolist()  # 32 blocks
    prompts = _prompts(32, seed=4, max_len=40, prefix=system)

    def always(builder):  # this tiny model's KV is too small for cascade to beat a graph by default
        builder.cascade_graph_min_saved_bytes = 0

    on, on_stats = _generate(head128_model, prompts, max_tokens=24, attention_backend="flashinfer",
                             plugin_config={"flashinfer": {"cascade_attention_min_blocks": 16}}, setup=always)
    off, off_stats = _generate(head128_model, prompts, max_tokens=24, attention_backend="flashinfer",
                               plugin_config={"flashinfer": {"cascade_attention_min_blocks": 0}})
    assert on_stats["cascade_steps"] >= 20 and off_stats["cascade_steps"] == 0
    assert off_stats["graph_replays"] > 0  # without cascade, the same decodes replay graphs
    assert_same_greedy(off, on, ("cascade off", "cascade on"))


def test_auto_picks_triton_on_this_gpu_and_logs_it(head128_model, caplog):
    with caplog.at_level(logging.INFO, logger="pagelm"):
        _, stats = _generate(head128_model, _prompts(2, seed=5), max_tokens=2)
    assert stats["backend"] == "triton"
    assert "attention_backend=auto: using 'triton' on cuda" in caplog.text
