"""The host's time between the two syncs of an EAGLE speculative step at llama-3.1-8b shapes,
without a profiler (issue 21): chosen functions wrapped with perf_counter during a batch-1
generation (k=3, random head, adaptive off, a 32,768-token draft vocabulary). The GPU is idle
from a sync's return until the next graph launch, so the two host segments of a step are:
  A: verification ids back (rejection sampler returns) -> drafting graph launched;
  B: drafts back (propose_step returns) -> next verification graph launched.
Prints each segment's median and the functions' inclusive time inside them, per step."""

import argparse
import collections
import functools
import statistics
import time

from pagelm import LLM, SamplingParams
from pagelm.plugins.bench.latency import add_parser, with_random_draft_head
from pagelm.plugins.bench.presets import resolve_bench_model
from pagelm.plugins.engine_args import engine_kwargs

import pagelm.worker.spec_decode as sd
from pagelm.engine.engine_core import EngineCore
from pagelm.sched.scheduler import Scheduler
from pagelm.worker.model_runner import ModelRunner
from pagelm.worker.cuda_graphs import CudaGraphRunner
from pagelm.sample.rejection_sampler import RejectionSampler
from pagelm.plugins.spec_decode.eagle_graphs import EagleDraftGraphs
from pagelm.plugins.spec_decode.drafting import DraftProposer
from pagelm.plugins.spec_decode.eagle import EagleProposer

events: list[tuple[str, float, float]] = []
recording = False


def wrap(owner, attr, name=None):
    fn = getattr(owner, attr)
    label = name or f"{getattr(owner, '__name__', owner)}.{attr}"

    @functools.wraps(fn)
    def timed(*a, **k):
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            if recording:
                events.append((label, start, time.perf_counter()))

    setattr(owner, attr, timed)


for owner, attr in [
    (EngineCore, "_schedule"), (EngineCore, "_finish"), (Scheduler, "update_from_output"), (ModelRunner, "launch"),
    (ModelRunner, "finish"), (sd.SpecDecodeRunner, "execute"), (sd.SpecDecodeRunner, "_graph_step"),
    (sd.SpecDecodeRunner, "propose"), (sd.SpecDecodeRunner, "_target_pass"), (RejectionSampler, "__call__"),
    (sd, "build_sampling_metadata"), (sd, "_split_logprobs"), (sd, "checked_drafts"), (CudaGraphRunner, "replay"),
    (CudaGraphRunner, "load"), (EagleDraftGraphs, "replay"), (EagleDraftGraphs, "load_step"), (EagleDraftGraphs, "_stage"),
    (DraftProposer, "propose_step"), (EagleProposer, "propose"), (ModelRunner, "prepare_inputs"),
]:
    wrap(owner, attr)

parser = argparse.ArgumentParser()
add_parser(parser.add_subparsers())
args = parser.parse_args(["latency", "--model", "llama-3.1-8b", "--max-model-len", "1024", "--max-num-seqs", "8"])
model_dir, base = resolve_bench_model(args.model, engine_kwargs(args))
spec = {"method": "eagle", "num_speculative_tokens": 3, "adaptive": False, "draft_vocab_size": 32768}
llm = LLM(model_dir, **{**base, "speculative_config": with_random_draft_head(model_dir, spec)})
prompt = {"prompt_token_ids": list(range(1000, 1128))}
params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
llm.generate([prompt], params, use_tqdm=False)
for run in range(2):
    events.clear()
    recording = True
    out = llm.generate([prompt], params, use_tqdm=False)
    recording = False
    m = out[0].metrics
    print(f"run {run}: TPOT {(m.finished_time - m.first_token_time) / 127 * 1e3:.3f} ms")
    ends = lambda n: sorted(e for l, s, e in events if l == n)  # noqa: E731
    starts = lambda n: sorted(s for l, s, e in events if l == n)  # noqa: E731
    verified = ends("RejectionSampler.__call__")
    draft_launch = starts("EagleDraftGraphs.replay")
    drafts_back = ends("DraftProposer.propose_step")
    verify_launch = starts("CudaGraphRunner.replay")
    segments = {"A": [], "B": []}
    for v in verified:
        nxt = next((d for d in draft_launch if d > v), None)
        if nxt is not None:
            segments["A"].append((v, nxt))
    for d in drafts_back:
        nxt = next((x for x in verify_launch if x > d), None)
        if nxt is not None:
            segments["B"].append((d, nxt))
    for seg, spans in segments.items():
        spans = spans[2:-2]  # steady steps
        if not spans:
            continue
        lengths = [b - a for a, b in spans]
        inside = collections.Counter()
        for label, s, e in events:
            for a, b in spans:
                o = min(e, b) - max(s, a)
                if o > 0:
                    inside[label] += o
        print(f"  segment {seg}: {len(spans)} steps, median {statistics.median(lengths) * 1e3:.3f} ms, "
              f"mean {statistics.mean(lengths) * 1e3:.3f} ms")
        for label, t in inside.most_common(12):
            print(f"    {t / len(spans) * 1e3:7.3f} ms/step  {label}")
