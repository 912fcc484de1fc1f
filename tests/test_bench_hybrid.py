"""The hybrid multi-turn benchmark (`mlx-pd bench hybrid-turns`, benchmarks/hybrid_bench.py) without a model
or a server: it is registered with the defaults docs/BENCHMARKS.md documents, its turns have the asked size,
its last-turns ratio is the mean cold TTFT over the mean cached TTFT, and its model's snapshot size is the
family's formula from config.json."""

from __future__ import annotations

from benchmarks import cli, hybrid_bench
from benchmarks.hybrid_model import HYBRID_CONFIG, state_bytes_per_sequence
from benchmarks.workloads import approx_tokens


def test_hybrid_turns_is_registered_with_its_documented_defaults():
    assert cli.MODULES["hybrid-turns"] == "hybrid_bench" and "hybrid-turns" in cli.SUBCOMMANDS
    a = cli.build_subcommand_parser("hybrid-turns").parse_args([])
    assert (a.turns, a.user_tokens, a.max_tokens, a.last_turns) == (16, 256, 32, 4)
    assert (a.rss_conversations, a.rss_turns, a.rss_kv_cache_gb, a.rss_state_cache_gb) == (25, 8, 1 / 16, 1 / 32)
    assert a.cold_args == "--no-prefix-caching" and a.theirs_cold_args == "--prompt-cache-size 0"


def test_user_turns_have_the_asked_size_and_the_ratio_is_over_the_last_turns():
    msgs = hybrid_bench.user_turns(16, 256, approx_tokens, tag="t")
    assert len(msgs) == 16 and all(abs(approx_tokens(m) - 256) <= 60 for m in msgs)
    assert msgs[3].startswith("[t turn 4]")

    def rec(ttft: float) -> dict:
        return {"ttft_s": ttft, "error": None, "text": "a", "cached_tokens": 0, "prompt_tokens": 10}

    s = hybrid_bench.summarize_turns({"mlx-pd": [rec(1.0)] * 4,
                                      "mlx-pd cold": [rec(2.0), rec(4.0), rec(10.0), rec(20.0)]}, last=2)
    assert s["mlx-pd"]["last_ratio"] == 15.0 and s["mlx-pd"]["same_answer_cold_vs_cached"] == 4


def test_the_benchmark_models_snapshot_size_is_the_familys_formula():
    from tests.family_helpers import expected_state_bytes_per_sequence

    assert state_bytes_per_sequence() == expected_state_bytes_per_sequence(HYBRID_CONFIG) == 2_469_888
