import os
if os.environ.get("S26_DEEP") or os.environ.get("S26_PROBE") or os.environ.get("S26_PROBATION"):
    import pagelm.plugins.spec_decode.backoff as b
    if os.environ.get("S26_DEEP"): b.DEEP_BACKOFF_MISSES = int(os.environ["S26_DEEP"])
    if os.environ.get("S26_PROBE"): b.PROBE_DRAFTS = int(os.environ["S26_PROBE"])
    if os.environ.get("S26_PROBATION"): b.PROBATION = os.environ["S26_PROBATION"] == "1"
if os.environ.get("S26_GAIN"):
    import pagelm.plugins.spec_decode.backoff as b
    b.MIN_GAIN = float(os.environ["S26_GAIN"])
if os.environ.get("S26_ALPHA") or os.environ.get("S26_START"):
    import pagelm.plugins.spec_decode.backoff as b
    if os.environ.get("S26_ALPHA"): b.GAIN_ALPHA = float(os.environ["S26_ALPHA"])
    if os.environ.get("S26_START"): b.GAIN_START = float(os.environ["S26_START"])
