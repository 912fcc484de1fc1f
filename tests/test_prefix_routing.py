"""The router's PrefixIndex and placement: exact match lengths, event gaps and restarts resync,
a hot prefix spills, unique prompts spread, no worker idles while another queues; and live (an in-process
cluster of the fast random-weight model): a cleared or restarted worker's entries disappear from the router's
index."""

from __future__ import annotations

from types import SimpleNamespace as E

import httpx
import pytest

from cluster.request import GenerateRequest
from cluster.topology import RoutingSection, WorkerSpec
from router.placement import WorkerState, place
from router.prefix_index import PrefixIndex


def ev(seq, kind, *hashes, group=0):
    return E(seq=seq, kind=kind, block_hashes=list(hashes), group=group)


def whole(hashes):
    """A snapshot's groups for a worker with one KV cache group that needs every block (full attention)."""
    return [(0, None, hashes)]


def test_match_counts_leading_blocks_per_worker():
    idx = PrefixIndex(["w0", "w1", "w2"])
    for name in ("w0", "w1", "w2"):
        idx.apply_snapshot(name, "boot", 0, whole([]))
    assert idx.apply_events("w0", "boot", [ev(1, "stored", 10, 11, 12)])
    assert idx.apply_events("w1", "boot", [ev(1, "stored", 10), ev(2, "stored", 12)])  # 12 without 11: no run
    assert idx.match([10, 11, 12, 13], 4) == {"w0": 3, "w1": 1}
    assert idx.match([11, 12], 4) == {"w0": 2}
    assert idx.match([99], 4) == {}
    assert idx.apply_events("w0", "boot", [ev(2, "removed", 11)])
    assert idx.match([10, 11, 12], 4) == {"w0": 1, "w1": 1}
    assert idx.apply_events("w1", "boot", [ev(3, "cleared")])
    assert idx.match([10, 11, 12], 4) == {"w0": 1} and len(idx) == 2  # 10 and 12 of w0; nothing of w1 left


def test_a_worker_with_recurrent_state_counts_only_prefixes_it_can_restore():
    """A hybrid-model worker holds blocks 10-13 with state snapshots after 11 and (later) 13, beside a plain
    worker holding 10-12: the hybrid one matches 2 blocks, then 4; when the snapshot after 13 is dropped it
    is back to 2, and when block 11 is evicted (its snapshot goes with it) to none, while the plain worker
    keeps counting every held block. The snapshots are a KV cache group of reach 1 (a hit's last block
    must be one), whose events the pool emits beside the main pool's."""
    from cluster.kv.block_pool import RESTORE_POINT_GROUP as R

    idx = PrefixIndex(["hybrid", "plain"])
    idx.apply_snapshot("hybrid", "boot", 2, [(0, None, [10, 11, 12, 13]), (R, 1, [11])])
    idx.apply_snapshot("plain", "boot", 0, whole([10, 11, 12]))
    assert idx.match([10, 11, 12, 13], 4) == {"hybrid": 2, "plain": 3}
    assert idx.apply_events("hybrid", "boot", [ev(3, "stored", 13, group=R)])
    assert idx.match([10, 11, 12, 13], 4) == {"hybrid": 4, "plain": 3}
    assert idx.match([10, 11, 12], 4) == {"hybrid": 2, "plain": 3}
    assert idx.apply_events("hybrid", "boot", [ev(4, "removed", 13, group=R)])
    assert idx.match([10, 11, 12, 13], 4) == {"hybrid": 2, "plain": 3}
    assert idx.apply_events("hybrid", "boot", [ev(5, "removed", 11, group=R), ev(6, "removed", 11)])
    assert idx.match([10, 11, 12, 13], 4) == {"plain": 3}
    assert set(idx.holders) == {0}  # nothing left behind by the dropped snapshots
    idx.apply_snapshot("hybrid", "boot2", 0, whole([10, 11]))  # a restart serving an attention-only model
    assert idx.match([10, 11], 4) == {"hybrid": 2, "plain": 2}


