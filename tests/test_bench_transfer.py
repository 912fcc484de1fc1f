"""Tests of `mlx-pd bench transfer` (benchmarks/transfer_bench.py, benchmarks/transfer_projection.py) with no
real model: the projection's arithmetic on known numbers, a tiny shipping round trip over loopback (byte
counts, the raw baseline's frames), and the CLI wiring down to the JSON file."""

from __future__ import annotations

import json

import pytest

from benchmarks import cli, transfer_bench
from benchmarks.transfer_bench import ship_format
from benchmarks.transfer_projection import Projection, projection_rows
from cluster.kv.store import kv_bytes_per_block
from cluster.model import ModelSpec

TINY = ModelSpec("tiny", "r0", num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64, vocab_size=100,
                 max_model_len=4096, eos_token_ids=(1,))

# --- the projection -----------------------------------------------------------------------------------


def test_llama_8b_kv_bytes_per_token_and_per_prompt():
    p = Projection()
    assert p.kv_bytes_per_token(None) == 32 * 2 * 8 * 128 * 2 == 131_072
    assert 2048 * p.kv_bytes_per_token(None) == 268_435_456
    # 4-bit, group 64, bf16 scale + bias per group: 65,536 values / 2 + 2 x 1,024 groups x 2 bytes
    assert p.kv_bytes_per_token(4) == 32_768 + 4_096 == 36_864
    assert p.kv_bytes_per_token(4) / p.kv_bytes_per_token(None) == pytest.approx(0.28125)


def test_llama_8b_prefill_flops():
    p = Projection()
    # per layer: q, o 4096^2; k, v 4096 x 1024; MLP 3 x 4096 x 14336
    assert p.matmul_params == 32 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336) == 6_979_321_856
    assert p.prefill_flops(0, 2048) == 2 * 6_979_321_856 * 2048 + 2 * 32 * 4096 * 2048**2
    # chunks add up to the whole prompt
    assert p.prefill_flops(0, 2048) + p.prefill_flops(2048, 4096) == pytest.approx(p.prefill_flops(0, 4096))
    assert p.prefill_seconds(0, 2048) == pytest.approx(p.prefill_flops(0, 2048) / (28e12 * 0.6))


def test_exposed_time_is_the_last_chunk_when_the_link_keeps_up():
    p = Projection()
    fast = 1e12  # the link outruns prefill: only the last chunk's transfer is left after prefill ends
    assert p.exposed_seconds(8192, fast, None) == pytest.approx(2048 * 131_072 / fast)
    assert p.exposed_seconds(3000, fast, None) == pytest.approx(952 * 131_072 / fast)  # a short last chunk


def test_exposed_time_when_the_link_is_slower_than_prefill():
    p = Projection()
    slow = 1e6  # every chunk's transfer outlasts the next chunk's compute: transfers run back to back
    first = p.prefill_seconds(0, 2048)
    total = p.prefill_seconds(0, 8192)
    assert p.exposed_seconds(8192, slow, None) == pytest.approx(first + 8192 * 131_072 / slow - total)


def test_projection_rows_cover_prompts_links_and_formats():
    rows = projection_rows(Projection(), prompts=(2048, 32768))
    assert len(rows) == 2 * 2 * 2
    r = next(r for r in rows if r["tokens"] == 2048 and r["link"] == "10 GbE" and r["format"] == "bf16")
    assert r["kv_bytes"] == 268_435_456
    assert r["transfer_s"] == pytest.approx(268_435_456 / 1.125e9)
    assert r["hidden"] == (r["transfer_s"] <= r["prefill_s"])


