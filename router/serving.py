"""The one serving path of every API: a `FrontDoor` per API (router/openai, router/anthropic, router/responses,
each in its `endpoints.py`) says how its request reads and what its answers look like; `serve` does the rest.

    read the body (size, JSON, Unicode; router/body.py) into the door's request model (400 naming the field)
    -> resolve the model name (404)
    -> translate into the OpenAI chat or completion request that asks for the same (the door's `translate`)
    -> prepare: tokenize, tools, grammar, sampling, n GenerateRequests (router/params.py)
    -> run the choices on the engine and answer whole or as an SSE stream, with the door's formatter
       (`serve_prepared`, below), counting tokens and latencies in the router's metrics

A 400 raised while translating or preparing names the API's own field (the door's `rename`), so a Messages
client reads `output_config.format`, not `response_format`.

Serving one prepared request: run its choices on the engine, answer whole or as an SSE stream.

Failure rules (what the client sees):

    EngineError before any output       503 (+ Retry-After when `retry_after` is set)
    ValueError from engine.generate()    400 (the engine's own check of the request)
    a choice finished "error"/"abort"   500 / 503 before the stream started, else an SSE error event ("abort":
                                         overload, or the cluster's fault: a worker or a KV transfer lost;
                                         503 with Retry-After)
    nothing from the engine for          504 before the stream started, else an SSE error event
      `stall_timeout_s`
    any other engine failure             500 (`engine_error`) or an SSE error event
    client disconnect                    every unfinished choice is aborted; nothing more is sent

A stream always ends with the formatter's end of stream (OpenAI's `data: [DONE]`; nothing after Anthropic's
`message_stop`) unless the client is gone. A streamed answer starts (status 200 and headers) when the first
delta arrives, so an engine that refuses the request still gets a proper status code; until then a side task
watches for a disconnect, as for non-streamed answers.

The bodies come from a `Formatter`, one per API (its `format.py`); the rules above are the same for every API.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Protocol, Union

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from cluster.engine_client import EngineClient, EngineError
from cluster.request import FinishReason, RequestOutput
from router.body import read_request
from router.errors import CLIENT_CLOSED, APIError, engine_unavailable, from_validation_error
from router.metrics import RouterMetrics
from router.params import PreparedRequest, prepare_chat, prepare_completion
from router.openai.request import ChatCompletionRequest, CompletionRequest, Usage
from router.tokenizer import RouterTokenizer
from router.choices import Accumulator, ChoiceState, finish_error
from router.streams import (ChoiceStreams, ClientDisconnected, EngineStreamEnded, SSEResponse, StallTimeout,
                            watch_disconnect)

logger = logging.getLogger(__name__)


class Formatter(Protocol):
    """The bodies of one API for one request. Chunks are the formatter's own strings; `frame` makes one SSE text."""

    def first_chunks(self) -> list[str]:
        """Chunks sent before the first delta's."""

    def delta_chunk(self, state: ChoiceState, out: RequestOutput) -> Union[None, str, list[str]]:
        """The chunk(s) for one delta of choice `state` (already added to it); None when it carries nothing."""

    def usage_chunk(self, usage: Usage) -> str:
        """The chunk after the last delta when the request asked for usage in the stream."""

    def response(self, acc: Accumulator) -> BaseModel:
        """The non-streamed answer."""

    def frame(self, chunk: str) -> str:
        """One chunk as SSE text."""

    def error_event(self, error: APIError) -> str:
        """The SSE text reporting `error` once the stream has started."""

    def end_of_stream(self) -> str:
        """The SSE text after everything else ("" for none)."""


def _same(error: APIError) -> APIError:
    return error


@dataclass(frozen=True)
class FrontDoor:
    """One API's way onto the serving path.

    `request_model`: the pydantic model of its body. `id_prefix`: of the request ids it makes ("chatcmpl-",
    "msg_", ...). `translate(req, model, context)`: the OpenAI `ChatCompletionRequest` or `CompletionRequest`
    that asks for what `req` asks (may raise `APIError` or pydantic's `ValidationError`). `formatter(req,
    prepared, ctx, created)`: the API's `Formatter` for one request (`ctx` the `ServingContext`: tokenizer,
    served model; `created`: Unix seconds).
    `rename(error)`: the error with the API's own field names (identity for OpenAI's chat and completions)."""

    request_model: type[BaseModel]
    id_prefix: str
    translate: Callable[[Any, str, dict[str, Any]], Union[ChatCompletionRequest, CompletionRequest]]
    formatter: Callable[[Any, PreparedRequest, "ServingContext", int], "Formatter"]
    rename: Callable[[APIError], APIError] = _same


@dataclass(frozen=True)
class ServingContext:
    """What every door's requests are served with: the engine client, the router's tokenizer and metrics,
    `resolve_model(name)` (the served name, 404 otherwise), `body_limit()` (bytes) and the engine's stall
    timeout in seconds."""

    engine: EngineClient
    tokenizer: RouterTokenizer
    metrics: Optional[RouterMetrics]
    resolve_model: Callable[[Optional[str]], str]
    body_limit: Callable[[], int]
    request_timeout_s: float

    @property
    def served_model(self) -> str:
        """The served model's own name (not an alias): what keys anything signed for it."""
        return getattr(self.engine, "model_name", "")

    @property
    def context(self) -> dict[str, Any]:
        """The validation context of request models and doors: the engine's context length, the served model's
        name (not an alias)."""
        return {"max_model_len": self.engine.max_model_len, "served_model": self.served_model}

    async def read(self, http_request: Request, model: type[BaseModel]) -> Any:
        """The request body validated as `model` (router/body.py's rules)."""
        return await read_request(http_request, model, self.body_limit(), self.context)


