"""Schema-driven fuzzing of the OpenAI API: whatever a client sends, never a 5xx.

Bodies come from the OpenAPI document the server itself serves (/openapi.json),
both inside the schema and outside it (wrong types, missing fields). The run
is bounded and derandomized, so it is the same few hundred requests every time.
"""

import collections

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from tests.server.conftest import TINY_ENGINE, engine_flags
from tests.server.serverproc import ServerProcess

pytestmark = pytest.mark.integration

# A short context and a small fan-out cap keep every accepted request cheap, so
# the examples stay a few seconds of engine time in all.
CONTEXT = 64
POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
# (path, method, modes): a GET's only input, a path string, has no invalid values
OPERATIONS = [
    ("/v1/completions", "POST", (POSITIVE, NEGATIVE)),
    ("/v1/chat/completions", "POST", (POSITIVE, NEGATIVE)),
    ("/v1/responses", "POST", (POSITIVE, NEGATIVE)),
    ("/tokenize", "POST", (POSITIVE, NEGATIVE)),
    ("/v1/models", "GET", (POSITIVE,)),
    ("/v1/models/{model_id}", "GET", (POSITIVE,)),
]
CASES = [(path, method, mode) for path, method, modes in OPERATIONS for mode in modes]
MAX_EXAMPLES = 50


@pytest.fixture(scope="module")
def fuzz_server(server_model_dir):
    with ServerProcess(
        "--model",
        server_model_dir,
        "--threads",
        "1",
        *engine_flags(**TINY_ENGINE),
        "--max-model-len",
        str(CONTEXT),
        "--max-seqs-per-request",
        "8",
        "--max-request-body-bytes",
        "65536",
    ) as server:
        yield server


@pytest.fixture(scope="module")
def schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


@pytest.mark.parametrize("path,method,mode", CASES, ids=[f"{m} {p} {g.value}" for p, m, g in CASES])
def test_no_server_errors(fuzz_server, schema, path, method, mode):
    statuses = []
    refusals = collections.Counter()  # which field each 400 named: why, when none got through

    @settings(
        max_examples=MAX_EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(schema[path][method].as_strategy(generation_mode=mode))
    def check(case):
        r = case.call(base_url=fuzz_server.url, timeout=60)
        statuses.append(r.status_code)
        if r.status_code == 400:
            try:
                refusals[r.json()["error"].get("param")] += 1
            except (ValueError, KeyError, TypeError, AttributeError):
                refusals["?"] += 1
        assert r.status_code < 500, f"{case.method} {case.formatted_path} {case.body!r} -> {r.status_code} {r.text}"

    check()
    # the schema let some requests through to the engine (its example, at least, which the
    # OpenAPI document shows for each route: which generated requests pass varies)
    if mode is POSITIVE and method == "POST":
        assert 200 in statuses, (statuses, refusals)


def test_server_still_serves_after_fuzzing(fuzz_server):
    """Runs after the fuzz cases above (file order): the engine is alive, idle and correct."""
    h = fuzz_server.wait_idle(60)
    assert h["status"] == "ok" and h["num_free_blocks"] == h["num_blocks"], h
    r = httpx.post(
        fuzz_server.url + "/v1/completions",
        timeout=30,
        json={"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert "Traceback" not in fuzz_server.log()
