"""Joining a worker group's collective, and what a model must be to run across one.

`join_group` starts MLX's distributed backend for one rank: `ring` (TCP, on any OS; its hostfile lists each
rank's address on the group's link) or `jaccl` (RDMA over Thunderbolt 5, macOS 26.2+ only; refused by name
elsewhere). `check_parallel` refuses, before any weight loads, what mlx-lm's `shard` (tensor parallelism) or
`pipeline` (pipeline parallelism) would split wrongly.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Optional

from cluster.parallel.spec import GroupPlan


def ring_hostfile(plan: GroupPlan) -> list[list[str]]:
    """The ring backend's hostfile: one list of "host:port" per rank, in rank order."""
    return [[f"{r.host}:{r.ring_port}"] for r in plan.ranks]


def join_group(plan: GroupPlan, rank: int):
    """Start the collective for `rank` of `plan` and return its `mx.distributed.Group`. Blocks until every rank
    has joined, holding Python's lock all along (MLX does not release it here, so no other thread of this
    process runs meanwhile, its heartbeat included: cluster/parallel/rank.py joins only once every rank is
    ready, and bounds the join). Raises ValueError for a backend this machine cannot run, or a group the
    backend did not form (its size differs from the plan's); RuntimeError when the ring backend gives up
    connecting (it retries for about 15 s)."""
    import mlx.core as mx

    if plan.backend == "jaccl":
        if sys.platform != "darwin":
            raise ValueError("backend='jaccl' needs macOS 26.2+ with RDMA over Thunderbolt 5; use backend='ring' "
                             "(TCP) on this machine")
        coordinator = plan.ranks[0]
        os.environ.setdefault("MLX_JACCL_COORDINATOR", f"{coordinator.host}:{coordinator.ring_port}")
        if "MLX_IBV_DEVICES" not in os.environ:
            raise ValueError("backend='jaccl' needs MLX_IBV_DEVICES (the RDMA device matrix `mlx.distributed_config` "
                             "writes) in each rank's environment")
    hostfile = None
    if plan.backend == "ring":
        fd, hostfile = tempfile.mkstemp(prefix="mlx-pd-ring-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(ring_hostfile(plan), f)
        os.environ["MLX_HOSTFILE"] = hostfile
    os.environ["MLX_RANK"] = str(rank)
    try:
        group = mx.distributed.init(strict=True, backend=plan.backend)
    finally:
        if hostfile is not None:  # read by init: nothing is left behind in the temporary folder
            os.unlink(hostfile)
    if group.size() != plan.size or group.rank() != rank:
        raise ValueError(f"the {plan.backend} backend formed a group of {group.size()} as rank {group.rank()}, "
                         f"not {plan.size} as rank {rank}")
    return group


# families whose mlx-lm `shard` splits an untied output head by vocabulary (each rank computes a slice of the logits)
VOCAB_SPLIT = ("qwen3_5", "qwen3_5_moe")


def check_tensor_parallel(config: dict, size: int) -> None:
    """Refuse, by name, a model whose heads `size` ranks cannot split evenly (mlx-lm's `shard` divides the query
    and KV heads, and a Gated DeltaNet's key and value heads, by the group size without checking), or whose
    untied output head it splits by a vocabulary they do not divide. Raises ValueError naming the field and what
    to do."""
    text = config.get("text_config") or config
    for name in ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads"):
        heads: Optional[int] = text.get(name)
        if heads is not None and heads % size:
            raise ValueError(f"{name}={heads} does not split across {size} tensor-parallel ranks: choose a rank "
                             f"count that divides it")
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    vocab = text.get("vocab_size")
    if config.get("model_type") in VOCAB_SPLIT and not tied and vocab and vocab % size:
        raise ValueError(f"vocab_size={vocab} does not split across {size} tensor-parallel ranks (mlx-lm's shard "
                         f"splits this family's output head by vocabulary): choose a rank count that divides it")


def check_pipeline_parallel(config: dict, size: int) -> None:
    """Refuse, by name, a model with fewer decoder layers than `size` pipeline ranks (mlx-lm's `pipeline` would
    leave a rank without layers). Raises ValueError naming the field and what to do."""
    text = config.get("text_config") or config
    layers = text.get("num_hidden_layers") or text.get("n_layer")
    if layers is not None and layers < size:
        raise ValueError(f"num_hidden_layers={layers} does not split across {size} pipeline ranks: use at most "
                         f"{layers} ranks, or tensor parallelism")


def check_parallel(config: dict, parallel: str, size: int) -> None:
    """Refuse, by name, a group that mlx-lm would split wrongly: `parallel` is "tensor" (`check_tensor_parallel`)
    or "pipeline" (`check_pipeline_parallel`). Raises ValueError naming the field."""
    if parallel == "tensor":
        check_tensor_parallel(config, size)
    elif parallel == "pipeline":
        check_pipeline_parallel(config, size)
    else:
        raise ValueError(f"parallel={parallel!r} is not a kind of worker group: use 'tensor' or 'pipeline'")
