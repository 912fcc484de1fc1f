"""Single-node fallback mode: the decode worker's loop in this process, reached through an in-process channel.

Single-node mode is a `decode_node.worker.DecodeWorker` with no KV socket and no network socket: its loop
thread owns the engine (every model call happens on it), and its control channel is
`cluster.control.InProcessControl`. `InProcessEngineClient` implements `cluster.engine_client.EngineClient` for the
router over that channel, with the same messages a router sends a worker over ZeroMQ: so a request meets the
same admission (400 / 503 with Retry-After / admitted) as in cluster mode, the stats are the worker's report,
and outputs come back, unpacked, through `loop.call_soon_threadsafe` into a per-request asyncio queue.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
from typing import AsyncIterator, Optional

from cluster.config import EngineConfig
from cluster.control import InProcessControl
from cluster.engine_client import EngineError, EngineStats
from cluster.protocol import AbortRequest, Generate, Rejected, ResetDone, ResetPrefixCache
from cluster.request import FinishReason, GenerateRequest, RequestOutput
from cluster.topology import ModelSection, TopologySpec, WorkerSpec

logger = logging.getLogger(__name__)
HEALTH_CHECK_S = 1.0  # a request waiting for its next output checks this often that the loop still runs


class InProcessEngineClient:
    """`EngineClient` over a `DecodeWorker` running in this process (`start_in_process_worker`)."""

    def __init__(self, worker, channel: InProcessControl, model_name: str):
        self.worker, self.channel, self.model_name = worker, channel, model_name
        self.engine = worker.engine
        self.max_model_len = self.engine.max_model_len
        config = self.engine.config
        self.max_sequences = config.max_num_seqs + config.max_waiting
        self._seq = itertools.count()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if not self.worker.healthy:
            raise EngineError("the engine is not running")
        loop = asyncio.get_running_loop()
        answers: asyncio.Queue = asyncio.Queue()
        self.channel.submit(lambda item: loop.call_soon_threadsafe(answers.put_nowait, item),
                            Generate(request=request))
        finished = False
        try:
            while not finished:
                try:
                    item = await asyncio.wait_for(answers.get(), HEALTH_CHECK_S)
                except asyncio.TimeoutError:
                    if self.worker.healthy:
                        continue
                    finished = True  # the loop is gone: nothing more will come
                    yield RequestOutput(request.request_id, finish_reason=FinishReason.ERROR, error="the engine stopped")
                    return
                if isinstance(item, Rejected):
                    finished = True
                    raise item.error()
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.channel.submit(_ignore, AbortRequest(request_id=request.request_id))

    async def abort(self, request_id: str) -> None:
        self.channel.submit(_ignore, AbortRequest(request_id=request_id))

    def stats(self) -> EngineStats:
        return EngineStats.from_reports([self.worker.stats()])

    def is_healthy(self) -> bool:
        return self.worker.healthy

    def worker_stats(self) -> list[dict]:
        """The one worker's latest report (`cluster.worker.Worker.stats`) plus its liveness and requests in
        flight, as `router.cluster_client.ClusterEngineClient.worker_stats` gives each worker's (the dashboard)."""
        report = self.worker.stats().report()
        return [dict(report, alive=self.worker.healthy, inflight=report["requests"])]

    async def clear_prefix_cache(self) -> int:
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def answer(item) -> None:
            if isinstance(item, ResetDone):
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(item.count))

        self.channel.submit(answer, ResetPrefixCache(seq=next(self._seq)))
        return await asyncio.wait_for(done, 30.0)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the worker's loop (requests still running end with it)."""
        self.worker.stop(timeout_s)


def _ignore(item) -> None:
    return None


def start_in_process_worker(engine, model_source: Optional[str] = None, model_name: Optional[str] = None,
                            group_rank=None):
    """Run `engine` (a `cluster.engine.EngineCore`, its drafters injected or not) in a single-node decode
    worker's loop; returns its `InProcessEngineClient`. `model_source` is what a draft model defaults to (the
    target, quantized). `group_rank`: rank 0 of the group the engine leads (`cluster.parallel.rank.GroupRank`),
    whose ranks the worker's stats report. The loop thread owns the engine from here on."""
    from decode_node.worker import DecodeWorker  # the roof may import the roles

    topology = TopologySpec(name="single-node", model=ModelSection(source=model_source), engine=engine.config)
    spec = WorkerSpec(name="engine", role="decode", control_port=None, engine=engine.config)
    channel = InProcessControl()
    worker = DecodeWorker(topology, spec, engine=engine, channel=channel)
    worker.group_rank = group_rank
    worker.start()
    return InProcessEngineClient(worker, channel, model_name or engine.spec.model_id)


def start_single_node_engine(model: Optional[str] = None, config: Optional[EngineConfig] = None,
                             model_name: Optional[str] = None, tensor_parallel: int = 1,
                             memory_budget_gb: Optional[float] = None, pipeline_parallel: int = 1):
    """Load the model and start the single-node worker; with `tensor_parallel` (or `pipeline_parallel`) > 1 the
    engine is rank 0 of a group of that many local ranks (cluster/launch/local_group.py); both at once are
    refused (ValueError: MLX's ring backend cannot split a group). `memory_budget_gb`: each rank's budget for
    weights plus KV, checked at load (ValueError when exceeded).

    Returns (InProcessEngineClient, tokenizer_path). `model` is anything `cluster.model.resolve_model_path`
    accepts (None = the default SmolLM2). Runs the model load on the calling thread, then hands the
    engine to the worker's loop thread.
    """
    from cluster.load_check import checked_engine
    from cluster.model import load_model, served_model

    from cluster.launch.local_group import group_shape

    parallel, ranks = group_shape(tensor_parallel, pipeline_parallel)
    config = config or EngineConfig()
    path, spec = served_model(model, model_name, config.dtype)
    started = None
    if ranks > 1:  # rank 0 of a group of local ranks (local_group.py)
        from cluster.launch.local_group import local_plan, start_local_group

        started, _ = start_local_group(local_plan(ranks, model, model_name, config, memory_budget_gb,
                                                  parallel=parallel))
        engine = started.engine
    else:
        from cluster.memory_budget import check_rank_memory, check_weights

        model_obj, tokenizer = load_model(path, dtype=config.dtype)
        if memory_budget_gb is not None:
            check_weights(model_obj, memory_budget_gb, "this rank")
        engine = checked_engine(model_obj, tokenizer, spec, config)
        if memory_budget_gb is not None:
            check_rank_memory(model_obj, engine, memory_budget_gb, "this rank")
    client = start_in_process_worker(engine, model, spec.model_id, started)
    atexit.register(client.stop)  # stop stepping before the interpreter tears MLX down
    return client, path
