"""From a validated OpenAI request to the `GenerateRequest`s the engine runs.

The steps every request takes, in order:

    tokenize (chat template or completion prompt); a text far over the context is refused after about the
       context's worth of it is tokenized (router/tokenizer.py), a token-id prompt by its length first
    -> reject a prompt that leaves no room: prompt_tokens >= max_model_len  (400, naming both numbers)
    -> max_tokens = min(requested or the context left, max_model_len - prompt_tokens)
    -> SamplingParams (its ValueError becomes a 400 naming the field)
       chat with tools or a JSON response_format: the tool plan (which tools the model sees, which parser
       reads its output, which calls are forced; `plan_tools`), rendered by router/tool_prompt.py, with the
       grammar of router/structured.py in SamplingParams.grammar
    -> n GenerateRequests "<base>-0" ... "<base>-{n-1}"; with a seed, choice i uses seed + i,
       so streamed and non-streamed answers with the same seed are the same.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Optional, Union

from cluster.request import GenerateRequest, ReasoningParams, SamplingParams
from router.errors import APIError, bad_request
from router.openai.request import (CONTEXT_LENGTH_EXCEEDED, INT64_MAX, ChatCompletionRequest, CompletionRequest,
                                  context_length_message)
from router.structured import build_grammar
from router.tokenizer import ChatTemplateError, PromptTooLong, RouterTokenizer
from router.reasoning import ReasoningPlan, plan_reasoning, reasoning_support
from router.tool_calls import ToolParser, forced_tool_parser_for, tool_parser_for
from router.tool_prompt import short_call_ids_for
from router.tool_prompt import chat_messages

GREEDY_BELOW = 1e-5  # temperatures below this are greedy (as in vLLM): dividing by ~0 overflows


@dataclass(frozen=True)
class PreparedRequest:
    """Everything the serving code needs besides the engine: the prompt, the choices, the output options.

    `logprobs` is the number of alternatives per generated token (None = no logprobs); `echo` (completions
    only) prepends `prompt_text` and, with logprobs, the prompt's logprobs. `tools`: the request's function
    tools (OpenAI-shaped dicts); `tool_parser`: what reads calls out of the output (None without tools or with
    tool_choice "none"); `parallel_tool_calls` False reports at most one call per choice.
    """

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    prompt_text: str
    requests: tuple[GenerateRequest, ...]
    max_tokens: int
    stream: bool
    include_usage: bool
    logprobs: Optional[int]
    echo: bool = False
    tools: tuple[dict, ...] = ()
    tool_parser: Optional[ToolParser] = None
    parallel_tool_calls: bool = True

    @property
    def max_tool_calls(self) -> Optional[int]:
        """The most calls a choice reports (1 without parallel tool calls, else no limit)."""
        return None if self.parallel_tool_calls else 1

    @property
    def n(self) -> int:
        """How many choices."""
        return len(self.requests)


def check_token_ids(ids: list[int], vocab_size: int, field: str) -> None:
    """400 unless every id is a token id of this model."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"{field}: token id {bad} is out of range: this model's ids are 0..{vocab_size - 1}",
                          field)


def too_long(exc: PromptTooLong, param: str) -> APIError:
    """The 400 for a prompt whose counting stopped once it had more tokens than the context holds."""
    return APIError(400, context_length_message(f"at least {exc.at_least}", exc.limit) + " (counting stopped "
                    "once the prompt could not fit)", param=param, code=CONTEXT_LENGTH_EXCEEDED)


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request uses tools: all its `tools`, those `shown` to the model (none with tool_choice
    "none"), the `parser` of its output, the tools one of which is `forced` (tool_choice "required" or named;
    None when the model may answer freely), whether the template renders them `native`ly, and whether a choice
    may hold `parallel` calls (not with parallel_tool_calls false, nor with a named tool_choice: naming a
    function asks for one call of it, as vLLM's named function calling gives, so a tool with side effects is
    not run twice)."""

    tools: tuple[dict, ...] = ()
    shown: tuple[dict, ...] = ()
    parser: Optional[ToolParser] = None
    forced: Optional[tuple[dict, ...]] = None
    native: bool = True
    parallel: bool = True


def plan_tools(req: ChatCompletionRequest, tok: RouterTokenizer) -> ToolPlan:
    """The ToolPlan of a chat request; 400 naming the field for duplicate tool names, a tool_choice that needs
    tools when there are none, or a named tool_choice that names none of them. A forced call, or tools next to
    a JSON response_format, uses the Hermes form (router/structured.py) and its parser."""
    tools = tuple(t.openai() for t in req.tools or ())
    names = [t["function"]["name"] for t in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise bad_request(f"tools: two functions are named {duplicate!r}: give each tool its own name", "tools")
    choice = req.tool_choice
    if choice is not None and choice not in ("none", "auto") and not tools:  # "auto" of nothing: plain text
        raise bad_request("tool_choice: there are no tools to choose from: send tools, or leave tool_choice out",
                          "tool_choice")
    parallel = req.parallel_tool_calls is not False
    if choice == "none" or not tools:
        return ToolPlan(tools=tools, native=tool_parser_for(tok).native, parallel=parallel)
    forced = None
    if choice == "required":
        forced = tools
    elif choice is not None and choice != "auto":
        forced, parallel = tuple(t for t in tools if t["function"]["name"] == choice.function.name), False
        if not forced:
            raise bad_request(f"tool_choice: {choice.function.name!r} is not one of the tools "
                              f"({', '.join(repr(n) for n in names)}): name one of them", "tool_choice")
    json_format = req.response_format is not None and req.response_format.type != "text"
    parser = forced_tool_parser_for(tok) if forced or json_format else tool_parser_for(tok)
    return ToolPlan(tools=tools, shown=tools, parser=parser, forced=forced, native=parser.native, parallel=parallel)


def reasoning_plan(req: ChatCompletionRequest, tok: RouterTokenizer) -> ReasoningPlan:
    """The request's reasoning plan (router/reasoning.py): the chat template's switches and the engine's budget."""
    return plan_reasoning(reasoning_support(tok.wrapped), req.reasoning_effort, req.thinking_token_budget,
                          req.chat_template_kwargs)


