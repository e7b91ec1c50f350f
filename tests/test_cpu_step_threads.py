"""On a CPU the engine core runs a long step's forward pass on every core and everything
else on the share it leaves the API process (``pagelm.worker.cpu_threads``). The thread
count follows each step's size, and it does not change what the engine computes."""

import pytest
import torch
import torch.nn.functional as F

from pagelm import LLM, SamplingParams
from pagelm.worker import cpu_threads
from pagelm.worker.cpu_threads import StepThreads

two_cores = pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs two CPU threads")


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    cpu_threads.set_step_threads(None)
    torch.set_num_threads(before)


def test_long_forward_passes_get_every_core(restore_threads):
    cpu_threads.set_step_threads(StepThreads(few=1, many=2, min_tokens=512))
    seen = []
    for num_tokens in (16, 511, 512, 2048, 17):
        with cpu_threads.forward_threads(num_tokens):
            seen.append(torch.get_num_threads())
        seen.append(torch.get_num_threads())
    assert seen == [1, 1, 1, 1, 2, 1, 2, 1, 1, 1]


def test_without_a_policy_threads_are_left_alone(restore_threads):
    torch.set_num_threads(1)
    with cpu_threads.forward_threads(100_000):
        assert torch.get_num_threads() == 1


@two_cores
@pytest.mark.parametrize("k,n", [(256, 768), (256, 1376), (688, 256), (256, 2048)])
def test_long_gemms_round_the_same_on_two_threads(restore_threads, k, n):
    """What the split relies on: a GEMM of ``MIN_TOKENS_FOR_ALL_CORES`` rows or more gives the
    same bits on one thread and on two (MKL's few-row GEMMs do not: that is why the LM head
    and short steps keep the default share)."""
    gen = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=gen)
    for m in (cpu_threads.MIN_TOKENS_FOR_ALL_CORES, 777, 2048):
        x = torch.randn(m, k, generator=gen)
        torch.set_num_threads(1)
        one = F.linear(x, w)
        torch.set_num_threads(2)
        assert torch.equal(F.linear(x, w), one), m


@two_cores
def test_engine_outputs_do_not_change_with_the_thread_split(llama_dir, restore_threads, monkeypatch):
    """Prompts long enough that the first steps run on two threads, then decode steps on one:
    every token and logprob equals a run on one thread throughout."""
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 200 + 5 for j in range(40 + 9 * i)]} for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)

    def run(policy):
        cpu_threads.set_step_threads(policy)
        llm = LLM(str(llama_dir), max_model_len=256, max_num_seqs=8, attention_backend="torch")
        outs = llm.generate(prompts, params)
        return [(o.outputs[0].token_ids, [sorted((t, p.logprob) for t, p in d.items()) for d in o.outputs[0].logprobs])
                for o in outs]

    counts = []
    real_set = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (counts.append(n), real_set(n))[-1])
    split = run(StepThreads(few=1, many=2, min_tokens=64))
    assert 2 in counts and counts[-1] == 1  # the prefill steps on two threads, the rest on one
    assert split == run(StepThreads(few=1, many=1))
