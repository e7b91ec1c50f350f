"""The model runner's start-up choices and persistent inputs, on CPU."""

import numpy as np
import pytest
import torch

from pagelm import LLM, SamplingParams
from pagelm.worker.cuda_graphs import capture_sizes
from pagelm.worker.input_buffers import InputBuffers


def test_auto_attention_backend_is_torch_on_cpu(llama_dir):
    llm = LLM(str(llama_dir), device="cpu")
    assert llm.engine.core.runner.backend.name == "torch"


def test_requiring_cuda_graphs_on_cpu_is_a_startup_error(llama_dir):
    with pytest.raises(ValueError, match="enforce_eager=False asks for CUDA graphs, but they need a CUDA device"):
        LLM(str(llama_dir), device="cpu", enforce_eager=False)


def test_capture_sizes_follow_1_2_4_8_then_steps_up_to_max_num_seqs():
    assert capture_sizes(256, 8192) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64] + list(range(80, 257, 16))
    assert capture_sizes(5, 8192) == [1, 2, 4, 5]
    assert capture_sizes(100, 100)[-1] == 100
    assert capture_sizes(256, 12) == [1, 2, 4, 8, 12]


def test_block_table_upload_keeps_full_width_rows():
    buffers = InputBuffers(max_num_tokens=16, max_num_reqs=4, max_blocks_per_req=6, device=torch.device("cpu"))
    table = buffers.upload_block_table(np.array([[3, 4], [7, 8]], dtype=np.int32))
    assert table.shape == (2, 6)
    assert table[:, :2].tolist() == [[3, 4], [7, 8]]


def test_block_table_rows_return_when_requests_finish(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", max_num_seqs=4)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 30, 12, 7, 19, 40)]
    llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    runner = llm.engine.core.runner
    # The last step's finished requests are dropped at the next schedule; run an empty one.
    llm.engine.core.step()
    assert sorted(runner._free_rows) == [0, 1, 2, 3]
    assert runner.requests == {}


def test_graph_inputs_are_derived_from_token_seq_len_and_block_row():
    """The decode graph's in-graph prologue, run eagerly on CPU: positions, slots and
    attention seq_lens follow from (token, seq_len, block row); padding stores nothing."""
    from pagelm.worker.cuda_graphs import CudaGraphRunner

    buffers = InputBuffers(max_num_tokens=16, max_num_reqs=4, max_blocks_per_req=8, device=torch.device("cpu"))
    graphs = CudaGraphRunner(model=None, buffers=buffers, builder=None, sizes=[1, 2, 4], max_seq_len=128, block_size=4)
    block_rows = np.array([[7, 3, 9], [5, 0, 0]], dtype=np.int32)
    graphs.load([11, 22], np.array([10, 2]), block_rows, size=4)
    graphs._derive_inputs(4)
    assert graphs.input_ids[:4].tolist() == [11, 22, 0, 0]
    assert graphs.positions[:4].tolist() == [9, 1, 0, 0]
    # position 9 -> block index 2 (id 9), offset 1; position 1 -> block 5, offset 1
    assert graphs.slot_mapping[:4].tolist() == [9 * 4 + 1, 5 * 4 + 1, -1, -1]
    assert graphs.seq_lens[:4].tolist() == [10, 2, 1, 1]
    assert buffers.block_table[:2, :3].tolist() == block_rows.tolist()


def test_graph_inputs_shift_rotary_positions_by_staged_deltas_not_slots():
    """With position offsets (M-RoPE), the graph's rotary positions are each request's
    position plus its delta; slots and seq_lens still follow the unshifted position."""
    from pagelm.worker.cuda_graphs import CudaGraphRunner

    buffers = InputBuffers(max_num_tokens=16, max_num_reqs=4, max_blocks_per_req=8, device=torch.device("cpu"))
    graphs = CudaGraphRunner(model=None, buffers=buffers, builder=None, sizes=[1, 2, 4], max_seq_len=128,
                             block_size=4, position_offsets=True)
    block_rows = np.array([[7, 3, 9], [5, 0, 0]], dtype=np.int32)
    graphs.load([11, 22], np.array([10, 2]), block_rows, size=4, deltas=np.array([-5, 0]))
    graphs._derive_inputs(4)
    assert graphs.positions[:4].tolist() == [9, 1, 0, 0]
    assert graphs.rope_positions[:4].tolist() == [4, 1, 0, 0]
    assert graphs.slot_mapping[:4].tolist() == [9 * 4 + 1, 5 * 4 + 1, -1, -1]
    assert buffers.block_table[:2, :3].tolist() == block_rows.tolist()
