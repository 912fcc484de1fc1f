"""The verified-families gate: every family outside the verified list, and every layer, rotary embedding
or class a verified family does not reproduce exactly, is refused at load by name."""

from __future__ import annotations

import pytest

from cluster.config import EngineConfig
from cluster.engine import EngineCore
from cluster.model import read_model_spec
from tests.family_helpers import (WINDOW, COMMON, CONFIGS, UNVERIFIED, tokenizer, build, write_config, family,
                                   engine, request, minimal_config)

from cluster.kv.store import KVStore
from cluster.model import load_model
from cluster.model_families import verify_model
from cluster.runner import ModelRunner


@pytest.mark.parametrize("model_type", UNVERIFIED)
def test_unverified_families_are_refused_at_load_by_name(model_type, tmp_path):
    """A config.json of a family outside the verified list is refused when its spec is read and when its
    model is loaded (before any weights), with a message naming it and listing the served families."""
    folder = write_config(tmp_path / model_type, minimal_config(model_type))
    for load in (read_model_spec, load_model):
        with pytest.raises(ValueError, match=rf"'{model_type}'.*served: llama, mistral"):
            load(folder)


def test_an_unverified_model_object_is_refused_when_the_engine_is_built():
    """A gemma (first generation) model handed to the engine directly (its spec read elsewhere) is refused by
    name when the engine is constructed, before any request."""
    model = build("gemma", dict(COMMON))
    _, spec = family("llama")
    with pytest.raises(ValueError, match="'gemma'.*served: llama"):
        EngineCore(model, tokenizer(), spec, EngineConfig(dtype="float32", num_blocks=8, block_size=8))


def test_a_sliding_window_layer_in_a_family_not_read_for_windows_is_refused():
    """qwen3's body was not read to ask its caches for windowed masks: a qwen3 model whose caches include a
    RotatingKVCache is refused, naming the layer and the cache."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    model = build("qwen3", dict(COMMON, **CONFIGS["qwen3"]))
    model.make_cache = lambda: [KVCache(), RotatingKVCache(max_size=WINDOW)]
    with pytest.raises(ValueError, match="layer 1 uses RotatingKVCache \\(max_size 8, keep 0\\)"):
        verify_model(model)


def test_a_sliding_window_that_keeps_a_prefix_or_differs_from_the_config_is_refused():
    """A rotating cache that keeps its first tokens (an attention-sink window) or whose size is not the
    model's `sliding_window` is not the window the engine's mask applies: refused by layer."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    model = build("llama", dict(COMMON, layer_types=["full_attention", "sliding_attention"], sliding_window=WINDOW))
    assert verify_model(model).layer_windows == (None, WINDOW)
    for cache in (RotatingKVCache(max_size=WINDOW, keep=4), RotatingKVCache(max_size=2 * WINDOW)):
        model.make_cache = lambda cache=cache: [KVCache(), cache]
        with pytest.raises(ValueError, match="layer 1 uses RotatingKVCache"):
            verify_model(model)


def test_a_length_dependent_rotary_embedding_is_refused():
    """Dynamic NTK rope (its base depends on the current length, not the position alone) is refused."""
    model = build("llama", dict(COMMON, rope_scaling={"type": "dynamic", "factor": 2.0}))
    with pytest.raises(ValueError, match="rotary embedding DynamicNTKScalingRoPE"):
        verify_model(model)


def test_a_verified_type_on_another_family_class_is_refused():
    """A model object claiming a verified type but built from another mlx-lm module is refused (its head
    and attention are not the verified ones)."""
    model = build("qwen2", dict(COMMON))
    model.model_type = "llama"
    with pytest.raises(ValueError, match="served only as mlx_lm.models.llama.Model"):
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
    """`mlx-pd serve --model FOLDER` for an unverified family exits 2 with one error line naming it."""
    import cluster.launch.platform
    from cluster.launch import cli

    monkeypatch.setattr(cluster.launch.platform, "reexec_with_openblas", lambda *a, **k: None)
    folder = write_config(tmp_path / "mamba2", minimal_config("mamba2"))
    assert cli.main(["serve", "--model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "mlx-pd: error: model_type 'mamba2'" in err and "Traceback" not in err
