"""Token sampling: batched logits processing and per-request seeded draws."""

from pagelm.sample.metadata import SamplingMetadata
from pagelm.sample.sampler import LogprobsTensors, Sampler, SamplerOutput

__all__ = ["LogprobsTensors", "Sampler", "SamplerOutput", "SamplingMetadata"]
