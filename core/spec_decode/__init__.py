"""Speculative decoding: the ``Proposer`` contract that draft plugins implement (the
drafting itself, ``ngram``, ``eagle`` and ``medusa`` are in ``pagelm.plugins.spec_decode``),
``speculative_config`` parsing and acceptance counters. Verification is
``pagelm.sample.rejection_sampler`` and ``pagelm.worker.spec_decode``."""

from pagelm.spec_decode.config import SpeculativeConfig
from pagelm.spec_decode.proposer import (
    DeviceDrafts, DraftGraphSetup, FinishedStep, Proposer, RequestView, TargetPass, VerificationBuffers,
)
from pagelm.spec_decode.stats import SpecDecodingStats

__all__ = [
    "DeviceDrafts", "DraftGraphSetup", "FinishedStep", "Proposer", "RequestView", "SpecDecodingStats",
    "SpeculativeConfig", "TargetPass", "VerificationBuffers",
]
