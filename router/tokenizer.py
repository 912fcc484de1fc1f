"""The router's tokenizer: chat templates, prompt encoding, and token display strings for logprobs.

`RouterTokenizer` wraps mlx-lm's `TokenizerWrapper` (from `cluster.model.load_tokenizer`), or any object
with the same small interface (`encode`, `decode`, `apply_chat_template`, `convert_ids_to_tokens`,
`__len__`, `eos_token_ids`, optionally `detokenizer`, `added_tokens_decoder`, `chat_template`).

Output text is detokenized by the engine (`RequestOutput.text`); the router only needs a token's own
bytes for the logprobs `token`/`bytes` fields. A byte-level BPE token (GPT-2 alphabet) may hold part of a
UTF-8 character, so its display string escapes the bytes the way OpenAI does:

    id 30000 -> "}/{"           bytes [125, 47, 123]
    a token holding b"\\xe2\\x80" -> "\\\\xe2\\\\x80"   bytes [226, 128]

Speed (SmolLM2, this machine's CPU): encoding 10k characters takes ~3.5 ms, 100k ~30 ms, 1M ~0.5 s; the
chat template renders in well under 1 ms. Prompts longer than `offload_chars` are therefore tokenized
in a one-thread executor so the event loop keeps streaming other requests; shorter ones run inline.

Bounded work for prompts far over the context (`encode`/`render_chat` with `limit`): a text of at most
`DIRECT_CHARS_PER_TOKEN` (8) characters per token of `limit` is tokenized whole, as always (real text has
fewer characters per token, so a valid prompt is tokenized once). A longer text is first counted in pieces:
the first piece has `limit` (at least 1024) characters, each next one twice the one before, each cut before a
whitespace run where one is near, and counting stops as soon as the pieces hold at least `limit` tokens
plus a slack per cut; `PromptTooLong` then says so, having tokenized about the context's worth of text (at
most about twice the characters needed to reach the count). Why this never refuses a prompt that fits:
tokenizing two pieces separately changes only the tokens around the cut (the pre-tokenizer splits at
whitespace anyway; a cut inside a word changes a few tokens, measured at most 3 on SmolLM2; a cut inside
a special token such as "<|im_start|>" spells it in at most one token per byte), so the whole text has at
least the pieces' count minus the slack per cut, `CUT_SLACK_TOKENS` plus the longest added token's bytes.
The pieces double, so there are few cuts. A text that the pieces do not prove too long is then tokenized
whole, exactly, as a shorter one is (its token count is near or under the context).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import re
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TypeVar

T = TypeVar("T")


DIRECT_CHARS_PER_TOKEN = 8  # a text of at most this many characters per token of the limit is tokenized whole
CUT_SLACK_TOKENS = 32  # with the longest added token's bytes: the most one cut may add to a piecewise count
CUT_SEARCH_FRACTION = 4  # a cut looks for whitespace in the last 1/4 of its piece
_SPACE_AFTER_WORD_REVERSED = re.compile(r"\s\S")  # in the reversed text: a whitespace run's first character


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's chat template (the client's fault: a 400)."""


class PromptTooLong(ValueError):
    """The text has at least `at_least` tokens, which is >= the `limit` asked for; counting stopped there."""

    def __init__(self, at_least: int, limit: int):
        super().__init__(f"the text has at least {at_least} tokens (limit {limit}); counting stopped there")
        self.at_least = at_least
        self.limit = limit


