"""The mlx-lm cache view that unmodified mlx-lm models run over: one object per layer and step, over the
KV store's arrays (cluster/kv/store.py) and the step's BatchLayout (cluster/kv/layout.py).

This is the only module that knows mlx-lm's cache protocol (`offset`, `update_and_fetch`, `make_mask`,
and `bits`/`group_size` for quantized attention, see mlx_lm/models/base.py).

`update_and_fetch` scatters the step's new K/V into their slots, then returns each sequence's whole context
([B, kv_heads, L, head_dim]) for attention, gathered or from the decode mirror; `make_mask` hides the padding.
Quantized KV has two views: `QuantizedLayerCacheView` hands mlx-lm the packed context (its quantized
attention, the fast path on Metal); `DequantizingLayerCacheView` hands it the context dequantized (float
attention, the fast path on the CPU backend). `KVStore.views` picks one (cluster/kv/cpu_backend.py says why).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import mlx.core as mx

from cluster.kv.layout import BatchLayout

if TYPE_CHECKING:
    from cluster.kv.store import KVStore


NO_SEND = mx.zeros((0,))  # `LayerCacheView.keys` until a pipeline-parallel body hangs its send on it


class LayerCacheView:
    """mlx-lm's cache protocol for one layer over the KVStore, for one step.

    `keys`: a pipeline-parallel rank's body (mlx-lm's `PipelineMixin` families) hangs the hidden state it sends
    to the next rank on its last layer's cache (`cache[-1].keys = mx.depends(cache[-1].keys, h)`), so that
    evaluating the KV runs the send; here it is only somewhere for that hook to land (`NO_SEND` until then): the
    runner evaluates a pipeline rank's whole forward, its send included (cluster/runner.py)."""

    keys = NO_SEND

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
        """The step's attention mask (see BatchLayout); with `window_size`, the mask of a sliding-window
        layer (`BatchLayout.windowed_mask`: the pool keeps every position, attention sees the window)."""
        if window_size is not None:
            return self.batch.windowed_mask(window_size)
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

    Used where `KVStore.dequantize_for_attention` is set: on MLX's CPU backend, where float attention is the
    faster (cluster.kv.cpu_backend.attend_in_float), and for families whose attention reads float KV only. The
    pool keeps its 4/8-bit size; only the step's transient context is float. No `bits` attribute, so mlx-lm
    uses its ordinary attention.
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