def test_a_worker_with_window_layers_counts_only_prefixes_whose_last_window_it_still_holds():
    """A 20-token prompt in five 4-token blocks, window 8: a worker holding all five full-attention blocks and
    the window blocks of the last window (3 and 4) matches five; once its window pool drops block 3 no
    prefix has an intact window (each needs the blocks of its own last window) and it matches none, while a
    plain worker holding the same blocks still matches five; storing window blocks 0 and 1 again makes the
    two-block prefix usable. The window pool is a KV cache group of reach 7 (window - 1 positions)."""
    from cluster.kv.hashing import block_hashes

    tokens, key = list(range(20)), 7
    h = block_hashes(tokens, 4, key)
    idx = PrefixIndex(["win", "plain"])
    idx.apply_snapshot("win", "boot", 0, [(0, None, h), (1, 7, h[3:])])
    idx.apply_snapshot("plain", "boot", 0, whole(h))
    assert idx.match_prompt(tokens, 4, key) == {"win": 5, "plain": 5}
    assert idx.apply_events("win", "boot", [E(seq=1, kind="removed", block_hashes=[h[3]], group=1)])
    assert idx.match_prompt(tokens, 4, key) == {"plain": 5}
    assert idx.apply_events("win", "boot", [E(seq=2, kind="stored", block_hashes=h[:2], group=1)])
    assert idx.match_prompt(tokens, 4, key) == {"win": 2, "plain": 5}
    assert idx.apply_events("win", "boot", [E(seq=3, kind="cleared", block_hashes=[], group=1)])
    assert idx.match_prompt(tokens, 4, key) == {"plain": 5}


def test_a_reach_in_positions_asks_exactly_for_the_blocks_a_window_or_a_restore_point_needs():
    """The router's one rule for every KV cache group (the first block a hit of k blocks needs from a group of
    reach r is max(0, (k x block_size - r) // block_size)) gives, for a sliding window of w positions as reach
    w - 1, the first block the worker's window pool must hold (cluster.kv.groups.window_first_block at the
    hit's end), and for reach 1 the hit's last block alone; a reach of None needs every block."""
    from cluster.kv.groups import window_first_block
    from router.prefix_index import first_needed_block

    for bs in (1, 2, 3, 4, 8, 16, 32):
        for window in list(range(1, 80)) + [127, 128, 129, 512, 4096]:
            for k in range(0, 70):
                assert first_needed_block(k, bs, window - 1) == window_first_block(k * bs, window, bs), (bs, window, k)
        for k in range(1, 70):
            assert first_needed_block(k, bs, 1) == k - 1 and first_needed_block(k, bs, None) == 0


def _worker_pools(kind, num_blocks=24):
    """A KVManager over bare pools as an engine builds them: `kind` "window" adds a window pool (window 10),
    "restore" makes the main pool keep restore points."""
    from types import SimpleNamespace

    from cluster.kv.attention_groups import FullAttentionGroup, SlidingWindowGroup
    from cluster.kv.block_pool import BlockPool
    from cluster.kv.manager import KVManager
    from cluster.kv.state_group import RecurrentStateGroup

    store = SimpleNamespace(block_size=4)
    pool = BlockPool(num_blocks, needs_restore_points=kind == "restore")
    groups = [FullAttentionGroup(pool, store, [0])]
    if kind == "window":
        groups.append(SlidingWindowGroup(BlockPool(num_blocks, event_log=pool.event_log, group=1), store, [1], 10))
    else:
        groups.append(RecurrentStateGroup((), pool, None))
    return KVManager(groups, 4)


def _snapshot_over_the_wire(kv, seq):
    """The worker's snapshot reply, packed and read back as the router reads it."""
    from cluster.kv.index_view import prefix_index_groups
    from cluster.protocol import (PROTOCOL_VERSION, TO_ROUTER, CacheGroupEntries, PrefixIndexSnapshot, pack,
                                  unpack)

    groups = [CacheGroupEntries(group=g.group, reach_tokens=g.reach_tokens, block_hashes=g.hashes)
              for g in prefix_index_groups(kv)]
    msg = unpack(pack(PrefixIndexSnapshot(seq=seq, boot_id="boot", last_event_seq=kv.pool.last_event_seq,
                                          groups=groups)), TO_ROUTER, PROTOCOL_VERSION)
    return [(g.group, g.reach_tokens, g.block_hashes) for g in msg.groups]


def _events_over_the_wire(kv):
    """The worker's drained KV events, packed and read back as the router reads them."""
    from cluster.protocol import KV_EVENTS, PROTOCOL_VERSION, KVEvent, KVEvents, pack, unpack

    events = [KVEvent(seq=e.seq, kind=e.kind, block_hashes=list(e.block_hashes), group=e.group)
              for e in kv.drain_events()]
    return unpack(pack(KVEvents(worker="w", boot_id="boot", events=events)), KV_EVENTS, PROTOCOL_VERSION).events


