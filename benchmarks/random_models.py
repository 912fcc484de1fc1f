"""Random-weight models built in code from mlx-lm's own model classes, saved once as mlx-lm folders with
SmolLM2's tokenizer: the fast-accelerator stand-in (benchmarks/reliability_long.py) and the hybrid model
(benchmarks/hybrid_model.py). No download: the weights come from `mx.random.seed(seed)`."""

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
