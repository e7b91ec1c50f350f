"""The draft head graphs' input kernels (``pagelm.backends.kernels.draft_inputs``) give what
``EagleDraftGraphs``' torch ops give (on the CPU under Triton's interpreter): pass 1's input
ids, slots and seq_lens from the step the target ran (read in place, or from the graph's own
copy), and each later pass's positions, seq_lens and slots, with padding requests, requests
drafting fewer tokens and positions clamped at ``max_model_len``."""

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("triton")

from triton_interpreter import interpreted_kernels  # noqa: E402
from pagelm.attention import GraphSupport  # noqa: E402
from pagelm.plugins.spec_decode.eagle_graphs import EagleDraftGraphs  # noqa: E402
from pagelm.spec_decode import DraftGraphSetup, VerificationBuffers  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
Q, BLOCK, MAX_LEN = 4, 4, 30


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter():
    with interpreted_kernels("pagelm.backends.kernels.draft_inputs", fresh=True):
        yield


class RecordingHead(nn.Module):
    """Stands in for the head: records what pass 1 feeds it."""

    def forward(self, input_ids, positions, hidden):
        self.seen = (input_ids.tolist(), positions.tolist(), hidden.tolist())
        return hidden + 1


def graphs(sources=None) -> EagleDraftGraphs:
    setup = DraftGraphSetup(
        builder=None, graph_support=GraphSupport.ALWAYS, sizes=[1, 2, 4], max_model_len=MAX_LEN, block_size=BLOCK,
        max_blocks_per_req=8, device=DEVICE, pool=None, verify_buffers={},
    )
    g = EagleDraftGraphs(RecordingHead(), lambda h: h[:, 0].long(), setup, [1, 2, 4], 3, 2, torch.float32,
                         query_len=Q, sources=sources)
    return g


def stage(g: EagleDraftGraphs, n: int, size: int) -> None:
    """``n`` requests padded to ``size``: last verified positions, caps, last rows, next tokens."""
    last_positions = np.array([9, 27, 3][:n])  # 27 + 2 passes past max_model_len - 1 = 29
    last_index = np.array([1, 7, 11][:n])  # request i's rows are 4i .. 4i + 3
    g._stage({0: last_positions, 1: np.array([3, 3, 1][:n]), 2: last_index, 3: np.array([70, 71, 72][:n]), 4: 1},
             np.array([[5, 6, 7, 1, 0], [2, 3, 4, 8, 9], [1, 0, 0, 0, 0]][:n], dtype=np.int64), size)


def step_buffers(size: int) -> VerificationBuffers:
    ids = torch.tensor([-1, -1, 11, 12, 21, 22, 23, 24, -1, -1, -1, 31, 0, 0, 0, 0][: size * Q], device=DEVICE)
    return VerificationBuffers(
        input_ids=ids,
        positions=torch.arange(size * Q, device=DEVICE) + 100,
        hidden_states=torch.arange(size * Q * 2, dtype=torch.float32, device=DEVICE).view(-1, 2),
        slot_mapping=torch.arange(size * Q, device=DEVICE) + 40,
        seq_lens=torch.tensor([12, 31, 5, 9][:size], dtype=torch.int32, device=DEVICE),
    )


def first_pass(g: EagleDraftGraphs, size: int, use_triton: bool) -> list:
    g.step_slot_mapping.fill_(-7)
    g.step_seq_lens.fill_(-7)
    g.head_input_ids.fill_(-7)
    drafts, hidden = g._first_pass(size, None, use_triton=use_triton)
    return [g.head.seen, g.step_slot_mapping[: size * Q].tolist(), g.step_seq_lens[:size].tolist(), drafts.tolist(),
            hidden.tolist()]


@pytest.mark.parametrize("in_place", [True, False], ids=["verification-graph-buffers", "own-copy"])
@pytest.mark.parametrize("n, size", [(3, 4), (1, 1), (2, 2)])
def test_pass_one_inputs_match_the_torch_ops(in_place, n, size):
    source = step_buffers(size)
    g = graphs({size: source} if in_place else None)
    stage(g, n, size)
    if not in_place:  # what load_step copies in
        for name in ("input_ids", "positions", "hidden_states", "slot_mapping", "seq_lens"):
            rows = size if name == "seq_lens" else size * Q
            getattr(g._own, name)[:rows].copy_(getattr(source, name))
    before = [t.clone() for t in (source.slot_mapping, source.seq_lens)]
    fused, reference = first_pass(g, size, True), first_pass(g, size, False)
    assert fused == reference
    ids, _, _ = fused[0]
    # Row 1 is request 0's last verified row: it reads the sampled token; the rest read p + 1
    # (a padding id as 0).
    assert ids[:3] == [0, 70, 12]
    if size > n:  # a padding request stores nothing and attends one key
        assert fused[1][-Q:] == [-1] * Q and fused[2][-1] == 1
    if in_place:  # the verification graph's own step is left as its replay left it
        assert [t.tolist() for t in (source.slot_mapping, source.seq_lens)] == [t.tolist() for t in before]


def pass_inputs(g: EagleDraftGraphs, size: int, j: int, use_triton: bool) -> list:
    for t in (g.positions, g.seq_lens, g.slot_mapping):
        t.fill_(-7)
    last_positions, max_drafts = g._field(0, size), g._field(1, size)
    g._pass_inputs(size, j, last_positions, max_drafts, use_triton=use_triton)
    return [g.positions[:size].tolist(), g.seq_lens[:size].tolist(), g.slot_mapping[:size].tolist()]


@pytest.mark.parametrize("j", [1, 2])
@pytest.mark.parametrize("n, size", [(3, 4), (2, 2)])
def test_later_pass_inputs_match_the_torch_ops(j, n, size):
    g = graphs()
    stage(g, n, size)
    fused = pass_inputs(g, size, j, True)
    assert fused == pass_inputs(g, size, j, False)
    positions, seq_lens, slots = fused
    # Request 0 drafts 3: position 9 + j through block row [5, 6, 7, ...].
    assert positions[0] == 9 + j and seq_lens[0] == 10 + j and slots[0] == 7 * BLOCK + (9 + j) % BLOCK
    assert positions[1] == min(27 + j, MAX_LEN - 1)
    if n == 3:  # request 2 drafts one token: later passes store nothing
        assert seq_lens[2] == 1 and slots[2] == -1
