"""The load check: before a server says ready, a short probe through the engine's paged pool and through mlx-lm's
own cache path must agree; a model made wrong on purpose is refused at load naming where the paths part, and a
family nobody listed is served when its structure is known and the probe agrees."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import mlx.core as mx
import pytest

from cluster.config import EngineConfig
from cluster.load_check import LoadCheckError, checked_engine, run_load_check
from cluster.model_families import FAMILIES
from cluster.model_structure import verify_model
from tests.family_helpers import COMMON, CONFIGS, build, family, tokenizer, write_config

CONFIG = EngineConfig(dtype="float32", block_size=8, kv_cache_gb=0.05)


def test_the_probe_runs_on_the_paged_pool_crossing_blocks_chunks_and_the_window():
    """gemma3_text's probe holds blocks in both KV cache groups, reuses cached blocks for a prefix hit, and its
    longest prompt crosses the 8-position sliding window, 8-token blocks and chunks; the checks say so."""
    model, spec = family("gemma3_text")
    check = run_load_check(model, tokenizer(), spec, CONFIG)
    peak = dict(check.peak_blocks)
    assert peak["full"] >= 3 and peak["sliding_window"] >= 2
    text = "; ".join(check.checks)
    assert "window of 8 positions crossed" in text and "8-token blocks, 8-token chunks" in text
    assert "prefix hit reusing 16 tokens" in text and "output head equals the model's own call" in text


def test_a_mask_rank_declared_wrong_is_refused_at_load(monkeypatch):
    """gemma2 splits grouped queries into [B, kv_heads, repeats, T, L]: declared as taking a [B, 1, T, L] mask
    (a test double of its family entry), the probe's batch of three prompts fails and the model is refused."""
    model, spec = family("gemma2")
    monkeypatch.setitem(FAMILIES, "gemma2", dataclasses.replace(FAMILIES["gemma2"], mask_rank=4))
    with pytest.raises(LoadCheckError, match="gemma2 model: a probe request failed on the paged path.*broadcast"):
        run_load_check(model, tokenizer(), spec, CONFIG)


def test_an_unlisted_family_learns_its_mask_rank_from_the_probe(monkeypatch):
    """With gemma2 taken off the tested list, the probe finds that its batched mask has rank 5 and the engine
    built from the check serves with it."""
    model, spec = family("gemma2")
    monkeypatch.delitem(FAMILIES, "gemma2")
    check = run_load_check(model, tokenizer(), spec, CONFIG)
    assert check.verified.mask_rank == 5 and not check.verified.tested
    assert "batched mask of rank 5" in check.checks


def test_a_paged_path_that_parts_from_mlx_lm_is_refused_naming_the_layer_and_position(monkeypatch):
    """A llama whose second layer's attention drops the causal mask when the cache is not mlx-lm's own (made
    wrong on purpose) is refused at load: the message names layer 1 and position 0 of the prompt."""
    from mlx_lm.models import llama
    from mlx_lm.models.cache import KVCache

    model, spec = family("llama")
    target = model.model.layers[1].self_attn
    original = llama.Attention.__call__

    def unmasked(self, x, mask=None, cache=None):
        if self is target and not isinstance(cache, KVCache):
            mask = None
        return original(self, x, mask, cache)

    monkeypatch.setattr(llama.Attention, "__call__", unmasked)
    with pytest.raises(LoadCheckError, match="first part at layer 1, position 0"):
        run_load_check(model, tokenizer(), spec, CONFIG)


def test_a_head_that_reads_the_input_tokens_is_refused_before_the_probe(monkeypatch):
    """The engine applies the head to the body's output alone: a model whose own call also reads the input tokens
    after its body (a bonus on each input token's own logit, made up for this test) is refused at load, naming the head."""
    model, spec = family("qwen3")
    cls = type(model)

    class TokenBiased(cls):
        def __call__(self, inputs, cache=None, **kw):
            logits = cls.__call__(self, inputs, cache=cache, **kw)
            return logits + 2.0 * (mx.arange(logits.shape[-1]) == inputs[..., None])

    monkeypatch.setattr(model, "__class__", TokenBiased)
    with pytest.raises(LoadCheckError, match="qwen3 model: the output head found .* differs from the model's own"):
        run_load_check(model, tokenizer(), spec, CONFIG)


