"""Host cost of the per-token path, old vs new in one run: `python -m benchmarks.wire_codec_bench`.

- `output` message: the worker packs a one-token delta, the router unpacks it. Old: the pydantic message model
  with `to_wire` / `from_wire` (cluster/protocol.py's generic codec, rebuilt here); new: `pack_output` and
  `unpack(..., TO_ROUTER, ...)` (msgspec).
- SSE chunk: one chat (and one completions) content delta. Old: the pydantic chunk model's `model_dump_json()`;
  new: `TextChunks` (router/openai/format.py).

Prints microseconds per message (best of `--repeat` timings of `--number` calls) and old/new.
"""

from __future__ import annotations

import argparse
import timeit
from typing import Literal

import msgpack
from pydantic import BaseModel, ConfigDict, TypeAdapter

from cluster.protocol import PROTOCOL_VERSION, TO_ROUTER, _typed, pack_output, unpack
from cluster.request import GenerateRequest, RequestOutput
from router.openai.format import ChatFormatter, CompletionFormatter
from router.openai.output import ChatChunkChoice, ChatCompletionChunk, CompletionChoice, CompletionResponse, DeltaMessage
from router.params import PreparedRequest


class _OldOutput(BaseModel):
    """The `output` message as it was: a strict pydantic model around the request-level codec."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")
    version: Literal[1] = PROTOCOL_VERSION
    type: Literal["output"] = "output"
    output: _typed(RequestOutput)


_OLD_ADAPTER = TypeAdapter(_OldOutput)


def _old_pack(out: RequestOutput) -> bytes:
    return msgpack.packb(_OldOutput(output=out).model_dump(), use_bin_type=True)


def _old_unpack(frame: bytes) -> RequestOutput:
    return unpack(frame, _OLD_ADAPTER, PROTOCOL_VERSION).output


def _new_unpack(frame: bytes) -> RequestOutput:
    return unpack(frame, TO_ROUTER, PROTOCOL_VERSION).output


def _time(fn, number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main(argv=None) -> None:
    """Time each pair and print a table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--number", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)

    delta = RequestOutput("chatcmpl-3f2a9c1e7b5d4a60-0", (12345,), " the", num_prompt_tokens=512,
                          num_cached_tokens=256, num_output_tokens=17)
    old_frame, new_frame = _old_pack(delta), pack_output(delta)
    assert _old_unpack(new_frame) == _new_unpack(old_frame) == _new_unpack(new_frame) == delta
    assert msgpack.unpackb(old_frame) == msgpack.unpackb(new_frame)

    prepared = PreparedRequest(request_id="chatcmpl-3f2a9c1e7b5d4a60", model="mlx-community/Llama-3.2-1B-Instruct-4bit",
                               prompt_token_ids=(1, 2, 3), prompt_text="", requests=(GenerateRequest("r", (1,)),),
                               max_tokens=64, stream=True, include_usage=False, logprobs=None)
    chat, completion = ChatFormatter(prepared, None, 1_700_000_000), CompletionFormatter(prepared, None, 1_700_000_000)
    text = " the"

    def old_chat() -> str:
        return ChatCompletionChunk(id=prepared.request_id, created=1_700_000_000, model=prepared.model, choices=[
            ChatChunkChoice(index=0, delta=DeltaMessage(content=text))]).model_dump_json()

    def old_completion() -> str:
        return CompletionResponse(id=prepared.request_id, created=1_700_000_000, model=prepared.model, choices=[
            CompletionChoice(index=0, text=text)]).model_dump_json()

    assert old_chat() == chat.text_chunk(0, text) and old_completion() == completion.text_chunk(0, text)

    rows = [
        ("output pack", lambda: _old_pack(delta), lambda: pack_output(delta)),
        ("output unpack", lambda: _old_unpack(old_frame), lambda: _new_unpack(new_frame)),
        ("output pack+unpack", lambda: _old_unpack(_old_pack(delta)), lambda: _new_unpack(pack_output(delta))),
        ("chat SSE chunk", old_chat, lambda: chat.text_chunk(0, text)),
        ("completions SSE chunk", old_completion, lambda: completion.text_chunk(0, text)),
    ]
    print(f"{'per message':<24}{'old us':>10}{'new us':>10}{'old/new':>10}")
    for name, old, new in rows:
        t_old, t_new = _time(old, args.number, args.repeat), _time(new, args.number, args.repeat)
        print(f"{name:<24}{t_old:>10.2f}{t_new:>10.2f}{t_old / t_new:>9.1f}x")


if __name__ == "__main__":
    main()
