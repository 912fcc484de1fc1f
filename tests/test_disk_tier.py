"""The SSD tier under the KV pool: a session whose blocks left RAM is restored from disk with exactly the cold run's
tokens and logprobs (float, 8-bit and 4-bit KV; alone and batched), after a restart too, and after the server was
killed with -9 while writing; a torn or flipped file is a miss that is recomputed; weights of other values in
files of the same sizes never hit; the folder stays within its budget, is locked against a second server and
private; a full disk turns writing off and the server serves on."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks.random_models import random_model_dir
from cluster.config import EngineConfig
from cluster.engine import EngineCore
from cluster.kv.block_file import BlockFileError, decode, encode
from cluster.kv.disk_tier import DiskTier, TierInUse
from cluster.model import load_model, read_model_spec
from cluster.request import GenerateRequest, SamplingParams
from tests.engine_helpers import run
from tests.family_helpers import COMMON, CONFIGS, TOL, VOCAB, request

REPO = Path(__file__).resolve().parents[1]
LLAMA = {"model_type": "llama", **COMMON, **CONFIGS["llama"], "head_dim": 32}  # 32 wide: 4-bit groups of 32
BLOCK = 8
CLUSTER_BLOCK = 32  # the clusters' (tests/cluster_helpers.py) block size
NAMES = ("0.k", "0.v")  # a block's arrays in a file: the full-attention group's K and V
# four sessions of 41 tokens (5 whole blocks each) over a pool of 13 usable blocks: each evicts the one before
SESSIONS = np.random.RandomState(1).randint(100, VOCAB, size=(4, 41)).tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.family_helpers import CONFIGS as FAMILIES

    root = tmp_path_factory.mktemp("tier-models")
    out = {seed: random_model_dir("tier-llama", LLAMA, seed, root) for seed in (0, 1)}
    out["hybrid"] = random_model_dir("tier-qwen3-next", {"model_type": "qwen3_next", **COMMON,
                                                         **FAMILIES["qwen3_next"]}, 0, root)
    return out


def _engine(folder: Path, tier_dir, budget_gb: float = 0.01, **config) -> EngineCore:
    model, tokenizer = load_model(folder, "float32")
    config = dict(dict(dtype="float32", block_size=BLOCK, num_blocks=14, ssd_cache_gb=budget_gb,
                       ssd_cache_dir=None if tier_dir is None else str(tier_dir)), **config)
    # one served name for every seed: the block hashes (model name, config, file sizes) are the same for both
    return EngineCore(model, tokenizer, read_model_spec(folder, model_id="tier-llama"), EngineConfig(**config))


def _answers(engine: EngineCore, prompts, tag: str) -> dict:
    results = run(engine, [request(f"{tag}{i}", p) for i, p in enumerate(prompts)])
    return {i: (results[f"{tag}{i}"].token_ids, [lp.logprob for lp in results[f"{tag}{i}"].logprobs],
                results[f"{tag}{i}"].final.num_cached_tokens) for i in range(len(prompts))}


def _assert_same(got: dict, cold: dict, tol: float = TOL) -> None:
    """Greedy tokens equal, logprobs within `tol` (quantized KV read back from blocks differs from the fresh
    values a cold prompt's own chunk attends to by more than float rounding: the project's 1e-3)."""
    for i, (tokens, logprobs, _) in cold.items():
        assert got[i][0] == tokens, i
        assert np.allclose(got[i][1], logprobs, atol=tol, rtol=0), i


@pytest.mark.parametrize("kv_bits", [None, 8, 4])
def test_sessions_evicted_from_ram_are_restored_from_disk_exactly_alone_batched_and_after_a_restart(
        kv_bits, models, tmp_path):
    """Four sessions, each evicting the one before from a small pool, come back from disk alone and then, after a
    restart, all four batched: with float KV their tokens and logprobs are the cold run's; in every format the
    disk's blocks are the pool's, byte for byte, so a restore from disk answers exactly as the same batch hit in
    the RAM of an engine without a tier (quantized KV reused from any cache differs from a cold prompt's own
    fresh K/V by the quantization error, README "What a request's output may depend on")."""
    kv = {} if kv_bits is None else {"kv_bits": kv_bits, "kv_group_size": 32}
    cold = _answers(_engine(models[0], None, budget_gb=0, enable_prefix_caching=False, **kv), SESSIONS, "cold")
    engine = _engine(models[0], tmp_path, **kv)
    for i, p in enumerate(SESSIONS):  # one after another: each pushes the one before out of the pool
        _answers(engine, [p], f"first{i}-")
    assert engine.tier.wait_written()
    assert engine.tier.stats()["written"] >= 4 * 5
    alone = {i: _answers(engine, [p], f"alone{i}-")[0] for i, p in enumerate(SESSIONS[:2])}
    assert all(a[2] == 40 for a in alone.values())  # every whole block of the prompt, from disk or RAM
    assert engine.tier.stats()["loaded"] >= 5
    if kv_bits is None:
        _assert_same(alone, {i: cold[i] for i in alone})
    engine.close()
    # a restart with a pool that holds the four at once: RAM is empty, the disk is not
    again = _engine(models[0], tmp_path, num_blocks=40, **kv)
    from_disk = _answers(again, SESSIONS, "disk")
    assert [b[2] for b in from_disk.values()] == [40] * 4
    assert again.tier.stats()["loaded"] >= 4 * 5 and again.tier.stats()["bad"] == 0
    if kv_bits is None:
        _assert_same(from_disk, cold)
    again.close()
    # the same batch on an engine without a tier, its prefixes computed there as the first engine computed them
    # (one session at a time) and hit in its own pool
    plain = _engine(models[0], None, budget_gb=0, num_blocks=40, **kv)
    for i, p in enumerate(SESSIONS):
        _answers(plain, [p], f"computed{i}-")
    from_ram = _answers(plain, SESSIONS, "ram")
    assert [r[2] for r in from_ram.values()] == [40] * 4
    _assert_same(from_disk, from_ram, tol=0.0)


def test_a_torn_or_flipped_file_is_a_miss_that_is_recomputed(models, tmp_path):
    engine = _engine(models[0], tmp_path)
    cold = _answers(engine, SESSIONS[:2], "cold")
    assert engine.tier.wait_written()
    folder = engine.tier.dir
    engine.close()
    files = sorted(folder.glob("*.kv"))
    assert len(files) >= 10
    by_block = {}
    for f in files:  # which session's which block each file holds
        data = f.read_bytes()
        for s, prompt in enumerate(SESSIONS[:2]):
            for b in range(5):
                try:
                    decode(data, int(f.stem, 16), prompt[b * BLOCK:(b + 1) * BLOCK], NAMES)
                    by_block[(s, b)] = f
                except BlockFileError:
                    pass
    flipped, torn = by_block[(0, 2)], by_block[(1, 3)]
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    torn.write_bytes(torn.read_bytes()[:100])
    again = _engine(models[0], tmp_path)
    got = _answers(again, SESSIONS[:2], "again")
    _assert_same(got, cold)
    assert [got[0][2], got[1][2]] == [2 * BLOCK, 3 * BLOCK]  # up to the bad block, then computed
    assert again.tier.stats()["bad"] == 2
    assert again.tier.wait_written()  # the recomputed blocks are written again, whole
    decode(flipped.read_bytes(), int(flipped.stem, 16), SESSIONS[0][2 * BLOCK:3 * BLOCK], NAMES)
    decode(torn.read_bytes(), int(torn.stem, 16), SESSIONS[1][3 * BLOCK:4 * BLOCK], NAMES)
    again.close()


def test_weights_of_other_values_in_files_of_the_same_sizes_never_hit(models, tmp_path):
    sizes = [sorted((f.name, f.stat().st_size) for f in models[s].glob("*.safetensors")) for s in (0, 1)]
    assert sizes[0] == sizes[1]
    assert read_model_spec(models[0]).revision == read_model_spec(models[1]).revision  # so the hashes agree
    first = _engine(models[0], tmp_path)
    _answers(first, SESSIONS[:1], "a")
    assert first.tier.wait_written() and first.tier.stats()["blocks"] >= 5
    folder = first.tier.dir
    first.close()
    other = _engine(models[1], tmp_path)
    got = _answers(other, SESSIONS[:1], "b")
    assert got[0][2] == 0 and other.tier.stats()["loaded"] == 0
    assert other.tier.dir != folder
    other.close()


def test_the_folder_stays_within_its_budget_is_private_and_refuses_a_second_server(models, tmp_path, monkeypatch):
    """Twelve sessions through a tier of seven blocks: the folder's block files never exceed the budget, not even
    for the moment a new file is renamed into place (room is made before it is written), and the tier evicts; the
    folder is private and a second server on it is refused until the first closes it."""
    block_file = len(encode(1, range(BLOCK), NAMES, [np.zeros((2, BLOCK, 2, 32), np.float32)] * 2))
    budget = 7 * block_file  # seven blocks: fewer than one session and a half
    engine = _engine(models[0], tmp_path, budget_gb=budget / 2**30)
    replace, peaks = os.replace, []

    def renamed(src, dst):  # the writer's rename: the folder's block files right after it
        replace(src, dst)
        peaks.append(sum(f.stat().st_size for f in Path(dst).parent.glob("*.kv") if f.exists()))

    monkeypatch.setattr(os, "replace", renamed)
    rng = np.random.RandomState(2)
    for i in range(12):
        _answers(engine, [rng.randint(100, VOCAB, size=41).tolist()], f"soak{i}-")
        assert engine.tier.wait_written()
        on_disk = sum(f.stat().st_size for f in engine.tier.dir.glob("*.kv"))
        assert on_disk <= budget and engine.tier.nbytes == on_disk
    stats = engine.tier.stats()
    assert stats["evicted"] > 0 and stats["blocks"] <= 7
    assert len(peaks) == stats["written"] and max(peaks) <= budget
    assert stat.S_IMODE(engine.tier.dir.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in engine.tier.dir.glob("*.kv"))
    name = engine.tier.dir.name
    with pytest.raises(TierInUse, match="in use by another server .*--ssd-cache-dir"):
        DiskTier(tmp_path, name, budget, NAMES)
    engine.close()
    DiskTier(tmp_path, name, budget, NAMES).close()  # free again once closed


def test_a_full_disk_turns_writing_off_and_the_server_serves_on(models, tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                                           capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs (CI runs as root)")
    try:
        cold = _answers(_engine(models[0], None, budget_gb=0, enable_prefix_caching=False), SESSIONS, "cold")
        engine = _engine(models[0], mount, budget_gb=1.0)  # a budget far larger than the disk
        got = {}
        for i, p in enumerate(SESSIONS):
            got[i] = _answers(engine, [p], f"full{i}-")[0]
            engine.tier.wait_written()
        _assert_same(got, cold)
        assert engine.tier.stats()["writable"] is False and engine.tier.stats()["written"] > 0
        _assert_same({0: _answers(engine, [SESSIONS[0]], "after")[0]}, {0: cold[0]})
        engine.close()
    finally:
        subprocess.run(["umount", str(mount)], check=False)


KILLED_WRITER = """
import sys
import numpy as np
from tests.test_disk_tier import SESSIONS, _answers, _engine
from pathlib import Path
engine = _engine(Path(sys.argv[1]), Path(sys.argv[2]))
_answers(engine, SESSIONS[:2], "before")
assert engine.tier.wait_written()
print("written", flush=True)
rng = np.random.RandomState(3)
while True:  # keep writing until killed
    _answers(engine, [rng.randint(100, 40000, size=41).tolist()], "more")