def _cut(text: str, start: int, end: int) -> int:
    """Where the piece text[start:end] ends: just before the last whitespace run in its last quarter that
    follows a non-space character, else at `end` (the text's end stays the text's end)."""
    if end >= len(text):
        return len(text)
    floor = end - max(1, (end - start) // CUT_SEARCH_FRACTION)
    found = _SPACE_AFTER_WORD_REVERSED.search(text[floor:end + 1][::-1])  # rev[k] = text[end - k]
    return end - found.start() if found else end


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character -> byte map (the inverse of `bytes_to_unicode`)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class RouterTokenizer:
    """Tokenization for the HTTP layer. Thread-safe for reads; tokenizing runs on one worker thread."""

    def __init__(self, wrapper: Any, *, offload_chars: int = 4096):
        self._tok = wrapper
        self._offload_chars = offload_chars
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._info: dict[int, tuple[str, bytes]] = {}
        self._scheme = self._detect_scheme()
        added = getattr(wrapper, "added_tokens_decoder", None) or {}
        self._added = {int(i): str(getattr(t, "content", t)) for i, t in added.items()}
        self._cut_slack = CUT_SLACK_TOKENS + max((len(t.encode("utf-8")) for t in self._added.values()), default=0)
        self.vocab_size: int = len(wrapper)
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(getattr(wrapper, "eos_token_ids", ()) or ()))

    @classmethod
    def from_path(cls, path: Path, **kwargs: Any) -> "RouterTokenizer":
        """Load the tokenizer of an mlx-lm model folder (no weights)."""
        from cluster.model import load_tokenizer

        return cls(load_tokenizer(path), **kwargs)

    def _detect_scheme(self) -> str:
        try:
            from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

            detok = getattr(self._tok, "detokenizer", None)
            if isinstance(detok, BPEStreamingDetokenizer):
                return "bytelevel"
            if isinstance(detok, SPMStreamingDetokenizer):
                return "spm"
        except ImportError:  # pragma: no cover - mlx-lm is a dependency
            pass
        return "decode"

    @property
    def wrapped(self) -> Any:
        """The wrapped tokenizer (mlx-lm's TokenizerWrapper), for tool parsing and grammars."""
        return self._tok

    @property
    def has_chat_template(self) -> bool:
        """True when the model ships a chat template."""
        flag = getattr(self._tok, "has_chat_template", None)
        return bool(flag if flag is not None else getattr(self._tok, "chat_template", None))

    # ------------------------------------------------------------------------------ encoding

    def render_chat(self, messages: Sequence[dict[str, Any]], limit: Optional[int] = None,
                    tools: Optional[list[dict[str, Any]]] = None,
                    template_kwargs: Optional[dict[str, Any]] = None) -> tuple[str, list[int]]:
        """(prompt text, token ids) of `messages` rendered with the chat template plus the generation prompt;
        `tools` (OpenAI function tools) is passed to the template when given (router/tool_prompt.py), and
        `template_kwargs` as more template variables (router/reasoning.py: the thinking switch, the effort).

        Raises ChatTemplateError when there is no template or the template rejects the messages
        (e.g. roles that do not alternate), and PromptTooLong when the rendered text has at least `limit`
        tokens and is far longer than that (bounded work; see the module docstring).
        """
        if not self.has_chat_template:
            raise ChatTemplateError("this model has no chat template: use /v1/completions")
        try:
            extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
            text = self._tok.apply_chat_template(list(messages), add_generation_prompt=True,
                                                 tokenize=False, **extra)
        except Exception as exc:  # jinja2 TemplateError, or a template that raises on purpose
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from exc
        if not isinstance(text, str):
            raise ChatTemplateError("the chat template did not render to text")
        return text, self._encode(text, False, limit)

    def encode(self, text: str, limit: Optional[int] = None) -> list[int]:
        """Token ids of a completion prompt (with the tokenizer's BOS when it adds one).

        With `limit`, raises PromptTooLong instead when the text is far longer than `limit` tokens and
        has at least that many (bounded work; see the module docstring)."""
        return self._encode(text, True, limit)

    def _encode(self, text: str, add_special_tokens: bool, limit: Optional[int]) -> list[int]:
        if limit is not None and len(text) > DIRECT_CHARS_PER_TOKEN * max(limit, 1):
            self._refuse_if_over(text, limit)
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def _refuse_if_over(self, text: str, limit: int) -> None:
        """Count `text`'s tokens in growing pieces; PromptTooLong as soon as the count proves >= limit."""
        start, size, count, cuts = 0, max(limit, 1024), 0, 0
        while start < len(text):
            end = _cut(text, start, start + size)
            count += len(self._tok.encode(text[start:end], add_special_tokens=False))
            start, size = end, 2 * size
            at_least = count - self._cut_slack * cuts
            if at_least >= limit:
                raise PromptTooLong(at_least, limit)
            cuts += 1

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids` (special tokens kept, as in the prompt)."""
        return self._tok.decode(list(token_ids))

    async def arender_chat(self, messages: Sequence[dict[str, Any]], limit: Optional[int] = None,
                           tools: Optional[list[dict[str, Any]]] = None,
                           template_kwargs: Optional[dict[str, Any]] = None) -> tuple[str, list[int]]:
        """`render_chat`, off the event loop when the messages are long."""
        size = sum(len(m.get("content") or "") for m in messages) + (len(str(tools)) if tools else 0)
        return await self._maybe_offload(size, self.render_chat, messages, limit, tools, template_kwargs)

    async def aencode(self, text: str, limit: Optional[int] = None) -> list[int]:
        """`encode`, off the event loop when the text is long."""
        return await self._maybe_offload(len(text), self.encode, text, limit)

    async def adecode(self, token_ids: Sequence[int]) -> str:
        """`decode`, off the event loop when there are many ids."""
        return await self._maybe_offload(4 * len(token_ids), self.decode, token_ids)

    async def _maybe_offload(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        if size <= self._offload_chars:
            return fn(*args)
        if self._executor is None:
            # One thread: HF tokenizers mutate truncation state per call, so calls are serialised.
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        """Stop the tokenizer thread (if one was started)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    # ------------------------------------------------------------------------------ token strings

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` contributes to the text (special tokens: their literal text)."""
        return self._token_info(token_id)[1]

    def token_text(self, token_id: int) -> str:
        """The display string of one token: its UTF-8 text, with bytes of partial characters escaped."""
        return self._token_info(token_id)[0]

    def _token_info(self, token_id: int) -> tuple[str, bytes]:
        info = self._info.get(token_id)
        if info is None:
            raw = self._raw_bytes(token_id)
            info = (raw.decode("utf-8", errors="backslashreplace"), raw)
            if len(self._info) < 1_000_000:
                self._info[token_id] = info
        return info

    def _raw_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        if not 0 <= token_id < self.vocab_size:
            return b""
        if self._scheme == "decode":
            return self._tok.decode([token_id]).encode("utf-8")
        piece = self._tok.convert_ids_to_tokens([token_id])[0]
        if piece is None:
            return b""
        if self._scheme == "spm":
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode("utf-8")
        decoder = _byte_decoder()
        if all(c in decoder for c in piece):
            return bytes(decoder[c] for c in piece)
        return piece.encode("utf-8")
