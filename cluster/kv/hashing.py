"""Chained block hashes: the identity of a prefix-cache block, equal on every process and machine.

    hash(block 0) = H(extra_keys, token_ids[0:B])
    hash(block i) = H(hash(block i-1), token_ids[i*B:(i+1)*B])

`H` is xxh3-64 with seed 0 over a canonical byte encoding (little-endian int64 parent, uint32 token
ids); `extra_keys` is a string of the model id, revision, KV format and optional cache salt, so that
blocks of different models, KV formats or tenants never match. `first_block_key` is the one place that key is
assembled: the engine's scheduler, the KV transfer handshake and the router's prefix index all call it, so
their hashes of one prompt agree. Only full blocks are hashed. A hash hit is
always confirmed by comparing token ids (see `BlockPool`), so a collision is a miss, never a wrong answer.
The scheme is vLLM's (vllm/v1/core/kv_cache_utils.py, hash_block_tokens) with a deterministic hash.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import xxhash

_SEED = 0


def kv_format_name(dtype: str, kv_bits: Optional[int], kv_group_size: int, block_size: int) -> str:
    """The KV format as it enters the first block's hash, e.g. "float32/kvfull/g64/b32" or
    "bfloat16/kv4/g32/b32": blocks of different formats must never match."""
    return f"{dtype}/kv{kv_bits or 'full'}/g{kv_group_size}/b{block_size}"


def block_extra_key(model_id: str, revision: str, kv_format: str, cache_salt: Optional[str] = None) -> int:
    """The 64-bit key mixed into the first block: model, weights revision, KV format and salt."""
    text = f"{model_id}\x00{revision}\x00{kv_format}\x00{cache_salt or ''}"
    return xxhash.xxh3_64_intdigest(text.encode(), seed=_SEED)


def first_block_key(model_id: str, revision: str, dtype: str, kv_bits: Optional[int], kv_group_size: int,
                    block_size: int, cache_salt: Optional[str] = None) -> int:
    """The key mixed into a prompt's first block hash, for a model (id and weights revision) served with a KV
    format (`dtype`, `kv_bits`, `kv_group_size`, `block_size`), under the tenant's optional `cache_salt`."""
    return block_extra_key(model_id, revision, kv_format_name(dtype, kv_bits, kv_group_size, block_size), cache_salt)


def hash_block(parent: int, token_ids: Sequence[int]) -> int:
    """Hash one full block given its parent's hash (or the extra key for block 0). Returns an int < 2**64."""
    data = np.asarray(token_ids, dtype="<u4").tobytes()
    return xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + data, seed=_SEED)


def block_hashes(token_ids: Sequence[int], block_size: int, extra_key: int,
                 start: int = 0, parent: Optional[int] = None) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` from block index `start` on.

    `parent` is the hash of block `start - 1` (required when `start > 0`). Trailing tokens that do not fill
    a block are not hashed. Example: 70 tokens, block_size 32 -> 2 hashes (tokens 0..31 and 32..63).
    """
    if start > 0 and parent is None:
        raise ValueError("parent hash is required when start > 0")
    out: list[int] = []
    prev = extra_key if start == 0 else parent
    for i in range(start, len(token_ids) // block_size):
        prev = hash_block(prev, token_ids[i * block_size:(i + 1) * block_size])
        out.append(prev)
    return out
