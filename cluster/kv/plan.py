"""The KV plan: a byte budget and a model turned into KV cache groups, blocks per group, running states and
snapshot bytes (`plan_kv`), and the groups built from it (`KVPlan.build`). vLLM plans its KV layout the same
way (`kv_cache_utils`) before its engine builds the scheduler; the engine receives the plan.

The groups come from the model's layers (`VerifiedModel.layer_kinds`): full-attention layers form one group;
sliding-window layers beside them form a second, with its own pool (when every KV layer slides, they stay one
group and keep every block); recurrent layers form a state group. Extra groups (`KVPlan.extra`) are built by
their own factories and join the same manager.

The split of `kv_cache_gb`: for a model with recurrent layers, `state_cache_gb` of it goes to state snapshots
(None: half) and the running sequences' states (one per sequence, up to `max_num_seqs`) come out of it too; the
rest is blocks. With a window group, a running sequence needs at most `window_blocks_per_sequence` window blocks
at once (its window, a prefill chunk, a draft run and partial blocks), so the window pool gets room for twice that
per running sequence (the other half keeps recently released window blocks findable for prefix hits and holds
transfers), and the main pool the rest. When that is no smaller than an even split (a window as long as the
context), both get the same number of blocks and nothing is saved.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

from cluster.config import EngineConfig
from cluster.kv.attention_groups import FullAttentionGroup, SlidingWindowGroup
from cluster.kv.block_pool import BlockPool
from cluster.kv.groups import KVCacheGroup
from cluster.kv.manager import KVManager
from cluster.kv.recurrent_state import StateShapes, state_nbytes
from cluster.kv.snapshots import StateSnapshots
from cluster.kv.state_group import RecurrentStateGroup
from cluster.kv.store import KVStore, kv_bytes_per_block
from cluster.model import ModelSpec
from cluster.model_structure import VerifiedModel
from cluster.ownership import ThreadOwner

# an extra group's factory: (the plan, the anchor pool, the engine's owner) -> the group
GroupFactory = Callable[["KVPlan", BlockPool, ThreadOwner], KVCacheGroup]


@dataclass(frozen=True)
class KVPlan:
    """What the KV of one engine is made of.

    `config`: the engine config with `max_num_seqs` and `max_num_batched_tokens` resolved; `full_layers` /
    `window_layers`: the KV layers of the full-attention and the sliding-window group (`window`: the largest
    window in positions; None without a window group); `num_blocks` / `num_window_blocks`: each pool's blocks,
    null block included (0: no window pool); `block_bytes`: one block over every block group; `state_shapes`:
    per recurrent layer its state arrays (empty without); `snapshot_bytes`: the snapshots' budget; `extra`:
    factories of groups beyond the model's own (they add no layers the model runs over unless they say so);
    `kv_shapes`: per KV layer (heads, key width, value width), from the model (empty: every layer `spec`'s)."""

    spec: ModelSpec
    config: EngineConfig
    full_layers: tuple[int, ...]
    num_blocks: int
    block_bytes: int
    window_layers: tuple[int, ...] = ()
    window: Optional[int] = None
    num_window_blocks: int = 0
    state_shapes: StateShapes = ()
    snapshot_bytes: int = 0
    dequantize_for_attention: Optional[bool] = None
    extra: tuple[GroupFactory, ...] = field(default=())
    kv_shapes: tuple = ()

    @property
    def kv_args(self) -> tuple:
        c = self.config
        return (c.block_size, c.dtype, c.kv_bits, c.kv_group_size)

    def with_group(self, factory: GroupFactory) -> "KVPlan":
        """This plan with one more group, built by `factory` (a kind defined outside this package)."""
        return dataclasses.replace(self, extra=self.extra + (factory,))

    def build(self, owner: ThreadOwner) -> KVManager:
        """The pools, stores and groups of this plan, owned by `owner` (the engine's thread), under one
        `KVManager`."""
        c = self.config
        caching = c.enable_prefix_caching
        pool = BlockPool(self.num_blocks, enable_caching=caching, needs_restore_points=bool(self.state_shapes))
        main_spec = group_spec(self.spec, self.kv_shapes, self.full_layers)
        mirror = mirror_budget_bytes(c, self.num_blocks * kv_bytes_per_block(main_spec, *self.kv_args))
        store = KVStore(main_spec, self.num_blocks, *self.kv_args, mirror_budget_bytes=mirror,
                        dequantize_for_attention=self.dequantize_for_attention, owner=owner)
        groups: list[KVCacheGroup] = [FullAttentionGroup(pool, store, self.full_layers)]
        if self.window is not None:
            window_pool = BlockPool(self.num_window_blocks, enable_caching=caching, event_log=pool.event_log, group=1)
            window_store = KVStore(group_spec(self.spec, self.kv_shapes, self.window_layers),
                                   self.num_window_blocks, *self.kv_args,
                                   dequantize_for_attention=self.dequantize_for_attention, owner=owner)
            groups.append(SlidingWindowGroup(window_pool, window_store, self.window_layers, self.window))
        if self.state_shapes:
            interval = c.state_snapshot_interval or max(  # default: whole blocks of a prefill chunk
                c.block_size, c.prefill_chunk_size // c.block_size * c.block_size)
            snapshots = StateSnapshots(self.snapshot_bytes, pool, c.block_size, interval)
            groups.append(RecurrentStateGroup(self.state_shapes, pool, snapshots))
        groups += [factory(self, pool, owner) for factory in self.extra]
        return KVManager(groups, c.block_size, store.copy_block)


STATE_ONLY_BLOCKS = 1 << 16  # blocks of a model without KV layers: they cost no KV bytes
AUTO_TOKENS_PER_SEQ = 256  # KV tokens of the pool per running sequence when max_num_seqs follows the budget
AUTO_MIN_SEQS, AUTO_MAX_SEQS = 16, 256


def auto_max_num_seqs(budget_bytes: int, block_bytes: int, block_size: int, state_bytes: int = 0) -> int:
    """`max_num_seqs` when it follows the KV budget: one running sequence per `AUTO_TOKENS_PER_SEQ` tokens of
    the pool, each also holding its recurrent state (`state_bytes`, 0 without recurrent layers), within
    [`AUTO_MIN_SEQS`, `AUTO_MAX_SEQS`] (vLLM's default batch is 256 sequences). `budget_bytes`: bytes for blocks
    and running states; `block_bytes`: one block's KV over every layer and group, for `block_size` tokens.
    A sequence that outgrows its share takes free blocks; when none are left, recompute preemption applies."""
    per_seq = -(-AUTO_TOKENS_PER_SEQ // block_size) * block_bytes + state_bytes
    return int(min(AUTO_MAX_SEQS, max(AUTO_MIN_SEQS, budget_bytes // max(1, per_seq))))


def mirror_budget_bytes(config: EngineConfig, pool_bytes: int) -> int:
    """Bytes for a decode mirror beside a pool of `pool_bytes`: `decode_mirror_gb`, or by default as much."""
    return pool_bytes if config.decode_mirror_gb is None else int(config.decode_mirror_gb * 2**30)


def group_spec(spec: ModelSpec, kv_shapes: tuple, layers: tuple[int, ...]) -> ModelSpec:
    """`spec` for the KV layers `layers` of one group, with their shape from `kv_shapes` (per KV layer, from
    the model; empty: `spec`'s own). Raises ValueError when the group's layers differ in shape."""
    shapes = {kv_shapes[i] for i in layers} if kv_shapes else set()
    if len(shapes) > 1:
        raise ValueError(f"KV layers {list(layers)} of one KV cache group cache different shapes "
                         f"{sorted(shapes)} (KV heads, key width, value width): not a layout the engine serves")
    if not shapes:
        return dataclasses.replace(spec, num_layers=len(layers))
    return spec.with_kv_shape(len(layers), shapes.pop())


def plan_kv(spec: ModelSpec, config: EngineConfig, verified: VerifiedModel) -> KVPlan:
    """The plan for `spec`'s model (`verified`: its cache slots, KV shapes and recurrent states, read from the
    model) within `config.kv_cache_gb`. Raises ValueError when the budget holds no block, when a set token budget
    cannot hold one token of every running sequence and a block, or when one group's layers differ in shape."""
    layer_windows, state_shapes, kv_shapes = verified.layer_windows, verified.state_shapes, verified.kv_shapes
    full = tuple(i for i, w in enumerate(layer_windows) if w is None)
    windowed = tuple(i for i, w in enumerate(layer_windows) if w is not None)
    if not full or not windowed:
        full, windowed = tuple(range(len(layer_windows))), ()
    window = max(w for w in layer_windows if w is not None) if windowed else None
    kv_args = (config.block_size, config.dtype, config.kv_bits, config.kv_group_size)
    per_block = kv_bytes_per_block(group_spec(spec, kv_shapes, full), *kv_args)
    window_block = kv_bytes_per_block(group_spec(spec, kv_shapes, windowed), *kv_args) if windowed \
        else 0
    state_gb = config.kv_cache_gb / 2 if config.state_cache_gb is None else config.state_cache_gb
    snapshot_bytes = int(state_gb * 2**30) if state_shapes and config.enable_prefix_caching else 0
    per_state = state_nbytes(state_shapes)
    config = resolve_limits(config, snapshot_bytes, per_block + window_block, per_state)
    budget = int(config.kv_cache_gb * 2**30) - snapshot_bytes - config.max_num_seqs * per_state
    if not per_block:  # no layer caches KV (a recurrent-only model): blocks only count tokens and hold snapshots
        num_blocks, num_window = config.num_blocks or 1 + STATE_ONLY_BLOCKS, 0
    elif window is None:
        num_blocks, num_window = config.num_blocks or 1 + budget // per_block, 0
    elif config.num_blocks:
        num_blocks = num_window = config.num_blocks
    else:
        need = window_blocks_per_sequence(window, config.block_size, config.prefill_chunk_size)
        main, extra = pool_sizes(budget, per_block, window_block, need, config.max_num_seqs)
        num_blocks, num_window = 1 + main, 1 + extra
    if min(num_blocks, num_window or num_blocks) < 2:
        raise ValueError(f"kv_cache_gb={config.kv_cache_gb} holds no block of {per_block} bytes"
                         + (f" beside state_cache_gb={state_gb} of recurrent-state snapshots and the states "
                            f"of max_num_seqs={config.max_num_seqs} running sequences: raise kv_cache_gb or "
                            "lower state_cache_gb or max_num_seqs" if state_shapes else ""))
    return KVPlan(spec, config, full, num_blocks, per_block + window_block, windowed, window, num_window,
                  state_shapes, snapshot_bytes, None if verified.reads_quantized_kv else True, kv_shapes=kv_shapes)


def resolve_limits(config: EngineConfig, snapshot_bytes: int, block_bytes: int, state_bytes: int) -> EngineConfig:
    """`config` with `max_num_seqs` (None: following the KV budget, `auto_max_num_seqs`) and
    `max_num_batched_tokens` (None: max(prefill_chunk_size, max_num_seqs + block_size)) filled in. Raises
    ValueError when a set token budget cannot hold one token of every running sequence and a block."""
    n = config.max_num_seqs
    if n is None:
        blocks_bytes = (config.num_blocks * block_bytes if config.num_blocks
                        else int(config.kv_cache_gb * 2**30) - snapshot_bytes)
        n = auto_max_num_seqs(blocks_bytes, block_bytes, config.block_size, state_bytes)
    need = n + config.block_size
    budget = config.max_num_batched_tokens or max(config.prefill_chunk_size, need)
    if budget < need:
        raise ValueError(f"max_num_batched_tokens={budget} cannot hold one token of each of max_num_seqs={n} "
                         f"running sequences and a block of prompt: set it to at least {need} or lower "
                         "max_num_seqs")
    return dataclasses.replace(config, max_num_seqs=n, max_num_batched_tokens=budget)


def window_blocks_per_sequence(window: int, block_size: int, prefill_chunk_size: int, max_draft: int = 16) -> int:
    """Window blocks one running sequence can hold at once: its window's, a prefill chunk's (or a draft
    run's, `max_draft` tokens), and two partial blocks."""
    return -(-(window + max(prefill_chunk_size, max_draft)) // block_size) + 2


def pool_sizes(budget_bytes: int, main_block_bytes: int, window_block_bytes: int, window_need: int,
               max_num_seqs: int) -> tuple[int, int]:
    """(main blocks, window blocks) within `budget_bytes` (see the module docstring); each count excludes the
    null block."""
    even = budget_bytes // (main_block_bytes + window_block_bytes)
    window = 2 * max_num_seqs * window_need
    if window >= even:
        return even, even
    return (budget_bytes - window * window_block_bytes) // main_block_bytes, window
