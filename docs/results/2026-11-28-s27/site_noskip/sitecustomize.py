# The engine as before this session's 2.22 change, for A/B runs in the same tree
# (PYTHONPATH=docs/results/2026-11-28-s27/site_noskip): every step's proposal made
# (no Proposer.skip_ahead) and the per-step checks in numpy (no one-by-one path).
from pagelm.plugins.spec_decode import DraftProposer, drafting

DraftProposer.skip_ahead = lambda self, requests: False
drafting.SCALAR_BATCH = 0
