"""Families with recurrent-state layers (qwen3_next's Gated DeltaNet beside attention, falcon_h1's Mamba and
attention in one layer) give exactly mlx-lm's own generation where padding, chunking and preemption could
corrupt a sequence's state, and after prefix hits restored from state snapshots; what the engine cannot yet
do for them (draft rollback, moving the state between workers) is refused, never answered wrongly. Solo and batched generation is in
tests/test_model_families.py with every family."""

from __future__ import annotations


import numpy as np
import pytest

from cluster.kv.recurrent_state import state_nbytes
from tests.engine_helpers import run
from tests.family_helpers import (VOCAB, COMMON, CONFIGS, RECURRENT, family, make_engine, engine, prompts,
                                   reference, request, assert_matches, expected_state_bytes_per_sequence,
                                   assert_exact_under_preemption,
                                   ReferenceDrafter, tokenizer)

LONG = np.random.RandomState(11).randint(100, VOCAB, size=45).tolist()


@pytest.mark.parametrize("model_type", RECURRENT)
def test_state_bytes_per_sequence_equal_the_configs_formula(model_type):
    """The state each sequence carries (shapes read from mlx-lm at load) holds exactly the bytes a formula
    from config.json gives, and the layers are classified as the family's code builds them."""
    core = engine(model_type)
    config = {"model_type": model_type, **COMMON, **CONFIGS[model_type]}
    assert state_nbytes(core.kv.state_shapes()) == expected_state_bytes_per_sequence(config)
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
    assert_exact_under_preemption(model_type)


@pytest.mark.parametrize("model_type", RECURRENT)
def test_the_next_turn_of_a_conversation_restores_the_state_after_the_previous_answer(model_type):
    """Turn 2 is turn 1's prompt, its answer and new text: it restores the snapshot saved when turn 1
    finished (at position 48, inside the answer), so it recomputes neither the prompt nor the answer, and it
    gives mlx-lm's generation of the whole turn-2 prompt."""
    assert_next_turn_restores(make_engine(model_type, enable_prefix_caching=True), model_type, LONG, 48)


def assert_next_turn_restores(core, model_type: str, prompt: list[int], cached: int) -> None:
    """Run `prompt`, then its next turn (the prompt, the answer and 5 new tokens): the next turn takes
    `cached` tokens from the prefix cache and gives mlx-lm's generation."""
    first = run(core, [request("turn-1", prompt)])["turn-1"]
    follow_up = prompt + first.token_ids + np.random.RandomState(3).randint(100, VOCAB, size=5).tolist()
    second = run(core, [request("turn-2", follow_up)])["turn-2"]
    assert second.outputs[-1].num_cached_tokens == cached
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
    assert core.pool.num_cached_blocks > 0 and len(core.kv.groups[-1].snapshots) == 0


def _state(kib: int):
    import mlx.core as mx
    return ((mx.zeros((1, 256 * kib), mx.float32),),)


def _pool_with_snapshots(budget: int, num_blocks: int = 8):
    from cluster.kv.block_pool import BlockPool
    from cluster.kv.snapshots import StateSnapshots

    pool = BlockPool(num_blocks, needs_restore_points=True)
    return pool, StateSnapshots(budget, pool)


def test_snapshots_are_evicted_least_recently_used_within_a_byte_budget():
    """The budget is bytes, not a count: a fourth snapshot of 1 KiB in a 3 KiB budget evicts the least
    recently used (not the oldest one just read), and one larger than the budget is not kept; the pool's
    restore points follow (events of their own KV cache group), so an evicted snapshot is never counted on."""
    from cluster.kv.block_pool import RESTORE_POINT_GROUP

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
    kinds = [(e.kind, e.block_hashes) for e in pool.drain_events() if e.group == RESTORE_POINT_GROUP]
    assert ("removed", (2,)) in kinds and ("stored", (4,)) in kinds


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
def test_chunk_end_snapshots_are_thinned_to_doubling_intervals_when_the_sequence_finishes(model_type):
    """A 45-token prompt with a snapshot every 8 tokens saves snapshots at 8, 16, 24 and 32 (chunk ends), 40
    (its last whole block) and, as it finishes, 48 (the last whole block its answer reached): then the one
    at 24 (three intervals, not a power of two) is dropped, the rest stay. A prompt sharing its first 20
    tokens restores 16 of them (from the snapshot at 16), the same prompt again 40, and both answer as
    mlx-lm does."""
    core = make_engine(model_type, enable_prefix_caching=True, prefill_chunk_size=24, state_snapshot_interval=8)
    run(core, [request("turn", LONG)])
    snaps = core.kv.groups[-1].snapshots
    assert snaps.num_saved == 6 and len(snaps) == 5 and len(core.pool.restorable_hashes()) == 5
    shared = LONG[:20] + np.random.RandomState(8).randint(100, VOCAB, size=12).tolist()
    results = run(core, [request("shares-20", shared), request("again", LONG)])
    assert results["shares-20"].outputs[-1].num_cached_tokens == 16
    assert results["again"].outputs[-1].num_cached_tokens == 40
    assert_matches(results["shares-20"], *reference(model_type, tuple(shared)), f"{model_type}: shared prefix")
    assert_matches(results["again"], *reference(model_type, tuple(LONG)), f"{model_type}: after thinning")


