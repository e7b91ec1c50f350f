"""The triton backend's fused q/k norm + rotary + K/V store (``rotary_store_kv``) against the
unfused torch path: per-head RMSNorm, neox RoPE, then K/V written at ``slot_mapping``; and
bit for bit against the two Triton kernels it replaces. Then whole models (Llama, Qwen3)
whose layers hand their rotary to the triton backend, against the same models keeping it.

Without CUDA the kernels run on the CPU under Triton's interpreter (shapes stay small).
"""

import pytest
import torch

pytest.importorskip("triton")

from pagelm import LLM, SamplingParams  # noqa: E402
from pagelm.attention import QKRotary  # noqa: E402
from pagelm.models.ops import reference  # noqa: E402
from triton_interpreter import interpreted_kernels  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
KERNEL_MODULES = ("pagelm.backends.kernels.rotary", "pagelm.backends.triton.kv_store",
                  "pagelm.backends.triton.paged_attention")


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter():
    """On CPU: TRITON_INTERPRET=1 while this module runs, with the kernels decorated under it."""
    with interpreted_kernels(*KERNEL_MODULES):
        yield


def kernels():
    import pagelm.backends.kernels.rotary as rotary
    import pagelm.backends.triton.kv_store as kv_store

    return rotary, kv_store


def cos_sin_cache(max_position: int, rotary_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)


