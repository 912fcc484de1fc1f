"""The hybrid multi-turn benchmark (`mlx-pd bench hybrid-turns`, benchmarks/hybrid_bench.py), mostly without a
model or a server: it is registered with the defaults docs/BENCHMARKS.md documents, its turns have the asked size,
its last-turns ratio is the mean cold TTFT over the mean cached TTFT, and its model's snapshot size is the
family's formula from config.json. One test builds a small qwen3_5 the way `--family qwen3_5` builds its model
and serves it."""

from __future__ import annotations

import copy

import httpx

from benchmarks import cli, hybrid_bench
from benchmarks.hybrid_model import (HYBRID_CONFIG, QWEN35_CONFIG, hybrid_model_dir, kv_bytes_per_token,
                                     state_bytes_per_sequence)
from benchmarks.workloads import approx_tokens


def test_hybrid_turns_is_registered_with_its_documented_defaults():
    assert cli.MODULES["hybrid-turns"] == "hybrid_bench" and "hybrid-turns" in cli.SUBCOMMANDS
    a = cli.build_subcommand_parser("hybrid-turns").parse_args([])
    assert (a.turns, a.user_tokens, a.max_tokens, a.last_turns) == (16, 256, 32, 4)
    assert (a.rss_conversations, a.rss_turns, a.rss_kv_cache_gb, a.rss_state_cache_gb) == (25, 8, 1 / 16, 1 / 32)
    assert a.cold_args == "--no-prefix-caching" and a.theirs_cold_args == "--prompt-cache-size 0"
    assert a.family == "qwen3_next" and a.model_dir is None
    assert cli.build_subcommand_parser("hybrid-turns").parse_args(["--family", "qwen3_5"]).family == "qwen3_5"


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


def test_the_qwen3_5_has_the_qwen3_next_layers_and_state():
    text = QWEN35_CONFIG["text_config"]
    shared = ("hidden_size", "num_hidden_layers", "full_attention_interval", "num_attention_heads",
              "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
              "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "vocab_size",
              "tie_word_embeddings")
    assert {k: text[k] for k in shared} == {k: HYBRID_CONFIG[k] for k in shared}
    assert text["rope_parameters"]["rope_theta"] == HYBRID_CONFIG["rope_theta"]
    assert "num_experts" not in text and text["intermediate_size"] == 1024
    assert state_bytes_per_sequence(QWEN35_CONFIG) == state_bytes_per_sequence() == 2_469_888
    assert kv_bytes_per_token(QWEN35_CONFIG) == kv_bytes_per_token() == 3 * 2 * 2 * 64 * 4


def test_a_small_qwen3_5_built_as_the_bench_builds_it_loads_and_is_served(tmp_path):
    """The bench's qwen3_5 config shrunk (hidden 64, the same 12-layer pattern cut to 4: 3 Gated DeltaNet, then
    gated attention), built by `hybrid_model_dir(family="qwen3_5")`: mlx-lm and `cluster.model.load_model` load
    the saved weights under the same names with the same values (qwen3_5's sanitize passes them through), and
    `mlx-pd serve` answers two turns, the second restoring a state snapshot of the formula's size."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    from cluster.model import load_model
    from tests.live_server import live_model_server

    config = copy.deepcopy(QWEN35_CONFIG)
    config["text_config"].update(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
                                 head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
                                 linear_key_head_dim=16, linear_value_head_dim=16)
    folder = hybrid_model_dir(tmp_path, config=config, family="qwen3_5")
    assert folder.name == "qwen3.5-random-81m-seed0"
    assert hybrid_model_dir(tmp_path, config=config, family="qwen3_5") == folder  # built once
    saved = mx.load(str(folder / "model.safetensors"))
    for model in (load(str(folder))[0], load_model(folder)[0]):
        got = dict(tree_flatten(model.parameters()))
        assert sorted(got) == sorted(saved)
        assert all(mx.array_equal(got[k], saved[k]).item() for k in saved)

    user = "Here are my notes. " + " ".join(f"Note {i}: the meeting moved to room {i + 3}." for i in range(12))
    with live_model_server(folder, kv_cache_gb=1 / 16) as (base, _):
        def chat(messages):
            r = httpx.post(base + "/v1/chat/completions", timeout=120,
                           json={"model": folder.name, "messages": messages, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            return body["choices"][0]["message"]["content"], body["usage"]

        first = [{"role": "user", "content": user}]
        answer, usage = chat(first)
        assert usage["prompt_tokens"] > 64 and usage["completion_tokens"] >= 1
        _, usage = chat(first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And?"}])
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 32
        got = hybrid_bench.snapshot_metrics(base)
    assert got["restored"] >= 1 and got["snapshots"] >= 1
    assert got["bytes"] == got["snapshots"] * state_bytes_per_sequence(config)
