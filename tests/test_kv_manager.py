"""Blocks have one owner: the KVManager frees them, by sequence or by request id, and nothing else does.

The static checks read every product module with `ast`: a call of `.free(` outside the owner (the KVManager,
and the scheduler that frees its sequences through it), or a function anywhere that takes a block table and
ends something (free / release), fails. The behaviour tests
follow a transfer's holdings through reserve, hold, adopt and release.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from types import SimpleNamespace

from cluster.kv.attention_groups import FullAttentionGroup
from cluster.kv.block_pool import BlockPool
from cluster.kv.hashing import block_hashes
from cluster.kv.manager import KVManager
from cluster.prefix_match import PrefixMatcher
from cluster.request import GenerateRequest, SamplingParams
from cluster.sequence import Sequence

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("cluster", "router", "prefill_node", "decode_node", "kv_transfer", "benchmarks")
# the manager, and the groups it drives (each frees its own pool's blocks only when the manager says so)
OWNERS = {"cluster/kv/manager.py", "cluster/kv/attention_groups.py", "cluster/scheduler.py"}
POOL = "cluster/kv/block_pool.py"  # defines free; never calls it
BLOCK_TABLE_NAMES = {"block_table", "block_ids", "blocks", "table", "tables"}
ENDING_CALLS = {"free", "release"}


def product_modules():
    for pkg in PRODUCT:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text())


def calls(node: ast.AST, names: set[str]):
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in names:
            yield n


def test_only_the_block_owner_calls_a_free_of_pool_blocks():
    found = [f"{rel}:{c.lineno}" for rel, tree in product_modules() if rel not in OWNERS for c in calls(tree, {"free"})]
    assert found == []


def test_no_function_takes_a_block_table_and_frees_or_releases_it():
    found = []
    for rel, tree in product_modules():
        if rel == POOL:
            continue
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
            if params & BLOCK_TABLE_NAMES and any(True for _ in calls(fn, ENDING_CALLS)):
                found.append(f"{rel}:{fn.lineno} {fn.name}")
    assert found == []


def manager(pool: BlockPool, copies: list | None = None) -> KVManager:
    """A manager of one full-attention group over `pool` (blocks of 4 tokens; block copies recorded)."""
    store = SimpleNamespace(block_size=4)
    return KVManager([FullAttentionGroup(pool, store, [0])], 4,
                     None if copies is None else lambda src, dst: copies.append((src, dst)))


def test_a_holding_is_freed_once_by_release_or_ends_when_adopted():
    pool = BlockPool(9)
    kv = manager(pool)
    free0 = pool.num_free_blocks
    none = kv.lookup((), (), 0)
    held = kv.reserve("a", none, 3, 12)
    assert len(held.block_table) == 3 and pool.num_free_blocks == free0 - 3
    with pytest.raises(ValueError, match="already holds"):
        kv.reserve("a", none, 1, 4)
    kv.adopt("a")  # the request arrived: the holding is its KV now
    assert kv.block_table("a") == list(held.block_table) and kv.held("a") is None and not kv.release("a")
    kv.finish("a")
    assert kv.block_table("a") == [] and pool.num_free_blocks == free0
    kv.finish("a")  # nothing left to free
    assert pool.num_free_blocks == free0

    kv.reserve("b", none, 2, 8)
    assert kv.release("b") and not kv.release("b") and pool.num_free_blocks == free0


def test_a_finished_sequence_kept_for_its_transfer_is_freed_when_the_transfer_ends():
    pool = BlockPool(9)
    kv = manager(pool)
    free0 = pool.num_free_blocks
    kv.allocate("p", 2)
    table = kv.block_table("p")
    held = kv.finish("p", keep=True)  # the first token is out; the blocks stay while they ship
    assert held.block_table == tuple(table) and pool.num_free_blocks == free0 - 2
    assert kv.release("p") and pool.num_free_blocks == free0


def test_reserving_more_than_is_free_raises_and_holds_nothing():
    pool = BlockPool(4)
    kv = manager(pool)
    with pytest.raises(ValueError, match="cannot hold"):
        kv.reserve("x", kv.lookup((), (), 0), 4, 16)
    assert kv.held("x") is None and not kv.has("x") and pool.num_free_blocks == 3


def _cached_prompt(kv: KVManager, rid: str, tokens: list[int], root: int) -> list[int]:
    """Run `tokens` through `rid`'s blocks, register its full blocks and finish it: they stay cached."""
    kv.allocate(rid, -(-len(tokens) // 4))
    hashes = block_hashes(tokens, 4, root)
    kv.cache_blocks(rid, 0, hashes, tokens, root)
    kv.finish(rid)
    return hashes


def pool_state(pool: BlockPool) -> tuple:
    return ([(b.ref_cnt, b.block_hash) for b in pool.blocks], list(pool._free), pool.last_event_seq)


def test_a_prefix_lookup_changes_nothing_and_a_sequence_that_does_not_fit_leaves_everything_as_it_was():
    """The lookup of a whole-block hit plus a head hit leaves the pool (ref counts, free queue, cached set,
    events), the matcher's counters and the sequence's counters as they were: the scheduler admits a sequence
    only after it knows it fits, so one that does not fit has nothing to undo."""
    pool, copies = BlockPool(8), []
    kv, root = manager(pool, copies), 7
    cached = list(range(1, 13))
    _cached_prompt(kv, "old", cached, root)
    matcher = PrefixMatcher(kv, 4, lambda salt: root)
    s = Sequence(GenerateRequest("new", tuple(cached[:4] + cached[4:7] + [50, 51]), SamplingParams(max_tokens=4)),
                 max_tokens=4)
    before = pool_state(pool)
    hit = matcher.lookup(s)
    assert hit.num_blocks == 1 and hit.head is not None and hit.num_tokens == 4 + hit.head[1]
    assert pool_state(pool) == before and (matcher.queries, matcher.hits) == (0, 0)
    assert (s.num_computed_tokens, s.num_cached_tokens, s.block_hashes) == (0, 0, []) and not kv.has("new")
    assert kv.free_besides(hit) == pool.num_free_blocks - 1  # the hit's block would leave the free queue


def test_a_head_hit_is_copied_from_a_source_no_allocation_of_the_commit_evicts():
    """Taking a hit whose head source is free: the commit's own allocation (every other free block) never
    evicts the source before its tokens are copied into the sequence's block, and afterwards the source is
    back on the free queue, still cached."""
    pool, copies = BlockPool(5), []  # blocks 1..4
    kv, root = manager(pool, copies), 7
    _cached_prompt(kv, "old", [1, 2, 3, 4], root)
    [source] = [b.block_id for b in pool.blocks if b.block_hash is not None]
    hit = kv.lookup([], [1, 2, 3, 9, 9], 0, head_until=4, root=root)
    assert hit.head == (source, 3)
    kv.commit("new", hit, pool.num_free_blocks - 1)
    table = kv.block_table("new")
    assert source not in table and copies == [(source, table[0])]
    assert pool.blocks[source].ref_cnt == 0 and pool.lookup(pool.blocks[source].block_hash, [1, 2, 3, 4]) == source
