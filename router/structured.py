"""Constrained decoding from the router: llguidance grammars for `response_format` and forced tool calls.

What each request asks for, and the grammar (`SamplingParams.grammar`) the engine then follows:

    response_format json_object          one JSON object: grammar_from_json_schema({"type": "object"})
    response_format json_schema          JSON valid against the schema: grammar_from_json_schema(schema)
    tool_choice "required"               one call (parallel_tool_calls false) or several, newline-separated,
                                         in the Hermes form the json_tools parser reads (Lark; see below)
    tool_choice naming a function        exactly one call of it, in the same form
    tools, tool_choice "auto", and a     either the JSON answer or the calls: `start: answer | calls`
      JSON response_format
    tool_choice "none", no tools, text   the JSON format's grammar, or none

A forced call is always written in the Hermes form, whatever the model's native format:

    <tool_call>
    {"name": "get_weather", "arguments": <the function's parameters schema>}
    </tool_call>

For the json_tools family (Hermes, Qwen2.5/3, and the fallback rendering) this is the model's own format;
for other families (Mistral's `[TOOL_CALLS]`, Qwen3-Coder's XML, ...) constraining the native body is not
easy, so such a request renders the Hermes tool section (router/tool_prompt.py) and parses with json_tools
(router/tool_calls.py). A marker that is a special token of the model is written as that token (`<tool_call>`
unquoted in Lark), else as text.

Whitespace: every JSON part is compact with one space after ':' and ',' (`{"a": 1, "b": [2, 3]}`, as
Python's json.dumps writes it) and no other whitespace between tokens (`whitespace_flexible: false`, set as
an override, so a schema's own "x-guidance" cannot turn free whitespace back on). A model can then never
spin in a whitespace-only loop between JSON values: at most the one separator space, then progress. Spaces
inside a string value are the value's content, bounded by the schema's maxLength or by max_tokens.

Object schemas that list `properties` and say nothing of other keys are closed (`additionalProperties:
false`, `closed_schema`), as xgrammar's strict mode does in vLLM: a small model otherwise keeps adding keys
until max_tokens; what the grammar allows still validates against the schema as sent.

Grammars are checked on the router with `LLMatcher.validate_grammar(grammar, tokenizer)` against the model's
llguidance tokenizer (built once per RouterTokenizer, ~0.3 s); an error is a 400 naming the field.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any, Optional, Sequence

from cluster.grammar import llguidance_tokenizer
from router.errors import bad_request

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}

_LOCK = threading.Lock()
_TOKENIZERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def llg_tokenizer(tok: Any) -> Optional[Any]:
    """The llguidance tokenizer of a RouterTokenizer (built on first use and kept), or None when its wrapped
    tokenizer is not a Hugging Face fast tokenizer (a test double): grammars are then checked without one."""
    with _LOCK:
        if tok in _TOKENIZERS:
            return _TOKENIZERS[tok]
        try:
            lt = llguidance_tokenizer(tok.wrapped, eos_ids=tok.eos_token_ids)
        except (ValueError, TypeError, AttributeError):
            lt = None
        _TOKENIZERS[tok] = lt
        return lt


_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("additionalProperties", "items", "contains", "not", "if", "then", "else")


def closed_schema(schema: Any, in_all_of: bool = False) -> Any:
    """A copy of `schema` where every object schema that lists `properties` and says nothing of other keys
    (no additionalProperties, patternProperties, unevaluatedProperties, and not inside or beside an allOf,
    which combine properties) gets `additionalProperties: false`, as xgrammar's strict mode does in vLLM.
    What the grammar allows still validates against `schema`; a small model no longer invents keys."""
    if isinstance(schema, list):
        return [closed_schema(s, in_all_of) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_schema(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS + _SUBSCHEMAS:
        if key in out:
            out[key] = closed_schema(out[key])
    if isinstance(out.get("allOf"), list):
        out["allOf"] = closed_schema(out["allOf"], in_all_of=True)
    if "properties" in out and not in_all_of and not any(k in schema for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def json_grammar(schema: Optional[dict[str, Any]]) -> str:
    """The llguidance grammar of JSON valid against `schema` (None = any JSON object), closed objects
    (`closed_schema`), compact whitespace."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(closed_schema(schema) if schema is not None else ANY_OBJECT,
                                              overrides=JSON_OPTIONS)


def _embedded(schema: Optional[dict[str, Any]]) -> str:
    """`schema` (closed) as the JSON text of a Lark `%json` body, with the compact-whitespace options."""
    body = closed_schema(schema) if schema else dict(ANY_OBJECT)
    body["x-guidance"] = dict(JSON_OPTIONS)
    return json.dumps(body, ensure_ascii=False)


