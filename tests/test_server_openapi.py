"""Issue 56, item 8: `/openapi.json` is true. schemathesis generates requests from the document
served by a running server (the course model), sends them over HTTP and validates every real
response against it: status codes documented, media types documented, bodies matching their
schemas, never a 500. Bounded: a few dozen requests per operation."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from kvlib.engine import LLMEngine
from kvlib.serve.server import ServerThread, create_app
from tests import test_server
from tests.test_server import ENGINE

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

model, served = test_server.model, test_server.served  # the course model and its fixtures


@pytest.fixture(scope="module")
def running(served):
    engine = LLMEngine(served.model, **{**ENGINE, "max_model_len": 256})
    with ServerThread(create_app(served, engine)) as thread:
        yield thread


@pytest.fixture(scope="module")
def api_schema(running):
    return schemathesis.openapi.from_url(running.root_url + "/openapi.json")


def test_the_document_states_what_fastapi_got_wrong(running):
    document = httpx.get(running.root_url + "/openapi.json").json()
    operations = [op for path in document["paths"].values() for op in path.values()]
    assert all("422" not in op["responses"] for op in operations)
    assert "content" not in document["paths"]["/health"]["get"]["responses"]["200"]
    metrics = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    completions = document["paths"]["/v1/completions"]["post"]["responses"]
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    assert {"400", "404", "413", "429"} <= set(completions)
    request = document["components"]["schemas"]["CompletionRequest"]["properties"]
    assert request["model"]["enum"] == ["course"] and request["echo"]["enum"] == [False, None]


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


@pytest.mark.timeout(300)
def test_real_responses_conform_to_the_document(api_schema, running):
    """Each operation: 25 generated requests (schemathesis' strategies, run by hypothesis here:
    its pytest plugin does not run under pytest 9), every response checked."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) == 5

    for operation in operations:

        @settings(
            max_examples=25,
            deadline=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        @given(case=operation.as_strategy())
        def check(case):
            if isinstance(case.body, dict):  # bounded work: max_tokens may reach the context
                for field in ("max_tokens", "max_completion_tokens"):
                    if isinstance(case.body.get(field), int) and case.body[field] > 8:
                        case.body[field] = 8
            case.call_and_validate(base_url=running.root_url, checks=CHECKS)

        check()
