# Session 25: S25_NO_DEEP=1 puts adaptive drafting back as it was before the deep-backoff
# change (a draft model follows every step), for A/B runs of the same tree.
import os
if os.environ.get("S25_NO_DEEP"):
    from pagelm.plugins.spec_decode.backoff import DraftBackoff
    DraftBackoff.deep = lambda self, rows: False
