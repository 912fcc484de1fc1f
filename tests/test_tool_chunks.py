"""The chat formatter's tool-call bodies (router/openai/format.py) from hand-made engine deltas: OpenAI's chunk
sequence for text and calls split across deltas, logprobs held with held-back text and sent with the next
chunk, the whole answer built from the same deltas, finish reasons, and a call cut by max_tokens."""

from __future__ import annotations

import json

from cluster.request import FinishReason, GenerateRequest, RequestOutput, TokenLogprob
from router.params import PreparedRequest
from router.choices import Accumulator
from router.openai.format import ChatFormatter
from router.tool_calls import FALLBACK_PARSER, ToolParser
from tests.router_fakes import load_tokenizer
from tests.tool_helpers import WEATHER

TEXT = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def prepared(logprobs=None) -> PreparedRequest:
    import importlib

    parser = ToolParser(FALLBACK_PARSER, importlib.import_module(f"mlx_lm.tool_parsers.{FALLBACK_PARSER}"),
                        native=False, markers_are_special=False)
    return PreparedRequest(request_id="chatcmpl-1", model="m", prompt_token_ids=(1, 2), prompt_text="",
                           requests=(GenerateRequest("chatcmpl-1-0", (1, 2)),), max_tokens=50, stream=True,
                           include_usage=False, logprobs=logprobs, tools=(WEATHER,), tool_parser=parser)


def deltas(pieces, finish):
    """One delta per piece of text, each of one token (id = its position), the last one finishing."""
    outs = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        outs.append(RequestOutput("chatcmpl-1-0", (i,), piece, (TokenLogprob(i, -0.5, ((i, -0.5),)),),
                                  finish_reason=finish if last else None))
    return outs


def run(p, outs):
    formatter, acc = ChatFormatter(p, load_tokenizer(), 0), Accumulator(p)
    chunks = []
    for out in outs:
        state = acc.add(0, out)
        chunks += [json.loads(c) for c in formatter.delta_chunk(state, out)]
    return chunks, formatter.response(acc)


def test_text_and_a_call_split_across_deltas_make_openai_chunks_with_logprobs_on_the_next_chunk():
    pieces = ["Check", "ing.\n<tool", "_call>\n{\"name\": \"get_weather\", ", "\"arguments\": {\"city\": \"Oslo\"}}",
              "\n</tool_call>"]
    chunks, whole = run(prepared(logprobs=1), deltas(pieces, FinishReason.STOP))
    choices = [c["choices"][0] for c in chunks]
    assert [c["delta"] for c in choices] == [
        {"content": "Check"}, {"content": "ing."},
        {"tool_calls": [{"index": 0, "id": choices[2]["delta"]["tool_calls"][0]["id"], "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}]}]
    # the three deltas held back (inside the call) send their logprobs with the first chunk after them
    assert [len(c["logprobs"]["content"]) if c["logprobs"] else 0 for c in choices] == [1, 1, 3, 0]
    assert [c["finish_reason"] for c in choices] == [None, None, None, "tool_calls"]
    message = whole.choices[0].message
    assert message.content == "Checking." and whole.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls[0].function.arguments == '{"city": "Oslo"}'
    assert len(whole.choices[0].logprobs.content) == len(pieces)


def test_a_call_cut_by_length_sends_none_of_its_text_and_its_logprobs_ride_on_the_last_chunk():
    cut = TEXT[:-5]
    pieces = [cut[:12], cut[12:30], cut[30:]]
    chunks, whole = run(prepared(logprobs=1), deltas(pieces, FinishReason.LENGTH))
    choices = [c["choices"][0] for c in chunks]
    assert [c["delta"] for c in choices] == [{"content": "Checking."}, {}]
    assert [c["finish_reason"] for c in choices] == [None, "length"]
    # every token generated has its logprob: those of the dropped call on the finishing chunk
    assert [len(c["logprobs"]["content"]) for c in choices] == [1, 2]
    assert whole.choices[0].message.content == "Checking." and whole.choices[0].message.tool_calls is None
    assert whole.choices[0].finish_reason == "length" and len(whole.choices[0].logprobs.content) == len(pieces)


def test_text_without_calls_keeps_stop_and_a_final_delta_with_nothing_left_still_finishes():
    chunks, whole = run(prepared(), deltas(["Hello ", "there", ""], FinishReason.STOP))
    choices = [c["choices"][0] for c in chunks]
    assert "".join(c["delta"].get("content", "") for c in choices) == "Hello there"
    assert choices[-1]["finish_reason"] == "stop"
    assert whole.choices[0].message.content == "Hello there" and whole.choices[0].finish_reason == "stop"
