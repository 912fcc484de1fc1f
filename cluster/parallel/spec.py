"""A worker group's plan: its parallelism, collective backend and ranks' addresses, and what every rank loads.

The leader (rank 0) writes the plan; each follower reads it (`GroupPlan.from_json`) and so builds the same
engine: same model, same `EngineConfig`, same KV pool. A rank's addresses: `ring_port` for the collective's
ring backend, `step_port` where the follower takes its steps (ZeroMQ PULL), `heartbeat_port` where it
publishes its heartbeats. `machine` (optional) is the Ray custom resource of the node the rank runs on (`mlx-pd up`
places a following rank as a Ray actor there, as it places a worker with `machine`); the rank itself never
reads it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Optional

from cluster.config import EngineConfig

PARALLEL_KINDS = ("tensor", "pipeline")
BACKENDS = ("ring", "jaccl")


@dataclass(frozen=True)
class RankAddress:
    """Where rank `rank` listens: `host` (an address on the group's link, not whatever interface comes first),
    `ring_port` (the ring backend's), `step_port` (a follower's step socket), `heartbeat_port` (its beats).
    `machine`: the Ray custom resource of its node (`mlx-pd up`'s placement; None: the node whose IP is
    `host`)."""

    host: str
    ring_port: int
    step_port: int
    heartbeat_port: int
    machine: Optional[str] = None


@dataclass(frozen=True)
class GroupPlan:
    """One worker group. `parallel`: "tensor" (every rank holds a slice of every layer's heads and MLP) or
    "pipeline" (a range of whole layers: rank 0 the last ones, rank size-1 the first, as mlx-lm's `pipeline`
    splits them); `backend`: "ring" (TCP, any OS) or
    "jaccl" (RDMA over Thunderbolt 5, macOS 26.2+ only); `ranks`: one address per rank, rank 0 leads.
    `model`/`served_name`: what `cluster.model.served_model` resolves; `engine`: the `EngineConfig` every rank
    builds. `heartbeat_s` / `deadline_s`: beat interval and how long a silent peer is tolerated (seconds).
    `memory_budget_gb`: each rank's own budget for weights plus KV (None: unchecked). `moves_kv`: the group is
    a prefill or decode worker, which ships or receives KV (False: single-node mode's engine).
    Raises ValueError naming the field for an unknown kind or backend, fewer than 2 ranks, or bad times."""

    parallel: str
    backend: str
    ranks: tuple[RankAddress, ...]
    model: Optional[str] = None
    served_name: Optional[str] = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    heartbeat_s: float = 0.5
    deadline_s: float = 10.0
    memory_budget_gb: Optional[float] = None
    moves_kv: bool = False

    def __post_init__(self) -> None:
        if self.parallel not in PARALLEL_KINDS:
            raise ValueError(f"parallel={self.parallel!r} is invalid: use one of {', '.join(PARALLEL_KINDS)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is invalid: use one of {', '.join(BACKENDS)}")
        if len(self.ranks) < 2:
            raise ValueError(f"ranks has {len(self.ranks)} entries: a group has at least 2 ranks")
        if not 0 < self.heartbeat_s < self.deadline_s:
            raise ValueError(f"heartbeat_s={self.heartbeat_s} and deadline_s={self.deadline_s} are invalid: "
                             "need 0 < heartbeat_s < deadline_s")
        if self.memory_budget_gb is not None and not self.memory_budget_gb > 0:
            raise ValueError(f"memory_budget_gb={self.memory_budget_gb!r} is invalid: must be > 0")

    @property
    def size(self) -> int:
        return len(self.ranks)

    def to_json(self) -> str:
        """The plan as JSON (what a follower reads)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "GroupPlan":
        """The plan `to_json` wrote. Raises ValueError (a field's rule) or KeyError/TypeError (a malformed file)."""
        data = json.loads(text)
        data["ranks"] = tuple(RankAddress(**r) for r in data["ranks"])
        data["engine"] = EngineConfig(**data["engine"])
        return cls(**data)
