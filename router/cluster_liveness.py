"""The router's view of worker liveness, and what it does when a worker goes: `ClusterLiveness`, a part of
`router.cluster_client.ClusterEngineClient` (which owns the sockets, streams and prefix index it uses).

A worker is marked dead the moment its control connection drops (a ZeroMQ socket monitor: the process died,
its machine left the network, or ZeroMQ's heartbeats found it silent) or when it has not answered a ping for
`dead_after_s`; its next pong makes it alive again. Its KV events feed the prefix index; a gap or a new boot
asks it for a snapshot. A dead decode worker's streams migrate (`_migrate`); a request whose prefill worker
dies before its decode worker has taken over (no first token yet, or a first token whose KV may never arrive)
is run by its decode worker instead (`_rerun_on_decode`), so the client sees a longer TTFT, not an error. A request with nowhere left to go ends with `FinishReason.ABORT` (the cluster's
fault, not the request's: the client gets a 503 with `Retry-After`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import zmq

from cluster.protocol import (KV_EVENTS, PROTOCOL_VERSION, AbortRequest, Generate, Ping, ProtocolError,
                              SnapshotRequest, unpack)
from cluster.request import FinishReason, RequestOutput, continue_request
from router.placement import WorkerState

if TYPE_CHECKING:
    from router.cluster_client import _Stream

logger = logging.getLogger("router.cluster_client")


class ClusterLiveness:
    """Heartbeats, connection monitors, KV-event feeds, and migration for ClusterEngineClient. Uses its
    `workers`, `streams`, `index`, `routing`, `_seq`, `_send`, `_post`, `_post_all` and `_deliver`."""

    async def _monitor(self, w: WorkerState) -> None:
        """Mark a worker dead the moment its connection drops (it comes back with its next pong)."""
        from zmq.utils.monitor import recv_monitor_message

        mon = w.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                event = await recv_monitor_message(mon)
                if event["event"] == zmq.EVENT_DISCONNECTED and w.alive:
                    self._mark_dead(w)
        finally:
            mon.close(linger=0)

    async def _events(self, w: WorkerState) -> None:
        """Feed the worker's KV events into the prefix index; a gap or a new boot asks for a snapshot."""
        while True:
            try:
                frames = await w.sub.recv_multipart()
                batch = unpack(frames[0], KV_EVENTS, PROTOCOL_VERSION)
                if batch.worker == w.spec.name and not self.index.apply_events(w.spec.name, batch.boot_id,
                                                                               batch.events):
                    await self._ask_snapshot(w)
            except asyncio.CancelledError:
                raise
            except (ProtocolError, IndexError) as exc:
                logger.warning("dropped malformed KV events from %s: %s", w.spec.name, exc)

    async def _ask_snapshot(self, w: WorkerState) -> None:
        now = time.monotonic()
        if w.alive and now - w.snapshot_asked > 2 * self.routing.heartbeat_s:  # one request in flight at a time
            w.snapshot_asked = now
            await self._send(w, SnapshotRequest(seq=next(self._seq)))

    async def _heartbeat(self) -> None:
        while True:
            now = time.monotonic()
            for w in self.workers:
                if w.alive and now - w.last_pong > self.routing.dead_after_s:
                    self._mark_dead(w)
                await self._send(w, Ping(seq=next(self._seq)))
            for name in self.index.needs_snapshot():
                w = next(x for x in self.workers if x.spec.name == name)
                if w.spec.events_port is not None:
                    await self._ask_snapshot(w)
            await asyncio.sleep(self.routing.heartbeat_s)

    def _mark_dead(self, w: WorkerState) -> None:
        logger.warning("worker %s is gone (connection lost or silent); routing around it", w.spec.actor_name)
        w.alive, w.stats = False, None
        self.index.forget(w.spec.name)
        for rid in list(w.inflight):
            stream = self.streams.get(rid)
            w.inflight.discard(rid)
            if stream is None or stream.finished or (w is stream.prefill and stream.decode_seen):
                continue  # a prefill worker that already handed over: the decode worker carries on
            if w is stream.decode and self._migrate(stream):
                continue
            if w is stream.prefill and self._rerun_on_decode(stream):
                continue
            self._deliver(stream, RequestOutput(rid, finish_reason=FinishReason.ABORT,
                                                error=f"the {w.spec.role} worker {w.spec.name} stopped "
                                                      "responding; retry the request"))

    def _rerun_on_decode(self, stream: _Stream) -> bool:
        """Its prefill worker died before the decode worker took over (nothing from the decode worker yet: the
        first token may not have come, or it came but the KV may never arrive): the decode worker drops that
        run and runs the request itself from its prompt plus the tokens already streamed (`_continuation`).
        The re-run gets a new request id on the workers: the KV may have reached the decode worker just before
        the prefill worker went, and outputs of that abandoned run, still on their way, must not pass for the
        re-run's (`_on_message` drops them by their old id). The prefill worker is told to stop in case it was
        only silent. False when the decode worker is gone too or nothing is left to generate."""
        decode, old = stream.decode, stream.request.request_id
        request = self._continuation(stream) if decode.alive else None
        if request is None:
            return False
        stream.reruns += 1
        new = f"{stream.client_id[:240]}~rerun{stream.reruns}"
        logger.warning("running %s on its decode worker %s after %d tokens: the prefill worker %s is gone",
                       stream.client_id, decode.spec.name, len(stream.token_ids), stream.prefill.spec.name)
        self._post(stream.prefill, AbortRequest(request_id=old))
        stream.request = dataclasses.replace(stream.request, request_id=new)
        stream.prefill, stream.first_seen, stream.migrated_from = None, True, len(stream.token_ids)
        stream.held.clear()
        decode.inflight.discard(old)
        decode.inflight.add(new)
        if self.streams.get(old) is stream and old != stream.client_id:
            del self.streams[old]
        self.streams[new] = stream
        self._post_all(decode, [AbortRequest(request_id=old),
                                Generate(request=dataclasses.replace(request, request_id=new), prefilled=False)])
        return True

    def _continuation(self, stream: _Stream):
        """The request that goes on from the tokens `stream` has streamed so far (`continue_request`: its prompt
        plus those tokens, the rest of its max_tokens, a grammar and reasoning that replay them); with nothing
        streamed, the request itself, prompt logprobs included. None when nothing is left to generate."""
        return continue_request(stream.request, stream.token_ids)

    def _migrate(self, stream: _Stream) -> bool:
        """Re-run a request whose decode worker died on another live decode worker, from its prompt plus the
        tokens already streamed (prefilled there locally; a prefill worker still computing it is told to stop; a
        grammar replays those tokens, `SamplingParams.grammar_prefix`).
        Nothing streamed yet: the request runs there from the start, prompt logprobs included. False when
        there is nowhere to go."""
        others = [w for w in self.workers if w.alive and w.spec.role == "decode" and w is not stream.decode]
        if not others:
            return False
        target = min(others, key=lambda w: len(w.inflight))
        request = self._continuation(stream)
        if request is None:
            return False
        done = len(stream.token_ids)
        logger.warning("migrating %s to %s after %d tokens", request.request_id, target.spec.name, done)
        stream.decode.inflight.discard(request.request_id)
        self._post(stream.decode, AbortRequest(request_id=request.request_id))  # it may only have been silent
        if stream.prefill is not None:  # its KV was bound for the dead worker
            stream.prefill.inflight.discard(request.request_id)
            self._post(stream.prefill, AbortRequest(request_id=request.request_id))
        stream.decode, stream.prefill, stream.first_seen = target, None, True
        stream.migrated_from = done
        stream.held.clear()
        target.inflight.add(request.request_id)
        self._post(target, Generate(request=request, prefilled=False))
        return True
