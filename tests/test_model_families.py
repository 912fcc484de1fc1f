"""Every verified model family, served by the engine, gives exactly mlx-lm's own generation; every other
family is refused at load by name.

Each verified family is a small random-weight model built in code from mlx-lm's own classes (2 layers,
hidden size 64, 4 query heads over 2 KV heads, the SmolLM2 tokenizer's vocabulary), float32. The reference
is `mlx_lm.generate.generate_step` over mlx-lm's own KV cache. The engine runs each prompt alone and in
batches of 2, 3 and 4 prompts of different lengths (batch sizes below, equal to and above the KV head
count), and must give the same tokens and logprobs (within 1e-3).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.engine_helpers import run
from tests.family_helpers import (TOL, COMMON, CONFIGS, OTHER_LAYER_KINDS, RECURRENT, family, make_engine, engine,
                                   prompts, reference, request, assert_matches, batches,
                                   expected_kv_bytes_per_token)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_greedy_generation_matches_mlx_lm_alone_and_in_batches_of_every_size(model_type):
    """Greedy tokens and logprobs equal mlx-lm's own generation for each prompt alone and in batches of 2,
    3 and 4 prompts of different lengths (batched prefill and decode over the decode mirror)."""
    core, ps = engine(model_type), prompts()
    for n, batch in enumerate(batches()):
        reqs = [request(f"{model_type}-{n}-{i}", ps[i]) for i in batch]
        results = run(core, reqs)
        for i, r in zip(batch, reqs):
            assert_matches(results[r.request_id], *reference(model_type, tuple(ps[i])),
                           f"{model_type}: prompt {i} in a batch of {len(batch)}")


@pytest.mark.parametrize("model_type", ["gemma2", "llama", "qwen3_moe", *OTHER_LAYER_KINDS, *RECURRENT])
def test_batched_decode_that_gathers_from_the_pool_matches_mlx_lm(model_type):
    """With the decode mirror off, batched decode steps gather their contexts (another mask path) and still
    give mlx-lm's tokens and logprobs."""
    core, ps = make_engine(model_type, decode_mirror_gb=0.0), prompts()
    reqs = [request(f"gather-{i}", p) for i, p in enumerate(ps[:3])]
    results = run(core, reqs)
    for i, r in enumerate(reqs):
        assert_matches(results[r.request_id], *reference(model_type, tuple(ps[i])), f"{model_type}: prompt {i}")


@pytest.mark.parametrize("model_type", ["granite", "gemma2", "llama"])
def test_sampling_at_a_temperature_draws_from_the_models_own_head(model_type):
    """Seeded sampling at temperature 0.7 draws the same tokens as mlx-lm's generation with the engine's
    sampling rule over mlx-lm's own logits (so the temperature acts on the family's real head, scaling or
    soft-capping included), alone and in a batch; the reported logprobs are the model's own (log-softmax
    of the raw logits, temperature aside)."""
    core, ps = engine(model_type), prompts()
    seeds = [11, 12, 13]
    for batch in ([0], [0, 1, 2]):
        reqs = [request(f"temp-{len(batch)}-{i}", ps[i], temperature=0.7, seed=seeds[i]) for i in batch]
        results = run(core, reqs)
        for i, r in zip(batch, reqs):
            assert_matches(results[r.request_id], *reference(model_type, tuple(ps[i]), 0.7, seeds[i]),
                           f"{model_type}: sampled prompt {i} in a batch of {len(batch)}")


@pytest.mark.parametrize("model_type", ["granite", "gemma2", "phi3"])
def test_prompt_logprobs_use_the_same_head_on_every_row(model_type):
    """Prompt logprobs (logits on every prompt row, the rows speculative verification also uses) equal the
    log-softmax of mlx-lm's full forward pass over the prompt."""
    model, _ = family(model_type)
    core, ps = engine(model_type), prompts()
    reqs = [request(f"echo-{i}", p, prompt_logprobs=0) for i, p in enumerate(ps[:2])]
    results = run(core, reqs)
    for p, r in zip(ps, reqs):
        logits = model(mx.array([p]))[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        want = [lp[t, p[t + 1]].item() for t in range(len(p) - 1)]
        got = [e.logprob for e in results[r.request_id].outputs[0].prompt_logprobs]
        assert np.allclose(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("model_type", ["granite", "gemma2"])
def test_speculative_verification_keeps_mlx_lms_greedy_output(model_type):
    """Prompt-lookup speculation (drafts verified with logits on every fed row) gives mlx-lm's greedy tokens
    and logprobs, alone and batched with a plain request."""
    from decode_node.drafters import PromptLookupDrafter
    from decode_node.speculative import DecodeSpeculator

    core, ps = make_engine(model_type), prompts()
    core.speculator = DecodeSpeculator({"prompt_lookup": PromptLookupDrafter()}, core.config)
    looped = ps[0] * 4  # repeats, so prompt lookup proposes drafts
    reqs = [request("spec-0", looped, speculative_method="prompt_lookup", num_draft_tokens=3),
            request("spec-1", ps[1])]
    results = run(core, reqs)
    assert core.speculator.num_draft_tokens > 0
    for p, r in zip((looped, ps[1]), reqs):
        assert_matches(results[r.request_id], *reference(model_type, tuple(p)), f"{model_type}: {r.request_id}")


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_kv_bytes_per_token_measured_from_the_pool_equal_the_configs_formula(model_type):
    """The pool's arrays (what the KV budget and the wire count) hold exactly the bytes per token that the
    family's cache shapes give: measured from the allocated arrays, against a formula from config.json."""
    core = engine(model_type)
    config = {"model_type": model_type, **COMMON, **CONFIGS[model_type]}
    stores = [g.store for g in core.kv.block_groups]  # window layers: a pool of their own
    measured = sum(s.nbytes / (s.num_blocks * s.block_size) for s in stores)
    assert measured == expected_kv_bytes_per_token(config)
    assert core.spec.kv_bytes_per_token(4) == measured
