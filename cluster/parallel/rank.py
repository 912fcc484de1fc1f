"""One rank of a worker group, from its plan to a built engine: watch the peers' heartbeats, join the collective,
load this rank's share of the model, build the same engine as every other rank (the load check runs on all
ranks at once), check the rank's memory budget. The leader then serves through its engine; a follower runs
`follower.run_follower` (`python -m cluster.parallel.rank PLAN_FILE RANK` starts one by hand).

Joining, and joining again after a restart (a supervisor brings back the ranks of a broken group on the same
ports): MLX holds Python's lock while it joins, so no heartbeat runs inside the join; the ranks first agree
over their heartbeats that all of them are about to join (`Heartbeat.ready_to_join`), and a join that still
takes more than `join_timeout_s` ends the process (exit status 1, faulthandler's watchdog: nothing else runs).
A follower restarted while the old leader is still being ended waits for the new one. Once joined, the ranks
exchange their heartbeats' boot ids over the collective (`Heartbeat.formed`): a rank that restarts later is
lost at once. A rank that cannot join, or whose collective fails (the ring backend raises once a peer's
connection drops), is lost as a silent peer is: by default its process ends with exit status 75, for its
supervisor to restart the group."""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import sys
import time
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from cluster.parallel.collective import check_parallel, join_group
from cluster.parallel.heartbeat import Heartbeat
from cluster.parallel.spec import GroupPlan

log = logging.getLogger(__name__)


@dataclass
class GroupRank:
    """A started rank: its `engine` (the leader's serves; a follower's runs the leader's steps), the `group`
    (`mx.distributed.Group`), its `heartbeat`, its `memory` (`cluster.memory_budget.RankMemory`), on the
    leader `leader` (`GroupLeader`), and `shards`: per KV cache group with blocks (by index), how the ranks
    spread them (`cluster.parallel.group_kv.KVShard`)."""

    rank: int
    plan: GroupPlan
    engine: object
    group: object
    heartbeat: Heartbeat
    memory: object
    leader: Optional[object] = None
    shards: dict = field(default_factory=dict)

    def stats(self) -> dict:
        """The group's fields of a leader's `cluster.stats.WorkerStats`: {"parallel", "ranks"}."""
        from cluster.stats import RankStats

        plan, sent = self.plan, self.leader.bytes_sent
        ranks = [RankStats(0, plan.ranks[0].host, True, self.memory.parameter_bytes, self.memory.kv_bytes,
                           self.memory.peak_bytes, sum(sent))]
        for peer in self.heartbeat.ranks():
            r = peer["rank"]
            ranks.append(RankStats(r, plan.ranks[r].host, peer["alive"], peer.get("parameter_bytes", 0),
                                   peer.get("kv_bytes", 0), peer.get("peak_bytes", 0), sent[r - 1]))
        return {"parallel": plan.parallel, "ranks": tuple(ranks)}


def group_id(plan: GroupPlan) -> str:
    """The group's name in its heartbeats: its leader's address."""
    r = plan.ranks[0]
    return f"{r.host}:{r.ring_port}"


def check_group(plan: GroupPlan, path: Optional[Path] = None) -> dict:
    """Refuse, before joining, a group that cannot split its model: by the config (`check_parallel`: heads or
    layers) and by the family's mlx-lm class (`cluster.model.check_splittable`). `path`: the model folder, when
    the caller has resolved it (else `served_model` does). Returns the model's config. Raises ValueError naming
    what to change."""
    from cluster.model import check_splittable, served_model

    if path is None:
        path, _ = served_model(plan.model, plan.served_name, plan.engine.dtype)
    model_config = json.loads((Path(path) / "config.json").read_text())
    check_parallel(model_config, plan.parallel, plan.size)
    check_splittable(path, plan.parallel)
    return model_config


