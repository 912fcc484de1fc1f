"""Each block of a prompt is hashed once in the whole cluster: by the router when it places by prefix (the
request carries the hashes to the prefill worker, whose transfer offer carries them to the decode worker), or
by the engine itself in single-node mode; a block filled during generation is hashed once where it fills.
Hashes computed under another first-block key are never taken."""

from __future__ import annotations

import collections
import threading

import httpx
import pytest

from cluster.kv import hashing
from cluster.kv.block_pool import BlockPool
from cluster.kv.hashing import block_hashes, carried_hashes, extend_block_hashes
from cluster.protocol import PROTOCOL_VERSION, TO_WORKER, Generate, pack, unpack
from cluster.request import GenerateRequest, SamplingParams

BS = 32
PROMPT_LEN = 6 * BS + 5  # six full blocks and a partial one
MAX_TOKENS = 40  # the partial block fills during generation: the last token is never computed, so 7 full blocks


class HashCalls:
    """Counts `hash_block`, the one function every block hash goes through, by (parent, tokens)."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[int, tuple[int, ...]]] = []
        self._lock = threading.Lock()
        real = hashing.hash_block

        def counted(parent, token_ids):
            with self._lock:
                self.calls.append((parent, tuple(token_ids)))
            return real(parent, token_ids)

        monkeypatch.setattr(hashing, "hash_block", counted)

    def clear(self) -> None:
        with self._lock:
            self.calls.clear()

    def tokens(self) -> list[tuple[int, ...]]:
        with self._lock:
            return [tokens for _, tokens in self.calls]


def prompt_ids(seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 131) % 20000 + 10 for i in range(PROMPT_LEN)]


def full_blocks(tokens) -> list[tuple[int, ...]]:
    return [tuple(tokens[i * BS:(i + 1) * BS]) for i in range(len(tokens) // BS)]


def test_carried_hashes_are_taken_only_under_the_same_key():
    tokens = list(range(3 * BS + 1))
    key, other = hashing.first_block_key("m", "r", "float32", None, 64, BS), \
        hashing.first_block_key("m", "r", "float32", None, 64, BS, "tenant")
    hashes = block_hashes(tokens, BS, key)
    assert carried_hashes(hashes, key, key, len(tokens), BS) == hashes
    assert carried_hashes(hashes, key, other, len(tokens), BS) == []  # another salt: hashed again
    assert carried_hashes(hashes, None, key, len(tokens), BS) == []
    assert carried_hashes(hashes + [1, 2], key, key, len(tokens), BS) == hashes  # never past the full blocks
    known = hashes[:1]
    assert extend_block_hashes(known, tokens, BS, key, 2) is known and known == hashes[:2]
    assert extend_block_hashes(known, tokens, BS, key) == hashes


def test_request_hashes_survive_the_control_wire_and_are_checked():
    key = 2**64 - 1
    req = GenerateRequest("r", tuple(range(2 * BS)), SamplingParams(max_tokens=1)).with_block_hashes([0, 2**64 - 2],
                                                                                                        key)
    got = unpack(pack(Generate(request=req)), TO_WORKER, PROTOCOL_VERSION).request
    assert got == req and got.prompt_block_hashes == (0, 2**64 - 2) and got.prompt_hash_key == key
    with pytest.raises(ValueError, match="prompt_hash_key"):
        GenerateRequest("r", (1, 2), prompt_block_hashes=(5,))
    with pytest.raises(ValueError, match="2\\*\\*64"):
        req.with_block_hashes([2**64], key)


def test_single_node_hashes_each_block_once(monkeypatch):
    from tests.engine_helpers import fast_model, make_engine, run

    engine = make_engine(fast_model(), block_size=BS)
    calls = HashCalls(monkeypatch)
    prompt = prompt_ids()
    req = GenerateRequest("a", tuple(prompt), SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    result = run(engine, [req])["a"]
    tokens = prompt + result.token_ids
    assert len(result.token_ids) == MAX_TOKENS
    assert calls.tokens() == full_blocks(tokens[:-1])  # prompt blocks at admission, then the one that filled

    # The same prompt again: a prefix hit, and again each of its blocks hashed once.
    calls.clear()
    run(engine, [GenerateRequest("b", tuple(prompt), SamplingParams(max_tokens=1, temperature=0))])
    assert calls.tokens() == full_blocks(prompt)
    assert engine.pool.num_cached_blocks >= len(prompt) // BS


def test_engine_takes_carried_hashes_only_under_its_own_key(monkeypatch):
    from tests.engine_helpers import fast_model, make_engine, run

    engine = make_engine(fast_model(), block_size=BS)
    prompt = prompt_ids(1)
    sp = SamplingParams(max_tokens=1, temperature=0)
    mine = engine._extra_key(None)
    calls = HashCalls(monkeypatch)
    hashes = block_hashes(prompt, BS, mine)
    calls.clear()
    run(engine, [GenerateRequest("mine", tuple(prompt), sp).with_block_hashes(hashes, mine)])
    assert calls.tokens() == []  # every block it registered came hashed
    assert set(hashes) <= set(engine.pool.cached_hashes())

    engine.pool.reset_prefix_cache()
    salted = engine._extra_key("other tenant")  # the request has no salt: these are not the engine's hashes
    theirs = GenerateRequest("theirs", tuple(prompt), sp).with_block_hashes(block_hashes(prompt, BS, salted), salted)
    calls.clear()
    run(engine, [theirs])
    assert calls.tokens() == full_blocks(prompt)  # another key: hashed here, once


def test_1p1d_hashes_each_prompt_block_once_in_the_cluster(monkeypatch):
    """Router, prefill worker and decode worker in one process: the prompt's blocks are hashed by the router
    only, the block filled during generation by the decode worker only, and no pool registers a block twice."""
    from tests.cluster_helpers import running_cluster
    from tests.cluster_requests import MODEL
    from tests.engine_helpers import fast_model

    registered = collections.Counter()
    lock = threading.Lock()
    real_cache_block = BlockPool.cache_block

    def counted_cache_block(pool, block_id, block_hash, token_ids, parent=None):
        with lock:
            registered[(id(pool), block_hash)] += 1
        return real_cache_block(pool, block_id, block_hash, token_ids, parent)

    with running_cluster(1, 1, loaded=fast_model(), routing="local_prefill_max_tokens = 0") as (base, client, workers):
        calls = HashCalls(monkeypatch)
        monkeypatch.setattr(BlockPool, "cache_block", counted_cache_block)
        prompt = prompt_ids(2)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        r = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
        hashed = calls.tokens()
        assert hashed[:len(prompt) // BS] == full_blocks(prompt)  # the router's, for placement
        assert len(hashed) == (PROMPT_LEN + MAX_TOKENS - 1) // BS  # and one more: the block generation filled
        assert len(set(hashed)) == len(hashed)
        # the prompt's blocks in the prefill worker's pool and, received, in the decode worker's; the filled one
        assert len({pool for pool, _ in registered}) == 2, registered
        assert sum(registered.values()) == 2 * (len(prompt) // BS) + 1 and max(registered.values()) == 1, registered
