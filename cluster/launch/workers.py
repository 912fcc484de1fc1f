"""Workers from the outside: `make_worker` builds the worker of a topology with the class its role needs
(prefill_node.worker.PrefillWorker or decode_node.worker.DecodeWorker, both over cluster.worker.Worker);
`probe_worker` asks a running worker for its stats with one ping (tools and benchmarks)."""

from __future__ import annotations

import time
from typing import Optional

import zmq

from cluster.protocol import PROTOCOL_VERSION, TO_ROUTER, Ping, Pong, pack, unpack
from cluster.topology import TopologySpec
from cluster.transport import CurveKeys, client_socket
from cluster.worker import Worker
from decode_node.worker import DecodeWorker
from prefill_node.worker import PrefillWorker


def make_worker(topology: TopologySpec, name: str, loaded=None) -> Worker:
    """The worker `name` of `topology`, of the class its role needs. `loaded` = (model, tokenizer, ModelSpec)
    shares an already loaded model (tests); otherwise `start()` loads it."""
    spec = topology.worker(name)
    if spec.role == "prefill":
        return PrefillWorker(topology, spec, loaded)
    return DecodeWorker(topology, spec, loaded)


def probe_worker(endpoint: str, keys: Optional[CurveKeys] = None, timeout_s: float = 3.0) -> Optional[dict]:
    """A worker's stats (what its pongs carry, as the JSON map `WorkerStats.report`) from one Ping on its
    control socket at `endpoint`, or None when it does not answer within `timeout_s` (tools and benchmarks;
    the router pings on its own sockets)."""
    ctx = zmq.Context()
    sock = client_socket(ctx, zmq.DEALER, endpoint, keys)
    try:
        deadline = time.monotonic() + timeout_s
        sock.sndtimeo = max(1, int(timeout_s * 1000))
        try:
            sock.send(pack(Ping(seq=1)))
        except zmq.Again:  # no connection to queue to: the handshake was refused, or nobody listens
            return None
        while (left := deadline - time.monotonic()) > 0 and sock.poll(int(left * 1000)):
            msg = unpack(sock.recv_multipart()[0], TO_ROUTER, PROTOCOL_VERSION)
            if isinstance(msg, Pong):
                return msg.stats.report()
        return None
    finally:
        sock.close(linger=0)
        ctx.destroy(linger=0)
