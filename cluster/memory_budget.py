"""A rank's own memory budget: weights plus KV. MLX's CPU backend does not enforce `mx.set_memory_limit`, so a
rank checks its budget itself, at load: its parameters' bytes (its share, in a group) and its KV pool's, and
the peak MLX reports once the engine is built (`mx.get_peak_memory`, which includes the load check's work)."""

from __future__ import annotations

from dataclasses import dataclass

from mlx.utils import tree_flatten

GB = 1024 ** 3


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds: `parameter_bytes` (its weights), `kv_bytes` (its KV pool's arrays), `peak_bytes`
    (MLX's peak so far); `entry_bytes`: one request's content beyond blocks (its share of a recurrent state, 0
    without), and `reserved_bytes`: what the rank keeps for such content at most (running requests' and kept
    copies'), besides the pool."""

    parameter_bytes: int
    kv_bytes: int
    peak_bytes: int
    entry_bytes: int = 0
    reserved_bytes: int = 0

    def report(self) -> dict:
        return {"parameter_bytes": self.parameter_bytes, "kv_bytes": self.kv_bytes, "peak_bytes": self.peak_bytes,
                "entry_bytes": self.entry_bytes, "reserved_bytes": self.reserved_bytes}


def parameter_bytes(model) -> int:
    """Bytes of `model`'s parameters as loaded on this rank."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def kv_pool_bytes(engine) -> int:
    """Bytes of an engine's KV: every array of its KV cache groups' stores (a quantized layer's packed values,
    scales and biases each)."""
    return sum(a.nbytes for g in engine.kv.groups for _, a in tree_flatten(list(g.arrays())))


def check_weights(model, budget_gb: float, where: str) -> int:
    """Raise ValueError when `model`'s weights alone exceed `budget_gb`; returns their bytes. `where` names the
    rank in the message."""
    nbytes = parameter_bytes(model)
    if nbytes > budget_gb * GB:
        raise ValueError(f"{where}: the model's weights ({nbytes / GB:.3f} GB) exceed memory_budget_gb="
                         f"{budget_gb}: run it across more ranks, or raise the budget")
    return nbytes


def check_rank_memory(model, engine, budget_gb: float, where: str) -> RankMemory:
    """This rank's `RankMemory` once its engine is built; raises ValueError when weights plus KV (its pool and
    what it reserves beside it), or MLX's peak, exceed `budget_gb` (lower kv_cache_gb, or add ranks)."""
    import mlx.core as mx

    groups, seqs = engine.kv.groups, engine.config.max_num_seqs
    memory = RankMemory(parameter_bytes(model), kv_pool_bytes(engine), int(mx.get_peak_memory()),
                        sum(g.entry_bytes() for g in groups), sum(g.reserved_bytes(seqs) for g in groups))
    held = memory.parameter_bytes + memory.kv_bytes + memory.reserved_bytes
    if max(held, memory.peak_bytes) > budget_gb * GB:
        raise ValueError(f"{where}: weights ({memory.parameter_bytes / GB:.3f} GB) plus KV "
                         f"({(memory.kv_bytes + memory.reserved_bytes) / GB:.3f} GB), peak {memory.peak_bytes / GB:.3f} GB, exceed "
                         f"memory_budget_gb={budget_gb}: lower kv_cache_gb or run across more ranks")
    return memory
