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

Every block hash of the cluster is computed by `hash_block`, and each prompt block once: the router hashes a
prompt for placement and the request carries the hashes with the key they were computed under
(`GenerateRequest.prompt_block_hashes`, `prompt_hash_key`); a worker takes them when that key is its own
(`carried_hashes`) and computes only what is missing (`extend_block_hashes`), and a KV transfer's offer
carries them on to the decode worker.
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


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int, extra_key: int,
                        num_blocks: Optional[int] = None) -> list[int]:
    """Extend `hashes`, the chained hashes of the leading full blocks of `token_ids` under `extra_key`, in place
    to its first `num_blocks` full blocks (None: all of them), hashing only the blocks it lacks; returns it.
    Example: 3 hashes known, `num_blocks` 5 -> blocks 3 and 4 are hashed, chained from the third hash."""
    stop = len(token_ids) // block_size if num_blocks is None else min(num_blocks, len(token_ids) // block_size)
    if len(hashes) < stop:
        hashes.extend(block_hashes(token_ids[:stop * block_size], block_size, extra_key, start=len(hashes),
                                   parent=hashes[-1] if hashes else None))
    return hashes


def carried_hashes(hashes: Sequence[int], key: Optional[int], extra_key: int, num_tokens: int,
                   block_size: int) -> list[int]:
    """The block hashes a prompt of `num_tokens` tokens carries from elsewhere (`hashes`, chained under `key`),
    as a list this worker may extend: all of them when `key` is its own first-block key `extra_key` (the same
    model, revision, KV format and salt: the same hashes it would compute), at most one per full block; none
    when the key differs or is unknown, so the worker hashes the prompt itself."""
    if key is None or key != extra_key:
        return []
    return list(hashes[:num_tokens // block_size])
