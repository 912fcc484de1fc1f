"""KVSender: the prefill worker's end of KV transfer, shipping blocks while the prompt is still computing.

The prefill worker's thread drives it between prefill chunks (no thread of its own, like the receiver):

    sender.open(rid, endpoint, token_ids, on_release=free_my_blocks)   # offer goes out at once
    for each chunk: compute it; sender.blocks_ready(rid, block_table, num_computed); sender.poll()
    sender.finish(rid, first_token, first_logprob)
    ... sender.poll() until it returns the transfer's `SendResult`

`blocks_ready` only records progress; `poll` receives answers (reserved / busy / refused / ack / abort),
sends every ready block not yet sent and not already held by the receiver (`num_cached_blocks`), then `done`
once the last block and the first token are in, and expires deadlines. While the offer is unanswered the
chunks keep computing, so the handshake overlaps compute too. Each message reads its blocks out of the pool
(`KVStore.read_blocks`, one copy) and hands the arrays to ZeroMQ without a further copy (`copy=False`);
a send queue of a few messages per peer (SNDHWM) bounds the memory a slow receiver can pin.

`on_release` is called exactly once per transfer, when it ends on any path (complete, refused, aborted,
timed out), so the prefill worker frees its blocks then and never earlier than the last read.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import zmq

from cluster.config import TransferConfig
from cluster.kv.attention_groups import FullAttentionGroup
from cluster.kv.groups import KVCacheGroup
from cluster.kv.manager import KVManager
from cluster.kv.store import KVStore, read_shipped_blocks, shipped_num_layers
from cluster.transport import CurveKeys, client_socket
from kv_transfer.handshake import KVFormat
from kv_transfer.metrics import TransferMetrics
from kv_transfer.wire import (Abort, Ack, ArraySpec, Blocks, BusyAnswer, Done, Offer, Refused, Reserved, WireError,
                              decode_header, encode, state_frames, state_specs)

logger = logging.getLogger(__name__)
_SNDHWM = 4  # messages queued per peer at most (a 64-block float32 message of SmolLM2 is ~94 MB)
_MAX_BACKOFF_S = 1.0


@dataclass(frozen=True)
class SendResult:
    """How a transfer ended: `kind` "complete", "refused", "aborted", "timeout"; `reason` explains all but
    "complete". `num_cached_blocks`: leading blocks the receiver already held (not sent)."""

    request_id: str
    kind: str
    reason: str = ""
    num_cached_blocks: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.kind == "complete"


@dataclass
class _Outgoing:
    request_id: str
    peer: "_Peer"
    offer: Offer
    num_blocks: int
    hashes: list[int]
    on_release: Optional[Callable[[], None]]
    started: float
    deadline: Optional[float]
    state: str = "offered"  # offered -> (busy -> offered)* -> reserved -> done_sent
    epoch: int = -1
    num_cached_blocks: int = 0
    next_block: int = 0
    tables: Sequence[Sequence[int]] = ()  # by KV cache group index
    num_ready_tokens: int = 0
    first: Optional[tuple[int, Optional[float]]] = None
    request_state: Any = None  # what the groups ship besides blocks (`KVManager.shipped_state`), after the prompt
    retry_at: float = 0.0
    backoff_s: float = 0.02


@dataclass
class _Peer:
    endpoint: str
    sock: zmq.Socket
    queue: deque = field(default_factory=deque)  # frame lists waiting for room in the socket
    last_progress: float = 0.0  # when the socket last accepted a message


class KVSender:
    """Sends the KV blocks of every KV cache group of `kv` (a `KVManager`, or one `KVStore` of full attention;
    owned by the caller's thread; call every method from it) in format `fmt`, each group's from the first block
    the decode worker's next query needs (`KVCacheGroup.first_to_ship`)."""

    def __init__(self, fmt: KVFormat, kv: Union[KVManager, KVStore], *, config: TransferConfig = TransferConfig(),
                 keys: Optional[CurveKeys] = None, ctx: Optional[zmq.Context] = None,
                 metrics: Optional[TransferMetrics] = None, clock: Callable[[], float] = time.monotonic):
        # (group number on the wire, group) of every group with blocks
        self.groups: list[tuple[int, KVCacheGroup]] = [(0, FullAttentionGroup.over(kv))] if isinstance(kv, KVStore) \
            else [(g.index, g) for g in kv.block_groups]
        self.store = self.groups[0][1].store
        self.fmt, self.config, self.keys, self.clock = fmt, config, keys, clock
        self.metrics = metrics or TransferMetrics("send")
        self.ctx = ctx or zmq.Context.instance()
        self.peers: dict[str, _Peer] = {}
        self.transfers: dict[str, _Outgoing] = {}
        self.blocks_per_message, self.layers_per_message = self._message_geometry()
        self._poller = zmq.Poller()
        self._results: list[SendResult] = []

    def _message_geometry(self) -> tuple[int, int]:
        """Blocks and layers per `blocks` message: the configured ones, halved (layers first) until every array
        frame fits `max_frame_bytes`, the receiver's limit (ZeroMQ drops a connection that sends a larger
        frame, stalling every transfer on it), then until the message's KV fits `max_message_bytes` (so that
        encrypting, sending, receiving and decrypting messages overlap; never below one block of one layer).
        Raises ValueError when one block of one layer does not fit `max_frame_bytes`."""
        blocks = self.config.max_blocks_per_message
        num_layers = shipped_num_layers(self.store)
        if not num_layers:  # no layer caches KV (a recurrent-only model): no blocks messages
            return blocks, 1
        layers = self.config.layers_per_message or num_layers

        def frame_bytes(b: int, n: int) -> list[int]:  # one array frame each, for b blocks of n layers
            return [ArraySpec(name=name, dtype=dtype, shape=list(shape)).nbytes
                    for name, dtype, shape in self.store.block_array_specs(b, n)]

        def largest_frame(b: int, n: int) -> int:
            return max(frame_bytes(b, n))

        def message(b: int, n: int) -> int:
            return sum(frame_bytes(b, n))

        while largest_frame(blocks, layers) > self.config.max_frame_bytes:
            if layers > 1:
                layers = (layers + 1) // 2
            elif blocks > 1:
                blocks = (blocks + 1) // 2
            else:
                raise ValueError(f"one KV block of one layer is {largest_frame(1, 1)} bytes, over max_frame_bytes="
                                 f"{self.config.max_frame_bytes}: raise [transfer] max_frame_bytes")
        while message(blocks, layers) > self.config.max_message_bytes and (layers > 1 or blocks > 1):
            if layers > 1:
                layers = (layers + 1) // 2
            else:
                blocks = (blocks + 1) // 2
        return blocks, layers

    # -- the caller's interface ------------------------------------------------------------------------------

    def open(self, request_id: str, endpoint: str, token_ids: Sequence[int], cache_salt: Optional[str] = None,
             on_release: Optional[Callable[[], None]] = None, block_hashes: Sequence[int] = ()) -> None:
        """Offer the KV of `token_ids` to the receiver at `endpoint`; `block_hashes`: the chained hashes of their
        leading full blocks in this sender's format, as far as the caller has them (the engine's sequence), the
        rest hashed here; the offer carries them all. Raises ValueError for a duplicate id."""
        if request_id in self.transfers:
            raise ValueError(f"request_id {request_id!r} is already being transferred")
        hashes = self.fmt.block_hashes(token_ids, cache_salt, block_hashes, self.fmt.extra_key(cache_salt))
        offer = Offer(request_id=request_id, format=self.fmt, token_ids=list(token_ids), cache_salt=cache_salt,
                      block_hashes=hashes)
        now = self.clock()
        t = _Outgoing(request_id, self._peer(endpoint), offer, -(-len(token_ids) // self.fmt.block_size),
                      hashes, on_release, now, now + self.config.reserve_deadline_s)
        self.transfers[request_id] = t
        self._enqueue(t.peer, encode(offer))

    def blocks_ready(self, request_id: str, tables: Sequence[Sequence[int]], num_computed_tokens: int) -> None:
        """Record that positions [0, num_computed_tokens) are computed into `tables` (each KV cache group's
        block table, by group index: `KVManager.tables`; a sender over one store takes its block table alone;
        sent on poll)."""
        t = self.transfers.get(request_id)
        if tables and not isinstance(tables[0], (list, tuple)):
            tables = (tables,)
        if t is not None:
            t.tables, t.num_ready_tokens = tables, num_computed_tokens

    def finish(self, request_id: str, first_token: int, first_logprob: Optional[float] = None,
               state: Any = None) -> None:
        """The prompt is fully computed and `first_token` sampled: `done` follows the last block, carrying
        `state`, what the groups ship besides blocks after the prompt (`KVManager.shipped_state`: per layer a
        tuple of MLX arrays [1, *shape]), which a format that lists such a state requires. Raises ValueError when
        it is missing there."""
        t = self.transfers.get(request_id)
        if t is not None:
            if bool(self.fmt.state) != (state is not None):
                raise ValueError(f"the transfer of {request_id!r} needs {'a' if self.fmt.state else 'no'} "
                                 "state beside its blocks")
            t.first, t.request_state = (first_token, first_logprob), state

    def abort(self, request_id: str, reason: str = "aborted by the prefill worker") -> bool:
        """Stop a transfer (e.g. its client left): the receiver is told and frees its blocks."""
        t = self.transfers.get(request_id)
        if t is None:
            return False
        self._enqueue(t.peer, encode(Abort(request_id=request_id, epoch=t.epoch if t.epoch >= 0 else None,
                                           reason=reason)))
        self.metrics.aborted("local")
        self._end(t, "aborted", reason)
        return True

    def poll(self, timeout_s: float = 0.0) -> list[SendResult]:
        """Receive answers (waiting up to `timeout_s`), send what is ready, expire deadlines; returns the
        transfers that ended since the last call."""
        ready = dict(self._poller.poll(int(timeout_s * 1000))) if self.peers else {}
        for peer in self.peers.values():
            for _ in range(256 if peer.sock in ready else 0):
                try:
                    self._handle(peer, peer.sock.recv_multipart(zmq.NOBLOCK, copy=False))
                except zmq.Again:
                    break
        now = self.clock()
        for t in list(self.transfers.values()):
            if t.state == "busy" and now >= t.retry_at:
                t.state = "offered"
                self._enqueue(t.peer, encode(t.offer))
            if t.state == "reserved":
                self._send_ready(t)
            if t.deadline is not None and now > t.deadline and t.request_id in self.transfers:
                self.metrics.timed_out()
                waited = {"offered": "a reservation", "busy": "free blocks at the receiver"}.get(t.state, "progress")
                self._enqueue(t.peer, encode(Abort(request_id=t.request_id, epoch=t.epoch if t.epoch >= 0 else None,
                                                   reason="the sender timed out")))
                self._end(t, "timeout", f"waited {now - t.started:.1f} s for {waited} from {t.peer.endpoint}")
        for peer in self.peers.values():
            self._flush(peer)
            if peer.queue and now - peer.last_progress > self.config.timeout_s:
                self._stalled(peer)
        self.metrics.set_inflight(len(self.transfers))
        results, self._results = self._results, []
        return results

    def close(self) -> None:
        """Abort every transfer and close the sockets."""
        for request_id in list(self.transfers):
            self.abort(request_id, "the prefill worker is shutting down")
        for peer in self.peers.values():
            self._flush(peer)
            peer.sock.close(linger=0)
        self.peers.clear()

    # -- internals --------------------------------------------------------------------------------------------

    def _peer(self, endpoint: str) -> _Peer:
        peer = self.peers.get(endpoint)
        if peer is None:
            sock = client_socket(self.ctx, zmq.DEALER, endpoint, self.keys, options={zmq.SNDHWM: _SNDHWM})
            peer = self.peers[endpoint] = _Peer(endpoint, sock)
            self._poller.register(sock, zmq.POLLIN)
        return peer

    def _handle(self, peer: _Peer, frames: list) -> None:
        try:
            msg = decode_header(frames[0])
        except WireError as exc:
            self.metrics.dropped("invalid")
            logger.debug("dropped a malformed answer: %s", exc)
            return
        t = self.transfers.get(msg.request_id)
        if t is None or t.peer is not peer or len(frames) != 1:
            self.metrics.dropped("late")
            if isinstance(msg, Reserved):  # a reservation for a transfer that ended here: release it there
                self._enqueue(peer, encode(Abort(request_id=msg.request_id, epoch=msg.epoch,
                                                 reason="the transfer already ended at the sender")))
            return
        now = self.clock()
        if isinstance(msg, Reserved) and t.state == "offered":
            t.state, t.epoch, t.num_cached_blocks = "reserved", msg.epoch, msg.num_cached_blocks
            t.next_block, t.deadline = msg.num_cached_blocks, None  # the sender computes; no wait until done
            self.metrics.answer("reserved")
        elif isinstance(msg, BusyAnswer) and t.state == "offered":
            self.metrics.answer("busy")
            t.state, t.retry_at = "busy", now + max(msg.retry_after_s, t.backoff_s)
            t.backoff_s = min(2 * t.backoff_s, _MAX_BACKOFF_S)
        elif isinstance(msg, Refused) and t.state == "offered":
            self.metrics.answer("refused")
            self._end(t, "refused", msg.reason)
        elif isinstance(msg, Ack) and t.state == "done_sent" and msg.epoch == t.epoch:
            self.metrics.completed(now - t.started)
            self._end(t, "complete")
        elif isinstance(msg, Abort) and msg.epoch in (t.epoch, None):
            self.metrics.aborted("peer")
            self._end(t, "aborted", f"the receiver aborted: {msg.reason}")
        else:
            self.metrics.dropped("late")

    def _send_ready(self, t: _Outgoing) -> None:
        """Queue `blocks` messages for ready blocks (while the peer's queue has room), then `done`."""
        bs, n = self.fmt.block_size, len(t.offer.token_ids)
        ready = t.num_blocks if t.num_ready_tokens >= n else min(t.num_ready_tokens // bs, t.num_blocks)
        while t.next_block < ready and len(t.peer.queue) < _SNDHWM:
            start, stop = t.next_block, min(ready, t.next_block + self.blocks_per_message)
            for index, group in self.groups:  # each group from the first block the next query needs
                first = max(start, group.first_to_ship(n, t.num_blocks))
                if first < stop:
                    self._send_blocks(t, index, group.store, first, list(t.tables[index][first:stop]))
            t.next_block = stop
        if t.next_block >= t.num_blocks and t.first is not None:
            arrays = state_frames(t.request_state) if t.request_state is not None else []
            specs = state_specs(self.fmt) if arrays else []
            self._enqueue(t.peer, encode(Done(request_id=t.request_id, epoch=t.epoch, first_token=t.first[0],
                                              first_logprob=t.first[1], arrays=specs), arrays))
            self.metrics.moved_state(sum(a.nbytes for a in arrays))
            t.state, t.deadline = "done_sent", self.clock() + self.config.timeout_s

    def _send_blocks(self, t: _Outgoing, group: int, store: KVStore, start: int, ids: list[int]) -> None:
        """Queue the `blocks` messages of blocks `ids` (positions from block `start`) of KV cache group
        `group`, `layers_per_message` layers each (none for a group without layers: its blocks hold no KV, and
        the receiver counts them complete)."""
        num_layers, step = shipped_num_layers(store), self.layers_per_message
        for l0 in range(0, num_layers, step):
            layers = range(l0, min(num_layers, l0 + step))
            arrays = read_shipped_blocks(store, ids, layers)
            specs = [ArraySpec(name=nm, dtype=dt, shape=list(sh))
                     for nm, dt, sh in store.block_array_specs(len(ids), len(layers))]
            stop = start + len(ids)
            msg = Blocks(request_id=t.request_id, epoch=t.epoch, block_start=start, num_blocks=len(ids),
                         block_hashes=t.hashes[start:min(stop, len(t.hashes))], layer_start=layers.start,
                         num_layers=len(layers), group=group, kv_bits=self.fmt.kv_bits,
                         kv_group_size=self.fmt.kv_group_size, arrays=specs)
            self._enqueue(t.peer, encode(msg, arrays))
            self.metrics.moved(sum(s.nbytes for s in specs), len(ids) if l0 == 0 and group == 0 else 0)

    def _enqueue(self, peer: _Peer, frames: list) -> None:
        if not peer.queue:
            peer.last_progress = self.clock()
        peer.queue.append(frames)
        self._flush(peer)

    def _stalled(self, peer: _Peer) -> None:
        """The peer accepted nothing for `timeout_s` (dead or stuck): end its transfers, drop its queue."""
        peer.queue.clear()
        for t in [t for t in self.transfers.values() if t.peer is peer]:
            self.metrics.timed_out()
            self._end(t, "timeout", f"{peer.endpoint} accepted no data for {self.config.timeout_s:g} s")

    def _flush(self, peer: _Peer) -> None:
        while peer.queue:
            try:
                peer.sock.send_multipart(peer.queue[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:  # the peer's queue is full (slow or dead receiver): retry on the next poll
                return
            peer.queue.popleft()
            peer.last_progress = self.clock()

    def _end(self, t: _Outgoing, kind: str, reason: str = "") -> None:
        del self.transfers[t.request_id]
        if t.on_release is not None:
            t.on_release()
        self._results.append(SendResult(t.request_id, kind, reason, t.num_cached_blocks, self.clock() - t.started))