def start_rank(plan: GroupPlan, rank: int, heartbeat: Optional[Heartbeat] = None) -> GroupRank:
    """Bring up `rank` of `plan` (see the module docstring); the leader's engine has the followers as its
    replicas and has told them its KV pool. `heartbeat`: one already started (else started here). Raises
    ValueError for what the group cannot serve (heads or layers that do not split, a family mlx-lm cannot split
    that way, recurrent layers, a budget exceeded), naming it; every rank raises the same. Pipeline ranks of
    unequal layers agree on the smallest pool's block count (block ids are shared)."""
    from cluster.kv.plan import plan_kv
    from cluster.load_check import checked_engine
    from cluster.memory_budget import check_rank_memory, check_weights
    from cluster.model import load_sharded_model, served_model
    from cluster.model_structure import kv_spec, verify_model

    if heartbeat is None:
        heartbeat = rank_heartbeat(plan, rank)
        heartbeat.start()
    config = plan.engine
    path, spec = served_model(plan.model, plan.served_name, config.dtype)
    model_config = check_group(plan, path)
    group = _join(plan, rank, heartbeat)
    model, tokenizer = load_sharded_model(path, group, config.dtype, plan.parallel)
    where = f"rank {rank} of {plan.size}"
    verified = verify_model(model)  # runs the model once: on every rank, before any check that may fail on one
    kinds = _all_ranks(group, verified.cache_kinds) if plan.parallel == "pipeline" else None
    own_blocks, error = 0, None
    try:  # checks whose answer may differ between ranks (a pipeline rank sees its own layers): refused together
        if plan.memory_budget_gb is not None:
            check_weights(model, plan.memory_budget_gb, where)
        _check_layers(verified, plan, spec.model_id, kinds)
        if plan.parallel == "pipeline" and config.num_blocks is None:  # ranks of unequal layers: the smallest pool
            own_blocks = plan_kv(kv_spec(spec, verified), config, verified).num_blocks
    except ValueError as exc:
        error = exc
    _refuse_together(group, error)
    if own_blocks:
        config = dataclasses.replace(config, num_blocks=_fewest(group, own_blocks))
    leader = None
    if rank == 0:
        from cluster.parallel.leader import GroupLeader

        leader = GroupLeader(plan, boot=heartbeat.boot)
    engine = checked_engine(model, tokenizer, spec, config, replicas=leader, open_tier=False)
    memory, error = None, None
    try:
        memory = check_rank_memory(model, engine, plan.memory_budget_gb or float("inf"), where)
    except ValueError as exc:
        error = exc
    _refuse_together(group, error)
    heartbeat.info = memory.report()
    log.info("%s: %.1f MiB of weights, %.1f MiB of KV, peak %.1f MiB", where, memory.parameter_bytes / 2**20,
             memory.kv_bytes / 2**20, memory.peak_bytes / 2**20)
    shards = kv_shards(plan, rank, group, engine, model_config)
    if plan.parallel == "pipeline":  # the whole model's slots, in layer order (rank size-1's first)
        per_rank = _all_ranks(group, engine.runner.verified.layer_kind_names)
        slots = [k for r in reversed(range(plan.size)) for k in per_rank[r]]
        engine.group_layer_kinds = tuple(slots) if rank == 0 else None
        # each copy of a request's content (a recurrent state) is charged as the largest rank's share
        for g in engine.kv.groups:
            largest = max(_all_ranks(group, g.entry_bytes()))
            if rank == 0:
                g.charge_entries(largest)
    from cluster.parallel.group_tier import open_group_tier

    engine.tier = open_group_tier(engine, spec, config, plan.parallel, rank, plan.size, group, leader)
    if leader is not None:
        from cluster.parallel.group_kv import GroupKV

        leader.hello(engine.pool.num_blocks, memory.kv_bytes)
        for index, shard in shards.items():  # KV enters and leaves the group whole
            engine.kv.groups[index].store.ranks = GroupKV(leader, group, index, shard)
    return GroupRank(rank, plan, engine, group, heartbeat, memory, leader, shards)


def kv_shards(plan: GroupPlan, rank: int, group, engine, model_config: dict) -> dict:
    """How the group spreads each of `engine`'s KV cache groups with blocks (by index; see
    `cluster.parallel.group_kv.KVShard`): tensor parallelism splits the heads (unless each rank holds the whole
    cache, as latent attention's), pipeline parallelism the layers (the ranks' counts: one all-gather, so every
    rank calls this at the same point)."""
    from cluster.parallel.group_kv import KVShard, splits_kv_heads

    stores = {i: g.store for i, g in enumerate(engine.kv.groups)
              if getattr(g, "store", None) is not None and g.pool is not None}
    if plan.parallel == "pipeline":
        import mlx.core as mx
        import numpy as np

        own = mx.array([stores[i].spec.num_layers for i in sorted(stores)] or [0], dtype=mx.int32)
        counts = np.array(mx.distributed.all_gather(own[None], group=group)).reshape(plan.size, -1)
        return {i: KVShard(rank, plan.size, layer_counts=tuple(int(c) for c in counts[:, j]))
                for j, i in enumerate(sorted(stores))}
    return {i: KVShard(rank, plan.size, head_ranks=plan.size if splits_kv_heads(
        model_config, store.spec.num_kv_heads, plan.size) else 1) for i, store in stores.items()}


