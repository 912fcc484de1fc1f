"""A worker group's followers keep each request's recurrent state and every state snapshot exactly as the leader
decides them, replaying only what the leader's step messages carry: in one process, a leader engine hands every
forward (encoded and decoded as on the wire) to a follower engine over the same whole model, which must then hold
the same state for every running request and the same snapshots as the leader, after restores on prefix hits,
snapshots saved at chunk ends and kept at finish, thinning, evictions from a small snapshot budget, and
preemptions from a small pool; and it must keep nothing for a request that is over."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cluster.config import EngineConfig
from cluster.engine import EngineCore
from cluster.kv.state_replica import CLEAR, DROP, KEEP_PENDING, PEND, RESTORE, SAVE, ReplicaError, StateReplica
from cluster.parallel import step_wire
from tests.family_helpers import (COMMON, CONFIGS, VOCAB, expected_state_bytes_per_sequence, family, reference,
                                  request, tokenizer)


class InProcessFollower:
    """The leader's `Replicas`: each forward goes through the step wire to `follower` (an engine of its own),
    which runs it before the leader does, as a following rank would."""

    def __init__(self):
        self.follower: EngineCore = None
        self.num_forwards = self.num_ops = 0

    def forward(self, items, mirror, groups) -> None:
        msg = step_wire.decode(step_wire.encode(step_wire.to_wire(items, mirror, groups)))
        self.num_forwards += 1
        self.num_ops += sum(len(ops) for ops in msg.replays)
        runner = self.follower.runner
        if runner.store.mirror is not None and step_wire.mirror_key(runner.store.mirror) != msg.mirror_key:
            runner.store.mirror.reset()
        outputs = runner.forward(step_wire.from_wire(msg, runner.groups))
        mx.eval(*[o for o in outputs if o is not None])

    def copy_block(self, src: int, dst: int) -> None:
        self.follower.kv.copy_block(src, dst)

    def abandon(self, exc: BaseException) -> None:
        raise AssertionError(f"the leader's forward failed: {exc}")


def _pair(**config) -> tuple[EngineCore, InProcessFollower]:
    model, spec = family("qwen3_next")
    config = EngineConfig(**dict(dict(dtype="float32", block_size=8, enable_prefix_caching=True,
                                      prefill_chunk_size=16, state_snapshot_interval=8), **config))
    followers = InProcessFollower()
    leader = EngineCore(model, tokenizer(), spec, config, replicas=followers)
    followers.follower = EngineCore(model, tokenizer(), spec, config)
    return leader, followers


def _state_group(engine: EngineCore):
    (group,) = [g for g in engine.kv.groups if g.ships_state]
    return group


def _assert_alike(leader: EngineCore, followers: InProcessFollower) -> None:
    """Once the leader's ops since its last forward reach the follower (as they would with the next forward), it
    holds, for every leader entry with a state, the same state, and the leader's snapshots, equal."""
    mine, theirs = _state_group(leader), _state_group(followers.follower).replica
    theirs.replay(mine.replica_ops())
    for entries in leader.kv._entries.values():
        entry = entries[mine.index]
        if entry.state is not None:
            _assert_equal(entry.state, theirs.entries[entry.id].state)
    kept = mine.snapshots._by_hash
    assert set(theirs.snapshots) == set(kept)
    for block_hash, (state, _) in kept.items():
        _assert_equal(state, theirs.snapshots[block_hash])


def _assert_equal(state, other) -> None:
    for a, b in zip(sum(state, ()), sum(other, ()), strict=True):
        assert np.array_equal(np.array(a), np.array(b))


def _run_checked(leader: EngineCore, followers: InProcessFollower, reqs) -> dict:
    """Step `leader` until `reqs` finish, checking the follower after every step; request id -> token ids."""
    for r in reqs:
        leader.add_request(r)
    tokens: dict = {r.request_id: [] for r in reqs}
    while leader.has_work():
        for out in leader.step():
            assert not out.error, out.error
            tokens[out.request_id] += list(out.token_ids)
        _assert_alike(leader, followers)
    return tokens


LONG = np.random.RandomState(3).randint(100, VOCAB, size=(3, 40)).tolist()


