"""Single-node fallback mode: one engine on a background thread, reached through an in-process channel.

`LocalEngineClient` implements `cluster.engine_client.EngineClient` for the router. The engine thread owns
MLX: every model call happens on it. Commands (add, abort, clear cache) cross a thread-safe queue; outputs
come back through `loop.call_soon_threadsafe` into a per-request asyncio queue.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import queue
import threading
from typing import AsyncIterator, Callable, Optional

from cluster.config import EngineConfig
from cluster.engine_client import EngineError, EngineStats
from cluster.request import FinishReason, GenerateRequest, RequestOutput

logger = logging.getLogger(__name__)

OutputSink = Callable[[RequestOutput], None]


class EngineThread:
    """Runs `core.step()` in a loop on a daemon thread. `core` is a `cluster.engine.EngineCore`."""

    def __init__(self, core, idle_wait_s: float = 0.05):
        self.core = core
        self._commands: "queue.Queue[tuple]" = queue.Queue()
        self._sinks: dict[str, OutputSink] = {}
        self._stop = threading.Event()
        self._idle_wait_s = idle_wait_s
        self._stats = EngineStats()
        self.alive = True
        self._thread = threading.Thread(target=self._loop, name="mlx-pd-engine", daemon=True)

    def start(self) -> "EngineThread":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout)

    def submit(self, request: GenerateRequest, sink: OutputSink) -> None:
        self._commands.put(("add", request, sink))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def call(self, fn: Callable[[], object]) -> "asyncio.Future":
        """Run `fn(core)` on the engine thread; returns a concurrent future of its result."""
        import concurrent.futures

        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, fut))
        return fut

    @property
    def stats(self) -> EngineStats:
        return self._stats

    def _loop(self) -> None:
        self.core.owner.take()  # from here on only this thread touches the engine (cluster/ownership.py)
        try:
            while not self._stop.is_set():
                self._drain(block=not self.core.has_work())
                for out in self.core.step():
                    self._emit(out)
                self._refresh_stats()
        except BaseException:  # pragma: no cover - a bug in the loop itself
            logger.exception("engine loop died")
            self.alive = False
            for rid in list(self._sinks):
                self._emit(RequestOutput(rid, finish_reason=FinishReason.ERROR, error="the engine stopped"))
            raise

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self._idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, request, sink = cmd
            try:
                final = self.core.add_request(request)
            except Exception as exc:  # validation raced or a bug: fail this request only
                final = RequestOutput(request.request_id, finish_reason=FinishReason.ERROR, error=str(exc))
            self._sinks[request.request_id] = sink
            if final is not None:
                self._emit(final)
        elif kind == "abort":
            out = self.core.abort(cmd[1])
            if out is not None:
                self._emit(out)
        elif kind == "call":
            _, fn, fut = cmd
            try:
                fut.set_result(fn(self.core))
            except Exception as exc:
                fut.set_exception(exc)

    def _emit(self, out: RequestOutput) -> None:
        sink = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
        if sink is not None:
            sink(out)

    def _refresh_stats(self) -> None:
        core = self.core
        sch = core.scheduler
        self._stats = EngineStats(
            num_running=len(sch.running), num_waiting=len(sch.waiting),
            num_kv_blocks_total=core.pool.num_usable_blocks, num_kv_blocks_free=core.pool.num_free_blocks,
            kv_block_size=core.block_size, num_preemptions=sch.num_preemptions,
            prefix_cache_queries=sch.prefix_queries, prefix_cache_hits=sch.prefix_hits,
            spec_draft_tokens=core.num_draft_tokens, spec_accepted_tokens=core.num_accepted_tokens)


class LocalEngineClient:
    """`EngineClient` over an `EngineThread` in this process."""

    def __init__(self, thread: EngineThread, model_name: str):
        self.thread = thread
        self.model_name = model_name
        self.max_model_len = thread.core.max_model_len
        config = thread.core.config
        self.max_sequences = config.max_num_seqs + config.max_waiting
        self._ids = itertools.count()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if not self.thread.alive:
            raise EngineError("the engine is not running")
        stats = self.thread.stats
        if stats.num_waiting >= self.thread.core.config.max_waiting:
            raise EngineError(f"{stats.num_waiting} requests are already waiting; retry later", retry_after=1.0)
        self.thread.core.check_request(request)  # pure Python; raises ValueError for the router's 400
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.thread.submit(request, lambda out: loop.call_soon_threadsafe(outputs.put_nowait, out))
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.thread.abort(request.request_id)

    async def abort(self, request_id: str) -> None:
        self.thread.abort(request_id)

    def stats(self) -> EngineStats:
        return self.thread.stats

    def is_healthy(self) -> bool:
        return self.thread.alive

    async def clear_prefix_cache(self) -> int:
        fut = self.thread.call(lambda core: core.pool.reset_prefix_cache())
        return await asyncio.wrap_future(fut)


def start_local_engine(model: Optional[str] = None, config: Optional[EngineConfig] = None,
                       model_name: Optional[str] = None):
    """Load the model and start a colocated engine thread.

    Returns (LocalEngineClient, tokenizer_path). `model` is anything `cluster.model.resolve_model_path`
    accepts (None = the default SmolLM2). Runs the model load on the calling thread, then hands the
    model to the engine thread.
    """
    from cluster.engine import EngineCore
    from cluster.model import load_model, served_model
    from decode_node.speculative import build_drafters  # the colocated engine decodes too

    config = config or EngineConfig()
    path, spec = served_model(model, model_name, config.dtype)
    name = spec.model_id
    model_obj, tokenizer = load_model(path, dtype=config.dtype)
    core = EngineCore(model_obj, tokenizer, spec, config)
    core.drafters.update(build_drafters(core, model))
    thread = EngineThread(core).start()
    atexit.register(thread.stop)  # stop stepping before the interpreter tears MLX down
    return LocalEngineClient(thread, name), path
