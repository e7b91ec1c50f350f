"""The fused-op kernels (RMSNorm + residual, rotary, SiLU-and-mul) give their torch references'
results: bit for bit in bf16/fp16 and where float32 math allows, within 2 ulp elsewhere.

Without CUDA the kernels run on the CPU under Triton's interpreter, set up for this module
only before the kernel modules are first imported; shapes stay small because it is slow. The
``gpu`` tests repeat the checks at model sizes on CUDA, through the ops' default dispatch.
"""

import importlib
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import transformers

pytest.importorskip("triton")

from pagelm.models import ops  # noqa: E402
from pagelm.attention import AttentionImpl, ForwardContext, attention_layers, forward_context  # noqa: E402
from pagelm.models import Qwen3ForCausalLM  # noqa: E402
from pagelm.models.layers import link_weight_prefetch  # noqa: E402
from pagelm.models.ops import reference  # noqa: E402
from triton_interpreter import interpreted_kernels  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KERNEL_MODULES = ("rms_norm", "rotary", "activation", "gemv")


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter():
    """On CPU: TRITON_INTERPRET=1 while this module runs, with the kernels decorated under it."""
    with interpreted_kernels(*(f"pagelm.backends.kernels.{name}" for name in KERNEL_MODULES)):
        yield


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of their (shared) dtype lie between ``a`` and ``b``."""
    assert a.dtype == b.dtype and a.shape == b.shape
    int_dtype = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]

    def ordered(x):  # float bits -> integers in the floats' order (+0 and -0 both 0)
        bits = x.view(int_dtype).long()
        return torch.where(bits < 0, torch.iinfo(int_dtype).min - bits, bits)

    return (ordered(a) - ordered(b)).abs()


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, max_ulp: int = 0) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    worst = ulp_distance(actual, expected).max().item()
    assert worst <= max_ulp, f"{worst} ulp apart (allowed {max_ulp})"


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(DEVICE, dtype)




def assert_norm_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Exact in bf16/fp16 on the CPU. Elsewhere the float32 mean square sums in another order
    than torch's (and rsqrt is approximate on CUDA): a row's scale may differ in its last
    bits, so a normalised value may round one ulp apart, which the weight then scales."""
    if actual.dtype != torch.float32 and not ON_GPU:
        assert_matches(actual, expected)
    else:
        torch.testing.assert_close(actual, expected, rtol=4 * torch.finfo(actual.dtype).eps, atol=0)


def assert_silu_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Exact on CUDA, where the kernel's exp and division are torch's. On the CPU torch's
    vectorised silu is not the interpreter's numpy exp (float32 results differ by a few ulp),
    and a silu that lands on a bf16/fp16 rounding midpoint may round the other way, which
    ``up`` then scales; so there, within four of the dtype's epsilons."""
    if ON_GPU:
        assert_matches(actual, expected)
    else:
        torch.testing.assert_close(actual, expected, rtol=4 * torch.finfo(actual.dtype).eps, atol=0)


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_without_residual_matches_reference_and_returns_the_input(dtype):
    x, weight = randn(7, 96, dtype=dtype), randn(96, dtype=dtype, seed=1)
    out, residual = ops.rms_norm(x, weight, 1e-6, use_triton=True)
    expected, _ = reference.rms_norm(x, weight, 1e-6)
    assert_norm_matches(out, expected)
    assert residual is x


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_adds_the_residual_and_returns_the_sum_as_next_residual(dtype):
    x, residual = randn(5, 80, dtype=dtype), randn(5, 80, dtype=dtype, seed=2, scale=4.0)
    weight = randn(80, dtype=dtype, seed=1)
    x_before, residual_before = x.clone(), residual.clone()
    out, next_residual = ops.rms_norm(x, weight, 1e-5, residual, use_triton=True)
    expected, expected_residual = reference.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(next_residual, expected_residual)
    assert_norm_matches(out, expected)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_per_head_of_a_fused_qkv_view(dtype):
    """Qwen3's q_norm: [T, heads, head_dim] view of qkv's q columns, rows not evenly spaced."""
    num_tokens, heads, head_dim = 3, 4, 32
    qkv = randn(num_tokens, (heads + 2 + 2) * head_dim, dtype=dtype)
    q_heads = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    weight = randn(head_dim, dtype=dtype, seed=1)
    out, _ = ops.rms_norm(q_heads, weight, 1e-6, use_triton=True)
    expected, _ = reference.rms_norm(q_heads, weight, 1e-6)
    assert_norm_matches(out, expected)