def test_a_follower_replaying_the_leaders_ops_holds_its_states_and_snapshots_through_hits_turns_and_evictions():
    """Three 40-token prompts computed in 16-token chunks (snapshots at every 8 tokens, thinned at finish), each
    sent again as a second turn with its answer (restored from the state kept when the first turn finished),
    under a snapshot budget of a few states (the least recently used are evicted): every answer equals mlx-lm's,
    and after each turn the follower holds exactly the leader's states and snapshots, and no state of a request
    that is over."""
    per_state = expected_state_bytes_per_sequence({"model_type": "qwen3_next", **COMMON, **CONFIGS["qwen3_next"]})
    leader, followers = _pair(num_blocks=96, state_cache_gb=6 * per_state / 2**30)
    snaps, prompts = _state_group(leader).snapshots, [list(p) for p in LONG]
    for turn in range(2):
        reqs = [request(f"t{turn}-{i}", p) for i, p in enumerate(prompts)]
        results = _run_checked(leader, followers, reqs)
        for i, r in enumerate(reqs):
            assert results[r.request_id] == reference("qwen3_next", tuple(prompts[i]))[0], r.request_id
        prompts = [p + results[r.request_id] for p, r in zip(prompts, reqs)]
        assert not leader.sequences and _state_group(followers.follower).replica.entries == {}
    assert snaps.num_restored > 0 and snaps.num_evicted > 0 and followers.num_ops > 0


def test_a_follower_holds_the_leaders_states_when_sequences_are_preempted_and_recomputed():
    """Seven usable 8-token blocks for four 15-token prompts that grow into a third block: the leader preempts
    sequences (their states dropped, recomputed from the first token), and the follower, told so, recomputes
    the same; every answer equals mlx-lm's and both ranks hold the same states after every step."""
    leader, followers = _pair(num_blocks=8, enable_prefix_caching=False)
    prompts = np.random.RandomState(5).randint(100, VOCAB, size=(4, 15)).tolist()
    reqs = [request(f"preempt-{i}", p) for i, p in enumerate(prompts)]
    results = _run_checked(leader, followers, reqs)
    assert leader.scheduler.num_preemptions > 0
    for p, r in zip(prompts, reqs):
        assert results[r.request_id] == reference("qwen3_next", tuple(p))[0], r.request_id


def test_a_replica_refuses_ops_on_states_it_never_computed():
    """An op naming a state or a snapshot the follower lacks means the ranks are out of step: it is refused, not
    replayed as zeros."""
    replica = StateReplica()
    with pytest.raises(ReplicaError, match="not computed"):
        replica.replay([[SAVE, 4, 0xABC]])
    with pytest.raises(ReplicaError, match="lacks"):
        replica.replay([[RESTORE, 4, 0xABC]])
    with pytest.raises(ReplicaError, match="pending"):
        replica.replay([[KEEP_PENDING, 4]])
    with pytest.raises(ReplicaError, match="cannot replay"):
        replica.replay([[99, 1]])
    state = ((mx.ones((1, 2)),),)
    replica.entry(4).state = state
    replica.replay([[PEND, 4, 0xD], [SAVE, 4, 0xE], [KEEP_PENDING, 4], [DROP, 0xE], [RESTORE, 5, 0xD], [CLEAR, 4]])
    assert set(replica.snapshots) == {0xD} and set(replica.entries) == {5}
    assert replica.entries[5].state is state


def test_a_follower_drops_what_the_pool_evicts_a_reset_forgets_and_an_abort_leaves_behind():
    """A pool of 13 usable blocks under sessions of 40 tokens: cached blocks carrying snapshots are evicted by
    the pool (their snapshots lost with them), a request is aborted while it decodes, and the prefix cache is
    reset; after every step the follower holds exactly the leader's states and snapshots."""
    leader, followers = _pair(num_blocks=14)
    pool = leader.kv.pool
    lost, on_lost = [], pool.on_restore_point_lost
    pool.on_restore_point_lost = lambda h: (lost.append(h), on_lost(h))
    rng = np.random.RandomState(9)
    for i in range(3):
        _run_checked(leader, followers, [request(f"evict{i}", rng.randint(100, VOCAB, size=40).tolist())])
    assert lost, "the pool never evicted a block that had a snapshot"
    leader.add_request(request("aborted", rng.randint(100, VOCAB, size=40).tolist()))
    while leader.scheduler.running == [] or leader.scheduler.running[0].num_output_tokens < 2:
        leader.step()
    leader.abort("aborted")
    _assert_alike(leader, followers)
    assert _state_group(followers.follower).replica.entries == {}
    leader.kv.reset_prefix_cache()
    _assert_alike(leader, followers)
    assert _state_group(followers.follower).replica.snapshots == {}


def test_the_leader_charges_each_snapshot_as_the_largest_ranks_share():
    """Pipeline ranks may hold different numbers of recurrent layers: the leader's snapshot budget counts each
    snapshot at the largest rank's bytes, so the rank holding more stays within its own budget."""
    leader, _ = _pair(num_blocks=96)
    group = _state_group(leader)
    own = group.entry_bytes()
    group.charge_entries(3 * own)
    _run_checked(leader, _, [request("charged", LONG[0])])
    snaps = group.snapshots
    assert len(snaps) > 0 and snaps.nbytes == len(snaps) * 3 * own
