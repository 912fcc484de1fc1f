"""Thinking models on the router: does the model reason apart, how is it switched, and what the engine is told.

The engine splits the output token by token (cluster/reasoning.py, `SamplingParams.reasoning`); the router finds,
once per tokenizer (`reasoning_support`):

    format     "think": the tokenizer has think markers (mlx-lm's `TokenizerWrapper` finds `<think>`/`</think>` and
               the other pairs it knows, multi-token ones included; the router adds the pairs of `THINK_MARKERS`
               that mlx-lm does not know, such as Mistral's `[THINK]`/`[/THINK]`, when each is one token of the
               vocabulary); "harmony": the gpt-oss specials (`<|channel|>`, `<|message|>`, ...) are single tokens;
               None: the model answers directly and every reasoning field is accepted as a no-op
    switch     the chat template's on/off variable (`enable_thinking`, or the name mlx-lm finds for it) when the
               template reads it; None for models that always think (DeepSeek-R1, gpt-oss) or never do
    effort     "reasoning_effort" when the template reads that variable (gpt-oss: "Reasoning: low|medium|high")

and per request (`plan_reasoning`), from the API fields the doors translate into the chat request:

    reasoning_effort "none" | "minimal"  thinking off: the switch set to false where there is one; a model
                                         without a switch is told a budget of 0 (the end marker is forced first),
                                         except that harmony's "minimal" is its "low" effort
    reasoning_effort low | medium | high | xhigh | max, or none given   thinking on: the switch set to true
                                         where there is one (mlx-lm's wrapper would default it so only for the
                                         markers it knows); the template's effort variable gets the level
                                         (xhigh and max as high, minimal as low)
    thinking_token_budget N              the engine forces the end marker after N reasoning tokens
    chat_template_kwargs                 passed to the template last, so an explicit `enable_thinking` wins;
                                         the keys the router itself sets (messages, tools, add_generation_prompt,
                                         tokenize, ...) and the template's own functions
                                         (raise_exception, namespace, ...) are refused by name

The plan's `template_kwargs` go to `apply_chat_template`; `params(prompt_ids)` is the engine's `ReasoningParams`
(None for a model without reasoning; the budget clamped to max_tokens, past which it cannot bind, so any
integer a client sends travels): `starts_inside` from the rendered prompt (its last start marker after its
last end marker, as mlx-lm's server decides; for harmony, a prompt that ends by opening an analysis message).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from cluster.reasoning import ends_inside, harmony_ids
from cluster.request import ReasoningParams
from router.errors import bad_request

RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                      "tokenize", "continue_final_message", "return_dict", "chat_template",
                                      # the globals templates call (Jinja's and transformers')
                                      "raise_exception", "strftime_now", "namespace", "range", "dict", "lipsum",
                                      "cycler", "joiner"})
OFF_EFFORTS = ("none", "minimal")
_EFFORT_LEVELS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
# think markers mlx-lm's TokenizerWrapper does not know (start, end), each a single token where a model has it:
# Mistral's reasoning models (Ministral 3 Reasoning, Magistral) write `[THINK]reasoning[/THINK]answer`
THINK_MARKERS = (("[THINK]", "[/THINK]"),)


@dataclass(frozen=True)
class ReasoningSupport:
    """What one tokenizer's model does with reasoning (module docstring). `start_ids`/`end_ids`: the think
    markers' token ids, or harmony's specials and its closing sequence (`cluster.reasoning.harmony_ids`)."""

    format: Optional[str] = None
    start_ids: tuple[int, ...] = ()
    end_ids: tuple[int, ...] = ()
    switch: Optional[str] = None
    effort: Optional[str] = None
    analysis_open: tuple[int, ...] = ()  # harmony: `<|channel|>analysis<|message|>`, a prompt ending in it is inside


@dataclass(frozen=True)
class ReasoningPlan:
    """One request's reasoning: `template_kwargs` for the chat template, and what the engine is told."""

    support: ReasoningSupport
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    budget: Optional[int] = None
    enabled: bool = True

    def params(self, prompt_ids: Sequence[int], max_tokens: int) -> Optional[ReasoningParams]:
        """The engine's `ReasoningParams` for the rendered prompt (None for a model without reasoning); the budget
        is clamped to `max_tokens` (the request's, after the context clamped it): a larger one never binds."""
        s = self.support
        if s.format is None:
            return None
        if s.format == "think":
            inside = ends_inside(prompt_ids, s.start_ids, s.end_ids)
        else:
            n = len(s.analysis_open)
            inside = n > 0 and tuple(prompt_ids[-n:]) == s.analysis_open
        budget = None if self.budget is None else min(self.budget, max_tokens)
        return ReasoningParams(format=s.format, start_ids=s.start_ids, end_ids=s.end_ids, starts_inside=inside,
                               budget=budget)


