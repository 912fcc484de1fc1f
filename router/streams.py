"""Running the n sequences of one request against the engine, and delivering them over SSE.

`ChoiceStreams` consumes `engine.generate()` for every choice concurrently (one task each) and merges
the deltas into one queue, in arrival order:

    engine.generate(req-0) --pump task--\\
    engine.generate(req-1) --pump task---> queue --> next() -> (index, RequestOutput)
    watch_disconnect()     --sentinel---/

`aclose()` ends everything: it cancels the pump tasks (which closes each engine generator, whose
`finally` aborts the request, per the EngineClient contract) and then calls `engine.abort()` for each
choice that had not finished, so a disconnected client never keeps the engine busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Sequence

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse

from cluster.engine_client import EngineClient
from cluster.request import GenerateRequest, RequestOutput
from router.metrics import RouterMetrics, SequenceTimer

logger = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0  # bound on cleanup awaits, so a stuck engine cannot hang the router


class StallTimeout(Exception):
    """The engine produced nothing for `stall_timeout_s`."""


class ClientDisconnected(Exception):
    """The HTTP client went away before the answer was complete."""


class EngineStreamEnded(Exception):
    """An engine generator ended without a finishing delta (a broken engine)."""


_DISCONNECT = object()


class ChoiceStreams:
    """The merged output of the n GenerateRequests of one HTTP request.

    Invariants: `next()` yields each choice's deltas in order and stops being useful once `done`;
    a choice's finishing delta is the last one taken from its engine generator; `aclose()` is idempotent
    and leaves no task running and no unfinished request un-aborted.
    """

    def __init__(self, engine: EngineClient, requests: Sequence[GenerateRequest], *,
                 stall_timeout_s: float, metrics: Optional[RouterMetrics] = None,
                 arrival: Optional[float] = None,
                 synthetic: Optional[Sequence[RequestOutput]] = None):
        self._engine = engine
        self._requests = tuple(requests)
        self._timeout = stall_timeout_s
        self._metrics = metrics
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._finished = [False] * len(self._requests)
        start = time.monotonic() if arrival is None else arrival
        self._timers = [SequenceTimer(metrics, start) for _ in self._requests]
        self._arrival = start
        self._synthetic = synthetic
        self._closed = False
        self._active = 0

    @property
    def done(self) -> bool:
        """True when every choice has delivered its finishing delta."""
        return all(self._finished)

    def start(self) -> None:
        """Submit every choice (or queue the synthetic outputs, for answers that need no engine)."""
        if self._tasks or self._closed:
            return
        if self._synthetic is not None:
            for i, out in enumerate(self._synthetic):
                self._queue.put_nowait((i, out))
            return
        history = self._metrics.history if self._metrics is not None else None
        for i, req in enumerate(self._requests):
            if history is not None:  # the dashboard's in-flight list (router/dashboard_history.py)
                history.begin(req.request_id, self._arrival)
            self._tasks.append(asyncio.create_task(self._pump(i, req), name=f"pump-{req.request_id}"))
        self._active = len(self._tasks)
        if self._metrics is not None:
            self._metrics.active.inc(self._active)

    async def _pump(self, index: int, req: GenerateRequest) -> None:
        agen: Any = None
        try:
            agen = self._engine.generate(req)
            async for out in agen:
                self._queue.put_nowait((index, out))
                if out.finished:
                    return
            self._queue.put_nowait((index, EngineStreamEnded(
                f"the engine ended request {req.request_id} without a finish_reason")))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # EngineError, or a broken engine: handed to the consumer
            self._queue.put_nowait((index, exc))
        finally:
            if agen is not None and hasattr(agen, "aclose"):
                with contextlib.suppress(BaseException):
                    await agen.aclose()
            self._dec_active()
            if self._metrics is not None and self._metrics.history is not None:
                self._metrics.history.end(req.request_id)

    def _dec_active(self) -> None:
        if self._active > 0:
            self._active -= 1
            if self._metrics is not None:
                self._metrics.active.dec()

    def disconnect(self) -> None:
        """Make the pending and every later `next()` raise ClientDisconnected."""
        self._queue.put_nowait((-1, _DISCONNECT))

    async def next(self) -> tuple[int, RequestOutput]:
        """The next delta of any choice. Raises the engine's exception for a choice that failed,
        StallTimeout when nothing came for `stall_timeout_s`, ClientDisconnected after `disconnect()`."""
        try:  # a delta already queued is taken without a timer (wait_for costs a task per call)
            index, item = self._queue.get_nowait()
        except asyncio.QueueEmpty:
            try:
                index, item = await asyncio.wait_for(self._queue.get(), self._timeout)
            except asyncio.TimeoutError:
                raise StallTimeout(f"the engine produced nothing for {self._timeout:g} s") from None
        if item is _DISCONNECT:
            self._queue.put_nowait((index, item))  # sticky
            raise ClientDisconnected()
        if isinstance(item, BaseException):
            raise item
        self._timers[index].observe(item)
        if item.finished:
            self._finished[index] = True
        return index, item

    async def aclose(self) -> None:
        """Stop every choice: close the engine generators, then abort what had not finished."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):  # runs to the end even inside a cancelled stream
            pending = [t for t in self._tasks if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                _, still = await asyncio.wait(pending, timeout=ABORT_TIMEOUT_S)
                if still:
                    logger.warning("%d engine generators did not close in %.0f s", len(still),
                                   ABORT_TIMEOUT_S)
            for done, req in zip(self._finished, self._requests):
                if not done and self._synthetic is None:
                    try:
                        await asyncio.wait_for(self._engine.abort(req.request_id), ABORT_TIMEOUT_S)
                    except Exception:
                        logger.warning("engine.abort(%s) failed", req.request_id, exc_info=True)
            for _ in range(self._active):
                self._dec_active()
            if self._metrics is not None and self._metrics.history is not None:  # a task cancelled unstarted
                for req in self._requests:
                    self._metrics.history.end(req.request_id)


@contextlib.asynccontextmanager
async def watch_disconnect(request: Request, streams: ChoiceStreams,
                           interval_s: float = 0.2) -> AsyncIterator[None]:
    """While the block runs, poll `request.is_disconnected()` and call `streams.disconnect()` once it is."""

    async def poll() -> None:
        while True:
            await asyncio.sleep(interval_s)
            if await request.is_disconnected():
                streams.disconnect()
                return

    task = asyncio.create_task(poll())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def sse_event(payload: str) -> str:
    """One server-sent event carrying `payload` (already JSON)."""
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """A `text/event-stream` response that always runs `on_close` and closes its body iterator,
    whether the stream ended, the client went away, or the task was cancelled."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(BaseException):
                        await aclose()
                await self._on_close()
