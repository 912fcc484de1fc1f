"""Helpers of the engine-level reasoning tests on the qwen3 thinking fixture (tests/thinking_models.py): engines,
prompts (ending inside reasoning or not), think-format ReasoningParams, greedy requests, the model's free output,
a small JSON schema grammar."""

from __future__ import annotations

import functools

import llguidance

from cluster.request import GenerateRequest, ReasoningParams, SamplingParams
from tests.engine_helpers import make_engine, run
from tests.thinking_models import THINK_TOKENS, load, qwen3_thinking_dir, token_id

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}
COMPACT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
EOS = 2  # the qwen3 fixture's <|im_end|>


@functools.lru_cache(maxsize=1)
def qwen3():
    """(loaded, start id, end id) of the qwen3 thinking fixture."""
    loaded = load(qwen3_thinking_dir())
    return (loaded, *(token_id(loaded[1], t) for t in THINK_TOKENS))


def engine(**config):
    """A fresh engine over the fixture (128 blocks of 8 tokens); `config` overrides EngineConfig fields."""
    return make_engine(qwen3()[0], **dict(dict(num_blocks=128, block_size=8), **config))


def prompt(question: str = "What is 2 + 2?", inside: bool = True) -> tuple[int, ...]:
    """The real Qwen3 template's prompt; `inside`: followed by `<think>\\n`, as templates that open the reasoning
    in the generation prompt end (Qwen3.5, DeepSeek-R1)."""
    tokenizer = qwen3()[0][1]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return tuple(ids) + (tuple(tokenizer.encode("<think>\n", add_special_tokens=False)) if inside else ())


def reasoning(budget=None, inside=True) -> ReasoningParams:
    """Think-format parameters with the fixture's `<think>` / `</think>`."""
    _, start, end = qwen3()
    return ReasoningParams("think", (start,), (end,), inside, budget)


def request(rid, max_tokens=12, p=None, **kw) -> GenerateRequest:
    """A greedy request of `p` (default: `prompt()`); `kw` are SamplingParams fields."""
    return GenerateRequest(rid, p or prompt(), SamplingParams(max_tokens=max_tokens, temperature=0, **kw))


def joined(result, field: str) -> str:
    """One text field (`text`, `reasoning_text`) of every output delta of a `Result`, joined."""
    return "".join(getattr(o, field) for o in result.outputs)


def decode(ids) -> str:
    """The fixture tokenizer's text of `ids` (special tokens skipped, as the engine's default)."""
    return qwen3()[0][1].decode(list(ids))


@functools.lru_cache(maxsize=None)
def free(max_tokens: int = 24, question: str = "What is 2 + 2?") -> tuple[int, ...]:
    """The model's greedy output with nothing constraining it."""
    r = request("free", max_tokens, prompt(question), ignore_eos=True)
    return tuple(run(engine(), [r])["free"].token_ids)


def grammar() -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=COMPACT)