# --- shipping ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,bits,group", [("float32", None, 64), ("bfloat16", 4, 32)])
def test_tiny_transfer_reports_the_right_byte_count(dtype, bits, group):
    out = ship_format(TINY, dtype=dtype, kv_bits=bits, group_size=group, tokens=200, rounds=2, block_size=32)
    blocks = 7  # ceil(200 / 32): the partial last block travels whole
    expected = kv_bytes_per_block(TINY, 32, dtype, bits, group) * blocks
    assert out["blocks"] == blocks
    assert out["payload_bytes_formula"] == expected
    assert out["payload_bytes_received"] == expected  # the receiver's TransferMetrics, per transfer
    # offer, one blocks message (7 <= 64 blocks) with 2 or 6 array frames, done
    frames = out["wire_frames"]
    assert [len(m) for m in frames] == [1, 1 + (2 if bits is None else 6), 1]
    assert sum(frames[1][1:]) == expected
    assert out["wire_bytes_sender"] == sum(map(sum, frames))
    assert len(out["seconds"]["mlx-pd"]) == len(out["seconds"]["raw"]) == 2
    assert out["ratio"] == pytest.approx(out["mlx-pd"]["gb_per_s"] / out["raw"]["gb_per_s"])


def test_messages_split_at_max_blocks_per_message():
    from cluster.config import TransferConfig

    out = ship_format(TINY, dtype="float32", kv_bits=None, group_size=64, tokens=320, rounds=1, raw=False,
                      config=TransferConfig(max_blocks_per_message=4))
    assert [len(m) for m in out["wire_frames"]] == [1, 3, 3, 3, 1]  # offer, 4 + 4 + 2 blocks, done
    assert out["payload_bytes_received"] == kv_bytes_per_block(TINY, 32, "float32", None, 64) * 10
    assert "raw" not in out and "ratio" not in out


# --- the command ---------------------------------------------------------------------------------------


def test_cli_parses_the_transfer_subcommand():
    assert "transfer" in cli.SUBCOMMANDS
    args = cli.build_subcommand_parser("transfer").parse_args(["--rounds", "3", "--tokens", "2048",
                                                               "--json", "t.json"])
    assert (args.rounds, args.tokens, args.out, args.model, args.no_raw) == (3, 2048, "t.json", None, False)
    assert cli.build_subcommand_parser("transfer").parse_args([]).tokens == 4096