def test_skipping_the_check_applies_to_tested_families_only(monkeypatch):
    """`skip_load_check` skips the probe for a family the tests cover, and is ignored for any other family."""
    model, spec = family("llama")
    config = dataclasses.replace(CONFIG, skip_load_check=True)
    assert checked_engine(model, tokenizer(), spec, config).load_check.skipped
    monkeypatch.delitem(FAMILIES, "llama")
    check = checked_engine(model, tokenizer(), spec, config).load_check
    assert not check.skipped and check.checks


def test_an_unlisted_family_built_from_known_kinds_is_served(tmp_path):
    """stablelm (full attention, a partial rope, layer norms with biases) is on no list: its structure is known,
    the probe agrees, and the engine built from the check serves it."""
    import tests.family_configs as fc
    from cluster.model import read_model_spec

    model = fc.build("stablelm")
    spec = read_model_spec(write_config(tmp_path, fc.config("stablelm")))
    assert "stablelm" not in FAMILIES
    engine = checked_engine(model, tokenizer(), spec, CONFIG)
    assert not engine.load_check.skipped and not engine.runner.verified.tested
    assert engine.load_check.verified.mask_rank == 4


def test_a_length_dependent_rope_is_refused_with_the_reason():
    """Dynamic NTK rope's frequencies depend on the sequence's length: with one offset per row a batched step
    is not each row alone, so the model is refused at load with that reason."""
    model = build("llama", dict(COMMON, **CONFIGS["llama"], rope_scaling={"type": "dynamic", "factor": 2.0}))
    with pytest.raises(ValueError, match="rotary embedding DynamicNTKScalingRoPE.*offset per row"):
        verify_model(model)


# -- where users see it: GET /v1/models and `mlx-pd status` ----------------------------------------------------

def test_a_single_node_server_lists_the_checks_its_model_passed():
    """A server started as `mlx-pd serve --model` starts it (the random-weight fast model, a llama) shows in each
    model card of `GET /v1/models` and `GET /v1/models/{model}` its one worker's load check: the checks it
    passed, in the words the log gives, what it cost, and that it was not skipped."""
    import httpx

    from benchmarks.reliability_long import fast_model_dir
    from tests.live_server import live_model_server

    with live_model_server(fast_model_dir(), dtype="float32", kv_cache_gb=0.05) as (base, client):
        ran = client.worker.engine.load_check
        card = httpx.get(f"{base}/v1/models").json()["data"][0]
        assert card["load_checks"] == [{"worker": "engine", "model_type": "llama", "passed": list(ran.checks),
                                        "seconds": round(ran.seconds, 3), "skipped": False}]
        assert "output head equals the model's own call" in card["load_checks"][0]["passed"]
        assert any(c.startswith("prefix hit reusing") for c in card["load_checks"][0]["passed"])
        assert 0 < card["load_checks"][0]["seconds"] < 60
        assert httpx.get(f"{base}/v1/models/{card['id']}").json()["load_checks"] == card["load_checks"]


def test_a_skipped_check_shows_as_skipped_with_nothing_passed():
    """`--skip-load-check` on a tested family: the model card says the check was skipped and lists no check as
    passed (it proved nothing)."""
    import httpx

    from benchmarks.reliability_long import fast_model_dir
    from tests.live_server import live_model_server

    with live_model_server(fast_model_dir(), dtype="float32", kv_cache_gb=0.05, skip_load_check=True) as (base, _):
        checks = httpx.get(f"{base}/v1/models").json()["data"][0]["load_checks"]
    assert checks == [{"worker": "engine", "model_type": "llama", "passed": [], "seconds": 0.0, "skipped": True}]


@pytest.fixture(scope="module")
def cluster():
    """A prefill and a decode worker over the fast model, on threads of this process behind the router over
    ZeroMQ (tests/cluster_helpers.py); each worker ran its own load check as it started."""
    from tests.cluster_helpers import running_cluster
    from tests.engine_helpers import fast_model

    with running_cluster(loaded=fast_model(), engine="skip_load_check = false") as running:
        yield running


def test_a_cluster_router_lists_each_workers_load_check(cluster):
    """In cluster mode the router learns each worker's load check from its pongs over ZeroMQ and lists one per
    worker in the model card, in the topology's order, each with the checks that worker passed."""
    import httpx

    base, _, workers = cluster
    checks = httpx.get(f"{base}/v1/models").json()["data"][0]["load_checks"]
    assert [c["worker"] for c in checks] == ["prefill-0", "decode-0"]
    for c in checks:
        ran = workers[c["worker"]].engine.load_check
        assert c["passed"] == list(ran.checks) and c["model_type"] == "llama" and not c["skipped"]
        assert "output head equals the model's own call" in c["passed"]