@pytest.mark.parametrize("kind", ["window", "restore"])
def test_the_router_counts_what_a_worker_with_a_window_pool_or_restore_points_would_hit(kind):
    """A worker whose pools see random traffic (prompts cached in both pools or with state snapshots kept and
    dropped, evictions, a cache reset), followed by the router through its snapshot reply and KV events on
    the wire: for every prompt the router's count equals the hit the worker's own lookup gives (main pool,
    cut back to a restore point or to an intact last window), the routing of before the groups were generic."""
    import random

    from cluster.kv.hashing import block_hashes

    bs, key, rng = 4, 5, random.Random(7)
    kv = _worker_pools(kind)
    pool = kv.pool
    heads = [[rng.randrange(1000) for _ in range(8 * bs)] for _ in range(3)]
    prompts = [head[:n * bs] + [rng.randrange(1000) for _ in range(rng.randrange(0, 3) * bs)]
               for head in heads for n in range(1, 9, 2)]

    window_pool = kv.groups[1].pool if kind == "window" else None

    def worker_hit(tokens):
        hashes = block_hashes(tokens, bs, key)
        if kind == "restore":  # the pool's restore points stand for the snapshots here
            return len(pool.find_cached_prefix(hashes, tokens, bs))
        return kv.lookup(hashes, tokens, len(hashes)).num_blocks

    def run(tokens):
        hashes = block_hashes(tokens, bs, key)
        n = min(len(hashes), pool.num_free_blocks - 1)
        main = pool.allocate(n)
        window = window_pool.allocate(n) if window_pool else []
        for i in range(n):
            parent = hashes[i - 1] if i else key
            pool.cache_block(main[i], hashes[i], tokens[i * bs:(i + 1) * bs], parent)
            if window and rng.random() < 0.7:  # a window block released before it was filled is never cached
                window_pool.cache_block(window[i], hashes[i], tokens[i * bs:(i + 1) * bs], parent)
            if pool.needs_restore_points and rng.random() < 0.3:
                pool.mark_restorable(hashes[i])
        if pool.needs_restore_points and n and rng.random() < 0.3:
            pool.unmark_restorable(hashes[rng.randrange(n)])
        pool.free(main)
        if window:
            window_pool.free(window)

    idx = PrefixIndex(["w"])
    groups = _snapshot_over_the_wire(kv, 0)
    reaches = {"window": [(0, None), (1, 9)], "restore": [(0, None), (2, 1)]}  # window 10: reach 9
    assert [(g, reach) for g, reach, _ in groups] == reaches[kind]
    idx.apply_snapshot("w", "boot", pool.last_event_seq, groups)
    checked = 0
    for step in range(300):
        run(rng.choice(prompts))
        if step == 150:
            kv.reset_prefix_cache()
        if step % 7 == 0:
            assert idx.apply_events("w", "boot", _events_over_the_wire(kv))
            if step % 70 == 0:  # a resync replaces what the events built, to the same effect
                idx.apply_snapshot("w", "boot", pool.last_event_seq, _snapshot_over_the_wire(kv, step))
            for tokens in prompts:
                want = worker_hit(tokens)
                assert idx.match_prompt(tokens, bs, key).get("w", 0) == want, (step, tokens)
                checked += want > 0
    assert checked > 50  # hits were there to count, not only misses


def test_the_snapshot_reply_lists_each_group_once_and_events_name_no_other_kinds():
    """The wire codec keeps to the generic form: a reply listing a group twice and an event of a kind other
    than stored / removed / cleared are protocol errors."""
    from cluster.protocol import (KV_EVENTS, PROTOCOL_VERSION, TO_ROUTER, CacheGroupEntries, KVEvent, KVEvents,
                                  PrefixIndexSnapshot, ProtocolError, pack, unpack)

    twice = [CacheGroupEntries(group=0, reach_tokens=None, block_hashes=[1]),
             CacheGroupEntries(group=0, reach_tokens=3, block_hashes=[])]
    with pytest.raises(ValueError):
        PrefixIndexSnapshot(seq=0, boot_id="b", last_event_seq=0, groups=twice)
    frame = pack(KVEvents(worker="w", boot_id="b", events=[KVEvent(seq=1, kind="stored", block_hashes=[1], group=2)]))
    assert unpack(frame, KV_EVENTS, PROTOCOL_VERSION).events[0].group == 2
    with pytest.raises(ProtocolError):
        unpack(frame.replace(b"stored", b"unknow"), KV_EVENTS, PROTOCOL_VERSION)
    ok = PrefixIndexSnapshot(seq=0, boot_id="b", last_event_seq=0, groups=twice[:1])
    assert unpack(pack(ok), TO_ROUTER, PROTOCOL_VERSION) == ok


