"""The conformance kit (``pagelm.testing.conformance``): checks a plugin author runs against a
scheduling policy, attention backend or proposer. Tiny model directories to run them on are
built by ``pagelm.models.testing``."""
