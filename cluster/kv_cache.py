"""The KV arrays behind the block pool, and the mlx-lm cache view that unmodified mlx-lm models run over.

This is the only module that knows mlx-lm's cache protocol (`offset`, `update_and_fetch`, `make_mask`,
and `bits`/`group_size` for quantized attention, see mlx_lm/models/base.py).

Memory layout (token-major "slots"): for each layer, keys and values are arrays of shape
[num_blocks * block_size, num_kv_heads, head_dim]; token `p` of a sequence with `block_table` lives in slot
`block_table[p // block_size] * block_size + p % block_size`. Example, block_size 4, block_table [7, 2]:
positions 0..3 are slots 28..31 and positions 4..5 are slots 8..9. A block is the contiguous slot range
[block_id * block_size, (block_id + 1) * block_size), which is what transfer and prefix reuse move.
Quantized KV (kv_bits 4 or 8) stores each array as mlx's (packed uint32, scales, biases) triple from
`mx.quantize` along head_dim, shapes [slots, kv_heads, head_dim * bits / 32] and
[slots, kv_heads, head_dim / group_size] twice.

One engine step runs a batch of B sequences, each with T_b new tokens (padded to T = max T_b):
`update_and_fetch` scatters the new K/V into their slots, then gathers each sequence's whole context
([B, kv_heads, L, head_dim], L = longest context) for attention; `make_mask` hides the padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from cluster.decode_mirror import DecodeMirror, MirrorStep, context_slots
from cluster.model import ModelSpec
from cluster.ownership import ThreadOwner


def kv_bytes_per_block(spec: ModelSpec, block_size: int, dtype: str, kv_bits: Optional[int],
                       kv_group_size: int) -> int:
    """Bytes one block occupies across all layers, K and V.

    Unquantized: layers x 2 x block_size x kv_heads x head_dim x dtype bytes. Quantized: packed values
    (bits / 8 bytes each) plus one scale and one bias of `dtype` per `kv_group_size` values.
    """
    per_value = mx.zeros((), getattr(mx, dtype)).itemsize
    values = spec.num_layers * 2 * block_size * spec.num_kv_heads * spec.head_dim
    if kv_bits is None:
        return values * per_value
    return values * kv_bits // 8 + 2 * (values // kv_group_size) * per_value


class KVStore:
    """Per-layer K/V arrays indexed by slot (see the module docstring for the layout).

    The arrays belong to `owner` (cluster/ownership.py: the engine's thread); `read_blocks`, `write_blocks` and
    `views` raise `WrongThreadError` on any other thread.
    """

    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: str = "float32",
                 kv_bits: Optional[int] = None, kv_group_size: int = 64, mirror_budget_bytes: int = 0,
                 dequantize_for_attention: Optional[bool] = None, owner: Optional[ThreadOwner] = None):
        if kv_bits is not None and spec.head_dim % kv_group_size:
            raise ValueError(f"kv_group_size={kv_group_size} does not divide head_dim={spec.head_dim}")
        self.spec, self.num_blocks, self.block_size = spec, num_blocks, block_size
        self.owner = owner or ThreadOwner("the KV store")
        self.dtype, self.kv_bits, self.kv_group_size = getattr(mx, dtype), kv_bits, kv_group_size
        slots, heads, dim = num_blocks * block_size, spec.num_kv_heads, spec.head_dim

        def make():
            if kv_bits is None:
                return mx.zeros((slots, heads, dim), self.dtype)
            return (mx.zeros((slots, heads, dim * kv_bits // 32), mx.uint32),
                    mx.zeros((slots, heads, dim // kv_group_size), self.dtype),
                    mx.zeros((slots, heads, dim // kv_group_size), self.dtype))

        self.keys = [make() for _ in range(spec.num_layers)]
        self.values = [make() for _ in range(spec.num_layers)]
        mx.eval(self.keys, self.values)
        if dequantize_for_attention is None:  # auto: float attention on the CPU backend (see the view)
            dequantize_for_attention = mx.default_device() == mx.cpu
        self.dequantize_for_attention = dequantize_for_attention
        mirrored_bits = None if dequantize_for_attention else kv_bits  # the mirror holds what attention reads
        per_token = kv_bytes_per_block(spec, 1, dtype, mirrored_bits, kv_group_size)
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

    def block_array_specs(self, num_blocks: int, num_layers: int) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype name, shape) of each array `read_blocks` returns for `num_blocks` blocks and
        `num_layers` layers: shape [num_layers, num_blocks * block_size, kv_heads, d] with d = head_dim,
        or head_dim * kv_bits / 32 (uint32 packed) and head_dim / kv_group_size (scales, biases)."""
        slots, heads, dim = num_blocks * self.block_size, self.spec.num_kv_heads, self.spec.head_dim
        dtype = str(self.dtype).removeprefix("mlx.core.")
        if self.kv_bits is None:
            parts = [(dtype, dim)]
        else:
            groups = dim // self.kv_group_size
            parts = [("uint32", dim * self.kv_bits // 32), (dtype, groups), (dtype, groups)]
        return [(name, dt, (num_layers, slots, heads, d))
                for name, (dt, d) in zip(self.array_names, parts * 2)]

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
        self._evaluate(layers)
        per_layer = [self._block_views(layer) for layer in layers]
        out = []
        for i in range(len(self.array_names)):
            first = per_layer[0][i]
            shape = (len(per_layer), len(ids)) + first.shape[1:]
            piece = first[0].nbytes
            shifts = _alias_shifts(ids, piece)
            if shifts:  # place the buffer so that no block copy 4K-aliases (see _alias_shifts)
                srcs, layer_bytes = [_address(views[i]) for views in per_layer], len(ids) * piece
                buf = _placed_empty(shape, first.dtype, lambda b: any(
                    _aliases(b + j * layer_bytes - src, shifts, -1) for j, src in enumerate(srcs)))
            else:
                buf = np.empty(shape, first.dtype)
            for j, views in enumerate(per_layer):
                # mode="clip" (ids are checked above): with the default "raise" NumPy takes into a temporary
                # and copies that into `out`, two copies instead of one (2.7x slower, measured)
                np.take(views[i], ids, axis=0, out=buf[j], mode="clip")
            out.append(buf.reshape(len(per_layer), len(ids) * self.block_size, *first.shape[2:]))
        return out

    def write_blocks(self, block_ids: Sequence[int], layers: range, arrays: Sequence[np.ndarray]) -> None:
        """Store `arrays` (as `read_blocks` returns them) into the blocks `block_ids` of `layers`, in place
        (see `_block_views` for who may call this and when). One fancy assignment (a memcpy per block) per
        array and layer. A layer whose block copies would 4K-alias (see `_alias_shifts`) goes through a bounce
        buffer placed so that neither copy does: one more copy of that layer, in cache, instead of block
        copies ~10x slower."""
        self.owner.check("KVStore.write_blocks")
        ids = self._block_ids(block_ids)
        self._evaluate(layers)
        shifts = {}
        for j, layer in enumerate(layers):
            for view, arr in zip(self._block_views(layer), arrays):
                src, piece = arr[j].reshape(len(ids), *view.shape[1:]), view[0].nbytes
                if piece not in shifts:
                    shifts[piece] = _alias_shifts(ids, piece)
                if shifts[piece]:
                    dst, at = _address(view), _address(src)
                    if _aliases(dst - at, shifts[piece], 1):
                        bounce = _placed_empty(src.shape, src.dtype, lambda b: _aliases(b - at, (0,), 1)
                                               or _aliases(dst - b, shifts[piece], 1))
                        np.copyto(bounce, src)
                        src = bounce
                view[ids] = src

    def views(self, batch: "BatchLayout") -> list["LayerCacheView"]:
        """One mlx-lm cache object per layer for this step's batch."""
        self.owner.check("KVStore.views")
        if self.kv_bits is None:
            cls = LayerCacheView
        else:
            cls = DequantizingLayerCacheView if self.dequantize_for_attention else QuantizedLayerCacheView
        return [cls(self, layer, batch) for layer in range(self.spec.num_layers)]


@dataclass
class BatchLayout:
    """Where this step's tokens go and which slots each sequence attends to.

    write_slots: int32 [B * T], the slot of each new token (padding -> null-block slots).
    gather_slots: int32 [B, L], each sequence's context slots, padded with slot 0.
    offset: the position of the first new token: an int when B == 1, else int32 [B] (rope accepts both).
    mask: None (B == 1, T == 1), "causal" (B == 1), or bool [B, 1, T, L]; with `mask_rank` 5, bool
    [B, 1, 1, T, L], for attention that splits queries into [B, kv_heads, repeats, T, head_dim] (a [B, 1, T, L]
    mask would broadcast sequence b's row onto KV head b there).
    mirror: set for decode steps served from the DecodeMirror (then gather_slots is None).
    """

    write_slots: mx.array
    gather_slots: Optional[mx.array]
    offset: Union[int, mx.array]
    mask: Union[None, str, mx.array]
    mirror: Optional[MirrorStep] = None

    @classmethod
    def build_decode(cls, store: "KVStore", rows: Sequence[str], block_tables: Sequence[Sequence[int]],
                     starts: Sequence[int], mask_rank: int = 4) -> "BatchLayout":
        """Layout for a decode step (one new token per row): from the mirror when it fits, else gathered."""
        bs = store.block_size
        step = store.mirror.plan(rows, block_tables, starts, bs) if store.mirror is not None else None
        if step is None:
            return cls.build(block_tables, starts, [1] * len(starts), bs, mask_rank)
        write = [t[p // bs] * bs + p % bs for t, p in zip(block_tables, starts)]
        return cls(mx.array(write, dtype=mx.int32), None, step.offset, _at_rank(step.mask, mask_rank), step)

    @classmethod
    def build(cls, block_tables: Sequence[Sequence[int]], starts: Sequence[int], num_new: Sequence[int],
              block_size: int, mask_rank: int = 4) -> "BatchLayout":
        """Layout for B sequences; sequence b writes positions [starts[b], starts[b] + num_new[b]).
        `mask_rank` (4 or 5) is the rank of a batched mask (see the class docstring)."""
        B, T = len(starts), max(num_new)
        L = max(s + n for s, n in zip(starts, num_new))
        write = np.zeros((B, T), dtype=np.int32)  # padding lands in the null block (block 0)
        gather = np.zeros((B, L), dtype=np.int32)
        for b, (table, start, n) in enumerate(zip(block_tables, starts, num_new)):
            ctx = start + n
            slots = context_slots(table, ctx, block_size)
            write[b, :n] = slots[start:]
            write[b, n:] = np.arange(T - n) % block_size
            gather[b, :ctx] = slots
        if B == 1:
            offset: Union[int, mx.array] = starts[0]
            mask: Union[None, str, mx.array] = None if T == 1 else "causal"
        else:
            offset = mx.array(list(starts), dtype=mx.int32)
            start_arr = offset[:, None, None, None]
            q = mx.arange(T)[None, None, :, None]
            k = mx.arange(L)[None, None, None, :]
            ctx_arr = mx.array([s + n for s, n in zip(starts, num_new)], dtype=mx.int32)[:, None, None, None]
            mask = _at_rank((k <= start_arr + q) & (k < ctx_arr), mask_rank)
        return cls(mx.array(write.ravel()), mx.array(gather), offset, mask)


class LayerCacheView:
    """mlx-lm's cache protocol for one layer over the KVStore, for one step."""

    def __init__(self, store: KVStore, layer: int, batch: BatchLayout):
        self.store, self.layer, self.batch = store, layer, batch
        self.offset = batch.offset

    def _store(self, arrays: list, part: Optional[int], new: mx.array) -> mx.array:
        """Scatter `new` [N, H, d] into the pool array (`arrays[layer]`, or its `part` when quantized);
        returns that pool array."""
        if part is None:
            arrays[self.layer] = pool = _scatter(arrays[self.layer], self.batch.write_slots, new)
        else:
            parts = list(arrays[self.layer])
            parts[part] = pool = _scatter(parts[part], self.batch.write_slots, new)
            arrays[self.layer] = tuple(parts)
        return pool

    def _update(self, arrays: list, part: Optional[int], new: mx.array, name: tuple) -> mx.array:
        """Store `new` and return the step's contexts [B, H, L, d] (from the mirror on decode steps that
        use it)."""
        pool = self._store(arrays, part, new)
        if self.batch.mirror is not None:
            return self.store.mirror.fetch(name, pool, new, self.batch.mirror, _gather)
        return _gather(pool, self.batch.gather_slots)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys/values [B, kv_heads, T, head_dim] -> the full contexts [B, kv_heads, L, head_dim]."""
        return (self._update(self.store.keys, None, _flatten_new(keys), ("k", self.layer)),
                self._update(self.store.values, None, _flatten_new(values), ("v", self.layer)))

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        """The step's attention mask (see BatchLayout); sliding windows are not supported."""
        if window_size is not None:
            raise NotImplementedError("sliding-window attention is not supported by the paged KV cache")
        mask = self.batch.mask
        if return_array and isinstance(mask, str):  # only B == 1 prefill uses "causal", never the mirror
            L = self.batch.gather_slots.shape[1]
            mask = (mx.arange(L - N, L)[:, None] >= mx.arange(L)[None])
        return mask


class QuantizedLayerCacheView(LayerCacheView):
    """The same over quantized blocks; mlx-lm sees `bits`/`group_size` and uses quantized attention."""

    def __init__(self, store: KVStore, layer: int, batch: BatchLayout):
        super().__init__(store, layer, batch)
        self.bits, self.group_size = store.kv_bits, store.kv_group_size

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys/values [B, kv_heads, T, head_dim] -> (packed, scales, biases) tuples over the contexts."""
        out = []
        for arrays, new, kind in ((self.store.keys, keys, "k"), (self.store.values, values, "v")):
            parts = mx.quantize(_flatten_new(new), group_size=self.group_size, bits=self.bits)
            out.append(tuple(self._update(arrays, i, p, (kind, self.layer, i)) for i, p in enumerate(parts)))
        return tuple(out)


class DequantizingLayerCacheView(LayerCacheView):
    """Quantized blocks in the pool, float attention: the gathered (or mirrored) context is dequantized.

    Used on MLX's CPU backend, where mlx-lm's quantized attention (`mx.quantized_matmul`) measured 3.6x
    slower in prefill and 1.7x slower in batch-8 decode than float attention (SmolLM2, 8-bit). The pool keeps
    its 4/8-bit size; only the step's transient context is float. No `bits` attribute, so mlx-lm uses
    its ordinary attention.
    """

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys/values [B, kv_heads, T, head_dim] -> float contexts [B, kv_heads, L, head_dim]."""
        store = self.store
        gs, bits = store.kv_group_size, store.kv_bits
        out = []
        for arrays, new, kind in ((store.keys, keys, "k"), (store.values, values, "v")):
            parts = mx.quantize(_flatten_new(new), group_size=gs, bits=bits)
            for i, part in enumerate(parts):  # the storage of record, as in the quantized view
                self._store(arrays, i, part)
            pool = arrays[self.layer]

            def gather(_, slots, pool=pool):
                return mx.dequantize(*(_gather(p, slots) for p in pool), group_size=gs, bits=bits)

            if self.batch.mirror is not None:
                flat = mx.dequantize(*parts, group_size=gs, bits=bits).astype(store.dtype)
                out.append(store.mirror.fetch((kind, self.layer), pool, flat, self.batch.mirror, gather))
            else:
                out.append(gather(None, self.batch.gather_slots))
        return tuple(out)


# MLX dtype -> the NumPy dtype of its pool's views and wire frames (NumPy has no bfloat16: its raw words)
_NUMPY_DTYPES = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16, mx.uint32: np.uint32}

# 4K aliasing: glibc's memcpy copies a piece of more than 2 KiB about 10x slower on some x86 CPUs when
# (dst - src) mod 4096 is in [1, 15] (measured on this project's AMD EPYC VM, glibc 2.36; 16..63 cost up to
# 1.3x): a load then looks as if it depended on a store just made to the same page offset. Block copies are one
# memcpy per block; in one (layer, array), block k of the message and block ids[k] of the pool are at
# (dst - src) of the first pair plus (ids[k] - k) * piece, so a handful of shifts covers every block.
_PAGE, _ALIAS_WINDOW, _SMALL_COPY = 4096, 64, 2048


def _alias_shifts(ids: np.ndarray, piece: int) -> tuple[int, ...]:
    """The distinct (ids[k] - k) * piece mod 4096; () when pieces are too small to 4K-alias."""
    if piece <= _SMALL_COPY or not ids.size:
        return ()
    return tuple(np.unique((ids - np.arange(ids.size)) * piece % _PAGE).tolist())


def _aliases(delta: int, shifts: Sequence[int], sign: int) -> bool:
    """Whether some block copy lands at (delta + sign * shift) mod 4096 in [1, 63]: delta = dst - src of the
    first pair, sign 1 when the pool is the destination (write), -1 when it is the source (read)."""
    return any(0 < (delta + sign * s) % _PAGE < _ALIAS_WINDOW for s in shifts)


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _placed_empty(shape: tuple, dtype, bad: Callable[[int], bool]) -> np.ndarray:
    """An uninitialized C-contiguous array at the first of 64 offsets (multiples of 64 bytes into one page of
    slack) whose address `bad` does not reject; offset 0 if `bad` rejects them all."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + _PAGE, np.uint8)
    base = _address(raw)
    shift = next((s for s in range(0, _PAGE, _ALIAS_WINDOW) if not bad(base + s)), 0)
    return raw[shift:shift + nbytes].view(dtype).reshape(shape)


def _at_rank(mask: Union[None, mx.array], rank: int) -> Union[None, mx.array]:
    """A [B, 1, T, L] mask as [B, 1, 1, T, L] for rank 5 (one more broadcast axis after the batch); else as is."""
    if rank == 4 or mask is None:
        return mask
    return mx.expand_dims(mask, 1)


def _flatten_new(x: mx.array) -> mx.array:
    """[B, H, T, D] -> [B * T, H, D] in (b, t) order, matching BatchLayout.write_slots."""
    B, H, T, D = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B * T, H, D)


def _scatter(pool: mx.array, slots: mx.array, new: mx.array) -> mx.array:
    pool[slots] = new.astype(pool.dtype)
    return pool


def _gather(pool: mx.array, slots: mx.array) -> mx.array:
    """pool [S, H, D] gathered at slots [B, L] -> [B, H, L, D], made contiguous once here (measured ~10%
    faster decode on the CPU backend than handing attention the strided view)."""
    return mx.contiguous(pool[slots].transpose(0, 2, 1, 3))
