"""A sequence whose KV was computed on one worker and transferred to another decodes token for token like
one computed locally (the default SmolLM2 model, greedy)."""

from __future__ import annotations

import time

import mlx.core as mx
import pytest

from cluster.kv.block_pool import BlockPool
from cluster.kv.manager import KVManager
from cluster.config import EngineConfig, TransferConfig
from cluster.kv.store import KVStore
from cluster.runner import BatchItem, Logits, ModelRunner
from kv_transfer.handshake import KVFormat
from kv_transfer.receiver import KVReceiver, ReceivedSequence
from kv_transfer.sender import KVSender
from tests.engine_helpers import chat_prompt, greedy, make_engine, real_model, run

MAX_TOKENS = 24


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_transferred_sequence_decodes_like_a_local_one(kv_bits):
    model, _, spec = real_model()
    config = EngineConfig(dtype="float32", kv_bits=kv_bits, kv_group_size=32, num_blocks=64)
    prompt = chat_prompt("Name three rivers of Europe and the seas they flow into, one line each.")
    assert len(prompt) % config.block_size  # a partial last block travels too

    local = run(make_engine(kv_bits=kv_bits, kv_group_size=32), [greedy("ref", prompt, MAX_TOKENS)])["ref"]

    fmt = KVFormat.of(spec, config)
    sides = [(BlockPool(64), KVStore(spec, 64, config.block_size, "float32", kv_bits, 32)) for _ in range(2)]
    (pool_p, store_p), (pool_d, store_d) = sides
    kv_d = KVManager.over(pool_d, store_d)  # the decode side's block owner
    rx = KVReceiver(fmt, kv_d, max_prompt_len=spec.max_model_len)
    tx = KVSender(fmt, store_p, config=TransferConfig(max_blocks_per_message=1))
    try:
        # Prefill worker: two chunks, each followed by shipping what is ready.
        runner_p = ModelRunner(model, store_p)
        table = pool_p.allocate(-(-len(prompt) // config.block_size))
        tx.open("r", rx.endpoint, prompt, on_release=lambda: pool_p.free(table))
        cut = len(prompt) // 2 + 3  # mid-block: a chunk boundary need not be a block boundary
        runner_p.forward([BatchItem(table, 0, prompt[:cut], Logits.NONE)])
        tx.blocks_ready("r", table, cut)
        tx.poll(0.01)
        logits = runner_p.forward([BatchItem(table, cut, prompt[cut:], Logits.LAST)])[0]
        first = int(mx.argmax(logits).item())
        tx.blocks_ready("r", table, len(prompt))
        tx.finish("r", first)
        got, done, deadline = None, False, time.monotonic() + 30
        while got is None or not done:
            assert time.monotonic() < deadline
            done = done or any(r.ok for r in tx.poll(0.01))
            got = got or next((e for e in rx.poll(0.01) if isinstance(e, ReceivedSequence)), None)
        assert pool_p.num_free_blocks == pool_p.num_usable_blocks  # the prefill side released its blocks

        # Decode worker: continue from the transferred blocks and the first token.
        runner_d = ModelRunner(model, store_d)
        table_d = got.block_table + pool_d.allocate(2)
        tokens, pos = [got.first_token], len(prompt)
        while len(tokens) < MAX_TOKENS and tokens[-1] not in spec.eos_token_ids:
            logits = runner_d.forward([BatchItem(table_d, pos, [tokens[-1]], Logits.LAST)])[0]
            tokens.append(int(mx.argmax(logits).item()))
            pos += 1
        assert tokens == local.token_ids
    finally:
        tx.close()
        rx.close()