def case(num_tokens, num_heads, num_kv_heads, head_dim, dtype, *, rotary_dim=None, norm=False, seed=0):
    """q, k, v as column slices of one fused qkv row (strided rows, as the model gives them),
    positions, the rotary inputs, and an empty two-tensor paged cache."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim + 8  # +8: rows wider than their heads
    qkv = torch.randn(num_tokens, width, generator=gen).to(DEVICE, dtype)
    q, k, v, _ = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim, 8], dim=-1)
    positions = torch.randint(0, 100, (num_tokens,), generator=gen).to(DEVICE)
    weights = {}
    if norm:
        weights = dict(
            q_norm_weight=(torch.rand(head_dim, generator=gen) + 0.5).to(DEVICE, dtype),
            k_norm_weight=(torch.rand(head_dim, generator=gen) + 0.5).to(DEVICE, dtype),
            eps=1e-6,
        )
    rotary = QKRotary(positions, cos_sin_cache(128, rotary_dim or head_dim), **weights)
    return qkv, q, k, v, rotary


def empty_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype):
    # The triton backend's layout: [2, num_blocks, block_size, num_kv_heads, head_dim].
    return torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)


def torch_reference(q, k, v, rotary, slot_mapping, cache, head_dim):
    """The unfused path: per-head RMSNorm (if any), RoPE, then the cache write at each slot."""
    n = q.shape[0]
    if rotary.q_norm_weight is not None:
        q = reference.rms_norm(q.reshape(n, -1, head_dim), rotary.q_norm_weight, rotary.eps)[0].view(n, -1)
        k = reference.rms_norm(k.reshape(n, -1, head_dim), rotary.k_norm_weight, rotary.eps)[0].view(n, -1)
    rotary_dim = rotary.cos_sin_cache.shape[-1]
    q, k = reference.rotary_embedding(rotary.positions, q, k, rotary.cos_sin_cache, head_dim, rotary_dim)
    cache = cache.clone()
    block_size = cache.shape[2]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            cache[0, slot // block_size, slot % block_size] = k[t].view(-1, head_dim)
            cache[1, slot // block_size, slot % block_size] = v[t].view(-1, head_dim)
    return q, cache


def run_fused(q, k, v, rotary, slot_mapping, cache, num_heads, num_kv_heads, head_dim):
    _, kv_store = kernels()
    return kv_store.rotary_store_kv(
        q, k, v, cache[0], cache[1], slot_mapping, rotary, num_heads, num_kv_heads, head_dim
    )


# Odd slot mappings: out of order, across blocks, the last slot of a block, a padding token (-1).
SLOTS = [37, 2, 15, 16, -1, 63]
TOLERANCE = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
             torch.float16: dict(rtol=1e-3, atol=1e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("norm", [True, False], ids=["qwen3_qk_norm", "llama"])
def test_fused_rotary_store_matches_the_unfused_torch_path(dtype, head_dim, norm):
    num_heads, num_kv_heads, block_size = 6, 2, 16  # GQA, a group of 3
    qkv, q, k, v, rotary = case(len(SLOTS), num_heads, num_kv_heads, head_dim, dtype, norm=norm)
    slot_mapping = torch.tensor(SLOTS, dtype=torch.int64, device=DEVICE)
    cache = empty_cache(5, block_size, num_kv_heads, head_dim, dtype)
    expected_q, expected_cache = torch_reference(q, k, v, rotary, slot_mapping, cache, head_dim)
    k_before, v_before = k.clone(), v.clone()

    out = run_fused(q, k, v, rotary, slot_mapping, cache, num_heads, num_kv_heads, head_dim)

    assert out.data_ptr() == q.data_ptr()  # q is rotated in place
    torch.testing.assert_close(q, expected_q, **TOLERANCE[dtype])
    torch.testing.assert_close(cache, expected_cache, **TOLERANCE[dtype])  # every slot, and zeros elsewhere
    assert torch.equal(k, k_before) and torch.equal(v, v_before)
    # The padding token wrote nothing: exactly the five real tokens' rows are filled.
    assert int((cache[0].abs().sum(dim=(-1, -2)) != 0).sum()) == 5
    assert torch.equal(cache[1].view(-1, num_kv_heads, head_dim)[SLOTS[0]], v[0].view(num_kv_heads, head_dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
def test_fused_kernel_is_bit_identical_to_the_two_kernels_it_replaces(dtype, norm):
    """The q/k norm + rotary kernel then the store kernel leave exactly the same bits."""
    rotary_kernels, kv_store = kernels()
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    qkv, q, k, v, rotary = case(len(SLOTS), num_heads, num_kv_heads, head_dim, dtype, norm=norm, seed=3)
    slot_mapping = torch.tensor(SLOTS, dtype=torch.int64, device=DEVICE)
    cache = empty_cache(4, 16, num_kv_heads, head_dim, dtype)
    qkv2 = qkv.clone()
    q2, k2, v2, _ = qkv2.split([q.shape[1], k.shape[1], v.shape[1], 8], dim=-1)
    cache2 = cache.clone()

    run_fused(q, k, v, rotary, slot_mapping, cache, num_heads, num_kv_heads, head_dim)
    qk_norm = (rotary.q_norm_weight, rotary.k_norm_weight, rotary.eps) if norm else None
    rotary_kernels.rotary_embedding(rotary.positions, q2, k2, rotary.cos_sin_cache, head_dim, head_dim, qk_norm=qk_norm)
    kv_store.store_kv(k2, v2, cache2[0], cache2[1], slot_mapping, num_kv_heads, head_dim)

    assert torch.equal(q, q2)
    assert torch.equal(cache, cache2)


def test_partial_rotary_passes_the_rest_of_each_key_head_to_the_cache():
    num_heads, num_kv_heads, head_dim = 4, 4, 64
    qkv, q, k, v, rotary = case(4, num_heads, num_kv_heads, head_dim, torch.float32, rotary_dim=32)
    slot_mapping = torch.tensor([9, 0, 31, 17], dtype=torch.int64, device=DEVICE)
    cache = empty_cache(2, 16, num_kv_heads, head_dim, torch.float32)
    expected_q, expected_cache = torch_reference(q, k, v, rotary, slot_mapping, cache, head_dim)
    run_fused(q, k, v, rotary, slot_mapping, cache, num_heads, num_kv_heads, head_dim)
    torch.testing.assert_close(q, expected_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache, expected_cache, rtol=1e-6, atol=1e-6)
    tail = cache[0].view(-1, num_kv_heads, head_dim)[9, :, 32:]
    assert torch.equal(tail, k[0].view(num_kv_heads, head_dim)[:, 32:])


def test_rows_past_the_slot_mapping_only_rotate_q():
    """A graph batch can carry more q rows than tokens with a slot: those rows rotate, store nothing."""
    num_heads, num_kv_heads, head_dim = 2, 1, 64
    qkv, q, k, v, rotary = case(3, num_heads, num_kv_heads, head_dim, torch.float32, norm=True)
    slot_mapping = torch.tensor([5], dtype=torch.int64, device=DEVICE)
    cache = empty_cache(1, 16, num_kv_heads, head_dim, torch.float32)
    expected_q, expected_cache = torch_reference(q, k, v, rotary, slot_mapping, cache, head_dim)
    run_fused(q, k, v, rotary, slot_mapping, cache, num_heads, num_kv_heads, head_dim)
    torch.testing.assert_close(q, expected_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache, expected_cache, rtol=1e-6, atol=1e-6)
    assert int((cache[0].abs().sum(dim=(-1, -2)) != 0).sum()) == 1


# ---- whole models -----------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 30)]


def engine_tokens(model_dir, backend, **kw):
    llm = LLM(str(model_dir), attention_backend=backend, dtype="float32", device=DEVICE.type,
              max_num_batched_tokens=16, **kw)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def count_calls(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_models_hand_rotary_to_the_triton_backend_with_unchanged_tokens(make_model, arch, monkeypatch):
    """Greedy tokens with the fused kernel equal those of the model's own q/k norm + rotary
    followed by the plain store, and those of the torch backend; the fused run never takes
    the plain store."""
    import pagelm.models.ops as ops

    _, kv_store = kernels()
    model_dir = make_model(f"{arch}_rotary_kv", arch)
    expected = engine_tokens(model_dir, "torch")

    fused, plain = count_calls(monkeypatch, kv_store, "rotary_store_kv"), count_calls(monkeypatch, kv_store, "store_kv")
    monkeypatch.setattr(ops, "ROTARY_KV_FUSION_DISABLED", False)
    assert engine_tokens(model_dir, "triton") == expected
    assert fused and not plain

    monkeypatch.setattr(ops, "ROTARY_KV_FUSION_DISABLED", True)
    fused.clear()
    assert engine_tokens(model_dir, "triton") == expected
    assert plain and not fused


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fused_kernel_in_a_cuda_graph_matches_the_two_kernels(dtype):
    """On CUDA: bit-identical to q/k norm + rotary then store, captured and replayed in a
    CUDA graph with new inputs written into the captured buffers."""
    rotary_kernels, kv_store = kernels()
    num_heads, num_kv_heads, head_dim = 16, 8, 128  # qwen3-0.6b's attention shape
    qkv, q, k, v, rotary = case(4, num_heads, num_kv_heads, head_dim, dtype, norm=True)
    slot_mapping = torch.tensor([40, 3, -1, 17], dtype=torch.int64, device=DEVICE)
    cache = empty_cache(4, 16, num_kv_heads, head_dim, dtype)
    source = qkv.clone()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run_fused(q, k, v, rotary, slot_mapping, cache, num_heads, num_kv_heads, head_dim)  # warm-up, compile
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_fused(q, k, v, rotary, slot_mapping, cache, num_heads, num_kv_heads, head_dim)

    for seed in (1, 2):
        new = torch.randn(source.shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)
        qkv.copy_(new)
        rotary.positions.copy_(torch.tensor([0, 99, 7, 64], device=DEVICE))
        cache.zero_()
        graph.replay()
        expected = new.clone()
        eq, ek, ev, _ = expected.split([q.shape[1], k.shape[1], v.shape[1], 8], dim=-1)
        expected_cache = torch.zeros_like(cache)
        qk_norm = (rotary.q_norm_weight, rotary.k_norm_weight, rotary.eps)
        rotary_kernels.rotary_embedding(rotary.positions, eq, ek, rotary.cos_sin_cache, head_dim, head_dim,
                                        qk_norm=qk_norm)
        kv_store.store_kv(ek, ev, expected_cache[0], expected_cache[1], slot_mapping, num_kv_heads, head_dim)
        torch.cuda.synchronize()
        assert torch.equal(q, eq)
        assert torch.equal(cache, expected_cache)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gpu_engine_with_cuda_graphs_takes_the_fused_path(make_model, arch, monkeypatch):
    """bf16 on CUDA with decode graphs: the fused kernel runs (eagerly and at capture) and
    greedy tokens equal the run that keeps q/k norm + rotary in the model."""
    import pagelm.models.ops as ops

    _, kv_store = kernels()
    model_dir = make_model(f"{arch}_rotary_kv", arch)

    def tokens():
        llm = LLM(str(model_dir), attention_backend="triton", dtype="bfloat16", device="cuda")
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    fused = count_calls(monkeypatch, kv_store, "rotary_store_kv")
    monkeypatch.setattr(ops, "ROTARY_KV_FUSION_DISABLED", False)
    with_fusion = tokens()
    assert fused
    monkeypatch.setattr(ops, "ROTARY_KV_FUSION_DISABLED", True)
    assert tokens() == with_fusion
