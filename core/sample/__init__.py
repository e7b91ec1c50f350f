"""Token sampling: batched logits processing and per-request seeded draws; the rejection
sampler that verifies speculative drafts."""

from pagelm.sample.metadata import SamplingMetadata
from pagelm.sample.rejection_sampler import RejectionSampler, RejectionSamplerOutput
from pagelm.sample.sampler import LogprobsTensors, Sampler, SamplerOutput

__all__ = [
    "LogprobsTensors",
    "RejectionSampler",
    "RejectionSamplerOutput",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
]
