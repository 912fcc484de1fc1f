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
                                   reference, reference_of, request, assert_matches, ReferenceDrafter)


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
    model the state snapshot at the last of them (`num_cached_tokens` is the whole-block prefix, so a
    disabled cache cannot pass), and both equal mlx-lm's generation, alone and beside a shorter prompt."""
    core = make_engine(model_type, enable_prefix_caching=True, prefill_chunk_size=7)
    long = np.random.RandomState(11).randint(100, VOCAB, size=45).tolist()
    want = reference(model_type, tuple(long))
    first = run(core, [request("cold", long)])["cold"]
    assert_matches(first, *want, f"{model_type}: cold, in 7-token chunks")
    assert first.outputs[-1].num_cached_tokens == 0
    results = run(core, [request("warm", long), request("beside", prompts()[1])])
    assert_matches(results["warm"], *want, f"{model_type}: after a prefix hit")
    assert results["warm"].outputs[-1].num_cached_tokens == (len(long) - 1) // 8 * 8
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


# -- through a prefill/decode transfer -----------------------------------------------------------------


@pytest.mark.parametrize("model_type", OTHER_LAYER_KINDS)
def test_other_layer_kinds_through_a_1p1d_transfer_match_mlx_lm(model_type, tmp_path):
    """A 45-token prompt (over five windows) prefilled by a prefill worker in 16-token chunks, its KV shipped
    to a decode worker in 8-token blocks (the prefill worker's sent-block count proves it crossed the wire),
    answers with mlx-lm's tokens and logprobs through the OpenAI completions endpoint."""
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
                         routing="local_prefill_max_tokens = 0") as (base, _, workers):
        r = httpx.post(base + "/v1/completions", timeout=300, json={
            "model": DEFAULT_MODEL, "prompt": long, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == tokenizer().decode(tokens)
        assert np.allclose(choice["logprobs"]["token_logprobs"], logprobs, atol=TOL, rtol=0)
        deadline = time.monotonic() + 60  # stats refresh between steps
        while workers["prefill-0"].stats()["kv_blocks_sent"] < len(long) // 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert workers["prefill-0"].stats()["kv_blocks_sent"] >= len(long) // 8
