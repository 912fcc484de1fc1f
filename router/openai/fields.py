"""Which OpenAI request fields the router honours, accepts with a stated effect, or refuses.

The rule: a field is refused by name only when ignoring it would change the answer (audio out, web search, the
deprecated `functions`); a hint, a field the server already satisfies, or one that is a no-op here is accepted,
and what the server does with it is stated (`*_ACCEPTED` maps each key to that sentence; docs/API-FIELDS.md is
the table, and tests/test_api_field_audit.py checks both against the SDK). Every key of the openai SDK's request
TypedDicts (`openai.types.chat.completion_create_params` and `openai.types.completion_create_params`, base,
streaming and non-streaming) is in exactly one of:

    HONOURED   the router does what the field asks
    ACCEPTED   accepted; the stated effect is what happens (metadata kept by nobody, hints no template reads,
               the prefix cache that is automatic anyway, one service tier)
    REFUSED    a 400 naming the field and saying what to send instead, unless the value is one that asks for
               what the router does anyway (e.g. `modalities: ["text"]`, `best_of: 1`)

Unknown keys (not in the SDK) are ignored, as OpenAI does. Message fields are audited the same way
(`MESSAGE_REFUSED`); content parts other than text are refused where messages are validated.
"""

from __future__ import annotations

from router.request_model import Refusal, absent, one_of

CHAT_HONOURED = frozenset({
    "model", "messages", "stream", "stream_options", "n", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs", "seed", "stop",
    "tools", "tool_choice", "parallel_tool_calls", "response_format", "reasoning_effort"})
COMPLETION_HONOURED = frozenset({
    "model", "prompt", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "frequency_penalty",
    "presence_penalty", "logit_bias", "logprobs", "seed", "stop", "echo"})
_METADATA = "metadata for the caller's own records: kept nowhere, no effect on the answer"
_CACHE = "the prefix cache is automatic, content-addressed and in memory: it is used whatever this says"
CHAT_ACCEPTED: dict[str, str] = {
    "user": _METADATA, "metadata": _METADATA, "safety_identifier": _METADATA,
    "prompt_cache_key": _CACHE, "prompt_cache_options": _CACHE, "prompt_cache_retention": _CACHE,
    "store": "nothing is stored: the answer is the same either way",
    "service_tier": "one service tier: every request is served alike (the answer reports \"default\")",
    "prediction": "a speed hint: decoding uses its own drafts; the answer is the same",
    "moderation": "no moderation is run: the answer is the model's",
    "verbosity": "a hint that no chat template reads: the model is not told (say it in the messages)",
}
COMPLETION_ACCEPTED: dict[str, str] = {"user": _METADATA}

CHAT_REFUSED: dict[str, Refusal] = {
    "audio": Refusal(absent, "audio output is not served (this server generates text): leave audio out"),
    "modalities": Refusal(one_of(["text"]), "only text output is served: leave modalities out or send [\"text\"]"),
    "web_search_options": Refusal(absent, "web search is not available on this server: leave web_search_options "
                                           "out"),
    "functions": Refusal(absent, "the deprecated functions field is not supported: send each function as "
                                  "tools=[{\"type\": \"function\", \"function\": {...}}]"),
    "function_call": Refusal(absent, "the deprecated function_call field is not supported: send tool_choice "
                                      "(\"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                      "\"function\": {\"name\": ...}})"),
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
# Fields beyond the SDK's and parts of honoured keys: the details docs/API-FIELDS.md lists.
CHAT_DETAILS: dict[str, str] = {
    "reasoning_effort": "a thinking model's switch and effort level in its chat template (none/minimal: off; a "
                        "model without a switch gets a budget of 0); no effect on a model that does not reason",
    "thinking_token_budget": "vLLM's extension: the engine ends the reasoning after that many tokens by forcing "
                             "the end marker (clamped to max_tokens)",
    "chat_template_kwargs": "vLLM's extension: more template variables, applied last (the router's own and the "
                            "template's functions are refused by name)",
    "messages[].reasoning_content, messages[].reasoning": "an earlier turn's reasoning, handed to the template "
                                                          "(as reasoning_content and thinking)",
}