def _check_layers(verified, plan: GroupPlan, model_id: str, kinds: Optional[list] = None) -> None:
    """Refuse, by name, layers a group does not serve: recurrent layers in a group that ships or receives KV (a
    prefill or decode worker: the state would travel between groups whole, which is not built), and in a
    pipeline sliding-window layers or ranks holding different kinds of layers (`kinds`: each rank's
    `cache_kinds`; each rank plans the KV cache groups of its own layers, and the ranks' groups must be the same).
    Raises ValueError."""
    if verified.num_state_layers and plan.moves_kv:
        raise ValueError(f"{model_id}: a worker group of a model with recurrent layers serves in single-node mode "
                         "only (mlx-pd serve --tensor-parallel N / --pipeline-parallel N): as a prefill or decode "
                         "worker its recurrent state would travel between groups, which is not built yet")
    reason = verified.pipeline_refusal() if plan.parallel == "pipeline" else None
    if reason:
        raise ValueError(f"{model_id}: {reason}; use parallel = 'tensor' (--tensor-parallel N) or one rank")
    if kinds and any(list(k) != list(kinds[0]) for k in kinds):
        held = "; ".join(f"rank {r}: {', '.join(k)}" for r, k in enumerate(kinds))
        raise ValueError(f"{model_id}: the pipeline's ranks would hold different kinds of layers ({held}), so "
                         "their KV cache groups would differ: choose a number of ranks that gives every rank "
                         "layers of each kind, or parallel = 'tensor' (--tensor-parallel N)")


def _refuse_together(group, error: Optional[Exception]) -> None:
    """Every rank of `group` calls this at the same point, after a check whose answer may differ between ranks:
    when any rank's check failed (`error`), every rank raises (its own error, or one naming the rank that
    refused), so that no rank waits in a collective that the refusing one never joins."""
    import mlx.core as mx
    import numpy as np

    flags = np.array(mx.distributed.all_gather(mx.array([1 if error else 0], dtype=mx.int32), group=group))
    if error is not None:
        raise error
    refused = [r for r, f in enumerate(flags.reshape(-1)) if f]
    if refused:
        raise ValueError(f"rank {refused[0]} of the group refused to serve (its log says why): every rank stops")


def _fewest(group, num_blocks: int) -> int:
    """The fewest `num_blocks` of any rank of `group` (every rank calls it at once)."""
    import mlx.core as mx

    return int(mx.distributed.all_gather(mx.array([num_blocks], dtype=mx.int32), group=group).min().item())


def _all_ranks(group, value) -> list:
    """Every rank's `value` (anything JSON can carry), by rank (every rank of `group` calls it at once)."""
    import mlx.core as mx
    import numpy as np

    data = json.dumps(value).encode()
    sizes = np.array(mx.distributed.all_gather(mx.array([len(data)], dtype=mx.int32), group=group)).reshape(-1)
    padded = np.frombuffer(data.ljust(int(sizes.max())), dtype=np.uint8)
    rows = np.array(mx.distributed.all_gather(mx.array(padded)[None], group=group))
    return [json.loads(bytes(rows[r, :int(sizes[r])]).decode()) for r in range(group.size())]


def join_timeout_s(plan: GroupPlan) -> float:
    """How long a rank may take inside the collective's join once every rank is ready for it."""
    return max(30.0, 3 * plan.deadline_s)


