"""The worker-group tests' shared pieces: model folders of the families' test models, each rank's expected share
of their parameters (mlx-lm's `shard` applied to a copy under a stand-in group), and the two runs that
tests/group_driver.py does in processes of their own: mlx-lm's own tensor-parallel generation, and mlx-pd's
group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from benchmarks.random_models import write_weight_index
from cluster.ports import free_ports

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 300


class StandInGroup:
    """What mlx-lm's `shard_linear` asks of a group while it slices weights: its rank and size (no collective
    runs until the model is called)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def model_config(model_type: str, layers: Optional[int] = None) -> dict:
    """The family's test model's config.json (tests/family_helpers.py's, else tests/family_configs.py's), with
    `layers` decoder layers instead of its own."""
    from tests.family_configs import CONFIGS as MORE
    from tests.family_helpers import COMMON, CONFIGS

    config = {"model_type": model_type, **COMMON, **CONFIGS[model_type]} if model_type in CONFIGS else \
        json.loads(json.dumps(MORE[model_type]))
    if layers is not None:
        config.get("text_config", config)["num_hidden_layers"] = layers
    return config


def model_folder(model_type: str, root: Path, layers: Optional[int] = None) -> Path:
    """The family's test model (`model_config`) as an mlx-lm folder under `root`."""
    from benchmarks.random_models import random_model_dir

    config = model_config(model_type, layers)
    return random_model_dir(f"group-{model_type}{'' if layers is None else f'-{layers}l'}", config, 0, root)


def rank_parameter_bytes(folder: Path, rank: int, size: int, parallel: str = "tensor") -> int:
    """The bytes of rank `rank`'s share of the folder's model under mlx-lm's own `shard` (tensor) or `pipeline`."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    model, _ = load_model(folder, lazy=True, strict=False)
    if parallel == "pipeline":
        model.model.pipeline(StandInGroup(rank, size))
    else:
        model.shard(StandInGroup(rank, size))
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def run_reference(folder: Path, prompts_path: Path, out: Path, size: int = 2, parallel: str = "tensor") -> list:
    """mlx-lm's own `parallel` generation on `size` ring ranks over loopback; the per-prompt results."""
    if parallel == "pipeline":
        write_weight_index(folder)
    hostfile = out.with_suffix(".hosts.json")
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(size)]))
    procs = [subprocess.Popen([sys.executable, "-m", "tests.group_driver", "reference", parallel, str(folder),
                               str(prompts_path),
                               str(out)], env={**_env(), "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(r)},
                              cwd=REPO) for r in range(size)]
    for p in procs:
        assert p.wait(RUN_TIMEOUT_S) == 0, f"mlx-lm's {parallel}-parallel reference failed"
    return json.loads(out.read_text())


def run_group(folder: Path, prompts_path: Path, reference_path: Path, out: Path, parallel: str = "tensor",
              size: int = 2) -> dict:
    """mlx-pd's group of `size` local ranks over the prompts (tests/group_driver.py's `engine`); its report."""
    proc = subprocess.run([sys.executable, "-m", "tests.group_driver", "engine", f"{parallel}:{size}", str(folder),
                           str(prompts_path),
                           str(reference_path), str(out)], env=_env(), cwd=REPO, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, "the worker group's run failed"
    return json.loads(out.read_text())
