"""Families with recurrent-state layers (qwen3_next's Gated DeltaNet beside attention, falcon_h1's Mamba and
attention in one layer) give exactly mlx-lm's own generation where padding, chunking and preemption could
corrupt a sequence's state, and after prefix hits restored from state snapshots; what the engine cannot yet
do for them (draft rollback, moving the state between workers) is refused, never answered wrongly. Solo and batched generation is in
tests/test_model_families.py with every family."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cluster.model_families import FAMILIES, verify_model
from cluster.recurrent_state import state_nbytes
from tests.engine_helpers import run
from tests.family_helpers import (VOCAB, COMMON, CONFIGS, RECURRENT, family, make_engine, engine, prompts,
                                   reference, request, assert_matches, expected_state_bytes_per_sequence,
                                   ReferenceDrafter, tokenizer)

LONG = np.random.RandomState(11).randint(100, VOCAB, size=45).tolist()


@pytest.mark.parametrize("model_type", RECURRENT)
def test_state_bytes_per_sequence_equal_the_configs_formula(model_type):
    """The state each sequence carries (shapes read from mlx-lm at load) holds exactly the bytes a formula
    from config.json gives, and the layers are classified as the family's code builds them."""
    core = engine(model_type)
    config = {"model_type": model_type, **COMMON, **CONFIGS[model_type]}
    assert state_nbytes(core.runner.state_shapes) == expected_state_bytes_per_sequence(config)
    kinds = core.runner.verified.layer_kinds
    if model_type == "qwen3_next":  # layer 0 Gated DeltaNet only, layer 1 attention only
        assert [(k.kv, k.state) for k in kinds] == [(None, 0), (0, None)]
    else:  # both layers carry Mamba state and KV
        assert [(k.kv, k.state) for k in kinds] == [(0, 0), (1, 1)]


@pytest.mark.parametrize("model_type", RECURRENT)
def test_recurrent_state_survives_chunk_boundaries_beside_other_prompts(model_type):
    """A 45-token prompt prefilled in 7-token chunks (each chunk continues the state the last one left),
    batched with shorter prompts whose chunks end first (padded rows in the same steps), then decoded beside
    them: every prompt gives mlx-lm's tokens and logprobs."""
    core = make_engine(model_type, prefill_chunk_size=21)
    chosen = [LONG, prompts()[0], prompts()[2]]
    reqs = [request(f"chunked-{i}", p) for i, p in enumerate(chosen)]
    results = run(core, reqs)
    for p, r in zip(chosen, reqs):
        assert_matches(results[r.request_id], *reference(model_type, tuple(p)), f"{model_type}: {r.request_id}")
    assert not core.sequences


@pytest.mark.parametrize("model_type", RECURRENT)
def test_a_preempted_sequence_recomputes_its_state_from_scratch(model_type):
    """Seven usable 8-token blocks for four 15-token prompts that grow into a third block while decoding:
    sequences are preempted mid-generation and each is recomputed from its first token with a fresh state
    (not the state it had reached), so every answer is still mlx-lm's."""
    core = make_engine(model_type, num_blocks=8)
    ps = np.random.RandomState(5).randint(100, VOCAB, size=(4, 15)).tolist()
    reqs = [request(f"preempt-{i}", p) for i, p in enumerate(ps)]
    results = run(core, reqs)
    assert core.scheduler.num_preemptions > 0
    for p, r in zip(ps, reqs):
        assert_matches(results[r.request_id], *reference(model_type, tuple(p)), f"{model_type}: {r.request_id}")


@pytest.mark.parametrize("model_type", RECURRENT)
def test_a_prefix_hit_restores_the_state_snapshot_at_the_prompts_last_whole_block(model_type):
    """The same 45-token prompt twice (21-token chunks, cut back to 16 so they end on block boundaries): the
    second run takes 40 tokens from the prefix cache (the KV blocks and the state snapshot at the prompt's
    last whole block), so a cache that restored nothing cannot pass, and both answers are mlx-lm's, the warm
    one beside a cold prompt in the same steps."""
    core = make_engine(model_type, enable_prefix_caching=True, prefill_chunk_size=21)
    want = reference(model_type, tuple(LONG))
    cold = run(core, [request("cold", LONG)])["cold"]
    assert_matches(cold, *want, f"{model_type}: cold")
    assert cold.outputs[-1].num_cached_tokens == 0
    results = run(core, [request("warm", LONG), request("beside", prompts()[1])])
    assert_matches(results["warm"], *want, f"{model_type}: after a prefix hit")
    assert results["warm"].outputs[-1].num_cached_tokens == 40
    assert_matches(results["beside"], *reference(model_type, tuple(prompts()[1])), f"{model_type}: beside it")