def _marker(text: str, lt: Optional[Any]) -> str:
    """A Lark item matching marker `text`: the special token itself when the model has it as one."""
    if lt is not None:
        ids = lt.tokenize_str(text)
        if len(ids) == 1 and lt.is_special_token(ids[0]):
            return text
    return json.dumps(text, ensure_ascii=False)


def tool_calls_lark(tools: Sequence[dict], parallel: bool, lt: Optional[Any] = None,
                    answer_schema: Optional[dict[str, Any]] = None, answer: bool = False) -> str:
    """The Lark grammar of Hermes-form calls to any of `tools` (OpenAI-shaped dicts): exactly one call, or
    with `parallel` one or more separated by a newline. With `answer`, the output may instead be a JSON answer
    valid against `answer_schema` (None = any object)."""
    start, end = _marker("<tool_call>", lt), _marker("</tool_call>", lt)
    lines = ["calls: call" + (' ("\\n" call)*' if parallel else ""),
             "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        function = tool["function"]
        head = json.dumps('\n{"name": ' + json.dumps(function["name"]) + ', "arguments": ')
        lines.append(f'call_{i}: {start} {head} args_{i} "}}\\n" {end}')
        lines.append(f"args_{i}: %json {_embedded(function.get('parameters'))}")
    top = "start: answer | calls\nanswer: %json " + _embedded(answer_schema) if answer else "start: calls"
    return top + "\n" + "\n".join(lines) + "\n"


def check_grammar(grammar: str, tok: Any, field: str) -> str:
    """`grammar` when llguidance can compile it for this model; a 400 naming `field` otherwise."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar, llg_tokenizer(tok))
    if error:
        raise bad_request(f"{field}: llguidance cannot build a grammar from it: {error.strip()}", field)
    return grammar


def format_schema(response_format: Any) -> tuple[Optional[str], Optional[dict[str, Any]]]:
    """(field to name in errors, schema) of a JSON response_format; (None, None) for text or none."""
    if response_format is None or response_format.type == "text":
        return None, None
    if response_format.type == "json_object":
        return "response_format", None
    return "response_format.json_schema.schema", response_format.json_schema.schema_


def _check_tool_schemas(tools: Sequence[dict], all_tools: Sequence[dict], tok: Any) -> None:
    """400 naming `tools[i].function.parameters` for a tool whose arguments schema llguidance cannot build."""
    for tool in tools:
        i = next(k for k, t in enumerate(all_tools) if t is tool)
        field = f"tools[{i}].function.parameters"
        try:
            check_grammar(json_grammar(tool["function"].get("parameters")), tok, field)
        except ValueError as exc:
            raise bad_request(f"{field}: {exc}", field) from None


def build_grammar(req: Any, tools: Sequence[dict], forced: Optional[Sequence[dict]], tok: Any,
                  parallel: bool = True) -> Optional[str]:
    """The grammar of a chat request, checked (see the module docstring), or None for free output.

    `tools`: the request's function tools offered to the model (empty for none or tool_choice "none");
    `forced`: the tools one of which must be called (tool_choice "required": all; named: that one), or None;
    `parallel`: calls may follow one another (False: exactly one; router/params.py's `ToolPlan.parallel`).
    Raises a 400 naming the field whose schema llguidance cannot build.
    """
    from llguidance import LLMatcher

    field, schema = format_schema(req.response_format)
    if forced:
        lark = LLMatcher.grammar_from_lark(tool_calls_lark(forced, parallel, llg_tokenizer(tok)))
        return _checked_calls(lark, tok, "tool_choice", lambda: _check_tool_schemas(forced, tools, tok))
    if field is None:
        return None
    try:
        answer = check_grammar(json_grammar(schema), tok, field)
    except ValueError as exc:  # the schema is not a JSON object llguidance can read
        raise bad_request(f"{field}: {exc}", field) from None
    if not tools:
        return answer
    lark = LLMatcher.grammar_from_lark(tool_calls_lark(tools, parallel, llg_tokenizer(tok), schema, answer=True))
    return _checked_calls(lark, tok, "tools", lambda: _check_tool_schemas(tools, tools, tok))


def _checked_calls(grammar: str, tok: Any, field: str, blame_tools: Any) -> str:
    """`grammar` (calls to some tools) when it compiles. Else `blame_tools()` raises the 400 naming the tool
    whose parameters schema is at fault, or, when each compiles alone, the 400 names `field`. So a valid
    request compiles one grammar, not one per tool as well."""
    from llguidance import LLMatcher

    if not LLMatcher.validate_grammar(grammar, llg_tokenizer(tok)):
        return grammar
    blame_tools()
    return check_grammar(grammar, tok, field)
