"""Built-in structured-output (guided decoding) backends, each a plugin module registered
through ``pagelm.plugins``."""