@pytest.mark.parametrize("model_type", RECURRENT)
def test_the_next_turn_of_a_conversation_restores_the_state_after_the_previous_answer(model_type):
    """Turn 2 is turn 1's prompt, its answer and new text: it restores the snapshot saved when turn 1
    finished (at position 48, inside the answer), so it recomputes neither the prompt nor the answer, and it
    gives mlx-lm's generation of the whole turn-2 prompt."""
    core = make_engine(model_type, enable_prefix_caching=True)
    first = run(core, [request("turn-1", LONG)])["turn-1"]
    follow_up = LONG + first.token_ids + np.random.RandomState(3).randint(100, VOCAB, size=10).tolist()
    second = run(core, [request("turn-2", follow_up)])["turn-2"]
    assert second.outputs[-1].num_cached_tokens == 48
    assert_matches(second, *reference(model_type, tuple(follow_up)), f"{model_type}: turn 2")


@pytest.mark.parametrize("model_type", RECURRENT)
def test_without_a_snapshot_budget_a_repeated_prompt_is_recomputed_exactly(model_type):
    """state_cache_gb = 0 keeps no snapshot: a KV prefix hit alone cannot restore the state, so the repeat
    is computed in full (no cached tokens) and still equals mlx-lm's generation."""
    core = make_engine(model_type, enable_prefix_caching=True, state_cache_gb=0.0)
    want = reference(model_type, tuple(LONG))
    for rid in ("first", "again"):
        result = run(core, [request(rid, LONG)])[rid]
        assert_matches(result, *want, f"{model_type}: {rid}")
        assert result.outputs[-1].num_cached_tokens == 0
    assert core.pool.num_cached_blocks > 0 and len(core.scheduler.snapshots) == 0


def _state(kib: int):
    import mlx.core as mx
    return ((mx.zeros((1, 256 * kib), mx.float32),),)


def _pool_with_snapshots(budget: int, num_blocks: int = 8):
    from cluster.block_pool import BlockPool
    from cluster.state_snapshots import StateSnapshots

    pool = BlockPool(num_blocks, needs_restore_points=True)
    return pool, StateSnapshots(budget, pool)


def test_snapshots_are_evicted_least_recently_used_within_a_byte_budget():
    """The budget is bytes, not a count: a fourth snapshot of 1 KiB in a 3 KiB budget evicts the least
    recently used (not the oldest one just read), and one larger than the budget is not kept; the pool's
    restore points follow, so an evicted snapshot is never counted on."""
    pool, snaps = _pool_with_snapshots(3 * 1024)
    blocks = pool.allocate(5)
    for i, block_id in enumerate(blocks, start=1):
        pool.cache_block(block_id, i, (i,))
    for h in (1, 2, 3):
        assert snaps.put(h, _state(1))
    assert snaps.get(1) is not None  # 2 is now the least recently used
    assert snaps.put(4, _state(1))
    assert 2 not in snaps and {1, 3, 4} <= {h for h in (1, 2, 3, 4) if h in snaps}
    assert snaps.nbytes == 3 * 1024 and snaps.num_evicted == 1
    assert sorted(pool.restorable_hashes()) == [1, 3, 4]
    assert not snaps.put(5, _state(4)) and 5 not in snaps and snaps.nbytes == 3 * 1024
    assert not snaps.put(99, _state(1)), "a snapshot needs its block in the prefix cache"
    kinds = [(e.kind, e.block_hashes) for e in pool.drain_events() if e.kind.endswith("restorable")]
    assert ("unrestorable", (2,)) in kinds and ("restorable", (4,)) in kinds


