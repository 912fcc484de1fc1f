"""The SSD tier under the KV pool: cached blocks kept as files, so that a prefix hit reaches past what RAM holds
and survives a restart (vllm-mlx's and oMLX's SSD caches, vLLM's tiered offload).

Write-behind: as the prefix cache registers a full, computed block (`KVManager.cache_blocks`), the engine's owner
thread copies it to host memory (`KVStore.read_blocks`, as the KV sender does) and hands it to `put`; a writer
thread of the tier writes it to a temporary name, renames it into place and only then lists it, so a crash or a
kill leaves whole files or none. When the pool later evicts the block nothing is left to do. `put` never waits:
its queue is bounded in bytes, and a block it cannot take is dropped (and counted). A full disk (or any other
write error) turns writing off with one log line; reading goes on.

Reads: a prefix lookup asks `has` which of the blocks after its RAM hit the tier holds; the scheduler starts
reading their files on reader threads (`prefetch`, cluster/kv/tier_prefetch.py) and admits the prompt once they
are read, and the commit `load_many`s them (verified: checksum, block hash and tokens, cluster/kv/block_file.py)
into the request's new pool blocks on the owner thread. A bad file is a miss: it is deleted and the rest of the
prompt is computed.

Bounded: the files of this fingerprint's folder stay within `budget_bytes`, least recently used first; a hit
touches its blocks suffix first, so a prompt's prefix is the last of it to go (a suffix is useless without its
prefix). At start the folder's files are listed by modification time (the oldest first to go). The folder is
`<root>/<fingerprint>` (cluster/kv/tier_fingerprint.py), created 0700 with files 0600, and locked: a second
server on the same folder is refused. `clear` (a prefix-cache reset) deletes every block.

In a worker group each rank keeps its own shard of every block in a tier of its own (cluster/parallel/
group_tier.py): the leader's decides, a follower's `follows` it: no LRU of its own, it deletes what the leader's
let go of (`drop`); a block it could not take is one the leader finds missing on a hit and has written again.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from cluster.kv.block_file import BlockFileError, decode, encode
from cluster.kv.tier_prefetch import Prefetch

log = logging.getLogger(__name__)

BLOCK, STATE = "kv", "st"  # the kinds of file, and their suffixes: a block's KV, a recurrent state after a block
QUEUE_BYTES = 256 << 20  # blocks waiting for the writer at most (or the budget, if smaller)
READERS = 16  # threads reading one prompt's block files at once (the disk's queue depth: 8 read 1.05 GB/s, 16 1.12, 32 0.78)


class TierInUse(ValueError):
    """Another server holds the tier's folder."""


