"""Built-in feature plugins (scheduling policies, ...), registered like third-party ones."""
