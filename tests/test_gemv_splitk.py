"""The split-K GEMV (``pagelm.backends.kernels.gemv_splitk``) gives ``F.linear``'s result for
1..8 rows, and ``PAGELM_TRITON_GEMV=1`` routes the models' projections through it.

Without CUDA the kernels run on the CPU under Triton's interpreter (small shapes: it is slow).
"""

import importlib

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from pagelm.attention import ForwardContext, forward_context  # noqa: E402
from pagelm.models import ops  # noqa: E402
from test_fused_ops import tiny_qwen3  # noqa: E402
from triton_interpreter import interpreted_kernels  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# float32 sums of float32 products; a bf16/fp16 result one rounding of the float32 sum away
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}


@pytest.fixture(scope="module")
def kernels():
    names = ("gemv_splitk", "gemv", "rms_norm", "rotary", "activation")
    with interpreted_kernels(*(f"pagelm.backends.kernels.{name}" for name in names)) as modules:
        yield modules[0]


def randn(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def exact_linear(x, weight, bias):
    """The product in float64, rounded once to the inputs' dtype."""
    out = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n, k, config", [(37, 300, (16, 64, 3, 4)), (50, 129, (32, 32, 2, 4)), (20, 70, None)])
def test_split_k_gemv_matches_linear(kernels, dtype, m, n, k, config):
    """K and N are not multiples of the blocks; the configs force several splits (and the
    default config, one split per chunk up to the grid target), so both stages run."""
    x, weight, bias = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype, seed=1), randn(n, dtype=dtype, seed=2)
    out = kernels.gemv_splitk(x, weight, bias, config=config)
    atol, rtol = TOLERANCES[dtype]
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out, exact_linear(x, weight, bias), atol=atol * k**0.5, rtol=rtol)


def test_split_k_gemv_without_bias_and_with_one_split(kernels):
    x, weight = randn(2, 40, dtype=torch.bfloat16), randn(24, 40, dtype=torch.bfloat16, seed=1)
    out = kernels.gemv_splitk(x, weight, None, config=(16, 64, 1, 4))
    torch.testing.assert_close(out, exact_linear(x, weight, None), atol=0.1, rtol=1.6e-2)


def test_split_k_gemv_is_the_same_every_run(kernels):
    x, weight = randn(3, 200, dtype=torch.bfloat16), randn(33, 200, dtype=torch.bfloat16, seed=1)
    first = kernels.gemv_splitk(x, weight, None, config=(16, 32, 7, 4))
    assert torch.equal(first, kernels.gemv_splitk(x, weight, None, config=(16, 32, 7, 4)))


@pytest.mark.parametrize(
    "m, n, k, expected",
    [
        (1, 4096, 1024, (32, 256, 4, 4)),  # Qwen3-0.6B qkv: 128 x 4 = 512 programs
        (1, 1024, 2048, (16, 256, 8, 4)),  # o: 64 x 8
        (1, 1024, 3072, (16, 256, 12, 4)),  # down
        (8, 6144, 4096, (32, 512, 4, 4)),  # Llama-3.1-8B qkv
        (1, 151936, 1024, (32, 256, 1, 4)),  # a vocabulary: N alone covers the SMs
    ],
)
def test_split_k_config_covers_the_sms_several_times(kernels, m, n, k, expected):
    config = kernels.gemv_splitk_config(m, n, k, num_sms=132)
    assert config == expected
    block_n, block_k, split_k, _ = config
    assert -(-n // block_n) * split_k >= 4 * 132 or split_k == -(-k // block_k)


@torch.no_grad()
def test_triton_gemv_switch_routes_decode_projections_and_keeps_greedy_ids(kernels, monkeypatch):
    """A bf16 decode step of 3 tokens with ``PAGELM_TRITON_GEMV`` forced on (and the kernels
    forced on the CPU): every projection runs the split-K GEMV, and the argmax ids are those
    of the plain path."""
    model = tiny_qwen3()
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    input_ids, positions = torch.tensor([5, 9, 17], device=DEVICE), torch.tensor([0, 1, 2], device=DEVICE)
    used = []
    real = kernels.gemv_splitk
    monkeypatch.setattr(kernels, "gemv_splitk", lambda x, w, b=None: used.append((x.shape[0], tuple(w.shape))) or real(x, w, b))

    def logits(switch: bool) -> torch.Tensor:
        with monkeypatch.context() as mp:
            mp.setattr(ops, "SPLITK_GEMV_ENABLED", switch)
            mp.setattr(ops, "fused_ops_enabled", lambda x: switch)
            with forward_context(ForwardContext(attn_metadata=None)):
                return model.compute_logits(model(input_ids, positions)).float()

    plain = logits(False)
    assert not used
    routed = logits(True)
    layers = len(model.model.layers)
    assert len(used) == 4 * layers + 1  # qkv, o, gate_up, down per layer, and the lm_head
    assert all(rows == 3 for rows, _ in used)
    torch.testing.assert_close(routed, plain, atol=0.05, rtol=0.02)
    assert torch.equal(routed.argmax(-1), plain.argmax(-1))


@torch.no_grad()
def test_min_rows_two_leaves_single_rows_to_the_one_row_gemv(kernels, monkeypatch):
    """``PAGELM_TRITON_GEMV_MIN_ROWS=2``: a one-token step keeps the one-row GEMV (with its
    norm and activation prologues), a three-token step takes the split-K GEMV."""
    x, weight = randn(1, 32, dtype=torch.bfloat16), randn(16, 32, dtype=torch.bfloat16, seed=1)
    monkeypatch.setattr(ops, "SPLITK_GEMV_ENABLED", True)
    monkeypatch.setattr(ops, "SPLITK_GEMV_MIN_ROWS", 2)
    one_row = importlib.import_module("pagelm.backends.kernels.gemv").gemv
    assert ops._splitk_gemv(x, weight, True) is None and ops._gemv(x, weight, True) is one_row
    rows3 = randn(3, 32, dtype=torch.bfloat16)
    assert ops._splitk_gemv(rows3, weight, True) is kernels.gemv_splitk and ops._gemv(rows3, weight, True) is None
    monkeypatch.setattr(ops, "SPLITK_GEMV_MIN_ROWS", 1)
    assert ops._splitk_gemv(x, weight, True) is kernels.gemv_splitk and ops._gemv(x, weight, True) is None
    torch.testing.assert_close(ops.linear(x, weight, use_triton=True), exact_linear(x, weight, None), atol=0.05, rtol=1.6e-2)
