"""Opening a server's SSD tier (cluster/kv/disk_tier.py) from its engine config: where its folder is, whether
this model and process can have one, and the fingerprint its blocks are kept under."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Optional

from cluster.kv.disk_tier import DiskTier

log = logging.getLogger(__name__)


def default_tier_dir(worker: Optional[str] = None) -> Path:
    """Where a tier lives without `ssd_cache_dir`: `kv-tier` in mlx-pd's cache folder (`$MLX_PD_CACHE` or
    ~/.cache/mlx-pd), and in it a folder per cluster worker (`worker`: its name), since each server needs its
    own."""
    root = Path(os.environ.get("MLX_PD_CACHE") or Path.home() / ".cache" / "mlx-pd") / "kv-tier"
    return root if worker is None else root / worker


def tier_for(manager, spec, config, shard: str = "whole", rank: Optional[int] = None) -> Optional[DiskTier]:
    """The SSD tier a server's `manager` (`KVManager`) keeps under its pool, attached, per `config`
    (`ssd_cache_gb`, `ssd_cache_dir`) for the model `spec` (`cluster.model.ModelSpec`, whose `weights_dir` is
    fingerprinted); None when the config keeps none, or (logged) when the model cannot have one: the prefix
    cache off, no weights folder. `shard`: how a worker group splits each block, and `rank` (None: not a
    group's) which part this process holds, in a folder `<fingerprint>-r<rank>` (cluster/parallel/group_tier.py);
    a follower's tier (rank > 0) follows the leader's (no LRU of its own).
    Raises TierInUse when another server holds the folder, ValueError when the folder cannot be made or written
    (naming `ssd_cache_dir`)."""
    from cluster.kv.hashing import kv_format_name
    from cluster.kv.tier_fingerprint import tier_fingerprint, weights_digest

    if not config.ssd_cache_gb:
        if config.ssd_cache_dir:
            log.warning("ssd_cache_dir %s is set but ssd_cache_gb is 0: no SSD tier (give --ssd-cache-gb a budget)",
                        config.ssd_cache_dir)
        return None
    why = "the prefix cache is off (enable_prefix_caching)" if not config.enable_prefix_caching \
        else "its weights' folder is unknown" if not spec.weights_dir else None
    if why:
        log.warning("SSD tier off for %s: %s", spec.model_id, why)
        return None
    root = Path(config.ssd_cache_dir) if config.ssd_cache_dir else default_tier_dir()
    fmt = kv_format_name(config.dtype, config.kv_bits, config.kv_group_size, config.block_size)
    t0 = time.perf_counter()
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not root.is_dir():
            raise NotADirectoryError(f"{root} is a file")
        fingerprint = tier_fingerprint(weights_digest(Path(spec.weights_dir), root), fmt, shard)
        if rank is not None:
            fingerprint += f"-r{rank}"
        tier = DiskTier(root, fingerprint, int(config.ssd_cache_gb * 2**30), manager.tier_array_names(),
                        state_names=manager.tier_state_names(), follows=bool(rank))
    except OSError as exc:
        raise ValueError(f"ssd_cache_dir {root} cannot hold the SSD tier ({exc.strerror or exc}): give "
                         "--ssd-cache-dir a folder this server can create and write") from None
    manager.attach_tier(tier)
    log.info("SSD tier: %s, %d blocks (%.1f MiB) of %.3g GiB found; weights fingerprinted in %.1f s", tier.dir,
             tier.stats()["blocks"], tier.nbytes / 2**20, config.ssd_cache_gb, time.perf_counter() - t0)
    return tier
