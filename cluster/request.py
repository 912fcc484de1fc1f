"""Request-level types shared by the router and every worker.

`GenerateRequest` is what travels (router -> worker); `RequestOutput` is what comes back, one delta at a
time. Worker-local state (`Sequence`) lives in `cluster.sequence`. All types here are plain frozen
dataclasses of built-in values so that they can be sent as msgpack maps between hosts (no pickle).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
import numbers
from dataclasses import dataclass, field
from typing import Optional, Sequence


SPECULATIVE_METHODS = ("prompt_lookup", "draft_model")  # the drafters of decode_node/drafters.py
MAX_DRAFT_TOKENS = 16  # draft tokens per sequence per step at most
REASONING_FORMATS = ("think", "harmony")  # ReasoningParams.format (cluster/reasoning.py)
# the harmony specials whose ids a harmony ReasoningParams.start_ids lists, in this order
HARMONY_SPECIALS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")


class FinishReason(str, enum.Enum):
    """Why a sequence ended; the string values are OpenAI's `finish_reason` values (plus `abort`/`error`)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # client disconnect or explicit abort
    ERROR = "error"  # the engine failed this request (the engine itself keeps running)


def _token_ids(value) -> bool:
    """True for a tuple of token ids (ints >= 0, not bools)."""
    return isinstance(value, tuple) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


