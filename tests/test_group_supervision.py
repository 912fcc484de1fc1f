"""Supervising a worker group whose ranks live in processes of their own: the heartbeats between ranks over
loopback (a silent rank is lost at its deadline; a rank that restarted after the group formed is lost at once,
since a new process on its port is not the one the group formed with; before the group formed any process of a
rank counts; the ranks enter the collective's join together), and the steps a follower runs (only its own
leader's, and never an old leader's through a reconnected socket)."""

from __future__ import annotations

import threading
import time

import pytest

from cluster.parallel.heartbeat import Heartbeat
from cluster.parallel.spec import GroupPlan, RankAddress
from cluster.ports import free_ports

INTERVAL_S = 0.05


class Watch:
    """A rank's heartbeat on loopback whose `on_lost` records instead of ending the process."""

    def __init__(self, rank: int, ports: dict[int, int], deadline_s: float = 1.0, startup_s: float = 30.0):
        self.lost: list[tuple[int, float]] = []
        self.event = threading.Event()
        peers = {r: f"tcp://127.0.0.1:{p}" for r, p in ports.items() if r != rank}
        self.hb = Heartbeat("g", rank, f"tcp://127.0.0.1:{ports[rank]}", peers, INTERVAL_S, deadline_s, startup_s,
                            on_lost=self._lost)
        self.hb.start()

    def _lost(self, rank: int, silent_s: float) -> None:
        self.lost.append((rank, silent_s))
        self.event.set()

    def stop(self) -> None:
        self.hb.stop()