@pytest.mark.parametrize("model_type", RECURRENT)
def test_a_prompt_ending_on_a_block_boundary_keeps_the_state_at_its_end_for_the_next_turn(model_type):
    """A 48-token prompt (six whole blocks) with a 6-token answer, which reaches no further block boundary:
    the snapshot at 48, the prompt's end, survives thinning beside the one at 40 (where a repeat of the
    prompt restores), so the next turn, the prompt plus the answer and new text, restores all 48 tokens and
    answers as mlx-lm does."""
    core = make_engine(model_type, enable_prefix_caching=True, prefill_chunk_size=24, state_snapshot_interval=8)
    assert_next_turn_restores(core, model_type, np.random.RandomState(12).randint(100, VOCAB, size=48).tolist(), 48)


@pytest.mark.parametrize("model_type", RECURRENT)
def test_speculative_decoding_is_refused_for_recurrent_models(model_type):
    """Rejected drafts are rolled back by lowering counters, which cannot undo a state update: installing a
    drafting speculator fails with a message that says what to change (flags or topology keys); a request
    asking for any method is refused with the reason and what to send instead."""
    from decode_node.speculative import DecodeSpeculator

    core = make_engine(model_type)
    with pytest.raises(ValueError, match="rolled back past rejected drafts.*--speculative-method.*topology"):
        core.speculator = DecodeSpeculator({"prompt_lookup": ReferenceDrafter({})}, core.config)
    for method in ("prompt_lookup", "draft_model"):
        with pytest.raises(ValueError, match=f"not available for {model_type}: its recurrent layers.*without "
                                             "`speculative`"):
            core.add_request(request("spec", prompts()[0], speculative_method=method, num_draft_tokens=3))


