"""Chat messages with tools and tool-call turns, as the chat template renders them.

Native rendering (the template renders tools itself and mlx-lm knows its call format; router/tool_calls.py):
the tools go to `apply_chat_template(messages, tools=...)`; an assistant turn keeps its `tool_calls` with
the arguments parsed from JSON text to an object (as vLLM and mlx-lm hand them to templates, which write
them with `tojson`); a tool turn keeps `tool_call_id` and gets the called function's `name`; a content of
None becomes "" (templates concatenate it); an assistant turn's reasoning (`reasoning_content` or `reasoning`)
goes to the template as `reasoning_content` and `thinking`, the names thinking models' templates read (most keep
it only for the turns after the last user message). The fallback rendering drops reasoning.

Fallback rendering (a template that ignores `tools`, such as SmolLM2's plain ChatML, or one whose call format
mlx-lm cannot parse), in the Hermes style the json_tools parser reads:

    system    the request's system text, then TOOLS_SECTION: the function signatures as a JSON list and the
              instruction to answer with <tool_call>{"name": ..., "arguments": ...}</tool_call>
    assistant its text, then each call as  <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
    tool      consecutive results merged into one user turn of <tool_response>\\n...\\n</tool_response> blocks
              (a role every template renders, and user/assistant turns keep alternating)

Which rendering a request gets follows its parser (`ToolParser.native`). Whether a template renders tools is
probed once per tokenizer: rendered with and without a probe tool, it must differ and name the tool.

Call ids in Mistral's form: Mistral's templates take only tool call ids of 9 letters or digits (Mistral Small
3.2's raises on any other), while clients send back the ids they were given: the router's own "call_" and 24
hex digits, Anthropic's "toolu_...", a Responses client's call_id. For such a template (`short_ids`; the router
decides it per tokenizer, `short_call_ids_for`) native rendering writes every call's id and
every tool turn's `tool_call_id` as `short_call_ids` maps them: an id already in that form stays; any other gets
9 base-62 digits of its SHA-256; one already taken in the conversation gets those of its SHA-256 with a counter,
the ids taken in order of first appearance. So a call and its result keep one id, two ids never share one, and
a conversation that grows keeps the ids of its earlier turns from one request to the next. vLLM, whose Mistral
parser gives 9-character ids, cuts longer ones to their last 9 characters instead. The mapping is for the
template only: the ids the client sees are the router's own, unchanged.
"""

from __future__ import annotations

import hashlib
import json
import string
import weakref
from typing import Any, Iterable, Optional, Sequence

from router.errors import bad_request

_PROBE_NAME = "mlx_pd_probe_function"
_PROBE_TOOL = {"type": "function", "function": {"name": _PROBE_NAME, "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}

TOOLS_SECTION = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{signatures}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def template_renders_tools(wrapper: Any) -> bool:
    """True when the tokenizer's chat template renders a `tools` list (probe; see the module docstring)."""
    messages = [{"role": "user", "content": "Hi"}]
    try:
        plain = wrapper.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        with_tools = wrapper.apply_chat_template(messages, tools=[_PROBE_TOOL], add_generation_prompt=True,
                                                 tokenize=False)
    except Exception:  # no template, or one that fails on tools
        return False
    return isinstance(with_tools, str) and with_tools != plain and _PROBE_NAME in with_tools


SHORT_CALL_ID_LENGTH = 9  # Mistral's tool call ids: this many letters or digits
_BASE62 = string.digits + string.ascii_letters


def is_short_call_id(call_id: str) -> bool:
    """True for an id in Mistral's form: exactly 9 ASCII letters or digits."""
    return len(call_id) == SHORT_CALL_ID_LENGTH and call_id.isascii() and call_id.isalnum()


def _derived_id(call_id: str, attempt: int) -> str:
    """9 base-62 digits of the SHA-256 of `call_id` (with `attempt` after the first)."""
    data = call_id if attempt == 0 else f"{call_id}\0{attempt}"
    n = int.from_bytes(hashlib.sha256(data.encode("utf-8")).digest(), "big")
    digits = []
    for _ in range(SHORT_CALL_ID_LENGTH):
        n, r = divmod(n, len(_BASE62))
        digits.append(_BASE62[r])
    return "".join(digits)


def short_call_ids(call_ids: Iterable[str]) -> dict[str, str]:
    """Each distinct id of `call_ids` (in the conversation's order) -> its id in Mistral's form, distinct ids to
    distinct ones (rules in the module docstring)."""
    out: dict[str, str] = {}
    taken: set[str] = set()
    for call_id in call_ids:
        if call_id in out:
            continue
        attempt = 0
        short = call_id if is_short_call_id(call_id) else _derived_id(call_id, attempt)
        while short in taken:
            attempt += 1
            short = _derived_id(call_id, attempt)
        out[call_id] = short
        taken.add(short)
    return out


def template_refuses_long_call_ids(wrapper: Any) -> bool:
    """True when the chat template refuses a previous call whose id is OpenAI-style ("call_" and 24 hex digits)
    but renders it with an id in Mistral's form (probe: a call of the probe tool and its result)."""
    def renders(call_id: str) -> bool:
        messages = [{"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": call_id, "type": "function", "function": {"name": _PROBE_NAME, "arguments": {}}}]},
                    {"role": "tool", "tool_call_id": call_id, "name": _PROBE_NAME, "content": "ok"}]
        try:
            wrapper.apply_chat_template(messages, tools=[_PROBE_TOOL], add_generation_prompt=True, tokenize=False)
        except Exception:
            return False
        return True

    return not renders("call_" + "0" * 24) and renders("a1B2c3D4e")


