"""One cached KV block as a file of the SSD tier (cluster/kv/disk_tier.py): its arrays exactly as the pool holds
them (`KVStore.read_blocks`: quantized blocks stay packed, bfloat16 travels as uint16 words), the tokens it
caches, and a checksum over all of it.

Layout: `MAGIC` (8 bytes), the header's length (uint32, little-endian), the header (msgpack: block hash, token
ids, and per array its name, dtype name and shape), the arrays' bytes one after another, then xxh3-64 of
everything before it (8 bytes, little-endian). `decode` refuses (`BlockFileError`) a file that is short, torn,
flipped anywhere, of another format, or whose block hash, tokens or arrays are not the ones expected: a bad file
is a miss, never a wrong answer.
"""

from __future__ import annotations

import struct
from typing import Sequence

import msgpack
import numpy as np
import xxhash

MAGIC = b"MLXPDKV1"
_LEN = struct.Struct("<I")
_SUM = struct.Struct("<Q")


class BlockFileError(ValueError):
    """A block file that cannot be used (see the module docstring); the message says why."""


def encode(block_hash: int, token_ids: Sequence[int], names: Sequence[str], arrays: Sequence[np.ndarray]) -> bytes:
    """The file's bytes for block `block_hash` caching `token_ids`, with `arrays` (one per name in `names`)."""
    header = msgpack.packb({"hash": block_hash, "tokens": list(token_ids),
                            "arrays": [[n, a.dtype.str, list(a.shape)] for n, a in zip(names, arrays)]})
    parts = [MAGIC, _LEN.pack(len(header)), header] + [np.ascontiguousarray(a).tobytes() for a in arrays]
    body = b"".join(parts)
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


def decode(data: bytes, block_hash: int, token_ids: Sequence[int], names: Sequence[str]) -> list[np.ndarray]:
    """The arrays of a file's bytes `data`, which must hold block `block_hash` caching exactly `token_ids` with the
    arrays `names`. Raises BlockFileError otherwise."""
    if len(data) < len(MAGIC) + _LEN.size + _SUM.size or not data.startswith(MAGIC):
        raise BlockFileError("not a KV block file (short, or another format)")
    body, (checksum,) = memoryview(data)[:-_SUM.size], _SUM.unpack(data[-_SUM.size:])  # no copy of the body
    if xxhash.xxh3_64_intdigest(body) != checksum:
        raise BlockFileError("checksum mismatch (a torn or corrupted file)")
    (n,) = _LEN.unpack_from(body, len(MAGIC))
    at = len(MAGIC) + _LEN.size
    try:
        header = msgpack.unpackb(body[at:at + n])
        specs = [(name, np.dtype(dt), tuple(shape)) for name, dt, shape in header["arrays"]]
        stored_hash, stored_tokens = header["hash"], header["tokens"]
    except (ValueError, TypeError, KeyError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise BlockFileError(f"unreadable header ({exc})") from None
    if stored_hash != block_hash or list(stored_tokens) != list(token_ids):
        raise BlockFileError("it caches other tokens than the prompt's block (a hash collision)")
    if [name for name, _, _ in specs] != list(names):
        raise BlockFileError(f"arrays {[s[0] for s in specs]}, expected {list(names)}")
    at += n
    arrays = []
    for _, dtype, shape in specs:
        size = dtype.itemsize * int(np.prod(shape))
        if at + size > len(body):
            raise BlockFileError("shorter than its header says")
        arrays.append(np.frombuffer(body, dtype=dtype, count=size // dtype.itemsize, offset=at).reshape(shape))
        at += size
    if at != len(body):
        raise BlockFileError("longer than its header says")
    return arrays
