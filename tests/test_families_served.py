"""Every model type the installed mlx-lm can load is served exactly or refused at load with a message that names
the missing layer kind or the reason; the families labs run today are served exactly alone, three at once,
after a prefix hit, across chunk boundaries and through a prefill/decode pair.

The models are tiny random-weight ones (tests/family_configs.py). "Served" means the structural gate admits the
model and its load check passes at the tests' tolerance: three prompts of different lengths batched on the paged
pool, a prefix hit reusing cached blocks, prompts crossing every block, prefill chunk and sliding window, each
generated token mlx-lm's greedy choice after the same tokens with its logprob within 1e-3.
"""

from __future__ import annotations

import functools
import json

import mlx.core as mx
import numpy as np
import pytest

import tests.family_configs as fc
from cluster.config import EngineConfig
from cluster.load_check import run_load_check
from cluster.model import read_model_spec
from cluster.model_families import FAMILIES, module_of
from tests.family_helpers import reference_of, tokenizer, write_config

TOL = 1e-3
CONFIG = EngineConfig(dtype="float32", block_size=8, kv_cache_gb=0.05)

# what is refused, and why (a regular expression of the message)
REFUSED = {
    "afm7": "a probe request failed on the paged path.*keys_and_values",  # reads its cache's arrays directly
    "deepseek_v32": "cache slot 0 keeps two KV caches",  # DeepSeek sparse attention's indexer keys
    "glm_moe_dsa": "cache slot 0 keeps two KV caches",
    "longcat_flash": "cache slot 0 keeps two KV caches",
    "longcat_flash_ngram": "cache slot 1 keeps two KV caches",
    "deepseek_v41": "cache slot 0 uses LayerCache, not a kind of KV the engine serves",
    "deepseek_v41_text": "cache slot 0 uses LayerCache, not a kind of KV the engine serves",
    "gemma3n": "runs its decoder layers and its output head in one call",
    "gpt_bigcode": "a probe request failed on the paged path",  # takes the cache's offset as one int
    "llama4": "chunked local attention",
    "minimax_m3_vl": "keeps a CacheList of KVCache",
    "phi-msft": "output head cannot be run apart from its body",
    "phixtral": "output head cannot be run apart from its body",
    "phi3small": "a probe request failed on the paged path.*broadcast",
    # mlx-lm's own forward differs between one call and the same prompt in chunks (its sliding-window cache)
    "plamo3": "probe prompt 0 .* on the paged path but .* in mlx-lm's own forward",
    "recurrent_gemma": "output head cannot be run apart from its body",
}
# the families labs run today, each served exactly in every setting below
LAB_FAMILIES = ["qwen3_5", "qwen3_5_moe", "gemma3", "gemma4_text", "gemma4", "glm4", "glm4_moe", "glm4_moe_lite",
                "kimi_k2", "kimi_k25", "kimi_linear", "minimax", "mistral3", "ministral3", "smollm3", "olmo3",
                "exaone4", "ernie4_5_moe", "seed_oss", "hunyuan_v1_dense", "bailing_moe", "apertus", "cohere2",
                "starcoder2", "nemotron_h", "granitemoehybrid", "lfm2", "lfm2_moe", "mamba2", "llama4_text"]


@functools.lru_cache(maxsize=2)
def loaded(model_type: str):
    """(model, spec) of the family's tiny model; the last two built are kept (a test module over 134 models must
    not hold them all)."""
    import tempfile
    from pathlib import Path

    folder = write_config(Path(tempfile.mkdtemp(prefix=f"served-{model_type}-")), fc.config(model_type))
    return fc.build(model_type), read_model_spec(folder, model_id=model_type)


def load_check(model_type: str, config: EngineConfig = CONFIG):
    model, spec = loaded(model_type)
    try:
        return run_load_check(model, tokenizer(), spec, config)
    finally:
        mx.clear_cache()  # the probe engine's pool and arrays go back to the system, not MLX's buffer cache


@pytest.mark.parametrize("model_type", fc.runnable_model_types())
def test_every_model_type_mlx_lm_can_load_is_served_or_refused_by_name(model_type, monkeypatch):
    """Each model type is either served (its structure known and its load check passing at 1e-3) or refused at
    load with the reason it is refused; the refused ones are exactly those listed here."""
    monkeypatch.setattr("cluster.load_check.tolerance", lambda dtype: TOL)
    if model_type in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[model_type]) as err:
            load_check(model_type)
        assert f"{model_type} model" in str(err.value)
    else:
        check = load_check(model_type)
        assert check.checks and dict(check.peak_blocks)


