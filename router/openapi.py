"""The router's published OpenAPI schema, made to say what the router really does.

The generation endpoints read their JSON body themselves (so that every invalid body gets OpenAI's 400 error
object, never FastAPI's 422), which leaves FastAPI's generated schema without a request body. This module
adds the bodies (CompletionRequest, ChatCompletionRequest, ResponsesRequest, Anthropic's MessagesRequest and
CountTokensRequest; required), the 200 answers (JSON, or an SSE stream when `stream` is true) and the error
answers every endpoint can give, as the ErrorResponse shape (AnthropicErrorResponse on /v1/messages and
below). Clients, and schemathesis in tests/test_api_fuzz.py, read it from /openapi.json. The chat request's tool and
format fields (tools, tool_choice, parallel_tool_calls, response_format, a message's tool_calls and tool_call_id)
and the answer's tool_calls come from the pydantic models; the fields router/openai/fields.py refuses are read
but left out of the schema (`SkipJsonSchema`), so a client generated from it never sends them.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from router.anthropic.output import AnthropicErrorResponse, CountTokensResponse, MessageResponse
from router.anthropic.request import CountTokensRequest, MessagesRequest
from router.errors import is_anthropic_path
from router.openai.request import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                  CompletionResponse, ErrorResponse)
from router.responses.output import ResponseObject
from router.responses.request import ResponsesRequest

_GENERATION = {"/v1/completions": (CompletionRequest, CompletionResponse),
               "/v1/chat/completions": (ChatCompletionRequest, ChatCompletionResponse),
               "/v1/responses": (ResponsesRequest, ResponseObject),
               "/v1/messages": (MessagesRequest, MessageResponse),
               "/v1/messages/count_tokens": (CountTokensRequest, CountTokensResponse)}
_NOT_STREAMED = ("/v1/messages/count_tokens",)
_ERRORS = {"400": "invalid request (the message says what to change)", "401": "missing or wrong API key",
           "404": "no such model or path", "413": "request body too large",
           "503": "the engine cannot take it now (Retry-After when transient)",
           "504": "the engine produced nothing within the request timeout"}


_PROMPT = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer", "minimum": 0}},
                     {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
                     {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                      "minItems": 1, "maxItems": 1}],
           "description": "text, token ids, or a one-element list of either"}


def _ref(model: type[BaseModel], components: dict) -> dict:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, sub in [*schema.pop("$defs", {}).items(), (model.__name__, schema)]:
        if components.setdefault(name, sub) != sub:  # two models of one name: one would publish the other's shape
            raise ValueError(f"two different models publish the schema {name!r}: rename one of them")
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def install_openapi(app: FastAPI) -> None:
    """Replace `app.openapi` with the generated schema completed as described in the module docstring."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version="1", summary=app.summary, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        openai_error = {"content": {"application/json": {"schema": _ref(ErrorResponse, components)}}}
        anthropic_error = {"content": {"application/json": {"schema": _ref(AnthropicErrorResponse, components)}}}
        for path, methods in schema.get("paths", {}).items():
            error = anthropic_error if is_anthropic_path(path) else openai_error
            for op in methods.values():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)  # never sent: schema errors are 400
                for code, text in _ERRORS.items():
                    responses.setdefault(code, {"description": text, **error})
                if path == "/metrics":
                    responses["200"] = {"description": "Prometheus text exposition",
                                        "content": {"text/plain": {"schema": {"type": "string"}}}}
                if path in _GENERATION:
                    body, answer = _GENERATION[path]
                    op["requestBody"] = {"required": True,
                                         "content": {"application/json": {"schema": _ref(body, components)}}}
                    if body is CompletionRequest:  # the validator also takes OpenAI's one-element batch forms
                        components["CompletionRequest"]["properties"]["prompt"] = _PROMPT
                    responses["200"] = {"description": "the answer, or with `stream: true` an SSE stream of chunks",
                                        "content": {"application/json": {"schema": _ref(answer, components)},
                                                    "text/event-stream": {"schema": {}}}}  # JSON chunks, then [DONE]
                    if path in _NOT_STREAMED:
                        responses["200"] = {"description": "the answer",
                                            "content": {"application/json": {"schema": _ref(answer, components)}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
