"""Heartbeats inside a worker group: MLX's collectives take no timeout, and a cut link or a dead rank blocks them
forever, so no rank may wait on a collective without someone watching.

Every rank publishes a beat every `interval_s` from a thread of its own (ZeroMQ PUB; a rank computing a long
step still beats) and watches the ranks it depends on (a follower its leader, the leader every follower). A
watched rank silent for `deadline_s` once seen, or never seen within `startup_s` (loading weights, the load
check), is lost: `on_lost(rank, silent_s)` runs once on the watch thread; by default it ends this process, the
one way out of a collective that will never return.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Optional

import msgspec
import zmq

log = logging.getLogger(__name__)

LOST_EXIT_CODE = 75  # a rank that ends because its group broke (EX_TEMPFAIL: a supervisor restarts the group)


class Beat(msgspec.Struct, array_like=True, frozen=True):
    """One beat: the group's name, the rank, a counter, and what the rank reports of itself (`Heartbeat.info`:
    its memory once loaded)."""

    group: str
    rank: int
    seq: int
    info: dict = {}


def exit_group(rank: int, silent_s: float) -> None:
    """The default `on_lost`: log and end this process at once (a collective may hold the main thread)."""
    end_rank(f"rank {rank} silent for {silent_s:.1f} s")


def end_rank(why: str) -> None:
    """End this rank's process at once with `LOST_EXIT_CODE`, logging `why`: its group is broken."""
    log.critical("worker group: %s; ending this rank so that the group restarts", why)
    logging.shutdown()
    os._exit(LOST_EXIT_CODE)


class Heartbeat:
    """Beats for rank `rank` of group `group` on `bind` (tcp://host:port) and watches `peers` ({rank:
    endpoint}). `start()` starts the thread; `stop()` ends it (a normal shutdown: nothing is lost)."""

    def __init__(self, group: str, rank: int, bind: str, peers: dict[int, str], interval_s: float = 0.5,
                 deadline_s: float = 10.0, startup_s: float = 300.0,
                 on_lost: Callable[[int, float], None] = exit_group):
        self.group, self.rank, self.bind, self.peers = group, rank, bind, dict(peers)
        self.interval_s, self.deadline_s, self.startup_s, self.on_lost = interval_s, deadline_s, startup_s, on_lost
        self.last_seen: dict[int, Optional[float]] = {r: None for r in peers}
        self.info: dict = {}  # what this rank's beats carry (set by its owner; ints and strings)
        self.peer_info: dict[int, dict] = {}  # what each watched rank's last beat carried
        self.lost: Optional[int] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-rank{self.rank}", daemon=True)
        self._thread.start()

    def ranks(self) -> list[dict]:
        """Each watched rank as last heard: {"rank", "alive", "silent_s", **its info}."""
        now = time.monotonic()
        out = []
        for rank, seen in sorted(self.last_seen.items()):
            silent = None if seen is None else round(now - seen, 3)
            out.append({"rank": rank, "alive": silent is not None and silent <= self.deadline_s,
                        "silent_s": silent, **self.peer_info.get(rank, {})})
        return out

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
        pub.linger = sub.linger = 0
        pub.bind(self.bind)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        for endpoint in self.peers.values():
            sub.connect(endpoint)
        encode, decoder = msgspec.msgpack.encode, msgspec.msgpack.Decoder(Beat)
        started, seq, next_beat = time.monotonic(), 0, 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    seq += 1
                    pub.send(encode(Beat(self.group, self.rank, seq, self.info)), zmq.NOBLOCK)
                    next_beat = now + self.interval_s
                if sub.poll(int(self.interval_s * 250)):
                    try:
                        beat = decoder.decode(sub.recv(zmq.NOBLOCK))
                    except (msgspec.DecodeError, msgspec.ValidationError, zmq.Again):
                        continue
                    if beat.group == self.group and beat.rank in self.last_seen:
                        self.last_seen[beat.rank] = time.monotonic()
                        self.peer_info[beat.rank] = beat.info
                lost = self._silent(time.monotonic(), started)
                if lost is not None:
                    self.lost = lost[0]
                    self.on_lost(*lost)
                    return
        finally:
            pub.close(0)
            sub.close(0)

    def _silent(self, now: float, started: float) -> Optional[tuple[int, float]]:
        """(rank, seconds silent) of the first watched rank past its deadline, or None."""
        for rank, seen in self.last_seen.items():
            if seen is None and now - started > self.startup_s:
                return rank, now - started
            if seen is not None and now - seen > self.deadline_s:
                return rank, now - seen
        return None
