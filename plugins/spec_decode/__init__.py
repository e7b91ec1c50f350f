"""Speculative decoding's drafting side and the built-in proposers (``ngram``, ``eagle``,
``medusa``), each a plugin module registered through ``pagelm.plugins``. ``DraftProposer`` is
the base they share (which requests draft how many tokens, adaptive back-off, the token
history); a third-party proposer may subclass it too."""

from pagelm.plugins.spec_decode.drafting import DraftProposer, ProposalBatch

__all__ = ["DraftProposer", "ProposalBatch"]
