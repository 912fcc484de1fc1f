"""What the SSD tier's blocks are valid for (cluster/kv/disk_tier.py): a fingerprint of the weights' bytes, the
model's config, the KV format and the MLX and mlx-lm versions. Two servers share a tier's blocks only when every one of
those is equal; anything else (retrained weights of the same shapes and file sizes, another dtype, block size or
quantization, another shard of a worker group, another MLX) gets a folder of its own and never reads them.

Hashing every weight byte is the price (xxh3-128, at the disk's speed); it is paid once per file: each file's
digest is kept in `weight-digests.json` beside the tier, keyed by the file's path, size, modification and change
times and inode (a file rewritten or replaced gets new ones, so it is hashed again).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import xxhash

from cluster.kv.block_file import MAGIC

DIGESTS = "weight-digests.json"
_CHUNK = 8 << 20


def file_digest(path: Path) -> str:
    """xxh3-128 of the file's bytes, hex."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def weights_digest(model_dir: Path, cache_dir: Optional[Path] = None) -> str:
    """One digest of every weight file (`*.safetensors`, `*.gguf`) and the config.json of `model_dir`, from
    their bytes; per-file digests are reused from `cache_dir/weight-digests.json` while a file's size, times and
    inode are unchanged (and written back there). Raises FileNotFoundError when the folder has no config.json."""
    model_dir = Path(model_dir).resolve()
    cache_path = None if cache_dir is None else Path(cache_dir) / DIGESTS
    known: dict = {}
    if cache_path is not None and cache_path.is_file():
        try:
            known = json.loads(cache_path.read_text())
        except (OSError, ValueError):
            known = {}
    total, changed = xxhash.xxh3_128(), False
    total.update((model_dir / "config.json").read_bytes())
    for f in sorted(p for pattern in ("*.safetensors", "*.gguf") for p in model_dir.glob(pattern)):
        st = f.stat()
        key, stamp = str(f), [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        entry = known.get(key)
        if not (isinstance(entry, list) and entry[:4] == stamp):
            entry, changed = stamp + [file_digest(f)], True
            known[key] = entry
        total.update(f"{f.name}:{entry[4]}".encode())
    if changed and cache_path is not None:
        tmp = cache_path.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps(known))
            os.chmod(tmp, 0o600)
            os.replace(tmp, cache_path)
        except OSError:  # a cache we cannot write is hashed again next time
            tmp.unlink(missing_ok=True)
    return total.hexdigest()


def tier_fingerprint(weights: str, kv_format: str, shard: str = "whole") -> str:
    """The folder name of a tier's blocks: the weights' digest (`weights_digest`), the KV format
    (`cluster.kv.hashing.kv_format_name`: dtype, quantization, block size), the shard this process holds
    ("whole", or a worker group's rank and split) and the MLX and mlx-lm versions (the model code), with the
    block file's format."""
    import mlx.core as mx
    import mlx_lm

    text = json.dumps([weights, kv_format, shard, mx.__version__, mlx_lm.__version__, MAGIC.decode()])
    return xxhash.xxh3_128_hexdigest(text.encode())
