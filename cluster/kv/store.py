"""The KV arrays behind the block pool (`KVStore`): what a block's K/V are, where they live, and whole-block
copies for transfer (kv_transfer/).

Memory layout (token-major "slots"): for each layer, keys and values are arrays of shape
[num_blocks * block_size, num_kv_heads, head_dim] (values: `spec.v_dim` on the last axis, which differs from
head_dim for latent attention); token `p` of a sequence with `block_table` lives in slot
`block_table[p // block_size] * block_size + p % block_size`. Example, block_size 4, block_table [7, 2]:
positions 0..3 are slots 28..31 and positions 4..5 are slots 8..9. A block is the contiguous slot range
[block_id * block_size, (block_id + 1) * block_size), which is what transfer and prefix reuse move.
Quantized KV (kv_bits 4 or 8) stores each array as mlx's (packed uint32, scales, biases) triple from
`mx.quantize` along head_dim, shapes [slots, kv_heads, head_dim * bits / 32] and
[slots, kv_heads, head_dim / group_size] twice.

Each step's mlx-lm cache objects come from `KVStore.views` (cluster/kv/cache_view.py), over the step's
`BatchLayout` (cluster/kv/layout.py).
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from cluster.kv.cpu_backend import CopyPlacement, attend_in_float
from cluster.kv.decode_mirror import DecodeMirror
from cluster.kv.cache_view import DequantizingLayerCacheView, LayerCacheView, QuantizedLayerCacheView
from cluster.kv.layout import BatchLayout
from cluster.model import ModelSpec
from cluster.ownership import ThreadOwner


def kv_bytes_per_block(spec: ModelSpec, block_size: int, dtype: str, kv_bits: Optional[int],
                       kv_group_size: int) -> int:
    """Bytes one block occupies across all layers, K and V.

    Unquantized: layers x block_size x kv_heads x (head_dim + v_dim) x dtype bytes. Quantized: packed values
    (bits / 8 bytes each) plus one scale and one bias of `dtype` per `kv_group_size` values.
    """
    per_value = mx.zeros((), getattr(mx, dtype)).itemsize
    values = spec.num_layers * block_size * spec.num_kv_heads * (spec.head_dim + spec.v_dim)
    if kv_bits is None:
        return values * per_value
    return values * kv_bits // 8 + 2 * (values // kv_group_size) * per_value


class KVStore:
    """Per-layer K/V arrays indexed by slot (see the module docstring for the layout).

    The arrays belong to `owner` (cluster/ownership.py: the engine's thread); `read_blocks`, `write_blocks` and
    `views` raise `WrongThreadError` on any other thread. `dequantize_for_attention` (quantized KV only): the
    views dequantize each step's context for float attention; None chooses by device
    (cluster.kv.cpu_backend.attend_in_float).
    """

    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: str = "float32",
                 kv_bits: Optional[int] = None, kv_group_size: int = 64, mirror_budget_bytes: int = 0,
                 dequantize_for_attention: Optional[bool] = None, owner: Optional[ThreadOwner] = None):
        for what, width in (("head_dim", spec.head_dim), ("the value width", spec.v_dim)):
            if kv_bits is not None and width % kv_group_size:
                raise ValueError(f"kv_group_size={kv_group_size} does not divide {what}={width}")
        self.spec, self.num_blocks, self.block_size = spec, num_blocks, block_size
        self.owner = owner or ThreadOwner("the KV store")
        self.dtype, self.kv_bits, self.kv_group_size = getattr(mx, dtype), kv_bits, kv_group_size
        slots, heads = num_blocks * block_size, spec.num_kv_heads

        def make(dim: int):
            if kv_bits is None:
                return mx.zeros((slots, heads, dim), self.dtype)
            return (mx.zeros((slots, heads, dim * kv_bits // 32), mx.uint32),
                    mx.zeros((slots, heads, dim // kv_group_size), self.dtype),
                    mx.zeros((slots, heads, dim // kv_group_size), self.dtype))

        self.keys = [make(spec.head_dim) for _ in range(spec.num_layers)]
        self.values = [make(spec.v_dim) for _ in range(spec.num_layers)]
        mx.eval(self.keys, self.values)
        if dequantize_for_attention is None:  # auto: float attention on the CPU backend (cluster/kv/cpu_backend.py)
            dequantize_for_attention = attend_in_float()
        self.dequantize_for_attention = dequantize_for_attention
        mirrored_bits = None if dequantize_for_attention else kv_bits  # the mirror holds what attention reads
        per_token = kv_bytes_per_block(spec, 1, dtype, mirrored_bits, kv_group_size)
        # a worker group's link to the other ranks' pools (cluster/parallel/group_kv.py's GroupKV; None alone)
        self.ranks = None
        self.mirror = DecodeMirror(per_token, mirror_budget_bytes) if mirror_budget_bytes > 0 else None

    @property
    def nbytes(self) -> int:
        """Bytes held by all K/V arrays."""
        leaves = [a for kv in (self.keys, self.values) for x in kv for a in (x if isinstance(x, tuple) else (x,))]
        return sum(a.nbytes for a in leaves)

    # -- whole blocks, for transfer (kv_transfer/) -------------------------------------------------------

    @property
    def array_names(self) -> tuple[str, ...]:
        """The arrays a batch of blocks travels as: ("k", "v"), or for quantized KV
        ("k.packed", "k.scales", "k.biases", "v.packed", "v.scales", "v.biases")."""
        if self.kv_bits is None:
            return ("k", "v")
        return tuple(f"{kv}.{part}" for kv in "kv" for part in ("packed", "scales", "biases"))

    @property
    def wire_kv_heads(self) -> int:
        """KV heads of a block on the wire: this pool's, times the ranks that split them in a worker group."""
        return self.spec.num_kv_heads * (self.ranks.head_factor if self.ranks is not None else 1)

    def block_array_specs(self, num_blocks: int, num_layers: int) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype name, shape) of each array `read_shipped_blocks` returns for `num_blocks` blocks and
        `num_layers` layers: shape [num_layers, num_blocks * block_size, kv_heads, d] (kv_heads:
        `wire_kv_heads`) with d = the width w
        (head_dim for keys, the spec's v_dim for values), or w * kv_bits / 32 (uint32 packed) and
        w / kv_group_size (scales, biases)."""
        slots, heads = num_blocks * self.block_size, self.wire_kv_heads
        dtype = str(self.dtype).removeprefix("mlx.core.")

        def parts(dim: int) -> list[tuple[str, int]]:
            if self.kv_bits is None:
                return [(dtype, dim)]
            groups = dim // self.kv_group_size
            return [("uint32", dim * self.kv_bits // 32), (dtype, groups), (dtype, groups)]

        return [(name, dt, (num_layers, slots, heads, d))
                for name, (dt, d) in zip(self.array_names, parts(self.spec.head_dim) + parts(self.spec.v_dim))]

    def _leaves(self, layer: int) -> list[mx.array]:
        """The layer's pool arrays in `array_names` order."""
        return [a for kv in (self.keys, self.values) for a in
                (kv[layer] if isinstance(kv[layer], tuple) else (kv[layer],))]

    def _block_views(self, layer: int) -> list[np.ndarray]:
        """Writable NumPy views of the layer's pool arrays, `array_names` order, shaped
        [num_blocks, block_size, kv_heads, d]; bfloat16 as uint16. Zero-copy: a write lands in the MLX array.
        Only the pool's owner thread may use them, between engine steps (no step is building a graph then),
        and only on blocks no running sequence reads (reserved for a transfer). Keep them transient: a view
        holds its MLX array (and buffer) alive, so one kept across steps would stop MLX reusing that memory.

        The views come straight from the arrays' buffer protocol (`np.frombuffer`, ~1 us each), which also
        evaluates a lazy array; no MLX op is built (an `a.view(mx.uint16)` per bfloat16 array costs a graph
        evaluation each, ~8 us idle and milliseconds when the CPU is contended)."""
        shape = (self.num_blocks, self.block_size)
        out = []
        for a in self._leaves(layer):
            view = np.frombuffer(a, dtype=_NUMPY_DTYPES[a.dtype])
            if view.size != a.size:  # pool arrays are always row-contiguous; never read a strided buffer as flat
                raise ValueError(f"pool array of shape {a.shape} exports {view.size} elements, expected {a.size}")
            out.append(view.reshape(*shape, *a.shape[1:]))
        return out

    def _evaluate(self, layers: range) -> None:
        """One `mx.eval` over the layers' pool arrays (a few us when they are already evaluated, as between
        steps), so `_block_views` never evaluates them one at a time."""
        mx.eval([a for layer in layers for a in self._leaves(layer)])

    def _block_ids(self, block_ids: Sequence[int]) -> np.ndarray:
        """`block_ids` as an index array, checked to lie in the pool (read_blocks indexes with mode="clip")."""
        ids = np.asarray(block_ids, dtype=np.intp).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise IndexError(f"block ids {block_ids!r} are outside the pool of {self.num_blocks} blocks")
        return ids

    def read_blocks(self, block_ids: Sequence[int], layers: range) -> list[np.ndarray]:
        """Copies of the blocks' K/V, one array per `array_names` entry, shaped as in `block_array_specs`
        (bfloat16 as uint16 words). One `np.take` per array and layer: a memcpy per block (blocks are
        contiguous slot ranges). Slots beyond a partial block's tokens hold whatever was there (never read)."""
        self.owner.check("KVStore.read_blocks")
        ids = self._block_ids(block_ids)
        placement = CopyPlacement(ids)  # no block copy may 4K-alias (cluster/kv/cpu_backend.py)
        self._evaluate(layers)
        per_layer = [self._block_views(layer) for layer in layers]
        out = []
        for i in range(len(self.array_names)):
            first = per_layer[0][i]
            shape = (len(per_layer), len(ids)) + first.shape[1:]
            buf = placement.read_buffer(shape, first.dtype, [views[i] for views in per_layer])
            for j, views in enumerate(per_layer):
                # mode="clip" (ids are checked above): with the default "raise" NumPy takes into a temporary
                # and copies that into `out`, two copies instead of one (2.7x slower, measured)
                np.take(views[i], ids, axis=0, out=buf[j], mode="clip")
            out.append(buf.reshape(len(per_layer), len(ids) * self.block_size, *first.shape[2:]))
        return out

    def write_blocks(self, block_ids: Sequence[int], layers: range, arrays: Sequence[np.ndarray]) -> None:
        """Store `arrays` (as `read_blocks` returns them) into the blocks `block_ids` of `layers`, in place
        (see `_block_views` for who may call this and when). One fancy assignment (a memcpy per block) per
        array and layer. A layer whose block copies would 4K-alias goes through a bounce buffer placed so that
        neither copy does (`CopyPlacement.write_source`, cluster/kv/cpu_backend.py)."""
        self.owner.check("KVStore.write_blocks")
        ids = self._block_ids(block_ids)
        placement = CopyPlacement(ids)
        self._evaluate(layers)
        for j, layer in enumerate(layers):
            for view, arr in zip(self._block_views(layer), arrays):
                view[ids] = placement.write_source(view, arr[j].reshape(len(ids), *view.shape[1:]))

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block `src`'s K/V (every layer, every slot) into block `dst`, in place: a prefix-cache hit on
        the head of a cached block (`PrefixMatcher`) starts its sequence's own block from a copy. The rules of
        `write_blocks` apply: the owner thread, between steps, `dst` read by no running sequence."""
        layers = range(self.spec.num_layers)
        if layers:  # a store without layers (a recurrent-only model's) has nothing to copy
            self.write_blocks([dst], layers, self.read_blocks([src], layers))

    def views(self, batch: BatchLayout) -> list[LayerCacheView]:
        """One mlx-lm cache object per layer for this step's batch."""
        self.owner.check("KVStore.views")
        if self.kv_bits is None:
            cls = LayerCacheView
        else:
            cls = DequantizingLayerCacheView if self.dequantize_for_attention else QuantizedLayerCacheView
        return [cls(self, layer, batch) for layer in range(self.spec.num_layers)]


# MLX dtype -> the NumPy dtype of its pool's views and wire frames (NumPy has no bfloat16: its raw words)
_NUMPY_DTYPES = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16, mx.uint32: np.uint32}