def test_the_router_and_the_transfer_handshake_key_a_prompt_as_one_function_does():
    """cluster.kv.hashing.first_block_key is the one home of the first block's key: the router's cached-blocks
    lookup (PrefixIndex.match_prompt) and the transfer handshake (KVFormat) hash a prompt with it."""
    from cluster.kv.hashing import block_hashes, first_block_key
    from kv_transfer.handshake import KVFormat

    fmt = KVFormat(model_id="m", revision="r", dtype="bfloat16", kv_bits=4, kv_group_size=32, block_size=4,
                   num_layers=1, num_kv_heads=1, head_dim=32)
    key = first_block_key("m", "r", "bfloat16", 4, 32, 4, "tenant")
    assert fmt.extra_key("tenant") == key != first_block_key("m", "r", "bfloat16", 8, 32, 4, "tenant")
    prompt = list(range(10))  # two full blocks
    idx = PrefixIndex(["w0"])
    idx.apply_snapshot("w0", "boot", 0, whole(fmt.block_hashes(prompt, "tenant")[:1]))
    assert idx.match_prompt(prompt, 4, key) == {"w0": 1} == idx.match(block_hashes(prompt, 4, key), 4)
    assert idx.match_prompt(prompt, 4, first_block_key("m", "r", "bfloat16", 4, 32, 4)) == {}  # another tenant


def test_a_gap_or_a_new_boot_marks_the_worker_stale_until_a_snapshot():
    idx = PrefixIndex(["w0"])
    assert idx.needs_snapshot() == ["w0"]  # nothing is trusted before the first snapshot
    idx.apply_snapshot("w0", "b1", 5, whole([1, 2]))
    assert idx.needs_snapshot() == [] and idx.match([1, 2], 4) == {"w0": 2}
    assert idx.apply_events("w0", "b1", [ev(4, "stored", 7), ev(5, "stored", 8)])  # already in the snapshot
    assert idx.match([7], 4) == {}
    assert not idx.apply_events("w0", "b1", [ev(7, "stored", 3)])  # event 6 was lost
    assert idx.needs_snapshot() == ["w0"]
    assert not idx.apply_events("w0", "b1", [ev(8, "stored", 4)])  # stays stale: nothing applied
    idx.apply_snapshot("w0", "b1", 8, whole([1, 3, 4]))
    assert idx.match([1, 2], 4) == {"w0": 1} and idx.match([3, 4], 4) == {"w0": 2}
    assert not idx.apply_events("w0", "b2", [ev(1, "stored", 9)])  # a restart: new boot id
    idx.apply_snapshot("w0", "b2", 1, whole([9]))  # the restarted worker holds only what it computed since
    assert idx.match([1], 4) == {} and idx.match([9], 4) == {"w0": 1} and len(idx) == 1


def test_forget_drops_a_dead_worker_and_the_index_stays_bounded():
    idx = PrefixIndex(["w0", "w1"])
    idx.apply_snapshot("w0", "b", 0, whole(range(1000)))
    idx.apply_snapshot("w1", "b", 0, whole(range(500, 1500)))
    assert len(idx) == 1500
    for seq in range(1, 101):  # churn: each store evicts an older block, as a full pool does
        assert idx.apply_events("w0", "b", [ev(seq, "stored", 10_000 + seq), ev(seq, "removed", seq - 1)][:1])
        idx.apply_events("w0", "b", [])
    idx.forget("w1")
    assert idx.match(list(range(500, 510)), 4) == {"w0": 10} and len(idx) == 1100
    assert idx.needs_snapshot() == ["w1"]


def workers(n, role="decode"):
    return [WorkerState(WorkerSpec(f"{role[0]}{i}", role, 7000 + i, kv_port=8000 + i if role == "decode" else None),
                        alive=True) for i in range(n)]


