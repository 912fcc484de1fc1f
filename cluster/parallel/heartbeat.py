"""Heartbeats inside a worker group: MLX's collectives take no timeout, and a cut link or a dead rank blocks them
forever, so no rank may wait on a collective without someone watching.

Every rank publishes a beat every `interval_s` from a thread of its own (ZeroMQ PUB; a rank computing a long
step still beats) and watches the ranks it depends on (a follower its leader, the leader every follower). A
watched rank silent for `deadline_s` once seen, or never seen within `startup_s` (loading weights, the load
check), is lost: `on_lost(rank, silent_s)` runs once on the watch thread; by default it ends this process, the
one way out of a collective that will never return.

A beat also says which process sent it (`boot`, new in every process) and where that process is (`phase`:
"starting", "joining", "ready", "formed"). Joining is a handshake (`ready_to_join`), because MLX holds
Python's lock while it joins a collective, so a rank inside the join can neither beat nor watch: a rank
beats "joining", turns "ready" once every rank it watches beats "joining" or "ready", and enters the join once
it has beaten "ready" and every rank it watches beats "ready" too (lately: a dead process's last beat does not
count). So the ranks enter the join together, and a rank never waits inside it for a peer that is not there.
Once the group has formed (`formed`, with the boots the ranks exchanged over the collective itself), a beat
from another process on a watched rank's port means that rank restarted (a supervisor such as Ray brought it
back within the deadline): the process this rank formed with is gone, so the rank is lost at once rather than
mistaken for alive. Before that, any process of a rank counts, and the last of them is the one that joins.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from typing import Callable, Optional

import msgspec
import zmq

log = logging.getLogger(__name__)

LOST_EXIT_CODE = 75  # a rank that ends because its group broke (EX_TEMPFAIL: a supervisor restarts the group)


PHASES = ("starting", "joining", "ready", "formed")


class Beat(msgspec.Struct, array_like=True, frozen=True):
    """One beat: the group's name, the rank, a counter, what the rank reports of itself (`Heartbeat.info`: its
    memory once loaded), its process's `boot` id and its `phase` (see the module docstring)."""

    group: str
    rank: int
    seq: int
    info: dict = {}
    boot: int = 0
    phase: str = ""


def new_boot() -> int:
    """A process's boot id: random, non-zero, within int32 (the collective exchanges it as one)."""
    return random.SystemRandom().randrange(1, 2**31)


def exit_group(rank: int, silent_s: float) -> None:
    """The default `on_lost`: log and end this process at once (a collective may hold the main thread). `rank`
    -1: no rank fell silent, this rank's collective failed."""
    end_rank("the group is broken" if rank < 0 else f"rank {rank} lost (silent for {silent_s:.1f} s)")


def end_rank(why: str) -> None:
    """End this rank's process at once with `LOST_EXIT_CODE`, logging `why`: its group is broken."""
    log.critical("worker group: %s; ending this rank so that the group restarts", why)
    logging.shutdown()
    os._exit(LOST_EXIT_CODE)


