"""The loop and control socket both worker roles share (prefill_node/worker.py, decode_node/worker.py).

A worker is one engine (cluster.engine.EngineCore) driven by one thread that also owns every socket of the
worker, so the KV pool has exactly one writer:

    loop: poll the control socket (router messages) -> poll KV transfer -> one engine step -> route outputs

The thread waits on its sockets only while it has nothing to compute (20 ms at most), so an idle worker
answers within milliseconds and a busy one between two steps. Nothing a request or a peer does can end the
loop: every handler's exception is logged and the loop carries on (`healthy` turns False only if the loop
itself stops).

Router messages arrive through a control channel (cluster/control.py): a ZeroMQ ROUTER socket in cluster
mode, an in-process queue in single-node mode, which runs a decode worker with no KV socket
(cluster/launch/single_node.py). Either way a request meets the same admission (`_admit`): a request id already
running here is a 400, then a request that can never run here (`EngineCore.check_request`) a 400 whatever the
load, then a full queue (`Scheduler.queue_full`) a 503 with Retry-After; the answer is a `Rejected` message and
nothing of the request is kept.

Roles implement `_on_generate`, `_on_abort`, `_poll_transfers`, `_after_step` and `_role_stats`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
import uuid
from typing import Callable, Optional

import zmq
from prometheus_client import CollectorRegistry, start_http_server

from cluster.control import ControlChannel, ZmqControl
from cluster.engine import EngineCore
from cluster.engine_client import EngineError
from cluster.owner_threads import OwnerThread, start_owner_thread
from cluster.kv.tier_setup import default_tier_dir
from cluster.kv.index_view import prefix_index_groups
from cluster.protocol import (AbortRequest, CacheGroupEntries, Generate, KVEvent, KVEvents, Ping, Pong,
                              PrefixIndexSnapshot, Rejected, ResetDone, ResetPrefixCache, SnapshotRequest,
                              pack)
from cluster.request import GenerateRequest, RequestOutput
from cluster.stats import WorkerStats
from cluster.topology import TopologySpec, WorkerSpec
from cluster.transport import CurveKeys, close_context, server_socket

logger = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.02
_STATS_EVERY_S = 0.5
CONTROL_MAX_MESSAGE_BYTES = 64 * 2**20  # a peer's larger message closes its connection (ZeroMQ MAXMSGSIZE); a
# generate for a 1M-token prompt is ~5 MB of msgpack


class Worker:
    """One prefill or decode worker: `start()` loads the model, binds its sockets and starts its loop thread.

    `loaded` is (model, tokenizer, ModelSpec) already loaded (None: load the topology's model); `engine` an
    `EngineCore` already built (None: build one from `loaded` and `spec.engine`); `channel` the control
    channel (None: a ZeroMQ ROUTER socket bound on `spec.control_port`)."""

    role = "?"

    def __init__(self, topology: TopologySpec, spec: WorkerSpec, loaded=None, engine: Optional[EngineCore] = None,
                 channel: Optional[ControlChannel] = None):
        self.topology, self.spec, self._loaded = topology, spec, loaded
        self.engine: Optional[EngineCore] = engine
        self.channel: Optional[ControlChannel] = channel
        self.ctx = zmq.Context()
        self.keys = CurveKeys.load(topology.security.curve_keys_dir) if topology.security.curve_keys_dir else None
        self.routes: dict[str, object] = {}  # request_id -> the peer (router) that sent it
        self._thread: Optional[OwnerThread] = None
        self._stop = threading.Event()
        self._calls: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()  # see call()
        self._stats = WorkerStats()
        self._stats_at = 0.0
        self.endpoints: dict = {}
        self._load_check = None  # the engine's load check as its stats report it (`LoadCheck.report`)
        self.group_rank = None  # rank 0's `cluster.parallel.rank.GroupRank` when the worker is a group
        self.tokens_out = 0
        self.registry = CollectorRegistry()  # this worker's Prometheus metrics (KV transfer)

    # -- life cycle ------------------------------------------------------------------------------------------

    def start(self) -> dict:
        """Load the model, bind the sockets, start the loop; returns {"name", "role", "control", "kv"}."""
        from cluster.load_check import checked_engine
        from cluster.model import load_model, served_model

        if self.engine is None and self.spec.group is not None:  # rank 0 of a group (cluster/parallel/)
            from cluster.parallel.rank import start_rank

            plan = self.spec.group.plan(self.topology.model.source, self.topology.model.served_name,
                                        self.spec.engine)
            self.group_rank = start_rank(plan, 0)
            self.engine = self.group_rank.engine
        if self.engine is None:
            if self._loaded is None:
                dtype = self.spec.engine.dtype
                path, model_spec = served_model(self.topology.model.source, self.topology.model.served_name, dtype)
                model, tokenizer = load_model(path, dtype)
                self._loaded = (model, tokenizer, model_spec)
            model, tokenizer, model_spec = self._loaded
            config = self.spec.engine
            if config.ssd_cache_gb and not config.ssd_cache_dir:  # each worker of a machine its own SSD tier
                config = dataclasses.replace(config, ssd_cache_dir=str(default_tier_dir(self.spec.name)))
            self.engine = checked_engine(model, tokenizer, model_spec, config)
        check = getattr(self.engine, "load_check", None)  # an engine built without one: not run
        self._load_check = check.report() if check is not None else None
        if self.channel is None:
            sock, endpoint = server_socket(self.ctx, zmq.ROUTER, self.spec.host, self.spec.control_port, self.keys,
                                           options={zmq.MAXMSGSIZE: CONTROL_MAX_MESSAGE_BYTES})
            self.channel = ZmqControl(sock, endpoint)
        self.boot_id = uuid.uuid4().hex[:16]  # a restarted worker's events start a new sequence
        self.events_pub, events = None, None
        if self.spec.events_port is not None:
            self.events_pub, events = server_socket(self.ctx, zmq.PUB, self.spec.host, self.spec.events_port, self.keys)
        self.endpoints = {"name": self.spec.name, "role": self.role, "control": self.channel.endpoint,
                          "kv": self._setup(),
                          "events": events, "metrics": None}
        if self.spec.metrics_port is not None:
            self._metrics_server, _ = start_http_server(self.spec.metrics_port, addr=self.spec.host,
                                                        registry=self.registry)
            self.endpoints["metrics"] = f"http://{self.spec.host}:{self.spec.metrics_port}/metrics"
        self._refresh_stats()
        self._thread = start_owner_thread(self._loop, self.spec.actor_name)  # never exits (cluster/owner_threads.py)
        return self.endpoints

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop (aborting transfers) and close every socket.

        The loop thread closes its own sockets as it ends (a ZeroMQ socket must not be closed by one thread
        while another uses it); then this stops the context's authenticator thread and terminates the
        context. A loop still running after `timeout_s` keeps its sockets, and this logs an error instead."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.error("%s: the loop did not stop within %.0f s; its sockets stay open",
                             self.spec.actor_name, timeout_s)
                return
        else:
            self._close_sockets()  # start() failed before the loop: this thread made the sockets
        if self.engine is not None:
            self.engine.close()
        close_context(self.ctx)
        server = getattr(self, "_metrics_server", None)
        if server is not None:
            server.shutdown()
            server.server_close()  # its port is free again: the worker can be started anew in this process

    @property
    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def call(self, fn: Callable[["Worker"], object], timeout_s: float = 30.0) -> object:
        """Run `fn(self)` on the loop thread between steps and return its result (or raise its exception);
        the way for another thread (a test, an actor method) to touch the engine. Raises TimeoutError when
        the loop has not run it within `timeout_s`."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, fut))
        return fut.result(timeout=timeout_s)

    def stats(self) -> WorkerStats:
        """The latest report (refreshed by the loop every 0.5 s), with `healthy` as of now."""
        return dataclasses.replace(self._stats, healthy=self.healthy)

    # -- the loop --------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        self.engine.owner.take()  # from here on only this thread touches the engine (cluster/ownership.py)
        try:
            while not self._stop.is_set():
                busy = self.engine.has_work() or self._transfers_busy()
                changed = self._poll_control(0.0 if busy else _IDLE_WAIT_S)
                self._guard(self._poll_transfers)
                if self.engine.has_work():
                    outputs = self._step()
                    if any(out.finished for out in outputs):
                        changed = True
                        self._refresh_stats()  # before the final output goes out: who sees it sees the freed blocks
                    self._guard(self._after_step, outputs)
                self._run_calls()
                self._guard(self._publish_events)
                if changed or time.monotonic() - self._stats_at > _STATS_EVERY_S:
                    self._refresh_stats()
        finally:
            self._guard(self._teardown)
            self._close_sockets()
            if self.group_rank is not None:  # a normal stop ends the group: its followers exit with status 0
                self._guard(self.group_rank.leader.stop, "the worker stops")
                self.group_rank.heartbeat.stop()

    def _step(self) -> list[RequestOutput]:
        """One engine step. A group's leader whose step fails has a broken group (a collective failed: the ring
        backend raises once a rank's connection drops; its followers ran the step or died), so the rank is lost
        as its heartbeat would lose it: by default the process ends with exit status 75, for its supervisor (Ray)
        to restart the group. Another worker's failure ends the loop, as it always did."""
        try:
            return self.engine.step()
        except Exception as exc:
            if self.group_rank is None:
                raise
            logger.critical("%s: a step of the group failed (%s: %s): the group is broken", self.spec.actor_name,
                            type(exc).__name__, exc)
            self.group_rank.heartbeat.on_lost(-1, 0.0)
            raise

    def _close_sockets(self) -> None:
        """Close the control channel and the events socket (role sockets close in `_teardown`)."""
        for sock in (self.channel, getattr(self, "events_pub", None)):
            if sock is not None:
                sock.close()

    def _run_calls(self) -> None:
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self))
                except Exception as exc:
                    fut.set_exception(exc)

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:  # a handler's bug must not end the worker
            logger.exception("%s: %s failed", self.spec.actor_name, getattr(fn, "__name__", fn))

    def _poll_control(self, timeout_s: float) -> bool:
        """Handle the router messages that arrive within `timeout_s`; True when there were any."""
        messages = self.channel.poll(timeout_s)
        for peer, msg in messages:
            self._guard(self._on_control, peer, msg)
        return bool(messages)

    def _on_control(self, peer, msg) -> None:
        if isinstance(msg, Generate):
            request = msg.request
            if request.request_id in self.routes:
                self._send(peer, Rejected(request_id=request.request_id, status=400,
                                          reason=f"request_id {request.request_id!r} is already running here"))
                return
            self.routes[request.request_id] = peer
            try:
                self._on_generate(request, msg)
            except ValueError as exc:  # it can never run here
                self._reject(request.request_id, str(exc), 400)
            except EngineError as exc:
                self._reject(request.request_id, str(exc), 503, exc.retry_after)
            except Exception as exc:  # a bug: answer (the request must not hang) and keep serving
                logger.exception("%s: generate %s failed", self.spec.actor_name, request.request_id)
                self._guard(self._on_abort, request.request_id)  # whatever it started is let go
                self._reject(request.request_id, f"internal error in the worker: {type(exc).__name__}: {exc}", 500)
        elif isinstance(msg, AbortRequest):
            if self.routes.pop(msg.request_id, None) is not None:
                self._on_abort(msg.request_id)
        elif isinstance(msg, Ping):
            self._refresh_stats()
            self._send(peer, Pong(seq=msg.seq, stats=self._stats))
        elif isinstance(msg, ResetPrefixCache):
            self._send(peer, ResetDone(seq=msg.seq, count=self.engine.kv.reset_prefix_cache()))
            self._publish_events()
        elif isinstance(msg, SnapshotRequest):
            self._publish_events()  # so the snapshot's last_event_seq covers everything published
            groups = [CacheGroupEntries(group=g.group, reach_tokens=g.reach_tokens, block_hashes=g.hashes)
                      for g in prefix_index_groups(self.engine.kv)]
            self._send(peer, PrefixIndexSnapshot(seq=msg.seq, boot_id=self.boot_id,
                                                 last_event_seq=self.engine.pool.last_event_seq, groups=groups))

    # -- to the router ---------------------------------------------------------------------------------------

    def _publish_events(self) -> None:
        """Send the prefix cache's new KV events to subscribers (the routers' prefix indexes)."""
        events = self.engine.kv.drain_events()
        if not events or self.events_pub is None:
            return
        batch = KVEvents(worker=self.spec.name, boot_id=self.boot_id,
                         events=[KVEvent(seq=e.seq, kind=e.kind, block_hashes=list(e.block_hashes), group=e.group) for e in events])
        try:
            self.events_pub.send(pack(batch), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a lost batch is a gap the router resyncs from a snapshot
            logger.debug("could not publish KV events: %s", exc)

    def emit(self, output: RequestOutput) -> None:
        """Send an output delta to the router that sent its request (the last one ends the route)."""
        peer = self.routes.get(output.request_id)
        if peer is None:
            return  # aborted meanwhile: nothing goes out after an abort
        if output.finished:
            del self.routes[output.request_id]
        self.tokens_out += len(output.token_ids)
        self.channel.send_output(peer, output)

    def _reject(self, request_id: str, reason: str, status: int, retry_after: Optional[float] = None) -> None:
        peer = self.routes.pop(request_id, None)
        if peer is not None:
            self._send(peer, Rejected(request_id=request_id, reason=reason, status=status, retry_after=retry_after))

    def _send(self, peer, msg) -> None:
        self.channel.send(peer, msg)

    def _refresh_stats(self) -> None:
        e = self.engine
        sched = e.scheduler
        self._stats = WorkerStats(
            name=self.spec.name, actor=self.spec.actor_name, role=self.role, host=self.spec.host,
            load_check=self._load_check,
            num_running=len(sched.running), num_waiting=len(sched.waiting), kv_block_size=e.block_size,
            num_preemptions=sched.num_preemptions, prefix_cache_queries=sched.prefix_queries,
            prefix_cache_hits=sched.prefix_hits, tokens_out=self.tokens_out, requests=len(self.routes),
            constrained_requests=e.grammars.num_constrained, grammar_mask_seconds=e.grammars.mask_seconds,
            kv_groups=e.kv.group_stats(self._transfer_metrics()),
            **(e.tier.engine_stats() if e.tier is not None else {}), ssd_block_worth=e.disk_block_worth(),
            **(self.group_rank.stats() if self.group_rank is not None else {}), **self._role_stats())
        self._stats_at = time.monotonic()


    # -- role hooks --------------------------------------------------------------------------------------------

    def _setup(self) -> Optional[str]:
        """Create role sockets; returns the KV endpoint (decode) or None."""
        return None

    def _admit(self, request: GenerateRequest, remote_decode: bool = False) -> None:
        """The admission rule every role applies before it takes a request: ValueError (the router's 400)
        when it can never run here, whatever the load (a 503 would ask for a retry that cannot succeed); then
        `EngineError` (503, Retry-After 1 s) when the queue is full."""
        self.engine.check_request(request, remote_decode)
        if self.engine.scheduler.queue_full():
            raise EngineError(f"the {self.role} queue is full ({self.spec.engine.max_waiting} requests); retry later",
                              retry_after=1.0)

    def _on_generate(self, request: GenerateRequest, msg: Generate) -> None:
        """Take a request (call `_admit` first); raises ValueError or EngineError to refuse it."""
        raise NotImplementedError

    def _on_abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _transfers_busy(self) -> bool:
        return False

    def _poll_transfers(self) -> None:
        pass

    def _after_step(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self.emit(out)

    def _role_stats(self) -> dict:
        """The role's `WorkerStats` fields (transfers, handoffs, speculation), by field name."""
        return {}

    def _transfer_metrics(self):
        """The role's KV transfer metrics (`kv_transfer.metrics.TransferMetrics`), None without transfers."""
        return None

    def _teardown(self) -> None:
        pass