@dataclass(frozen=True)
class ReasoningParams:
    """How a thinking model's reasoning is told from its answer, token by token (cluster/reasoning.py has the rules).

    - `format`: "think" (reasoning between a start and an end marker: Qwen3, DeepSeek-R1, GLM, gemma4) or
      "harmony" (gpt-oss's channels: the analysis channel is the reasoning, the final channel the answer).
    - `start_ids`: for "think", the start marker's token ids (e.g. the id of `<think>`; several ids for a
      multi-token marker such as gemma4's `<|channel>thought`); for "harmony", the ids of the seven specials of
      `HARMONY_SPECIALS` in that order: `<|start|>`, `<|channel|>`, `<|message|>`, `<|end|>`, `<|return|>`,
      `<|call|>`, `<|constrain|>` (`cluster.reasoning.harmony_ids` reads them from a tokenizer).
    - `end_ids`: the token ids the engine forces to end the reasoning when the budget is spent: for "think" the end
      marker (e.g. the id of `</think>`), which also ends reasoning the model writes itself; for "harmony" the
      sequence that closes the analysis message and opens the final one,
      `<|end|><|start|>assistant<|channel|>final<|message|>` tokenized (it must begin with `<|end|>` and end with
      `<|message|>`).
    - `starts_inside`: the prompt ends inside an open reasoning section (a template that opens `<think>\n` in the
      generation prompt; `cluster.reasoning.ends_inside`), or for "harmony" inside an analysis message's body.
      False for harmony's usual generation prompt `<|start|>assistant`: the output begins with a header.
    - `budget`: the most reasoning tokens (None: no limit). A sequence that has produced `budget` reasoning
      tokens and is still inside reasoning gets `end_ids` forced, one token per step (the only token its mask
      allows), then goes on freely; 0 with `starts_inside` forces the end marker as the first tokens.
    - `num_generated`: the last `num_generated` prompt tokens are this request's own output, generated before it
      came here (a continuation after a worker died: `continue_request`); the state is replayed through them from
      `starts_inside`, so the count and the budget go on where they were. 0 for a new request.
    """

    format: str = "think"
    start_ids: tuple[int, ...] = ()
    end_ids: tuple[int, ...] = ()
    starts_inside: bool = False
    budget: Optional[int] = None
    num_generated: int = 0

    def __post_init__(self) -> None:
        def bad(name: str, value: object, rule: str) -> ValueError:
            return ValueError(f"reasoning.{name}={value!r} is invalid: {rule}")

        if self.format not in REASONING_FORMATS:
            raise bad("format", self.format, f"must be one of {', '.join(REASONING_FORMATS)}")
        for name in ("start_ids", "end_ids"):
            if not _token_ids(getattr(self, name)) or not getattr(self, name):
                raise bad(name, getattr(self, name), "must be a non-empty tuple of token ids >= 0")
        if self.format == "think" and self.start_ids == self.end_ids:
            raise bad("end_ids", self.end_ids, "the end marker must differ from the start marker")
        if self.format == "harmony":
            if len(self.start_ids) != len(HARMONY_SPECIALS) or len(set(self.start_ids)) != len(self.start_ids):
                raise bad("start_ids", self.start_ids, f"harmony needs the {len(HARMONY_SPECIALS)} distinct ids of "
                          f"{', '.join(HARMONY_SPECIALS)}, in that order")
            if self.end_ids[0] != self.start_ids[3] or self.end_ids[-1] != self.start_ids[2]:
                raise bad("end_ids", self.end_ids, "harmony's forced closing must begin with <|end|> and end with "
                          "<|message|> (<|end|><|start|>assistant<|channel|>final<|message|>)")
        if not isinstance(self.starts_inside, bool):
            raise bad("starts_inside", self.starts_inside, "must be true or false")
        if self.budget is not None and (not isinstance(self.budget, int) or isinstance(self.budget, bool)
                                        or self.budget < 0):
            raise bad("budget", self.budget, "must be an integer >= 0 or null (no limit)")
        if not isinstance(self.num_generated, int) or isinstance(self.num_generated, bool) or self.num_generated < 0:
            raise bad("num_generated", self.num_generated, "must be an integer >= 0")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one sequence. Validated on construction; a bad value raises `ValueError` naming it.

    Semantics follow the OpenAI API and vLLM:
      - `max_tokens`: new tokens to generate (>= 0). The engine clamps it to the context left
        (`max_model_len - num_prompt_tokens`) and then finishes with `length`.
      - `temperature` 0 means greedy (argmax). `top_p` in (0, 1], `top_k` 0 = off, `min_p` in [0, 1].
      - `repetition_penalty` (> 0, 1 = off) is the CTRL rule (Keskar et al. 2019, as in HF transformers):
        logits of already-seen tokens are divided by it when positive, multiplied when negative.
      - `presence_penalty` / `frequency_penalty` in [-2, 2] are OpenAI's additive penalties.
      - `logit_bias`: (token_id, bias) pairs added to the logits, bias in [-100, 100].
      - `logprobs`: None = off; k >= 0 = return the sampled token's logprob and the top-k alternatives.
      - `prompt_logprobs`: None = off; k >= 0 = logprobs of every prompt token after the first (echo).
      - `stop`: strings that end generation; they are never part of the returned text. With `reasoning` they
        are looked for in the answer text only: the reasoning's text never ends the output (a stop meant for
        the answer, such as "\n\n", would otherwise cut the thinking before any answer).
      - `stop_token_ids`: token ids that end generation (in addition to EOS unless `ignore_eos`).
      - `seed`: makes sampling reproducible for this sequence alone, independent of batching (with
        speculative decoding, for a given drafter and draft length: the draws differ from plain decoding's,
        the distribution does not).
      - `speculative_method`: None = the engine's default (`EngineConfig.speculative_method`, off unless
        set), else one of `SPECULATIVE_METHODS` ("prompt_lookup", "draft_model"; see decode_node/speculative.py).
      - `num_draft_tokens`: the most draft tokens per step for this sequence, in [0, MAX_DRAFT_TOKENS];
        None = the engine's default; 0 turns speculation off for this request.
      - `grammar`: None = free output; else a grammar every output token must follow (constrained decoding),
        as llguidance serializes it (`llguidance.LLMatcher.grammar_from_json_schema` / `grammar_from_lark`;
        the router builds it from `response_format` or `tool_choice`). The sequence ends with `stop` when the
        grammar is complete (the mask then allows only the model's EOS ids); `ignore_eos` is refused with it.
      - `grammar_prefix`: output tokens the grammar has already consumed elsewhere (a request the router moved
        to another decode worker after streaming them, now part of its prompt): the matcher replays them first.
      - `skip_special_tokens`: leave special tokens out of the output text (True, as vLLM); the router turns it
        off when a tool-call parser reads markers that are special tokens (e.g. Qwen's `<tool_call>`).
      - `reasoning`: None = the output is all answer; else how a thinking model's reasoning is told from its
        answer (`ReasoningParams`): the reasoning goes to `RequestOutput.reasoning_text`, a budget ends it, and a
        grammar constrains the answer after it only. With a grammar and `reasoning.num_generated`,
        `grammar_prefix` must be those same tokens (the matcher replays the answer's among them).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: Optional[int] = None
    speculative_method: Optional[str] = None
    num_draft_tokens: Optional[int] = None
    grammar: Optional[str] = None
    grammar_prefix: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    reasoning: Optional[ReasoningParams] = None

    def __post_init__(self) -> None:
        def bad(name: str, value: object, rule: str) -> ValueError:
            return ValueError(f"{name}={value!r} is invalid: {rule}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 0")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, value, "must be a finite number")
        if self.temperature < 0:
            raise bad("temperature", self.temperature, "must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "must be an integer >= 0 (0 disables it)")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", self.repetition_penalty, "must be > 0 (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, getattr(self, name), "must be in [-2, 2]")
        for token_id, bias in self.logit_bias:
            if not isinstance(token_id, int) or token_id < 0:
                raise bad("logit_bias", token_id, "keys must be token ids >= 0")
            if not -100 <= bias <= 100:
                raise bad("logit_bias", bias, "values must be in [-100, 100]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= 20):
                raise bad(name, value, "must be an integer in [0, 20] or null")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "stop strings must be non-empty strings")
        if len(self.stop) > 16:
            raise bad("stop", len(self.stop), "at most 16 stop strings")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "must be token ids >= 0")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", self.ignore_eos, "must be true or false")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "must be an integer or null")
        if self.speculative_method is not None and self.speculative_method not in SPECULATIVE_METHODS:
            raise bad("speculative_method", self.speculative_method,
                      f"must be one of {', '.join(SPECULATIVE_METHODS)} or null (the server's default)")
        k = self.num_draft_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_DRAFT_TOKENS):
            raise bad("num_draft_tokens", k, f"must be an integer in [0, {MAX_DRAFT_TOKENS}] (0 turns speculation "
                      "off) or null (the server's default)")
        if not isinstance(self.skip_special_tokens, bool):
            raise bad("skip_special_tokens", self.skip_special_tokens, "must be true or false")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise bad("grammar", self.grammar, "must be a non-empty grammar string or null")
        if self.grammar_prefix and (self.grammar is None or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.grammar_prefix)):
            raise bad("grammar_prefix", self.grammar_prefix, "must be token ids >= 0, and only with a grammar")
        if self.reasoning is not None and not isinstance(self.reasoning, ReasoningParams):
            raise bad("reasoning", self.reasoning, "must be ReasoningParams or null")
        if (self.reasoning is not None and self.grammar_prefix
                and len(self.grammar_prefix) != self.reasoning.num_generated):
            raise bad("grammar_prefix", self.grammar_prefix, "with reasoning it must be the request's own output "
                      "generated before (reasoning.num_generated tokens, the end of the prompt)")
        if self.grammar is not None and self.ignore_eos:
            raise bad("ignore_eos", self.ignore_eos, "cannot be combined with a grammar (response_format or "
                      "tool_choice), which ends the output once complete: drop ignore_eos")

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature 0)."""
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        """True when the output-token history changes the logits."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


