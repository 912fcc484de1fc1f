"""Topology files (`topologies/*.toml`) -> a validated `TopologySpec`.

Single-node form (what `mlx-pd serve --topology FILE` reads; `topologies/single-node.toml` is the default):

    [model]
    source = "SmolLM2-135M-Instruct"   # a folder, a .gguf file or a repo id (cluster.model.resolve_model_path)
    served_name = "SmolLM2-135M-Instruct"

    [engine]                             # any field of cluster.config.EngineConfig
    kv_cache_gb = 1.0
    kv_bits = 8

    [router]
    host = "127.0.0.1"
    port = 8000

Every unknown table or key is an error that names it and the file, so a typo never silently falls back to
a default. Worker tables for cluster mode are added by the cluster launcher.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from cluster.config import EngineConfig

TOPOLOGY_DIR = Path(__file__).resolve().parent.parent / "topologies"


@dataclass(frozen=True)
class ModelSection:
    """`[model]`: what to load and the name clients use."""

    source: Optional[str] = None
    served_name: Optional[str] = None


@dataclass(frozen=True)
class RouterSection:
    """`[router]`: where the OpenAI API listens (127.0.0.1 unless the file says otherwise)."""

    host: str = "127.0.0.1"
    port: int = 8000

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError(f"router.port={self.port!r} is invalid: must be an integer in 1..65535")


@dataclass(frozen=True)
class TopologySpec:
    """A parsed topology file."""

    name: str
    model: ModelSection = field(default_factory=ModelSection)
    engine: EngineConfig = field(default_factory=EngineConfig)
    router: RouterSection = field(default_factory=RouterSection)


def _section(cls, table: Any, where: str):
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    try:
        return cls(**table)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def resolve_topology_path(name_or_path: str) -> Path:
    """A path as given, or a name looked up in the shipped `topologies/` folder (".toml" optional)."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    for candidate in (TOPOLOGY_DIR / name_or_path, TOPOLOGY_DIR / f"{name_or_path}.toml"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"topology {name_or_path!r} not found (looked in . and {TOPOLOGY_DIR})")


def load_topology(name_or_path: str) -> TopologySpec:
    """Parse and validate a topology file. Raises FileNotFoundError or ValueError naming the bad key."""
    path = resolve_topology_path(name_or_path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    sections = {"model": ModelSection, "engine": EngineConfig, "router": RouterSection}
    unknown = sorted(set(data) - set(sections))
    if unknown:
        raise ValueError(f"{path}: unknown table(s) {', '.join(unknown)}; known: {', '.join(sections)}")
    parsed = {key: _section(cls, data.get(key, {}), f"{path} [{key}]") for key, cls in sections.items()}
    return TopologySpec(name=path.stem, **parsed)
