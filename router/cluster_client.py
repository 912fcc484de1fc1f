"""ClusterEngineClient: the router's `EngineClient` over the workers of a topology (ZeroMQ control sockets).

One DEALER socket per worker (zmq.asyncio, on the router's event loop; no extra thread). A reader task per
worker dispatches its messages: output deltas to the request's stream, pongs to the worker's state. A
heartbeat task pings every worker each `heartbeat_s`; a worker is marked dead when its connection drops (a
ZeroMQ socket monitor sees the TCP connection close: the process died or its machine left the network;
ZeroMQ heartbeats catch a silent peer) or when it is silent for `dead_after_s` (longer than any engine step,
since a worker answers pings between steps):
no new request goes to it, and each of its requests either migrates (a decode worker died mid-stream and
another is alive: the request is re-run there from its prompt plus the tokens already streamed, so the client
sees one uninterrupted stream) or ends with an error. A dead worker that answers again is used again.

Placement (`router.placement.place`) picks a decode worker for every request and a prefill worker unless the
prompt is short (conditional disaggregation: the decode worker prefills it itself). The prefill worker
streams the first token; the decode worker streams the rest; the stream delivers them in order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

import zmq
import zmq.asyncio

from cluster.engine_client import EngineError, EngineStats
from cluster.kv.hashing import carried_hashes, extend_block_hashes, first_block_key
from cluster.protocol import (PROTOCOL_VERSION, TO_ROUTER, AbortRequest, Generate, Pong, ProtocolError, Rejected,
                              PrefixIndexSnapshot, ResetDone, ResetPrefixCache, pack, unpack)
from cluster.request import FinishReason, GenerateRequest, RequestOutput
from cluster.kv.plan import AUTO_MAX_SEQS
from cluster.topology import TopologySpec
from cluster.transport import CurveKeys, client_socket
from router.cluster_liveness import ClusterLiveness
from router.placement import WorkerState, place
from router.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    """One request in flight: where it runs, what it has streamed, and its outputs' queue."""

    request: GenerateRequest
    queue: asyncio.Queue
    decode: WorkerState
    prefill: Optional[WorkerState]
    first_seen: bool = False  # the prefill worker's first token arrived (decode outputs wait for it)
    decode_seen: bool = False  # an output came from the decode worker: it has taken over from the prefill worker
    held: list = field(default_factory=list)  # decode outputs that arrived before it
    token_ids: list = field(default_factory=list)
    num_cached_tokens: int = 0
    migrated_from: int = 0  # tokens streamed before a migration (added to the new worker's counts)
    finished: bool = False
    client_id: str = ""  # the request id the client's side knows; request.request_id is the workers' (a re-run
    # on the same worker gets a new one, so that outputs of the abandoned run are told apart and dropped)
    reruns: int = 0

    def __post_init__(self) -> None:
        self.client_id = self.client_id or self.request.request_id

    @property
    def workers(self) -> list[WorkerState]:
        return [w for w in (self.prefill, self.decode) if w is not None]


