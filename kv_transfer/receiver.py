"""KVReceiver: the decode worker's end of KV transfer, writing straight into reserved blocks of its pool.

One ZeroMQ ROUTER socket bound to `host:port` (127.0.0.1 unless configured) serves every sender. The
receiver has no thread of its own: the pool's owner (the decode worker's engine loop) calls `poll()` between
steps, so blocks are written by the only thread that touches the pool and its arrays. ZeroMQ's I/O thread
keeps receiving into its buffers meanwhile, so the network transfer overlaps the engine's compute.

Life of a transfer (see kv_transfer/handshake.py and wire.py):

    offer   -> reserve (or refuse / busy); the reservation is live under (request_id, epoch, sender identity)
    blocks* -> checked against the reservation, then written with KVStore.write_blocks
    done    -> every expected (block, layer) arrived: full blocks join the prefix cache, `ack` goes back and
               poll() returns a `ReceivedSequence`; its blocks stay held under the request id in the
               worker's `KVManager` until the engine admits the request (adopt) or the caller releases them
    abort   -> (either side) the holding is released; poll() returns a `TransferFailed`

Any message whose (request_id, epoch, identity) is not live is dropped before its arrays are even parsed.
A malformed message that names a live transfer fails that transfer (the sender hears why); one that names
nothing is dropped. Nothing a peer sends can raise out of `poll()`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import numpy as np
import zmq

from cluster.config import TransferConfig
from cluster.kv.manager import KVManager
from cluster.kv.store import shipped_num_layers, write_received_blocks
from cluster.transport import LOOPBACK, CurveKeys, server_socket
from kv_transfer.handshake import Busy, KVFormat, Refusal, Reservation, reserve
from kv_transfer.metrics import TransferMetrics
from kv_transfer.wire import (Abort, Ack, Blocks, BusyAnswer, Done, Message, Offer, Refused, Reserved, WireError,
                              decode_arrays, decode_header, encode, state_from_frames, state_specs)

logger = logging.getLogger(__name__)
_MAX_MESSAGES_PER_POLL = 256


@dataclass(frozen=True)
class ReceivedSequence:
    """A completed transfer: the prompt's KV is in `block_table`, held under `request_id` in the worker's
    `KVManager` (the request adopts the holding, or the caller releases it); `first_token` was sampled by the
    prefill worker."""

    request_id: str
    token_ids: list[int]
    block_table: Sequence[int]
    num_cached_tokens: int
    first_token: int
    first_logprob: Optional[float]
    cache_salt: Optional[str]
    block_hashes: tuple[int, ...] = ()  # of the prompt's full blocks, under which they are registered here


@dataclass(frozen=True)
class TransferFailed:
    """A transfer that ended without the sequence: `kind` is "aborted" (by the sender or `abort()`),
    "timeout" or "error" (a malformed message); its blocks are already freed."""

    request_id: str
    kind: str
    reason: str


ReceiveEvent = Union[ReceivedSequence, TransferFailed]


@dataclass
class _Incoming:
    offer: Offer
    identity: bytes
    epoch: int
    reservation: Reservation
    hashes: list[int]
    started: float
    deadline: float
    layers_per_group: tuple[int, ...]  # by KV cache group index: its layers (0: a group without blocks)
    received: list[np.ndarray] = field(init=False)  # per KV cache group, bool [num_blocks, its layers]

    def __post_init__(self) -> None:
        self.received = [np.zeros((len(self.block_table), n), dtype=bool) for n in self.layers_per_group]
        for g, r in enumerate(self.received):
            r[:self.first_sent(g)] = True

    @property
    def block_table(self) -> Sequence[int]:
        return self.reservation.block_table

    @property
    def num_cached_blocks(self) -> int:
        return self.reservation.num_cached_blocks

    def first_sent(self, group: int) -> int:
        """The first block of `group` the sender sends."""
        return self.reservation.first_sent[group]

    def table(self, group: int) -> Sequence[int]:
        return self.reservation.tables[group]


class KVReceiver:
    """Receives KV blocks into the stores of `kv`'s KV cache groups, in blocks reserved through `kv` (owned by
    the caller's thread; call every method from it).

    `fmt` is this worker's KV format; offers in any other format are refused naming the difference.
    `max_prompt_len`: offers of this many tokens or more are refused (the context limit).
    """

    def __init__(self, fmt: KVFormat, kv: KVManager, *, max_prompt_len: int,
                 config: TransferConfig = TransferConfig(), host: str = LOOPBACK, port: int = 0,
                 keys: Optional[CurveKeys] = None, ctx: Optional[zmq.Context] = None,
                 metrics: Optional[TransferMetrics] = None, clock: Callable[[], float] = time.monotonic):
        self.fmt, self.kv, self.pool, self.config = fmt, kv, kv.pool, config
        # by KV cache group index: its store (None: a group without blocks)
        self.stores = [g.store if g.pool is not None else None for g in kv.groups]
        self.max_prompt_len, self.clock = max_prompt_len, clock
        self.metrics = metrics or TransferMetrics("receive")
        self.ctx = ctx or zmq.Context.instance()
        self.sock, self.endpoint = server_socket(self.ctx, zmq.ROUTER, host, port, keys,
                                                 options={zmq.MAXMSGSIZE: config.max_frame_bytes})
        self.live: dict[str, _Incoming] = {}
        self._epoch = 0
        self._events: list[ReceiveEvent] = []

    # -- the caller's interface ------------------------------------------------------------------------------

    def poll(self, timeout_s: float = 0.0) -> list[ReceiveEvent]:
        """Handle what has arrived (waiting up to `timeout_s` for the first message) and expire deadlines."""
        if self.sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            for _ in range(_MAX_MESSAGES_PER_POLL):
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._handle(frames)
        now = self.clock()
        for t in [t for t in self.live.values() if t.deadline < now]:
            self.metrics.timed_out()
            self._fail(t, "timeout", f"no message for {self.config.timeout_s:g} s (transfer deadline)")
        self.metrics.set_inflight(len(self.live))
        events, self._events = self._events, []
        return events

    def abort(self, request_id: str, reason: str = "aborted by the decode worker") -> bool:
        """Abort a live transfer (e.g. its client left): free its blocks and tell the sender."""
        t = self.live.get(request_id)
        if t is None:
            return False
        self.metrics.aborted("local")
        self._fail(t, "aborted", reason)
        return True

    def close(self) -> None:
        """Abort every live transfer and close the socket."""
        for request_id in list(self.live):
            self.abort(request_id, "the decode worker is shutting down")
        self._events.clear()
        self.sock.close(linger=0)

    # -- messages ---------------------------------------------------------------------------------------------

    def _handle(self, frames: list) -> None:
        if len(frames) < 2:
            self.metrics.dropped("invalid")
            return
        identity, frames = frames[0].bytes, frames[1:]
        try:
            msg = decode_header(frames[0])
        except WireError as exc:
            self.metrics.dropped("invalid")
            logger.debug("dropped a malformed message: %s", exc)
            return
        if isinstance(msg, Offer):
            if len(frames) != 1:
                self.metrics.dropped("invalid")
                return
            self._on_offer(identity, msg)
            return
        t = self.live.get(msg.request_id)
        epoch = getattr(msg, "epoch", None)  # only an abort may omit it (sent before the reservation arrived)
        if t is None or t.identity != identity or epoch not in (t.epoch, None) \
                or (epoch is None and not isinstance(msg, Abort)):
            self.metrics.dropped("late")  # aborted, reassigned, or someone else's: never touches memory
            return
        t.deadline = self.clock() + self.config.timeout_s
        try:
            if not isinstance(msg, (Blocks, Done)) and len(frames) != 1:
                raise WireError(f"a {msg.type!r} message carries no array frames, got {len(frames) - 1}")
            if isinstance(msg, Blocks):
                self._on_blocks(t, msg, frames[1:])
            elif isinstance(msg, Done):
                self._on_done(t, msg, frames[1:])
            elif isinstance(msg, Abort):
                self.metrics.aborted("peer")
                self._fail(t, "aborted", f"the sender aborted: {msg.reason}", notify=False)
            else:
                raise WireError(f"unexpected {msg.type!r} message ({len(frames) - 1} array frames) for a live "
                                "transfer")
        except WireError as exc:
            self.metrics.dropped("invalid")
            self._fail(t, "error", str(exc))

    def _on_offer(self, identity: bytes, offer: Offer) -> None:
        def answer(msg: Message, outcome: str) -> None:
            self.metrics.answer(outcome)
            self._send(identity, msg)

        rid = offer.request_id
        if rid in self.live:
            answer(Refused(request_id=rid, reason=f"request_id {rid!r} is already being transferred"), "refused")
            return
        if len(offer.token_ids) >= self.max_prompt_len:  # before hashing: a huge offer costs nothing
            answer(Refused(request_id=rid, reason=f"the prompt has {len(offer.token_ids)} tokens but the "
                                                  f"receiver's context limit is {self.max_prompt_len}"), "refused")
            return
        # the offer's hashes were computed under its format's first-block key: used when that key is this
        # worker's (a format this receiver refuses anyway has another), hashed here otherwise
        hashes = self.fmt.block_hashes(offer.token_ids, offer.cache_salt, offer.block_hashes,
                                       offer.format.extra_key(offer.cache_salt))
        got = reserve(self.kv, rid, self.fmt, offer.format, offer.token_ids, hashes, self.max_prompt_len,
                      self.config.watermark_blocks)
        if isinstance(got, Refusal):
            answer(Refused(request_id=rid, reason=got.reason), "refused")
        elif isinstance(got, Busy):
            answer(BusyAnswer(request_id=rid, retry_after_s=got.retry_after_s), "busy")
        else:
            self._epoch += 1
            now = self.clock()
            self.live[rid] = _Incoming(offer, identity, self._epoch, got, hashes, now, now + self.config.timeout_s,
                                       tuple(shipped_num_layers(s) if s is not None else 0 for s in self.stores))
            answer(Reserved(request_id=rid, epoch=self._epoch, num_cached_blocks=got.num_cached_blocks,
                            num_blocks=len(got.block_table)), "reserved")

    def _on_blocks(self, t: _Incoming, msg: Blocks, payload: list) -> None:
        start, stop = msg.block_start, msg.block_start + msg.num_blocks
        layers = range(msg.layer_start, msg.layer_start + msg.num_layers)
        if msg.group >= len(self.stores) or self.stores[msg.group] is None:
            raise WireError(f"blocks of KV cache group {msg.group}, but this model's groups with blocks are "
                            f"{[g for g, s in enumerate(self.stores) if s is not None]}")
        store, first = self.stores[msg.group], t.first_sent(msg.group)
        if start < first or stop > len(t.block_table) or layers.stop > shipped_num_layers(store):
            raise WireError(f"blocks [{start}, {stop}) x layers [{layers.start}, {layers.stop}) of group {msg.group} "
                            f"are outside the reservation (blocks [{first}, {len(t.block_table)}), "
                            f"{shipped_num_layers(store)} layers)")
        if (msg.kv_bits, msg.kv_group_size) != (self.fmt.kv_bits, self.fmt.kv_group_size):
            raise WireError(f"blocks quantized as kv_bits={msg.kv_bits}, group {msg.kv_group_size}, but the "
                            f"transfer agreed on kv_bits={self.fmt.kv_bits}, group {self.fmt.kv_group_size}")
        expected = [(n, d, list(s)) for n, d, s in store.block_array_specs(msg.num_blocks, msg.num_layers)]
        if [(a.name, a.dtype, a.shape) for a in msg.arrays] != expected:
            raise WireError(f"array specs {[a.model_dump() for a in msg.arrays]} do not match the expected "
                            f"{expected}")
        if msg.block_hashes != t.hashes[start:min(stop, len(t.hashes))]:
            raise WireError("block hashes do not match the prompt's: the workers hash blocks differently")
        arrays = decode_arrays(msg, payload)  # checks every frame's size before anything is written
        write_received_blocks(store, t.table(msg.group)[start:stop], layers, arrays)
        t.received[msg.group][start:stop, layers.start:layers.stop] = True
        self.metrics.moved(sum(a.nbytes for a in msg.arrays),
                           msg.num_blocks if layers.start == 0 and msg.group == 0 else 0)

    def _on_done(self, t: _Incoming, msg: Done, payload: list) -> None:
        if not all(r.all() for r in t.received):
            missing = sum(int((~r).any(axis=1).sum()) for r in t.received)
            raise WireError(f"'done' before every block arrived ({missing} blocks missing)")
        expected = state_specs(self.fmt)
        if msg.arrays != expected:
            raise WireError(f"'done' carries state arrays {[f'{a.dtype}{a.shape}' for a in msg.arrays]} but this "
                            f"model's recurrent state is {[f'{a.dtype}{a.shape}' for a in expected]}")
        state = state_from_frames(self.fmt, decode_arrays(msg, payload)) if expected else None
        if expected:
            self.metrics.moved_state(sum(a.nbytes for a in msg.arrays))
        bs, tokens = self.fmt.block_size, t.offer.token_ids
        root = self.fmt.extra_key(t.offer.cache_salt)  # block 0's parent, for head hits (cluster/prefix_match.py)
        rid = t.offer.request_id
        self.kv.cache_blocks(rid, t.num_cached_blocks, t.hashes, tokens, root)  # the one registration
        self.kv.receive_state(rid, state)
        del self.live[t.offer.request_id]
        self._send(t.identity, Ack(request_id=t.offer.request_id, epoch=t.epoch))
        self.metrics.completed(self.clock() - t.started)
        self._events.append(ReceivedSequence(t.offer.request_id, list(tokens), list(t.block_table),
                                             t.num_cached_blocks * bs, msg.first_token, msg.first_logprob,
                                             t.offer.cache_salt, tuple(t.hashes)))

    def _fail(self, t: _Incoming, kind: str, reason: str, notify: bool = True) -> None:
        del self.live[t.offer.request_id]
        self.kv.release(t.offer.request_id)
        if notify:
            self._send(t.identity, Abort(request_id=t.offer.request_id, epoch=t.epoch, reason=reason))
        self._events.append(TransferFailed(t.offer.request_id, kind, reason))

    def _send(self, identity: bytes, msg: Message) -> None:
        try:
            self.sock.send_multipart([identity, *encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the peer is gone or not reading: its own deadline will tell it
            logger.debug("could not answer %s: %s", identity.hex(), exc)
