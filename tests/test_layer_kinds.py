"""Families whose layers are not all plain full attention (sliding windows, attention sinks, latent
attention) give exactly mlx-lm's own generation: with draft verification, after a prefix-cache hit across
chunk boundaries, over quantized KV, and through a prefill/decode transfer."""

from __future__ import annotations

import numpy as np
import pytest

from cluster.config import EngineConfig
from cluster.engine import EngineCore
from cluster.model import read_model_spec
from tests.engine_helpers import run
from tests.family_helpers import (VOCAB, NEW_TOKENS, TOL, WINDOW, COMMON, CONFIGS, OTHER_LAYER_KINDS, RECURRENT,
                                   tokenizer, build, write_config, family, make_engine, engine, prompts,
                                   reference, reference_of, request, assert_matches, assert_exact_under_preemption,
                                   ReferenceDrafter)


@pytest.mark.parametrize("model_type", OTHER_LAYER_KINDS)
def test_draft_verification_over_other_layer_kinds_keeps_mlx_lms_greedy_output(model_type):
    """Draft verification feeds several rows per sequence through the sliding layers' windowed mask, or
    latent attention's prompt path (accepted and rejected drafts alike): tokens and logprobs stay mlx-lm's,
    for a prompt past the window batched with a shorter one."""
    from decode_node.speculative import DecodeSpeculator

    core, ps = make_engine(model_type), prompts()
    chosen = (ps[3], ps[0])
    refs = {tuple(p): reference(model_type, tuple(p)) for p in chosen}
    drafter = ReferenceDrafter({p: r[0] for p, r in refs.items()})
    core.speculator = DecodeSpeculator({"prompt_lookup": drafter}, core.config)
    reqs = [request(f"draft-{i}", p, speculative_method="prompt_lookup", num_draft_tokens=3)
            for i, p in enumerate(chosen)]
    results = run(core, reqs)
    assert core.speculator.num_draft_tokens > 0 and 0 < core.speculator.num_accepted_tokens
    for p, r in zip(chosen, reqs):
        assert_matches(results[r.request_id], *refs[tuple(p)], f"{model_type}: {r.request_id}")


@pytest.mark.parametrize("model_type", OTHER_LAYER_KINDS + RECURRENT)
def test_other_layer_kinds_after_a_prefix_hit_and_across_chunk_boundaries(model_type):
    """A 45-token prompt (over five windows) prefilled in 7-token chunks, so chunks start mid-block and
    mid-window (a recurrent model's chunks are cut back to block boundaries, where its state is saved), then
    the same prompt again: the second run restores its full blocks from the prefix cache, and a recurrent
    model the state snapshot at the last of them (`num_cached_tokens` is the whole-block prefix, or for
    full attention alone all but the last token, so a disabled cache cannot pass), and both equal mlx-lm's generation, alone and beside a shorter prompt."""
    core = make_engine(model_type, enable_prefix_caching=True, prefill_chunk_size=7)
    long = np.random.RandomState(11).randint(100, VOCAB, size=45).tolist()
    want = reference(model_type, tuple(long))
    first = run(core, [request("cold", long)])["cold"]
    assert_matches(first, *want, f"{model_type}: cold, in 7-token chunks")
    assert first.outputs[-1].num_cached_tokens == 0
    results = run(core, [request("warm", long), request("beside", prompts()[1])])
    assert_matches(results["warm"], *want, f"{model_type}: after a prefix hit")
    # window and recurrent families take whole blocks only; a model with full attention alone (latent, here)
    # also takes the head of the block after them, all but the last prompt token
    whole_blocks = model_type in ("gemma3_text", "gpt_oss") or model_type in RECURRENT
    assert results["warm"].outputs[-1].num_cached_tokens == ((len(long) - 1) // 8 * 8 if whole_blocks
                                                             else len(long) - 1)
    assert_matches(results["beside"], *reference(model_type, tuple(prompts()[1])), f"{model_type}: beside it")


@pytest.mark.parametrize("model_type", OTHER_LAYER_KINDS)
def test_other_layer_kinds_over_quantized_kv_stay_close_to_mlx_lm(model_type, tmp_path):
    """8-bit KV (group 32): the sliding layers' windowed mask applies over quantized blocks too; gpt_oss's
    attention sinks and latent attention compute over float K/V, so the engine dequantizes for them. The
    output stays within quantization error of mlx-lm's float generation (the first token equal, logprobs
    within 0.05)."""
    config = {"model_type": model_type, **COMMON, **CONFIGS[model_type], "head_dim": 32}
    if model_type == "deepseek_v3":  # both cached widths must hold whole quantization groups
        config["qk_rope_head_dim"] = 32
    model = build(model_type, config)
    spec = read_model_spec(write_config(tmp_path, config))
    core = EngineCore(model, tokenizer(), spec, EngineConfig(dtype="float32", num_blocks=32, block_size=8,
                                                             kv_bits=8, kv_group_size=32))
    assert core.store.dequantize_for_attention or model_type == "gemma3_text"
    long = prompts()[3]
    got = run(core, [request("q8", long)])["q8"]
    tokens, logprobs = reference_of(model, tuple(long))
    assert got.token_ids[0] == tokens[0]
    assert abs(got.logprobs[0].logprob - logprobs[0]) < 0.05