async def tokenize_chat(req: ChatCompletionRequest, tok: RouterTokenizer, max_model_len: Optional[int] = None,
                        plan: Optional[ToolPlan] = None, reasoning: Optional[ReasoningPlan] = None
                        ) -> tuple[str, list[int]]:
    """(prompt text, token ids) of the chat messages (with the plan's tools and tool turns,
    router/tool_prompt.py, and the reasoning plan's template variables); 400 when the template rejects them, or
    when the rendered prompt has at least `max_model_len` tokens and is far longer (found after bounded work)."""
    plan = plan or plan_tools(req, tok)
    reasoning = reasoning or reasoning_plan(req, tok)
    short_ids = plan.native and any(m.tool_calls for m in req.messages) and short_call_ids_for(tok)
    messages, template_tools = chat_messages(req.messages, plan.shown, plan.native, short_ids)
    if template_tools and reasoning.support.format == "harmony":  # gpt-oss's template reads every description
        template_tools = [{**t, "function": {**t["function"], "description": t["function"].get("description", "")}}
                          for t in template_tools]
    try:
        return await tok.arender_chat(messages, max_model_len, template_tools, reasoning.template_kwargs)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from exc
    except PromptTooLong as exc:
        raise too_long(exc, "messages") from None


async def tokenize_completion(req: CompletionRequest, tok: RouterTokenizer,
                              max_model_len: Optional[int] = None) -> tuple[str, list[int]]:
    """(prompt text, token ids) of a completion prompt given as text or as token ids; with `max_model_len`,
    a prompt that leaves no room is refused first (token ids by their count, text after bounded work)."""
    if isinstance(req.prompt, str):
        try:
            ids = await tok.aencode(req.prompt, max_model_len)
        except PromptTooLong as exc:
            raise too_long(exc, "prompt") from None
        if not ids:
            raise bad_request("prompt: it encodes to no tokens; send a non-empty prompt", "prompt")
        return req.prompt, ids
    if max_model_len is not None:
        clamp_max_tokens(None, len(req.prompt), max_model_len)  # 400 before the ids are read or decoded
    check_token_ids(req.prompt, tok.vocab_size, "prompt")
    text = await tok.adecode(req.prompt) if req.echo else ""
    return text, list(req.prompt)


def clamp_max_tokens(requested: Optional[int], num_prompt_tokens: int, max_model_len: int,
                     param: str = "prompt") -> int:
    """The tokens to generate: `requested` (None = all) clamped to the context left; 400 if none is left."""
    left = max_model_len - num_prompt_tokens
    if left <= 0:
        raise APIError(400, context_length_message(str(num_prompt_tokens), max_model_len), param=param,
                       code=CONTEXT_LENGTH_EXCEEDED)
    return left if requested is None else min(requested, left)


