import os
if os.environ.get("S25_HEAD_SKIPS"):
    from pagelm.plugins.spec_decode.eagle import EagleProposer
    EagleProposer.needs_ahead_target = False
