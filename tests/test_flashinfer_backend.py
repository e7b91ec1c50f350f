"""The flashinfer backend without a GPU: registration, the start-up errors and ``auto``'s
fallback, the host-side page tables, and the whole backend (planning, decode/prefill split,
cascade, CUDA-graph re-planning, the engine) against the torch reference, with a stand-in for
FlashInfer (``fake_flashinfer.py``: 0.5.3's signatures, torch math). The real kernels are
checked on the GPU in ``test_flashinfer_gpu.py``, through the same harness (``run_against_torch``).
"""

import logging
import math
import sys

import numpy as np
import pytest
import torch

import fake_flashinfer
from pagelm import LLM, SamplingParams
from pagelm.attention import AttentionSpec, CommonAttentionMetadata, GraphSupport
from pagelm.attention.selector import select_attention_backend
from pagelm.backends.flashinfer import FlashInferAttentionBackend
from pagelm.backends.flashinfer import backend as fi_backend
from pagelm.backends.flashinfer.layout import common_prefix_blocks, padded_decode_table, page_table, step_layout
from pagelm.backends.torch import TorchAttentionBackend
from pagelm.testing.conformance import paged_metadata
from pagelm.config import EngineConfig
from pagelm.plugin_manager import get_plugin_manager

CONFIG = EngineConfig(model="(test)", attention_backend="flashinfer")
LLAMA_8B = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, scale=1 / math.sqrt(128))


@pytest.fixture
def fake_fi(monkeypatch):
    """FlashInfer's stand-in as the ``flashinfer`` module, and the backend believing it is installed."""
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    monkeypatch.setattr(fi_backend, "flashinfer_installed", lambda: True)
    return fake_flashinfer


# =============================================================================================
# the harness (also used by test_flashinfer_gpu.py)
# =============================================================================================


