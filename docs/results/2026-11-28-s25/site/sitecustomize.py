import os
if os.environ.get("S25_OLD_SAMPLER"):
    import pagelm.sample.sampler as S
    S.sample_from_probs = lambda probs, generators, generator, q=None: S.exponential_race(probs, generators, generator, q)
