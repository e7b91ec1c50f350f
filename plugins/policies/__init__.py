"""Built-in scheduling policies, each a plugin module registered through ``pagelm.plugins``."""