"""


def test_sessions_written_before_a_kill_9_during_writes_still_hit(models, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(models[0]), str(tmp_path)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "written"
        time.sleep(1.0)  # in the middle of later sessions' writes
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    again = _engine(models[0], tmp_path)  # the dead server's lock died with it
    assert not list(again.tier.dir.glob(".*.tmp"))  # a write cut short left a temporary file at most: gone
    for f in again.tier.dir.glob("*.kv"):  # every file listed is whole
        _decode_any(f)
    got = _answers(again, SESSIONS[:2], "again")
    assert [got[0][2], got[1][2]] == [40, 40] and again.tier.stats()["bad"] == 0
    cold = _answers(_engine(models[0], None, budget_gb=0, enable_prefix_caching=False), SESSIONS[:2], "cold")
    _assert_same(got, cold)
    again.close()


def test_a_sliding_window_model_restores_both_of_its_pools_from_disk_exactly(tmp_path_factory, tmp_path):
    """gemma3's layers alternate an 8-position sliding window with global attention, in two pools of their own:
    each block's file holds its KV in both, and after a restart the four sessions, batched, load both and
    answer as the cold run."""
    from tests.family_helpers import CONFIGS as FAMILIES

    config = {"model_type": "gemma3_text", **COMMON, **FAMILIES["gemma3_text"], "query_pre_attn_scalar": 16}
    folder = random_model_dir("tier-gemma3", config, 0,
                              tmp_path_factory.mktemp("tier-gemma3"))
    cold = _answers(_engine(folder, None, budget_gb=0, enable_prefix_caching=False), SESSIONS, "cold")
    engine = _engine(folder, tmp_path)
    assert [g.name for g in engine.kv.groups] == ["full", "sliding_window"]
    for i, p in enumerate(SESSIONS):
        _answers(engine, [p], f"first{i}-")
    assert engine.tier.wait_written() and engine.tier.names == ("0.k", "0.v", "1.k", "1.v")
    engine.close()
    again = _engine(folder, tmp_path, num_blocks=40)
    got = _answers(again, SESSIONS, "disk")
    _assert_same(got, cold)
    assert [g[2] for g in got.values()] == [40] * 4 and again.tier.stats()["loaded"] == 4 * 5
    again.close()


def test_a_hybrid_model_restores_its_blocks_and_the_state_after_them_from_disk(models, tmp_path):
    """qwen3_next (Gated DeltaNet beside attention): each snapshot of the recurrent state is written beside the
    blocks, and after a restart a hit loads the blocks and the state after the last of them and answers as the
    cold run; a flipped state file leaves no restorable hit (computed in full), and a torn block file under a good
    state falls back to what the pool holds (nothing after a restart): exact either way."""
    folder = models["hybrid"]
    cold = _answers(_engine(folder, None, budget_gb=0, enable_prefix_caching=False), SESSIONS, "cold")
    engine = _engine(folder, tmp_path)
    assert [g.name for g in engine.kv.groups] == ["full", "recurrent"]
    for i, p in enumerate(SESSIONS):
        _answers(engine, [p], f"first{i}-")
    assert engine.tier.wait_written()
    folder_on_disk = engine.tier.dir
    engine.close()
    states = sorted(folder_on_disk.glob("*.st"))
    assert len(states) >= 4  # the state after each prompt's last whole block, at least
    again = _engine(folder, tmp_path, num_blocks=40)
    got = _answers(again, SESSIONS[:2], "disk")
    _assert_same(got, {i: cold[i] for i in got})
    assert [got[0][2], got[1][2]] == [40, 40] and again.tier.stats()["bad"] == 0
    again.close()
    hashes = _prompt_hashes(folder, SESSIONS[2:])
    flip(folder_on_disk / f"{hashes[0][4]:016x}.st")  # session 2: its state after block 4
    (folder_on_disk / f"{hashes[1][2]:016x}.kv").write_bytes(b"torn")  # session 3: a block before its state
    third = _engine(folder, tmp_path, num_blocks=40)
    got = _answers(third, SESSIONS[2:], "bad")
    _assert_same({0: got[0], 1: got[1]}, {0: cold[2], 1: cold[3]})
    assert [got[0][2], got[1][2]] == [0, 0] and third.tier.stats()["bad"] == 2
    third.close()


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _prompt_hashes(folder: Path, prompts) -> list[list[int]]:
    """Each prompt's chained block hashes as an engine over `folder` computes them."""
    from cluster.kv.hashing import extend_block_hashes

    engine = _engine(folder, None, budget_gb=0)
    root = engine._extra_key(None)
    out = []
    for p in prompts:
        hashes: list[int] = []
        extend_block_hashes(hashes, p, BLOCK, root, len(p) // BLOCK)
        out.append(hashes)
    return out


@pytest.mark.parametrize("model", [0, "hybrid"])
def test_the_router_counts_what_a_worker_reaches_in_ram_and_on_disk_and_again_after_its_restart(model, models,
                                                                                                 tmp_path):
    """A worker whose pool and tier see random traffic (sessions evicted from RAM to disk, the tier's own LRU
    evicting, blocks the pool still holds after ones only the disk holds), followed by the router through its
    snapshot reply and KV events: for every prompt the router's count equals the hit the worker's own lookup
    reaches, and of those the router counts as only on disk exactly the blocks the worker's pool does not hold
    (placement prefers RAM); after a restart the worker's snapshot announces its disk blocks again, and both
    counts still hold. For a llama and for a hybrid (qwen3_next: a hit needs a state after its last block, in RAM
    or on disk)."""
    import random

    from cluster.kv.hashing import block_hashes
    from router.prefix_index import PrefixIndex
    from tests.test_prefix_routing import _events_over_the_wire, _snapshot_over_the_wire

    rng = random.Random(5)
    heads = [[rng.randrange(100, VOCAB) for _ in range(6 * BLOCK)] for _ in range(4)]
    prompts = [head[:n * BLOCK] + [rng.randrange(100, VOCAB) for _ in range(3)] for head in heads for n in (2, 4, 6)]
    block_file = len(encode(1, range(BLOCK), NAMES, [np.zeros((2, BLOCK, 2, 32), np.float32)] * 2))
    budget_gb = 14 * block_file / 2**30  # about as much as the pool: the tier evicts too

    def check(engine, idx) -> tuple[int, int]:
        key = engine._extra_key(None)
        assert idx.apply_events("w", "boot", _events_over_the_wire(engine.kv))
        hits = disk_only = 0
        in_ram = set(engine.pool.cached_hashes())
        for tokens in prompts:
            hashes = block_hashes(tokens, BLOCK, key)
            want = engine.kv.lookup(hashes, tokens, len(hashes), tier=True).num_blocks
            matched = idx.match_prompt(tokens, BLOCK, key)
            assert matched.get("w", 0) == want, tokens[:4]
            on_disk = sum(1 for h in hashes[:want] if h not in in_ram)
            assert idx.on_disk(hashes, matched).get("w", 0) == on_disk, tokens[:4]
            hits, disk_only = hits + want, disk_only + on_disk
        return hits, disk_only

    engine = _engine(models[model], tmp_path, budget_gb=budget_gb)
    idx = PrefixIndex(["w"])
    idx.apply_snapshot("w", "boot", engine.pool.last_event_seq, _snapshot_over_the_wire(engine.kv, 0))
    reached = on_disk = 0
    for step in range(24):
        _answers(engine, [rng.choice(prompts)], f"s{step}-")
        assert engine.tier.wait_written()
        hits, disk_only = check(engine, idx)
        reached, on_disk = reached + hits, on_disk + disk_only
    assert reached > on_disk > 0 and engine.tier.stats()["evicted"] > 0
    engine.close()
    again = _engine(models[model], tmp_path, budget_gb=budget_gb)
    idx = PrefixIndex(["w"])
    idx.apply_snapshot("w", "boot", again.pool.last_event_seq, _snapshot_over_the_wire(again.kv, 1))
    hits, disk_only = check(again, idx)
    assert hits == disk_only > 0  # nothing in RAM: every hit is the disk's
    again.close()


def test_a_block_the_pool_still_holds_after_blocks_only_the_disk_holds_is_copied_into_the_hit(models, tmp_path):
    """A session's first blocks left the pool (the disk keeps them) while its third stayed in the pool and left
    the disk (the tier's LRU): its next turn still reuses all four, loading the first two and copying the third
    from the pool, and answers as the cold run; the router counts the same four."""
    from cluster.kv.hashing import block_hashes
    from router.prefix_index import PrefixIndex
    from tests.test_prefix_routing import _snapshot_over_the_wire

    prompt = SESSIONS[0][:4 * BLOCK + 3]
    cold = _answers(_engine(models[0], None, budget_gb=0, enable_prefix_caching=False), [prompt], "cold")
    engine = _engine(models[0], tmp_path)
    _answers(engine, [prompt], "first")
    assert engine.tier.wait_written()
    key = engine._extra_key(None)
    hashes = block_hashes(prompt, BLOCK, key)
    pool = engine.pool
    ram = [pool.lookup(h, prompt[i * BLOCK:(i + 1) * BLOCK]) for i, h in enumerate(hashes)]
    for b in reversed(ram[:2]):  # the pool evicts blocks 0 and 1 first
        pool._free.move_to_end(b, last=False)
    engine.kv.allocate("other", 2)
    engine.kv.finish("other")
    engine.tier._forget((hashes[2], "kv"), delete=True)  # the tier let go of block 2
    assert [pool.lookup(h, prompt[i * BLOCK:(i + 1) * BLOCK]) is not None for i, h in enumerate(hashes)] == \
        [False, False, True, True]
    assert [engine.tier.has(h) for h in hashes] == [True, True, False, True]
    idx = PrefixIndex(["w"])
    idx.apply_snapshot("w", "boot", pool.last_event_seq, _snapshot_over_the_wire(engine.kv, 0))
    assert idx.match_prompt(prompt, BLOCK, key) == {"w": 4}
    got = _answers(engine, [prompt], "again")
    _assert_same(got, cold)
    assert got[0][2] == 4 * BLOCK and engine.tier.stats()["loaded"] == 3  # blocks 0, 1 and 3 from disk
    engine.close()


def test_on_one_prefill_and_two_decode_workers_a_session_goes_where_its_blocks_are_on_disk_across_restarts(
        tmp_path, monkeypatch):
    """1P2D, every worker with an SSD tier (one folder per worker by default). A session's first turn is placed on
    one decode worker, which writes its blocks to its disk. That worker restarts (RAM empty), announces its disk
    to the router again, and still gets the session: a follow-up with a long new part goes through the prefill
    worker, and the decode worker loads the session's blocks from its own disk instead of receiving them; a short
    follow-up it prefills itself from its disk. Then the whole cluster restarts and the first turn comes back
    from disk. Every answer equals the same prompt computed cold (another cache salt: nothing to hit)."""
    import httpx

    from cluster.launch.workers import make_worker
    from tests.cluster_helpers import running_cluster
    from tests.cluster_requests import MODEL
    from tests.engine_helpers import fast_model

    monkeypatch.setenv("MLX_PD_CACHE", str(tmp_path))
    rng = np.random.RandomState(4)
    first = rng.randint(100, VOCAB, size=300).tolist()
    long_turn = first + rng.randint(100, VOCAB, size=300).tolist()  # more new tokens than a decode worker prefills
    short_turn = first + rng.randint(100, VOCAB, size=20).tolist()
    loaded_model = fast_model()

    def ask(base, prompt, salt=None):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1}
        if salt:
            body["cache_salt"] = salt
        r = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], r.json()["choices"][0]["logprobs"]["token_logprobs"]

    def tier(w, key):
        return w.call(lambda w: w.engine.tier.stats()[key])

    def same(got, cold):
        assert got[0] == cold[0] and np.allclose(got[1], cold[1], atol=TOL, rtol=0)

    with running_cluster(1, 2, loaded=loaded_model, engine="ssd_cache_gb = 0.05") as (base, client, workers):
        answer = ask(base, first)
        for w in workers.values():
            assert w.call(lambda w: w.engine.tier.wait_written())
        held = 300 // CLUSTER_BLOCK
        holder = next(n for n in ("decode-0", "decode-1") if tier(workers[n], "blocks") >= held)
        other = "decode-1" if holder == "decode-0" else "decode-0"
        assert tier(workers[other], "blocks") == 0

        workers[holder].stop()  # a restart: its RAM is empty, its disk is not
        workers[holder] = make_worker(client.topology, holder, loaded_model)
        workers[holder].start()
        request = GenerateRequest("probe", long_turn, SamplingParams(max_tokens=1))
        deadline = time.monotonic() + 30
        while (client.cached_blocks(request) or {}).get(holder, 0) < held:
            assert time.monotonic() < deadline, "the restarted worker's disk never reached the router's index"
            time.sleep(0.05)

        got_long = ask(base, long_turn)
        assert tier(workers[holder], "loaded") >= held  # from its own disk, not over the wire:
        assert workers[holder].stats().kv_blocks_received <= -(-len(long_turn) // CLUSTER_BLOCK) - held
        got_short = ask(base, short_turn)
        assert tier(workers[holder], "loaded") >= held and workers[other].stats().tokens_out == 0
        same(got_long, ask(base, long_turn, salt="cold"))
        same(got_short, ask(base, short_turn, salt="cold"))
        for w in workers.values():
            assert w.call(lambda w: w.engine.tier.wait_written())

    with running_cluster(1, 2, loaded=loaded_model, engine="ssd_cache_gb = 0.05") as (base, client, workers):
        again = ask(base, first)  # the whole cluster restarted: RAM empty everywhere
        assert sum(tier(w, "loaded") for w in workers.values()) >= 300 // CLUSTER_BLOCK
        same(again, answer)
    assert sorted(p.name for p in (tmp_path / "kv-tier").iterdir()) == ["decode-0", "decode-1", "prefill-0"]


def test_blocks_that_would_load_slower_than_they_compute_are_computed(models, tmp_path):
    """Once the tier's load rate and the engine's prefill cost are measured, a hit whose blocks would take longer
    to read than to compute (a disk made slow here) is computed instead: nothing loaded, the same answer; and what
    the worker reports a disk block to be worth (for the router's placement) drops to nothing."""
    engine = _engine(models[0], tmp_path)
    cold = _answers(engine, SESSIONS, "first")  # each evicts the one before; prefill steps are timed
    assert engine.tier.wait_written()
    assert _answers(engine, SESSIONS[:1], "fast")[0][2] == 40  # loaded: the rate is measured now
    loaded = engine.tier.stats()["loaded"]
    assert loaded >= 4 and engine.tier.load_seconds_estimate(5) is not None
    measured = engine.tier.load_seconds
    engine.tier.load_seconds = measured * 1e-6  # a disk a million times faster: its blocks are all but free
    assert 0.99 < engine.disk_block_worth() <= 1.0  # (what the worker reports for the router's placement)
    engine.tier.load_seconds = measured * 1e6  # a disk a million times slower than measured
    assert engine.disk_block_worth() == 0.0
    got = _answers(engine, SESSIONS[1:2], "slow")
    assert got[0][2] == 0 and engine.tier.stats()["loaded"] == loaded
    _assert_same({0: got[0]}, {0: cold[1]})
    engine.close()


def _decode_any(path: Path) -> list:
    """The arrays of a block file, checked against the hash and tokens its own header names."""
    import msgpack

    data = path.read_bytes()
    n = int.from_bytes(data[8:12], "little")
    header = msgpack.unpackb(data[12:12 + n])
    return decode(data, header["hash"], header["tokens"], [a[0] for a in header["arrays"]])


def test_a_prefix_reused_from_ram_stays_on_disk_while_other_sessions_come_and_go_and_a_reset_clears_it(
        models, tmp_path):
    """A shared 4-block prefix hit in RAM again and again, between one-off prompts that fill a tier of 9 blocks:
    each hit makes the prefix the tier's most recently used (its first block last to go), so it stays while the
    one-offs are evicted, on disk in that order too; resetting the prefix cache deletes every file."""
    rng = np.random.RandomState(6)
    shared = rng.randint(100, VOCAB, size=4 * BLOCK).tolist()
    block_file = len(encode(1, range(BLOCK), NAMES, [np.zeros((2, BLOCK, 2, 32), np.float32)] * 2))
    engine = _engine(models[0], tmp_path, budget_gb=9 * block_file / 2**30, num_blocks=40)
    key = engine._extra_key(None)
    from cluster.kv.hashing import block_hashes

    prefix = block_hashes(shared, BLOCK, key)
    for i in range(8):
        _answers(engine, [shared + rng.randint(100, VOCAB, size=3).tolist()], f"shared{i}-")
        _answers(engine, [rng.randint(100, VOCAB, size=2 * BLOCK + 3).tolist()], f"other{i}-")
        assert engine.tier.wait_written()
    assert all(engine.tier.has(h) for h in prefix) and engine.tier.stats()["evicted"] > 0
    order = sorted(engine.tier.dir.glob("*.kv"), key=lambda f: f.stat().st_mtime_ns)
    on_disk = [int(f.stem, 16) for f in order]
    assert on_disk.index(prefix[0]) > on_disk.index(prefix[3])  # the first block is the last to go
    engine.kv.reset_prefix_cache()
    assert not list(engine.tier.dir.glob("*.kv")) and engine.tier.stats()["blocks"] == 0
    engine.close()


@pytest.mark.parametrize("family", ["llama", "sliding_window", "hybrid"])
def test_a_decode_workers_reservation_loads_the_blocks_its_own_disk_holds_so_the_transfer_skips_them(
        family, models, tmp_path_factory, tmp_path):
    """A receiver restarted with a session's blocks on its SSD tier, offered that session's prompt: it reserves
    with the blocks read from disk into the reservation's own blocks (each KV cache group's, bit for bit what the
    pool held before the restart; a window pool's blocks no later query sees stay unreserved) and answers that
    many cached blocks, which the sender then skips. A hybrid's state comes with the transfer, so its blocks
    need no state on disk."""
    from kv_transfer.handshake import KVFormat, Reservation, reserve
    from tests.family_helpers import CONFIGS as FAMILIES

    if family == "sliding_window":
        config = {"model_type": "gemma3_text", **COMMON, **FAMILIES["gemma3_text"], "query_pre_attn_scalar": 16}
        folder = random_model_dir("tier-gemma3", config, 0, tmp_path_factory.mktemp("tier-gemma3"))
    else:
        folder = models[0 if family == "llama" else "hybrid"]
    prompt = SESSIONS[0]
    engine = _engine(folder, tmp_path, num_blocks=40)
    _answers(engine, [prompt], "first")
    fmt = KVFormat.of_engine(engine)
    hashes = fmt.block_hashes(prompt)
    cached = engine.kv.lookup(hashes, prompt, len(hashes))

    def per_block(group, table) -> dict:  # block index in the prompt -> that block's arrays in `group`
        layers = range(group.store.spec.num_layers)
        return {i: group.store.read_blocks([b], layers) for i, b in enumerate(table) if b}

    before = [per_block(g, h.blocks) for g, h in zip(engine.kv.groups, cached.groups) if g.pool is not None]
    assert engine.tier.wait_written()
    engine.close()

    again = _engine(folder, tmp_path, num_blocks=40)  # RAM empty, the disk as it was
    got = reserve(again.kv, "r", fmt, fmt, prompt, hashes, max_prompt_len=4096)
    assert isinstance(got, Reservation) and got.num_cached_blocks == len(hashes) == 5
    assert again.tier.stats()["loaded"] == 5
    for g, table, first, was in zip(again.kv.block_groups, got.tables, got.first_sent, before):
        now = per_block(g, table[:5])
        assert first >= 5 and now and set(now) <= set(was)
        assert all(np.array_equal(a, b) for i in now for a, b in zip(was[i], now[i]))
    if family == "sliding_window":
        window = again.kv.block_groups[1]
        assert got.tables[1][0] == 0 and window.first_to_ship(len(prompt), len(got.tables[1])) > 0
    again.kv.release("r")
    again.close()


def test_while_a_sequence_decodes_another_prompts_blocks_are_read_from_disk_without_stopping_it(models, tmp_path):
    """A session whose blocks are only on disk arrives while another request decodes: its files are read in the
    background (held here until the test lets them go), and the decoding request gets a token every step
    meanwhile; once the reads are done the session is admitted, loads what was read (no file read twice) and
    answers as the cold run."""
    import threading

    from tests.engine_helpers import Result

    cold = _answers(_engine(models[0], None, budget_gb=0, enable_prefix_caching=False), SESSIONS[:1], "cold")
    engine = _engine(models[0], tmp_path, num_blocks=40)
    _answers(engine, SESSIONS[:1], "first")
    assert engine.tier.wait_written()
    engine.close()
    engine = _engine(models[0], tmp_path, num_blocks=40)  # RAM empty: the session is on disk only
    gate, reads = threading.Event(), []
    read = engine.tier._prefetch._read

    def held_read(block_hash, token_ids):
        reads.append(block_hash)
        assert gate.wait(30)
        return read(block_hash, token_ids)

    engine.tier._prefetch._read = held_read
    long = GenerateRequest("decoding", tuple(SESSIONS[3][:9]), SamplingParams(max_tokens=40, temperature=0,
                                                                             ignore_eos=True))
    results = {"decoding": Result(), "session": Result()}
    assert engine.add_request(long) is None
    while not results["decoding"].token_ids:  # it decodes
        for out in engine.step():
            results[out.request_id].add(out)
    assert engine.add_request(request("session", SESSIONS[0])) is None
    tokens_before = len(results["decoding"].token_ids)
    for _ in range(5):  # its reads are held: the session waits, the decoding request does not
        for out in engine.step():
            results[out.request_id].add(out)
    assert len(results["decoding"].token_ids) == tokens_before + 5 and not results["session"].token_ids
    assert len(reads) == 5 and engine.tier.stats()["loaded"] == 0
    gate.set()
    while engine.has_work():
        for out in engine.step():
            results[out.request_id].add(out)
    session = results["session"]
    assert session.final.num_cached_tokens == 40 and engine.tier.stats()["loaded"] == 5 and len(reads) == 5
    _assert_same({0: (session.token_ids, [lp.logprob for lp in session.logprobs], 40)}, cold)
    engine.close()


def _block(seed: int) -> list[np.ndarray]:
    return [np.random.RandomState(seed).rand(2, BLOCK, 2, 32).astype(np.float32) for _ in NAMES]


def test_a_ranks_tier_never_trims_another_ranks_folder_of_its_group_but_trims_a_stale_fingerprint(tmp_path):
    """Two ranks of one worker group keep their folders side by side (`<fingerprint>-r0`, `-r1`), each about the
    budget: opening one never deletes the other (nor counts it), while a stale fingerprint's folder goes."""
    group, stale = "a" * 32, "b" * 32
    block_file = len(encode(1, range(BLOCK), NAMES, _block(0)))
    budget = 3 * block_file
    for folder, n in ((f"{group}-r1", 3), (stale, 4)):  # the stale one over the budget by itself
        tier = DiskTier(tmp_path, folder, n * block_file, NAMES)
        for i in range(n):
            assert tier.put(i + 1, range(BLOCK), _block(i))
        assert tier.wait_written()
        tier.close()
    tier = DiskTier(tmp_path, f"{group}-r0", budget, NAMES)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{group}-r0", f"{group}-r1"]
    assert len(list((tmp_path / f"{group}-r1").glob("*.kv"))) == 3
    tier.close()


def test_a_dropped_block_is_deleted_even_while_queued_or_being_written(tmp_path):
    """A worker group's follower drops what the leader let go of: a block still in its write queue, or being
    written at that moment, is not left behind on disk."""
    import threading

    tier = DiskTier(tmp_path, "c" * 32, 1 << 20, NAMES)
    release, write = threading.Event(), tier._write

    def held_write(key, token_ids, arrays):
        assert release.wait(10)
        return write(key, token_ids, arrays)

    tier._write = held_write
    assert tier.put(1, range(BLOCK), _block(1)) and tier.put(2, range(BLOCK), _block(2))
    time.sleep(0.05)  # the writer holds block 1, block 2 waits in the queue
    tier.drop([(1, "kv"), (2, "kv")])
    release.set()
    assert tier.wait_written()
    time.sleep(0.05)
    assert not tier.has(1) and not tier.has(2) and not list(tier.dir.glob("*.kv"))
    tier.close()


def test_a_block_let_go_of_and_put_again_before_it_was_announced_is_not_announced_gone(tmp_path):
    """The tier evicts block 1 for block 2, then takes block 1 again before its owner drains what was let go of:
    nothing announces block 1 gone (the router and a group's followers keep it, as the tier does)."""
    block_file = len(encode(1, range(BLOCK), NAMES, _block(0)))
    tier = DiskTier(tmp_path, "d" * 32, block_file, NAMES)
    assert tier.put(1, range(BLOCK), _block(1)) and tier.wait_written()
    assert tier.put(2, range(BLOCK), _block(2)) and tier.wait_written()  # evicts 1
    assert not tier.has(1)
    assert tier.put(1, range(BLOCK), _block(1)) and tier.wait_written()  # evicts 2
    assert tier.take_gone() == [(2, "kv")]
    tier.close()


def test_a_session_larger_than_the_tier_keeps_its_first_blocks_not_its_last(models, tmp_path):
    """A five-block session through a tier of three blocks: the tier keeps the session's first three blocks (a
    prefix a later hit can use), not its last (which no hit reaches without the blocks before them), and lists
    them so that the first is the last to go."""
    from cluster.kv.hashing import block_hashes

    block_file = len(encode(2**64 - 1, [VOCAB - 1] * BLOCK, NAMES, [np.zeros((2, BLOCK, 2, 32), np.float32)] * 2))
    engine = _engine(models[0], tmp_path, budget_gb=3 * block_file / 2**30)  # (the largest hash and tokens: 3 files fit)
    engine.tier.queue_bytes = 1 << 20  # the writer's queue takes all five: the budget alone decides
    _answers(engine, SESSIONS[:1], "first")
    assert engine.tier.wait_written()
    hashes = block_hashes(SESSIONS[0], BLOCK, engine._extra_key(None))
    assert [engine.tier.has(h) for h in hashes] == [True, True, True, False, False]
    assert list(engine.tier._index) == [(h, "kv") for h in reversed(hashes[:3])]  # least recently used first
    engine.close()


def test_a_tier_that_cannot_be_is_refused_by_name_and_a_folder_without_a_budget_is_said(models, tmp_path, caplog):
    """An infinite budget, or a folder that is a file or lies under one, is refused naming the setting (never a
    traceback); a folder given without a budget keeps no tier, and the log says why."""
    import logging

    with pytest.raises(ValueError, match="ssd_cache_gb=inf is invalid"):
        EngineConfig(ssd_cache_gb=float("inf"))
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    for folder in (a_file, a_file / "under"):
        with pytest.raises(ValueError, match=f"ssd_cache_dir {folder} cannot hold the SSD tier"):
            _engine(models[0], folder)
    with caplog.at_level(logging.WARNING):
        engine = _engine(models[0], tmp_path / "unused", budget_gb=0)
    assert engine.tier is None and "ssd_cache_gb is 0: no SSD tier" in caplog.text
    assert not (tmp_path / "unused").exists()
