"""The structural gate: a model type mlx-lm has no class for, a cache kind the KV wing has no group for and a
rotary embedding that depends on more than the position are refused at load by name."""

from __future__ import annotations

import pytest

from cluster.config import EngineConfig
from cluster.engine import EngineCore
from cluster.model import read_model_spec
from tests.family_helpers import WINDOW, COMMON, CONFIGS, tokenizer, build, write_config, minimal_config

from cluster.kv.store import KVStore
from cluster.model import load_model
from cluster.model_structure import verify_model
from cluster.runner import ModelRunner


@pytest.mark.parametrize("model_type", ["not_a_family", "llama9"])
def test_a_model_type_mlx_lm_has_no_class_for_is_refused_at_load_by_name(model_type, tmp_path):
    """A config.json whose model_type the installed mlx-lm has no class for is refused when its spec is read and
    when its model is loaded (before any weights), with a message naming it and what to do."""
    folder = write_config(tmp_path / model_type, minimal_config(model_type))
    for load in (read_model_spec, load_model):
        with pytest.raises(ValueError, match=rf"model_type '{model_type}' has no model class in the installed mlx-lm"):
            load(folder)


def test_a_sliding_window_that_keeps_a_prefix_is_refused_by_slot():
    """A rotating cache that keeps its first tokens (attention sinks kept in the cache) is not a window the
    engine's mask applies: refused, naming the cache slot; a window of another size than the config's is a
    window like any other (the load check proves the body asks for its mask)."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    model = build("llama", dict(COMMON, layer_types=["full_attention", "sliding_attention"], sliding_window=WINDOW))
    assert verify_model(model).layer_windows == (None, WINDOW)
    model.make_cache = lambda: [KVCache(), RotatingKVCache(max_size=WINDOW, keep=4)]
    with pytest.raises(ValueError, match="cache slot 1 is a sliding window of 8 that keeps its first 4 tokens"):
        verify_model(model)
    model.make_cache = lambda: [KVCache(), RotatingKVCache(max_size=2 * WINDOW)]
    assert verify_model(model).layer_windows == (None, 2 * WINDOW)


def test_a_cache_kind_the_engine_does_not_serve_is_refused_by_slot():
    """A model whose own caches include a kind the KV wing has no group for (a quantized mlx-lm cache) is refused,
    naming the slot and the cache class."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    model = build("qwen3", dict(COMMON, **CONFIGS["qwen3"]))
    model.make_cache = lambda: [KVCache(), QuantizedKVCache()]
    with pytest.raises(ValueError, match="cache slot 1 uses QuantizedKVCache"):
        verify_model(model)


def test_gemma2_attends_over_float_kv_when_kv_is_quantized(tmp_path):
    """gemma2's attention reads float K/V only: the engine dequantizes quantized KV for it, and a runner
    over a store that would hand it quantized KV is refused."""
    config = dict(COMMON, **CONFIGS["gemma2"], head_dim=32)  # quantization groups are 32 values at least
    model = build("gemma2", config)
    spec = read_model_spec(write_config(tmp_path, {"model_type": "gemma2", **config}))
    core = EngineCore(model, tokenizer(), spec, EngineConfig(dtype="float32", num_blocks=8, block_size=8, kv_bits=8,
                                                             kv_group_size=32))
    assert core.store.dequantize_for_attention
    store = KVStore(spec, 4, 8, kv_bits=8, kv_group_size=32, dequantize_for_attention=False)
    with pytest.raises(ValueError, match="gemma2 attention reads float KV only"):
        ModelRunner(model, store)


def test_serve_reports_a_refused_family_as_an_error_not_a_traceback(tmp_path, monkeypatch, capsys):
    """`mlx-pd serve --model FOLDER` for a model type mlx-lm has no class for exits 2 with one error line
    naming it."""
    import cluster.launch.platform
    from cluster.launch import cli

    monkeypatch.setattr(cluster.launch.platform, "reexec_with_openblas", lambda *a, **k: None)
    folder = write_config(tmp_path / "not_a_family", minimal_config("not_a_family"))
    assert cli.main(["serve", "--model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "mlx-pd: error: model_type 'not_a_family'" in err and "Traceback" not in err
