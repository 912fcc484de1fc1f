"""Families with recurrent-state layers (qwen3_next's Gated DeltaNet beside attention, falcon_h1's Mamba and
attention in one layer) give exactly mlx-lm's own generation where padding, chunking and preemption could
corrupt a sequence's state; what the engine cannot yet do for them (prefix hits, draft rollback, moving the
state between workers) is refused or recomputed, never answered wrongly. Solo and batched generation is in
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
def test_with_the_prefix_cache_on_a_repeated_prompt_is_recomputed_exactly(model_type):
    """A prefix hit would skip tokens the recurrent state needs, so these models run without the prefix
    cache: the same prompt twice is computed twice (no cached tokens reported) and both answers are
    mlx-lm's."""
    core = make_engine(model_type, enable_prefix_caching=True)
    want = reference(model_type, tuple(LONG))
    for rid in ("first", "again"):
        result = run(core, [request(rid, LONG)])[rid]
        assert_matches(result, *want, f"{model_type}: {rid}")
        assert result.outputs[-1].num_cached_tokens == 0
    assert core.pool.num_cached_blocks == 0


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
