"""API fuzzing: schemathesis generates requests from the router's own OpenAPI schema, valid and
invalid, for every endpoint; the router must never answer 5xx, must answer in the schema it publishes, and
must stay healthy. The engine is the deterministic FakeEngine (tests/router_fakes.py): what is fuzzed here is
the HTTP layer (validation, errors, streaming), quickly enough for CI. Every operation the schema documents is
fuzzed, the Responses API (POST /v1/responses) and Anthropic's Messages API (POST /v1/messages and
/v1/messages/count_tokens) included; the Messages endpoints get a handful of examples and no coverage phase
(whose boundary values of every field of the nested content blocks take some 600 requests per endpoint; their
validation is checked case by case in tests/test_anthropic_api.py). `scripts/reliability` runs the same against
the real model with more examples."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                 status_code_conformance)

from router.app import create_app
from tests.router_fakes import MODEL, FakeEngine, load_tokenizer

_tok = load_tokenizer()
_engine = FakeEngine(_tok)
app = create_app(_engine, _tok, served_model_names=[MODEL])
_MESSAGES = {"include-path-regex": "^/v1/messages", "phases": {"coverage": {"enabled": False}},
             "generation": {"max-examples": 6}}
schema = schemathesis.openapi.from_asgi("/openapi.json", app,
                                        config=SchemathesisConfig.from_dict({"operations": [_MESSAGES]}))


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


def test_fuzzing_covers_the_responses_api():
    """The fuzzed operations include POST /v1/responses with its JSON body, and it answers a plain request after
    the fuzzing."""
    from starlette.testclient import TestClient

    operations = {(op.method, op.path): op for op in (r.ok() for r in schema.get_all_operations())}
    assert [b.media_type for b in operations[("post", "/v1/responses")].body] == ["application/json"]
    with TestClient(app) as client:
        r = client.post("/v1/responses", json={"model": MODEL, "input": "Hello", "max_output_tokens": 3})
        assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"]


def test_fuzzing_covers_the_anthropic_messages_api():
    """The fuzzed operations include POST /v1/messages and /v1/messages/count_tokens with their JSON bodies, and
    both answer a plain request after the fuzzing."""
    from starlette.testclient import TestClient

    operations = {(op.method, op.path): op for op in (r.ok() for r in schema.get_all_operations())}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        assert [b.media_type for b in operations[("post", path)].body] == ["application/json"]
    body = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "Hello"}]}
    with TestClient(app) as client:
        r = client.post("/v1/messages", json=body)
        assert r.status_code == 200 and r.json()["content"][0]["text"]
        r = client.post("/v1/messages/count_tokens", json=body)
        assert r.status_code == 200 and r.json()["input_tokens"] > 0
