"""BlockPool bookkeeping told as stories with exact block ids, ref counts and eviction order (no arrays)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cluster.kv.block_pool import BlockPool
from cluster.kv.hashing import block_extra_key, block_hashes, hash_block

B = 4


def test_allocate_free_and_lru_order():
    pool = BlockPool(6)
    assert pool.num_free_blocks == 5  # block 0 is the null block
    a = pool.allocate(3)
    assert a == [1, 2, 3] and [pool.blocks[i].ref_cnt for i in a] == [1, 1, 1]
    pool.free(a)  # freed tail first: the free queue is now 4, 5, 3, 2, 1
    assert pool.allocate(5) == [4, 5, 3, 2, 1]
    with pytest.raises(ValueError, match="only 0 free"):
        pool.allocate(1)


def test_prefix_hit_touch_and_eviction_story():
    pool = BlockPool(6)
    key = block_extra_key("m", "r", "f")
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    hashes = block_hashes(prompt, B, key)
    assert len(hashes) == 2
    table = pool.allocate(3)  # [1, 2, 3]
    for i, h in enumerate(hashes):
        pool.cache_block(table[i], h, prompt[i * B:(i + 1) * B])
    pool.free(table)  # queue: 4, 5, 3, 2, 1 ; blocks 1, 2 cached with ref_cnt 0

    hit = pool.find_cached_prefix(hashes, prompt, B)
    assert hit == [1, 2]
    pool.touch(hit)
    assert pool.blocks[1].ref_cnt == 1 and pool.num_free_blocks == 3
    pool.free(hit)  # queue: 4, 5, 3, 2, 1

    # allocating 4 blocks takes 4, 5, 3 (uncached) and 2: block 2's hash is evicted, block 1 survives
    assert pool.allocate(4) == [4, 5, 3, 2]
    assert pool.find_cached_prefix(hashes, prompt, B) == [1]
    kinds = [(e.kind, e.block_hashes) for e in pool.drain_events()]
    assert kinds == [("stored", (hashes[0],)), ("stored", (hashes[1],)), ("removed", (hashes[1],))]
    assert [e.seq for e in pool.drain_events()] == []


def test_collision_is_a_miss_and_first_holder_wins():
    pool = BlockPool(4)
    [b1, b2] = pool.allocate(2)
    pool.cache_block(b1, 123, [1, 2, 3, 4])
    pool.cache_block(b2, 123, [9, 9, 9, 9])  # same hash again: ignored
    assert pool.blocks[b2].block_hash is None
    assert pool.find_cached_prefix([123], [5, 6, 7, 8], B) == []  # hash matches, tokens do not
    assert pool.find_cached_prefix([123], [1, 2, 3, 4], B) == [b1]


def test_reset_prefix_cache_forgets_hashes_but_keeps_blocks_in_use():
    pool = BlockPool(4)
    [b1] = pool.allocate(1)
    pool.cache_block(b1, 7, [1, 2, 3, 4])
    assert pool.reset_prefix_cache() == 1
    assert pool.find_cached_prefix([7], [1, 2, 3, 4], B) == []
    assert pool.blocks[b1].ref_cnt == 1
    assert pool.drain_events()[-1].kind == "cleared"


def test_the_head_of_a_cached_block_is_found_among_the_children_of_its_parent():
    """`find_partial` returns the child of the given parent sharing the longest head with the tokens, never a
    child of another parent, and forgets a child once it is evicted or the cache is reset."""
    pool = BlockPool(6)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, 11, [1, 2, 3, 4], parent=100)
    pool.cache_block(b, 12, [1, 2, 9, 9], parent=100)
    pool.cache_block(c, 13, [1, 2, 3, 8], parent=200)  # the same head under another parent
    assert pool.find_partial(100, [1, 2, 3, 5]) == (a, 3)
    assert pool.find_partial(100, [1, 2, 9]) == (b, 3)
    assert pool.find_partial(200, [1, 2, 3, 4]) == (c, 3)
    assert pool.find_partial(100, [7, 2, 3, 4]) is None and pool.find_partial(300, [1]) is None
    pool.free([a, b, c])  # queue: 4, 5, c, b, a
    pool.allocate(5)  # evicts every cached block
    assert pool.find_partial(100, [1, 2, 3]) is None and pool.find_partial(200, [1, 2, 3]) is None
    [d] = [i for i in range(1, 6) if pool.blocks[i].ref_cnt == 1][:1]
    pool.cache_block(d, 14, [1, 2, 3, 4], parent=100)
    assert pool.find_partial(100, [1, 2]) == (d, 2)
    pool.reset_prefix_cache()
    assert pool.find_partial(100, [1, 2]) is None


def test_hashes_chain_and_depend_on_extra_keys():
    tokens = list(range(12))
    k1, k2 = block_extra_key("m", "r", "f"), block_extra_key("m", "r", "f", cache_salt="tenant-b")
    h1 = block_hashes(tokens, B, k1)
    assert h1[1] == hash_block(h1[0], tokens[4:8])
    assert block_hashes(tokens, B, k2)[0] != h1[0]
    assert block_hashes(tokens, B, k1, start=1, parent=h1[0]) == h1[1:]
    assert block_hashes(tokens[:11], B, k1) == h1[:2]  # a partial block is not hashed


def test_hashes_are_equal_in_another_process():
    code = ("from cluster.kv.hashing import block_extra_key, block_hashes;"
            "print(block_hashes(list(range(100)), 32, block_extra_key('m', 'r', 'f', 's')))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123", "PYTHONPATH": "."})
    assert other.stdout.strip() == str(block_hashes(list(range(100)), 32, block_extra_key("m", "r", "f", "s")))