def test_a_llama_with_sliding_window_layers_matches_mlx_lm():
    """llama's `layer_types` with "sliding_attention" layers (mlx-lm gives them a RotatingKVCache): served,
    and every prompt, alone and in a batch of four, equals mlx-lm's generation past the window."""
    import tempfile
    from pathlib import Path

    config = {"model_type": "llama", **COMMON, **CONFIGS["llama"],
              "layer_types": ["sliding_attention", "full_attention"], "sliding_window": WINDOW}
    model = build("llama", config, seed=3)
    spec = read_model_spec(write_config(Path(tempfile.mkdtemp(prefix="family-llama-swa-")), config))
    core = EngineCore(model, tokenizer(), spec, EngineConfig(dtype="float32", num_blocks=96, block_size=8,
                                                             enable_prefix_caching=False))
    ps = prompts()
    for batch in ([1], [0, 1, 2, 3]):
        reqs = [request(f"swa-{len(batch)}-{i}", ps[i]) for i in batch]
        results = run(core, reqs)
        for i, r in zip(batch, reqs):
            assert_matches(results[r.request_id], *reference_of(model, tuple(ps[i])),
                           f"llama with a sliding layer: prompt {i} in a batch of {len(batch)}")


# -- the window layers' own pool --------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["gemma3_text", "gpt_oss"])
def test_window_layers_release_the_blocks_no_later_query_can_see(model_type):
    """A 45-token prompt (window 8, blocks of 8) decoding beside a short one: after every step each
    sequence's window-layer blocks before its next query's window are released (0 in its window table, back
    in the window pool) while its full-attention blocks all stay, and both answers are still mlx-lm's."""
    core = make_engine(model_type)
    windows = [w for w in core.runner.verified.layer_windows if w is not None]
    window_group = core.kv.groups[1]
    assert [g.name for g in core.kv.groups] == ["full", "sliding_window"] and window_group.window == max(windows)
    long = np.random.RandomState(11).randint(100, VOCAB, size=45).tolist()
    reqs = [request("long", long), request("short", prompts()[0])]
    results = {r.request_id: [] for r in reqs}
    for r in reqs:
        core.add_request(r)
    checked = 0
    while core.has_work():
        for out in core.step():
            results[out.request_id].append(out)
        live = list(core.sequences.values())
        for seq in live:
            table, window_table = core.kv.tables(seq.request_id)
            first = window_group.first_block(seq.num_computed_tokens)
            assert not any(window_table[:first]) and all(window_table[first:]), window_table
            assert all(table) and len(window_table) == len(table)
            checked += first > 0
        held = sum(1 for seq in live for b in core.kv.tables(seq.request_id)[1] if b)
        assert window_group.pool.num_free_blocks == window_group.pool.num_usable_blocks - held
    assert checked, "no step ran with a released window block"
    for r in reqs:
        tokens = tuple(t for out in results[r.request_id] for t in out.token_ids)
        assert list(tokens) == list(reference(model_type, tuple(r.prompt_token_ids))[0]), r.request_id


@pytest.mark.parametrize("model_type", ["gemma3_text", "gpt_oss"])
def test_preempted_sequences_free_and_retake_blocks_in_both_pools(model_type):
    """Seven usable 8-token blocks per pool for four 15-token prompts that grow into a third block while
    decoding: sequences are preempted (their full and window blocks freed) and recomputed, every answer is
    mlx-lm's, and both pools end with every block free."""
    core = assert_exact_under_preemption(model_type)
    for pool in (core.pool, core.kv.groups[1].pool):
        assert pool.num_free_blocks == pool.num_usable_blocks


def test_a_prefix_hit_needs_the_window_blocks_before_its_end_in_the_window_pool():
    """Five cached 4-token blocks, window 8: after the sequence's old window blocks were released and then
    evicted from the window pool, a prompt repeating all five still hits all five (the blocks its window
    needs, 3 and 4, are cached), but a prompt sharing only the first three hits nothing: its window's blocks
    (1 and 2) are gone, though the full-attention blocks are all still cached."""
    from types import SimpleNamespace

    from cluster.kv.attention_groups import FullAttentionGroup, SlidingWindowGroup
    from cluster.kv.block_pool import BlockPool
    from cluster.kv.manager import KVManager

    store = SimpleNamespace(block_size=4)
    window = SlidingWindowGroup(BlockPool(16), store, [1], 8)
    kv = KVManager([FullAttentionGroup(BlockPool(16), store, [0]), window], 4)
    tokens, hashes = list(range(20)), [100 + i for i in range(5)]
    kv.allocate("s", 5)
    kv.cache_blocks("s", 0, hashes, tokens, 99)
    kv.computed("s", 20, hashes, 20)
    window_table = kv.tables("s")[1]
    assert window_table[:3] == (0, 0, 0) and all(window_table[3:])
    kv.finish("s")
    window.pool.allocate(window.pool.num_free_blocks - 2)  # evicts every free window block but the last two
    hit = kv.lookup(hashes, tokens, 5)
    assert hit.num_blocks == 5 and hit.groups[1].blocks == (0, 0, 0) + window_table[3:]
    assert kv.lookup(hashes[:3], tokens, 3).num_blocks == 0
    assert kv.pool.find_cached_prefix(hashes[:3], tokens, 4) != []


