"""Property-based fuzzing of a real `pagelm serve` from its own OpenAPI schema (schemathesis):
requests that fit the schema and requests that break it, for every operation, must never get
a 5xx, and the server must still answer /health afterwards.

Bounded for CI: a fixed number of examples per operation, replayed the same on every run
(derandomized: a failure here is a bug, never luck), no shrinking, and a time limit per
request so that a hang fails instead of stalling the suite (about 40 s on two CPU cores).
PAGELM_FUZZ_EXAMPLES=500 runs a longer, still derandomized, search by hand.
"""

import os
from datetime import timedelta

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error

from test_server import running_server

EXAMPLES = int(os.environ.get("PAGELM_FUZZ_EXAMPLES", "30"))


@pytest.fixture(scope="module")
def fuzz_server(llama_dir):
    # Short sequences and few samples keep each generated completion cheap.
    with running_server(
        str(llama_dir), "--served-model-name", "tiny", "--num-kv-blocks", "64", "--max-model-len", "64",
        "--max-n", "4", "--max-logprobs", "5",
    ) as url:
        yield url


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(f"{fuzz_server}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=EXAMPLES, derandomize=True, deadline=timedelta(seconds=20), phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck), database=None,
)
def test_no_request_the_schema_generates_gets_a_5xx(case, fuzz_server):
    case.call_and_validate(base_url=fuzz_server, checks=[not_a_server_error], timeout=20)


def test_the_server_still_serves_after_the_fuzzing(fuzz_server):
    assert httpx.get(f"{fuzz_server}/health", timeout=10).status_code == 200
    r = httpx.post(f"{fuzz_server}/v1/completions", json={"prompt": "hello", "max_tokens": 3, "ignore_eos": True},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
