"""Supervising a worker group whose ranks live in processes of their own (on Ray, in actors of their own): the
heartbeats between ranks over loopback (a silent rank is lost at its deadline; a rank that restarted after the
group formed is lost at once, since a new process on its port is not the one the group formed with; before the
group forms any process of a rank counts), a rank's `machine` in the topology and in the plan a follower reads,
and what `mlx-pd up`, `mlx-pd status` and the dashboard make of a group's ranks (placement, actor names,
status lines, the dashboard's rows). The ranks across a shaped link, killed and cut: tests/test_lab_group.py."""

from __future__ import annotations

import threading
import time

import pytest

from cluster.config import EngineConfig
from cluster.parallel.heartbeat import Heartbeat
from cluster.parallel.spec import GroupPlan, RankAddress
from cluster.ports import free_ports
from cluster.topology import parse_topology

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


# -- a rank's machine -------------------------------------------------------------------------------------------

GROUP_TOPOLOGY = """
[model]
source = "m"
[[workers]]
name = "decode-0"
role = "decode"
machine = "mac-a"
host = "10.0.0.1"
control_port = 5611
kv_port = 5612
[workers.group]
parallel = "tensor"
backend = "ring"
deadline_s = 5.0
ranks = [{ host = "10.0.0.1", ring_port = 5620, step_port = 5621, heartbeat_port = 5622 },
         { host = "10.0.0.2", ring_port = 5620, step_port = 5621, heartbeat_port = 5622, machine = "mac-b" }]
"""


def test_a_rank_names_its_machine_and_the_plan_keeps_it_through_json():
    t = parse_topology(GROUP_TOPOLOGY, "g")
    group = t.worker("decode-0").group
    assert [r.machine for r in group.ranks] == [None, "mac-b"] and group.deadline_s == 5.0
    plan = group.plan("m", None, EngineConfig(dtype="float32"))
    again = GroupPlan.from_json(plan.to_json())
    assert again == plan and again.ranks[1] == RankAddress("10.0.0.2", 5620, 5621, 5622, "mac-b")
    # a plan written before ranks had a machine still reads
    old = plan.to_json().replace(', "machine": null', "").replace(', "machine": "mac-b"', "")
    assert '"machine"' not in old and GroupPlan.from_json(old).ranks[1].machine is None


def test_rank_zero_is_the_worker_itself_so_its_machine_is_the_workers():
    ok = GROUP_TOPOLOGY.replace('{ host = "10.0.0.1", ring_port', '{ host = "10.0.0.1", machine = "mac-a", ring_port')
    assert parse_topology(ok, "g").worker("decode-0").group.ranks[0].machine == "mac-a"
    bad = GROUP_TOPOLOGY.replace('{ host = "10.0.0.1", ring_port', '{ host = "10.0.0.1", machine = "mac-b", ring_port')
    with pytest.raises(ValueError, match=r"group.ranks\[0\].machine='mac-b' is invalid.*mac-a"):
        parse_topology(bad, "g")
    with pytest.raises(ValueError, match="unknown key.*mchine"):
        parse_topology(GROUP_TOPOLOGY.replace('machine = "mac-b"', 'mchine = "mac-b"'), "g")


# -- mlx-pd up, status and the dashboard --------------------------------------------------------------------------

def test_each_following_rank_is_an_actor_placed_on_its_own_machine():
    from cluster.launch import ray_up

    t = parse_topology(GROUP_TOPOLOGY, "g")
    w = t.worker("decode-0")
    assert ray_up.rank_actor_names(t) == ["decode-0-rank1@mac-b"]
    opts = ray_up.rank_options(t, w, 1, "10.0.0.9", {})
    assert opts == {"name": "decode-0-rank1@mac-b", "namespace": "mlx-pd-g", "lifetime": "detached",
                    "get_if_exists": True, "num_cpus": 0, "max_concurrency": 4, "resources": {"mac-b": 0.01},
                    "max_restarts": 3, "max_task_retries": 0}
    assert ray_up.group_placement_problems(t, "10.0.0.9") == []
    # two ranks on one machine are refused, by resource or by the node that alone advertises both
    same = parse_topology(GROUP_TOPOLOGY.replace('machine = "mac-b"', 'machine = "mac-a"'), "g")
    [problem] = ray_up.group_placement_problems(same, "10.0.0.9")
    assert "decode-0: ranks 0 and 1 would share a node (mac-a)" in problem
    no_machine = parse_topology(GROUP_TOPOLOGY.replace(', machine = "mac-b"', ""), "g")
    assert ray_up.rank_options(no_machine, no_machine.worker("decode-0"), 1, "x", {})["resources"] == {
        "node:10.0.0.2": 0.01}
    nodes = {"mac-a": {"n1"}, "node:10.0.0.2": {"n1"}}  # 10.0.0.2 is an address of mac-a's node
    assert "would share a node (node n1)" in ray_up.group_placement_problems(no_machine, "x", nodes)[0]
    assert ray_up.group_placement_problems(no_machine, "x", {"mac-a": {"n1"}, "node:10.0.0.2": {"n2"}}) == []
    local = parse_topology(GROUP_TOPOLOGY.replace('machine = "mac-a"\n', "").replace("10.0.0.1", "127.0.0.1")
                           .replace('"10.0.0.2", ring_port = 5620, step_port = 5621, heartbeat_port = 5622',
                                    '"127.0.0.1", ring_port = 5630, step_port = 5631, heartbeat_port = 5632')
                           .replace(', machine = "mac-b"', ""), "g")
    assert ray_up.group_placement_problems(local, "10.0.0.9") == []  # one machine's group, on loopback