def shipped_num_layers(store) -> int:
    """The layers of any kind of store's blocks on the wire: its own, or in a worker group whose ranks hold
    ranges of layers (pipeline parallelism) the whole model's (`store.ranks.shard`)."""
    ranks = getattr(store, "ranks", None)  # a KVStore of a worker group's leader; other kinds have none
    return store.spec.num_layers if ranks is None else ranks.shard.num_layers(store.spec.num_layers)


def read_shipped_blocks(store, block_ids: Sequence[int], layers: range) -> list[np.ndarray]:
    """What the KV transfer ships of blocks `block_ids` of `layers` (of `shipped_num_layers`) from any kind of
    store: its `read_blocks`, and in a worker group whose ranks split the heads or the layers, every rank's share
    (`store.ranks.read`: one all-gather across the group), shaped as in `block_array_specs`."""
    ranks = getattr(store, "ranks", None)
    return store.read_blocks(block_ids, layers) if ranks is None else ranks.read(store, block_ids, layers)


def write_received_blocks(store, block_ids: Sequence[int], layers: range, arrays: Sequence[np.ndarray]) -> None:
    """Store blocks as the KV transfer brings them (`block_array_specs`, of `shipped_num_layers`' layers) into
    any kind of store (`write_blocks`); in a worker group, each rank gets its share (`store.ranks.write`)."""
    ranks = getattr(store, "ranks", None)
    if ranks is None:
        store.write_blocks(block_ids, layers, arrays)
    else:
        ranks.write(store, block_ids, layers, arrays)
