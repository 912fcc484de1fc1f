"""A worker group's rules, checked in this process without forming a collective: what the leader sends its
followers (every step message survives the wire, a recurrent state's entry named by its id and the leader's
changes to it carried once; a forward that could not be replayed on another rank is refused), the decode mirror key, the group's plan (a JSON round trip; each invalid field refused by name), which
models and kinds of parallelism a group refuses, how a pipeline's KV maps onto its ranks, the jaccl backend refused off macOS, the heartbeats (two ranks
see each other and what each reports; one that stops, or never starts, is lost), and a rank's memory budget."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import msgspec
import pytest

from cluster.config import EngineConfig
from cluster.kv.decode_mirror import DecodeMirror
from cluster.kv.state_replica import CLEAR
from cluster.memory_budget import GB, check_rank_memory, check_weights
from cluster.parallel import step_wire
from cluster.parallel.collective import check_parallel, check_tensor_parallel, join_group, ring_hostfile
from cluster.parallel.group_kv import KVShard
from cluster.parallel.heartbeat import Heartbeat
from cluster.parallel.spec import GroupPlan, RankAddress
from cluster.ports import free_ports
from cluster.runner import BatchItem, Logits

RANKS = (RankAddress("127.0.0.1", 7001, 7002, 7003), RankAddress("127.0.0.1", 7011, 7012, 7013))


# -- the step messages -------------------------------------------------------------------------------------------

def _groups():
    """A full-attention group and a recurrent-state group over a small pool (what the wire names of them)."""
    from cluster.kv.attention_groups import FullAttentionGroup
    from cluster.kv.block_pool import BlockPool
    from cluster.kv.snapshots import StateSnapshots
    from cluster.kv.state_group import RecurrentStateGroup

    pool = BlockPool(16, enable_caching=True, needs_restore_points=True)
    shapes = (((((3, 4), mx.float32),),))
    return FullAttentionGroup(pool, SimpleNamespace(block_size=8), (0,)), RecurrentStateGroup(shapes, pool, StateSnapshots(1 << 20, pool, 8))


def test_every_step_message_survives_the_wire_and_a_forward_gives_back_its_batch_items():
    leader, follower = _groups(), _groups()
    for g in leader:
        g.replicate()
    state = leader[1].new_entry()
    leader[1].free(state)  # a preemption: the follower drops what it holds of this entry
    items = [BatchItem([3, 4, 9], 17, [5], Logits.LAST, "req-a", ([3, 4, 9], state)),
             BatchItem([6], 0, [11, 12, 13], Logits.ALL, None, ([6], leader[1].new_entry())),
             BatchItem([7, 8], 40, [14, 15], Logits.NONE, None, ([7, 8], state))]
    forward = step_wire.to_wire(items, None, leader)
    assert forward.mirror_key == 0
    assert forward.replays == [[], [[CLEAR, state.id]]]
    assert step_wire.to_wire(items, None, leader).replays == []  # taken once
    got = step_wire.decode(step_wire.encode(forward))
    assert got == forward and isinstance(got, step_wire.Forward)
    back = step_wire.from_wire(got, follower)
    assert len(back) == len(items)
    for b, it in zip(back, items):
        assert (list(b.block_table), b.start, list(b.token_ids), b.logits, b.mirror_row) == (
            list(it.block_table), it.start, list(it.token_ids), it.logits, it.mirror_row)
        assert list(b.entries[0]) == list(it.entries[0])
        assert b.entries[1].id == it.entries[1].id and b.entries[1].state is None  # the follower's own entry
        assert b.inflight_request is None
    assert back[0].entries[1] is back[2].entries[1]  # one request, one entry, on the follower as on the leader
    for msg in (step_wire.CopyBlock(3, 8), step_wire.Hello(num_blocks=96, pool_bytes=1 << 20),
                step_wire.Stop("the leader stops")):
        again = step_wire.decode(step_wire.encode(msg))
        assert again == msg and type(again) is type(msg)
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        step_wire.decode(b"\x93not a step")


def test_a_forward_refuses_a_token_in_flight_on_the_leader():
    in_flight = BatchItem([1], 5, [], Logits.LAST, "r", (), inflight_request="r")
    with pytest.raises(ValueError, match="in flight"):
        step_wire.to_wire([in_flight], None)
    # one bad item refuses the whole forward, wherever it stands
    with pytest.raises(ValueError):
        step_wire.to_wire([BatchItem([2], 0, [3]), in_flight], None)


def test_the_mirror_key_is_zero_without_a_mirror_and_changes_with_its_rows_and_lengths():
    assert step_wire.mirror_key(None) == 0
    mirror = DecodeMirror(bytes_per_token=64, budget_bytes=1 << 30)
    assert step_wire.mirror_key(mirror) == 0  # empty
    mirror.plan(["a"], [[1]], [3], block_size=8)
    one_row = step_wire.mirror_key(mirror)
    assert one_row != 0
    mirror.plan(["a"], [[1]], [4], block_size=8)  # the next decode step: one token longer
    longer = step_wire.mirror_key(mirror)
    assert longer not in (0, one_row)
    mirror.plan(["a", "b"], [[1], [2]], [5, 2], block_size=8)  # a second row joins
    two_rows = step_wire.mirror_key(mirror)
    assert two_rows not in (0, one_row, longer)
    assert step_wire.to_wire([BatchItem([1], 5, [7], mirror_row="a")], mirror).mirror_key == two_rows
    mirror.reset()
    assert step_wire.mirror_key(mirror) == 0


# -- the plan -----------------------------------------------------------------------------------------------------

def test_a_plan_survives_its_json_with_every_field():
    plan = GroupPlan("tensor", "ring", RANKS, model="/models/m", served_name="m",
                     engine=EngineConfig(dtype="float32", kv_cache_gb=0.25, block_size=16, max_num_seqs=4),
                     heartbeat_s=0.2, deadline_s=3.0, memory_budget_gb=1.5)
    again = GroupPlan.from_json(plan.to_json())
    assert again == plan
    assert again.size == 2 and again.ranks[1].step_port == 7012
    assert ring_hostfile(again) == [["127.0.0.1:7001"], ["127.0.0.1:7011"]]
    assert GroupPlan.from_json(GroupPlan("tensor", "ring", RANKS).to_json()).memory_budget_gb is None


@pytest.mark.parametrize("change, field", [
    ({"parallel": "data"}, "parallel"),
    ({"backend": "mpi"}, "backend"),
    ({"ranks": RANKS[:1]}, "ranks"),
    ({"heartbeat_s": 0.0}, "heartbeat_s"),
    ({"heartbeat_s": 5.0, "deadline_s": 5.0}, "deadline_s"),
    ({"memory_budget_gb": 0.0}, "memory_budget_gb"),
    ({"memory_budget_gb": -2.0}, "memory_budget_gb"),
])
def test_a_plan_refuses_an_invalid_field_by_name(change, field):
    valid = GroupPlan("tensor", "ring", RANKS)
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(valid, **change)
    # a follower reading a plan file meets the same rule
    data = msgspec.json.decode(valid.to_json())
    data.update({k: ([dataclasses.asdict(r) for r in v] if k == "ranks" else v) for k, v in change.items()})
    with pytest.raises(ValueError, match=field):
        GroupPlan.from_json(msgspec.json.encode(data).decode())


# -- what a group refuses to run -------------------------------------------------------------------------------

def test_heads_that_do_not_split_across_the_ranks_are_refused_by_name():
    with pytest.raises(ValueError, match="num_attention_heads=9"):
        check_tensor_parallel({"num_attention_heads": 9, "num_key_value_heads": 3}, 2)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        check_tensor_parallel({"num_attention_heads": 6, "num_key_value_heads": 3}, 2)
    # a multimodal config's text model is what splits
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        check_tensor_parallel({"text_config": {"num_attention_heads": 4, "num_key_value_heads": 3}}, 2)
    check_tensor_parallel({"num_attention_heads": 4, "num_key_value_heads": 2}, 2)
    check_tensor_parallel({"num_attention_heads": 9, "num_key_value_heads": 3}, 3)
    # a Gated DeltaNet's heads split too, and qwen3_5's untied output head by vocabulary (llama's is whole)
    qwen3_5 = {"model_type": "qwen3_5", "tie_word_embeddings": False, "text_config": {
        "num_attention_heads": 4, "num_key_value_heads": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "vocab_size": 49152}}
    check_tensor_parallel(qwen3_5, 2)
    with pytest.raises(ValueError, match="linear_num_key_heads=1 "):
        check_tensor_parallel({**qwen3_5, "text_config": {**qwen3_5["text_config"], "linear_num_key_heads": 1}}, 2)
    with pytest.raises(ValueError, match="vocab_size=49153 .*by vocabulary"):
        check_tensor_parallel({**qwen3_5, "text_config": {**qwen3_5["text_config"], "vocab_size": 49153}}, 2)
    check_tensor_parallel({**qwen3_5, "tie_word_embeddings": True,
                           "text_config": {**qwen3_5["text_config"], "vocab_size": 49153}}, 2)
    check_tensor_parallel({"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2,
                           "vocab_size": 49153}, 2)


def test_a_pipeline_needs_a_layer_per_rank_and_not_heads_that_split():
    with pytest.raises(ValueError, match="num_hidden_layers=2 .* 3 pipeline ranks"):
        check_parallel({"num_hidden_layers": 2, "num_attention_heads": 4}, "pipeline", 3)
    # SmolLM2's 9 query and 3 KV heads do not split in two, its 30 layers do
    smol = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3}
    check_parallel(smol, "pipeline", 2)
    with pytest.raises(ValueError, match="num_attention_heads=9"):
        check_parallel(smol, "tensor", 2)
    with pytest.raises(ValueError, match="parallel='expert'.*'tensor' or 'pipeline'"):
        check_parallel(smol, "expert", 2)


def test_a_family_whose_mlx_lm_class_cannot_split_its_layers_is_refused_by_name(tmp_path):
    from cluster.model import load_sharded_model
    from tests.group_helpers import StandInGroup, model_folder

    from cluster.launch.local_group import local_plan
    from cluster.parallel.rank import check_group

    folder = model_folder("llama", tmp_path)
    with pytest.raises(ValueError, match="'llama' cannot run pipeline parallel.*--tensor-parallel N"):
        load_sharded_model(folder, StandInGroup(0, 2), parallel="pipeline")
    # what `serve --pipeline-parallel 2` checks before it starts any rank
    with pytest.raises(ValueError, match="'llama' cannot run pipeline parallel"):
        check_group(local_plan(2, str(folder), None, EngineConfig(), parallel="pipeline"))
    with pytest.raises(ValueError, match="num_hidden_layers=2 .* 3 pipeline ranks"):
        check_group(local_plan(3, str(model_folder("qwen3_moe", tmp_path)), None, EngineConfig(), parallel="pipeline"))
    assert check_group(local_plan(2, str(folder), None, EngineConfig()))["model_type"] == "llama"


def test_both_kinds_of_parallelism_at_once_are_refused_before_loading():
    from cluster.launch.single_node import start_single_node_engine

    with pytest.raises(ValueError, match="tensor_parallel and pipeline_parallel"):
        start_single_node_engine("no-such-model", tensor_parallel=2, pipeline_parallel=2)


def test_a_pipeline_shard_maps_the_whole_models_layers_to_each_ranks_pool():
    # 5 layers on 2 ranks as mlx-lm splits them: rank 1 the first 2, rank 0 the last 3
    shard = KVShard(0, 2, layer_counts=(3, 2))
    assert shard.num_layers(3) == 5
    assert shard.layers_of(1, range(0, 5)) == (range(0, 2), range(0, 2))
    assert shard.layers_of(0, range(0, 5)) == (range(2, 5), range(0, 3))
    assert shard.layers_of(0, range(1, 3)) == (range(2, 3), range(0, 1))
    assert shard.layers_of(0, range(0, 2)) == (range(0), range(0))
    whole = [np.arange(5 * 4 * 2 * 3, dtype=np.float32).reshape(5, 4, 2, 3)]  # [layers, slots, heads, d]
    local, share = shard.share(1, range(1, 4), [whole[0][1:4]])
    assert local == range(1, 2) and np.array_equal(share[0], whole[0][1:2])
    local, share = shard.share(0, range(1, 4), [whole[0][1:4]])
    assert local == range(0, 2) and np.array_equal(share[0], whole[0][2:4])
    # tensor parallel: every layer, half the heads
    heads = KVShard(1, 2, head_ranks=2)
    local, share = heads.share(1, range(0, 5), whole)
    assert local == range(0, 5) and np.array_equal(share[0], whole[0][:, :, 1:2])
    assert KVShard(0, 2).whole and not heads.whole and not shard.whole


@pytest.mark.skipif(sys.platform == "darwin", reason="jaccl may run on macOS")
def test_the_jaccl_backend_is_refused_off_macos_pointing_at_ring():
    plan = GroupPlan("tensor", "jaccl", RANKS)
    with pytest.raises(ValueError, match="jaccl") as err:
        join_group(plan, 0)
    assert "ring" in str(err.value)


# -- heartbeats ---------------------------------------------------------------------------------------------------

class LostRecorder:
    """An `on_lost` that records (rank, seconds silent) instead of ending the process."""

    def __init__(self):
        self.calls: list[tuple[int, float]] = []
        self.fired = threading.Event()

    def __call__(self, rank: int, silent_s: float) -> None:
        self.calls.append((rank, silent_s))
        self.fired.set()


def _wait_for(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_two_ranks_see_each_others_beats_and_the_one_left_loses_the_rank_that_stops():
    p0, p1 = free_ports(2)
    lost0, lost1 = LostRecorder(), LostRecorder()
    hb0 = Heartbeat("g", 0, f"tcp://127.0.0.1:{p0}", {1: f"tcp://127.0.0.1:{p1}"}, interval_s=0.05,
                    deadline_s=0.5, on_lost=lost0)
    hb1 = Heartbeat("g", 1, f"tcp://127.0.0.1:{p1}", {0: f"tcp://127.0.0.1:{p0}"}, interval_s=0.05,
                    deadline_s=0.5, on_lost=lost1)
    hb1.info = {"parameter_bytes": 1234, "kv_bytes": 56}
    try:
        hb0.start()
        hb1.start()
        assert _wait_for(lambda: hb0.ranks()[0]["alive"] and hb1.ranks()[0]["alive"], 10), (hb0.ranks(),
                                                                                            hb1.ranks())
        assert _wait_for(lambda: hb0.peer_info.get(1) == hb1.info, 5), hb0.peer_info
        (seen,) = hb0.ranks()
        assert seen["rank"] == 1 and seen["parameter_bytes"] == 1234 and seen["kv_bytes"] == 56
        assert seen["silent_s"] is not None and seen["silent_s"] <= 0.5
        assert hb1.ranks()[0]["rank"] == 0
        hb1.stop()  # a normal shutdown: rank 1 loses no one
        assert lost0.fired.wait(5), "rank 0 never noticed that rank 1 stopped beating"
        assert lost0.calls[0][0] == 1 and lost0.calls[0][1] > 0.5
        assert hb0.lost == 1
        assert not hb0.ranks()[0]["alive"]
        time.sleep(0.2)
        assert len(lost0.calls) == 1, "on_lost runs once"
        assert not lost1.calls
    finally:
        hb1.stop()
        hb0.stop()


def test_a_peer_never_heard_within_startup_is_lost():
    mine, silent = free_ports(2)  # nothing ever binds `silent`
    lost = LostRecorder()
    hb = Heartbeat("g", 0, f"tcp://127.0.0.1:{mine}", {3: f"tcp://127.0.0.1:{silent}"}, interval_s=0.05,
                   deadline_s=0.5, startup_s=0.3, on_lost=lost)
    try:
        hb.start()
        assert hb.ranks() == [{"rank": 3, "alive": False, "silent_s": None}]
        assert lost.fired.wait(5), "a rank that never beat was not lost"
        assert lost.calls[0][0] == 3 and lost.calls[0][1] > 0.3
        assert hb.lost == 3
    finally:
        hb.stop()


# -- a rank's memory budget ----------------------------------------------------------------------------------

class FakeModel:
    """What the budget checks read of a model: its parameters."""

    def __init__(self, **arrays):
        self.arrays = arrays

    def parameters(self):
        return {"layers": [{"w": a} for a in self.arrays.values()]}


def _fake_engine(*arrays, entry_bytes: int = 0, max_num_seqs: int = 4):
    """An engine of one KV cache group holding `arrays`, and `entry_bytes` per running request beside them."""
    group = SimpleNamespace(arrays=lambda: list(arrays), entry_bytes=lambda: entry_bytes,
                            reserved_bytes=lambda seqs: seqs * entry_bytes)
    return SimpleNamespace(kv=SimpleNamespace(groups=[group]), config=SimpleNamespace(max_num_seqs=max_num_seqs))


def test_weights_over_the_budget_are_refused_naming_memory_budget_gb():
    model = FakeModel(a=mx.zeros((256, 1024), mx.float32), b=mx.zeros((256,), mx.float16))  # 1 MiB + 512 B
    nbytes = 256 * 1024 * 4 + 256 * 2
    assert check_weights(model, 2 / 1024, "rank 1 of 2") == nbytes
    with pytest.raises(ValueError, match=r"rank 1 of 2: .*memory_budget_gb=0\.0009765625") as err:
        check_weights(model, 1 / 1024, "rank 1 of 2")
    assert "across more ranks" in str(err.value)


def test_a_rank_over_its_budget_once_built_is_refused_naming_memory_budget_gb():
    model = FakeModel(a=mx.ones((256, 1024), mx.float32))  # 1 MiB
    engine = _fake_engine(mx.ones((512, 1024), mx.float32), mx.ones((512, 1024), mx.float32))  # 4 MiB of KV
    mx.eval(model.arrays["a"], *engine.kv.groups[0].arrays())
    memory = check_rank_memory(model, engine, 1e6, "this rank")
    assert (memory.parameter_bytes, memory.kv_bytes) == (1 << 20, 4 << 20)
    assert memory.report() == {"parameter_bytes": 1 << 20, "kv_bytes": 4 << 20, "peak_bytes": memory.peak_bytes,
                               "entry_bytes": 0, "reserved_bytes": 0}
    # weights plus KV over the budget
    with pytest.raises(ValueError, match=r"this rank: weights .* plus KV .*memory_budget_gb=0\.00390625"):
        check_rank_memory(model, engine, 4 / 1024, "this rank")
    # within it by the pool, over it by the recurrent states the rank keeps beside the pool (4 requests of 1 MiB)
    states = _fake_engine(*engine.kv.groups[0].arrays(), entry_bytes=1 << 20)
    mx.reset_peak_memory()  # (what other tests left aside)
    assert check_rank_memory(model, states, 9.5 / 1024, "this rank").reserved_bytes == 4 << 20
    with pytest.raises(ValueError, match=r"plus KV \(0\.008 GB\)"):
        check_rank_memory(model, states, 8.5 / 1024, "this rank")
    # held within the budget, but MLX's peak (here a 64 MiB array made and dropped) over it
    mx.reset_peak_memory()
    big = mx.ones((16, 1 << 20), mx.float32)
    mx.eval(big)
    del big
    with pytest.raises(ValueError, match=r"peak .*memory_budget_gb=0\.03125"):
        check_rank_memory(model, engine, 32 / 1024, "this rank")
    assert mx.get_peak_memory() > 32 * GB / 1024


def test_a_pipeline_refuses_sliding_window_layers_by_name_and_tensor_parallelism_keeps_them():
    from cluster.model_structure import LayerKind, VerifiedModel
    from cluster.parallel.rank import _check_layers

    def verified(*windows):
        return VerifiedModel("ministral3", None, None, 4, False, tuple(LayerKind(kv=i, window=w)
                                                                       for i, w in enumerate(windows)))

    plan = GroupPlan("pipeline", "ring", RANKS)
    with pytest.raises(ValueError, match="m-1: a model with sliding-window layers .*--tensor-parallel N"):
        _check_layers(verified(512, None), plan, "m-1")
    _check_layers(verified(None, None), plan, "m-1")  # full attention only: each rank plans the same groups
    _check_layers(verified(512, None), dataclasses.replace(plan, parallel="tensor"), "m-1")


def test_recurrent_layers_are_served_by_a_group_in_one_process_and_refused_where_the_group_moves_kv():
    """A group of a model with recurrent layers serves in single-node mode; as a prefill or decode worker (a
    topology's group, which ships or receives KV) it is refused by name, since the state would have to travel
    between groups; pipeline ranks that would hold different kinds of layers are refused, naming each rank's."""
    from cluster.model_structure import LayerKind, VerifiedModel
    from cluster.parallel.rank import _check_layers
    from cluster.topology import WorkerGroup

    hybrid = VerifiedModel("qwen3_5", None, None, 4, False, (LayerKind(state=0), LayerKind(kv=0)),
                           state_shapes=((((3, 4), mx.float32),),))
    assert hybrid.cache_kinds == ("attention", "state")
    for parallel in ("tensor", "pipeline"):
        _check_layers(hybrid, GroupPlan(parallel, "ring", RANKS), "m-1", [["attention", "state"]] * 2)
    worker = WorkerGroup("tensor", "ring", RANKS).plan("m", None, EngineConfig())
    assert worker.moves_kv
    with pytest.raises(ValueError, match="m-1: a worker group of a model with recurrent layers serves in "
                                         "single-node mode only"):
        _check_layers(hybrid, worker, "m-1")
    _check_layers(dataclasses.replace(hybrid, layer_kinds=(LayerKind(kv=0),), state_shapes=()), worker, "m-1")
    with pytest.raises(ValueError, match=r"different kinds of layers \(rank 0: attention; rank 1: state\)"):
        _check_layers(hybrid, GroupPlan("pipeline", "ring", RANKS), "m-1", [["attention"], ["state"]])
