"""Unknown request fields: ignored, unless the key misspells a field the API knows or belongs to another API;
then a 400 names the key by its JSON path and says what to send instead (router/request_model.py)."""

from __future__ import annotations

import pytest

from router.anthropic.request import MessagesRequest
from router.body import parse_body
from router.errors import APIError
from router.openai.request import ChatCompletionRequest, CompletionRequest
from router.request_model import edit_distance, near_miss
from router.responses.request import ResponsesRequest

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}
ANTHROPIC = {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
RESPONSES = {"input": "Hi"}


def refused(model, body) -> APIError:
    with pytest.raises(APIError) as exc:
        parse_body(model, body)
    assert exc.value.status == 400
    return exc.value


def test_edit_distance_counts_insertions_deletions_substitutions_and_adjacent_swaps():
    assert edit_distance("max_tokens", "max_tokens") == 0
    assert edit_distance("max_token", "max_tokens") == 1
    assert edit_distance("schmea", "schema") == 1  # one swap
    assert edit_distance("top_a", "top_k") == 1
    assert edit_distance("kitten", "sitting") == 3


def test_near_misses_are_close_names_of_four_characters_or_more():
    known = ["max_tokens", "response_format", "schema", "top_k", "n", "stop"]
    assert near_miss("respone_format", known) == "response_format"
    assert near_miss("Max-Tokens", known) == "max_tokens"
    assert near_miss("stpo", known) == "stop"
    assert near_miss("nn", known) is None  # too short to tell a typo from another vendor's field
    assert near_miss("cache_salt_v2", known) is None and near_miss("foo_bar", known) is None


@pytest.mark.parametrize("model, body, param, says", [
    (ChatCompletionRequest, {**CHAT, "max_token": 5}, "max_token", "max_tokens"),
    (ChatCompletionRequest, {**CHAT, "respone_format": {"type": "json_object"}}, "respone_format", "response_format"),
    (ChatCompletionRequest, {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schmea": {"type": "object"}}}}, "response_format.json_schema.schmea", "'schema'"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "contnet": "Hi"}]}, "messages[0].contnet", "'content'"),
    (ChatCompletionRequest, {**CHAT, "max_output_tokens": 5}, "max_output_tokens", "max_completion_tokens"),
    (CompletionRequest, {"prompt": "Hi", "max_tokesn": 3}, "max_tokesn", "max_tokens"),
    (ResponsesRequest, {**RESPONSES, "max_tokens": 5}, "max_tokens", "max_output_tokens"),
    (ResponsesRequest, {**RESPONSES, "response_format": {"type": "json_object"}}, "response_format", "text.format"),
    (ResponsesRequest, {**RESPONSES, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools[0].function", "flat"),
    (ResponsesRequest, {**RESPONSES, "instructons": "Be brief."}, "instructons", "instructions"),
    (MessagesRequest, {**ANTHROPIC, "stop": ["x"]}, "stop", "stop_sequences"),
    (MessagesRequest, {**ANTHROPIC, "stop_sequence": ["x"]}, "stop_sequence", "stop_sequences"),
])
def test_a_misspelled_or_other_apis_field_is_a_400_naming_it_and_what_to_send(model, body, param, says):
    error = refused(model, body)
    assert error.param == param and error.message.startswith(param + ": ")
    assert says in error.message


def test_unknown_fields_that_misspell_nothing_are_still_ignored():
    """Another vendor's extension (or a field from a newer client) passes, as OpenAI-compatible servers do."""
    assert parse_body(ChatCompletionRequest, {**CHAT, "chat_template_kwargs": {"x": 1}, "guided_foo": 1})
    assert parse_body(ResponsesRequest, {**RESPONSES, "some_new_field": True})
    assert parse_body(MessagesRequest, {**ANTHROPIC, "vendor_extension": {}})
