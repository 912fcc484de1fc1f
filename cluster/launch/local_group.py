"""A worker group of local ranks, for development and one machine with several processes' worth of memory:
`mlx-pd serve --tensor-parallel N` (or `--pipeline-parallel N`) leads the group in its own process (rank 0: the router and the engine) and
starts ranks 1..N-1 as child processes (`python -m cluster.parallel.rank`), all over loopback with the ring
backend. Across Macs, a group's ranks run on their own hosts (`mlx-pd up`'s placement, or by hand)."""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from cluster.config import EngineConfig
from cluster.parallel.spec import GroupPlan, RankAddress
from cluster.ports import free_ports

log = logging.getLogger(__name__)


def group_shape(tensor_parallel: int, pipeline_parallel: int) -> tuple[str, int]:
    """(parallel kind, ranks) of `serve --tensor-parallel` / `--pipeline-parallel` (("tensor", 1): one rank).
    Raises ValueError for a count below 1, or both above 1 (MLX's ring backend cannot split one group in two)."""
    if tensor_parallel < 1 or pipeline_parallel < 1:
        raise ValueError("--tensor-parallel and --pipeline-parallel count ranks: give 1 (one rank, the default) "
                         "or more")
    if tensor_parallel > 1 and pipeline_parallel > 1:
        raise ValueError("tensor_parallel and pipeline_parallel cannot both exceed 1 (MLX's ring backend cannot "
                         "split one group in two): choose one")
    return ("pipeline", pipeline_parallel) if pipeline_parallel > 1 else ("tensor", tensor_parallel)


def local_plan(size: int, model: Optional[str], served_name: Optional[str], engine: EngineConfig,
               memory_budget_gb: Optional[float] = None, deadline_s: float = 10.0,
               host: str = "127.0.0.1", parallel: str = "tensor") -> GroupPlan:
    """A plan of `size` ranks on `host`, on free ports; `parallel`: "tensor" or "pipeline"."""
    ports = free_ports(3 * size, host)
    ranks = tuple(RankAddress(host, *ports[3 * r:3 * r + 3]) for r in range(size))
    return GroupPlan(parallel, "ring", ranks, model, served_name, engine, deadline_s=deadline_s,
                     memory_budget_gb=memory_budget_gb)


class LocalFollowers:
    """The child processes of ranks 1..N-1 of `plan`, stopped with this process (the group's `Stop`, then a
    terminate). Their output goes to this process's stderr."""

    def __init__(self, plan: GroupPlan):
        from cluster.launch.platform import preload_env

        fd, self.plan_path = tempfile.mkstemp(prefix="mlx-pd-group-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(plan.to_json())
        env = {**os.environ, **preload_env()}
        repo = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
        self.procs = [subprocess.Popen([sys.executable, "-m", "cluster.parallel.rank", self.plan_path, str(r)],
                                       stdin=subprocess.DEVNULL, env=env, start_new_session=True)
                      for r in range(1, plan.size)]
        atexit.register(self.stop)

    def stop(self, timeout_s: float = 5.0) -> None:
        for proc in self.procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
        try:
            os.unlink(self.plan_path)
        except OSError:
            pass


def start_local_group(plan: GroupPlan):
    """Start ranks 1.. of `plan` as children, then rank 0 here; returns (rank 0's `GroupRank`, the
    `LocalFollowers`). Raises ValueError for what the group cannot serve: what the model's config and class
    tell is refused here, before any child starts (`check_group`); the rest, every rank refuses alike."""
    from cluster.parallel.rank import check_group, start_rank

    check_group(plan)
    followers = LocalFollowers(plan)
    started = start_rank(plan, 0)

    def stop_group() -> None:
        started.leader.stop()
        started.heartbeat.stop()
        followers.stop()

    atexit.register(stop_group)
    return started, followers
