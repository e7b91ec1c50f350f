"""The OpenAI-compatible HTTP server (``pagelm serve``): FastAPI app, pydantic schemas,
OpenAI-format errors."""

# Samples one request may ask for (``--max-n``): each is a sequence in the engine, and
# n = 100000 held the server for minutes (vLLM's CVE-2026-34756 class). Here, not in
# serving.py, so that the CLI can show it without importing FastAPI.
DEFAULT_MAX_N = 128
# Sequences one request may put in the engine (``--max-sequences-per-request``): prompts x n.
# A 100 KB completions body with 20,000 one-token prompts queued 20,000 sequences.
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 1024
# Largest request body (``--max-request-body-bytes``): a 413 beyond it, before it is read.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20
# Stop strings one request may give (``--max-stop-strings``): each is searched for after every
# token, in the API process; 10,000 of them cost every other stream there.
DEFAULT_MAX_STOP_STRINGS = 128
# Largest request head, the request line and headers (``--max-header-bytes``): a 431 beyond
# it. httptools has no limit of its own, so a 1 GB header was read into memory (vLLM's
# CVE-2025-48956 class).
DEFAULT_MAX_HEADER_BYTES = 64 << 10