def build_sampling(req: Union[ChatCompletionRequest, CompletionRequest], *, max_tokens: int,
                   logprobs: Optional[int], prompt_logprobs: Optional[int],
                   tok: RouterTokenizer, grammar: Optional[str] = None,
                   skip_special_tokens: bool = True, reasoning: Optional[ReasoningParams] = None) -> SamplingParams:
    """SamplingParams for one choice (seed not yet offset); 400 naming the field on a bad value."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    stop_ids = list(req.stop_token_ids or ())
    check_token_ids(stop_ids, tok.vocab_size, "stop_token_ids")
    if not req.ignore_eos:  # the tokenizer's end-of-turn ids, in case the engine knows fewer
        stop_ids += [t for t in tok.eos_token_ids if t not in stop_ids]
    bias = []
    for key, value in (req.logit_bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias: key {key!r} is not a token id", "logit_bias") from None
        check_token_ids([token_id], tok.vocab_size, "logit_bias")
        bias.append((token_id, value))
    temperature = 1.0 if req.temperature is None else req.temperature
    if 0 < temperature < GREEDY_BELOW:
        temperature = 0.0
    top_k = req.top_k or 0
    if top_k == -1 or top_k >= tok.vocab_size:  # -1 is vLLM's "off"; k >= vocab keeps every token
        top_k = 0
    fields = dict(
        max_tokens=max_tokens, temperature=temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k,
        min_p=req.min_p or 0.0, repetition_penalty=1.0 if req.repetition_penalty is None
        else req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=tuple(bias), logprobs=logprobs, prompt_logprobs=prompt_logprobs, stop=stop,
        stop_token_ids=tuple(stop_ids), ignore_eos=req.ignore_eos, seed=req.seed,
        speculative_method=req.speculative.method if req.speculative else None,
        num_draft_tokens=req.speculative.num_draft_tokens if req.speculative else None,
        grammar=grammar, skip_special_tokens=skip_special_tokens, reasoning=reasoning)
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        message = str(exc)
        field = message.split("=", 1)[0] if "=" in message else None
        raise bad_request(message, field if field in fields else None) from exc


def seeded(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s params: seed + index (wrapped into int64), or unchanged without a seed."""
    if sampling.seed is None or index == 0:
        return sampling
    seed = sampling.seed + index
    if seed > INT64_MAX:
        seed -= 2**64
    return replace(sampling, seed=seed)


def make_requests(request_id: str, prompt_ids: list[int], sampling: SamplingParams, n: int,
                  cache_salt: Optional[str], arrival_time: Optional[float] = None
                  ) -> tuple[GenerateRequest, ...]:
    """The n GenerateRequests of one HTTP request, ids f"{request_id}-{i}"."""
    arrival = time.time() if arrival_time is None else arrival_time
    prompt = tuple(prompt_ids)
    return tuple(GenerateRequest(request_id=f"{request_id}-{i}", prompt_token_ids=prompt,
                                 sampling=seeded(sampling, i), cache_salt=cache_salt,
                                 arrival_time=arrival) for i in range(n))


async def prepare_chat(req: ChatCompletionRequest, tok: RouterTokenizer, *, request_id: str,
                       model: str, max_model_len: int, arrival_time: float) -> PreparedRequest:
    """Validate and tokenize a chat request into its GenerateRequests."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs: set logprobs to true to use top_logprobs", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    plan = plan_tools(req, tok)
    grammar = None
    if plan.forced or (req.response_format is not None and req.response_format.type != "text"):
        grammar = await asyncio.get_running_loop().run_in_executor(
            None, build_grammar, req, plan.shown, plan.forced, tok, plan.parallel)  # the first builds the llg tokenizer
    reasoning = reasoning_plan(req, tok)
    text, ids = await tokenize_chat(req, tok, max_model_len, plan, reasoning)
    max_tokens = clamp_max_tokens(req.requested_max_tokens, len(ids), max_model_len, "messages")
    special = plan.parser is not None and plan.parser.markers_are_special
    sampling = build_sampling(req, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=None, tok=tok,
                              grammar=grammar, skip_special_tokens=not special, reasoning=reasoning.params(ids, max_tokens))
    return PreparedRequest(
        request_id=request_id, model=model, prompt_token_ids=tuple(ids), prompt_text=text,
        requests=make_requests(request_id, ids, sampling, req.n or 1, req.cache_salt, arrival_time),
        max_tokens=max_tokens, stream=req.stream, include_usage=req.include_usage, logprobs=logprobs,
        tools=plan.tools, tool_parser=plan.parser, parallel_tool_calls=plan.parallel)


async def prepare_completion(req: CompletionRequest, tok: RouterTokenizer, *, request_id: str,
                             model: str, max_model_len: int, arrival_time: float) -> PreparedRequest:
    """Validate and tokenize a completion request into its GenerateRequests."""
    text, ids = await tokenize_completion(req, tok, max_model_len)
    requested = 16 if req.max_tokens is None else req.max_tokens
    max_tokens = clamp_max_tokens(requested, len(ids), max_model_len)
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    sampling = build_sampling(req, max_tokens=max_tokens, logprobs=req.logprobs,
                              prompt_logprobs=prompt_logprobs, tok=tok)
    return PreparedRequest(
        request_id=request_id, model=model, prompt_token_ids=tuple(ids), prompt_text=text,
        requests=make_requests(request_id, ids, sampling, req.n or 1, req.cache_salt, arrival_time),
        max_tokens=max_tokens, stream=req.stream, include_usage=req.include_usage,
        logprobs=req.logprobs, echo=req.echo)
