"""API fuzzing: schemathesis generates requests from the router's own OpenAPI schema, valid and
invalid, for every endpoint; the router must never answer 5xx, must answer in the schema it publishes, and
must stay healthy. The engine is the deterministic FakeEngine (tests/router_fakes.py): what is fuzzed here is
the HTTP layer (validation, errors, streaming), quickly enough for CI. `scripts/reliability` runs the same
against the real model with more examples."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                 status_code_conformance)

from router.app import create_app
from tests.router_fakes import MODEL, FakeEngine, load_tokenizer

_tok = load_tokenizer()
_engine = FakeEngine(_tok)
app = create_app(_engine, _tok, served_model_names=[MODEL])
schema = schemathesis.openapi.from_asgi("/openapi.json", app)


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_router_never_answers_5xx_and_keeps_its_schema(case):
    response = case.call()
    assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:300])
    # The answers' conformance to the published schema. Whether the router accepts exactly the inputs the
    # schema allows (schemathesis' positive/negative data checks) is covered case by case in test_router_*.
    case.validate_response(response, checks=(not_a_server_error, status_code_conformance, content_type_conformance,
                                             response_schema_conformance))


def test_router_is_healthy_after_fuzzing():
    from starlette.testclient import TestClient

    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
