"""Built-in attention backends (each a plugin registered through ``pagelm.plugins``)."""
