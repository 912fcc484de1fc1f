"""Which keys of Anthropic's Messages request POST /v1/messages honours, accepts as metadata, or refuses.

Every key of the anthropic SDK's `MessageCreateParams` (and of the beta one) is in exactly one of these sets
(tests/test_anthropic_api.py walks them), the scheme of router/openai/fields.py.
"""

from __future__ import annotations

from router.request_model import Refusal, absent, one_of

MESSAGES_HONOURED = frozenset({
    "model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k", "stream",
    "tools", "tool_choice", "output_config", "cache_control"})
MESSAGES_METADATA = frozenset({"metadata"})  # `user_id`, accepted with no effect on the output
MESSAGES_REFUSED: dict[str, Refusal] = {
    "thinking": Refusal(one_of({"type": "disabled"}), "extended thinking is not supported by this server: leave "
                                                       "thinking out or send {\"type\": \"disabled\"}"),
    "service_tier": Refusal(one_of("auto", "standard_only"), "this server has one (standard) service tier: leave "
                                                              "service_tier out or send \"auto\""),
    "speed": Refusal(one_of("standard"), "this server has one speed: leave speed out or send \"standard\""),
    "container": Refusal(absent, "containers (code execution) are not supported by this server: leave container "
                                  "out"),
    "diagnostics": Refusal(absent, "prompt-cache diagnostics are not supported by this server: leave diagnostics "
                                    "out (usage.cache_read_input_tokens reports prefix-cache hits)"),
    "inference_geo": Refusal(absent, "this server has no inference regions: leave inference_geo out"),
    "user_profile_id": Refusal(absent, "user profiles are not supported by this server: leave user_profile_id "
                                        "out"),
    "workspace_id": Refusal(absent, "workspaces are not supported by this server: leave workspace_id out"),
    "mcp_servers": Refusal(absent, "MCP servers are not supported by this server: leave mcp_servers out and "
                                    "send their tools as custom tools"),
    "context_management": Refusal(absent, "context management is not supported by this server: leave "
                                           "context_management out"),
    "betas": Refusal(absent, "beta features are not supported by this server: leave betas out"),
    "compaction": Refusal(absent, "compaction is not supported by this server: leave compaction out"),
    "fallbacks": Refusal(absent, "model fallbacks are not supported by this server: leave fallbacks out"),
    "fallback_credit_token": Refusal(absent, "model fallbacks are not supported by this server: leave "
                                              "fallback_credit_token out"),
    "billing_policy": Refusal(absent, "billing policies are not supported by this server: leave billing_policy "
                                       "out"),
    "thread": Refusal(absent, "server-side threads are not supported by this server: leave thread out and send "
                               "the whole conversation in messages"),
}


