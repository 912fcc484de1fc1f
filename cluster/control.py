"""A worker's control channel: how its loop hears from the router and answers it.

The worker loop (cluster/worker.py) reads router messages (`Generate`, `AbortRequest`, `Ping`, ... of
cluster/protocol.py) and sends answers (`Rejected`, `Pong`, ...) and output deltas through one of two
channels, the same messages either way:

- `ZmqControl` (cluster mode): a ZeroMQ ROUTER socket; every message is one msgpack frame, each router a peer
  named by its ZeroMQ identity. Malformed frames are dropped here, so the loop only sees valid messages; a
  `generate` that names its request id but does not validate is answered here with a 400 `Rejected`.
- `InProcessControl` (single-node mode): a thread-safe queue into the loop; each peer is a callable the
  loop's answers are handed to, on the loop's thread. Nothing is packed, and an output delta stays the
  `RequestOutput` it is.

Both are owned by the worker's loop thread once it runs: only `InProcessControl.submit` may be called from
another thread.
"""

from __future__ import annotations

import logging
import queue
from typing import Any, Callable, Optional, Protocol

import zmq

from cluster.protocol import (PROTOCOL_VERSION, TO_WORKER, ProtocolError, Rejected, generate_request_id, pack,
                              pack_output, unpack)
from cluster.request import RequestOutput

logger = logging.getLogger(__name__)
MAX_MESSAGES_PER_POLL = 256  # then the loop steps the engine before reading more


class ControlChannel(Protocol):
    """What the worker loop needs from its channel. `endpoint` is where routers connect (None: in-process)."""

    endpoint: Optional[str]

    def poll(self, timeout_s: float) -> list[tuple[Any, object]]:
        """Wait up to `timeout_s` for messages; returns (peer, message) pairs, each message a validated
        router -> worker model of cluster/protocol.py, at most `MAX_MESSAGES_PER_POLL`."""
        ...

    def send(self, peer: Any, message) -> None:
        """Send a worker -> router message to `peer`; never raises (a lost answer is the peer's heartbeat's
        business)."""
        ...

    def send_output(self, peer: Any, output: RequestOutput) -> None:
        """Send one output delta to `peer`; never raises."""
        ...

    def close(self) -> None:
        ...


class ZmqControl:
    """The control channel over a bound ZeroMQ ROUTER socket `sock` (see the module docstring)."""

    def __init__(self, sock: zmq.Socket, endpoint: str):
        self.sock, self.endpoint = sock, endpoint

    def poll(self, timeout_s: float) -> list[tuple[Any, object]]:
        if not self.sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            return []
        got = []
        for _ in range(MAX_MESSAGES_PER_POLL):
            try:
                identity, *frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            except ValueError:  # a message without an identity frame cannot come from a ROUTER peer
                continue
            if len(frames) != 1:
                logger.debug("dropped a control message of %d frames", len(frames))
                continue
            try:
                got.append((identity, unpack(frames[0], TO_WORKER, PROTOCOL_VERSION)))
            except ProtocolError as exc:
                rid = generate_request_id(frames[0])
                if rid is not None:  # the router waits for this request: tell it why it will never run
                    self.send(identity, Rejected(request_id=rid, reason=str(exc)[:4096], status=400))
                logger.debug("dropped a malformed control message: %s", exc)
        return got

    def send(self, peer: bytes, message) -> None:
        try:
            self.sock.send_multipart([peer, pack(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the router is gone or not reading; its heartbeat will notice
            logger.debug("could not send %s: %s", message.type, exc)

    def send_output(self, peer: bytes, output: RequestOutput) -> None:
        try:  # the per-token message: packed by msgspec, with no message object built around the delta
            self.sock.send_multipart([peer, pack_output(output)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the router is gone or not reading; its heartbeat will notice
            logger.debug("could not send output: %s", exc)

    def close(self) -> None:
        self.sock.close(linger=0)


Peer = Callable[[object], None]


class InProcessControl:
    """The control channel inside one process (see the module docstring). A peer is a callable; the loop
    calls it with each answer (a protocol message, or a `RequestOutput` delta) on the loop's thread."""

    endpoint = None

    def __init__(self) -> None:
        self._inbox: "queue.SimpleQueue[tuple[Peer, object]]" = queue.SimpleQueue()

    def submit(self, peer: Peer, message) -> None:
        """Queue a router -> worker message from `peer` (any thread)."""
        self._inbox.put((peer, message))

    def poll(self, timeout_s: float) -> list[tuple[Any, object]]:
        got = []
        try:
            got.append(self._inbox.get(timeout=timeout_s) if timeout_s > 0 else self._inbox.get_nowait())
            while len(got) < MAX_MESSAGES_PER_POLL:
                got.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return got

    def send(self, peer: Peer, message) -> None:
        self._deliver(peer, message)

    def send_output(self, peer: Peer, output: RequestOutput) -> None:
        self._deliver(peer, output)

    @staticmethod
    def _deliver(peer: Peer, item: object) -> None:
        try:
            peer(item)
        except Exception:  # a peer's bug (its event loop closed, say) must not end the worker
            logger.exception("could not deliver %s to an in-process peer", type(item).__name__)

    def close(self) -> None:
        pass