# ---------------------------------------------------------------------------------------------
# Rotary embedding
# ---------------------------------------------------------------------------------------------


def cos_sin_cache(max_position: int, rotary_dim: int) -> torch.Tensor:
    """What RotaryEmbedding builds: [max_position, rotary_dim] float32, cos then sin."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)


def fused_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=0, pad=8):
    """q, k, v column views of one [T, (H + 2 KV) * D + pad] tensor: rows wider than q or k."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(num_tokens, q_size + 2 * kv_size + pad, dtype=dtype, seed=seed, scale=2.0)
    q, k, v = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size], qkv[:, q_size + kv_size :]
    return qkv, q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, rotary_dim", [(64, 64), (128, 128), (64, 32), (128, 64)])
def test_rotary_rotates_q_and_k_in_place_like_the_reference(dtype, head_dim, rotary_dim):
    num_heads, num_kv_heads, max_position = 4, 2, 64
    qkv, q, k, v = fused_qkv(5, num_heads, num_kv_heads, head_dim, dtype)
    before = qkv.clone()
    positions = torch.tensor([0, 63, 7, 7, 30], device=DEVICE)
    cache = cos_sin_cache(max_position, rotary_dim)
    expected_q, expected_k = reference.rotary_embedding(positions, q, k, cache, head_dim, rotary_dim)

    out_q, out_k = ops.rotary_embedding(positions, q, k, cache, head_dim, rotary_dim, use_triton=True)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert_matches(out_q, expected_q)
    assert_matches(out_k, expected_k)
    v_and_pad = slice((num_heads + num_kv_heads) * head_dim, None)
    assert torch.equal(qkv[:, v_and_pad], before[:, v_and_pad])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, rotary_dim", [(64, 64), (64, 32)])
def test_rotary_reference_is_the_textbook_rotation_bit_for_bit(dtype, head_dim, rotary_dim):
    """The reference's ``x * [cos, cos] + [x2, x1] * [-sin, sin]`` gives the very bits of
    ``[x1 cos - x2 sin, x2 cos + x1 sin]`` (in float32, then rounded), which it replaced."""
    qkv, q, k, _ = fused_qkv(5, 4, 2, head_dim, dtype)
    positions = torch.tensor([0, 63, 7, 7, 30], device=DEVICE)
    cache = cos_sin_cache(64, rotary_dim)
    cos, sin = cache[positions].unsqueeze(1).chunk(2, dim=-1)

    def textbook(x):
        heads = x.view(5, -1, head_dim)
        x1, x2 = heads[..., :rotary_dim].float().chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)
        return torch.cat([rotated, heads[..., rotary_dim:]], dim=-1).view_as(x)

    out_q, out_k = reference.rotary_embedding(positions, q, k, cache, head_dim, rotary_dim)
    assert not torch.equal(out_q, q)
    assert torch.equal(out_q, textbook(q)) and torch.equal(out_k, textbook(k))


def test_rotary_leaves_dims_past_rotary_dim_untouched():
    head_dim, rotary_dim = 64, 16
    qkv, q, k, _ = fused_qkv(2, 2, 1, head_dim, torch.float32)
    before = qkv.clone()
    ops.rotary_embedding(torch.tensor([3, 5], device=DEVICE), q, k, cos_sin_cache(8, rotary_dim), head_dim,
                         rotary_dim, use_triton=True)
    after, before = (t[:, : 3 * head_dim].view(2, 3, head_dim) for t in (qkv, before))
    assert torch.equal(after[..., rotary_dim:], before[..., rotary_dim:])
    assert not torch.equal(after[..., :rotary_dim], before[..., :rotary_dim])