class ClusterEngineClient(ClusterLiveness):
    """`EngineClient` over the workers of `topology`; `model_name`/`max_model_len`/`revision` come from the
    model (cluster.model.ModelSpec). Without `revision` the router cannot hash prompts as the workers do, so
    `prefix_aware` placement sees no cached blocks (it then balances by load)."""

    def __init__(self, topology: TopologySpec, model_name: str, max_model_len: int,
                 keys: Optional[CurveKeys] = None, revision: Optional[str] = None):
        self.topology, self.model_name, self.max_model_len = topology, model_name, max_model_len
        self.block_size, self.revision = topology.engine.block_size, revision
        self.index = PrefixIndex([w.name for w in topology.workers])
        self.routing = topology.routing
        if keys is None and topology.security.curve_keys_dir:
            keys = CurveKeys.load(topology.security.curve_keys_dir)
        self.keys = keys
        self.ctx = zmq.asyncio.Context()
        self.workers = [WorkerState(spec) for spec in topology.workers]
        # a worker whose max_num_seqs follows its KV budget runs at most AUTO_MAX_SEQS (cluster/kv/plan.py)
        capacity = {role: sum((w.engine.max_num_seqs or AUTO_MAX_SEQS) + w.engine.max_waiting
                              for w in topology.workers if w.role == role) for role in ("prefill", "decode")}
        self.max_sequences = min(c for c in capacity.values() if c) if any(capacity.values()) else None
        self.streams: dict[str, _Stream] = {}
        self._tasks: list[asyncio.Task] = []
        self._seq = itertools.count()
        self._resets: dict[int, tuple[asyncio.Future, int]] = {}

    # -- life cycle ------------------------------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._tasks:
            return
        for w in self.workers:
            # ZeroMQ's own heartbeat notices a connection that went silent (a cable pulled, a host frozen); it
            # waits as long as the router's silence rule, so a worker on a saturated machine, whose I/O thread
            # may not run for seconds, is not dropped sooner than `dead_after_s` says
            w.sock = client_socket(self.ctx, zmq.DEALER, w.spec.endpoint(w.spec.control_port), self.keys, options={
                zmq.HEARTBEAT_IVL: int(self.routing.heartbeat_s * 1000),
                zmq.HEARTBEAT_TIMEOUT: int(self.routing.dead_after_s * 1000)})
            self._tasks.append(asyncio.ensure_future(self._reader(w)))
            self._tasks.append(asyncio.ensure_future(self._monitor(w)))
            if w.spec.events_port is not None:
                w.sub = client_socket(self.ctx, zmq.SUB, w.spec.endpoint(w.spec.events_port), self.keys)
                w.sub.setsockopt(zmq.SUBSCRIBE, b"")
                self._tasks.append(asyncio.ensure_future(self._events(w)))
        self._tasks.append(asyncio.ensure_future(self._heartbeat()))

    async def wait_ready(self, timeout_s: float) -> bool:
        """Start and wait until every worker has answered a ping (True) or `timeout_s` passed (False)."""
        self._ensure_started()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(w.alive for w in self.workers):
                return True
            await asyncio.sleep(0.05)
        return False

    async def close(self) -> None:
        """Stop the reader and monitor tasks and close every socket, on the event loop that used them (the
        app's shutdown does this; a socket left to the garbage collector would close on whatever thread
        collects it). Idempotent."""
        if self.ctx.closed:
            return
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)  # monitors close their sockets first
        for w in self.workers:
            for sock in (w.sock, w.sub):
                if sock is not None:
                    sock.close(linger=0)
        self.ctx.term()

    # -- EngineClient --------------------------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self._ensure_started()
        if request.request_id in self.streams:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        await self._wait_for_decode_worker()
        request = self.hashed(request)  # once here, for placement and for every worker after it
        cached = self.cached_blocks(request)
        prefill, decode = place(self.workers, request, self.routing, cached, self.block_size,
                                self.disk_blocks(request, cached))
        stream = _Stream(request, asyncio.Queue(), decode, prefill)
        self.streams[request.request_id] = stream
        self._dispatch(stream)
        yielded = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Rejected):
                    if yielded:  # a worker refused after another one streamed: end the stream with the reason
                        item = RequestOutput(request.request_id, finish_reason=FinishReason.ERROR, error=item.reason)
                    else:
                        raise item.error()
                yielded = True
                yield item
                if item.finished:
                    return
        finally:
            self._end(stream, abort=not stream.finished)

    async def abort(self, request_id: str) -> None:
        stream = self.streams.get(request_id)
        if stream is not None:
            self._end(stream, abort=True)

    def stats(self) -> EngineStats:
        return EngineStats.from_reports(w.stats for w in self.workers if w.alive and w.stats is not None)

    def is_healthy(self) -> bool:
        self._ensure_started()  # the first /health starts the heartbeats on the server's event loop
        return any(w.alive and w.spec.role == "decode" for w in self.workers)

    async def clear_prefix_cache(self) -> int:
        self._ensure_started()
        seq = next(self._seq)
        live = [w for w in self.workers if w.alive]
        fut = asyncio.get_running_loop().create_future()
        self._resets[seq] = (fut, len(live))
        fut.counts = []  # type: ignore[attr-defined]
        for w in live:
            await self._send(w, ResetPrefixCache(seq=seq))
        try:
            return await asyncio.wait_for(fut, self.routing.dead_after_s) if live else 0
        except asyncio.TimeoutError:
            return sum(fut.counts)  # type: ignore[attr-defined]
        finally:
            self._resets.pop(seq, None)

    def hashed(self, request: GenerateRequest) -> GenerateRequest:
        """`request` carrying the hashes of its prompt's full blocks under the workers' first-block key
        (`GenerateRequest.prompt_block_hashes`), which placement by prefix needs; the workers then hash none of
        them. Hashes it carries already under that key are kept, only the blocks past them are hashed (a
        continuation's prompt grew). Unchanged when the router does not place by prefix, or cannot know the key
        (no `revision`): the workers hash the prompt then."""
        if self.revision is None or self.routing.policy != "prefix_aware":
            return request
        e = self.topology.engine
        key = first_block_key(self.model_name, self.revision, e.dtype, e.kv_bits, e.kv_group_size, e.block_size,
                              request.cache_salt)
        known = carried_hashes(request.prompt_block_hashes, request.prompt_hash_key, key,
                               len(request.prompt_token_ids), self.block_size)
        if request.prompt_hash_key == key and len(known) == len(request.prompt_token_ids) // self.block_size:
            return request
        return request.with_block_hashes(extend_block_hashes(known, request.prompt_token_ids, self.block_size, key),
                                         key)

    def cached_blocks(self, request: GenerateRequest) -> Optional[dict[str, int]]:
        """Leading blocks of the prompt each worker's prefix cache holds (None: not known here), from its block
        hashes (`hashed`)."""
        request = self.hashed(request)
        if request.prompt_hash_key is None:
            return None
        return self.index.match_hashes(request.prompt_block_hashes, self.block_size)

    def disk_blocks(self, request: GenerateRequest, cached: Optional[dict[str, int]]) -> Optional[dict[str, int]]:
        """Of `cached` (`cached_blocks` of `request`), the blocks each worker holds only on its SSD tier."""
        if not cached:
            return None
        return self.index.on_disk(self.hashed(request).prompt_block_hashes, cached)

    def worker_stats(self) -> list[dict]:
        """Each worker's last report (`WorkerStats.report`, empty before its first) plus the router's view
        (alive, requests in flight)."""
        return [dict(w.stats.report() if w.stats is not None else {}, name=w.spec.name, role=w.spec.role,
                     alive=w.alive, inflight=len(w.inflight))
                for w in self.workers]

    # -- internals -------------------------------------------------------------------------------------------

    async def _wait_for_decode_worker(self) -> None:
        deadline = time.monotonic() + self.routing.dead_after_s
        while not self.is_healthy():
            if time.monotonic() > deadline:
                raise EngineError("no decode worker is alive", retry_after=self.routing.dead_after_s)
            await asyncio.sleep(0.05)

    def _dispatch(self, stream: _Stream) -> None:
        """Send the request to its workers (decode first, so it expects the KV)."""
        rid = stream.request.request_id
        for w in stream.workers:
            w.inflight.add(rid)
        self._post(stream.decode, Generate(request=stream.request, prefilled=stream.prefill is not None))
        if stream.prefill is not None:
            kv = stream.decode.spec.endpoint(stream.decode.spec.kv_port)
            self._post(stream.prefill, Generate(request=stream.request, decode_endpoint=kv))

    def _end(self, stream: _Stream, abort: bool) -> None:
        rid = stream.request.request_id
        for key in {rid, stream.client_id}:
            if self.streams.get(key) is stream:
                del self.streams[key]
        stream.finished = True
        for w in stream.workers:
            if abort:  # the client left (or the stream broke): free its blocks on every worker
                self._post(w, AbortRequest(request_id=rid))
            w.inflight.discard(rid)

    def _post(self, w: WorkerState, msg) -> None:
        asyncio.ensure_future(self._send(w, msg))

    def _post_all(self, w: WorkerState, msgs: list) -> None:
        """Send `msgs` to `w` in this order (one task, so a later message never overtakes an earlier one)."""
        async def send_all() -> None:
            for msg in msgs:
                await self._send(w, msg)
        asyncio.ensure_future(send_all())

    async def _send(self, w: WorkerState, msg) -> None:
        try:
            await w.sock.send(pack(msg), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.debug("could not send %s to %s: %s", msg.type, w.spec.name, exc)

    async def _reader(self, w: WorkerState) -> None:
        while True:
            try:
                frames = await w.sock.recv_multipart()
                msg = unpack(frames[0], TO_ROUTER, PROTOCOL_VERSION)
                self._on_message(w, msg)
            except asyncio.CancelledError:
                raise
            except (ProtocolError, IndexError) as exc:
                logger.warning("dropped a malformed message from %s: %s", w.spec.name, exc)
            except Exception:
                logger.exception("router: handling a message from %s failed", w.spec.name)

    def _on_message(self, w: WorkerState, msg) -> None:
        if isinstance(msg, Pong):
            w.last_pong, w.stats = time.monotonic(), msg.stats
            if not w.alive:
                logger.info("worker %s is alive", w.spec.actor_name)
            w.alive = True
            return
        if isinstance(msg, PrefixIndexSnapshot):
            self.index.apply_snapshot(w.spec.name, msg.boot_id, msg.last_event_seq,
                                      [(g.group, g.reach_tokens, g.block_hashes) for g in msg.groups])
            w.snapshot_asked = 0.0
            return
        if isinstance(msg, ResetDone):
            entry = self._resets.get(msg.seq)
            if entry is not None:
                fut, expected = entry
                fut.counts.append(msg.count)
                if len(fut.counts) == expected and not fut.done():
                    fut.set_result(sum(fut.counts))
            return
        rid = msg.request_id if isinstance(msg, Rejected) else msg.output.request_id
        stream = self.streams.get(rid)
        if stream is None or stream.finished or w not in stream.workers or rid != stream.request.request_id:
            return  # late: finished, aborted, migrated away, or from a run given up for a re-run
        if isinstance(msg, Rejected):
            self._deliver(stream, msg)
            return
        out = msg.output
        if w is stream.decode:
            stream.decode_seen = True
        if w is stream.prefill:
            stream.first_seen = True
            self._deliver(stream, out)
            for held in stream.held:
                self._deliver(stream, held)
            stream.held.clear()
        elif stream.prefill is not None and not stream.first_seen and out.token_ids:
            stream.held.append(out)  # tokens after the first: wait for the first (an error passes at once)
        else:
            self._deliver(stream, out)

    def _deliver(self, stream: _Stream, item) -> None:
        if stream.finished:
            return
        if isinstance(item, RequestOutput):
            if item.request_id != stream.client_id:  # a re-run under the workers' new id
                item = dataclasses.replace(item, request_id=stream.client_id)
            stream.token_ids += item.token_ids
            if stream.migrated_from:
                item = dataclasses.replace(item, num_prompt_tokens=len(stream.request.prompt_token_ids),
                                           num_cached_tokens=stream.num_cached_tokens,
                                           num_output_tokens=item.num_output_tokens + stream.migrated_from)
            elif item.num_cached_tokens:
                stream.num_cached_tokens = item.num_cached_tokens
            if item.finished:
                stream.finished = True
                for other in stream.workers:  # the others may still hold state for it
                    self._post(other, AbortRequest(request_id=stream.request.request_id))
        elif isinstance(item, Rejected):
            stream.finished = True
            for other in stream.workers:
                self._post(other, AbortRequest(request_id=stream.request.request_id))
        stream.queue.put_nowait(item)
