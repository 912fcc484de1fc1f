"""Tests of the prefix-cache and KV benchmarks (benchmarks/prefix_bench.py, benchmarks/chat_prefix_bench.py,
benchmarks/kv_bench.py) with no model: the workload builders (system prompts, 2-turn conversations, the TTFT
plan), the hit-rate arithmetic against a perfect cache, the KV pool table over a tiny model spec, the CLI
wiring, and one 2-turn round against the fake OpenAI server of tests/test_bench.py."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from benchmarks import chat_prefix_bench, cli, kv_bench, prefix_bench
from benchmarks.chat_prefix_bench import ChatResult, chat_hit_rates
from benchmarks.prefix_bench import ChatWorkloadConfig, interleave, ttft_plan
from benchmarks.workloads import (ChatTokens, Conversation, Served, approx_tokens, build_conversations,
                                  common_prefix_len, computed_ids, hit_rates, ideal_cached_tokens, system_prompt)
from benchmarks.stats import RequestRecord
from tests.test_bench import fake_server  # noqa: F401  (the fixture)

# --- workload builders ------------------------------------------------------------------------------------


def test_system_prompt_reaches_its_length_and_is_deterministic():
    text = system_prompt(2, 1000, tag="tenant 2 abc")
    assert approx_tokens(text) >= 1000
    assert approx_tokens(text) < 1000 + 60  # overshoots by at most one rule
    assert text.startswith("[tenant 2 abc] You are the assistant of tenant 2.")
    assert text == system_prompt(2, 1000, tag="tenant 2 abc")
    assert system_prompt(3, 1000, tag="x") != system_prompt(2, 1000, tag="x")
    # only the tag line differs: a fresh tag makes a cold prompt that shares just the template and "[cold "
    a, b = system_prompt(0, 300, tag="cold 00000001"), system_prompt(0, 300, tag="cold 00000002")
    assert a != b and a[:13] == b[:13] and a[15:] == b[15:]
    # the token counter decides the length
    assert len(system_prompt(0, 500, count_tokens=len)) >= 500


def test_conversations_bind_users_to_tenants_with_unique_questions():
    systems = ["S0", "S1", "S2", "S3"]
    convs = build_conversations(10, systems, turns=2, seed=1)
    assert [c.tenant for c in convs] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert all(c.system == systems[c.tenant] for c in convs)
    questions = [q for c in convs for q in c.questions]
    assert len(set(questions)) == 20
    assert all(c.questions[0].startswith("[t1 ") and c.questions[1].startswith("[t2 ") for c in convs)
    assert build_conversations(10, systems, seed=1) == convs
    with pytest.raises(ValueError):
        build_conversations(0, systems)


def test_second_turn_is_first_turn_plus_reply_plus_new_question():
    conv = Conversation(user=3, tenant=1, system="SYS", questions=("Q1", "Q2"))
    first = conv.messages(0)
    assert first == [{"role": "system", "content": "SYS"}, {"role": "user", "content": "Q1"}]
    second = conv.messages(1, ["R1"])
    assert second[:2] == first
    assert second[2:] == [{"role": "assistant", "content": "R1"}, {"role": "user", "content": "Q2"}]
    assert (conv.key(0), conv.key(1)) == ("u3/t1", "u3/t2")
    with pytest.raises(ValueError, match="replies"):
        conv.messages(1)


def test_ttft_plan_alternates_cold_and_cached_and_goes_back_for_older():
    made = []

    def make_system(i, tag):
        made.append((i, tag))
        return f"[{tag}] system {i}"

    questions = [f"q{k}" for k in range(20)]
    plan = ttft_plan(3, make_system, questions, seed=0)
    assert [[r.kind for r in g] for g in plan] == [["cold", "cached"], ["cold", "cached", "older"],
                                                    ["cold", "cached", "older"]]
    tags = [tag for _, tag in made]
    assert len(set(tags)) == 3 and all(t.startswith("cold ") for t in tags)
    for i, group in enumerate(plan):
        cold, cached = group[0].messages, group[1].messages
        assert cold[0] == cached[0] and cold[1] != cached[1]  # same system prompt, another question
        if i:
            assert group[2].messages[0] == plan[i - 1][0].messages[0]  # back to the previous pair's system
    users = [r.messages[1]["content"] for g in plan for r in g]
    assert len(set(users)) == len(users)
    assert [[r.kind for r in g] for g in ttft_plan(2, make_system, questions, older=False)] == [["cold", "cached"]] * 2


def test_interleave_is_abba_for_two_servers():
    names = ["mlx-pd", "mlx_lm.server"]
    assert [interleave(names, r)[0] for r in range(8)] == ["mlx-pd", "mlx_lm.server", "mlx_lm.server", "mlx-pd"] * 2
    assert interleave(["server"], 1) == ["server"]


def test_chat_workload_config_sends_the_messages_of_its_key():
    cfg = ChatWorkloadConfig(url="http://x:1", max_tokens=4, suppress_token_ids=(2,), messages={})
    cfg.messages["u0/t1"] = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    body = cfg.body("u0/t1")
    assert body["messages"] == cfg.messages["u0/t1"]
    assert body["max_tokens"] == 4 and body["stream"] and body["logit_bias"] == {"2": -100.0}
    hash(cfg)  # the messages dict stays out of the frozen dataclass's hash


# --- hit-rate arithmetic ------------------------------------------------------------------------------------


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([5], [6]) == 0
    assert common_prefix_len(list(range(100)), list(range(100))) == 100


def test_computed_ids_are_the_prompt_and_all_but_the_last_output_token():
    prompt = [1, 2, 3]
    with_reply = [1, 2, 3, 10, 11, 12, 99]  # reply 10 11 12, then the template's end-of-turn 99
    assert computed_ids(prompt, with_reply, 3) == [1, 2, 3, 10, 11]
    assert computed_ids(prompt, with_reply, 1) == [1, 2, 3]


def test_ideal_counts_only_requests_finished_before_and_leaves_one_token():
    sys_a = list(range(100, 140))  # 40 tokens of tenant A's system prompt
    r0 = Served(0.0, 5.0, sys_a + [1, 2], sys_a + [1, 2, 7, 8])  # turn 1 of user 0
    r1 = Served(1.0, 6.0, sys_a + [3, 4], sys_a + [3, 4])  # sent while r0 ran: nothing finished yet
    r2 = Served(5.0, 9.0, sys_a + [1, 2, 7, 8, 9, 5], sys_a)  # turn 2 of user 0: r0's prompt and reply
    r3 = Served(6.5, None, sys_a + [3], [])  # failed; computed nothing for later requests
    r4 = Served(10.0, 11.0, sys_a + [3], sys_a)  # all of its prompt seen: capped at prompt - 1
    r5 = Served(10.0, 12.0, [7, 7, 7], [7, 7, 7])  # another tenant
    served = [r0, r1, r2, r3, r4, r5]
    assert ideal_cached_tokens(served) == [0, 0, 44, 40, 40, 0]
    assert ideal_cached_tokens(served, block_size=32) == [0, 0, 32, 32, 32, 0]
    # a request finishing exactly when another is sent counts
    assert ideal_cached_tokens([Served(0, 1.0, [1, 2, 3], [1, 2, 3]), Served(1.0, 2.0, [1, 2, 3, 4], [])]) == [0, 3]
    # a running request's prompt counts once its first token has arrived; its output only once it finished
    running = Served(0.0, 9.0, [1, 2, 3], [1, 2, 3, 4, 5], first_token_s=1.0)
    later = [Served(0.5, 2.0, [1, 2, 3, 4, 5, 6], []), Served(1.5, 2.0, [1, 2, 3, 4, 5, 6], []),
             Served(9.0, 10.0, [1, 2, 3, 4, 5, 6], [])]
    assert ideal_cached_tokens([running] + later)[1:] == [0, 3, 5]


def test_hit_rates_arithmetic():
    h = hit_rates([100, 100, 200], [0, 64, 160], [0, 90, 190])
    assert (h["prompt_tokens"], h["cached_tokens"], h["ideal_tokens"]) == (400, 224, 280)
    assert h["hit_rate"] == pytest.approx(0.56) and h["ideal_rate"] == pytest.approx(0.7)
    assert h["of_ideal"] == pytest.approx(0.8)
    empty = hit_rates([], [], [])
    assert empty["prompt_tokens"] == 0 and empty["hit_rate"] != empty["hit_rate"]  # NaN


class WordTokenizer:
    """A fake tokenizer: one id per word (stable within an instance), a ChatML-like template."""

    def __init__(self):
        self.ids: dict[str, int] = {}

    def encode(self, text, add_special_tokens=False):
        return [self.ids.setdefault(w, len(self.ids)) for w in text.split()]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        text = "".join(f"<s> {m['role']} {m['content']} </s> " for m in messages)
        return text + ("<s> assistant " if add_generation_prompt else "")


def _rec(start, e2e, text, prompt_tokens, cached, out=3):
    return RequestRecord(index=0, start_s=start, ttft_s=0.1, e2e_s=e2e, text=text, output_tokens=out,
                         prompt_tokens=prompt_tokens, cached_tokens=cached)


def test_chat_hit_rates_over_two_turns():
    tokens = ChatTokens(WordTokenizer())
    system = " ".join(f"w{i}" for i in range(40))
    a = Conversation(0, 0, system, ("q a1", "q a2"))
    b = Conversation(1, 0, system, ("q b1", "q b2"))
    a0, b0 = a.messages(0), b.messages(0)
    a1 = a.messages(1, ["r1 r2 r3"])
    n_a0, n_a1 = len(tokens.render(a0)), len(tokens.render(a1))
    assert tokens.render(a1)[:n_a0] == tokens.render(a0)  # turn 2's prompt extends turn 1's
    results = [ChatResult(a, 0, a0, _rec(0.0, 2.0, "r1 r2 r3", n_a0, 0)),
               ChatResult(b, 0, b0, _rec(0.5, 2.5, "x", n_a0, 0)),  # sent after a's first token, before its end
               ChatResult(a, 1, a1, _rec(2.0, 3.0, "y", n_a1, 40))]
    h = chat_hit_rates(results, tokens, block_size=8)
    assert h["prompt_count_matches"] == 3 and h["requests_ok"] == 3
    # turn 2 of a: its turn-1 prompt and two of the three reply tokens ("r1 r2"; "r3" was never fed back)
    assert h["turn 2"]["ideal_tokens"] == n_a0 + 2
    assert h["turn 2"]["block_ideal_tokens"] == (n_a0 + 2) // 8 * 8
    # turn 1 of b: a's prompt was computed (its first token had come) but not its reply: the shared system prompt
    shared = common_prefix_len(tokens.render(b0), tokens.render(a0))
    assert shared == 2 + 40 + 1 + 3  # "<s> system", the 40 words, "</s>", "<s> user q"
    assert h["turn 1"]["ideal_tokens"] == shared
    assert h["all"]["cached_tokens"] == 40 and h["all"]["prompt_tokens"] == 2 * n_a0 + n_a1
    assert h["all"]["of_ideal"] == pytest.approx(40 / (n_a0 + 2 + shared))


# --- a 2-turn round against the fake server ---------------------------------------------------------------


def test_chat_round_sends_the_reply_back_in_turn_two(fake_server):  # noqa: F811
    url, received = fake_server
    received.clear()
    convs = build_conversations(4, ["SYS A", "SYS B"], turns=2)
    cfg = ChatWorkloadConfig(url=url, max_tokens=3, messages={})
    results, wall = asyncio.run(chat_prefix_bench._chat_round(cfg, convs, 2, time.perf_counter()))
    assert len(results) == 8 and all(r.rec.ok for r in results) and wall > 0
    for conv in convs:
        first, second = [r for r in results if r.conv is conv]
        assert (first.turn, second.turn) == (0, 1)
        assert second.rec.start_s >= first.rec.start_s + first.rec.e2e_s  # turn 2 waits for turn 1's reply
        assert second.messages[2] == {"role": "assistant", "content": "t0 t1 t2 "}
    bodies = [b for b in received if len(b["messages"]) == 4]
    assert len(bodies) == 4 and all(b["messages"][0]["content"] in ("SYS A", "SYS B") for b in bodies)


def test_prom_counters_parse_metrics_text(monkeypatch):
    text = ("# HELP mlx_pd_prefix_cache_hit_tokens x\n# TYPE mlx_pd_prefix_cache_hit_tokens counter\n"
            "mlx_pd_prefix_cache_hit_tokens_total 1536.0\n"
            'mlx_pd_kv_group_blocks_total{group="sliding_window"} 64.0\n'
            'mlx_pd_kv_group_blocks_total{group="full"} 727.0\n')

    class Resp:
        pass

    resp = Resp()
    resp.text = text
    monkeypatch.setattr(prefix_bench.httpx, "get", lambda *a, **k: resp)
    full = 'mlx_pd_kv_group_blocks_total{group="full"}'
    got = prefix_bench.prom_counters("http://x", ["mlx_pd_prefix_cache_hit_tokens", full, "absent"])
    assert got == {"mlx_pd_prefix_cache_hit_tokens": 1536.0, full: 727.0, "absent": None}


# --- KV pool table -------------------------------------------------------------------------------------------


def test_kv_pool_table_measures_bytes_per_token_and_capacity():
    from cluster.model import ModelSpec

    spec = ModelSpec("tiny", "r", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, vocab_size=100,
                     max_model_len=4096, eos_token_ids=(0,))
    rows = {r["label"]: r for r in kv_bench.pool_table(spec, block_size=16, probe_blocks=4, kv_cache_gb=0.01,
                                                       seq_len=256)}
    values = 2 * 2 * 2 * 64  # layers x K,V x heads x dim, per token
    assert rows["float32"]["bytes_per_token"] == values * 4 == rows["float32"]["seeds_formula_bytes_per_token"]
    assert rows["float16"]["bytes_per_token"] == values * 2
    assert rows["8-bit (f32 scales)"]["bytes_per_token"] == values + 2 * values // 64 * 4
    assert rows["4-bit (f16 scales)"]["bytes_per_token"] == values // 2 + 2 * values // 64 * 2
    for r in rows.values():
        assert r["bytes_per_token"] == r["formula_bytes_per_token"]
        per_block = r["formula_bytes_per_token"] * 16
        assert r["num_blocks"] == 1 + int(0.01 * 2**30 // per_block) and r["usable_blocks"] == r["num_blocks"] - 1
        assert r["max_seqs"] == r["usable_blocks"] * 16 // 256
    assert rows["4-bit (f16 scales)"]["vs_float16"] >= 3 and rows["4-bit (f32 scales)"]["vs_float16"] >= 3
    assert rows["float16"]["vs_float16"] == 1


# --- CLI wiring -----------------------------------------------------------------------------------------------


def test_subcommand_parsers():
    args = cli.build_subcommand_parser("prefix").parse_args(["--pairs", "3", "--servers", "mlx-pd"])
    assert (args.pairs, args.system_tokens, args.max_tokens, args.servers) == (3, 1500, 4, "mlx-pd")
    args = cli.build_subcommand_parser("chat").parse_args(["--users", "16"])
    assert (args.users, args.system_prompts, args.turns, args.concurrency) == (16, 4, 2, 8)
    args = cli.build_subcommand_parser("kv").parse_args(["--decode"])
    assert args.decode and args.decode_kv_bits == 8 and args.concurrency == 8 and args.max_tokens == 64
    with pytest.raises(SystemExit):
        cli.build_subcommand_parser("prefix").parse_args(["--bogus"])
    with pytest.raises(ValueError, match="unknown server"):
        prefix_bench.server_argvs(["vllm"], "/m", "float32")


def test_bench_kv_subcommand_runs_without_a_server(tmp_path, monkeypatch):
    from cluster.model import ModelSpec

    spec = ModelSpec("tiny", "r", num_layers=1, num_heads=2, num_kv_heads=1, head_dim=64, vocab_size=10,
                     max_model_len=512, eos_token_ids=(0,))
    monkeypatch.setattr("cluster.model.read_model_spec", lambda path: spec)
    out = tmp_path / "kv.json"
    # benchmarks/report.py binds `sys.stdout` as a default argument when first imported; if that happened here,
    # a later capsys test of test_bench.py would print to this test's stream. Leave no such import behind.
    had_report = "benchmarks.report" in sys.modules
    try:
        code = cli.main(["kv", "--model-dir", str(tmp_path), "--kv-cache-gb", "0.01", "--out", str(out),
                         "--markdown", str(tmp_path / "kv.md")])
    finally:
        if not had_report:
            sys.modules.pop("benchmarks.report", None)
    assert code == 0 and out.exists()
    assert "| 4-bit (f16 scales) |" in (tmp_path / "kv.md").read_text()