class Heartbeat:
    """Beats for rank `rank` of group `group` on `bind` (tcp://host:port) and watches `peers` ({rank:
    endpoint}). `start()` starts the thread; `stop()` ends it (a normal shutdown: nothing is lost). `boot`: this
    process's id in its beats; `phase`: what they say of it (set by the owner: "joining", then `formed`)."""

    def __init__(self, group: str, rank: int, bind: str, peers: dict[int, str], interval_s: float = 0.5,
                 deadline_s: float = 10.0, startup_s: float = 300.0,
                 on_lost: Callable[[int, float], None] = exit_group):
        self.group, self.rank, self.bind, self.peers = group, rank, bind, dict(peers)
        self.interval_s, self.deadline_s, self.startup_s, self.on_lost = interval_s, deadline_s, startup_s, on_lost
        self.last_seen: dict[int, Optional[float]] = {r: None for r in peers}
        self.info: dict = {}  # what this rank's beats carry (set by its owner; ints and strings)
        self.peer_info: dict[int, dict] = {}  # what each watched rank's last beat carried
        self.boot = new_boot()
        self.phase = "starting"  # what the next beat says; `set_phase` sends it at once
        self.sent_phase = ""  # what the last beat sent said
        self._beat_now = False
        self.peer_phase: dict[int, str] = {}  # each watched rank's phase, as its last beat said
        self.formed_with: Optional[dict[int, int]] = None  # {rank: boot} of the processes the group formed with
        self._heard: dict[int, set[int]] = {r: set() for r in peers}  # boots heard from each rank before that
        self.lost: Optional[int] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-rank{self.rank}", daemon=True)
        self._thread.start()

    def ranks(self) -> list[dict]:
        """Each watched rank as last heard: {"rank", "alive", "silent_s", **its info}; a rank once lost is not
        alive."""
        now = time.monotonic()
        out = []
        for rank, seen in sorted(self.last_seen.items()):
            silent = None if seen is None else now - seen
            alive = silent is not None and silent <= self.deadline_s and rank != self.lost
            out.append({"rank": rank, "alive": alive, "silent_s": None if silent is None else round(silent, 3),
                        **self.peer_info.get(rank, {})})
        return out

    def formed(self, boots: dict[int, int]) -> None:
        """The group formed with these processes of the watched ranks ({rank: boot}, as the ranks exchanged them
        over the collective): from now on only their beats count, a beat from any other new process of a rank
        loses it at once, and older processes' late beats are ignored. Restarts every deadline from now (forming
        proved each rank alive)."""
        now = time.monotonic()
        self.formed_with = {r: boots[r] for r in self.last_seen}
        for r in self.last_seen:
            self.last_seen[r] = now
        self.set_phase("formed")

    def set_phase(self, phase: str) -> None:
        """Say `phase` in this rank's beats, from a beat sent at once."""
        self.phase = phase
        self._beat_now = True

    def ready_to_join(self, timeout_s: float) -> bool:
        """The join's handshake (see the module docstring): True once this rank and every rank it watches are
        "ready"; False after `timeout_s` or once a rank is lost (this rank then should not join)."""
        deadline = time.monotonic() + timeout_s
        self.set_phase("joining")
        while self.lost is None and time.monotonic() < deadline:
            now = time.monotonic()
            heard = {r: self.peer_phase.get(r) for r, seen in self.last_seen.items()
                     if seen is not None and now - seen <= 3 * self.interval_s}
            if self.phase == "joining" and all(heard.get(r) in ("joining", "ready") for r in self.last_seen):
                self.set_phase("ready")
            if self.sent_phase == "ready" and all(heard.get(r) == "ready" for r in self.last_seen):
                return True
            time.sleep(min(0.02, self.interval_s / 4))
        return False

    def wait_for_phase(self, rank: int, phase: str, timeout_s: float) -> bool:
        """Wait until watched rank `rank` beats `phase` (its latest process); False after `timeout_s` or once a
        rank is lost."""
        deadline = time.monotonic() + timeout_s
        while self.peer_phase.get(rank) != phase:
            if self.lost is not None or time.monotonic() > deadline:
                return False
            time.sleep(min(0.05, self.interval_s))
        return True

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
                if now >= next_beat or self._beat_now:
                    seq += 1
                    self._beat_now, phase = False, self.phase
                    pub.send(encode(Beat(self.group, self.rank, seq, self.info, self.boot, phase)), zmq.NOBLOCK)
                    self.sent_phase = phase
                    next_beat = now + self.interval_s
                lost = None
                if sub.poll(int(self.interval_s * 250) if not self._beat_now else 0):
                    try:
                        beat = decoder.decode(sub.recv(zmq.NOBLOCK))
                    except (msgspec.DecodeError, msgspec.ValidationError, zmq.Again):
                        continue
                    lost = self._heard_beat(beat, time.monotonic())
                lost = lost or self._silent(time.monotonic(), started)
                if lost is not None:
                    self.lost = lost[0]
                    self.on_lost(*lost)
                    return
        finally:
            pub.close(0)
            sub.close(0)

    def _heard_beat(self, beat: Beat, now: float) -> Optional[tuple[int, float]]:
        """Take one beat (see the module docstring); (rank, seconds since its formed process's last beat) when
        it says that rank restarted after the group formed, else None."""
        rank = beat.rank
        if beat.group != self.group or rank not in self.last_seen:
            return None
        formed = self.formed_with
        if formed is not None and beat.boot != formed[rank]:
            if beat.boot in self._heard[rank]:
                return None  # a late beat of a process from before the group formed
            seen = self.last_seen[rank]
            log.critical("worker group: rank %d restarted (a new process beats on its port): the process this "
                         "group formed with is gone", rank)
            return rank, 0.0 if seen is None else now - seen
        if formed is None:
            self._heard[rank].add(beat.boot)
        self.last_seen[rank] = now
        self.peer_info[rank] = beat.info
        self.peer_phase[rank] = beat.phase
        return None

    def _silent(self, now: float, started: float) -> Optional[tuple[int, float]]:
        """(rank, seconds silent) of the first watched rank past its deadline, or None."""
        for rank, seen in self.last_seen.items():
            if seen is None and now - started > self.startup_s:
                return rank, now - started
            if seen is not None and now - seen > self.deadline_s:
                return rank, now - seen
        return None
