"""A worker group of two ranks, tensor or pipeline parallel, against mlx-lm's own generation split the same way on
the same ranks: greedy tokens equal and logprobs within 1e-3, for prompts run alone, together, again once their
blocks are cached (a recurrent state restored from a snapshot), and with drafts to verify (not for recurrent
layers, whose state cannot be rolled back); and each rank holding only its share of the weights, of the KV and of
a recurrent state (its heads, or its layers; a leader that ran the whole model would hold all of it)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.family_helpers import (COMMON, CONFIGS, NEW_TOKENS, TOL, expected_kv_bytes_per_token,
                                   expected_state_bytes_per_sequence)
from tests.group_helpers import model_config, model_folder, rank_parameter_bytes, run_group, run_reference

# tensor: dense attention, routed experts, latent attention (whose latent every rank keeps whole), and Gated
# DeltaNet beside attention (qwen3_5: each rank a share of the recurrent heads, the output head split by vocabulary);
# pipeline: the families whose mlx-lm class can split its layers, with routed experts, with a latent, and with
# recurrent layers (qwen3_next of 4 layers, DeltaNet and attention alternating: each rank holds one of each)
SPLITS = [("llama", "tensor", None), ("qwen3_moe", "tensor", None), ("deepseek_v3", "tensor", None),
          ("qwen3_5", "tensor", None), ("qwen3_moe", "pipeline", None), ("deepseek_v3", "pipeline", None),
          ("qwen3_next", "pipeline", 4)]


def _prompts() -> list[list[int]]:
    rng = np.random.RandomState(11)
    return [rng.randint(100, COMMON["vocab_size"], size=n).tolist() for n in (5, 19, 11, 26, 9, 17, 33, 3)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tmp_path_factory.mktemp("group-models")


@pytest.mark.parametrize("model_type,parallel,layers", SPLITS)
def test_group_of_two_equals_mlx_lm_split_the_same_way(model_type, parallel, layers, models, tmp_path):
    folder = model_folder(model_type, models, layers)
    prompts = _prompts()
    prompts_path = tmp_path / "prompts.json"
    prompts_path.write_text(json.dumps(prompts))
    refs = run_reference(folder, prompts_path, tmp_path / "reference.json", parallel=parallel)
    report = run_group(folder, prompts_path, tmp_path / "reference.json", tmp_path / "group.json", parallel)
    runs = report["runs"]
    n = len(prompts) // 2
    recurrent = model_type in ("qwen3_5", "qwen3_next")  # no speculation: a recurrent state cannot roll back
    expected = {**{f"solo{i}": refs[i] for i in range(n)}, **{f"batch{i}": refs[i] for i in range(n, 2 * n)},
                **{f"cached{i}": r for i, r in enumerate(refs)},
                **({} if recurrent else {f"spec{i}": r for i, r in enumerate(refs)})}
    got = {rid: r for run in runs.values() for rid, r in run.items()}
    assert set(got) == set(expected)
    for rid, ref in expected.items():
        assert len(ref["tokens"]) == NEW_TOKENS
        assert got[rid]["tokens"] == ref["tokens"], f"{model_type} {rid}"
        assert np.allclose(got[rid]["logprobs"], ref["logprobs"], atol=TOL, rtol=0), f"{model_type} {rid}"
    # the second run of every prompt reused its cached blocks (8-token blocks: at least every whole block
    # before the last position), and some reused the head of a block, which every rank copies (a model with
    # recurrent layers restores whole blocks only: a state is kept at block boundaries)
    cached = [runs["cached"][f"cached{i}"]["cached"] for i in range(len(prompts))]
    assert all((len(p) - 1) // 8 * 8 <= c <= len(p) - 1 for p, c in zip(prompts, cached)), cached
    assert any(c % 8 for c in cached) != recurrent, cached
    # each rank holds its share of the weights and of the KV, not the whole model
    config = model_config(model_type, layers)
    config = config.get("text_config", config)
    whole_kv = expected_kv_bytes_per_token(config) * 8 * report["num_blocks"]
    if parallel == "pipeline":  # one of the two layers each
        shares = [whole_kv // 2, whole_kv // 2]
    else:  # half the heads each; every rank keeps a latent whole
        shares = [whole_kv] * 2 if model_type == "deepseek_v3" else [whole_kv // 2] * 2
    for rank in (0, 1):
        memory = report["memory"][str(rank)]
        assert memory["parameter_bytes"] == rank_parameter_bytes(folder, rank, 2, parallel), f"rank {rank}'s weights"
        assert memory["parameter_bytes"] < rank_parameter_bytes(folder, 0, 1, parallel), f"rank {rank} holds it all"
        assert memory["kv_bytes"] == shares[rank], f"rank {rank}'s KV"
    assert report["forwards"] > 0 and report["bytes_sent"][0] > 0
    if recurrent:  # each rank's recurrent state is half the whole one (half the heads, or one of two layers),
        whole = expected_state_bytes_per_sequence(config)  # and so is each snapshot the leader kept
        assert [report["memory"][r]["entry_bytes"] for r in "01"] == [whole // 2] * 2
        (states,) = [g for g in report["kv_groups"] if g["entries"] is not None]
        assert states["restores"] > 0 and states["bytes_used"] == states["entries"] * whole // 2
        return
    # the drafts (mlx-lm's own tokens, proposed 3 at a time) were verified by the group, and accepted
    assert report["drafts"]["accepted"] > 0 and report["drafts"]["proposed"] >= report["drafts"]["accepted"]


def test_three_pipeline_ranks_of_unequal_layers_equal_mlx_lm_split_the_same_way(models, tmp_path):
    """5 layers over 3 ranks split as mlx-lm splits them (2, 2, 1; rank 2 the first layer): the ranks' pools,
    sized by bytes, agree on the fewest blocks any of them holds, and each holds its layers' KV of them."""
    folder = model_folder("qwen3_moe", models, layers=5)
    prompts = _prompts()
    prompts_path = tmp_path / "prompts.json"
    prompts_path.write_text(json.dumps(prompts))
    refs = run_reference(folder, prompts_path, tmp_path / "reference.json", size=3, parallel="pipeline")
    report = run_group(folder, prompts_path, tmp_path / "reference.json", tmp_path / "group.json", "pipeline", 3)
    n = len(prompts) // 2
    assert {rid for run in report["runs"].values() for rid in run} == {
        *(f"solo{i}" for i in range(n)), *(f"batch{i}" for i in range(n, 2 * n)),
        *(f"cached{i}" for i in range(2 * n)), *(f"spec{i}" for i in range(2 * n))}
    assert report["drafts"]["accepted"] > 0
    for run in report["runs"].values():
        for rid, got in run.items():
            ref = refs[int(rid.lstrip("solobatchcachedspec"))]
            assert got["tokens"] == ref["tokens"], rid
            assert np.allclose(got["logprobs"], ref["logprobs"], atol=TOL, rtol=0), rid
    config = {"model_type": "qwen3_moe", **COMMON, **CONFIGS["qwen3_moe"], "num_hidden_layers": 5}
    per_layer = expected_kv_bytes_per_token(config) // 5 * 8 * report["num_blocks"]
    for rank, layers in enumerate((2, 2, 1)):
        memory = report["memory"][str(rank)]
        assert memory["kv_bytes"] == per_layer * layers, f"rank {rank}'s KV"
        assert memory["parameter_bytes"] == rank_parameter_bytes(folder, rank, 3, "pipeline"), f"rank {rank}"