def test_status_shows_each_workers_load_check(cluster, monkeypatch):
    """`mlx-pd status` reads each worker actor's report (what `WorkerActor.stats` returns: the worker's
    `stats().report()`, here of the running workers, Ray's calls stood in for) and prints one line per worker
    saying its load check: passed, in how long and which checks; a worker whose engine ran none says "not run",
    one that did not answer "unknown"."""
    import os

    import ray

    from cluster.launch import ray_up
    from cluster.launch.ray_driver import collect_status

    _, client, workers = cluster
    reports = {w.spec.actor_name: {**w.stats().report(), "pid": os.getpid()} for w in workers.values()}
    router = {"endpoint": "http://127.0.0.1:8000/v1", "healthy": True, "workers_alive": {}}

    def get_actor(name):  # a handle whose stats() (info() for the router) answers at once
        method = SimpleNamespace(remote=lambda: reports.get(name, router))
        return SimpleNamespace(stats=method, info=method)

    monkeypatch.setattr(ray, "get_actor", get_actor)
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    topology = client.topology
    actors = {name: {"state": "ALIVE"} for name in [ray_up.router_actor_name(topology), *reports]}
    text = ray_up.format_status(collect_status(topology, actors, 5.0, ""))
    for w in workers.values():
        line = next(ln for ln in text.splitlines() if ln.startswith(f"{w.spec.actor_name}: load check"))
        assert line.startswith(f"{w.spec.actor_name}: load check passed for llama in ")
        assert line.endswith(": " + "; ".join(w.engine.load_check.checks)), line

    decode = next(w for w in workers.values() if w.role == "decode").spec.actor_name
    reports[decode]["load_check"] = None  # an engine built without a check
    del actors[next(w for w in workers.values() if w.role == "prefill").spec.actor_name]  # no such actor
    text = ray_up.format_status(collect_status(topology, actors, 5.0, ""))
    assert f"{decode}: load check not run" in text.splitlines()
    assert any(ln.endswith(": load check unknown (no report)") for ln in text.splitlines())


@pytest.mark.parametrize("model_type", ["gemma3_text", "gpt_oss"])
def test_a_long_window_is_shrunk_so_the_probe_crosses_it(model_type, tmp_path):
    """A sliding window of 4,096 positions (longer than the probe crosses itself) is shrunk on the model for the probe
    (the body and its caches read the same attribute), the probe crosses the shrunk window on the paged pool, and
    afterwards the model has its own window again."""
    from cluster.model import read_model_spec

    config = {"model_type": model_type, **COMMON, **CONFIGS[model_type], "sliding_window": 4096}
    model = build(model_type, config)
    spec = read_model_spec(write_config(tmp_path, config))
    check = run_load_check(model, tokenizer(), spec, CONFIG)
    assert "window of 4096 positions shrunk to 12 for the probe" in check.checks
    assert "window of 12 positions crossed" in check.checks
    assert dict(check.peak_blocks)["sliding_window"] >= 2
    assert verify_model(model).layer_windows.count(4096) == 1 and check.verified.layer_windows == (4096, None)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_check_passes_on_quantized_weights(bits, tmp_path):
    """A llama whose weights are quantized as mlx-lm's converter does (every linear and the embedding, groups of 32)
    passes the load check in float32: the paged path and mlx-lm's own run the same quantized weights."""
    import mlx.nn as nn

    from cluster.model import read_model_spec

    config = {"model_type": "llama", **COMMON, **CONFIGS["llama"]}
    model = build("llama", config)
    nn.quantize(model, group_size=32, bits=bits)
    spec = read_model_spec(write_config(tmp_path, config))
    check = run_load_check(model, tokenizer(), spec, CONFIG)
    assert "prefix hit reusing 16 tokens" in "; ".join(check.checks)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_server_with_quantized_kv_passes_the_check(bits, tmp_path):
    """A server started with 4- or 8-bit KV passes the load check: the probe proves the paged path with float KV,
    the one mlx-lm's own forward keeps (quantized KV read back across chunks differs from it by design)."""
    from cluster.model import read_model_spec

    config = {"model_type": "llama", **COMMON, **CONFIGS["llama"], "head_dim": 64}
    model = build("llama", config)
    spec = read_model_spec(write_config(tmp_path, config))
    check = run_load_check(model, tokenizer(), spec, dataclasses.replace(CONFIG, kv_bits=bits, kv_group_size=64))
    assert "prefix hit reusing 16 tokens" in "; ".join(check.checks)