def test_model_types_that_cannot_be_built_here_are_known_to_the_config_gate():
    """The types without a tiny random-weight form (a module that exits the interpreter, a packed 2-bit format)
    or that need Metal still pass the config gate (mlx-lm has their class); the Mac runs them through the same
    gates."""
    for model_type in list(fc.CANNOT_BUILD) + list(fc.NEEDS_METAL):
        if model_type == "olmo":  # its module calls sys.exit at import without the ai2-olmo package
            continue
        assert module_of(model_type)


@pytest.mark.parametrize("model_type", LAB_FAMILIES)
def test_lab_families_are_exact_alone_batched_after_a_prefix_hit_and_across_chunks(model_type, monkeypatch):
    """Greedy generation of 32 tokens alone (at least 16 distinct) equals mlx-lm's own generation token for token
    with logprobs within 1e-3; the load check's batch of three prompts, its prefix hit (whole cached blocks, as
    `cached_tokens` reports) and its chunk and window crossings agree at 1e-3 as well."""
    from cluster.engine import EngineCore
    from cluster.request import GenerateRequest, SamplingParams
    from tests.engine_helpers import run

    monkeypatch.setattr("cluster.load_check.tolerance", lambda dtype: TOL)
    check = load_check(model_type)
    text = "; ".join(check.checks)
    assert "prefix hit reusing 16 tokens" in text and "8-token blocks, 8-token chunks" in text
    model, spec = loaded(model_type)
    prompt = np.random.RandomState(3).randint(100, fc.vocab_size(model_type), size=20).tolist()
    want, want_lps = reference_of(model, tuple(prompt), max_tokens=32)
    assert len(set(want)) >= 16
    engine = EngineCore(model, tokenizer(), spec, CONFIG, verified=check.verified)
    req = GenerateRequest(f"{model_type}-solo", tuple(prompt), SamplingParams(max_tokens=32, temperature=0.0,
                                                                              logprobs=0, ignore_eos=True))
    result = run(engine, [req])[req.request_id]
    assert result.token_ids == want
    assert np.allclose([lp.logprob for lp in result.logprobs], want_lps, atol=TOL, rtol=0)


def test_the_tested_families_are_the_labs_ones_and_the_earlier_fifteen():
    """The families whose load check may be skipped are exactly those the tests serve exactly in every setting:
    the earlier fifteen (tests/test_model_families.py) and the labs' ones here, by mlx-lm module."""
    from tests.family_helpers import CONFIGS

    assert set(FAMILIES) == {module_of(t) for t in list(CONFIGS) + LAB_FAMILIES}


def test_the_readme_lists_what_the_gate_serves_and_refuses():
    """The README's model list names every tested family and every refused model type, as these tests find
    them."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Models"):readme.index("## API")]
    for name in list(FAMILIES) + list(REFUSED):
        assert f"`{name}`" in section, name


@pytest.mark.parametrize("model_type", LAB_FAMILIES)
def test_lab_families_through_a_prefill_decode_pair_match_mlx_lm(model_type, tmp_path):
    """A 29-token prompt prefilled by a prefill worker in 16-token chunks, its KV (and recurrent state) shipped to
    a decode worker in 8-token blocks, answers with mlx-lm's greedy tokens and logprobs (1e-3) through the
    completions endpoint; the prefill worker's sent blocks (a model without attention: its sent state) prove
    it crossed the wire."""
    import time

    import httpx

    from cluster.model import DEFAULT_MODEL
    from tests.cluster_helpers import running_cluster

    model, _ = loaded(model_type)
    spec = read_model_spec(write_config(tmp_path, fc.config(model_type)), model_id=DEFAULT_MODEL)
    prompt = np.random.RandomState(11).randint(100, fc.vocab_size(model_type), size=29).tolist()
    want, want_lps = reference_of(model, tuple(prompt), max_tokens=6)
    engine = "block_size = 8\nprefill_chunk_size = 16"
    with running_cluster(1, 1, loaded=(model, tokenizer(), spec), engine=engine,
                         routing="local_prefill_max_tokens = 0") as (base, _, workers):
        r = httpx.post(base + "/v1/completions", timeout=300, json={
            "model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == tokenizer().decode(want)
        assert np.allclose(choice["logprobs"]["token_logprobs"], want_lps, atol=TOL, rtol=0)
        def moved() -> float:  # blocks sent, or for a model without attention the recurrent state's bytes
            stats = workers["prefill-0"].stats()
            if workers["prefill-0"].engine.runner.verified.kv_shapes:
                return stats.kv_blocks_sent
            return next((g.bytes_sent or 0 for g in stats.kv_groups if g.group == "recurrent"), 0)

        deadline = time.monotonic() + 60  # the worker's stats refresh between its steps
        while moved() < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert moved() >= 3


def test_configs_are_json_and_name_their_type():
    """Every tiny config writes as config.json and names its own model type (what `mlx-pd serve --model` reads)."""
    for model_type in fc.model_types():
        assert json.loads(json.dumps(fc.config(model_type)))["model_type"] == model_type
