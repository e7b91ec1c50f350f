"""The torch reference backend is really paged: K/V scattered into shuffled blocks through
slot_mapping and read back through block tables give the same result as dense causal
attention over each sequence's contiguous K/V."""

import math

import pytest
import torch

from pagelm.attention import AttentionSpec
from pagelm.testing.conformance import paged_metadata
from pagelm.backends.torch import TorchAttentionBackend
from pagelm.backends.torch.backend import GatherBuffer


def dense_reference(q, k, v, num_heads, num_kv_heads, window=None):
    """Plain causal attention over one whole sequence; the last len(q) positions are queries."""
    L, D = k.shape[0], k.shape[-1]
    group = num_heads // num_kv_heads
    kk = k.repeat_interleave(group, dim=1)  # [L, H, D]
    vv = v.repeat_interleave(group, dim=1)
    q_pos = torch.arange(L - q.shape[0], L)
    scores = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(D)
    k_pos = torch.arange(L)
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)


def run_paged(seqs, num_heads, num_kv_heads, head_dim, block_size, window=None, seed=0):
    """seqs: list of (num_cached, num_new). Cached tokens' K/V are written first in a
    previous 'step', then the new tokens run through the backend."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    spec = AttentionSpec(num_heads, num_kv_heads, head_dim, 1 / math.sqrt(head_dim), window)
    impl = TorchAttentionBackend.make_impl(spec)
    cache = torch.zeros(TorchAttentionBackend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim))
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # blocks in shuffled order
    tables, full = [], []
    for c, n in seqs:
        nb = -(-(c + n) // block_size)
        tables.append([perm.pop() for _ in range(nb)])
        full.append(
            (
                torch.randn(c + n, num_heads, head_dim, generator=gen),
                torch.randn(c + n, num_kv_heads, head_dim, generator=gen),
                torch.randn(c + n, num_kv_heads, head_dim, generator=gen),
            )
        )
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    # One builder for both steps, as the runner has: its gather buffer carries over.
    builder = TorchAttentionBackend.make_metadata_builder(torch.device("cpu"))

    def step(ranges):
        qs, ks, vs = [], [], []
        for i, (lo, hi) in enumerate(ranges):
            q, k, v = full[i]
            qs.append(q[lo:hi]); ks.append(k[lo:hi]); vs.append(v[lo:hi])
        common = paged_metadata(block_table, ranges, block_size, torch.device("cpu"))
        qsl = common.query_start_loc_cpu.tolist()
        md = builder.build(common)
        out = impl.forward(
            torch.cat(qs).flatten(1), torch.cat(ks).flatten(1), torch.cat(vs).flatten(1), cache, md
        )
        return out.view(-1, num_heads, head_dim), qsl

    if any(c for c, _ in seqs):
        step([(0, c) for c, _ in seqs])
    out, qsl = step([(c, c + n) for c, n in seqs])
    for i, (c, n) in enumerate(seqs):
        q, k, v = full[i]
        ref = dense_reference(q[c:], k, v, num_heads, num_kv_heads, window)
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefill_batch_of_mixed_lengths(block_size):
    run_paged([(0, 1), (0, 7), (0, 33)], num_heads=4, num_kv_heads=4, head_dim=16, block_size=block_size)


def test_decode_over_cached_context_with_gqa():
    run_paged([(16, 1), (31, 1), (5, 1)], num_heads=8, num_kv_heads=2, head_dim=32, block_size=4)


def test_chunked_prefill_over_cached_prefix_mixed_with_decode():
    run_paged([(20, 9), (0, 12), (40, 1)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8)


def test_sliding_window_masks_old_keys():
    run_paged([(12, 5), (0, 20)], num_heads=4, num_kv_heads=1, head_dim=16, block_size=4, window=6)


def test_block_boundary_lengths():
    run_paged([(15, 1), (16, 1), (0, 16), (0, 17)], num_heads=2, num_kv_heads=1, head_dim=8, block_size=16)


def test_verification_rows_batch_with_decodes_padded_to_the_longest():
    """Rows of a few tokens after a cached prefix (a speculative verification's 1 + k) are
    batched with the decode rows, each padded to the longest; longer ones stay prefill rows."""
    seqs = [(20, 4), (7, 2), (33, 4), (5, 1), (0, 9), (9, 3), (12, 9)]
    run_paged(seqs, num_heads=8, num_kv_heads=2, head_dim=16, block_size=4)
    run_paged([(20, 4), (7, 4), (1, 4)], num_heads=4, num_kv_heads=4, head_dim=8, block_size=16)  # no padding rows
    run_paged([(12, 5), (3, 2), (30, 4), (6, 1)], num_heads=4, num_kv_heads=1, head_dim=16, block_size=4, window=5)


def test_short_rows_go_to_the_batched_path():
    from pagelm.backends.torch.backend import SHORT_QUERY_LEN
    from pagelm.testing.conformance import paged_metadata

    table = torch.arange(40, dtype=torch.int32).view(4, 10)
    ranges = [(20, 24), (7, 9), (0, 5), (30, 30 + SHORT_QUERY_LEN + 1)]
    md = TorchAttentionBackend.make_metadata_builder(torch.device("cpu")).build(paged_metadata(table, ranges, 4, torch.device("cpu")))
    assert md.decode.query_len == 4 and md.decode.query_pos.tolist() == [[20, 21, 22, 23], [7, 8, 8, 8]]
    assert md.decode.real_rows.tolist() == [0, 1, 2, 3, 4, 5]
    assert [(p.start, p.end) for p in md.prefills] == [(6, 11), (11, 11 + SHORT_QUERY_LEN + 1)]


def test_sliding_window_in_decode_rows():
    run_paged([(12, 1), (3, 1), (30, 1), (0, 9)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, window=5)


@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_batches(seed):
    """Decodes, fresh prompts and chunks after a cached prefix in one step, in random order
    (the backend batches the decodes and loops over the rest)."""
    rng = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(int(torch.randint(1, 9, (1,), generator=rng))):
        kind = int(torch.randint(0, 3, (1,), generator=rng))
        cached = int(torch.randint(1, 40, (1,), generator=rng))
        new = int(torch.randint(2, 20, (1,), generator=rng))
        rows.append([(cached, 1), (0, new), (cached, new)][kind])
    window = [None, 7][seed % 2]
    run_paged(rows, num_heads=6, num_kv_heads=2, head_dim=8, block_size=4, window=window, seed=seed)


def test_gather_buffer_grows_and_is_reused():
    buffer = GatherBuffer()
    like = torch.zeros(1)
    small = buffer.take((2, 3, 4), like)
    assert small.shape == (2, 3, 4) and small.is_contiguous()
    # A smaller or equal request is a view of the same memory; a larger one reallocates.
    again = buffer.take((4, 5), like)
    assert again.data_ptr() == small.data_ptr() and again.shape == (4, 5)
    big = buffer.take((10, 10), like)
    assert big.numel() == 100 and big.data_ptr() != small.data_ptr()
    assert buffer.take((2, 3, 4), like).data_ptr() == big.data_ptr()
    # Another dtype gets a buffer of its own dtype.
    assert buffer.take((3,), torch.zeros(1, dtype=torch.float64)).dtype == torch.float64


def test_kv_cache_keeps_heads_outermost():
    """A head's block is one contiguous [block_size, head_dim] tile: what the gather relies on
    to hand attention each (request, head)'s keys as one matrix."""
    assert TorchAttentionBackend.get_kv_cache_shape(10, 16, 2, 64) == (2, 2, 10, 16, 64)
    cache = torch.zeros(TorchAttentionBackend.get_kv_cache_shape(3, 4, 2, 8))
    spec = AttentionSpec(2, 2, 8, 1.0, None)
    impl = TorchAttentionBackend.make_impl(spec)
    common = paged_metadata(torch.tensor([[2]], dtype=torch.int32), [(0, 1)], 4, torch.device("cpu"))
    k = torch.arange(16.0).view(1, 16)
    impl.forward(torch.zeros(1, 16), k, -k, cache, TorchAttentionBackend.make_metadata_builder(torch.device("cpu")).build(common))
    # Slot 8 = block 2, offset 0; head h's key is k[h * 8 : (h + 1) * 8].
    assert torch.equal(cache[0, :, 2, 0], k.view(2, 8)) and torch.equal(cache[1, :, 2, 0], -k.view(2, 8))
    assert cache.count_nonzero() == 30  # nothing else written (k[0] is 0 in both)