@dataclass(frozen=True)
class GenerateRequest:
    """One sequence to generate, as sent by the router to a worker.

    `prompt_token_ids` is the fully rendered, tokenized prompt (the router owns chat templates).
    `cache_salt` is mixed into the first block hash so tenants never share prefix-cache blocks.
    `arrival_time` is the router's `time.time()` at arrival (seconds), used for TTFT and queue deadlines.
    `prompt_block_hashes`: the chained hashes of the prompt's leading full blocks (all of them, or a prefix: a
    continuation's prompt grew after they were computed), computed once where the prompt was first hashed (the
    router, for placement), under the first-block key `prompt_hash_key` (cluster.kv.hashing.first_block_key,
    salt included); a worker uses them only when that key is its own (`carried_hashes`). Empty (key None)
    when nobody hashed the prompt before the worker.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: Optional[str] = None
    arrival_time: float = 0.0
    prompt_block_hashes: tuple[int, ...] = ()
    prompt_hash_key: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        if len(self.prompt_token_ids) == 0:
            raise ValueError("the prompt is empty: send at least one token")
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in self.prompt_token_ids):
            raise ValueError("prompt_token_ids must be integers")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError("cache_salt must be a string or null")
        if not isinstance(self.arrival_time, (int, float)) or isinstance(self.arrival_time, bool):
            raise ValueError("arrival_time must be a number (seconds since the epoch)")
        self._check_hashes()
        reasoning, sp = self.sampling.reasoning, self.sampling
        if reasoning is not None and reasoning.num_generated:
            n = reasoning.num_generated
            if n >= len(self.prompt_token_ids):
                raise ValueError(f"reasoning.num_generated={n} must be less than the prompt's "
                                 f"{len(self.prompt_token_ids)} tokens (the output generated before is its end)")
            if sp.grammar_prefix and tuple(self.prompt_token_ids[-n:]) != tuple(sp.grammar_prefix):
                raise ValueError("grammar_prefix must be the last reasoning.num_generated prompt tokens: the output "
                                 "generated before")

    def _check_hashes(self) -> None:
        def u64(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**64

        if self.prompt_hash_key is not None and not u64(self.prompt_hash_key):
            raise ValueError("prompt_hash_key must be an integer in [0, 2**64) or null")
        if self.prompt_block_hashes and self.prompt_hash_key is None:
            raise ValueError("prompt_block_hashes need the prompt_hash_key they were computed under")
        if len(self.prompt_block_hashes) > len(self.prompt_token_ids) or not all(map(u64, self.prompt_block_hashes)):
            raise ValueError("prompt_block_hashes must be integers in [0, 2**64), at most one per prompt block")

    def with_block_hashes(self, hashes: Sequence[int], key: int) -> "GenerateRequest":
        """This request carrying `hashes`, its prompt's full-block hashes under the first-block key `key`. Only the
        new fields are checked: the rest was when this request was made (a long prompt's token check costs
        more than hashing it)."""
        out = copy.copy(self)
        object.__setattr__(out, "prompt_block_hashes", tuple(hashes))
        object.__setattr__(out, "prompt_hash_key", key)
        out._check_hashes()
        return out


def continue_request(request: GenerateRequest, streamed: Sequence[int]) -> Optional[GenerateRequest]:
    """The request that goes on from the tokens `request` has streamed so far (its worker died): its prompt plus
    those tokens, the rest of its max_tokens, no prompt logprobs, a grammar that replays them
    (`SamplingParams.grammar_prefix`) and reasoning that replays them (`ReasoningParams.num_generated`, so the
    reasoning count and budget go on). With nothing streamed, `request` itself; None when nothing is left to
    generate."""
    done = len(streamed)
    sp = request.sampling
    if sp.max_tokens - done <= 0:
        return None
    if not done:
        return request
    reasoning = sp.reasoning
    if reasoning is not None:
        reasoning = dataclasses.replace(reasoning, num_generated=reasoning.num_generated + done)
    sp = dataclasses.replace(sp, max_tokens=sp.max_tokens - done, prompt_logprobs=None, reasoning=reasoning,
                             grammar_prefix=sp.grammar_prefix + tuple(streamed) if sp.grammar is not None else ())
    return dataclasses.replace(request, prompt_token_ids=tuple(request.prompt_token_ids) + tuple(streamed),
                               sampling=sp)


@dataclass(frozen=True)
class TokenLogprob:
    """The logprob of one token, with the top alternatives at that position.

    `logprob` is the natural log of the model's softmax probability (float32 logits, before
    temperature and penalties, as vLLM reports by default). `top` is ((token_id, logprob), ...) sorted
    by descending logprob, of length `SamplingParams.logprobs`.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """A delta of one request's output: the tokens and text produced since the previous delta.

    `text` never contains any part of a stop string, and never ends inside a multi-byte character
    (no U+FFFD in a delta); text held back for those reasons is released by a later delta.
    `logprobs` has one entry per entry of `token_ids` when logprobs were requested, else None.
    `prompt_logprobs` (first delta only, when requested) has one entry per prompt token after the first.
    `finish_reason` is set on the last delta only; `error` carries a message when it is `error`.
    `stop_string` (last delta only) is the stop string that ended the output with `stop`; None when EOS, a
    stop token id, a complete grammar or anything else ended it (vLLM's `stop_reason`, strings only).

    With `SamplingParams.reasoning` (cluster/reasoning.py): `text` is the answer's text only and
    `reasoning_text` this delta's reasoning text, both without the markers and harmony headers (a harmony tool
    call is in `text` in its canonical form, `<tool_call>{"name": ..., "arguments": ...}</tool_call>`); the same
    invariants hold for each. `num_reasoning_tokens` is cumulative: the output tokens so far that are the
    reasoning's content ("think": between the markers, neither marker's tokens counted; harmony: the analysis
    messages' bodies, headers and `<|end|>` not counted), including those generated before a continuation
    (`ReasoningParams.num_generated`). Without reasoning, `reasoning_text` is "" and the count 0.
    """

    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: Optional[tuple[TokenLogprob, ...]] = None
    prompt_logprobs: Optional[tuple[TokenLogprob, ...]] = None
    finish_reason: Optional[FinishReason] = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: Optional[str] = None
    stop_string: Optional[str] = None
    reasoning_text: str = ""
    num_reasoning_tokens: int = 0

    @property
    def finished(self) -> bool:
        """True on the last delta of the request."""
        return self.finish_reason is not None
