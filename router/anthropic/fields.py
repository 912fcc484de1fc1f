"""Which keys of Anthropic's Messages request POST /v1/messages honours, accepts with a stated effect, or refuses.

Every key of the anthropic SDK's `MessageCreateParams` (and of the beta one) is in exactly one of these sets
(tests/test_anthropic_api.py walks them), by the rule of router/openai/fields.py: refused by name only what
would change the answer if ignored.
"""

from __future__ import annotations

from router.request_model import Refusal, absent

MESSAGES_HONOURED = frozenset({
    "model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k", "stream",
    "tools", "tool_choice", "output_config", "cache_control", "thinking", "context_management"})
MESSAGES_ACCEPTED: dict[str, str] = {
    "metadata": "metadata.user_id, for the caller's own records: kept nowhere, no effect on the answer",
    "service_tier": "one service tier: every request is served alike (usage reports \"standard\")",
    "speed": "one speed: every request is served alike",
    "diagnostics": "no prompt-cache diagnostics are reported (usage.cache_read_input_tokens counts the hits)",
    "inference_geo": "the request runs where this server runs",
    "user_profile_id": "an account field: no effect on the answer",
    "workspace_id": "an account field: no effect on the answer",
    "betas": "beta features are what their own fields ask for (each honoured, accepted or refused here)",
    "fallbacks": "the served model answers; a fallback would only be used if it could not",
    "fallback_credit_token": "the served model answers; a fallback would only be used if it could not",
    "billing_policy": "an account field: no effect on the answer",
}
MESSAGES_REFUSED: dict[str, Refusal] = {
    "container": Refusal(absent, "containers (code execution) are not supported by this server: leave container "
                                  "out"),
    "mcp_servers": Refusal(absent, "MCP servers are not supported by this server: leave mcp_servers out and "
                                    "send their tools as custom tools"),
    "compaction": Refusal(absent, "compaction is not supported by this server: leave compaction out"),
    "thread": Refusal(absent, "server-side threads are not supported by this server: leave thread out and send "
                               "the whole conversation in messages"),
}
# What the server does with parts of honoured keys and with blocks: the details docs/API-FIELDS.md lists.
MESSAGES_DETAILS: dict[str, str] = {
    "thinking {type: enabled, budget_tokens}": "thinking on; the engine ends the reasoning after budget_tokens "
                                               "(a budget at or over max_tokens never binds: reasoning counts "
                                               "toward max_tokens)",
    "thinking {type: adaptive or between_tools}": "the chat template's default (the model decides)",
    "thinking {type: disabled}": "the chat template's thinking switch off (a model without one: the end "
                                 "marker forced first)",
    "thinking.display omitted": "thinking blocks come with empty text; their signature carries it",
    "output_config.effort": "the template's effort variable where it has one (max as xhigh)",
    "context_management.edits[] clear_thinking_20251015": "drops the reasoning of all but the last `keep` "
                                                          "assistant turns; reported in applied_edits",
    "context_management.edits[] of other types": "refused naming the edit (it would change what the model sees)",
    "messages[].content[] thinking": "its reasoning goes back to the template when its signature is this "
                                     "server's (a changed block is a 400); another server's is left out",
    "messages[].content[] redacted_thinking": "left out of the prompt",
    "tools[].defer_loading": "the tool is left out of the prompt until a tool_result's tool_reference loads it",
    "tools[].eager_input_streaming": "satisfied: a call's input is streamed whole once the model has written it",
    "tools[] server tools (web_search_..., web_fetch_..., code_execution_..., tool_search_tool_...)":
        "left out of the prompt; a tool_choice naming one is refused",
    "tools[] client tools of Anthropic's schemas (bash_..., text_editor_..., computer_..., memory_...)":
        "refused naming the tool: send it as a custom tool",
}