def _until(pred, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def ports():
    a, b = free_ports(2)
    return {0: a, 1: b}


def test_a_rank_silent_past_its_deadline_is_lost(ports):
    leader, follower = Watch(0, ports, deadline_s=0.5), Watch(1, ports, deadline_s=0.5)
    try:
        assert _until(lambda: leader.hb.last_seen[1] is not None and follower.hb.last_seen[0] is not None)
        follower.stop()  # the follower's process is gone: no more beats
        t0 = time.monotonic()
        assert leader.event.wait(5.0), "the leader never gave the silent follower up"
        assert 0.2 < time.monotonic() - t0 < 2.0 and leader.lost[0][0] == 1 and leader.lost[0][1] > 0.5
        assert leader.hb.lost == 1
    finally:
        leader.stop()


def test_a_rank_restarted_after_the_group_formed_is_lost_at_once_not_at_its_deadline(ports):
    """Ray restarts a killed rank within seconds, on the same port: its new process beats on time, but it is
    not the one the group formed with, and waiting for the deadline would leave the leader in a collective
    with a process that never joined it."""
    leader, follower = Watch(0, ports, deadline_s=30.0), Watch(1, ports, deadline_s=30.0)
    try:
        assert _until(lambda: leader.hb.peer_phase.get(1) == "starting")
        boots = {0: leader.hb.boot, 1: follower.hb.boot}
        leader.hb.formed(boots)
        follower.hb.formed(boots)
        assert leader.hb.phase == follower.hb.phase == "formed"
        assert _until(lambda: follower.hb.peer_phase.get(0) == "formed")
        time.sleep(5 * INTERVAL_S)
        assert not leader.event.is_set() and not follower.event.is_set()  # the same processes: all is well
        follower.stop()
        t0 = time.monotonic()
        follower = Watch(1, ports, deadline_s=30.0)  # the restarted rank, on the same port
        assert leader.event.wait(5.0), "the leader took the restarted rank for the one it formed with"
        assert time.monotonic() - t0 < 3.0 and leader.lost[0][0] == 1
        assert not follower.event.is_set()  # the new process has formed nothing yet: the old leader counts
    finally:
        leader.stop()
        follower.stop()


def test_before_the_group_forms_a_restarted_rank_counts_and_its_phase_is_heard(ports):
    leader, follower = Watch(0, ports, deadline_s=30.0), Watch(1, ports, deadline_s=30.0)
    try:
        assert _until(lambda: leader.hb.peer_phase.get(1) == "starting")
        first = follower.hb.boot
        follower.stop()
        follower = Watch(1, ports, deadline_s=30.0)
        follower.hb.phase = "joining"
        assert leader.hb.wait_for_phase(1, "joining", 5.0)  # the last process's phase
        assert follower.hb.boot != first and not leader.event.is_set()
        leader.hb.formed({0: leader.hb.boot, 1: follower.hb.boot})
        # a late beat of the process from before the group formed is ignored, a new process is not
        assert leader.hb._heard_beat(_beat(1, first), time.monotonic()) is None
        assert leader.hb._heard_beat(_beat(1, 12345), time.monotonic())[0] == 1
        assert not leader.hb.wait_for_phase(1, "never", 0.1)
    finally:
        leader.stop()
        follower.stop()


def test_ranks_enter_the_join_together_and_never_on_a_dead_peers_last_word(ports):
    """MLX holds Python's lock while it joins, so a rank inside the join neither beats nor watches: each rank
    waits until the other has said it is ready, and a peer that said so and died does not count."""
    leader, follower = Watch(0, ports, deadline_s=30.0), Watch(1, ports, deadline_s=30.0)
    try:
        got = {}
        waits = [threading.Thread(target=lambda w=w, r=r: got.__setitem__(r, w.hb.ready_to_join(5.0)))
                 for r, w in ((0, leader), (1, follower))]
        t0 = time.monotonic()
        for t in waits:
            t.start()
        for t in waits:
            t.join(10)
        assert got == {0: True, 1: True} and time.monotonic() - t0 < 2.0
        assert leader.hb.peer_phase[1] == follower.hb.peer_phase[0] == "ready"
        follower.stop()  # ready, then gone: its last beat said "ready"
        time.sleep(0.3)
        t0 = time.monotonic()
        assert not leader.hb.ready_to_join(1.0) and time.monotonic() - t0 >= 1.0
    finally:
        leader.stop()
        follower.stop()


def _beat(rank: int, boot: int):
    from cluster.parallel.heartbeat import Beat

    return Beat("g", rank, 1, {}, boot, "formed")


# -- steps from the leader the group formed with, and no other ----------------------------------------------------

def _plan(step_port: int, deadline_s: float = 10.0) -> GroupPlan:
    a, b, c, d, e = free_ports(5)
    return GroupPlan("tensor", "ring", (RankAddress("127.0.0.1", a, b, c), RankAddress("127.0.0.1", d, step_port, e)),
                     heartbeat_s=0.05, deadline_s=deadline_s)


def _pull(port: int):
    import zmq

    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.linger = 0
    sock.bind(f"tcp://127.0.0.1:{port}")
    return sock


def test_a_follower_runs_only_the_steps_of_the_leader_it_formed_with():
    """Ray restarts a killed follower on its port at once, while the old leader still lives: a step the old
    leader sends then must not wait in the new follower's queue to run out of step with the new leader."""
    from types import SimpleNamespace

    from cluster.parallel.follower import run_follower
    from cluster.parallel.leader import GroupLeader
    from cluster.parallel.step_wire import Stop

    port = free_ports(1)[0]
    sock = _pull(port)
    old, new = GroupLeader(_plan(port), boot=111), GroupLeader(_plan(port), boot=222)
    copies = []
    engine = SimpleNamespace(runner=SimpleNamespace(store=SimpleNamespace(mirror=None)),
                             owner=SimpleNamespace(take=lambda: None),
                             kv=SimpleNamespace(copy_block=lambda src, dst: copies.append((src, dst))))
    try:
        old.copy_block(1, 2)
        new.copy_block(3, 4)
        old.send_all(Stop("the old leader's"))
        new.stop("the group ends")
        assert run_follower(engine, sock, poll_ms=50, leader_boot=222) == "the group ends"
        assert copies == [(3, 4)]
    finally:
        old.stop()
        sock.close(0)


def test_a_leader_whose_follower_dropped_never_reaches_the_followers_next_process():
    lost = []
    port = free_ports(1)[0]
    first = _pull(port)
    from cluster.parallel.leader import GroupLeader

    leader = GroupLeader(_plan(port, deadline_s=0.5), on_lost=lambda rank, s: lost.append(rank), boot=5)
    try:
        leader.copy_block(1, 2)
        assert first.poll(5000) and len(first.recv_multipart()) == 2
        first.close(0)  # the follower's process is gone ...
        time.sleep(0.3)
        second = _pull(port)  # ... and its next one binds the same port
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="took no step within 0.5 s"):
            leader.copy_block(3, 4)
        assert lost == [1] and 0.4 < time.monotonic() - t0 < 3.0
        assert not second.poll(300), "the old leader's step reached the follower's next process"
        second.close(0)
    finally:
        leader.stop()