def request(n_tokens=400, rid="r"):
    return GenerateRequest(rid, tuple(range(1, n_tokens + 1)))


def test_unique_prompts_spread_evenly():
    """Requests with no cached prefix spread with max/min per-worker count <= 2 (here exactly even),
    whether they arrive one after another or pile up."""
    for concurrent in (False, True):
        ws, counts = workers(4), {}
        for i in range(40):
            _, d = place(ws, request(rid=f"r{i}"), RoutingSection(), cached={})
            counts[d.spec.name] = counts.get(d.spec.name, 0) + 1
            if concurrent:
                d.inflight.add(f"r{i}")
        assert max(counts.values()) / min(counts.values()) <= 2 and sum(counts.values()) == 40


def test_a_hot_prefix_goes_to_its_holder_then_spills_once_it_is_saturated():
    routing = RoutingSection(spill_margin=2, cache_weight=0.1)
    ws = workers(3)
    cached = {"d0": 30}  # d0 holds 30 blocks of the shared system prompt
    picks = []
    for i in range(12):
        _, d = place(ws, request(rid=f"r{i}"), routing, cached=cached)
        d.inflight.add(f"r{i}")
        picks.append(d.spec.name)
    assert picks[:3] == ["d0", "d0", "d0"]  # the cache is worth ~3 requests in flight
    assert set(picks) == {"d0", "d1", "d2"}  # then the others take their share: nobody idles
    loads = [len(w.inflight) for w in ws]
    assert max(loads) - min(loads) <= routing.spill_margin + 1  # the holder never runs away


def test_a_prefix_in_ram_wins_over_the_same_prefix_on_disk_which_wins_over_none():
    """Three decode workers: one holds the prompt's 20 blocks in RAM, one the same 20 only on its SSD tier, one
    nothing. The RAM holder gets the request; without it, the disk holder; a disk-only block is worth
    `disk_cache_weight` of one in RAM, so a longer run on disk can still win over a short one in RAM."""
    ws = workers(3)
    routing = RoutingSection(disk_cache_weight=0.5)
    cached, on_disk = {"d0": 20, "d1": 20}, {"d1": 20}
    assert place(ws, request(), routing, cached=cached, on_disk=on_disk)[1].spec.name == "d0"
    assert place(ws, request(), routing, cached={"d1": 20}, on_disk=on_disk)[1].spec.name == "d1"
    assert place(ws, request(), routing, cached={"d0": 5, "d1": 20}, on_disk=on_disk)[1].spec.name == "d1"
    assert place(ws, request(), routing, cached={"d0": 15, "d1": 20}, on_disk=on_disk)[1].spec.name == "d0"
    with pytest.raises(ValueError, match="disk_cache_weight"):
        RoutingSection(disk_cache_weight=2)


def test_a_disk_block_is_worth_what_its_worker_measured_loading_saves():
    """A worker that measured its disk blocks as nearly free to load (worth 0.9 of a RAM block) wins with 20 of
    them on disk over a worker with 15 in RAM; one whose disk barely beats computing (worth 0.1) loses; a worker
    that has measured nothing yet counts `disk_cache_weight`."""
    from cluster.stats import WorkerStats

    routing = RoutingSection(disk_cache_weight=0.5)
    cached, on_disk = {"d0": 15, "d1": 20}, {"d1": 20}
    for worth, winner in ((0.9, "d1"), (0.1, "d0"), (None, "d0")):
        ws = workers(2)
        ws[1].stats = WorkerStats(name="d1", role="decode", ssd_block_worth=worth)
        assert place(ws, request(), routing, cached=cached, on_disk=on_disk)[1].spec.name == winner, worth


def test_short_uncached_suffix_skips_the_prefill_worker():
    ws = workers(1, "prefill") + workers(2)
    routing = RoutingSection(local_prefill_max_tokens=64)
    p, d = place(ws, request(400), routing, cached={"d1": 12}, block_size=32)
    assert p is None and d.spec.name == "d1"  # 400 - 12 * 32 = 16 tokens left: prefilled on d1
    p, d = place(ws, request(400), routing, cached={}, block_size=32)
    assert p is not None and p.spec.role == "prefill"


