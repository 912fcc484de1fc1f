"""The constrained-decoding benchmark (`mlx-pd bench structured`, benchmarks/structured_bench.py): it is registered
with the defaults docs/BENCHMARKS.md documents, and a tiny in-process run on the random-weight model measures both
modes over the same number of tokens, takes its ratios from the runs' tokens/s and its mask cost from the engine's
own counters, and replays the constrained outputs through the grammar to time the mask alone."""

from __future__ import annotations

import statistics

import llguidance.numpy as llg_numpy
import numpy as np
import pytest
from jsonschema import Draft202012Validator

from benchmarks import cli, structured_bench
from benchmarks.structured_mask import numpy_unpack


def test_structured_is_registered_with_its_documented_defaults():
    assert cli.MODULES["structured"] == "structured_bench" and "structured" in cli.SUBCOMMANDS
    a = cli.build_subcommand_parser("structured").parse_args([])
    assert (a.models, a.concurrency, a.max_tokens, a.rounds) == ("real,random", 8, 64, 4)
    assert (a.random_max_tokens, a.random_rounds, a.speculative_rounds, a.num_draft_tokens) == (256, 8, 2, 4)


def test_the_schema_asks_for_at_least_max_tokens_items():
    """Each item takes at least one token, so no output of max_tokens tokens completes the object."""
    validator = Draft202012Validator(structured_bench.schema(3))
    two = {"items": [{"name": "a", "count": 1}, {"name": "b", "count": 2}]}
    three = {"items": two["items"] + [{"name": "c", "count": 3}]}
    assert not validator.is_valid(two) and validator.is_valid(three)
    assert not validator.is_valid({"items": [{"name": "a", "count": "1"}] * 3})


def test_the_host_unpack_reads_llguidances_bit_layout():
    bitmask = np.zeros((2, 2), dtype=np.int32)
    bitmask[0, 0], bitmask[1, 1] = 1 - 2**31, 1 << 3  # bits 0 and 31: tokens 0 and 31 of row 0; token 35 of row 1
    got = numpy_unpack(bitmask, 40)
    assert got.shape == (2, 40) and np.flatnonzero(got[0]).tolist() == [0, 31] and np.flatnonzero(got[1]).tolist() == [35]
    allowed = llg_numpy.allocate_token_bitmask(1, 40)  # all allowed
    assert numpy_unpack(allowed, 40).all()


@pytest.fixture(scope="module")
def tiny():
    """Three requests of 6 tokens, 2 ABBA rounds, on the random 2-layer model."""
    engine, _ = structured_bench.load_engine("random", None, 3)
    got = structured_bench.on_engine_thread(engine, lambda e: structured_bench.measure_model(
        e, concurrency=3, max_tokens=6, rounds=2, log=lambda msg: None), timeout_s=120)
    return got["plain"]


def test_both_modes_generate_the_same_tokens_and_finish_by_length_in_abba_order(tiny):
    assert [r["order"] for r in tiny["rounds"]] == [["unconstrained", "constrained"], ["constrained", "unconstrained"]]
    for r in tiny["rounds"]:
        u, c = r["unconstrained"], r["constrained"]
        assert u["finish"] == c["finish"] == {"length": 3}
        assert u["decode_tokens"] == c["decode_tokens"] > 0 and u["steps"] == c["steps"]
        assert c["tok_s"] == pytest.approx(c["decode_tokens"] / c["decode_s"])
        assert r["ratio"] == pytest.approx(c["tok_s"] / u["tok_s"])
    assert tiny["ratio_p50"] == pytest.approx(statistics.median(r["ratio"] for r in tiny["rounds"]))
    modes = tiny["modes"]
    assert tiny["ratio_of_medians"] == pytest.approx(modes["constrained"]["tok_s_p50"] / modes["unconstrained"]["tok_s_p50"])


def test_the_mask_cost_comes_from_the_engines_counters_one_mask_per_constrained_token(tiny):
    runs = [r["constrained"] for r in tiny["rounds"]]
    for r in tiny["rounds"]:
        assert r["unconstrained"]["mask_rows"] == 0 and r["unconstrained"]["mask_s"] == 0.0
        assert r["constrained"]["mask_rows"] == r["constrained"]["decode_tokens"] and r["constrained"]["mask_s"] > 0
    mask = tiny["mask"]
    assert mask["rows"] == sum(x["mask_rows"] for x in runs) and mask["steps"] == sum(x["steps"] for x in runs)
    assert mask["ms_per_row"] == pytest.approx(1000 * sum(x["mask_s"] for x in runs) / mask["rows"])
    assert mask["ms_per_step"] == pytest.approx(1000 * sum(x["mask_s"] for x in runs) / mask["steps"])


def test_the_mask_alone_replays_the_constrained_outputs_through_the_grammar(tiny):
    alone = tiny["mask_alone"]  # a token the grammar refuses, or unpacks that differ, would have raised
    assert alone["rows"] == 3 and alone["steps"] == 5
    assert alone["fill_ms_p50"] > 0 and alone["unpack_ms_p50"] > 0 and alone["numpy_unpack_ms_p50"] > 0
    assert alone["total_ms_p50"] == pytest.approx(alone["fill_ms_p50"] + alone["unpack_ms_p50"] + alone["apply_ms_p50"])


def test_the_report_has_a_throughput_row_and_a_mask_cost_row_per_model(tiny):
    (title, head, rows), (_, cost_head, cost) = structured_bench.tables({"models": {"random": {"plain": tiny}}})
    assert len(rows) == 1 and len(rows[0]) == len(head) and rows[0][0] == "random" and rows[0][7].endswith("x")
    assert len(cost) == 1 and len(cost[0]) == len(cost_head)
