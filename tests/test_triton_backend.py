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
    shape = TorchAttentionBackend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    assert TritonAttentionBackend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim) == shape

    builder = TritonAttentionBackend.make_metadata_builder(DEVICE)
    if min_tokens_per_split is not None:
        builder.min_tokens_per_split = min_tokens_per_split
    runs = {
        "triton": (
            TritonAttentionBackend.make_impl(spec), builder, torch.zeros(shape, dtype=dtype, device=DEVICE)
        ),
        "torch": (
            TorchAttentionBackend.make_impl(spec),
            TorchAttentionBackend.make_metadata_builder(DEVICE),
            torch.zeros(shape, dtype=dtype, device=DEVICE),
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
    # unused ones are zero in both).
    torch.testing.assert_close(runs["triton"][2], runs["torch"][2], atol=0, rtol=0)
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


def test_engine_greedy_tokens_match_with_sliding_window(make_model):
    model_dir = make_model("mistral_window8", "mistral", sliding_window=8)
    assert engine_tokens(model_dir, "triton") == engine_tokens(model_dir, "torch")
