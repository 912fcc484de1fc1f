"""Random-weight models built in code from mlx-lm's own model classes, saved once as mlx-lm folders with
SmolLM2's tokenizer: the fast-accelerator stand-in (benchmarks/reliability_long.py), the hybrid model
(benchmarks/hybrid_model.py) and, here, a llama of SmolLM2-135M's size whose heads split over 2 tensor-parallel
ranks (`smol_shape_model_dir`, for `mlx-pd bench tensor-parallel`). No download: the weights come from
`mx.random.seed(seed)`."""

from __future__ import annotations

import copy
import importlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MARKER = "random_model.json"  # the config and seed a folder was built from


def random_model_dir(name: str, config: dict, seed: int = 0, root: Optional[Path] = None) -> Path:
    """The model of mlx-lm's `mlx_lm.models.<config["model_type"]>` with `config` and weights from
    `mx.random.seed(seed)` (float32), as an mlx-lm folder (config.json, model.safetensors, SmolLM2's tokenizer
    files) named `<name>-seed<seed>` under `root` (default: next to the default model in the mlx-pd cache,
    `$MLX_PD_CACHE` or ~/.cache/mlx-pd/models). Built once: a folder whose marker names the same config and seed
    is returned as it is; it is written to a temporary folder and renamed, so a reader never sees half of it."""
    from cluster.gguf_import import default_model_dir, ensure_default_model

    root = Path(root) if root is not None else default_model_dir("float32").parent
    out = root / f"{name}-seed{seed}"
    want = {"config": config, "seed": seed}
    marker = out / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == want and (out / "model.safetensors").is_file():
        return out
    import mlx.core as mx
    from mlx.utils import tree_flatten

    family = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    tokenizer_dir = ensure_default_model("float32", progress=False)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    os.chmod(tmp, 0o755)
    mx.random.seed(seed)
    # a copy: some families' argument classes edit nested dicts in place (qwen3_5 renames rope_parameters'
    # rope_type to type), which would change the config.json and marker written below, and the caller's dict
    model = family.Model(family.ModelArgs.from_dict(copy.deepcopy(config)))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).is_file():
            shutil.copy2(tokenizer_dir / file, tmp / file)
    (tmp / MARKER).write_text(json.dumps(want) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


# SmolLM2-135M's shape (hidden 576, 30 layers, MLP 1536, vocabulary 49,152, tied embeddings) with 8 query heads over
# 4 KV heads of 72 (SmolLM2 has 9 over 3 of 64), so that both divide by 2 tensor-parallel ranks
SMOL_SHAPE_NAME = "smollm2-135m-shape-8h4kv"
SMOL_SHAPE_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 576,
                     "num_hidden_layers": 30, "intermediate_size": 1536, "num_attention_heads": 8,
                     "num_key_value_heads": 4, "head_dim": 72, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
                     "vocab_size": 49152, "max_position_embeddings": 8192, "tie_word_embeddings": True,
                     "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
                     "pad_token_id": 2}


def smol_shape_model_dir(root: Optional[Path] = None, seed: int = 0) -> Path:
    """A random-weight llama of SmolLM2-135M's size whose 8 query and 4 KV heads divide by 2 tensor-parallel ranks
    (SMOL_SHAPE_CONFIG, weights from `mx.random.seed(seed)`, float32, about 540 MB), as an mlx-lm model folder
    with SmolLM2's tokenizer files, built once by :func:`random_model_dir` under `root` (default: the mlx-pd
    cache); returns the folder. With tied random embeddings its greedy answers tend to repeat one token: fine
    for speed, weak as a check of the output text."""
    return random_model_dir(SMOL_SHAPE_NAME, SMOL_SHAPE_CONFIG, seed, root)


# SmolLM2-135M's own shape, 9 query heads over 3 KV heads of 64, as a qwen2 (whose mlx-lm class can split its layers
# into a pipeline; its heads do not split in two for tensor parallelism)
SMOL_QWEN2_NAME = "smollm2-135m-shape-qwen2"
SMOL_QWEN2_CONFIG = {**SMOL_SHAPE_CONFIG, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                     "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}


def smol_qwen2_model_dir(root: Optional[Path] = None, seed: int = 0) -> Path:
    """A random-weight qwen2 of SmolLM2-135M's size and heads (SMOL_QWEN2_CONFIG; float32, about 540 MB), built
    once as :func:`smol_shape_model_dir` builds its llama, with its weight index; for pipeline parallelism,
    which mlx-lm's llama lacks."""
    folder = random_model_dir(SMOL_QWEN2_NAME, SMOL_QWEN2_CONFIG, seed, root)
    if not (folder / "model.safetensors.index.json").exists():
        write_weight_index(folder)
    return folder


def write_weight_index(folder: Path) -> None:
    """The folder's `model.safetensors.index.json` (which weight is in which file), which mlx-lm's pipeline-parallel
    `sharded_load` reads to open only a rank's files; a one-file random model has none."""
    import mlx.core as mx

    weight_map = {name: f.name for f in sorted(folder.glob("*.safetensors")) for name in mx.load(str(f))}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