@pytest.mark.parametrize("model_type", RECURRENT)
def test_through_a_1p1d_transfer_the_state_crosses_the_wire_and_the_next_turn_reuses_both_caches(model_type, tmp_path):
    """A 45-token prompt prefilled by a prefill worker in 16-token chunks: its KV blocks and, after them, its
    recurrent state after the whole prompt cross the wire (the sent and received state bytes equal one
    sequence's state, so a decode worker that computed the prompt itself cannot pass), and the decode worker
    continues from them with mlx-lm's tokens and logprobs. Then two prompts at once, the conversation's next
    turn (the first prompt, its answer and new text) and an unrelated one: both equal mlx-lm's generation,
    the next turn restoring 40 tokens from the prefill worker's snapshot and the decode worker skipping the
    blocks it already holds; the router's /metrics shows the snapshots kept and restored."""
    import concurrent.futures
    import time

    import httpx

    from cluster.model import DEFAULT_MODEL, read_model_spec
    from tests.cluster_helpers import running_cluster
    from tests.family_helpers import NEW_TOKENS, TOL, write_config

    model, _ = family(model_type)
    config = {"model_type": model_type, **COMMON, **CONFIGS[model_type]}
    spec = read_model_spec(write_config(tmp_path, config), model_id=DEFAULT_MODEL)
    engine = "block_size = 8\nprefill_chunk_size = 16"

    def complete(base: str, prompt: list[int]) -> dict:
        r = httpx.post(base + "/v1/completions", timeout=300, json={
            "model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()

    def check(body: dict, prompt: list[int], what: str) -> None:
        tokens, logprobs = reference(model_type, tuple(prompt))
        choice = body["choices"][0]
        assert choice["text"] == tokenizer().decode(tokens), what
        assert np.allclose(choice["logprobs"]["token_logprobs"], logprobs, atol=TOL, rtol=0), what

    def figure(stats, key: str) -> float:
        """A report's field, or a "group.field" of one of its KV cache groups (0 when it has none)."""
        if "." not in key:
            return getattr(stats, key)
        group, field = key.split(".")
        return next((getattr(g, field) or 0 for g in stats.kv_groups if g.group == group), 0)

    def settled(workers, key: str, role: str, want: float) -> float:
        deadline = time.monotonic() + 60  # stats refresh between steps
        while figure(workers[role].stats(), key) < want and time.monotonic() < deadline:
            time.sleep(0.05)
        return figure(workers[role].stats(), key)

    with running_cluster(1, 1, loaded=(model, tokenizer(), spec), engine=engine,
                         routing="local_prefill_max_tokens = 0") as (base, client, workers):
        one_state = state_nbytes(workers["decode-0"].engine.kv.state_shapes())
        first = complete(base, LONG)
        check(first, LONG, f"{model_type}: 1P1D")
        assert settled(workers, "kv_blocks_sent", "prefill-0", 6) == 6  # ceil(45 / 8) blocks
        assert settled(workers, "kv_blocks_received", "decode-0", 6) == 6
        assert settled(workers, "recurrent.bytes_sent", "prefill-0", one_state) == one_state
        assert settled(workers, "recurrent.bytes_received", "decode-0", one_state) == one_state
        # the router counts the prefill worker's five blocks (its snapshot at position 40 restores them) and
        # none of the decode worker's, which holds the same five blocks but no snapshot to restore them with
        from cluster.request import GenerateRequest
        deadline, cached = time.monotonic() + 30, None
        while cached != {"prefill-0": 5} and time.monotonic() < deadline:
            time.sleep(0.05)
            cached = client.cached_blocks(GenerateRequest("probe", tuple(LONG + [5] * 40)))
        assert cached == {"prefill-0": 5}

        answer = tokenizer().encode(first["choices"][0]["text"], add_special_tokens=False)
        follow_up = LONG + answer + np.random.RandomState(3).randint(100, VOCAB, size=10).tolist()
        other = prompts()[1]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            turn2, beside = pool.map(lambda p: complete(base, p), [follow_up, other])
        check(turn2, follow_up, f"{model_type}: 1P1D, next turn")
        check(beside, other, f"{model_type}: 1P1D, beside the next turn")
        assert turn2["usage"]["prompt_tokens_details"]["cached_tokens"] >= 40
        sent = workers["prefill-0"].stats().kv_blocks_sent - 6
        assert sent < -(-len(follow_up) // 8) + -(-len(other) // 8)  # the decode worker held LONG's blocks
        assert settled(workers, "recurrent.bytes_received", "decode-0", 3 * one_state) == 3 * one_state
        deadline, metrics = time.monotonic() + 30, {}
        restores = 'mlx_pd_kv_group_restores_total{group="recurrent"}'
        while metrics.get(restores, 0) < 1 and time.monotonic() < deadline:  # the router learns stats from pings
            time.sleep(0.1)
            metrics = {line.split()[0]: float(line.split()[1]) for line in
                       httpx.get(base + "/metrics").text.splitlines()
                       if line.startswith("mlx_pd_kv_group_") and 'group="recurrent"' in line}
        assert metrics[restores] >= 1
        assert 0 < metrics['mlx_pd_kv_group_bytes{group="recurrent"}'] <= metrics[
            'mlx_pd_kv_group_budget_bytes{group="recurrent"}']


def test_the_state_crosses_the_wire_in_its_own_dtype_and_shape():
    """A `done` message carries each recurrent layer's arrays as frames named and shaped in its header
    (bfloat16 as 16-bit words, float32 as is): what arrives equals what was sent, bit for bit, in the same
    dtypes, grouped by layer as the format lists them."""
    import mlx.core as mx

    from kv_transfer.handshake import KVFormat, StateArray
    from kv_transfer.wire import Done, decode, encode, state_frames, state_from_frames, state_specs

    fmt = KVFormat.of_engine(engine("qwen3_next")).model_copy(update={"state": [
            [StateArray(dtype="bfloat16", shape=[3, 4]), StateArray(dtype="float32", shape=[2])],
            [StateArray(dtype="float32", shape=[5])]]})
    state = ((mx.random.normal((1, 3, 4)).astype(mx.bfloat16), mx.random.normal((1, 2))), (mx.arange(5.0)[None],))
    msg, arrays = decode(encode(Done(request_id="r", epoch=1, first_token=7, arrays=state_specs(fmt)),
                                state_frames(state)))
    assert [a.name for a in msg.arrays] == ["state.0.0", "state.0.1", "state.1.0"]
    back = state_from_frames(fmt, arrays)
    assert [[a.dtype for a in layer] for layer in back] == [[mx.bfloat16, mx.float32], [mx.float32]]
    for sent, got in zip([a for layer in state for a in layer], [a for layer in back for a in layer]):
        assert got.shape == sent.shape and mx.array_equal(got, sent).item()


def test_workers_whose_layer_kinds_differ_are_refused_at_the_handshake_by_name():
    """A receiver serving a model whose layers cache other kinds than the sender's (here a hybrid against an
    attention-only format of the same geometry) refuses the transfer naming layer_kinds and state."""
    from kv_transfer.handshake import KVFormat

    hybrid = KVFormat.of_engine(engine("qwen3_next"))
    plain = hybrid.model_copy(update={"layer_kinds": [], "state": []})
    diff = plain.mismatches(hybrid)
    assert [d.split(":")[0] for d in diff] == ["layer_kinds", "state"]
    assert "state + attention" not in diff[0] and "'state'" in diff[0] and "float32" in diff[1]
