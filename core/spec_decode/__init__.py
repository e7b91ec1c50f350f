"""Speculative decoding: the ``Proposer`` ABC that draft plugins implement (``ngram``,
``eagle``), ``speculative_config`` parsing and acceptance counters. Verification is
``pagelm.sample.rejection_sampler``."""

from pagelm.spec_decode.config import SpeculativeConfig
from pagelm.spec_decode.proposer import ProposalBatch, Proposer
from pagelm.spec_decode.stats import SpecDecodingStats

__all__ = ["ProposalBatch", "Proposer", "SpecDecodingStats", "SpeculativeConfig"]
