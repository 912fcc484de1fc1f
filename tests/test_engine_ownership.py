"""The ownership rule for engine state (cluster/ownership.py), and a bounded stress of it.

An engine's model calls, KV arrays and the NumPy views that move KV in and out of them belong to one thread.
Touching them from another thread raises at once. Several engines over one shared model, each on its own
thread, moving KV blocks between their pools as a prefill and a decode worker do, while another thread
collects garbage, give every request exactly the answer it gets with no other thread running, and never a
native crash.
"""

from __future__ import annotations

import functools
import gc
import json
import queue
import tempfile
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from cluster.config import EngineConfig
from cluster.engine import EngineCore
from cluster.model import read_model_spec
from cluster.ownership import WrongThreadError
from cluster.request import GenerateRequest, SamplingParams
from tests.engine_helpers import run

VOCAB = 49152  # SmolLM2's tokenizer
CONFIG = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, vocab_size=VOCAB, max_position_embeddings=512,
              rope_theta=10000.0, tie_word_embeddings=True, eos_token_id=2)
BLOCK = 8


@functools.lru_cache(maxsize=1)
def tiny_model():
    """(model, tokenizer, spec): a random-weight 2-layer llama with SmolLM2's tokenizer (a fast forward)."""
    from mlx_lm.models.llama import Model, ModelArgs

    from cluster.gguf_import import ensure_default_model
    from cluster.model import load_tokenizer

    mx.random.seed(3)
    model = Model(ModelArgs.from_dict(CONFIG))
    mx.eval(model.state)
    folder = Path(tempfile.mkdtemp(prefix="ownership-llama-"))
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return model, load_tokenizer(ensure_default_model(progress=False)), read_model_spec(folder, model_id="tiny")


def make_engine(**config) -> EngineCore:
    model, tokenizer, spec = tiny_model()
    config = dict(dict(dtype="float32", num_blocks=128, block_size=BLOCK), **config)
    return EngineCore(model, tokenizer, spec, EngineConfig(**config))


def request(rid: str, prompt, max_tokens: int = 8, **sampling) -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens, logprobs=0, temperature=0.0, **sampling))


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return [rng.randint(100, VOCAB, size=int(rng.randint(3, 40))).tolist() for _ in range(n)]


def on_thread(fn):
    """Run `fn()` on a fresh thread; return its result or raise its exception."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            box["error"] = exc

    t = threading.Thread(target=target)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the thread did not finish"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def test_an_engine_taken_by_its_loop_thread_refuses_every_other_thread():
    """Once a loop thread takes an engine, the thread that built it (or any other) cannot step it, queue or
    abort requests on it, or read, write or view its KV arrays: each raises at once, naming the owner."""
    engine = make_engine()
    on_thread(engine.owner.take)  # the "loop" thread took it, then ended
    blocks = [1, 2]
    attempts = {
        "step": engine.step,
        "add_request": lambda: engine.add_request(request("r", [5, 6, 7])),
        "abort": lambda: engine.abort("r"),
        "read_blocks": lambda: engine.store.read_blocks(blocks, range(2)),
        "write_blocks": lambda: engine.store.write_blocks(blocks, range(2), []),
        "views": lambda: engine.store.views(None),
    }
    for name, attempt in attempts.items():
        with pytest.raises(WrongThreadError, match="owned by thread"):
            attempt()
    assert not engine.sequences and engine.pool.num_free_blocks == engine.pool.num_usable_blocks
    engine.owner.take()  # handed back: the owner may use it
    assert run(engine, [request("back", [5, 6, 7], max_tokens=2)])["back"].final.finished


def test_engines_on_threads_moving_kv_between_them_answer_as_if_alone():
    """Three engines over one shared model, each on its own thread, run batches of prompts of different
    lengths; one of them also ships the KV blocks of a cached prompt (read on its thread) to a fourth thread,
    which writes them into its own pool and reads them back byte for byte; meanwhile the main thread collects
    garbage. Every greedy answer equals, bit for bit, what the same batch gives on one engine with no other
    thread running, and every moved block arrives intact. Bounded: a few hundred steps."""
    rounds = 6
    work = {i: prompts(3, seed=i) for i in range(3)}
    work[2][0] = list(range(1000, 1030))  # three full blocks to ship
    # the reference: each thread's rounds replayed on this thread alone, on a fresh engine (the same batches
    # and the same prefix-cache hits, so the same arithmetic)
    alone = {}
    for i, batch in work.items():
        reference = make_engine()
        for r in range(rounds):
            alone[i, r] = run(reference, [request(f"{i}-{r}-{j}", p) for j, p in enumerate(batch)])
    engines = [make_engine() for _ in range(3)]
    receiver = make_engine()
    moved: "queue.Queue" = queue.Queue()
    errors: list = []
    results: dict = {}
    received: list = []

    def decode_loop(i: int) -> None:
        engine = engines[i]
        engine.owner.take()
        for r in range(rounds):
            got = run(engine, [request(f"{i}-{r}-{j}", p) for j, p in enumerate(work[i])])
            for j in range(len(work[i])):
                results[(i, r, j)] = got[f"{i}-{r}-{j}"]
            if i == 2:  # the "prefill worker": ship the KV of a cached prompt's blocks
                ids = engine.pool.find_cached_prefix(_hashes(engine, work[i][0]), work[i][0], BLOCK)
                assert len(ids) == 3, ids
                moved.put((ids, engine.store.read_blocks(ids, range(2))))
        if i == 2:
            moved.put(None)

    def receive_loop() -> None:
        receiver.owner.take()
        while (item := moved.get(timeout=120)) is not None:
            received.append(item[0])
            ids, arrays = item
            rid = f"moved-{len(received)}"
            dst = list(receiver.kv.reserve(rid, receiver.kv.lookup((), (), 0), len(ids), len(ids)).block_table)  # held
            receiver.store.write_blocks(dst, range(2), arrays)
            back = receiver.store.read_blocks(dst, range(2))
            assert all(np.array_equal(a, b) for a, b in zip(arrays, back)), "moved KV blocks changed on the way"
            receiver.kv.release(rid)

    def guarded(fn, *args):
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(decode_loop, i)) for i in range(3)]
    threads.append(threading.Thread(target=guarded, args=(receive_loop,)))
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads[:3]):
        gc.collect()  # garbage of every thread's objects is collected here, on another thread
        threads[0].join(0.05)
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    assert len(received) == rounds and len(results) == 3 * rounds * 3
    for (i, r, j), got in results.items():
        want = alone[i, r][f"{i}-{r}-{j}"]
        assert got.token_ids == want.token_ids, (i, r, j)
        assert [e.logprob for e in got.logprobs] == [e.logprob for e in want.logprobs], (i, r, j)
    for engine in (*engines, receiver):
        assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks  # every block came back


def _hashes(engine: EngineCore, prompt: list[int]) -> list[int]:
    from cluster.kv.hashing import block_hashes

    return block_hashes(prompt, BLOCK, engine._extra_key(None))