async def serve(http_request: Request, door: FrontDoor, ctx: ServingContext) -> Response:
    """Serve one request that came in through `door` (the steps in the module docstring)."""
    arrival, arrival_wall = time.monotonic(), time.time()
    req = await ctx.read(http_request, door.request_model)
    model = ctx.resolve_model(req.model)
    max_model_len = ctx.engine.max_model_len
    try:
        openai_req = door.translate(req, model, ctx.context)
        prepare = prepare_chat if isinstance(openai_req, ChatCompletionRequest) else prepare_completion
        prepared = await prepare(openai_req, ctx.tokenizer, request_id=door.id_prefix + uuid.uuid4().hex,
                                 model=model, max_model_len=max_model_len, arrival_time=arrival_wall)
    except ValidationError as exc:
        raise door.rename(from_validation_error(exc)) from None
    except APIError as exc:
        raise door.rename(exc) from None
    capacity = getattr(ctx.engine, "max_sequences", None)
    if capacity and prepared.n > capacity:
        raise APIError(400, f"n={prepared.n} asks for more sequences than this server holds running and "
                            f"queued at once ({capacity}); lower n", param="n")
    formatter = door.formatter(req, prepared, ctx, int(arrival_wall))
    return await serve_prepared(http_request, prepared, formatter, engine=ctx.engine, metrics=ctx.metrics,
                                stall_timeout_s=ctx.request_timeout_s, arrival=arrival)


def to_api_error(exc: BaseException) -> APIError:
    """The HTTP error for an exception raised while running a request's choices."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineError):
        return engine_unavailable(f"the engine cannot take this request now: {exc}", exc.retry_after)
    if isinstance(exc, StallTimeout):
        return APIError(504, f"{exc}; the request was aborted", code="timeout")
    if isinstance(exc, ClientDisconnected):
        return APIError(CLIENT_CLOSED, "the client disconnected", code="client_disconnected")
    if isinstance(exc, ValueError):  # the engine's own request check (e.g. InProcessEngineClient.check_request)
        return APIError(400, f"the engine rejected this request: {exc}")
    if isinstance(exc, EngineStreamEnded):
        return APIError(500, str(exc), code="engine_error")
    logger.error("the engine failed a request", exc_info=exc)
    return APIError(500, f"the engine failed this request: {type(exc).__name__}: {exc}", code="engine_error")


def _synthetic_outputs(prepared: PreparedRequest) -> Optional[list[RequestOutput]]:
    """Finished outputs for max_tokens 0 (no engine call), unless echo needs the prompt's logprobs."""
    if prepared.max_tokens != 0 or (prepared.echo and prepared.logprobs is not None):
        return None
    return [RequestOutput(request_id=r.request_id, finish_reason=FinishReason.LENGTH,
                          num_prompt_tokens=len(prepared.prompt_token_ids)) for r in prepared.requests]


async def serve_prepared(http_request: Request, prepared: PreparedRequest, formatter: Formatter, *,
                         engine: EngineClient, metrics: Optional[RouterMetrics], stall_timeout_s: float,
                         arrival: float) -> Response:
    """Run `prepared` on the engine and answer it (JSON, or SSE when `prepared.stream`)."""
    streams = ChoiceStreams(engine, prepared.requests, stall_timeout_s=stall_timeout_s, metrics=metrics,
                            arrival=arrival, synthetic=_synthetic_outputs(prepared))
    acc = Accumulator(prepared)
    if metrics is not None:
        metrics.prompt_tokens.inc(len(prepared.prompt_token_ids))
    streams.start()
    try:
        async with watch_disconnect(http_request, streams):
            first = await streams.next()
            if not prepared.stream:
                await _collect(first, streams, acc)
        error = finish_error(first[1])
        if error is not None:
            raise error
    except asyncio.CancelledError:
        await streams.aclose()
        raise
    except Exception as exc:
        await streams.aclose()
        raise to_api_error(exc) from exc
    if not prepared.stream:
        await streams.aclose()
        return Response(formatter.response(acc).model_dump_json(), media_type="application/json")
    return SSEResponse(_events(first, streams, acc, formatter), on_close=streams.aclose)


async def _collect(first: tuple[int, RequestOutput], streams: ChoiceStreams, acc: Accumulator) -> None:
    index, out = first
    while True:
        acc.add(index, out)
        error = finish_error(out)
        if error is not None:
            raise error
        if streams.done:
            return
        index, out = await streams.next()


async def _events(first: tuple[int, RequestOutput], streams: ChoiceStreams, acc: Accumulator,
                  formatter: Formatter) -> AsyncIterator[str]:
    """The SSE body: first chunks, the chunks of each delta, the usage chunk, then the end of stream."""
    try:
        for chunk in formatter.first_chunks():
            yield formatter.frame(chunk)
        index, out = first
        while True:
            state = acc.add(index, out)
            error = finish_error(out)
            if error is not None:
                yield formatter.error_event(error)
                break
            chunks = formatter.delta_chunk(state, out)  # None, one chunk, or several (tool calls)
            for chunk in ([chunks] if isinstance(chunks, str) else chunks or ()):
                yield formatter.frame(chunk)
            if streams.done:
                if acc.prepared.include_usage:
                    yield formatter.frame(formatter.usage_chunk(acc.usage()))
                break
            index, out = await streams.next()
    except ClientDisconnected:
        return
    except Exception as exc:
        yield formatter.error_event(to_api_error(exc))
    finally:
        await streams.aclose()
    end = formatter.end_of_stream()
    if end:
        yield end
