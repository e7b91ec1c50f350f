"""The CUDA graphs' input-derivation kernel gives what the torch ops give (on the CPU under
Triton's interpreter): input ids, positions, seq_lens and slots, for one-token decode and for
verification with padding tokens and padding requests."""

import importlib

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from triton_interpreter import interpret_triton  # noqa: E402
from pagelm.worker.cuda_graphs import PAD_TOKEN, CudaGraphRunner  # noqa: E402
from pagelm.worker.input_buffers import InputBuffers  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter():
    if torch.cuda.is_available():
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        interpret_triton(mp)
        importlib.reload(importlib.import_module("pagelm.backends.kernels.graph_inputs"))
        importlib.reload(importlib.import_module("pagelm.backends.kernels.draft_inputs"))
        yield


def derived(graphs: CudaGraphRunner, size: int, use_triton: bool) -> list[list]:
    for t in (graphs.input_ids, graphs.positions, graphs.slot_mapping, graphs.seq_lens):
        t.fill_(-7)  # whatever the derivation leaves unwritten would show
    graphs._derive_inputs(size, use_triton=use_triton)
    n = size * graphs.query_len
    return [graphs.input_ids[:n].tolist(), graphs.positions[:n].tolist(), graphs.slot_mapping[:n].tolist(),
            graphs.seq_lens[:size].tolist()]


@pytest.mark.parametrize("query_len, tokens, seq_lens, size", [
    (1, [5, 9, 2], [7, 1, 19], 4),  # decode, one padding request
    (4, [11, 12, 13, 14, PAD_TOKEN, PAD_TOKEN, 21, 22, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN, 31], [10, 6, 2], 4),
])
def test_kernel_matches_the_torch_derivation(query_len, tokens, seq_lens, size):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    buffers = InputBuffers(max_num_tokens=64, max_num_reqs=4, max_blocks_per_req=8, device=device)
    graphs = CudaGraphRunner(
        model=None, buffers=buffers, builder=None, sizes=[1, 2, 4], max_seq_len=32, block_size=4,
        query_len=query_len,
    )
    block_rows = np.array([[7, 3, 9, 4, 2], [5, 8, 0, 0, 0], [6, 1, 0, 0, 0]], dtype=np.int32)
    graphs.load(tokens, np.array(seq_lens), block_rows, size=size)
    assert derived(graphs, size, use_triton=True) == derived(graphs, size, use_triton=False)


def test_draft_gather_kernel_matches_the_torch_gather():
    """A verification graph whose drafts wait on the device (``draft_source``): the staged ids
    at draft positions are replaced by the kept drafts, clamped into the vocabulary, and the
    verdict's third row marks the out-of-vocabulary ones, kernel and torch ops alike."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    buffers = InputBuffers(max_num_tokens=64, max_num_reqs=4, max_blocks_per_req=8, device=device)
    kept = torch.tensor([5, 77, -3, 8, 9, 40, 41, 42], device=device)  # vocab 50: 77 and -3 lie outside
    graphs = CudaGraphRunner(
        model=None, buffers=buffers, builder=None, sizes=[1, 2, 4], max_seq_len=32, block_size=4,
        query_len=4, draft_source=(kept, 50),
    )
    tokens = [11, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN, 21, 22, 31, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN]
    block_rows = np.array([[7, 3, 9, 4, 2], [5, 8, 0, 0, 0], [6, 1, 0, 0, 0]], dtype=np.int32)
    at, sources = np.array([1, 2, 3, 9, 10, 11]), np.array([0, 1, 2, 5, 6, 7])

    def run(use_triton):
        graphs.load(tokens, np.array([10, 6, 12]), block_rows, size=4, drafts=(at, sources))
        graphs._verdict.fill_(-7)
        out = derived(graphs, 4, use_triton)
        return out, graphs._verdict[2, :16].tolist()

    fused = run(True)
    assert fused == run(False)
    (ids, *_), out_of_vocab = fused
    assert ids[:4] == [11, 5, 49, 0] and ids[8:12] == [31, 40, 41, 42]
    assert out_of_vocab[:4] == [0, 0, 1, 1] and sum(out_of_vocab) == 2
