"""Which keys of OpenAI's Responses request POST /v1/responses honours, accepts with a stated effect, or refuses.

Every key of `openai.types.responses.response_create_params.ResponseCreateParamsBase` (and `stream`) is in
exactly one of these sets, the scheme of router/openai/fields.py (tests/test_responses_api.py walks them):

    RESPONSES_HONOURED   the server does what the key asks. `max_tool_calls` bounds calls to built-in tools,
                         of which this server runs none, so no response exceeds it; `include` takes the values
                         of INCLUDE_SERVED
    RESPONSES_ACCEPTED   accepted, with the effect stated beside each key
    RESPONSES_REFUSED    a 400 naming the key and saying what to send instead, unless the value asks for what
                         the server does anyway (`store: false`, `truncation: "disabled"`, ...)

The server is stateless: `previous_response_id`, `conversation`, `store: true` and `background: true` are
refused with a message that says to send the whole conversation in `input`.
"""

from __future__ import annotations

from typing import Any

from router.request_model import Refusal, absent, one_of


INCLUDE_LOGPROBS = "message.output_text.logprobs"


def _no_reasoning(value: Any) -> bool:
    return value is None or (isinstance(value, dict) and all(v is None for v in value.values()))


_STATELESS = "this server is stateless and stores nothing between requests: "
RESPONSES_HONOURED = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "stream_options",
    "tools", "tool_choice", "parallel_tool_calls", "text", "include", "top_logprobs", "max_tool_calls"})
_METADATA = "echoed in the Response; kept nowhere, no effect on the answer"
RESPONSES_ACCEPTED: dict[str, str] = {
    "metadata": _METADATA, "user": _METADATA, "safety_identifier": _METADATA,
    "prompt_cache_key": "echoed; the prefix cache is automatic and content-addressed, so a key adds nothing",
}
RESPONSES_REFUSED: dict[str, Refusal] = {
    "previous_response_id": Refusal(absent, _STATELESS + "send the whole conversation in input (earlier messages, "
                                    "function_call and function_call_output items) and leave previous_response_id "
                                    "out"),
    "conversation": Refusal(absent, _STATELESS + "send the whole conversation in input and leave conversation out"),
    "store": Refusal(one_of(False), _STATELESS + "leave store out or send false, and send the whole "
                                                    "conversation in input each time"),
    "background": Refusal(one_of(False), _STATELESS + "responses run in the foreground only (stream: true "
                                                         "reports progress); leave background out or send false and "
                                                         "send the whole conversation in input"),
    "background_options": Refusal(absent, "responses run in the foreground only: leave background_options out"),
    "prompt": Refusal(absent, _STATELESS + "it keeps no prompt templates; send the instructions and input "
                                           "themselves"),
    "reasoning": Refusal(_no_reasoning, "the served models do not reason apart, so there is no effort or "
                                        "summary to set: leave reasoning out"),
    "moderation": Refusal(absent, "moderation is not run on this server: leave moderation out"),
    "image": Refusal(absent, "this server's model reads text only: leave image out"),
    "access_programs": Refusal(absent, "this server has no access programs: leave access_programs out"),
    "context_management": Refusal(lambda v: v is None or v == [], "context compaction is not run on this "
                                  "server: leave context_management out and shorten the input"),
    "prompt_cache_options": Refusal(absent, "the prefix cache is automatic (content-addressed, in memory): "
                                            "leave prompt_cache_options out"),
    "prompt_cache_retention": Refusal(one_of("in_memory"), "the prefix cache lives in memory only: leave "
                                                              "prompt_cache_retention out or send \"in_memory\""),
    "service_tier": Refusal(one_of("auto", "default"), "this server has one service tier: leave service_tier "
                                                          "out or send \"auto\""),
    "truncation": Refusal(one_of("disabled"), "an input over the context is refused with a 400, never "
                                                 "truncated: leave truncation out or send \"disabled\""),
}
# `include` values: the logprobs of output text are served; the server makes no reasoning items, so their
# encrypted content is trivially included; every other value belongs to a tool or an input kind refused here.
INCLUDE_SERVED = (INCLUDE_LOGPROBS, "reasoning.encrypted_content")
