"""Tuning for machines that run MLX's CPU backend: the Linux x86-64 development VMs and CI, not the Macs.

mlx-pd is built for Apple Silicon, where MLX runs on Metal. Its tests and benchmarks run on Linux, where the
`mlx[cpu]` wheel runs every array operation on the CPU. Two things are slow there, and this module makes the
choices that work around them. The KV store (cluster/kv/store.py) asks this module, and nothing else in the
engine knows about these quirks:

1. **Quantized attention.** On the CPU backend, mlx-lm's quantized attention (`mx.quantized_matmul` over the
   packed KV) measured 3.6x slower in prefill and 1.7x slower in batch-8 decode than float attention (SmolLM2,
   8-bit KV). So `attend_in_float()` is True there: the KV store keeps its blocks 4/8-bit, and
   `cluster.kv.cache_view.DequantizingLayerCacheView` dequantizes each step's gathered context instead. On Metal,
   mlx-lm's quantized attention kernels read the packed blocks directly and are the fast path, so
   `attend_in_float()` is False and `QuantizedLayerCacheView` is used.

2. **4K aliasing in block copies.** Transfer moves KV blocks between the pool and message buffers with one
   memcpy per block (`KVStore.read_blocks`/`write_blocks`). On some x86 CPUs, glibc's memcpy of a piece over
   2 KiB runs about 10x slower when (dst - src) mod 4096 is in [1, 15] (16..63 cost up to 1.3x): a load then
   looks as if it depended on a store just made at the same page offset. This was measured on this project's
   AMD EPYC VM with glibc 2.36. `CopyPlacement` places the buffers of those copies, within one page of slack,
   so that no copy lands in that window. It is a property of x86 cores (Intel and AMD document it), not of
   MLX; it was never measured on Apple Silicon. It runs on every machine because it costs only a few integer
   checks and at most one page of slack per buffer, and it changes where a buffer sits, never what it holds.

Process-level quirks of the same machines, the OpenBLAS preload and CPU pinning, are in
cluster/launch/platform.py. Two measured defaults stay with what they set: float32 as the default dtype off
macOS (cluster/config.py) and the verify cost of a draft token (decode_node/drafters.py, `VERIFY_COST`).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import mlx.core as mx
import numpy as np


def attend_in_float(device: Optional[mx.Device] = None) -> bool:
    """Whether quantized KV should be dequantized for attention on `device` (default: MLX's default device):
    True on the CPU backend, False on Metal (see the module docstring, item 1)."""
    return (device or mx.default_device()) == mx.cpu


# 4K aliasing (module docstring, item 2). In one (layer, array), block k of the message and block ids[k] of the
# pool are at (dst - src) of the first pair plus (ids[k] - k) * piece, so a handful of shifts covers every block.
_PAGE, _ALIAS_WINDOW, _SMALL_COPY = 4096, 64, 2048


def alias_shifts(ids: np.ndarray, piece: int) -> tuple[int, ...]:
    """The distinct (ids[k] - k) * piece mod 4096; () when pieces are too small to 4K-alias."""
    if piece <= _SMALL_COPY or not ids.size:
        return ()
    return tuple(np.unique((ids - np.arange(ids.size)) * piece % _PAGE).tolist())


def aliases(delta: int, shifts: Sequence[int], sign: int) -> bool:
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


class CopyPlacement:
    """Buffer placement for copying the blocks `ids` between the pool's block views and message arrays, so
    that no block copy 4K-aliases. One per `read_blocks`/`write_blocks` call (it caches shifts per piece size)."""

    def __init__(self, ids: np.ndarray):
        self.ids = ids
        self._shifts: dict[int, tuple[int, ...]] = {}

    def shifts(self, piece: int) -> tuple[int, ...]:
        """`alias_shifts` of these ids for pieces (one block of one array of one layer) of `piece` bytes."""
        if piece not in self._shifts:
            self._shifts[piece] = alias_shifts(self.ids, piece)
        return self._shifts[piece]

    def read_buffer(self, shape: tuple, dtype, sources: Sequence[np.ndarray]) -> np.ndarray:
        """An uninitialized array of `shape` [layers, len(ids), ...] for `np.take(sources[j], ids, axis=0,
        out=buffer[j])`, layer by layer, placed so that none of those block copies 4K-aliases."""
        piece = sources[0][0].nbytes
        shifts = self.shifts(piece)
        if not shifts:
            return np.empty(shape, dtype)
        starts, layer_bytes = [_address(s) for s in sources], len(self.ids) * piece
        return _placed_empty(shape, dtype, lambda b: any(
            aliases(b + j * layer_bytes - start, shifts, -1) for j, start in enumerate(starts)))

    def write_source(self, dst: np.ndarray, src: np.ndarray) -> np.ndarray:
        """What to copy into `dst[ids]` for `src` [len(ids), ...]: `src` itself, or, when its block copies would
        4K-alias, a bounce copy of it placed so that neither copy does (one more copy, in cache, instead of
        block copies ~10x slower)."""
        shifts = self.shifts(dst[0].nbytes)
        if not shifts:
            return src
        to, at = _address(dst), _address(src)
        if not aliases(to - at, shifts, 1):
            return src
        bounce = _placed_empty(src.shape, src.dtype, lambda b: aliases(b - at, (0,), 1) or aliases(to - b, shifts, 1))
        np.copyto(bounce, src)
        return bounce
