"""Which keys of OpenAI's Responses request POST /v1/responses honours, accepts with a stated effect, or refuses.

Every key of `openai.types.responses.response_create_params.ResponseCreateParamsBase` (and `stream`) is in
exactly one of these sets, by the rule of router/openai/fields.py: refused by name only what would change the
answer if ignored (tests/test_responses_api.py walks them; docs/API-FIELDS.md is the table, made from them):

    RESPONSES_HONOURED   the server does what the key asks. `max_tool_calls` bounds calls to built-in tools,
                         of which this server runs none, so no response exceeds it; `include` takes the values
                         of INCLUDE_SERVED; `reasoning.effort` is the chat path's `reasoning_effort`
    RESPONSES_ACCEPTED   accepted, with the effect stated beside each key
    RESPONSES_REFUSED    a 400 naming the key and saying what to send instead, unless the value asks for what
                         the server does anyway (`background: false`, `context_management: []`)

RESPONSES_DETAILS states the same for parts of honoured keys (`reasoning.summary`, `text.verbosity`, hosted
tools, ...) and for keys outside the SDK that agent clients send (`client_metadata`).

The server is stateless: `previous_response_id`, `conversation` and `background: true` are refused with a message
that says to send the whole conversation in `input`; `store: true` is accepted (nothing is stored, and the answer
is the same). It compacts nothing: `context_management`, the `compaction_trigger` and `compaction` input items
and POST /v1/responses/compact are refused with NO_COMPACTION.
"""

from __future__ import annotations

from router.request_model import Refusal, absent, one_of

INCLUDE_LOGPROBS = "message.output_text.logprobs"
# Built-in tools of the SDK's ToolParam and ToolChoice that OpenAI's servers run and this server does not:
# accepted in `tools` and left out of the prompt; a tool_choice that forces one is refused.
HOSTED_TOOL_TYPES = frozenset({
    "web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
    "code_interpreter", "image_generation", "mcp", "tool_search", "programmatic_tool_calling"})
# Built-in tools the client runs, from calls in their own item types (computer_call, local_shell_call, ...) that
# these models do not write: refused by name (left out, the model could not do what the client offers).
CLIENT_RUN_TOOL_TYPES = frozenset({"computer", "computer_use", "computer_use_preview", "local_shell", "shell",
                                   "apply_patch"})

_STATELESS = "this server is stateless and stores nothing between requests: "
NO_COMPACTION = ("this server does not compact conversations server-side: configure Codex with a custom model "
                 "provider ([model_providers.<name>] with wire_api = \"responses\" in config.toml), which compacts "
                 "on the client, or send the whole conversation in input")
RESPONSES_HONOURED = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "stream_options",
    "tools", "tool_choice", "parallel_tool_calls", "text", "include", "top_logprobs", "max_tool_calls",
    "thinking_token_budget",  # not the SDK's: vLLM's extension, as on the chat endpoint
    "reasoning"})
_METADATA = "echoed in the Response; kept nowhere, no effect on the answer"
_CACHE = "the prefix cache is automatic, content-addressed and in memory: it is used whatever this says"
RESPONSES_ACCEPTED: dict[str, str] = {
    "metadata": _METADATA, "user": _METADATA, "safety_identifier": _METADATA,
    "prompt_cache_key": "echoed; " + _CACHE, "prompt_cache_options": _CACHE, "prompt_cache_retention": _CACHE,
    "store": "nothing is stored: the answer is the same either way, the Response reports store false, and a "
             "later previous_response_id is refused (send the whole conversation in input)",
    "service_tier": "one service tier: every request is served alike (the Response reports \"default\")",
    "truncation": "an input is never truncated: one that fits is answered the same whatever this says, one over "
                  "the context gets a 400 (context_length_exceeded) to shorten it; the Response reports "
                  "\"disabled\"",
    "moderation": "no moderation is run: the answer is the model's",
    "image": "options for input images: this server's model reads text only and image parts are refused by "
             "name, so there is nothing to apply",
    "background_options": "options of background responses, which are refused (background: true): no effect "
                          "on a response run in the foreground",
    "access_programs": "this server gates no content by access program: every request is served alike",
}
RESPONSES_REFUSED: dict[str, Refusal] = {
    "previous_response_id": Refusal(absent, _STATELESS + "send the whole conversation in input (earlier messages, "
                                    "reasoning, function_call and function_call_output items) and leave "
                                    "previous_response_id out"),
    "conversation": Refusal(absent, _STATELESS + "send the whole conversation in input and leave conversation out"),
    "background": Refusal(one_of(False), _STATELESS + "responses run in the foreground only (stream: true "
                                                         "reports progress); leave background out or send false and "
                                                         "send the whole conversation in input"),
    "prompt": Refusal(absent, _STATELESS + "it keeps no prompt templates; send the instructions and input "
                                           "themselves"),
    "context_management": Refusal(lambda v: v is None or v == [], NO_COMPACTION + "; leave context_management "
                                  "out"),
}
RESPONSES_DETAILS: dict[str, str] = {
    "reasoning.effort": "the chat path's reasoning_effort (none, minimal, low, medium, high, xhigh; max as "
                        "xhigh): a thinking model's switch and effort level in its chat template; no effect on a "
                        "model that does not reason apart",
    "reasoning.summary": "no summary is made: the served models' reasoning is not summarised, and no reasoning "
                         "item with summary text is returned",
    "reasoning.generate_summary": "the deprecated name of reasoning.summary: no summary is made",
    "reasoning.context": "\"current_turn\" leaves out the reasoning items before the last user message; "
                         "\"all_turns\" and \"auto\" hand every reasoning item's text to the chat template with its "
                         "assistant turn (the template decides which turns it renders)",
    "reasoning.mode": "one execution mode: every request is served alike",
    "text.verbosity": "a hint that no chat template reads: the model is not told (say it in the instructions); "
                      "echoed",
    "tools[] of type namespace": "each function becomes the chat function <namespace>__<name> (the namespace's "
                              "description leads its description); a call of it comes back as a function_call "
                              "item with name and namespace",
    "tools[] of a hosted type (HOSTED_TOOL_TYPES)":
        "a built-in tool this server does not run: left out of the prompt and echoed; a tool_choice that forces "
        "one is refused naming tool_choice",
    "input[] of type reasoning": "its text (content's reasoning_text parts, else its summary, else the "
                              "encrypted_content this server made) is the reasoning_content of the next "
                              "assistant turn; encrypted_content of another server is left out",
    "input[].id, input[].status, input[].phase": "ids, statuses and phases of items sent back: no effect on the answer",
    "input[] of type compaction or compaction_trigger": "refused: " + NO_COMPACTION,
    "client_metadata": "not a key of the SDK (Codex's ids of its client and turn): ignored, as unknown keys are",
}
# `include` values: the logprobs of output text, and reasoning items' encrypted content (this server's token of
# their text, router/reasoning_token.py); every other value belongs to a tool or an input kind refused here.
REASONING_CONTENT = "reasoning.encrypted_content"
INCLUDE_SERVED = (INCLUDE_LOGPROBS, REASONING_CONTENT)
