"""The streamed chunk of a plain text delta, spliced from a per-stream prefix and suffix around the JSON-escaped
text (router/openai/format.py's `TextChunks`), is byte for byte the chunk the pydantic models render, for chat and
completions, whatever the text holds; deltas with anything else (logprobs, reasoning, a finish) keep the general
path."""

from __future__ import annotations

import json
import random

import pytest

from cluster.request import FinishReason, GenerateRequest, RequestOutput, TokenLogprob
from router.choices import Accumulator
from router.openai.format import ChatFormatter, CompletionFormatter
from router.openai.output import (ChatChunkChoice, ChatCompletionChunk, CompletionChoice, CompletionResponse,
                                  DeltaMessage)
from router.params import PreparedRequest

TEXTS = ["", "hello", " world", "é", "日本語", "😀", "👩‍👩‍👧", '"quoted"', "back\\slash", "\\u0041", "line\nbreak",
         "\r\n\t\b\f", "\x00", "\x1f\x7f", "\u2028\u2029", "\ufeff", "</script>", "'single'", "{}[],:",
         "".join(map(chr, range(0x20))), "\U0010ffff", "a" * 1000]


def _random_texts(n: int) -> list[str]:
    rng = random.Random(7)
    pools = [(0, 0x80), (0, 0x800), (0xE000, 0x10000), (0x10000, 0x110000)]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(pools)
        out.append("".join(chr(rng.randrange(lo, hi)) for _ in range(rng.randint(1, 12))))
    return out


ALL_TEXTS = TEXTS + _random_texts(300)


def _prepared(n: int = 2, model: str = "org/model-1B", **kw) -> PreparedRequest:
    reqs = tuple(GenerateRequest(f"req-{i}", (1, 2, 3)) for i in range(n))
    return PreparedRequest(request_id="chatcmpl-abc123", model=model, prompt_token_ids=(1, 2, 3), prompt_text="Hi",
                           requests=reqs, max_tokens=16, stream=True, include_usage=False, logprobs=None, **kw)


def _chat_reference(p: PreparedRequest, index: int, text: str, created: int) -> str:
    return ChatCompletionChunk(id=p.request_id, created=created, model=p.model, choices=[
        ChatChunkChoice(index=index, delta=DeltaMessage(content=text))]).model_dump_json()


def _completion_reference(p: PreparedRequest, index: int, text: str, created: int) -> str:
    return CompletionResponse(id=p.request_id, created=created, model=p.model, choices=[
        CompletionChoice(index=index, text=text)]).model_dump_json()


@pytest.mark.parametrize("model", ["org/model-1B", 'we"ird\\mo\u2028del😀', "has\x00mlx-pd:text\x00marker"])
def test_chat_text_chunks_equal_the_models_rendering_raw_and_parsed(model):
    p = _prepared(model=model)
    formatter, acc = ChatFormatter(p, None, 1_700_000_000), Accumulator(p)
    for k, text in enumerate(ALL_TEXTS):
        index = k % p.n
        out = RequestOutput(f"req-{index}", (k,), text)
        got = formatter.delta_chunk(acc.add(index, out), out)
        want = _chat_reference(p, index, text, 1_700_000_000)
        assert got == want, (text, got, want)
        assert json.loads(got)["choices"][0]["delta"] == {"content": text}


@pytest.mark.parametrize("model", ["org/model-1B", "has\x00mlx-pd:text\x00marker"])
def test_completion_text_chunks_equal_the_models_rendering_raw_and_parsed(model):
    p = _prepared(model=model)
    formatter, acc = CompletionFormatter(p, None, 12), Accumulator(p)
    for k, text in enumerate(ALL_TEXTS):
        index = k % p.n
        out = RequestOutput(f"req-{index}", (k,), text)
        got = formatter.delta_chunk(acc.add(index, out), out)
        assert got == _completion_reference(p, index, text, 12), text
        assert json.loads(got)["choices"][0]["text"] == text


def test_the_splice_matches_the_general_path_for_every_unicode_scalar_value():
    p = _prepared(n=1)
    formatter = ChatFormatter(p, None, 5)
    text = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
    assert formatter.text_chunk(0, text) == _chat_reference(p, 0, text, 5)


def test_other_deltas_keep_the_general_path():
    p = _prepared(n=1)
    formatter, acc = ChatFormatter(p, None, 5), Accumulator(p)
    out = RequestOutput("req-0", (1,), "a")
    assert formatter.delta_chunk(acc.add(0, out), out) == _chat_reference(p, 0, "a", 5)
    out = RequestOutput("req-0", (2,), "b", reasoning_text="hmm")
    assert json.loads(formatter.delta_chunk(acc.add(0, out), out))["choices"][0]["delta"] == {
        "content": "b", "reasoning_content": "hmm", "reasoning": "hmm"}
    assert formatter.delta_chunk(acc.add(0, RequestOutput("req-0")), RequestOutput("req-0")) is None
    out = RequestOutput("req-0", (3,), "c", finish_reason=FinishReason.STOP)
    choice = json.loads(formatter.delta_chunk(acc.add(0, out), out))["choices"][0]
    assert choice == {"index": 0, "delta": {"content": "c"}, "logprobs": None, "finish_reason": "stop"}

    completion = CompletionFormatter(_prepared(n=1, echo=True), None, 5)
    acc = Accumulator(completion.p)
    out = RequestOutput("req-0", (1,), "a")
    assert json.loads(completion.delta_chunk(acc.add(0, out), out))["choices"][0]["text"] == "Hia"  # the echo
    assert completion.delta_chunk(acc.add(0, out), out) == _completion_reference(completion.p, 0, "a", 5)


def test_a_stream_with_logprobs_takes_the_general_path():
    class Tok:
        def token_text(self, t):
            return f"t{t}"

        def token_bytes(self, t):
            return f"t{t}".encode()

    p = _prepared(n=1)
    p = PreparedRequest(**{**p.__dict__, "logprobs": 1})
    formatter, acc = ChatFormatter(p, Tok(), 5), Accumulator(p)
    out = RequestOutput("req-0", (1,), "a", logprobs=(TokenLogprob(1, -0.5, ((1, -0.5),)),))
    chunk = json.loads(formatter.delta_chunk(acc.add(0, out), out))
    assert chunk["choices"][0]["logprobs"]["content"][0]["token"] == "t1"