def tools_section(tools: Sequence[dict]) -> str:
    """The fallback's system-prompt section describing `tools` (OpenAI-shaped dicts)."""
    signatures = json.dumps([t["function"] for t in tools], ensure_ascii=False)
    return TOOLS_SECTION.format(signatures=signatures)


def call_text(name: str, arguments: dict[str, Any]) -> str:
    """One call in the Hermes form the fallback and the forced grammar use."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _check_tool_turns(messages: Sequence[Any]) -> dict[str, str]:
    """tool_call_id -> function name over the conversation; 400 naming the message field for a tool turn
    that answers no earlier call, a tool turn without tool_call_id, or tool fields on the wrong role."""
    called: dict[str, str] = {}
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            raise bad_request(f"messages[{i}].tool_calls: only assistant messages carry tool calls; move them "
                              f"to an assistant message", f"messages[{i}].tool_calls")
        for call in m.tool_calls or ():
            called[call.id] = call.function.name
        if m.role == "tool":
            if not m.tool_call_id:
                raise bad_request(f"messages[{i}].tool_call_id: a tool message must say which call it answers: "
                                  "send the id of a tool call of an earlier assistant message",
                                  f"messages[{i}].tool_call_id")
            if m.tool_call_id not in called:
                raise bad_request(f"messages[{i}].tool_call_id: {m.tool_call_id!r} matches no tool call of an "
                                  "earlier assistant message: send the id of one of their tool_calls",
                                  f"messages[{i}].tool_call_id")
        elif m.tool_call_id is not None:
            raise bad_request(f"messages[{i}].tool_call_id: only tool messages answer a call; send it on a "
                              "message with role \"tool\"", f"messages[{i}].tool_call_id")
    return called


def _native(messages: Sequence[Any], called: dict[str, str], short_ids: bool) -> list[dict[str, Any]]:
    ids = short_call_ids(c.id for m in messages for c in m.tool_calls or ()) if short_ids else {}
    out = []
    for m in messages:
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.content or ""}
        if m.name:
            message["name"] = m.name
        if m.role == "assistant" and m.reasoning_text:  # Qwen3's and GLM's templates read the first name,
            message["reasoning_content"] = message["thinking"] = m.reasoning_text  # gpt-oss's the second
        if m.tool_calls:
            message["tool_calls"] = [{"id": ids.get(c.id, c.id), "type": "function",
                                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                     for c in m.tool_calls]
        if m.role == "tool":
            message["tool_call_id"] = ids.get(m.tool_call_id, m.tool_call_id)
            message["name"] = called[m.tool_call_id]
        out.append(message)
    return out


def _fallback(messages: Sequence[Any], tools: Sequence[dict]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        text = m.content or ""
        if m.role == "tool":
            block = f"<tool_response>\n{text}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        if m.tool_calls:
            calls = "\n".join(call_text(c.function.name, c.function.arguments) for c in m.tool_calls)
            text = f"{text}\n{calls}" if text else calls
        message = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if m.name:
            message["name"] = m.name
        out.append(message)
    for message in out:
        message.pop("_tool_results", None)
    if tools:
        section = tools_section(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{section}" if out[0]["content"] else section
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def chat_messages(messages: Sequence[Any], tools: Sequence[dict], native: bool, short_ids: bool = False
                  ) -> tuple[list[dict[str, Any]], Optional[list[dict]]]:
    """(messages for the chat template, `tools` argument for it or None) of validated ChatMessages.

    `tools`: the function tools to show the model (OpenAI-shaped; empty shows none); `native`: render them
    with the template (True) or with the Hermes fallback (False); `short_ids`: the template takes call ids only
    in Mistral's form, so native rendering maps them (module docstring). 400 for inconsistent tool turns."""
    called = _check_tool_turns(messages)
    if native:
        return _native(messages, called, short_ids), (list(tools) or None)
    return _fallback(messages, tools), None


_SHORT_IDS: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def short_call_ids_for(tok: Any) -> bool:
    """True when a RouterTokenizer's chat template takes tool call ids only in Mistral's form (9 letters or
    digits), so the router renders them so (`short_call_ids`): its parser is mistral's, or its template
    refuses an OpenAI-style id that the short form passes (probed once, kept for the tokenizer's life)."""
    short = _SHORT_IDS.get(tok)
    if short is None:
        from router.tool_calls import tool_parser_for  # the parser is chosen there, from the same template

        short = tool_parser_for(tok).name == "mistral" or template_refuses_long_call_ids(tok.wrapped)
        _SHORT_IDS[tok] = short
    return short
