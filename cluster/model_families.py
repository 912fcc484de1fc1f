"""Which models the engine serves: the config gate, and the families the tests cover.

A model is served when three gates pass, each with a message naming what failed:

1. `check_config` (config.json, before any weights load): the installed mlx-lm has a model class for its
   `model_type` (after mlx-lm's own `MODEL_REMAPPING`, so `kimi_k2` runs as `deepseek_v3` and `mistral` as
   `llama`).
2. `cluster.model_structure.verify_model` (the loaded model): every cache slot of the model's own `make_cache()`
   is a kind the paged KV serves, every rotary embedding gives each row of a batch what it gives that row
   alone, and the output head is found.
3. `cluster.load_check.run_load_check` (the loaded model, before /health says ready): a short probe through the
   engine's paged path and through mlx-lm's own cache path agree token for token (logprobs within a tolerance).

`FAMILIES` lists the families whose random-weight models the test suite serves exactly in every setting (solo,
batched, after a prefix hit, across chunks, through prefill/decode), keyed by mlx-lm module. For them the load
check may be skipped (`EngineConfig.skip_load_check`), and their entry says what the probe would otherwise
find out: the rank of the batched attention mask (`mask_rank`) and whether the attention reads quantized KV as
stored (`reads_quantized_kv`). A family outside the list is served when the structure is known and the load
check passes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Family:
    """A family the tests cover.

    `mask_rank`: 4 when the attention's scores are [B, heads, T, L] (mlx-lm's `scaled_dot_product_attention`),
    5 when it splits grouped queries into [B, kv_heads, repeats, T, L] (gemma2), "grouped" when that depends on
    the model (5 when any layer's attention has `repeats` > 1, else 4).
    `reads_quantized_kv`: the attention goes through mlx-lm's `scaled_dot_product_attention`, which reads
    quantized caches (`bits`/`group_size`); when False, quantized KV is dequantized for attention.
    """

    mask_rank: object = 4
    reads_quantized_kv: bool = True


FAMILIES: dict[str, Family] = {
    "llama": Family(),  # mistral, iquestcoder and xverse checkpoints run on these classes too
    "qwen2": Family(),
    "qwen3": Family(),
    "qwen3_moe": Family(),
    "mixtral": Family(),
    "olmo2": Family(),
    "phi3": Family(),
    # gemma2 computes attention itself: scores [B, kv_heads, repeats, T, L] when repeats > 1, float K/V only
    "gemma2": Family(mask_rank="grouped", reads_quantized_kv=False),
    "granite": Family(),
    "gemma3_text": Family(),
    "gemma3": Family(),  # the vision wrapper: its text path is gemma3_text
    # attention sinks: mlx-lm's quantized attention has no sinks
    "gpt_oss": Family(reads_quantized_kv=False),
    # multi-head latent attention computes with the latent and the rope key itself (kimi_k2 runs on it too)
    "deepseek_v3": Family(reads_quantized_kv=False),
    "kimi_k25": Family(reads_quantized_kv=False),
    "qwen3_next": Family(),
    "qwen3_5": Family(),
    "qwen3_5_moe": Family(),
    "falcon_h1": Family(),
    "gemma4_text": Family(),
    "gemma4": Family(),
    "glm4": Family(),
    "glm4_moe": Family(),
    "minimax": Family(),
    "mistral3": Family(),
    "ministral3": Family(),
    "smollm3": Family(),
    "olmo3": Family(),
    "nemotron_h": Family(),
    "granitemoehybrid": Family(),
    "lfm2": Family(),
    "llama4_text": Family(),
    "glm4_moe_lite": Family(reads_quantized_kv=False),  # latent attention, as deepseek_v3
    "kimi_linear": Family(reads_quantized_kv=False),  # latent attention beside Kimi delta attention
    "exaone4": Family(),
    "ernie4_5_moe": Family(),
    "seed_oss": Family(),
    "hunyuan_v1_dense": Family(),
    "bailing_moe": Family(),
    "apertus": Family(),
    "cohere2": Family(),
    "starcoder2": Family(),
    "lfm2_moe": Family(),
    "mamba2": Family(),  # no attention: Mamba-2 layers alone
}


def module_of(model_type: Optional[str]) -> str:
    """The mlx-lm module (`mlx_lm.models.<module>`) that runs `model_type`, after mlx-lm's `MODEL_REMAPPING`.
    Raises ValueError naming the type when the installed mlx-lm has no such module."""
    from mlx_lm.utils import MODEL_REMAPPING

    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"config.json's model_type {model_type!r} is missing or not a string")
    module = MODEL_REMAPPING.get(model_type, model_type)
    try:
        imported = importlib.import_module(f"mlx_lm.models.{module}")
    except ImportError:
        raise ValueError(f"model_type {model_type!r} has no model class in the installed mlx-lm: upgrade mlx-lm "
                         f"or convert the model to a type it has") from None
    if not hasattr(imported, "Model"):
        raise ValueError(f"model_type {model_type!r}: mlx_lm.models.{module} defines no Model class")
    return module


def tested(model_type: Optional[str]) -> Optional[Family]:
    """The `Family` entry of `model_type`'s module when the tests cover it, else None."""
    try:
        return FAMILIES.get(module_of(model_type))
    except ValueError:
        return None


def tested_types() -> str:
    """The modules the tests cover, comma-separated, for messages."""
    return ", ".join(FAMILIES)


def check_config(config: dict) -> str:
    """Gate on a config.json dict (before any weights load): the installed mlx-lm must have a class for its
    top-level `model_type`. Returns the mlx-lm module; raises ValueError as `module_of`."""
    return module_of(config.get("model_type"))