def test_rotary_at_position_zero_is_identity():
    qkv, q, k, _ = fused_qkv(3, 2, 2, 64, torch.float32)
    before = qkv.clone()
    ops.rotary_embedding(torch.zeros(3, dtype=torch.long, device=DEVICE), q, k, cos_sin_cache(4, 64), 64, 64,
                         use_triton=True)
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_qk_norm_and_rotary_in_one_kernel_match_norm_then_rotary(dtype, head_dim):
    """Qwen3's q_norm / k_norm then RoPE in one launch: the eager three-step result, within
    the per-head RMSNorm's one-ulp sum-order difference (which the rotation may carry to 2)."""
    num_heads, num_kv_heads = 4, 2
    qkv, q, k, _ = fused_qkv(5, num_heads, num_kv_heads, head_dim, dtype)
    positions = torch.tensor([0, 63, 7, 7, 30], device=DEVICE)
    cache = cos_sin_cache(64, head_dim)
    q_w = randn(head_dim, dtype=dtype, scale=1.0)
    k_w = randn(head_dim, dtype=dtype, seed=1, scale=1.0)
    expected_q, expected_k = ops.qk_norm_rotary_embedding(
        positions, q.clone(), k.clone(), q_w, k_w, 1e-6, cache, head_dim, use_triton=False
    )
    out_q, out_k = ops.qk_norm_rotary_embedding(positions, q, k, q_w, k_w, 1e-6, cache, head_dim, use_triton=True)
    assert out_q.data_ptr() == q.data_ptr()
    tol = 0 if dtype == torch.float32 else 2
    if dtype == torch.float32:
        torch.testing.assert_close(out_q, expected_q, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out_k, expected_k, rtol=1e-6, atol=1e-6)
    else:
        assert_matches(out_q, expected_q, max_ulp=tol)
        assert_matches(out_k, expected_k, max_ulp=tol)


# ---------------------------------------------------------------------------------------------
# SiLU and mul
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate_size", [96, 1500])  # one block of a row; two, the last partial
def test_silu_and_mul_matches_reference(dtype, intermediate_size):
    x = randn(3, 2 * intermediate_size, dtype=dtype, scale=4.0)
    out = ops.silu_and_mul(x, use_triton=True)
    assert out.shape == (3, intermediate_size)
    assert_silu_matches(out, reference.silu_and_mul(x))


# ---------------------------------------------------------------------------------------------
# GEMV (decode-sized projections)
# ---------------------------------------------------------------------------------------------


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The product of the low-precision operands in float64, rounded once to their dtype."""
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def assert_gemv_matches(actual: torch.Tensor, x, weight, bias) -> None:
    """Float32 accumulation in another order than float64's: the sum may land on the other
    side of a rounding boundary of the output dtype, so one ulp, no more."""
    assert_matches(actual, exact_linear(x, weight, bias), max_ulp=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k, bias", [(40, 64, False), (37, 96, True), (1030, 1100, False)])
def test_gemv_matches_the_exact_product(dtype, n, k, bias):
    """Output rows past a program's block (n=37, 1030), K past a 1024-wide chunk (1100), a bias."""
    x, weight = randn(1, k, dtype=dtype, seed=k), randn(n, k, dtype=dtype, seed=n, scale=0.1)
    b = randn(n, dtype=dtype, seed=7) if bias else None
    out = ops.linear(x, weight, b, use_triton=True)
    assert out.shape == (1, n) and out.dtype == dtype
    assert_gemv_matches(out, x, weight, b)


def test_gemv_config_takes_all_of_k_in_one_chunk_only_when_unpadded_and_small():
    """The rule of ``gemv_config`` at the shapes it was measured on (H200, batch 1)."""
    from pagelm.backends.kernels import gemv

    assert gemv.WHOLE_K_BYTES == 16384  # the default; PAGELM_GEMV_WHOLE_K_BYTES changes it
    assert gemv.gemv_config(3072, 2048) == (4, 2048, 4)  # Llama-3.2-1B qkv: one chunk
    assert gemv.gemv_config(2048, 2048) == (4, 2048, 4)  # its o
    assert gemv.gemv_config(1024, 2048) == (2, 2048, 4)  # Qwen3-0.6B o
    assert gemv.gemv_config(1024, 3072) == (2, 1024, 4)  # Qwen3-0.6B down: K padded, chunks
    assert gemv.gemv_config(16384, 2048) == (8, 1024, 4)  # Llama-3.2-1B gate_up: 32 KB, chunks
    assert gemv.gemv_config(4096, 4096) == (8, 1024, 4)  # Llama-3.1-8B o: chunks