def run_against_torch(seqs, num_heads, num_kv_heads, head_dim, block_size, *, dtype=torch.float32, device="cpu",
                      window=None, shared_blocks=0, cascade=None, host_block_table=True, seed=0):
    """seqs: (num_cached, num_new) per request. Both backends store the cached tokens' K/V in a
    first step and run the new tokens in a second, on shuffled blocks; returns the flashinfer
    and torch outputs of the second step and flashinfer's metadata and builder.

    The first ``shared_blocks`` blocks of every request are the same physical blocks holding
    the same K/V (a prefix-cache hit); with ``cascade`` (default: when there are shared
    blocks) the builder's cascade threshold is ``shared_blocks``, so it finds them itself."""
    device = torch.device(device)
    cascade = bool(shared_blocks) if cascade is None else cascade
    shared_tokens = shared_blocks * block_size
    assert all(c >= shared_tokens for c, _ in seqs), "the shared prefix must be cached"
    gen = torch.Generator().manual_seed(seed)
    private = [-(-(c + n) // block_size) - shared_blocks for c, n in seqs]
    num_blocks = shared_blocks + sum(private) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shared = [perm.pop() for _ in range(shared_blocks)]
    tables = [shared + [perm.pop() for _ in range(p)] for p in private]
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    # Queries only for the second step's tokens (the first step's output is not compared).
    qkv = [
        [torch.randn(n if h == num_heads else c + n, h, head_dim, generator=gen)
         for h in (num_heads, num_kv_heads, num_kv_heads)]
        for c, n in seqs
    ]
    for _, k, v in qkv[1:]:  # the shared prefix holds one set of keys and values
        k[:shared_tokens], v[:shared_tokens] = qkv[0][1][:shared_tokens], qkv[0][2][:shared_tokens]
    spec = AttentionSpec(num_heads, num_kv_heads, head_dim, 1 / math.sqrt(head_dim), window)

    fi_builder = FlashInferAttentionBackend.make_metadata_builder(device)
    if device.type == "cpu":
        fi_builder.workspace_bytes = 1 << 16
    fi_builder.bind_layers([spec], dtype)
    fi_builder.cascade_min_blocks = shared_blocks if cascade else 0
    runs = {}
    for name, backend, builder in (
        ("flashinfer", FlashInferAttentionBackend, fi_builder),
        ("torch", TorchAttentionBackend, TorchAttentionBackend.make_metadata_builder(device)),
    ):
        shape = backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        runs[name] = (backend.make_impl(spec), builder, torch.zeros(shape, dtype=dtype, device=device))

    def step(ranges, queries=True):
        """One forward over (request, first position, end position) ranges (zero queries
        when ``queries`` is False: the first step only fills the caches)."""
        rows = block_table[[i for i, _, _ in ranges]]
        common = paged_metadata(
            rows, [(lo, hi) for _, lo, hi in ranges], block_size, device,
            block_table_cpu=rows if host_block_table else None,
        )
        k, v = (torch.cat([qkv[i][j][lo:hi] for i, lo, hi in ranges]).flatten(1).to(device, dtype) for j in (1, 2))
        if queries:
            q = torch.cat([qkv[i][0] for i, _, _ in ranges]).flatten(1).to(device, dtype)
        else:
            q = torch.zeros(common.num_actual_tokens, num_heads * head_dim, device=device, dtype=dtype)
        outs, mds = {}, {}
        for name, (impl, builder, cache) in runs.items():
            mds[name] = builder.build(common)
            outs[name] = impl.forward(q, k, v, cache, mds[name]).view(-1, num_heads, head_dim)
        return outs, mds

    cached = [(i, 0, c) for i, (c, _) in enumerate(seqs) if c]
    if cached:
        step(cached, queries=False)
    outs, mds = step([(i, c, c + n) for i, (c, n) in enumerate(seqs)])
    return outs["flashinfer"], outs["torch"], mds["flashinfer"], fi_builder


def assert_matches(seqs, num_heads, num_kv_heads, head_dim, block_size, **kw):
    out, ref, md, builder = run_against_torch(seqs, num_heads, num_kv_heads, head_dim, block_size, **kw)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    return md, builder


# =============================================================================================
# registration, validation, selection (no GPU, no flashinfer)
# =============================================================================================


def test_registered_through_the_builtin_entry_point():
    pm = get_plugin_manager()
    assert pm.collect("attention backend").get("flashinfer") is FlashInferAttentionBackend
    assert pm.loaded["flashinfer_attention"].builtin


def test_selecting_flashinfer_without_a_gpu_is_a_clear_startup_error(llama_dir, monkeypatch):
    monkeypatch.setattr(fi_backend, "flashinfer_installed", lambda: False)
    with pytest.raises(ValueError) as err:
        LLM(str(llama_dir), attention_backend="flashinfer", device="cpu")
    msg = str(err.value)
    assert msg.startswith("attention_backend='flashinfer': ")
    assert "does not run on cpu" in msg and "needs an NVIDIA GPU of compute capability 8.0+" in msg
    assert "pip install 'pagelm[flashinfer]'" in msg


def test_missing_package_names_the_extra_to_install(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(fi_backend, "flashinfer_installed", lambda: False)
    assert FlashInferAttentionBackend.validate(CONFIG, LLAMA_8B, torch.bfloat16, cuda) == [
        "attention backend 'flashinfer' needs the flashinfer package: pip install 'pagelm[flashinfer]'"
    ]
    monkeypatch.setattr(fi_backend, "flashinfer_installed", lambda: True)
    assert FlashInferAttentionBackend.validate(CONFIG, LLAMA_8B, torch.float16, cuda) == []


def test_float32_and_unsupported_head_sizes_are_rejected(monkeypatch):
    monkeypatch.setattr(fi_backend, "flashinfer_installed", lambda: True)
    cuda = torch.device("cuda")
    problems = FlashInferAttentionBackend.validate(CONFIG, LLAMA_8B, torch.float32, cuda)
    assert problems == ["attention backend 'flashinfer' does not support dtype torch.float32"]
    odd = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=80, scale=0.1)
    (problem,) = FlashInferAttentionBackend.validate(CONFIG, odd, torch.bfloat16, cuda)
    assert "supports head sizes (64, 128, 256), the model has 80" in problem


def test_gpus_older_than_ampere_are_rejected(monkeypatch):
    monkeypatch.setattr(fi_backend, "flashinfer_installed", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    (problem,) = FlashInferAttentionBackend.validate(CONFIG, LLAMA_8B, torch.float16, torch.device("cuda"))
    assert problem == "attention backend 'flashinfer' needs compute capability 8.0+, Tesla T4 has 7.5"


def test_graph_safety_is_declared_and_the_cache_is_flashinfers_nhd_layout():
    assert FlashInferAttentionBackend.graph_support == GraphSupport.DECODE_ONLY
    assert FlashInferAttentionBackend.get_kv_cache_shape(10, 16, 8, 128) == (10, 2, 16, 8, 128)


def _auto(device: str, dtype=torch.bfloat16):
    config = EngineConfig(model="(test)")
    return select_attention_backend(
        config, get_plugin_manager().collect("attention backend"), LLAMA_8B, dtype, torch.device(device)
    )


def test_auto_on_cpu_picks_torch_and_logs_it(caplog):
    with caplog.at_level(logging.INFO, logger="pagelm"):
        assert _auto("cpu").name == "torch"
    assert "attention_backend=auto: using 'torch' on cpu" in caplog.text


def test_auto_on_cuda_prefers_triton_then_flashinfer(monkeypatch, caplog):
    pytest.importorskip("triton")
    monkeypatch.setattr(fi_backend, "flashinfer_installed", lambda: True)
    with caplog.at_level(logging.INFO, logger="pagelm"):
        assert _auto("cuda").name == "triton"
    assert "using 'triton' on cuda" in caplog.text
    monkeypatch.setattr(fi_backend.FlashInferAttentionBackend, "auto_priority", {"cuda": 400})
    assert _auto("cuda").name == "flashinfer"
    assert _auto("cuda", torch.float32).name == "triton"  # FlashInfer has no float32 kernels


def test_cascade_threshold_is_the_backends_own_setting_and_is_validated():
    import argparse

    from pagelm.plugins.engine_args import add_engine_args, engine_kwargs

    spec = AttentionSpec(4, 2, 64, 0.125)
    for bad in (-1, 1.5, "4", True):
        problems = FlashInferAttentionBackend.validate(cascade_config(bad), spec, torch.float16, torch.device("cpu"))
        assert any(p.startswith("plugin_config['flashinfer']['cascade_attention_min_blocks'] must be an integer >= 0")
                   for p in problems), (bad, problems)
    ok = FlashInferAttentionBackend.validate(cascade_config(4), spec, torch.float16, torch.device("cpu"))
    assert not any("cascade" in p for p in ok)
    builder = FlashInferAttentionBackend.make_metadata_builder(torch.device("cpu"))
    assert builder.cascade_min_blocks == 0  # off by default
    builder.configure(EngineConfig(model="m"))
    assert builder.cascade_min_blocks == 0
    builder.configure(cascade_config(4))
    assert builder.cascade_min_blocks == 4
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        ["--plugin-config", '{"flashinfer": {"cascade_attention_min_blocks": 4}}', "--attention-backend", "flashinfer"]
    )
    kwargs = engine_kwargs(args)
    assert kwargs["plugin_config"] == {"flashinfer": {"cascade_attention_min_blocks": 4}}


# =============================================================================================
# host-side layout
# =============================================================================================


def test_page_table_lists_each_rows_blocks_and_last_page_fill():
    table = np.array([[7, 3, 9], [5, 0, 0], [2, 8, 0]], dtype=np.int32)
    pt = page_table(table, np.array([9, 4, 8]), block_size=4)
    assert pt.indptr.tolist() == [0, 3, 4, 6]
    assert pt.indices.tolist() == [7, 3, 9, 5, 2, 8]
    assert pt.last_page_len.tolist() == [1, 4, 4]
    assert pt.indptr.dtype == pt.indices.dtype == pt.last_page_len.dtype == np.int32


def test_leading_decodes_go_to_the_decode_wrapper_and_the_rest_to_prefill():
    table = np.array([[1, 2], [3, 0], [4, 5], [6, 0]], dtype=np.int32)
    # r0, r1 decode; r2 a chunk of 3 over 2 cached; r3 a decode after a prefill -> prefill wrapper
    layout = step_layout(np.array([0, 1, 2, 5, 6]), np.array([6, 1, 5, 2]), table, block_size=4)
    assert layout.num_decodes == layout.num_decode_tokens == 2
    assert layout.decode.indices.tolist() == [1, 2, 3] and layout.decode.last_page_len.tolist() == [2, 1]
    assert layout.prefill_qo_indptr.tolist() == [0, 3, 4]
    assert layout.prefill.indptr.tolist() == [0, 2, 3] and layout.prefill.indices.tolist() == [4, 5, 6]
    assert layout.shared is None


def test_cascade_layout_moves_the_common_blocks_to_one_shared_row():
    table = np.array([[9, 8, 1, 2], [9, 8, 3, 0], [9, 8, 4, 5]], dtype=np.int32)
    layout = step_layout(np.array([0, 1, 2, 3]), np.array([13, 10, 15]), table, block_size=4,
                         num_common_prefix_blocks=2)
    assert layout.shared.indptr.tolist() == [0, 2] and layout.shared.indices.tolist() == [9, 8]
    assert layout.shared.last_page_len.tolist() == [4]
    # what is left after 8 shared tokens: 5, 2 and 7 tokens
    assert layout.decode.indices.tolist() == [1, 2, 3, 4, 5]
    assert layout.decode.indptr.tolist() == [0, 2, 3, 5] and layout.decode.last_page_len.tolist() == [1, 2, 3]


def test_graph_padding_rows_attend_one_key_in_block_zero():
    table = np.array([[7, 3], [5, 0]], dtype=np.int32)
    pt = padded_decode_table(table, np.array([6, 2, 1, 1]), block_size=4, num_padded=4)
    assert pt.indptr.tolist() == [0, 2, 3, 4, 5]
    assert pt.indices.tolist() == [7, 3, 5, 0, 0]
    assert pt.last_page_len.tolist() == [2, 2, 1, 1]


def test_common_prefix_counts_identical_cached_leading_blocks():
    table = np.array([[4, 5, 6, 7, 1], [4, 5, 6, 9, 2], [4, 5, 6, 7, 3]], dtype=np.int32)
    # 3 identical columns, all cached (>= 12 tokens computed by every request)
    assert common_prefix_blocks(table, np.array([17, 13, 20]), block_size=4, min_blocks=2) == 3
    # a request that has computed only 9 tokens: block 2 is not cached for it yet
    assert common_prefix_blocks(table, np.array([17, 9, 20]), block_size=4, min_blocks=2) == 2
    assert common_prefix_blocks(table, np.array([17, 9, 20]), block_size=4, min_blocks=3) == 0  # below N
    assert common_prefix_blocks(table, np.array([17, 13, 20]), block_size=4, min_blocks=0) == 0  # off
    assert common_prefix_blocks(table[:1], np.array([17]), block_size=4, min_blocks=1) == 0  # one request


# =============================================================================================
# the backend against the torch reference (FlashInfer's stand-in)
# =============================================================================================


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_batch(fake_fi, block_size):
    md, _ = assert_matches([(0, 1), (0, 7), (0, 33)], 4, 2, 64, block_size)
    assert md.num_decode_tokens == 1  # a one-token prompt at the front is a decode


def test_decode_batch_with_gqa_uses_tensor_cores(fake_fi):
    md, builder = assert_matches([(16, 1), (31, 1), (5, 1), (47, 1)], 8, 2, 64, 16)
    (group,) = builder.groups.values()
    assert group.use_tensor_cores and group.decode.use_tensor_cores
    assert md.num_decode_tokens == 4 and md.plans[group.spec].prefill is None


def test_chunked_prefill_over_a_cached_prefix_mixed_with_decodes(fake_fi):
    assert_matches([(40, 1), (7, 1), (20, 9), (0, 12), (33, 3)], 4, 1, 64, 8)


def test_a_decode_after_a_prefill_goes_through_the_prefill_wrapper(fake_fi):
    md, _ = assert_matches([(20, 9), (40, 1)], 4, 2, 64, 8)
    assert md.num_decode_tokens == 0


@pytest.mark.parametrize("block_size", [4, 16])
def test_block_boundary_lengths(fake_fi, block_size):
    b = block_size
    assert_matches([(b - 1, 1), (b, 1), (0, b), (0, b + 1), (b - 1, 2)], 2, 1, 64, b)


def test_sliding_window(fake_fi):
    assert_matches([(45, 1), (30, 5), (0, 20)], 2, 1, 64, 16, window=6)


def test_without_a_host_block_table_the_device_table_is_read(fake_fi):
    assert_matches([(16, 1), (20, 9)], 4, 2, 64, 8, host_block_table=False)


def test_cascade_over_a_shared_prefix_equals_attention_over_whole_sequences(fake_fi):
    md, builder = assert_matches([(37, 1), (40, 1), (33, 1), (52, 1)], 4, 2, 64, 8, shared_blocks=4)
    assert md.cascade and builder.num_cascade_steps == 1


def test_cascade_with_decodes_and_a_chunk(fake_fi):
    md, _ = assert_matches([(37, 1), (33, 1), (40, 6), (35, 2)], 4, 2, 64, 8, shared_blocks=4)
    assert md.cascade and md.num_decode_tokens == 2


def test_cascade_is_off_with_a_sliding_window(fake_fi):
    md, builder = assert_matches([(37, 1), (40, 1)], 4, 2, 64, 8, shared_blocks=4, window=16)
    assert not md.cascade and builder.num_cascade_steps == 0


def test_plan_runs_once_per_step_not_per_layer(fake_fi):
    spec = AttentionSpec(4, 2, 64, 0.125)
    other = AttentionSpec(4, 2, 64, 0.125, sliding_window=8)
    builder = FlashInferAttentionBackend.make_metadata_builder(torch.device("cpu"))
    builder.workspace_bytes = 1 << 16
    builder.bind_layers([spec, other, spec, other], torch.float32)
    assert len(builder.groups) == 2  # one set of wrappers per layer shape
    workspaces = {id(g.workspace) for g in builder.groups.values()}
    assert workspaces == {id(builder.workspace)}  # allocated once, shared
    builder.bind_layers([spec, other], torch.float32)  # the runner binds again after profiling
    assert {id(g.workspace) for g in builder.groups.values()} == workspaces
    _, _, common = _decode_step(num_reqs=3, block_size=4)
    md = builder.build(common)
    cache = torch.zeros(FlashInferAttentionBackend.get_kv_cache_shape(64, 4, 2, 64))
    for _ in range(3):  # three layers of each shape
        for s in (spec, other):
            q, kv = torch.randn(3, 4 * 64), torch.randn(3, 2 * 64)
            FlashInferAttentionBackend.make_impl(s).forward(q, kv, kv, cache, md)
    for g in builder.groups.values():
        assert g.decode.num_plans == 1 and g.prefill.num_plans == 0


def _decode_step(num_reqs, block_size, seq_lens=None, num_padded=None):
    """A decode step's common metadata over blocks 1.. (padded rows: seq_len 1, slot -1)."""
    size = num_padded or num_reqs
    seq_lens = seq_lens or [5 + 3 * i for i in range(num_reqs)]
    width = 8
    table = torch.arange(1, 1 + size * width, dtype=torch.int32).view(size, width) % 64
    lens = torch.tensor(list(seq_lens) + [1] * (size - num_reqs), dtype=torch.int32)
    pos = (lens - 1).long()
    slots = table[torch.arange(size), pos // block_size].long() * block_size + pos % block_size
    slots[num_reqs:] = -1
    qsl = torch.arange(size + 1, dtype=torch.int32)
    common = CommonAttentionMetadata(
        num_reqs=size, num_actual_tokens=size, max_query_len=1, max_seq_len=int(lens.max()), query_start_loc=qsl,
        seq_lens=lens, block_table=table, slot_mapping=slots, query_start_loc_cpu=qsl, seq_lens_cpu=lens,
        block_size=block_size, block_table_cpu=table[:num_reqs],
    )
    return table, lens, common


def _capture_common(size, block_size, slot_buffer=None):
    """What the runner hands ``build_for_cudagraph``: padding rows only."""
    return CommonAttentionMetadata(
        num_reqs=size, num_actual_tokens=size, max_query_len=1, max_seq_len=64,
        query_start_loc=torch.arange(size + 1), seq_lens=torch.ones(size, dtype=torch.int32),
        block_table=torch.zeros(size, 8, dtype=torch.int32),
        slot_mapping=torch.full((size,), -1) if slot_buffer is None else slot_buffer,
        query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32), seq_lens_cpu=torch.ones(size, dtype=torch.int32),
        block_size=block_size,
    )


def test_graph_replay_reads_the_plan_made_before_it(fake_fi):
    """Capture plans size 4 on dummy rows; before a 'replay' (the captured metadata run again)
    the builder re-plans the graph wrapper's fixed buffers with the real, padded batch."""
    spec, bs = AttentionSpec(8, 2, 64, 0.125), 4
    builder = FlashInferAttentionBackend.make_metadata_builder(torch.device("cpu"))
    builder.workspace_bytes = 1 << 16
    builder.bind_layers([spec], torch.float32)
    slot_buffer = torch.full((4,), -1)  # the runner's persistent buffer, refilled before each replay
    captured = builder.build_for_cudagraph(_capture_common(4, bs, slot_buffer))
    (group,) = builder.groups.values()
    wrapper = group.graph_decode[4]
    assert wrapper.is_cuda_graph_enabled and captured.plans[spec].decode is wrapper

    impl, ref_impl = FlashInferAttentionBackend.make_impl(spec), TorchAttentionBackend.make_impl(spec)
    cache = torch.randn(FlashInferAttentionBackend.get_kv_cache_shape(64, bs, 2, 64))
    ref_cache = cache.permute(1, 3, 0, 2, 4).contiguous()  # the torch backend's [2, kv_heads, blocks, ...] layout
    for seq_lens in ([9, 22, 5], [30, 1, 17]):
        table, lens, common = _decode_step(3, bs, seq_lens, num_padded=4)
        slot_buffer.copy_(common.slot_mapping)
        assert builder.prepare_cudagraph_replay(common, num_reqs=3)
        q, kv = torch.randn(4, 8 * 64), torch.randn(4, 2 * 64)
        got = impl.forward(q, kv, kv, cache, captured)[:3]
        ref_common = _decode_step(3, bs, seq_lens)[2]
        ref_md = TorchAttentionBackend.make_metadata_builder(None).build(ref_common)
        want = ref_impl.forward(q[:3], kv[:3], kv[:3], ref_cache, ref_md)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert builder.num_graph_plans == 3  # capture + two replays


def _shared_prefix_step(block_size, seq_lens, num_padded, shared_blocks=2):
    """Decode rows whose first ``shared_blocks`` blocks are the same (5, 6, ...), then their
    own."""
    size, num_reqs, width = num_padded, len(seq_lens), 8
    table = torch.zeros(size, width, dtype=torch.int32)
    for i in range(num_reqs):
        own = [20 + 8 * i + j for j in range(width - shared_blocks)]
        table[i] = torch.tensor([5 + j for j in range(shared_blocks)] + own)
    lens = torch.tensor(list(seq_lens) + [1] * (size - num_reqs), dtype=torch.int32)
    pos = (lens - 1).long()
    slots = table[torch.arange(size), pos // block_size].long() * block_size + pos % block_size
    slots[num_reqs:] = -1
    qsl = torch.arange(size + 1, dtype=torch.int32)
    return CommonAttentionMetadata(
        num_reqs=size, num_actual_tokens=size, max_query_len=1, max_seq_len=int(lens.max()), query_start_loc=qsl,
        seq_lens=lens, block_table=table, slot_mapping=slots, query_start_loc_cpu=qsl, seq_lens_cpu=lens,
        block_size=block_size, block_table_cpu=table[:num_reqs],
    )


def cascade_config(min_blocks):
    return EngineConfig(model="m", plugin_config={"flashinfer": {"cascade_attention_min_blocks": min_blocks}})


def test_cascade_graph_variant_replays_a_shared_prefix_batch(fake_fi):
    """With cascade on, each size gets a "cascade" graph beside the plain one: a decode batch
    over a common prefix replays it (shared level over the prefix + each request's own pages,
    merged) and equals attention over the whole sequences; a batch without one replays the
    plain graph."""
    spec, bs = AttentionSpec(8, 2, 64, 0.125), 4
    builder = FlashInferAttentionBackend.make_metadata_builder(torch.device("cpu"))
    builder.workspace_bytes = 1 << 16
    builder.bind_layers([spec], torch.float32)
    builder.configure(cascade_config(0))
    assert builder.cudagraph_variants(cascade_config(0)) == ("",)
    builder.configure(cascade_config(2))
    assert builder.cudagraph_variants(cascade_config(2)) == ("", "cascade")
    slot_buffer = torch.full((4,), -1)
    builder.build_for_cudagraph(_capture_common(4, bs, slot_buffer))
    captured = builder.build_for_cudagraph(_capture_common(4, bs, slot_buffer), variant="cascade")
    (group,) = builder.groups.values()
    assert captured.plans[spec].shared is group.graph_shared[4] and group.graph_shared[4].is_cuda_graph_enabled

    impl, ref_impl = FlashInferAttentionBackend.make_impl(spec), TorchAttentionBackend.make_impl(spec)
    cache = torch.randn(FlashInferAttentionBackend.get_kv_cache_shape(64, bs, 2, 64))
    ref_cache = cache.permute(1, 3, 0, 2, 4).contiguous()
    for seq_lens in ([13, 10, 15], [9, 22, 12]):
        common = _shared_prefix_step(bs, seq_lens, num_padded=4)  # the builder finds the 2 shared blocks
        slot_buffer.copy_(common.slot_mapping)
        assert builder.prepare_cudagraph_replay(common, num_reqs=3) == "cascade"
        q, kv = torch.randn(4, 8 * 64), torch.randn(4, 2 * 64)
        got = impl.forward(q, kv, kv, cache, captured)[:3]
        ref_common = _shared_prefix_step(bs, seq_lens, num_padded=3)
        want = ref_impl.forward(q[:3], kv[:3], kv[:3], ref_cache, TorchAttentionBackend.make_metadata_builder(None).build(ref_common))
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert builder.num_cascade_steps == 2
    _, _, no_prefix = _decode_step(3, bs, num_padded=4)
    assert builder.prepare_cudagraph_replay(no_prefix, num_reqs=3) is True


def test_a_batch_declines_the_graph_for_cascade_when_the_prefix_is_worth_it(fake_fi):
    builder = FlashInferAttentionBackend.make_metadata_builder(torch.device("cpu"))
    builder.workspace_bytes = 1 << 16
    builder.bind_layers([AttentionSpec(8, 2, 64, 0.125)] * 3, torch.float32)  # 3 layers
    assert builder.kv_bytes_per_token == 3 * 2 * 2 * 64 * 4
    builder.configure(cascade_config(1))
    builder.build_for_cudagraph(_capture_common(4, 4))
    common = _shared_prefix_step(4, [5, 8, 11], num_padded=4, shared_blocks=1)  # 1 common block
    # cascade would spare 2 requests x 4 tokens x 3 KiB: not worth giving up the graph...
    builder.cascade_graph_min_saved_bytes = 2 * 4 * 3072 + 1
    assert builder.prepare_cudagraph_replay(common, num_reqs=3) is True
    builder.cascade_graph_min_saved_bytes = 2 * 4 * 3072  # ...unless that is enough
    assert builder.prepare_cudagraph_replay(common, num_reqs=3) is False


# =============================================================================================
# the whole engine on the stand-in
# =============================================================================================


@pytest.fixture
def engine_fi(fake_fi, monkeypatch):
    """Let the engine select flashinfer on the CPU (validate would refuse it there)."""
    monkeypatch.setattr(FlashInferAttentionBackend, "validate", classmethod(lambda cls, *a: []))
    monkeypatch.setattr(fi_backend.FlashInferMetadataBuilder, "workspace_bytes", 1 << 16)


def _tokens(model_dir, backend, prompts, **kw):
    llm = LLM(str(model_dir), attention_backend=backend, device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=64, seed=0, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.engine.core.runner.metadata_builder


def test_engine_greedy_tokens_equal_the_reference_with_and_without_cascade(make_model, engine_fi):
    model_dir = make_model("fi_llama", "llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    system = list(range(5, 45))  # 40 tokens = 10 shared blocks
    prompts = [{"prompt_token_ids": system + [50 + 7 * i + j for j in range(3 + i)]} for i in range(6)]
    want, _ = _tokens(model_dir, "torch", prompts)
    got, builder = _tokens(model_dir, "flashinfer", prompts, plugin_config=cascade_config(4).plugin_config)
    assert got == want
    assert builder.num_cascade_steps > 0  # the decodes over the system prompt ran as cascade
    got_off, builder_off = _tokens(model_dir, "flashinfer", prompts)
    assert got_off == want and builder_off.num_cascade_steps == 0


def test_engine_greedy_tokens_equal_the_reference_when_the_model_hands_over_qk_norm_and_rotary(
    make_model, engine_fi, monkeypatch
):
    """Qwen3's q/k norm and rotary go to the backend's K/V store (``rotary=``), not the model
    (the default; ``PAGELM_ROTARY_KV_FUSION=0`` turns it off, so the test sets it on)."""
    from pagelm.models import ops

    monkeypatch.setattr(ops, "ROTARY_KV_FUSION_DISABLED", False)
    model_dir = make_model("fi_qwen3", "qwen3", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    prompts = [{"prompt_token_ids": [5 + 3 * i + j for j in range(4 + 5 * i)]} for i in range(3)]
    want, _ = _tokens(model_dir, "torch", prompts)
    handed_over = []
    rotary_store_kv = fi_backend.rotary_store_kv
    monkeypatch.setattr(fi_backend, "rotary_store_kv", lambda *a: handed_over.append(1) or rotary_store_kv(*a))
    got, _ = _tokens(model_dir, "flashinfer", prompts)
    assert got == want and handed_over


# =============================================================================================
# the shared-prefix benchmark workload
# =============================================================================================


def test_shared_prefix_workload_is_one_system_prompt_and_unique_suffixes():
    from pagelm.plugins.bench.workload import TokenWorkload

    w = TokenWorkload.shared_prefix(num_seqs=5, prefix_len=32, suffix_len=8, output_len=4, vocab_size=500, seed=0)
    assert [len(p) for p in w.prompt_token_ids] == [40] * 5 and w.output_lens == [4] * 5
    assert len({tuple(p[:32]) for p in w.prompt_token_ids}) == 1
    assert len({tuple(p[32:]) for p in w.prompt_token_ids}) == 5
    assert max(max(p) for p in w.prompt_token_ids) < 500


def test_throughput_bench_runs_the_shared_prefix_workload(llama_dir, tmp_path):
    import json

    from pagelm.cli import main

    out = tmp_path / "throughput.json"
    rc = main([
        "bench", "throughput", "--model", str(llama_dir), "--workload", "shared-prefix", "--num-seqs", "4",
        "--prefix-len", "32", "--input-len", "8", "--output-len", "5",
        "--plugin-config", '{"flashinfer": {"cascade_attention_min_blocks": 0}}',
        "--json", str(out),
    ])
    assert rc == 0
    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert report["workload"] == "shared-prefix" and report["engine_args"]["plugin_config"] == cascade_config(0).plugin_config
    assert (result["num_requests"], result["prompt_tokens"], result["output_tokens"]) == (4, 160, 20)
