"""A new kind of KV cache group needs no product change: a toy kind defined here (one vector per block, its own
block pool, no layers of the model) joins the plan through `KVPlan.with_group` and is served exactly (against an
engine without it) alone, batched, after a prefix hit and through a 1P1D transfer, and the wing allocates,
caches, reuses and ships its blocks like any other group's."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np

from cluster.engine import EngineCore
from cluster.kv.block_pool import BlockPool
from cluster.kv.groups import GroupHit, KVCacheGroup
from cluster.kv.plan import plan_kv
from cluster.model_structure import verify_model
from tests.family_helpers import family, make_engine, prompts, request, tokenizer

MODEL = "llama"
WIDTH = 4  # floats per block vector


def block_vector(token_ids) -> np.ndarray:
    """What a toy block holds: a vector computed from its tokens."""
    t = np.asarray(token_ids, dtype=np.float32)
    return np.array([t.sum(), t.min(), t.max(), len(t)], dtype=np.float32)


class VectorStore:
    """The toy kind's arrays: one float32 vector per block, behind the store interface a transfer uses
    (`block_array_specs`, `read_blocks`, `write_blocks`)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size, self.num_blocks = block_size, num_blocks
        self.spec = SimpleNamespace(num_layers=1)
        self.vectors = np.zeros((num_blocks, WIDTH), dtype=np.float32)
        self.writes: list[list[int]] = []  # block ids written by a transfer
        self.reads: list[list[int]] = []  # block ids read for a transfer

    @property
    def nbytes(self) -> int:
        return self.vectors.nbytes

    def block_array_specs(self, num_blocks: int, num_layers: int):
        return [("vec", "float32", (num_layers, num_blocks, WIDTH))]

    def read_blocks(self, block_ids, layers):
        self.reads.append(list(block_ids))
        return [np.ascontiguousarray(self.vectors[list(block_ids)][None])]

    def write_blocks(self, block_ids, layers, arrays):
        self.writes.append(list(block_ids))
        self.vectors[list(block_ids)] = arrays[0][0]


class VectorGroup(KVCacheGroup):
    """One vector per block, in a pool of its own: written when a computed block is registered (unless the
    block already holds one, e.g. it arrived by transfer), reused by a prefix hit, shipped whole."""

    name = "toy_vectors"

    def __init__(self, pool: BlockPool, store: VectorStore):
        self.pool, self.store = pool, store

    def new_entry(self) -> list[int]:
        return []

    def table(self, entry):
        return entry

    def allocate(self, entry, n):
        entry.extend(self.pool.allocate(n))
        return entry

    def free(self, entry):
        self.pool.free([b for b in entry if b])
        return []

    def longest_hit(self, hashes, token_ids, k, state_shipped):
        bs = self.store.block_size
        n = 0
        while n < k and self.pool.lookup(hashes[n], token_ids[n * bs:(n + 1) * bs]) is not None:
            n += 1
        return n

    def hit(self, hashes, token_ids, k, state_shipped):
        bs = self.store.block_size
        return GroupHit(tuple(self.pool.lookup(hashes[i], token_ids[i * bs:(i + 1) * bs]) for i in range(k)))

    def take(self, entry, hit):
        self.pool.touch([b for b in hit.blocks if b])
        entry.extend(hit.blocks)
        return entry

    def cache_block(self, entry, i, block_hash, token_ids, parent):
        block = entry[i]
        if not self.store.vectors[block].any():
            self.store.vectors[block] = block_vector(token_ids)
        self.pool.cache_block(block, block_hash, token_ids, parent)

    def reset_prefix_cache(self):
        return self.pool.reset_prefix_cache()

    def first_to_ship(self, num_tokens, num_blocks):
        return 0


def with_vectors(plan, pool, owner):
    """The toy group's factory (`KVPlan.with_group`): a pool as large as the anchor pool, caching as it does."""
    caching = plan.config.enable_prefix_caching
    return VectorGroup(BlockPool(plan.num_blocks, caching, event_log=pool.event_log, group=3),
                       VectorStore(plan.num_blocks, plan.config.block_size))


def toy_engine(**config) -> EngineCore:
    plain = make_engine(MODEL, **config)
    model, spec = family(MODEL)
    plan = plan_kv(spec, plain.config, verify_model(model)).with_group(with_vectors)
    return EngineCore(model, tokenizer(), spec, plain.config, kv_plan=plan)