def test_status_shows_each_rank_of_a_group():
    from cluster.launch.ray_driver import group_ranks
    from cluster.launch.ray_up import format_status

    t = parse_topology(GROUP_TOPOLOGY, "g")
    w = t.worker("decode-0")
    row = {"actor": w.actor_name, "name": w.name, "role": "decode", "host": w.host, "state": "alive",
           "running": 1, "waiting": 0, "load_check": None}
    reported = [{"rank": 0, "host": "10.0.0.1", "alive": True, "parameter_bytes": 3 * 2**20, "kv_bytes": 2**21,
                 "peak_bytes": 2**22, "step_bytes": 4096},
                {"rank": 1, "host": "10.0.0.2", "alive": False, "parameter_bytes": 3 * 2**20, "kv_bytes": 2**21,
                 "peak_bytes": 2**22, "step_bytes": 4096}]
    row["pid"] = 11
    row.update(parallel="tensor", ranks=group_ranks(
        w, row, {"decode-0-rank1@mac-b": {"state": "RESTARTING"}}, reported))
    assert [(k["rank"], k["actor"], k["state"], k["pid"], k["alive"]) for k in row["ranks"]] == [
        (0, "decode-0@mac-a", "alive", 11, True), (1, "decode-0-rank1@mac-b", "restarting", None, False)]
    alive = {"decode-0-rank1@mac-b": {"state": "ALIVE"}}
    ranks = group_ranks(w, row, alive, reported, {"decode-0-rank1@mac-b": {"pid": 12, "healthy": True}})
    assert (ranks[1]["state"], ranks[1]["pid"]) == ("alive", 12)
    for own in ({"decode-0-rank1@mac-b": {"pid": 12, "healthy": False}}, {"decode-0-rank1@mac-b": None}):
        assert group_ranks(w, row, alive, reported, own)[1]["state"] == "unhealthy"  # failed, or did not answer
    text = format_status([row, {"actor": "router@127.0.0.1", "name": "router", "role": "router",
                                "host": "127.0.0.1", "state": "alive"}])
    assert "decode-0@mac-a: a tensor-parallel group of 2 ranks" in text
    assert ("  rank 1  10.0.0.2  decode-0-rank1@mac-b restarting  in group: silent  weights 3.0 MiB, KV 2.0 MiB, "
            "peak 4.0 MiB, steps 4.0 KiB") in text
    # the leader did not answer: the ranks are the topology's, with their actors' states only
    silent = group_ranks(w, {**row, "state": "unhealthy"}, {}, None)
    assert [(k["state"], k["alive"], k["kv_bytes"]) for k in silent] == [("unhealthy", None, None),
                                                                          ("absent", None, None)]


def test_the_dashboard_rows_carry_a_groups_ranks():
    from types import SimpleNamespace

    from router.dashboard import worker_rows
    from router.dashboard_history import DashboardHistory

    t = parse_topology(GROUP_TOPOLOGY, "g")
    ranks = [{"rank": 0, "host": "10.0.0.1", "alive": True, "parameter_bytes": 1, "kv_bytes": 2, "peak_bytes": 3,
              "step_bytes": 4}, {"rank": 1, "host": "10.0.0.2", "alive": True, "parameter_bytes": 1,
                                 "kv_bytes": 2, "peak_bytes": 3, "step_bytes": 0}]
    engine = SimpleNamespace(workers=[SimpleNamespace(spec=t.worker("decode-0"))], worker_stats=lambda: [
        {"name": "decode-0", "role": "decode", "alive": True, "inflight": 0, "parallel": "tensor", "ranks": ranks}])
    [row] = worker_rows(engine, DashboardHistory())
    assert row["parallel"] == "tensor" and row["ranks"] == ranks
    engine.worker_stats = lambda: [{"name": "decode-0", "role": "decode", "alive": False, "inflight": 0}]
    [row] = worker_rows(engine, DashboardHistory())  # no report yet (dead): no ranks to show
    assert row["parallel"] == "" and row["ranks"] == []
