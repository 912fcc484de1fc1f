"""Prefill and decode between workers of different shapes: a prefill worker that is a tensor-parallel group of
two ranks ships to a decode worker of one, a prefill worker of one to a decode group of two, a group of two to a
group of two with 8-bit KV, a pipeline-parallel group of two (each rank a layer) to a tensor-parallel group of
two, and a pipeline of three ranks of unequal layers (5 layers as 2, 2, 1) to a tensor-parallel group and back.
All answer greedy requests exactly as one engine alone does, and the decode group's second rank receives its
share of the KV (half the heads, or its layers), not the whole."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from benchmarks.cluster_procs import group_table, make_workers, run_cluster, topology_toml, worker_stats
from benchmarks.servers import free_ports
from tests.family_helpers import COMMON, CONFIGS, expected_kv_bytes_per_token
from tests.group_helpers import model_folder

MAX_TOKENS = 8
BLOCK = 8


def _prompts() -> list[list[int]]:
    rng = np.random.RandomState(5)
    return [rng.randint(100, COMMON["vocab_size"], size=n).tolist() for n in (200, 130, 77)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (folder, config): the llama and qwen3_moe test models (head_dim 16; qwen3_moe's class splits its
    layers), and the 2-layer stand-in (head_dim 64, which 8-bit KV quantizes in groups of 64)."""
    from benchmarks.reliability_long import fast_model_dir

    stand_in = fast_model_dir()
    folders = tmp_path_factory.mktemp("pd-models")
    return {"llama": (model_folder("llama", folders), {"model_type": "llama", **COMMON, **CONFIGS["llama"]}),
            "qwen3_moe": (model_folder("qwen3_moe", folders),
                          {"model_type": "qwen3_moe", **COMMON, **CONFIGS["qwen3_moe"]}),
            "qwen3_moe-5l": (model_folder("qwen3_moe", folders, layers=5),
                             {"model_type": "qwen3_moe", **COMMON, **CONFIGS["qwen3_moe"], "num_hidden_layers": 5}),
            "stand-in": (stand_in, json.loads((stand_in / "config.json").read_text()))}


def _alone(folder, kv_bits, kv_group_size):
    """One engine alone: each prompt's greedy text."""
    from cluster.config import EngineConfig
    from cluster.engine import EngineCore
    from cluster.model import load_model, read_model_spec
    from tests.engine_helpers import greedy, run

    model, tokenizer = load_model(folder, "float32")
    engine = EngineCore(model, tokenizer, read_model_spec(folder, "pd-test"),
                        EngineConfig(dtype="float32", num_blocks=256, block_size=BLOCK, kv_bits=kv_bits,
                                     kv_group_size=kv_group_size))
    out = run(engine, [greedy(f"p{i}", p, MAX_TOKENS, ignore_eos=True) for i, p in enumerate(_prompts())])
    return [out[f"p{i}"].text for i in range(len(_prompts()))]


# a shape: "one" process, "tpN" (tensor parallel over N ranks) or "ppN" (pipeline parallel over N ranks)
@pytest.mark.parametrize("model,prefill_shape,decode_shape,kv_bits",
                         [("llama", "tp2", "one", None), ("llama", "one", "tp2", None), ("stand-in", "tp2", "tp2", 8),
                          ("qwen3_moe", "pp2", "tp2", None), ("qwen3_moe-5l", "pp3", "tp2", None),
                          ("qwen3_moe-5l", "tp2", "pp3", None)],
                         ids=["tp2-to-one", "one-to-tp2", "tp2-to-tp2-8bit-kv", "pp2-to-tp2", "pp3-of-5-layers-to-tp2",
                              "tp2-to-pp3-of-5-layers"])
def test_prefill_and_decode_across_group_shapes(models, model, prefill_shape, decode_shape, kv_bits, tmp_path):
    folder, config = models[model]
    group_size = 64
    workers = make_workers([("prefill-0", "prefill", []), ("decode-0", "decode", [])])
    for w, shape in zip(workers, (prefill_shape, decode_shape)):
        if shape != "one":
            w["group"] = group_table(int(shape[2:]), parallel="pipeline" if shape.startswith("pp") else "tensor")
    router_port = free_ports(1)[0]
    topo = tmp_path / "topology.toml"
    topo.write_text(topology_toml(workers, router_port, model_source=str(folder),
                                  engine={"dtype": "float32", "num_blocks": 256, "block_size": BLOCK,
                                          "kv_group_size": group_size, **({"kv_bits": kv_bits} if kv_bits else {})},
                                  routing={"local_prefill_max_tokens": 0},
                                  # pipelines: 2-layer messages, some of whose layers a rank holds none of
                                  transfer={"layers_per_message": 2} if "pp3" in (prefill_shape, decode_shape) else {}))
    with run_cluster(workers, {"pd": str(topo)}, log_dir=str(tmp_path), deadline_s=240) as procs:
        url = procs["routers"]["pd"].url
        texts = []
        for p in _prompts():
            r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": folder.name, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        stats = worker_stats(workers)
    assert texts == _alone(folder, kv_bits, group_size)
    prefill, decode = stats["prefill-0"], stats["decode-0"]
    # every prompt was prefilled by the prefill worker and its KV moved, whole, over the transfer (8-bit KV:
    # a quarter of the float32 bytes, plus a float32 scale and bias per 64 values)
    per_token = expected_kv_bytes_per_token(config) * (1 if kv_bits is None else (1 / 4 + 2 / group_size))
    shipped = sum(-(-len(p) // BLOCK) * BLOCK for p in _prompts()) * per_token
    assert prefill["kv_bytes_sent"] == decode["kv_bytes_received"] == shipped
    shape = decode_shape if decode_shape != "one" else prefill_shape
    group = decode if decode_shape != "one" else prefill
    assert [r["rank"] for r in group["ranks"]] == list(range(int(shape[2:]))) and all(r["alive"] for r in group["ranks"])
    assert group["parallel"] == ("pipeline" if shape.startswith("pp") else "tensor")
    if decode_shape != "one":
        # the blocks arrived whole at rank 0, which handed each other rank its share plus the steps: half the
        # heads, or its layers (mlx-lm's split of 5 over 3: rank 1 two, rank 2 the first one)
        shares = {"tp2": [1 / 2], "pp3": [2 / 5, 1 / 5]}[decode_shape]
        for rank, share in enumerate(shares, start=1):
            sent = group["ranks"][rank]["step_bytes"]
            assert shipped * share <= sent < shipped * (share + 1 / 4), (rank, sent, shipped)