def _join(plan: GroupPlan, rank: int, heartbeat: Heartbeat):
    """Join the collective as `rank` (see the module docstring) and tell the heartbeat whom it formed with."""
    import mlx.core as mx
    import numpy as np

    t0 = time.monotonic()
    if not heartbeat.ready_to_join(heartbeat.startup_s):
        waited = time.monotonic() - t0
        log.critical("rank %d: the group's ranks were not all ready to join within %.0f s", rank, waited)
        if heartbeat.lost is None:  # else its watch has already lost a rank
            heartbeat.on_lost(0 if rank else 1, waited)
        raise RuntimeError(f"rank {rank}: the group's ranks were not ready to join")
    watchdog = _join_watchdog(join_timeout_s(plan))
    try:
        group = join_group(plan, rank)
    except RuntimeError as exc:  # the ring backend gave up connecting: the group cannot form
        peer = (rank + 1) % plan.size
        log.critical("rank %d could not join the group (%s): ending this rank so that the group restarts", rank, exc)
        heartbeat.on_lost(peer, time.monotonic() - t0)
        raise
    finally:
        if watchdog:
            faulthandler.cancel_dump_traceback_later()
    boots = mx.distributed.all_gather(mx.array([heartbeat.boot], dtype=mx.int32), group=group)
    heartbeat.formed({r: int(b) for r, b in enumerate(np.array(boots).reshape(-1))})
    log.info("rank %d of %d: joined the group in %.1f s", rank, plan.size, time.monotonic() - t0)
    return group


def _join_watchdog(timeout_s: float) -> bool:
    """End this process if the join takes more than `timeout_s` (faulthandler's own thread: it needs no Python
    lock); False when it cannot be armed (no stderr file to write the tracebacks to)."""
    try:
        faulthandler.dump_traceback_later(timeout_s, exit=True)
    except (ValueError, RuntimeError, OSError, AttributeError):
        return False
    return True


def rank_heartbeat(plan: GroupPlan, rank: int) -> Heartbeat:
    """Rank `rank`'s heartbeat: it beats on its own port and watches the leader (a follower) or every follower
    (the leader)."""
    me = plan.ranks[rank]
    watched = range(1, plan.size) if rank == 0 else [0]
    peers = {r: f"tcp://{plan.ranks[r].host}:{plan.ranks[r].heartbeat_port}" for r in watched}
    return Heartbeat(group_id(plan), rank, f"tcp://{me.host}:{me.heartbeat_port}", peers, plan.heartbeat_s,
                     plan.deadline_s)


def follow(plan: GroupPlan, rank: int, on_started: Optional[Callable[[GroupRank], None]] = None) -> int:
    """A follower's life: bind the step socket, start the rank, run the leader's steps until it stops the group.
    Returns the exit code (0 after a `Stop`). `on_started(GroupRank)` runs once the rank has joined and built its
    engine. An exception stops this rank's heartbeat before it propagates, so the leader sees the rank lost."""
    import zmq

    from cluster.kv.state_replica import ReplicaError
    from cluster.parallel.follower import run_follower

    heartbeat = rank_heartbeat(plan, rank)
    heartbeat.start()
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.linger = 0
    try:
        me = plan.ranks[rank]
        sock.bind(f"tcp://{me.host}:{me.step_port}")
        started = start_rank(plan, rank, heartbeat)
        if on_started is not None:
            on_started(started)
        try:
            reason = run_follower(started.engine, sock, started.group, leader_boot=heartbeat.formed_with[0],
                                  shards=started.shards)
        except ReplicaError as exc:  # the leader's ops name what this rank never held: out of step
            log.critical("rank %d is out of step with its leader (%s): ending this rank so that the group "
                         "restarts", rank, exc)
            heartbeat.on_lost(-1, 0.0)
            raise
        except RuntimeError as exc:  # a collective failed (the leader's connection dropped): the group broke
            log.critical("rank %d: the group broke (%s): ending this rank so that the group restarts", rank, exc)
            heartbeat.on_lost(-1, 0.0)
            raise
        log.info("rank %d: the group stopped (%s)", rank, reason)
    finally:
        heartbeat.stop()
        sock.close(0)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.parallel.rank",
                                description="run one following rank of a worker group")
    p.add_argument("plan", help="the group's plan (JSON, GroupPlan.to_json)")
    p.add_argument("rank", type=int)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{args.rank} %(name)s: %(message)s")
    plan = GroupPlan.from_json(Path(args.plan).read_text())
    if not 0 < args.rank < plan.size:
        p.error(f"rank {args.rank} is not a follower of a group of {plan.size} (1..{plan.size - 1})")
    try:
        return follow(plan, args.rank)
    except ValueError as exc:  # what the group cannot serve: every rank refuses it alike, the leader says so
        log.error("rank %d: %s", args.rank, exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
