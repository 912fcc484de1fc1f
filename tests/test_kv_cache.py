"""Paged KV layout and the mlx-lm cache view, on a tiny random-weight llama (structure, not quality)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

from cluster.kv.layout import BatchLayout
from cluster.kv.store import KVStore, kv_bytes_per_block
from cluster.model import ModelSpec
from cluster.runner import BatchItem, Logits, ModelRunner


def tiny_model():
    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97,
                           head_dim=32)
    model = llama.Model(args)
    mx.eval(model.parameters())
    spec = ModelSpec("tiny", "r0", 2, 4, 2, 32, 97, 512, (1,))
    return model, spec


def test_layout_worked_example():
    layout = BatchLayout.build([[7, 2]], [0], [6], block_size=4)
    assert layout.write_slots.tolist() == [28, 29, 30, 31, 8, 9]
    assert layout.gather_slots.tolist() == [[28, 29, 30, 31, 8, 9]]
    assert layout.offset == 0 and layout.mask == "causal"


def test_padding_writes_only_into_the_null_block():
    layout = BatchLayout.build([[5], [1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12]], [0, 0], [1, 40], block_size=4)
    write = np.array(layout.write_slots.tolist()).reshape(2, 40)
    assert (write[0, 1:] < 4).all()  # 39 padding positions, all inside block 0
    assert write[0, 0] == 20
    mask = np.array(layout.mask.tolist())
    assert mask.shape == (2, 1, 40, 40)
    assert mask[0, 0, 0].tolist() == [True] + [False] * 39


@pytest.mark.parametrize("mask_rank", [4, 5])
def test_windowed_mask_is_mlx_lms_sliding_window_mask_row_by_row(mask_rank):
    """A sliding-window layer's mask (window 3) for one sequence, for two rows of different starts and
    lengths (padding hidden as well), and for a decode step over the mirror: each row's visible keys are
    exactly those of mlx-lm's `create_causal_mask(N, offset, window_size=3)` at that row's positions."""
    from mlx_lm.models.base import create_causal_mask

    from cluster.kv.decode_mirror import DecodeMirror

    def visible(mask, b, rows, cols):
        m = np.array(mask.tolist(), dtype=bool).reshape(mask.shape[0] if mask.ndim > 2 else 1, -1, *mask.shape[-2:])
        return m[min(b, m.shape[0] - 1), 0][:rows, :cols]

    def want(n, offset):
        return np.array(create_causal_mask(n, offset, window_size=3).tolist(), dtype=bool)

    one = BatchLayout.build([[7, 2]], [2], [5], block_size=4, mask_rank=mask_rank)
    assert visible(one.windowed_mask(3), 0, 5, 7).tolist() == want(5, 2).tolist()
    two = BatchLayout.build([[7, 2], [3, 4, 5]], [0, 6], [6, 3], block_size=4, mask_rank=mask_rank)
    got = two.windowed_mask(3)
    assert got.ndim == mask_rank
    assert visible(got, 0, 6, 6).tolist() == want(6, 0).tolist()
    assert not visible(got, 0, 6, 9)[:, 6:].any()  # row 0's context ends at 6
    assert visible(got, 1, 3, 9).tolist() == want(3, 6).tolist()

    store = KVStore(ModelSpec("tiny", "r0", 2, 4, 2, 32, 97, 512, (1,)), num_blocks=16, block_size=4,
                    mirror_budget_bytes=1 << 24)
    step = BatchLayout.build_decode(store, ["a", "b"], [[7, 2], [3, 4]], [5, 3], mask_rank=mask_rank)
    assert step.mirror is not None and isinstance(store.mirror, DecodeMirror)
    mirrored = step.windowed_mask(3)
    # width 5: row a's positions 0..5 are columns 0..5; row b's positions 0..3 are columns 2..5
    assert visible(mirrored, 0, 1, 6).tolist() == [[False, False, False, True, True, True]]
    assert visible(mirrored, 1, 1, 6).tolist() == [[False, False, False, True, True, True]]
    with pytest.raises(ValueError, match="at least one position"):
        one.windowed_mask(0)


def reference_logits(model, tokens: list[int]) -> mx.array:
    cache = [KVCache() for _ in model.layers]
    return model(mx.array([tokens]), cache=cache)[0, -1]


KV_MODES = [(None, None), (8, False), (8, True), (4, True)]  # (kv_bits, dequantize_for_attention)


@pytest.mark.parametrize("kv_bits,dequant", KV_MODES)
def test_paged_batched_chunked_forward_matches_contiguous_cache(kv_bits, dequant):
    model, spec = tiny_model()
    store = KVStore(spec, num_blocks=16, block_size=4, kv_bits=kv_bits, kv_group_size=32,
                    dequantize_for_attention=dequant)
    runner = ModelRunner(model, store)
    a, b = list(range(3, 14)), list(range(20, 27))
    ta, tb = [9, 3, 5], [1, 12]  # scattered, non-contiguous blocks
    runner.forward([BatchItem(ta, 0, a[:6])])  # chunk 1 of a
    la, lb = runner.forward([BatchItem(ta, 6, a[6:]), BatchItem(tb, 0, b)])  # chunk 2 of a batched with b
    tol = {None: 1e-4, 8: 5e-2, 4: 0.5}[kv_bits]
    assert mx.allclose(la, reference_logits(model, a).astype(mx.float32), atol=tol).item()
    assert mx.allclose(lb, reference_logits(model, b).astype(mx.float32), atol=tol).item()
    # one decode step for both, at different positions
    la, lb = runner.forward([BatchItem(ta, len(a), [50]), BatchItem(tb, len(b), [60])])
    assert mx.allclose(la, reference_logits(model, a + [50]).astype(mx.float32), atol=tol).item()
    assert mx.allclose(lb, reference_logits(model, b + [60]).astype(mx.float32), atol=tol).item()


def test_bytes_per_block_and_group_size_validation():
    _, spec = tiny_model()
    full = kv_bytes_per_block(spec, 4, "float32", None, 64)
    assert full == 2 * 2 * 4 * 2 * 32 * 4
    q4 = kv_bytes_per_block(spec, 4, "float16", 4, 32)
    assert q4 < full / 3
    with pytest.raises(ValueError, match="does not divide head_dim"):
        KVStore(ModelSpec("t", "r", 1, 2, 1, 48, 10, 64, ()), 4, 4, kv_bits=8, kv_group_size=32)


@pytest.mark.parametrize("kv_bits,dequant", KV_MODES)
def test_decode_mirror_matches_contiguous_cache_across_batch_changes(kv_bits, dequant):
    model, spec = tiny_model()
    store = KVStore(spec, num_blocks=32, block_size=4, kv_bits=kv_bits, kv_group_size=32,
                    mirror_budget_bytes=1 << 24, dequantize_for_attention=dequant)
    runner = ModelRunner(model, store)
    tol = {None: 1e-4, 8: 5e-2, 4: 0.5}[kv_bits]
    seqs = {"a": ([9, 3, 5, 7], list(range(3, 10))), "b": ([1, 12, 14], list(range(20, 23))),
            "c": ([2, 4, 6, 8], list(range(40, 45)))}
    for table, toks in seqs.values():
        runner.forward([BatchItem(table, 0, toks, Logits.NONE)])
    plan = [("a", "b"), ("a", "b"), ("a", "b", "c"), ("a", "c"), ("a", "c")]  # joins and leaves
    for step, rows in enumerate(plan):
        items = [BatchItem(seqs[r][0], len(seqs[r][1]), [60 + step], mirror_row=r) for r in rows]
        logits = runner.forward(items)
        assert runner.store.mirror.rows == rows
        for r, lg in zip(rows, logits):
            seqs[r][1].append(60 + step)
            assert mx.allclose(lg, reference_logits(model, seqs[r][1]).astype(mx.float32), atol=tol).item()


def test_decode_mirror_steps_aside_when_over_budget():
    model, spec = tiny_model()
    store = KVStore(spec, num_blocks=16, block_size=4, mirror_budget_bytes=1)  # nothing fits
    runner = ModelRunner(model, store)
    runner.forward([BatchItem([1, 2], 0, [5, 6, 7], Logits.NONE)])
    (lg,) = runner.forward([BatchItem([1, 2], 3, [8], mirror_row="x")])
    assert store.mirror.rows == ()
    assert mx.allclose(lg, reference_logits(model, [5, 6, 7, 8]).astype(mx.float32), atol=1e-4).item()
