"""The leading rank's side of a worker group: it hands each follower every forward and block copy before running
its own (`cluster.runner.Replicas`), over one ZeroMQ PUSH socket per follower, in order.

Each message goes out as two frames: the leader's boot id (its heartbeat's, `BOOT_BYTES` big-endian), then the
message. A follower runs only the messages of the leader it formed its group with: when a group breaks and its
ranks are restarted one by one (Ray brings a killed follower back at once, on the same port, while the old
leader still lives), the old leader's steps must never reach the new follower's queue and run there out of
step with the new leader's collectives. The sockets never reconnect either: once a follower's connection
drops, a send finds no follower and ends the group at the deadline (`on_lost`)."""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import zmq

from cluster.parallel import step_wire
from cluster.parallel.heartbeat import end_rank, exit_group
from cluster.parallel.spec import GroupPlan
from cluster.runner import BatchItem

log = logging.getLogger(__name__)


class GroupLeader:
    """Rank 0 of `plan`: connects to every follower's step socket. A send that cannot complete within the plan's
    deadline (a follower gone, its link cut) ends the group through `on_lost` (default: this process ends,
    since the next collective would block forever), and so does a forward that fails after the followers took
    it (`on_broken`). Sends on the engine's thread only; `bytes_sent` counts
    what was handed over."""

    def __init__(self, plan: GroupPlan, on_lost: Callable[[int, float], None] = exit_group, boot: int = 0,
                 on_broken: Callable[[str], None] = end_rank):
        self.plan, self.on_lost, self.on_broken = plan, on_lost, on_broken
        self.boot = boot.to_bytes(step_wire.BOOT_BYTES, "big")  # the first frame of every message (see the module docstring)
        ctx = zmq.Context.instance()
        self.sockets = []
        for rank in plan.ranks[1:]:
            sock = ctx.socket(zmq.PUSH)
            sock.linger = 0
            sock.sndtimeo = int(plan.deadline_s * 1000)
            sock.setsockopt(zmq.RECONNECT_IVL, -1)  # this follower's process, or none (its step socket is bound)
            sock.connect(f"tcp://{rank.host}:{rank.step_port}")
            self.sockets.append(sock)
        self.bytes_sent = [0] * len(self.sockets)  # to each follower (rank 1..)
        self.num_forwards = 0
        self.stopped = False

    def send_all(self, msg: step_wire.StepMessage) -> None:
        """Send `msg` to every follower, in rank order."""
        data = step_wire.encode(msg)
        for rank in range(1, self.plan.size):
            self._send_bytes(rank, data)

    def send_to(self, rank: int, msg: step_wire.StepMessage) -> None:
        """Send `msg` to follower `rank` only."""
        self._send_bytes(rank, step_wire.encode(msg))

    def _send_bytes(self, rank: int, data: bytes) -> None:
        try:
            self.sockets[rank - 1].send_multipart([self.boot, data], copy=False)
        except zmq.Again:
            self.on_lost(rank, self.plan.deadline_s)
            raise RuntimeError(f"worker group: rank {rank} took no step within {self.plan.deadline_s} s") from None
        self.bytes_sent[rank - 1] += len(data)

    def hello(self, num_blocks: int, pool_bytes: int) -> None:
        """Tell the followers the leader's KV pool (they check their own against it)."""
        self.send_all(step_wire.Hello(num_blocks, pool_bytes))

    def forward(self, items: Sequence[BatchItem], mirror, groups: Sequence) -> None:
        self.num_forwards += 1
        self.send_all(step_wire.to_wire(items, mirror, groups))

    def copy_block(self, src: int, dst: int) -> None:
        self.send_all(step_wire.CopyBlock(src, dst))

    def abandon(self, exc: BaseException) -> None:
        """A forward the followers took failed here: the ranks' collectives are out of step, so the group ends
        (`on_lost`; by default this process exits and its supervisor restarts the group)."""
        self.on_broken(f"a forward failed on the leader after its followers took it ({type(exc).__name__}: {exc})")

    def stop(self, reason: str = "the leader stops") -> None:
        """End the group normally: every follower that is still there exits (a `Stop`, never waited for: a
        follower already gone is no loss now). Once only (a second call does nothing)."""
        if self.stopped:
            return
        self.stopped = True
        data = step_wire.encode(step_wire.Stop(reason))
        for sock in self.sockets:
            try:
                sock.send_multipart([self.boot, data], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            sock.close(linger=1000)
