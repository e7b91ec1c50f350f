"""Built-in speculative proposers (``ngram``, ``eagle``), each a plugin module registered
through ``pagelm.plugins``."""