def test_the_kv_budget_gives_the_window_pool_what_running_sequences_need_and_the_rest_to_full_layers():
    """gemma3_text's window of 1024 beside full layers, 16 running sequences of 2048-token chunks: the
    window pool gets twice their need, the main pool the rest of the budget, and together they stay inside
    it; a window as long as the context saves nothing (an even split)."""
    from cluster.kv.plan import pool_sizes, window_blocks_per_sequence

    need = window_blocks_per_sequence(1024, 16, 2048)
    assert need == (1024 + 2048) // 16 + 2
    budget, main_bytes, window_bytes = 8 * 2**30, 64 * 2**10, 5 * 64 * 2**10  # five window layers to one
    main, window = pool_sizes(budget, main_bytes, window_bytes, need, 16)
    assert window == 2 * 16 * need and main * main_bytes + window * window_bytes <= budget
    assert main > budget // (main_bytes + window_bytes)  # more full-layer blocks than an even split gives
    huge = window_blocks_per_sequence(131072, 16, 2048)
    assert pool_sizes(budget, main_bytes, window_bytes, huge, 16) == (budget // (6 * 64 * 2**10),) * 2


# -- through a prefill/decode transfer -----------------------------------------------------------------


@pytest.mark.parametrize("model_type", OTHER_LAYER_KINDS)
def test_other_layer_kinds_through_a_1p1d_transfer_match_mlx_lm(model_type, tmp_path):
    """A 45-token prompt (over five windows) prefilled by a prefill worker in 16-token chunks, its KV shipped
    to a decode worker in 8-token blocks (the prefill worker's sent-block count proves it crossed the wire;
    for sliding-window layers, only the two blocks inside the decode worker's first window move), answers
    with mlx-lm's tokens and logprobs through the OpenAI completions endpoint; sent again, only its last,
    partial block moves (the decode worker holds the five full ones, and their window blocks)."""
    import time

    import httpx

    from cluster.model import DEFAULT_MODEL
    from tests.cluster_helpers import running_cluster

    model, _ = family(model_type)
    config = {"model_type": model_type, **COMMON, **CONFIGS[model_type]}
    spec = read_model_spec(write_config(tmp_path, config), model_id=DEFAULT_MODEL)
    long = np.random.RandomState(11).randint(100, VOCAB, size=45).tolist()
    tokens, logprobs = reference(model_type, tuple(long))
    engine = "block_size = 8\nprefill_chunk_size = 16"
    with running_cluster(1, 1, loaded=(model, tokenizer(), spec), engine=engine,
                         routing="local_prefill_max_tokens = 0") as (base, client, workers):
        def complete_and_check() -> None:
            r = httpx.post(base + "/v1/completions", timeout=300, json={
                "model": DEFAULT_MODEL, "prompt": long, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["text"] == tokenizer().decode(tokens)
            assert np.allclose(choice["logprobs"]["token_logprobs"], logprobs, atol=TOL, rtol=0)

        def blocks_sent(want: int) -> float:
            deadline = time.monotonic() + 60  # stats refresh between steps
            while workers["prefill-0"].stats().kv_blocks_sent < want and time.monotonic() < deadline:
                time.sleep(0.05)
            return workers["prefill-0"].stats().kv_blocks_sent

        complete_and_check()
        assert blocks_sent(6) == 6
        assert workers["decode-0"].stats().kv_blocks_received == 6  # the decode worker took them in
        e = workers["prefill-0"].engine
        stores = [g.store for g in e.kv.block_groups]
        per_block = [s.nbytes // s.num_blocks for s in stores]
        if len(stores) > 1:  # window layers: only the blocks the next query can see (4 and 5) move
            assert workers["prefill-0"].stats().kv_bytes_sent == 6 * per_block[0] + 2 * per_block[1]
            # the router follows each worker's window pool (its snapshot, then its events of group 1)
            index = client.index
            deadline = time.monotonic() + 30
            while index.num_blocks("decode-0", 1) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            reach = {name: index.workers[name].groups[1].reach for name in ("decode-0", "prefill-0")}
            assert reach == {"decode-0": WINDOW - 1, "prefill-0": WINDOW - 1}  # a window's reach: window - 1
            assert index.num_blocks("decode-0", 1) == 2  # block 4 as received, block 5 filled by decoding
        sent = workers["prefill-0"].stats().kv_bytes_sent
        complete_and_check()  # again: the decode worker holds the first five blocks (and their window)
        assert blocks_sent(7) == 7
        assert workers["prefill-0"].stats().kv_bytes_sent - sent == sum(per_block)