_SUPPORT: "weakref.WeakKeyDictionary[Any, ReasoningSupport]" = weakref.WeakKeyDictionary()


def _template_source(wrapper: Any) -> str:
    source = getattr(wrapper, "chat_template", None)
    if isinstance(source, dict):  # several named templates
        return "\n".join(str(v) for v in source.values())
    return source if isinstance(source, str) else ""


def _detect(wrapper: Any) -> ReasoningSupport:
    source = _template_source(wrapper)
    effort = "reasoning_effort" if "reasoning_effort" in source else None
    vocab = wrapper.get_vocab() if hasattr(wrapper, "get_vocab") else {}
    if "<|channel|>" in vocab and "<|message|>" in vocab:
        try:
            start, end = harmony_ids(wrapper)
        except ValueError:
            pass
        else:
            opening = tuple(wrapper.encode("<|channel|>analysis<|message|>", add_special_tokens=False))
            return ReasoningSupport("harmony", start, end, None, effort, opening)
    if getattr(wrapper, "has_thinking", False):
        start = tuple(getattr(wrapper, "_think_start_tokens", ()) or ())
        end = tuple(getattr(wrapper, "_think_end_tokens", ()) or ())
        if start and end:
            kwarg = getattr(wrapper, "_thinking_kwarg", "enable_thinking") or "enable_thinking"
            return ReasoningSupport("think", start, end, kwarg if kwarg in source else None, effort)
    for start_text, end_text in THINK_MARKERS:
        start, end = _single_token(wrapper, vocab, start_text), _single_token(wrapper, vocab, end_text)
        if start is not None and end is not None:
            switch = "enable_thinking" if "enable_thinking" in source else None
            return ReasoningSupport("think", (start,), (end,), switch, effort)
    return ReasoningSupport(None, (), (), None, effort)


def _single_token(wrapper: Any, vocab: dict, text: str) -> Optional[int]:
    """The id of `text` when the tokenizer has it as one token (encoding it gives that id alone), else None."""
    token_id = vocab.get(text)
    if token_id is None:
        return None
    try:
        encoded = list(wrapper.encode(text, add_special_tokens=False))
    except Exception:
        return None
    return token_id if encoded == [token_id] else None


def reasoning_support(wrapper: Any) -> ReasoningSupport:
    """The `ReasoningSupport` of a tokenizer (mlx-lm's `TokenizerWrapper`), found once and cached."""
    try:
        return _SUPPORT[wrapper]
    except (KeyError, TypeError):
        pass
    support = _detect(wrapper)
    try:
        _SUPPORT[wrapper] = support
    except TypeError:  # not weak-referenceable: computed each time
        pass
    return support


def plan_reasoning(support: ReasoningSupport, effort: Optional[str], budget: Optional[int],
                   template_kwargs: Optional[dict[str, Any]]) -> ReasoningPlan:
    """The plan of one chat request: `effort` its `reasoning_effort`, `budget` its `thinking_token_budget` (tokens,
    >= 0), `template_kwargs` its `chat_template_kwargs`. 400 naming `chat_template_kwargs.<key>` for a key the
    router sets itself."""
    for key in template_kwargs or {}:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise bad_request(f"chat_template_kwargs.{key}: the router sets {key!r} itself: leave it out",
                              f"chat_template_kwargs.{key}")
    kwargs: dict[str, Any] = {}
    enabled = True
    if effort in OFF_EFFORTS and not (effort == "minimal" and support.format == "harmony"):
        enabled = False
        if support.switch is not None:
            kwargs["enable_thinking"] = False  # mlx-lm's wrapper renames it to the template's own variable
        elif support.format is not None:
            budget = 0
    elif support.switch is not None:
        kwargs["enable_thinking"] = True
    if effort is not None and support.effort is not None:
        kwargs[support.effort] = _EFFORT_LEVELS.get(effort, "low")
    kwargs.update(template_kwargs or {})
    if support.switch is not None and "enable_thinking" in kwargs:
        enabled = bool(kwargs["enable_thinking"])
    return ReasoningPlan(support, kwargs, budget, enabled)