def run(engine: EngineCore, reqs) -> dict[str, list]:
    """Every request's (token ids, logprobs) to the end."""
    out = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += list(zip(o.token_ids, o.logprobs or [None] * len(o.token_ids)))
    return out


def vectors_of(engine: EngineCore, table, tokens) -> list:
    group = engine.kv.groups[-1]
    bs = engine.block_size
    return [(group.store.vectors[b].tolist(), block_vector(tokens[i * bs:(i + 1) * bs]).tolist())
            for i, b in enumerate(table[:len(tokens) // bs])]


def test_a_toy_kind_is_planned_built_and_served_exactly_alone_and_batched():
    toy, plain = toy_engine(), make_engine(MODEL)
    assert [g.name for g in toy.kv.groups] == ["full", "toy_vectors"]
    reqs = [request(f"r{i}", p) for i, p in enumerate(prompts())]
    assert run(toy, reqs[:1]) == run(plain, reqs[:1])  # alone
    assert run(toy, reqs) == run(plain, reqs)  # batched
    group = toy.kv.groups[-1]
    assert group.pool.num_free_blocks == group.pool.num_usable_blocks  # every block back
    assert group.pool.num_cached_blocks == toy.pool.num_cached_blocks == 0  # caching is off here


def test_a_prefix_hit_reuses_the_toy_blocks_and_their_vectors():
    toy, plain = toy_engine(enable_prefix_caching=True), make_engine(MODEL)
    head = prompts()[3]  # 26 tokens: three whole 8-token blocks
    first, second = request("a", head + [5, 6]), request("b", head + [7, 8, 9])
    assert run(toy, [first]) == run(plain, [first])
    group = toy.kv.groups[-1]
    cached = group.pool.num_cached_blocks
    assert cached == toy.pool.num_cached_blocks >= 3
    toy.add_request(second)
    toy.step()  # admitted: the hit takes the cached blocks in both groups
    table = toy.kv.tables("b")[-1]
    assert toy.sequences["b"].num_cached_tokens == 24
    assert all(got == want for got, want in vectors_of(toy, table, head[:24]))
    while toy.has_work():
        toy.step()
    plain2 = make_engine(MODEL)
    assert run(toy, [request("c", head + [7, 8, 9])]) == run(plain2, [request("c", head + [7, 8, 9])])


def test_a_toy_kinds_blocks_ship_through_a_1p1d_transfer(monkeypatch, tmp_path):
    """Both workers plan the toy group (the plan is patched where the engine makes it); a 45-token prompt is
    prefilled by the prefill worker, whose toy store is read for the transfer, and the decode worker's toy
    store is written with the same vectors; the answer is the plain engine's."""
    import httpx

    import cluster.engine
    from cluster.model import DEFAULT_MODEL
    from tests.cluster_helpers import running_cluster

    real = cluster.engine.plan_kv
    monkeypatch.setattr(cluster.engine, "plan_kv", lambda *a, **k: real(*a, **k).with_group(with_vectors))
    model, spec = family(MODEL)
    spec = dataclasses.replace(spec, model_id=DEFAULT_MODEL)
    long = np.random.RandomState(11).randint(100, 250, size=45).tolist()
    want = [t for t, _ in run(make_engine(MODEL), [request("x", long)])["x"]]
    engine = "block_size = 8\nprefill_chunk_size = 16"
    with running_cluster(1, 1, loaded=(model, tokenizer(), spec), engine=engine,
                         routing="local_prefill_max_tokens = 0") as (base, client, workers):
        r = httpx.post(base + "/v1/completions", timeout=300, json={
            "model": DEFAULT_MODEL, "prompt": long, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tokenizer().decode(want)
        sent = workers["prefill-0"].engine.kv.groups[-1].store
        got = workers["decode-0"].engine.kv.groups[-1].store
    shipped = [b for ids in sent.reads for b in ids]
    written = [b for ids in got.writes for b in ids]
    assert len(shipped) == len(written) == -(-45 // 8)  # every block of the prompt, the partial one too
    for s_block, d_block, i in zip(shipped, written, range(5)):  # the five full blocks' vectors crossed
        assert got.vectors[d_block].tolist() == sent.vectors[s_block].tolist() \
            == block_vector(long[i * 8:(i + 1) * 8]).tolist()

