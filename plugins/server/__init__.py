"""The OpenAI-compatible HTTP server (``pagelm serve``): FastAPI app, pydantic schemas,
OpenAI-format errors."""