@pytest.mark.parametrize("k", [1100, 2048])
def test_gemv_with_k_in_one_chunk_matches_the_exact_product(k):
    """All of a program's K in one chunk (masked at 1100, through an explicit config), plain
    and with the norm prologue."""
    from pagelm.backends.kernels.gemv import gemv as gemv_kernel

    n, dtype = 40, torch.bfloat16
    config = (2, 1 << (k - 1).bit_length(), 4)
    x, weight = randn(1, k, dtype=dtype, seed=k), randn(n, k, dtype=dtype, seed=n, scale=0.1)
    assert_gemv_matches(gemv_kernel(x, weight, config=config), x, weight, None)
    norm_weight, residual = randn(k, dtype=dtype, seed=3), randn(1, k, dtype=dtype, seed=2, scale=3.0)
    out, _ = gemv_kernel(x, weight, norm=(norm_weight, 1e-6, residual), config=config)
    normed, _ = ops.rms_norm(x, norm_weight, 1e-6, residual, use_triton=True)
    assert_gemv_matches(out, normed, weight, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [200, 1024])  # a masked chunk; exactly one chunk
def test_gemv_with_silu_input_is_silu_and_mul_then_linear(dtype, k):
    """The activation computed while loading rounds as the separate op does, so the product
    is the exact product of ``silu_and_mul(x)`` and the weight, to one ulp."""
    n = 48
    x = randn(1, 2 * k, dtype=dtype, seed=3, scale=3.0)
    weight = randn(n, k, dtype=dtype, seed=4, scale=0.1)
    out = ops.silu_and_mul_linear(x, weight, use_triton=True)
    activation = ops.silu_and_mul(x, use_triton=True)
    assert_gemv_matches(out, activation, weight, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k, with_residual", [(96, True), (1100, True), (2048, False)])
def test_gemv_with_rms_norm_is_the_norm_then_linear(dtype, k, with_residual):
    """The norm in the GEMV's prologue rounds as the RMSNorm op does, so the product is the
    exact product of the op's output and the weight (one ulp), and the next residual is the
    op's bit for bit. K in one masked chunk, over two chunks, and exactly two."""
    n = 40
    x = randn(1, k, dtype=dtype, seed=1)
    residual = randn(1, k, dtype=dtype, seed=2, scale=3.0) if with_residual else None
    norm_weight, weight = randn(k, dtype=dtype, seed=3), randn(n, k, dtype=dtype, seed=4, scale=0.1)
    out, next_residual = ops.rms_norm_linear(x, norm_weight, 1e-6, residual, weight, use_triton=True)
    normed, expected_residual = ops.rms_norm(x, norm_weight, 1e-6, residual, use_triton=True)
    assert torch.equal(next_residual, expected_residual)
    assert_gemv_matches(out, normed, weight, None)


@pytest.mark.parametrize("silu_input", [False, True])
def test_gemv_all_reduce_sums_two_ranks_partials_and_leaves_the_buffers_zero(silu_input):
    """The two-rank exchange of ``gemv(all_reduce=...)``, ranks run one after the other (the
    interpreter runs one program at a time, so the other rank's half is already there when a
    rank starts): each rank's result is the sum of both ranks' rounded partial products, the
    two are the same bits, each rank's partials land in the other's receive buffer as
    flagged 64-bit words, and a rank leaves its receive buffer zero once it has read it. The
    output (n=1030) is not a whole number of tiles, so the last program's masked rows are
    exchanged too."""
    gemv = importlib.import_module("pagelm.backends.kernels.gemv")
    n, k, dtype = 1030, 96, torch.bfloat16
    padded = -(-n // gemv.gemv_config(n, k)[0]) * gemv.gemv_config(n, k)[0]
    xs = [randn(1, 2 * k if silu_input else k, dtype=dtype, seed=10 + r, scale=2.0) for r in range(2)]
    weights = [randn(n, k, dtype=dtype, seed=20 + r, scale=0.1) for r in range(2)]
    partials = [gemv.gemv(x, w, silu_input=silu_input) for x, w in zip(xs, weights)]
    expected = (partials[0].float() + partials[1].float()).to(dtype)
    recv = [torch.zeros(2 * padded, dtype=dtype) for _ in range(2)]  # 4 bytes per output
    recv[0].copy_(_words(partials[1][0], padded))  # rank 1 got as far as its exchange
    out0 = gemv.gemv(xs[0], weights[0], silu_input=silu_input, all_reduce=(recv[1], recv[0]))
    assert torch.equal(out0, expected)
    assert recv[0].view(torch.int16).eq(0).all(), "rank 0 zeroes every word it read"
    assert torch.equal(recv[1].view(torch.int16), _words(partials[0][0], padded).view(torch.int16))
    out1 = gemv.gemv(xs[1], weights[1], silu_input=silu_input, all_reduce=(recv[0], recv[1]))
    assert torch.equal(out1, out0)


def _words(values: torch.Tensor, padded: int) -> torch.Tensor:
    """What an exchange writes into the other rank's buffer: each pair of 16-bit values (the
    tile past ``values`` zero) in a 64-bit word with 1 in its high half, as 16-bit values."""
    bits = torch.zeros(padded, dtype=torch.int64)
    bits[: values.numel()] = values.view(torch.int16).to(torch.int64) & 0xFFFF
    return (bits[0::2] | (bits[1::2] << 16) | (1 << 32)).view(values.dtype)


def test_linear_dispatch_keeps_batches_and_float32_on_torch():
    """The GEMV takes only what it is for: single bf16/fp16 rows."""
    weight = randn(16, 32, dtype=torch.bfloat16)
    gemv = importlib.import_module("pagelm.backends.kernels.gemv").gemv
    assert ops._gemv(randn(1, 32, dtype=torch.bfloat16), weight, True) is gemv
    assert ops._gemv(randn(2, 32, dtype=torch.bfloat16), weight, True) is None
    assert ops._gemv(randn(1, 32), weight.float(), True) is None
    assert ops._gemv(randn(2, 32, dtype=torch.bfloat16), weight, False) is None


# ---------------------------------------------------------------------------------------------
# Dispatch and the models
# ---------------------------------------------------------------------------------------------


def test_cpu_tensors_take_the_reference_by_default():
    assert not ops.fused_ops_enabled(torch.zeros(1))


@pytest.mark.parametrize("value, disabled", [("1", True), ("0", False)])
def test_env_var_disables_the_fused_kernels(value, disabled):
    code = "import pagelm.models.ops as ops; print(ops.FUSED_OPS_DISABLED)"
    env = {**os.environ, "PAGELM_DISABLE_FUSED_OPS": value}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == str(disabled)


class CausalSDPA(AttentionImpl):
    """Causal attention over the step's own tokens: the same in both runs being compared."""

    def forward(self, query, key, value, kv_cache, metadata):
        spec, num_tokens = self.spec, query.shape[0]
        q, k, v = (
            t.reshape(num_tokens, -1, spec.head_dim).transpose(0, 1) for t in (query, key, value)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=spec.scale, enable_gqa=True)
        return out.transpose(0, 1).reshape(num_tokens, spec.num_heads * spec.head_dim)


def tiny_qwen3() -> Qwen3ForCausalLM:
    config = transformers.Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=128, max_position_embeddings=64,
    )
    model = Qwen3ForCausalLM(config).to(DEVICE)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            values = torch.rand(param.shape, generator=generator) + 0.5 if "norm" in name else \
                torch.randn(param.shape, generator=generator) * 0.2
            param.copy_(values)
    for layer in attention_layers(model):
        layer.impl = CausalSDPA(layer.spec)
        layer.kv_cache = torch.empty(0)
    return model


@torch.no_grad()
def test_qwen3_forward_with_the_kernels_matches_the_reference_path(monkeypatch):
    """Every norm (per-head q/k norms included), the rotary and the MLP activation of a model
    running through the kernels, against the same model on the torch references."""
    model = tiny_qwen3()
    input_ids = torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    positions = torch.arange(12, device=DEVICE)

    def logits(fused: bool) -> torch.Tensor:
        with monkeypatch.context() as mp:
            mp.setattr(ops, "fused_ops_enabled", lambda x: fused)
            with forward_context(ForwardContext(attn_metadata=None)):
                return model.compute_logits(model(input_ids, positions))

    torch.testing.assert_close(logits(True), logits(False), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_bf16_single_token_forward_through_the_gemv_prologues_matches_the_reference_path(monkeypatch):
    """Batch-1 decode shape in bf16: every projection takes the GEMV, the norms run in the qkv
    and gate_up prologues and the activation in down's. Same logits as the separate ops, up to
    the GEMV's accumulation order (a bf16 ulp here and there)."""
    model = tiny_qwen3()
    for param in model.parameters():  # the rotary cache stays float32, as the loader keeps it
        param.data = param.data.to(torch.bfloat16)
    input_ids, positions = torch.tensor([5], device=DEVICE), torch.tensor([0], device=DEVICE)
    used = []
    real_gemv = importlib.import_module("pagelm.backends.kernels.gemv").gemv
    monkeypatch.setattr("pagelm.backends.kernels.gemv.gemv", lambda *a, **k: used.append(k) or real_gemv(*a, **k))

    def logits(fused: bool) -> torch.Tensor:
        with monkeypatch.context() as mp:
            mp.setattr(ops, "fused_ops_enabled", lambda x: fused)
            with forward_context(ForwardContext(attn_metadata=None)):
                return model.compute_logits(model(input_ids, positions)).float()

    reference_logits = logits(False)
    assert not used
    fused_logits = logits(True)
    # Per layer: qkv (norm prologue), o, gate_up (norm prologue), down (silu prologue).
    assert [("norm" in k, k.get("silu_input", False)) for k in used[:4]] == [(True, False), (False, False), (True, False), (False, True)]
    torch.testing.assert_close(fused_logits, reference_logits, atol=0.05, rtol=0.02)


@torch.no_grad()
def test_each_projection_prefetches_the_weight_the_next_projection_reads(monkeypatch):
    """``link_weight_prefetch``: in a batch-1 forward every GEMV is handed the weight of the
    GEMV after it (qkv -> o -> gate_up -> down -> next layer's qkv -> ... -> LM head), the LM
    head none; linking registers no parameter."""
    model = tiny_qwen3()
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    names = [name for name, _ in model.named_parameters()]
    link_weight_prefetch(model)
    assert [name for name, _ in model.named_parameters()] == names
    calls = []
    real_gemv = importlib.import_module("pagelm.backends.kernels.gemv").gemv
    monkeypatch.setattr(
        "pagelm.backends.kernels.gemv.gemv", lambda *a, **k: calls.append((a[1], k.get("prefetch"))) or real_gemv(*a, **k)
    )
    monkeypatch.setattr(ops, "fused_ops_enabled", lambda x: True)
    with forward_context(ForwardContext(attn_metadata=None)):
        model.compute_logits(model(torch.tensor([5], device=DEVICE), torch.tensor([0], device=DEVICE)))
    weights = [weight for weight, _ in calls]
    assert len(weights) == 2 * 4 + 1 and weights[-1] is model.lm_head.weight
    assert weights[:4] == [model.model.layers[0].self_attn.qkv_proj.weight, model.model.layers[0].self_attn.o_proj.weight,
                           model.model.layers[0].mlp.gate_up_proj.weight, model.model.layers[0].mlp.down_proj.weight]
    assert [prefetch for _, prefetch in calls] == weights[1:] + [None]


def test_a_gemv_kernel_registered_without_prefetch_is_called_without_it():
    """Plugin API 2.20 added ``prefetch`` to the GEMV's call; a kernel written before keeps
    working."""
    def before_2_20(x, weight, bias=None, *, silu_input=False, norm=None):
        pass

    def since_2_20(x, weight, bias=None, *, silu_input=False, norm=None, prefetch=None):
        pass

    following = torch.zeros(4, 4)
    assert ops._optional_kwargs(before_2_20, following) == {}
    assert ops._optional_kwargs(since_2_20, following)["prefetch"] is following
    assert ops._optional_kwargs(since_2_20, None) == {}


# ---------------------------------------------------------------------------------------------
# CUDA, at model sizes, through the default dispatch
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_tensors_take_the_kernels_by_default():
    assert ops.fused_ops_enabled(torch.zeros(1, device="cuda")) != ops.FUSED_OPS_DISABLED


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [4096, 5120])
def test_gpu_rms_norm_matches_reference(dtype, hidden_size):
    x = randn(257, hidden_size, dtype=dtype)
    residual = randn(257, hidden_size, dtype=dtype, seed=2, scale=4.0)
    weight = randn(hidden_size, dtype=dtype, seed=1)
    out, next_residual = ops.rms_norm(x, weight, 1e-6, residual, use_triton=True)
    expected, expected_residual = reference.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(next_residual, expected_residual)
    assert_norm_matches(out, expected)

    q_heads = randn(257, 40, 3 * 128, dtype=dtype)[..., :128]  # Qwen3's per-head norm on strided rows
    out, _ = ops.rms_norm(q_heads, weight[:128], 1e-6, use_triton=True)
    assert_norm_matches(out, reference.rms_norm(q_heads, weight[:128], 1e-6)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, rotary_dim", [(64, 64), (128, 128), (128, 64), (256, 256)])
def test_gpu_rotary_matches_reference_exactly(dtype, head_dim, rotary_dim):
    qkv, q, k, _ = fused_qkv(333, 32, 8, head_dim, dtype)
    positions = torch.randint(0, 8192, (333,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    cache = cos_sin_cache(8192, rotary_dim)
    expected_q, expected_k = reference.rotary_embedding(positions, q, k, cache, head_dim, rotary_dim)
    out_q, out_k = ops.rotary_embedding(positions, q, k, cache, head_dim, rotary_dim, use_triton=True)
    assert_matches(out_q, expected_q)
    assert_matches(out_k, expected_k)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_silu_and_mul_matches_reference_exactly(dtype):
    x = randn(257, 2 * 11008, dtype=dtype, scale=4.0)
    assert_matches(ops.silu_and_mul(x, use_triton=True), reference.silu_and_mul(x))


@pytest.mark.gpu
def test_gpu_ops_replay_in_a_cuda_graph():
    """Captured once, replayed on new inputs written into the same buffers."""
    hidden, head_dim = 1024, 128
    x, residual = randn(16, hidden, dtype=torch.bfloat16), randn(16, hidden, dtype=torch.bfloat16, seed=1)
    weight = randn(hidden, dtype=torch.bfloat16, seed=2)
    qkv, q, k, _ = fused_qkv(16, 8, 2, head_dim, torch.bfloat16)
    positions = torch.arange(16, device=DEVICE)
    cache = cos_sin_cache(64, head_dim)
    gate_up = randn(16, 2 * 512, dtype=torch.bfloat16)

    def step():
        normed, next_residual = ops.rms_norm(x, weight, 1e-6, residual)
        ops.rotary_embedding(positions, q, k, cache, head_dim, head_dim)
        return normed, next_residual, ops.silu_and_mul(gate_up)

    step()  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()

    x.copy_(randn(16, hidden, dtype=torch.bfloat16, seed=5))
    positions.copy_(torch.arange(16, 32, device=DEVICE))
    qkv.copy_(randn(*qkv.shape, dtype=torch.bfloat16, seed=6))
    gate_up.copy_(randn(16, 2 * 512, dtype=torch.bfloat16, seed=7))
    expected_norm, expected_residual = reference.rms_norm(x, weight, 1e-6, residual)
    expected_q, expected_k = reference.rotary_embedding(positions, q, k, cache, head_dim, head_dim)
    expected_act = reference.silu_and_mul(gate_up)
    graph.replay()
    torch.cuda.synchronize()
    assert_norm_matches(outputs[0], expected_norm)
    assert torch.equal(outputs[1], expected_residual)
    assert_matches(q, expected_q)
    assert_matches(k, expected_k)
    assert torch.equal(outputs[2], expected_act)


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch_bytes", [2**20, 2**30])
def test_gpu_gemv_prefetching_the_next_weight_gives_the_same_bits(monkeypatch, prefetch_bytes):
    """The L2 prefetch is a hint: the product is bit-identical with it, eagerly and replayed
    in a CUDA graph, whether it covers part of the next weight or all of it (and the weight
    is not a multiple of the programs' shares)."""
    gemv_module = importlib.import_module("pagelm.backends.kernels.gemv")
    x, weight = randn(1, 2048, dtype=torch.bfloat16), randn(1000, 2048, dtype=torch.bfloat16, seed=1)
    following = randn(4099, 1024, dtype=torch.bfloat16, seed=2)
    expected = gemv_module.gemv(x, weight)
    monkeypatch.setattr(gemv_module, "L2_PREFETCH_BYTES", prefetch_bytes)
    assert torch.equal(gemv_module.gemv(x, weight, prefetch=following), expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv_module.gemv(x, weight, prefetch=following)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