def test_policies_for_comparison():
    ws = workers(3)
    rr = RoutingSection(policy="round_robin")
    assert [place(ws, request(), rr, cached={"d0": 99})[1].spec.name for _ in range(6)] == \
        ["d0", "d1", "d2", "d0", "d1", "d2"]
    mixed = workers(1, "prefill") + workers(2)  # each role takes turns on its own (a shared counter would not)
    picks = [place(mixed, request(1000), rr, cached={}) for _ in range(4)]
    assert [d.spec.name for _, d in picks] == ["d0", "d1", "d0", "d1"] and all(p is not None for p, _ in picks)
    ll = RoutingSection(policy="least_loaded")
    ws[0].inflight.update({"a", "b"})
    assert place(ws, request(), ll, cached={"d0": 99})[1].spec.name != "d0"


def test_no_live_decode_worker_is_a_503():
    from cluster.engine_client import EngineError

    ws = workers(2)
    for w in ws:
        w.alive = False
    with pytest.raises(EngineError, match="no decode worker"):
        place(ws, request(), RoutingSection())


# -- live: a cleared or restarted worker ------------------------------------------------------------------------

def test_router_index_follows_clears_and_restarts():
    from tests.cluster_helpers import running_cluster
    from tests.engine_helpers import fast_model
    from tests.cluster_requests import MODEL, wait_until

    system = "You are a meticulous archivist. " * 40
    body = {"model": MODEL, "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
    with running_cluster(1, 2, loaded=fast_model(), routing="local_prefill_max_tokens = 0") as (base, client, workers):
        assert httpx.post(base + "/v1/chat/completions", json=body, timeout=120).status_code == 200
        prompt = tuple(chat_ids_messages(body["messages"]))
        req = GenerateRequest("probe", prompt)
        predicted = lambda: client.cached_blocks(req)  # noqa: E731
        # the router learns each worker's blocks from its KV events, which arrive on their own time
        assert wait_until(lambda: predicted().get("prefill-0", 0) >= len(prompt) // 32 - 1
                          and any(n.startswith("decode") for n in predicted())), predicted()
        holder = next(n for n in predicted() if n.startswith("decode"))
        other = next(n for n in workers if n.startswith("decode") and n != holder)
        assert wait_until(lambda: workers[holder].stats().kv_bytes_received > 0)  # stats lag <= 0.5 s
        before = {n: workers[n].stats().kv_bytes_received for n in (holder, other)}
        # The same prompt again goes to the decode worker that holds it, and only its uncached tail moves.
        assert httpx.post(base + "/v1/chat/completions", json=body, timeout=120).status_code == 200
        assert wait_until(lambda: workers[holder].stats().kv_bytes_received > before[holder])
        moved = workers[holder].stats().kv_bytes_received - before[holder]
        assert moved <= 2 * before[holder] / (len(prompt) // 32) and workers[other].stats().kv_bytes_received == 0
        assert wait_until(lambda: workers["prefill-0"].stats().prefix_cache_hits > 0)  # stats lag <= 0.5 s

        # Admin clear: within a bounded time the router predicts nothing cached anywhere.
        assert httpx.post(base + "/reset_prefix_cache", timeout=30).status_code == 200
        assert wait_until(lambda: predicted() == {}), predicted()

        # Restart (a new boot): after the router resyncs, the worker's old entries are gone.
        assert httpx.post(base + "/v1/chat/completions", json=body, timeout=120).status_code == 200
        assert wait_until(lambda: "prefill-0" in predicted())

        def restart(worker):  # on the worker's own thread: the engine belongs to it
            worker.engine.pool.reset_prefix_cache()  # what a fresh process has: nothing...
            worker.engine.pool.drain_events()  # ...and no event saying so (a restart sends none)
            worker.boot_id = "restarted"
            block = worker.engine.pool.allocate(1)[0]
            worker.engine.pool.cache_block(block, 12345, list(range(32)))  # its first new block
            worker.engine.pool.free([block])

        workers["prefill-0"].call(restart)
        assert wait_until(lambda: "prefill-0" not in predicted()), predicted()
        assert client.index.num_blocks("prefill-0") == 1
        assert all(not w.inflight for w in client.workers)  # in-flight counters back to zero


def chat_ids_messages(messages):
    from tests.engine_helpers import fast_model

    _, tokenizer, _ = fast_model()  # SmolLM2's tokenizer and chat template
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