def test_a_prefix_hit_is_cut_back_to_the_last_block_with_a_snapshot_and_dies_with_its_block():
    """Four cached blocks with a snapshot after the second: a lookup of all four finds two (the state after
    the third and fourth cannot be restored); when the pool evicts the second block for a new allocation,
    its snapshot goes with it (bytes returned, no restore point, no hit)."""
    pool, snaps = _pool_with_snapshots(1 << 20, num_blocks=5)
    table = pool.allocate(4)
    tokens = list(range(8))
    for i, block_id in enumerate(table):
        pool.cache_block(block_id, 100 + i, tokens[2 * i:2 * i + 2])
    assert snaps.put(101, _state(1))
    assert pool.find_cached_prefix([100, 101, 102, 103], tokens, 2) == table[:2]
    pool.free(table)
    pool.allocate(4)  # every free block is taken: their hashes are evicted
    assert 101 not in snaps and snaps.nbytes == 0 and pool.restorable_hashes() == []
    assert pool.find_cached_prefix([100, 101], tokens, 2) == []


@pytest.mark.parametrize("model_type", RECURRENT)
def test_chunk_end_snapshots_are_thinned_when_the_sequence_finishes(model_type):
    """A 45-token prompt in 16-token chunks saves snapshots at 16 and 32 (chunk ends), 40 (its last whole
    block) and, when it finishes, 56 (its answer's last whole block): the chunk-end ones are dropped then,
    so a long conversation keeps two per turn; the next request restores from 40 and answers as mlx-lm."""
    core = make_engine(model_type, enable_prefix_caching=True, prefill_chunk_size=16)
    run(core, [request("turn", LONG)])
    snaps = core.scheduler.snapshots
    assert snaps.num_saved == 4 and len(snaps) == 2
    assert len(core.pool.restorable_hashes()) == 2
    again = run(core, [request("again", LONG)])["again"]
    assert again.outputs[-1].num_cached_tokens == 40
    assert_matches(again, *reference(model_type, tuple(LONG)), f"{model_type}: after thinning")


@pytest.mark.parametrize("model_type", RECURRENT)
def test_speculative_decoding_is_refused_for_recurrent_models(model_type):
    """Rejected drafts are rolled back by lowering counters, which cannot undo a state update: installing a
    drafting speculator fails with a message that says what to change; requests asking for a method are
    refused as for any server without one."""
    from decode_node.speculative import DecodeSpeculator

    core = make_engine(model_type)
    with pytest.raises(ValueError, match="recurrent layers' state cannot be rolled back.*without --speculative"):
        core.speculator = DecodeSpeculator({"prompt_lookup": ReferenceDrafter({})}, core.config)
    with pytest.raises(ValueError, match="speculative method 'prompt_lookup' is not available"):
        core.add_request(request("spec", prompts()[0], speculative_method="prompt_lookup", num_draft_tokens=3))


def test_a_disaggregated_topology_refuses_a_recurrent_model_by_name(tmp_path):
    """The KV transfer carries no recurrent state, so a worker of a topology with prefill workers refuses a
    recurrent model when it starts, naming the model type and what to run instead."""
    from cluster.launch.workers import make_worker
    from cluster.model import read_model_spec
    from cluster.topology import parse_topology
    from tests.cluster_helpers import topology_text
    from tests.family_helpers import write_config

    model, _ = family("qwen3_next")
    config = {"model_type": "qwen3_next", **COMMON, **CONFIGS["qwen3_next"]}
    spec = read_model_spec(write_config(tmp_path, config))
    topology = parse_topology(topology_text(1, 1, engine="block_size = 8"), name="hybrid")
    for name in ("prefill-0", "decode-0"):
        worker = make_worker(topology, name, loaded=(model, tokenizer(), spec))
        with pytest.raises(ValueError, match="qwen3_next has recurrent layers.*decode workers only"):
            worker.start()
        worker.stop()


def test_recurrent_layers_in_a_family_not_read_for_them_are_refused(monkeypatch):
    """The gate serves recurrent state only in families whose layers were read to keep padding out of it:
    with that mark taken off qwen3_next, its Gated DeltaNet layer is refused by layer and cache type."""
    model, _ = family("qwen3_next")
    monkeypatch.setitem(FAMILIES, "qwen3_next", dataclasses.replace(FAMILIES["qwen3_next"], recurrent=False))
    with pytest.raises(ValueError, match="layer 0 uses ArraysCache"):
        verify_model(model)