def test_cli_runs_end_to_end_on_a_tiny_config(tmp_path, monkeypatch, capsys):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": 2, "num_key_value_heads": 1,
                                                   "hidden_size": 128, "num_hidden_layers": 1, "vocab_size": 100}))
    monkeypatch.setattr(transfer_bench, "FORMATS", transfer_bench.FORMATS[:1] + transfer_bench.FORMATS[3:4])
    out = tmp_path / "t.json"
    assert cli.main(["transfer", "--model", str(model), "--tokens", "64", "--rounds", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["command"].startswith("mlx-pd bench transfer --model")
    assert set(result["formats"]) == {"float32", "4-bit g64"}
    # 1 layer x K,V x 64 tokens (2 blocks) x 1 KV head x head_dim 64 x 4 bytes
    assert result["formats"]["float32"]["payload_bytes_received"] == 1 * 2 * 64 * 1 * 64 * 4
    assert result["projection"]["constants"]["kv_bytes_per_token"] == {"bf16": 131_072, "4-bit": 36_864}
    printed = capsys.readouterr().out
    assert "| float32 |" in printed and "Projection: Llama-3.1-8B" in printed
    assert "| --- |" in printed  # Markdown tables


def test_rounds_past_nine_keep_the_replayed_frames():
    # request ids are fixed-width, so the 11th round's headers are the size of the first's
    out = ship_format(TINY, dtype="float32", kv_bits=None, group_size=64, tokens=64, rounds=10, raw=False)
    assert len(out["seconds"]["mlx-pd"]) == 10


# --- the copies the benchmark measures (KVStore.read_blocks / write_blocks) ------------------------------


def _placed(a, address_mod_4096):
    """A copy of NumPy array `a` whose data starts at `address_mod_4096` modulo 4096 (as a ZeroMQ frame might)."""
    import numpy as np

    raw = np.empty(a.nbytes + 8192, np.uint8)
    start = (address_mod_4096 - raw.ctypes.data) % 4096
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


@pytest.mark.parametrize("dtype,bits,group", [("float32", None, 64), ("bfloat16", None, 64), ("bfloat16", 8, 64),
                                              ("bfloat16", 4, 32)])
def test_block_copies_survive_4k_aliased_frames(dtype, bits, group):
    """Frames placed 8 bytes below the receiver's pool arrays modulo 4096 (the 4K-aliasing case that makes
    memcpy ~10x slower on some x86 CPUs) go through the bounce buffer and still land bit-exact, in any block
    order; the sender's buffers are placed off that window."""
    import numpy as np

    from cluster.kv import cpu_backend
    from cluster.kv.store import KVStore

    spec = ModelSpec("t", "r", num_layers=3, num_heads=16, num_kv_heads=16, head_dim=64, vocab_size=100,
                     max_model_len=4096, eos_token_ids=(1,))  # 16 heads: blocks of 32 KiB / 64 KiB, over 2 KiB
    src = transfer_bench._filled_store(spec, 12, 32, dtype, bits, group)
    ids = [3, 9, 1, 4, 10]
    arrays = src.read_blocks(ids, range(3))
    views = [src._block_views(layer) for layer in range(3)]
    for i, a in enumerate(arrays):  # the sender's buffer: no block copy in its 4K-aliasing window
        shifts = cpu_backend.alias_shifts(np.asarray(ids), views[0][i][0].nbytes)
        assert not any(cpu_backend.aliases(a[j].ctypes.data - views[j][i].ctypes.data, shifts, -1) for j in range(3))
        for j in range(3):
            assert np.array_equal(a[j].reshape(len(ids), *views[j][i].shape[1:]), views[j][i][ids])
    dst = KVStore(spec, 12, 32, dtype, bits, group)
    targets = [7, 2, 11, 5, 6]
    pool = dst._block_views(0)[0].ctypes.data % 4096
    frames = [_placed(a, pool - 8) for a in arrays]
    assert frames[0][0].ctypes.data % 4096 == (pool - 8) % 4096
    dst.write_blocks(targets, range(3), frames)
    assert all(np.array_equal(x, y) for x, y in zip(dst.read_blocks(targets, range(3)), arrays))
    with pytest.raises(IndexError):
        src.read_blocks([12], range(3))  # outside the pool: read_blocks indexes with mode="clip"


# --- over a link between two hosts (benchmarks/link_transfer.py) ----------------------------------------


def test_link_rounds_carry_at_least_the_asked_payload_in_whole_blocks():
    from benchmarks.link_transfer import tokens_for

    for dtype, bits in (("float32", None), ("bfloat16", 8), ("bfloat16", 4)):
        n = tokens_for(TINY, dtype, bits, 64, tokens=100, min_mb=1.0)
        per_block = kv_bytes_per_block(TINY, 32, dtype, bits, 64)
        assert n % 32 == 0 and n // 32 * per_block >= 1e6 > (n // 32 - 1) * per_block
    assert tokens_for(TINY, "float32", None, 64, tokens=100_001, min_mb=0.001) == 100_032  # whole blocks


def test_link_sides_ship_between_two_processes_over_loopback():
    """The receiving and sending sides of the link benchmark, each its own process as in two namespaces, here
    both on loopback: every round arrives and the sender reports the payload of the default model's geometry."""
    import subprocess
    import sys

    from benchmarks.link_transfer import _spec

    tokens, rounds = 256, 2
    side = [sys.executable, "-m", "benchmarks.link_transfer"]
    common = ["--dtype", "bfloat16", "--kv-bits", "8", "--group-size", "64", "--tokens", str(tokens)]
    rx = subprocess.Popen(side + ["receive", *common, "--count", str(rounds + 1), "--deadline-s", "120"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        endpoint = json.loads(rx.stdout.readline())["endpoint"]
        out = subprocess.run(side + ["send", *common, "--endpoint", endpoint, "--rounds", str(rounds)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        res = json.loads(out.stdout.strip().splitlines()[-1])
        received = [json.loads(line)["received"] for line in rx.stdout.read().splitlines()]
    finally:
        rx.stdin.close()
        rx.wait(30)
    assert len(res["seconds"]) == rounds and all(s > 0 for s in res["seconds"])
    assert res["payload_bytes"] == kv_bytes_per_block(_spec(), 32, "bfloat16", 8, 64) * tokens // 32
    assert received == [f"link-{r:04d}" for r in range(rounds + 1)] and rx.returncode == 0
