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

from cluster.kv.block_pool import BlockPool
from cluster.kv.manager import KVManager
from cluster.request import GenerateRequest, SamplingParams
from cluster.sequence import Sequence

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("cluster", "router", "prefill_node", "decode_node", "kv_transfer", "benchmarks")
OWNERS = {"cluster/kv/manager.py", "cluster/scheduler.py"}
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


def seq(rid: str, n: int = 6) -> Sequence:
    return Sequence(GenerateRequest(rid, tuple(range(1, n + 1)), SamplingParams(max_tokens=4)), max_tokens=4)


def test_a_holding_is_freed_once_by_release_or_ends_when_adopted():
    pool = BlockPool(9)
    kv = KVManager(pool)
    free0 = pool.num_free_blocks
    held = kv.reserve("a", [], 3, 0)
    assert len(held.block_table) == 3 and pool.num_free_blocks == free0 - 3
    with pytest.raises(ValueError, match="already holds"):
        kv.reserve("a", [], 1, 0)
    s = seq("a")
    kv.adopt("a", s)  # the request arrived: the holding is its block table now
    assert s.block_table == list(held.block_table) and kv.held("a") is None and not kv.release("a")
    kv.free(s)
    assert s.block_table == [] and pool.num_free_blocks == free0
    kv.free(s)  # idempotent: nothing left to free
    assert pool.num_free_blocks == free0

    kv.reserve("b", [], 2, 0)
    assert kv.release("b") and not kv.release("b") and pool.num_free_blocks == free0


def test_a_finished_sequence_kept_for_its_transfer_is_freed_when_the_transfer_ends():
    pool = BlockPool(9)
    kv = KVManager(pool)
    free0 = pool.num_free_blocks
    s = seq("p")
    kv.allocate(s, 2)
    table = list(s.block_table)
    held = kv.hold(s)  # the first token is out; the blocks stay while they ship
    assert s.block_table == [] and held.block_table == tuple(table) and pool.num_free_blocks == free0 - 2
    assert kv.release("p") and pool.num_free_blocks == free0


def test_reserving_more_than_is_free_raises_and_holds_nothing():
    pool = BlockPool(4)
    kv = KVManager(pool)
    with pytest.raises(ValueError, match="cannot hold"):
        kv.reserve("x", [], 4, 0)
    assert kv.held("x") is None and pool.num_free_blocks == 3


def test_a_pinned_cached_block_outlives_an_allocation_that_would_evict_it():
    """A head hit's source is pinned from the match until the copy: allocating every free block leaves it
    cached, and unpinning returns it to the free queue, still cached; unpinning what is not pinned fails."""
    pool = BlockPool(4)  # blocks 1..3
    kv = KVManager(pool)
    s = seq("a")
    kv.allocate(s, 1)
    [source] = s.block_table
    kv.cache_block(s, 0, 99, (1, 2, 3, 4), parent=7)
    kv.free(s)  # cached, on the free queue
    kv.pin(source)
    taken = pool.allocate(pool.num_free_blocks)
    assert source not in taken and pool.find_partial(7, [1, 2]) == (source, 2)
    kv.unpin(source)
    assert pool.blocks[source].ref_cnt == 0 and pool.num_free_blocks == 1
    with pytest.raises(KeyError):
        kv.unpin(source)