class DiskTier:
    """Blocks of one fingerprint's folder under `root`, within `budget_bytes`; each block's arrays are named
    `names` (`KVManager.tier_array_names`), and, for a model with recurrent layers, the state after a block
    `state_names` (kind `STATE`, keyed by the block's hash: a snapshot). Owner-thread calls: `has`, `put`,
    `end_batch`, `prefetch`, `load`, `load_many`, `touch`, `drop`, `clear`; the writer thread lists what it
    wrote; `follows`: a worker group follower's tier (no LRU of its own). Raises TierInUse when another process holds
    the folder, OSError when it cannot be made."""

    def __init__(self, root: Path, fingerprint: str, budget_bytes: int, names: Sequence[str],
                 queue_bytes: Optional[int] = None, state_names: Sequence[str] = (), follows: bool = False):
        root = Path(root).expanduser()
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.dir = root / fingerprint
        self.dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.budget_bytes, self.names = int(budget_bytes), tuple(names)
        self._names = {BLOCK: self.names, STATE: tuple(state_names)}
        self._lock_file = os.fdopen(os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, 0o600), "r+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.seek(0)
            holder = self._lock_file.read().strip() or "?"
            self._lock_file.close()
            raise TierInUse(f"ssd_cache_dir {root} is in use by another server (pid {holder}) for this model: "
                            "give each server its own --ssd-cache-dir") from None
        self._lock_file.truncate(0)
        self._lock_file.write(str(os.getpid()))
        self._lock_file.flush()
        # (block hash, kind) -> file bytes, least recently used first
        self._index: OrderedDict[tuple[int, str], int] = OrderedDict()
        self.nbytes = 0
        self._mutex = threading.Lock()
        self._wake = threading.Condition(self._mutex)
        self._queue: deque = deque()
        self._pending: dict[tuple[int, str], tuple[tuple[int, ...], list[np.ndarray]]] = {}
        # the last file read (`load`): its key, the tokens it was read for, its arrays
        self._memo: Optional[tuple[tuple[int, str], tuple[int, ...], list[np.ndarray]]] = None
        self._gone: list[tuple[int, str]] = []  # let go of since `take_gone` (evicted, bad, never written)
        self._ends: set[tuple[int, str]] = set()  # queued keys that end a batch (`end_batch`)
        self._batch: list[tuple[int, str]] = []  # the writer's: keys written since the last batch ended
        self._queued_bytes = 0
        self.queue_bytes = min(queue_bytes or QUEUE_BYTES, max(1, self.budget_bytes))
        self.writable = True
        self.follows = follows  # a worker group's follower: no LRU of its own (see the module docstring)
        self.num_written = self.num_dropped = self.num_loaded = self.num_bad = self.num_evicted = 0
        self.bytes_written = self.bytes_loaded = 0
        self.load_seconds = 0.0
        self._prefetch = Prefetch(self._read_file, READERS)
        self._scan()
        self._trim_others(root)
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-tier", daemon=True)
        self._writer.start()

    # -- the owner thread ----------------------------------------------------------------------------------------

    def has(self, block_hash: int, kind: str = BLOCK) -> bool:
        """True when the tier holds (or is writing) block `block_hash`'s file of `kind`."""
        key = (block_hash, kind)
        with self._mutex:
            return key in self._index or key in self._pending

    def put(self, block_hash: int, token_ids: Sequence[int], arrays: list[np.ndarray], kind: str = BLOCK) -> bool:
        """Queue block `block_hash`'s file of `kind` (a block caching `token_ids`, or the state after it; its
        host copies `arrays`) for writing; False when it is held already, writing is off, or the queue is full
        (dropped and counted)."""
        size = sum(a.nbytes for a in arrays)
        key = (block_hash, kind)
        with self._mutex:
            if key in self._index or key in self._pending:
                return False
            if not self.writable or self._closed or size > self.budget_bytes:
                return False
            if self._queued_bytes + size > self.queue_bytes:
                self.num_dropped += 1
                return False
            self._pending[key] = (tuple(token_ids), arrays)
            if key in self._gone:  # let go of and taken again before it was announced: nothing to announce
                self._gone.remove(key)
            self._queue.append(key)
            self._queued_bytes += size
            self._wake.notify()
        return True

    def load(self, block_hash: int, token_ids: Sequence[int], kind: str = BLOCK) -> Optional[list[np.ndarray]]:
        """The arrays of block `block_hash`'s file of `kind` if it caches exactly `token_ids` (a state: none);
        None on a miss or a bad file (which is deleted, counted and logged). Reads the file on the calling
        thread; the last file read is kept, so a lookup repeated while its request waits reads it once."""
        t0 = time.perf_counter()
        key = (block_hash, kind)
        with self._mutex:
            pending = self._pending.get(key)
            known = key in self._index
            memo = self._memo
        if pending is not None:
            if pending[0] != tuple(token_ids):
                return None
            arrays = pending[1]
        elif not known:
            return None
        elif memo is not None and memo[0] == key and memo[1] == tuple(token_ids):
            return memo[2]
        else:
            try:
                arrays = decode(self._path(key).read_bytes(), block_hash, token_ids, self._names[kind])
            except FileNotFoundError:  # evicted by the writer meanwhile: a miss
                return None
            except (OSError, BlockFileError) as exc:
                log.warning("SSD tier: %s file of block %016x is unusable (%s): computing it instead",
                            "the state" if kind == STATE else "the KV", block_hash, exc)
                self.num_bad += 1
                self._forget(key, delete=True)
                return None
            self._memo = (key, tuple(token_ids), arrays)
            if kind == BLOCK:  # what the load rate is measured on: block files read from the disk
                self.num_loaded += 1
                self.bytes_loaded += sum(a.nbytes for a in arrays)
                self.load_seconds += time.perf_counter() - t0
        return arrays

    def prefetch(self, blocks: Sequence[tuple[int, Sequence[int]]]) -> bool:
        """Start reading the files of `blocks` ((block hash, tokens), one prompt's) on the reader threads, for a
        `load_many` to come (dropping any other prompt's reads not taken yet); True when every one of them can be
        loaded without waiting for the disk (read already, or still in the writer's queue)."""
        with self._mutex:
            on_disk = [(h, t) for h, t in blocks if (h, BLOCK) in self._index and (h, BLOCK) not in self._pending]
        self._prefetch.start(on_disk)
        return self._prefetch.ready(h for h, _ in on_disk)

    def load_many(self, blocks: Sequence[tuple[int, Sequence[int]]]) -> list[Optional[list[np.ndarray]]]:
        """`load` of each (block hash, tokens) of `blocks`, in order up to the first that fails (None from there on),
        their files read and verified by `READERS` threads at once (one reader leaves an SSD idle between
        requests: measured 0.41 GB/s from one thread, 0.75 from eight, on a disk that reads 1.55 GB/s
        sequentially, 405 KB files, page cache dropped); files `prefetch` read already are taken from there."""
        with self._mutex:
            unread = {h: tuple(t) for h, t in blocks if (h, BLOCK) in self._index and (h, BLOCK) not in self._pending}
        files, spans = {}, []
        for h, tokens in unread.items():  # what `prefetch` read: its time is from its first read to its last
            got = self._prefetch.take(h, tokens)
            if got is not None:
                files[h] = got[0]
                spans.append(got[1:])
        if spans:
            self.load_seconds += max(end for _, end in spans) - min(start for start, _ in spans)
        rest = [h for h in unread if h not in files]
        if len(rest) < 2 and not files:
            out: list[Optional[list[np.ndarray]]] = []
            for h, t in blocks:
                out.append(None if out and out[-1] is None else self.load(h, t))
            return out
        t0 = time.perf_counter()
        if rest:
            files.update(zip(rest, self._prefetch.pool().map(self._read_file, rest, [unread[h] for h in rest])))
        out = []
        for block_hash, tokens in blocks:
            if out and out[-1] is None:  # a hit ends at its first block that cannot be loaded
                out.append(None)
                continue
            if block_hash not in unread:  # waiting for the writer
                out.append(self.load(block_hash, tokens))
                continue
            arrays = files[block_hash]
            if arrays is None:  # evicted meanwhile
                out.append(None)
                continue
            if isinstance(arrays, Exception):
                log.warning("SSD tier: the KV file of block %016x is unusable (%s): computing it instead",
                            block_hash, arrays)
                self.num_bad += 1
                self._forget((block_hash, BLOCK), delete=True)
                out.append(None)
                continue
            self.num_loaded += 1
            self.bytes_loaded += sum(a.nbytes for a in arrays)
            out.append(arrays)
        if rest:
            self.load_seconds += time.perf_counter() - t0
        return out

    def _read_file(self, block_hash: int, token_ids: tuple[int, ...]):
        """Block `block_hash`'s KV file read and verified for `token_ids` (on a reader thread): its arrays, None
        when it is gone (evicted by the writer meanwhile: a miss), or the error that makes it unusable."""
        try:
            return decode(self._path((block_hash, BLOCK)).read_bytes(), block_hash, token_ids, self.names)
        except FileNotFoundError:
            return None
        except (OSError, BlockFileError) as exc:
            return exc

    def load_seconds_estimate(self, num_blocks: int) -> Optional[float]:
        """Predicted seconds to load `num_blocks` block files, at the seconds per block file measured so far (None
        before a few loads were timed)."""
        if self.num_loaded < 4 or self.load_seconds <= 0:
            return None
        return num_blocks * self.load_seconds / self.num_loaded

    def touch(self, hashes: Sequence[int]) -> None:
        """A prompt used these blocks (a prefix, in order; and the state after its last one): the most recently
        used now, its first block last of all, so its suffix goes before its prefix."""
        order = []
        with self._mutex:
            if hashes and (hashes[-1], STATE) in self._index:
                order.append((hashes[-1], STATE))
            order += [(h, BLOCK) for h in reversed(hashes) if (h, BLOCK) in self._index]
            for key in order:
                self._index.move_to_end(key)
        self._stamp(order)

    def end_batch(self) -> None:
        """The blocks `put` since the last call are one prompt's, first to last: once written they are listed as
        `touch` lists a prefix (its first block the last to go), whatever order the writer listed them in."""
        with self._mutex:
            if self._queue:
                self._ends.add(self._queue[-1])

    def _stamp(self, order: list) -> None:
        """Give the files `order` increasing modification times, the same order on disk for the next start's
        listing."""
        now = time.time_ns()
        for j, key in enumerate(order):
            try:
                os.utime(self._path(key), ns=(now + j, now + j))
            except OSError:
                pass

    def hashes(self, kind: str = BLOCK) -> list[int]:
        """The block hashes whose file of `kind` the tier holds (or is writing)."""
        with self._mutex:
            return [h for h, k in (*self._index, *self._pending) if k == kind]

    def take_gone(self) -> list[tuple[int, str]]:
        """The (block hash, kind) files the tier let go of since the last call: evicted, found bad, or never
        written (a write failed); the owner thread announces them (`KVManager.drain_events`)."""
        with self._mutex:
            gone, self._gone = self._gone, []
        return gone

    def drop(self, keys: Sequence[tuple[int, str]]) -> None:
        """Forget and delete the files `keys` ((block hash, kind)), queued ones too (a file being written is
        deleted once written): what a worker group's leader let go of, or what a leader found missing on a
        follower (announced by `take_gone`, so that it is written again)."""
        for key in keys:
            key = tuple(key)
            with self._mutex:
                pending = self._pending.pop(key, None)
                if pending is not None:
                    self._queue.remove(key)
                    self._queued_bytes -= sum(a.nbytes for a in pending[1])
                    self._let_go([key])
            self._forget(key, delete=True)

    def clear(self) -> int:
        """Forget and delete every block (waiting ones included); returns how many were held."""
        with self._mutex:
            keys = list(self._index)
            n = len(keys) + len(self._pending)
            self._queue.clear()
            self._pending.clear()
            self._queued_bytes = 0
            self._index.clear()
            self._memo = None
            self._gone = []
            self._ends.clear()
            self.nbytes = 0
        self._prefetch.start(())  # reads ahead of files that go
        for key in keys:
            self._path(key).unlink(missing_ok=True)
        return n

    def wait_written(self, timeout_s: float = 10.0) -> bool:
        """Wait until the writer has written (or given up on) every queued block; False at the deadline."""
        deadline = time.monotonic() + timeout_s
        with self._mutex:
            while self._queue and time.monotonic() < deadline:
                self._wake.wait(0.01)
            return not self._queue

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (for at most `timeout_s`), stop the writer, release the folder."""
        with self._mutex:
            self._closed = True
            self._wake.notify()
        self._writer.join(timeout_s)
        self._prefetch.close()
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
        finally:
            self._lock_file.close()

    def stats(self) -> dict:
        """Blocks and bytes held, the budget, and the counters since start (written, dropped, loaded, bad,
        evicted; bytes written and loaded; seconds spent loading); `writable` False once a write failed."""
        with self._mutex:
            blocks, queued = sum(1 for _, kind in self._index if kind == BLOCK), len(self._pending)
        return {"blocks": blocks, "bytes": self.nbytes, "budget_bytes": self.budget_bytes, "queued": queued,
                "written": self.num_written, "dropped": self.num_dropped, "loaded": self.num_loaded,
                "bad": self.num_bad, "evicted": self.num_evicted, "bytes_written": self.bytes_written,
                "bytes_loaded": self.bytes_loaded, "load_seconds": self.load_seconds, "writable": self.writable}

    def engine_stats(self) -> dict:
        """`stats` as `cluster.stats.EngineStats`'s `ssd_*` fields."""
        s = self.stats()
        return {"ssd_blocks": s["blocks"], "ssd_bytes": s["bytes"], "ssd_budget_bytes": s["budget_bytes"],
                "ssd_blocks_written": s["written"], "ssd_blocks_dropped": s["dropped"],
                "ssd_blocks_loaded": s["loaded"], "ssd_bytes_loaded": s["bytes_loaded"],
                "ssd_load_seconds": s["load_seconds"], "ssd_bad_blocks": s["bad"], "ssd_blocks_evicted": s["evicted"]}

    # -- the writer thread ---------------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            with self._mutex:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if not self._queue:
                    return
                key = self._queue[0]
                token_ids, arrays = self._pending[key]
            size = self._write(key, token_ids, arrays)
            order = []
            with self._mutex:
                if size is None:  # no room beside its batch's earlier blocks: let go of, as an eviction
                    self.num_evicted += 1
                    self._let_go([key])
                if self._queue and self._queue[0] == key:  # not cleared meanwhile
                    self._queue.popleft()
                    self._pending.pop(key, None)
                    self._queued_bytes -= sum(a.nbytes for a in arrays)
                    if size:
                        self._index[key] = size
                        self.nbytes += size
                        self._batch.append(key)
                    doomed = []
                else:
                    doomed = [key] if size else []
                if key in self._ends or not self._queue:  # a batch is written: its first block newest
                    self._ends.discard(key)
                    order = [k for k in reversed(self._batch) if k in self._index]
                    self._batch = []
                    for k in order:
                        self._index.move_to_end(k)
            for k in doomed:
                self._path(k).unlink(missing_ok=True)
            self._stamp(order)

    def _write(self, key: tuple[int, str], token_ids, arrays) -> Optional[int]:
        """Write one file (temporary name, then renamed); its bytes, 0 when writing failed (writing is then off
        for good: the disk is full or failing), None when it does not fit beside the blocks written before it in
        its batch (a prompt's later block is worth less than its earlier ones: it is not written)."""
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            data = encode(key[0], token_ids, self._names[key[1]], arrays)
            with self._mutex:  # room first: the folder never holds more than its budget, this file included
                doomed = self._over_budget(adding=len(data), spare=set(self._batch))
                room = self.follows or self.nbytes + len(data) <= self.budget_bytes
            for k in doomed:
                self._path(k).unlink(missing_ok=True)
            if not room:  # only its own batch's earlier blocks could make room: it is not written, they stay
                return None
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except Exception as exc:  # noqa: BLE001 - the writer thread must not die with its queue held
            tmp.unlink(missing_ok=True)
            full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
            log.error("SSD tier: writing off (%s%s); the server serves on from RAM and what the tier holds",
                      "the disk is full: " if full else "", exc)
            with self._mutex:
                self.writable = False
                self._let_go(list(self._pending))
                self._queue.clear()
                self._pending.clear()
                self._queued_bytes = 0
            return 0
        self.num_written += 1
        self.bytes_written += len(data)
        return len(data)

    # -- the index -----------------------------------------------------------------------------------------------

    def _let_go(self, keys: list[tuple[int, str]]) -> None:
        """`keys` are no longer held: announced by `take_gone` (a follower's are the leader's to announce)."""
        if not self.follows:
            self._gone += keys

    def _over_budget(self, adding: int = 0, spare: frozenset = frozenset()) -> list[tuple[int, str]]:
        """Drop the least recently used files (not any of `spare`) until the tier, with `adding` bytes more, fits
        its budget; their keys, whose files the caller deletes outside the lock. Called holding the lock. A
        follower drops nothing of its own accord."""
        doomed = []
        if self.follows:
            return doomed
        candidates = (k for k in list(self._index) if k not in spare)
        while self.nbytes + adding > self.budget_bytes and self._index and (adding or len(self._index) > 1):
            key = next(candidates, None)
            if key is None:
                break
            size = self._index[key]
            del self._index[key]
            self.nbytes -= size
            self.num_evicted += 1
            doomed.append(key)
        self._let_go(doomed)
        return doomed

    def _forget(self, key: tuple[int, str], delete: bool) -> None:
        with self._mutex:
            size = self._index.pop(key, None)
            if size is not None:
                self.nbytes -= size
                self._let_go([key])
            if self._memo is not None and self._memo[0] == key:
                self._memo = None
        if delete:
            self._path(key).unlink(missing_ok=True)

    def _scan(self) -> None:
        """List the folder's block files, oldest first; delete temporary files a crash left behind, and what is
        over the budget."""
        found = []
        for entry in os.scandir(self.dir):
            name = entry.name
            if name.startswith(".") and name.endswith(".tmp"):
                os.unlink(entry.path)
            elif name.endswith((f".{BLOCK}", f".{STATE}")):
                stem, kind = name.rsplit(".", 1)
                try:
                    block_hash = int(stem, 16)
                    st = entry.stat()
                except (ValueError, OSError):
                    continue
                found.append((st.st_mtime_ns, (block_hash, kind), st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.nbytes += size
        for key in self._over_budget():
            self._path(key).unlink(missing_ok=True)

    def _trim_others(self, root: Path) -> None:
        """Keep the whole folder within the budget: the folders of other fingerprints (another model, KV format or
        MLX) that no server holds go, the least recently used first, while they and this one's files exceed it.
        Only a fingerprint's own files are deleted (block and state files, its lock), never anything else."""
        others = []
        for entry in os.scandir(root):
            if entry.path == str(self.dir) or not entry.is_dir() or not _is_fingerprint(entry.name) \
                    or _same_group(entry.name, self.dir.name):  # another rank of this worker group: its own
                continue
            files = [f for f in os.scandir(entry.path) if f.name.endswith((f".{BLOCK}", f".{STATE}", ".tmp"))]
            stats = [f.stat() for f in files]
            others.append((max((st.st_mtime_ns for st in stats), default=0), entry.path, files,
                           sum(st.st_size for st in stats)))
        total = self.nbytes + sum(size for *_, size in others)
        for _, path, files, size in sorted(others):
            if total <= self.budget_bytes:
                break
            try:
                with open(os.path.join(path, "lock"), "a+") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a running server: leave it
                    for f in files:
                        os.unlink(f.path)
                os.unlink(os.path.join(path, "lock"))
                os.rmdir(path)
            except (BlockingIOError, OSError):
                continue
            total -= size
            log.info("SSD tier: removed another fingerprint's folder %s (%.1f MiB) to keep within the budget",
                     path, size / 2**20)

    def _path(self, key: tuple[int, str]) -> Path:
        return self.dir / f"{key[0]:016x}.{key[1]}"


def _is_fingerprint(name: str) -> bool:
    """A tier folder's name: 32 hex digits (`tier_fingerprint`), and for a worker group's rank "-r" and its
    number."""
    fingerprint, _, rank = name.partition("-r")
    return len(fingerprint) == 32 and all(c in "0123456789abcdef" for c in fingerprint) \
        and (rank.isdigit() or "-r" not in name)


def _same_group(name: str, own: str) -> bool:
    """Whether folders `name` and `own` are two ranks' of one worker group (one fingerprint, other ranks)."""
    return "-r" in name and name.partition("-r")[0] == own.partition("-r")[0]
