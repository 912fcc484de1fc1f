"""Reading a prompt's block files from the SSD tier ahead of its commit, on reader threads, so that the engine
goes on with other work (decode steps, other prompts' chunks) while the disk is busy (vLLM v1's asynchronous KV
loads: a request waits for its remote KV while the rest of the batch runs).

While sequences run, the scheduler starts the reads of the prompt at the head of its queue (`Prefetch.start`),
leaves it waiting while they run and admits it once they are all done (`ready`); the commit then takes the
verified arrays (`take`) instead of reading the files itself. (With nothing running, nothing would overlap the
reads: the commit reads the files itself, on the same threads, and prompts that came together stay together.) One prompt's reads at a time: starting another prompt's drops whatever of
the last one was not taken (a request aborted or put back), so what waits in memory is at most one prompt's
blocks. Reads are plain functions of (block hash, tokens) given by the tier (cluster/kv/disk_tier.py): a file
read and verified, None when it is gone, or the exception that made it unusable.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Optional, Sequence


class Prefetch:
    """Reads by `threads` threads of `read(block_hash, token_ids)`; call every method from one thread (the
    engine's owner)."""

    def __init__(self, read: Callable[[int, tuple[int, ...]], Any], threads: int):
        self._read, self._threads = read, threads
        self._pool: Optional[ThreadPoolExecutor] = None
        # block hash -> (the tokens it is read for, its read: (result, perf_counter when done), when submitted)
        self._reads: dict[int, tuple[tuple[int, ...], Future, float]] = {}

    def pool(self) -> ThreadPoolExecutor:
        """The reader threads (started on first use)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="kv-disk-read")
        return self._pool

    def start(self, blocks: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Read each (block hash, tokens) of `blocks` in the background unless it is read or being read already;
        drop every other read not taken yet."""
        keep = {h for h, _ in blocks}
        for h in [h for h in self._reads if h not in keep]:
            self._reads.pop(h)[1].cancel()
        for h, tokens in blocks:
            tokens = tuple(tokens)
            known = self._reads.get(h)
            if known is None or known[0] != tokens:
                if known is not None:
                    known[1].cancel()
                self._reads[h] = (tokens, self.pool().submit(self._timed, h, tokens), time.perf_counter())

    def ready(self, hashes: Iterable[int]) -> bool:
        """True when the reads of every one of `hashes` that was started have finished."""
        return all(self._reads[h][1].done() for h in hashes if h in self._reads)

    def take(self, block_hash: int, token_ids: Sequence[int]) -> Optional[tuple[Any, float, float]]:
        """The read of `block_hash` for exactly `token_ids` (waited for if it still runs), forgotten here: (its
        result, perf_counter when it was started, when it finished); None when there is none (not started, other
        tokens, cancelled)."""
        known = self._reads.pop(block_hash, None)
        if known is None or known[0] != tuple(token_ids) or known[1].cancelled():
            return None
        result, done_at = known[1].result()
        return result, known[2], done_at

    def close(self) -> None:
        """Drop every read and stop the threads (reads under way finish on their own)."""
        for _, future, _ in self._reads.values():
            future.cancel()
        self._reads.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _timed(self, block_hash: int, token_ids: tuple[int, ...]) -> tuple[Any, float]:
        return self._read(block_hash, token_ids), time.perf_counter()
