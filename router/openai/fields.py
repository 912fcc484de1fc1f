"""Which OpenAI request fields the router honours, accepts as metadata, or refuses (nothing passes silently).

Every key of the openai SDK's request TypedDicts (`openai.types.chat.completion_create_params` and
`openai.types.completion_create_params`, base, streaming and non-streaming) is in exactly one of these sets
(tests/test_api_field_audit.py walks them):

    HONOURED   the router does what the field asks
    METADATA   accepted, with no effect on the output, as vLLM accepts them: OpenAI uses them for abuse
               tracking, dashboards or its own cache routing (`prompt_cache_key`: mlx-pd's prefix cache is
               automatic and content-addressed, so a key adds nothing)
    REFUSED    a 400 naming the field and saying what to send instead, unless the value is one that asks for
               what the router does anyway (e.g. `store: false`, `service_tier: "auto"`, `modalities:
               ["text"]`, `best_of: 1`)

Unknown keys (not in the SDK) are ignored, as OpenAI does. Message fields are audited the same way
(`MESSAGE_REFUSED`); content parts other than text are refused where messages are validated.
"""

from __future__ import annotations

from router.request_model import Refusal, absent, one_of

CHAT_HONOURED = frozenset({
    "model", "messages", "stream", "stream_options", "n", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs", "seed", "stop",
    "tools", "tool_choice", "parallel_tool_calls", "response_format"})
COMPLETION_HONOURED = frozenset({
    "model", "prompt", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "frequency_penalty",
    "presence_penalty", "logit_bias", "logprobs", "seed", "stop", "echo"})
CHAT_METADATA = frozenset({"user", "metadata", "safety_identifier", "prompt_cache_key"})
COMPLETION_METADATA = frozenset({"user"})

CHAT_REFUSED: dict[str, Refusal] = {
    "audio": Refusal(absent, "audio output is not served (this server generates text): leave audio out"),
    "modalities": Refusal(one_of(["text"]), "only text output is served: leave modalities out or send [\"text\"]"),
    "prediction": Refusal(absent, "predicted outputs are not supported: leave prediction out"),
    "web_search_options": Refusal(absent, "web search is not available on this server: leave web_search_options "
                                           "out"),
    "store": Refusal(one_of(False), "completions are not stored on this server: leave store out or send false"),
    "service_tier": Refusal(one_of("auto", "default"),
                            "this server has one service tier: leave service_tier out or send \"auto\""),
    "reasoning_effort": Refusal(absent, "this server runs no reasoning-effort control: leave reasoning_effort "
                                         "out"),
    "verbosity": Refusal(absent, "verbosity control is not supported: leave verbosity out and say how long "
                                  "an answer should be in the messages"),
    "functions": Refusal(absent, "the deprecated functions field is not supported: send each function as "
                                  "tools=[{\"type\": \"function\", \"function\": {...}}]"),
    "function_call": Refusal(absent, "the deprecated function_call field is not supported: send tool_choice "
                                      "(\"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                      "\"function\": {\"name\": ...}})"),
    "moderation": Refusal(absent, "moderation is not run on this server: leave moderation out"),
    "prompt_cache_options": Refusal(absent, "the prefix cache is automatic (content-addressed, in memory): "
                                             "leave prompt_cache_options out"),
    "prompt_cache_retention": Refusal(one_of("in_memory"), "the prefix cache lives in memory only: leave "
                                                            "prompt_cache_retention out or send \"in_memory\""),
}
COMPLETION_REFUSED: dict[str, Refusal] = {
    "best_of": Refusal(one_of(1), "best_of > 1 is not supported: leave it out (or 1) and use n for several "
                                   "completions"),
    "suffix": Refusal(one_of(""), "suffix (fill-in-the-middle) is not supported: leave suffix out"),
}
MESSAGE_REFUSED: dict[str, Refusal] = {
    "audio": Refusal(absent, "earlier audio answers cannot be replayed: leave the message's audio out"),
    "function_call": Refusal(absent, "the deprecated function_call of a message is not supported: send the "
                                      "call as tool_calls=[{\"id\", \"type\": \"function\", \"function\": {...}}]"),
    "refusal": Refusal(absent, "a refusal of an earlier answer cannot be replayed: send it as the message's "
                                "content"),
}
