"""The pure parts of `mlx-pd bench reliability` (benchmarks/reliability_*.py): hostile frame generators,
the soak's request mix, reply classification, outcome accounting, the acceptance rules and the Markdown.
The harness itself runs real processes (./scripts/reliability, docs/RELIABILITY.md)."""

from __future__ import annotations

import json
import random

import msgpack
import pytest

from benchmarks.reliability_client import classify_json, classify_stream
from benchmarks.reliability_cluster import topology_text
from benchmarks.reliability_inputs import (MAX_HEADER_BYTES, control_garbage, kv_garbage, reference_key,
                                           soak_workload)
from benchmarks.reliability_report import (BEGIN, END, Outcomes, failures, render_markdown, replace_generated,
                                           summary_rows)


def _decodes(frame: bytes):
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception:
        return None


def test_control_garbage_covers_every_kind_and_none_is_a_valid_control_message():
    from cluster.protocol import PROTOCOL_VERSION, TO_WORKER, ProtocolError, generate_request_id, unpack

    frames = control_garbage(random.Random(1), per_kind=5)
    kinds = {k for k, _ in frames}
    assert kinds >= {"random", "truncated", "mutated", "oversized", "wrong_version", "unknown_type",
                     "unknown_request_id", "bad_fields", "extra_frames", "empty", "generate_invalid"}
    assert any(len(f[0]) > MAX_HEADER_BYTES for k, f in frames if k == "oversized")
    for kind, msg in frames:
        if kind in ("mutated", "unknown_request_id") or kind.startswith("generate_") or len(msg) != 1:
            continue  # a mutation may survive; the others are valid on purpose; extra frames are dropped whole
        with pytest.raises(ProtocolError):
            unpack(msg[0], TO_WORKER, PROTOCOL_VERSION)
    invalid = [m[0] for k, m in frames if k == "generate_invalid"]
    assert len(invalid) == 6
    refused_as_messages = 0
    for frame in invalid:  # each names its request id, so a worker can refuse it by id whatever else is wrong
        try:
            unpack(frame, TO_WORKER, PROTOCOL_VERSION)  # only the engine can tell (a token outside the vocabulary)
        except ProtocolError:
            refused_as_messages += 1
    assert refused_as_messages == 5
    abandoned = [unpack(m[0], TO_WORKER, PROTOCOL_VERSION) for k, m in frames if k == "generate_abandoned"]
    assert len(abandoned) == 1 and abandoned[0].prefilled and abandoned[0].decode_endpoint is None
    prefill = [unpack(m[0], TO_WORKER, PROTOCOL_VERSION) for k, m in control_garbage(random.Random(1), 5, "prefill")
               if k == "generate_abandoned"]
    assert prefill[0].decode_endpoint == "tcp://127.0.0.1:9" and not prefill[0].prefilled
    rids = [generate_request_id(frame) for frame in invalid]
    assert all(r.startswith("fuzz-") for r in rids) and len(set(rids)) == len(rids)


def test_kv_garbage_is_deterministic_and_rejected_by_the_wire_decoder():
    from kv_transfer.wire import WireError, decode

    fmt = {"model_id": "m", "revision": "r", "dtype": "float32", "kv_bits": None, "kv_group_size": 64,
           "block_size": 32, "num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "speculative_kv": False}
    a, b = kv_garbage(random.Random(3), 4, fmt), kv_garbage(random.Random(3), 4, fmt)
    assert a == b
    offers = [m for k, m in a if k == "offer_wrong_format"]
    assert len(offers) == 5 and all(_decodes(m[0])["format"] != fmt for m in offers)
    for kind, msg in a:
        if kind in ("mutated", "unknown_request_id", "offer_wrong_format"):
            continue
        with pytest.raises(WireError):
            decode(msg)
    assert "offer_wrong_format" not in {k for k, _ in kv_garbage(random.Random(3), 4)}


def test_soak_workload_mix_and_references():
    items = soak_workload(200, seed=5)
    assert len(items) == 200 and [i.index for i in items] == list(range(200))
    kinds = {i.kind for i in items}
    assert kinds == {"chat", "tenant", "long", "disconnect", "sampled"}
    for i in items:
        assert i.compare == (i.kind in ("chat", "tenant", "long"))
        assert (i.body["temperature"] == 0) == (i.kind != "sampled")
        assert (i.disconnect_after is not None) == (i.kind == "disconnect")
        assert i.speculative == ("speculative" in i.body) and (not i.speculative or i.compare)
    greedy = [i for i in items if i.compare]
    assert abs(sum(i.speculative for i in greedy) - len(greedy) / 2) <= 1
    assert not any(i.speculative for i in soak_workload(200, seed=5, speculative=False))
    # speculative and streaming do not change the greedy reference; the prompt does
    a = next(i for i in greedy if i.speculative)
    plain = {k: v for k, v in a.body.items() if k not in ("speculative", "stream", "stream_options")}
    assert reference_key(a.path, a.body) == reference_key(a.path, {**plain, "stream": False})
    assert reference_key(a.path, a.body) != reference_key(a.path, {**plain, "max_tokens": 3})
    assert soak_workload(50, seed=1)[7].body == soak_workload(50, seed=1)[7].body
    assert len({reference_key(i.path, i.body) for i in soak_workload(1000) if i.compare}) < 200  # they repeat
    long_prompt = next(i for i in items if i.kind == "long").body["prompt"]
    assert 800 <= len(long_prompt.split()) <= 1500


def _sse(*events) -> list[str]:
    return [json.dumps(e) if isinstance(e, dict) else e for e in events]


def test_classify_stream():
    chunk = lambda text, finish=None: {"choices": [{"delta": {"content": text}, "finish_reason": finish}]}
    r = classify_stream(_sse(chunk("Hel"), chunk("lo", "stop"), {"choices": [], "usage": {"completion_tokens": 2}},
                             "[DONE]"))
    assert (r.outcome, r.text, r.finish_reason, r.completion_tokens, r.events) == ("completed", "Hello", "stop", 2, 2)
    assert classify_stream(_sse(chunk("a"), "[DONE]")).outcome == "lost"  # no finish reason
    assert classify_stream(_sse(chunk("a", "length"))).outcome == "lost"  # no [DONE]
    err = classify_stream(_sse(chunk("a"), {"error": {"message": "the decode worker decode-0 stopped"}}, "[DONE]"))
    assert err.outcome == "error" and "decode-0" in err.error
    comp = classify_stream(_sse({"choices": [{"text": "x", "finish_reason": "length"}]}, "[DONE]"))
    assert comp.outcome == "completed" and comp.text == "x"


def test_classify_json():
    ok = json.dumps({"choices": [{"message": {"content": "Paris"}, "finish_reason": "stop"}],
                     "usage": {"completion_tokens": 1}}).encode()
    assert classify_json(200, ok, None).text == "Paris"
    busy = json.dumps({"error": {"message": "full"}}).encode()
    assert classify_json(503, busy, "1").outcome == "refused"
    assert classify_json(503, busy, None).outcome == "error"  # a 503 without Retry-After is not a clean refusal
    assert classify_json(500, b"oops", None).outcome == "error"
    assert classify_json(200, b"{}", None).outcome == "lost"
    bad = json.dumps({"choices": [{"text": "", "finish_reason": "error"}]}).encode()
    assert classify_json(200, bad, None).outcome == "error"


def test_outcomes_accounting():
    t = Outcomes()
    for outcome in ("completed", "completed", "disconnected", "error"):
        t.add("chat", outcome, example=f"ex {outcome}")
    t.add("long", "mismatch_batch_only", example="x" * 1000)
    t.add("long", "lost")
    d = t.as_dict()
    assert d["sent"] == 6 and d["totals"]["completed"] == 2 and d["totals"]["lost"] == 1
    assert d["by_kind"]["long"] == {"mismatch_batch_only": 1, "lost": 1}
    assert len(d["examples"]["mismatch_batch_only"][0]) == 300 and "completed" not in d["examples"] or True
    with pytest.raises(ValueError):
        t.add("chat", "vanished")


def _result(**phases) -> dict:
    base = {
        "api_fuzz": {"requests": 10, "server_errors": 0, "violations": 0, "healthy_after": True,
                     "operations": {"GET /health": {"requests": 10, "server_errors": 0, "violations": 0,
                                                    "statuses": {"200": 10}}}, "modes": {"positive": 5, "negative": 5},
                     "statuses": {"200": 10}},
        "access": {"http": {"unauthorized_expected": 9, "unauthorized_got": 9}, "curve": {"probes": 16, "answered": 0,
                                                                                         "sockets": 8},
                   "listening": ["router tcp 127.0.0.1:1"], "non_loopback": [], "secrets_found": [],
                   "files_scanned": 12},
        "wire_fuzz": {"sent": 500, "sent_control": 300, "sent_kv": 200, "sockets": ["a", "b"], "answers": {},
                      "unexpected_answers": 0, "missing_answers": 0, "workers_alive_after": True, "served_after": True,
                      "by_kind": {"control": {"random": 3}, "kv": {"random": 2, "offer_wrong_format": 5}}},
        "soak": {"sent": 10, "concurrency": 4, "duration_s": 12.0, "compared": 6, "equal": 6,
                 "by_kind": {"chat": {"completed": 8, "disconnected": 2}},
                 "totals": {"completed": 8, "disconnected": 2, "lost": 0, "mismatch": 0}, "speculative": "yes",
                 "latency_s": {"chat": {"p50": 1.25, "p95": 3.0, "max": 4.0}},
                 "rss_series": [[5, {"decode-0": 100}], [10, {"decode-0": 104}]]},
        "faults": {"kill": {"lost": 0, "recovered": True, "outcome": "completed 8"},
                   "lost messages": {"lost": None, "outcome": "library tests"}},
        "overload": {"sent": 100, "capacity": 48, "duration_s": 9.0, "totals": {"completed": 60, "refused": 40},
                     "refused_with_retry_after": 40, "refused_without_retry_after": 0, "peak_rss_mib": 10,
                     "rss_before_mib": 9},
        "baseline": {"workers": {"decode-0": {"kv_blocks_free": 5, "kv_blocks_total": 5}}, "at_baseline": ["decode-0"],
                     "not_at_baseline": [], "rss": {"decode-0": {"warm_mib": 100, "end_mib": 130, "ratio": 1.3}},
                     "rss_over_1_2x": ["decode-0"],
                     "max_rss_ratio": 1.3},
    }
    for name, patch in phases.items():
        base[name] = {**base[name], **patch}
    return {"phases": base, "command": "mlx-pd bench reliability --requests 10", "duration_s": 60}


def test_failures_name_each_broken_rule():
    assert failures(_result()) == []
    assert failures({"phases": {}}) == []  # phases that did not run are not failures
    broken = _result(api_fuzz={"server_errors": 2}, access={"non_loopback": ["router 0.0.0.0:8000"]},
                     soak={"totals": {"lost": 1, "error": 0, "mismatch": 3}},
                     overload={"refused_without_retry_after": 4},
                     baseline={"not_at_baseline": ["decode-0"]})
    text = "\n".join(failures(broken))
    for needle in ("5xx", "0.0.0.0:8000", "1 requests lost", "3 requests differed", "without Retry-After",
                   "decode-0 did not return"):
        assert needle in text
    assert "mismatch_batch_only" not in text


def test_render_markdown_and_markers():
    result = _result()
    md = render_markdown(result)
    assert "every rule held" in md and "| phase | inputs tried | faults injected | load held | lost | outcome |" in md
    rows = summary_rows(result)
    assert [r[0] for r in rows] == ["1 API fuzz", "2 access", "3 wire fuzz", "4 soak", "5 fault: kill",
                                    "5 fault: lost messages", "6 overload", "7 baseline"]
    assert "1.30x (over 1.2x)" in md and "offer_wrong_format" in md
    assert "to look at: RSS of decode-0 1.30x" in md
    assert "| chat | 8 | 2 | 0 | 1.2 | 3.0 |" in md and "| 10 | 104 |" in md
    assert "FAILED" in render_markdown(_result(soak={"totals": {"lost": 2}}))
    doc = "# Reliability\n\nintro\n"
    once = replace_generated(doc, "table one")
    assert once.startswith(doc.rstrip()) and BEGIN in once and END in once
    twice = replace_generated(once + "\nafter\n", "table two")
    assert "table one" not in twice and "table two" in twice and twice.endswith("after\n") and twice.count(BEGIN) == 1


def test_topology_text_parses_with_keys_and_loopback_only(tmp_path):
    from cluster.topology import parse_topology

    workers = [{"name": "prefill-0", "role": "prefill", "control_port": 5001, "kv_port": None, "events_port": 5002},
               {"name": "decode-0", "role": "decode", "control_port": 5003, "kv_port": 5004, "events_port": 5005}]
    topo = parse_topology(topology_text(workers, 8123, keys_dir=str(tmp_path / "k")), name="t")
    assert topo.router.port == 8123 and topo.router.host == "127.0.0.1"
    assert topo.security.curve_keys_dir == str(tmp_path / "k")
    assert [w.host for w in topo.workers] == ["127.0.0.1"] * 2
    assert topo.routing.local_prefill_max_tokens == 128 and topo.engine.prefill_chunk_size == 256


def test_api_fuzz_cases_are_capped_and_repaired():
    from types import SimpleNamespace

    from benchmarks.reliability_phases import _cap_case, _repair

    case = SimpleNamespace(body={"messages": [{"role": "\x00", "content": 3}, "junk"], "model": "x", "n": 99.0})
    _repair(case)
    _cap_case(case)
    assert case.body == {"messages": [{"role": "user", "content": "Hello"}], "model": "SmolLM2-135M-Instruct",
                         "n": 2, "max_tokens": 8}
    empty = SimpleNamespace(body={"messages": [], "max_completion_tokens": 10**6, "max_tokens": -3})
    _repair(empty)
    _cap_case(empty)
    assert empty.body["messages"] == [{"role": "user", "content": "Hello"}]
    assert empty.body["max_completion_tokens"] == 8 and empty.body["max_tokens"] == -3  # invalid values stay
    other = SimpleNamespace(body=["not", "a", "dict"])
    _repair(other)
    _cap_case(other)
    assert other.body == ["not", "a", "dict"]


def test_topology_and_reference_serve_a_model_folder_under_its_name(tmp_path):
    from benchmarks.reliability_cluster import reference_argv
    from cluster.topology import parse_topology

    workers = [{"name": "decode-0", "role": "decode", "control_port": 5003, "kv_port": 5004, "events_port": 5005}]
    topo = parse_topology(topology_text(workers, 8123, model=str(tmp_path), served_name="fast"), name="t")
    assert topo.model.source == str(tmp_path) and topo.model.served_name == "fast"
    argv = reference_argv(8124, model=str(tmp_path), served_name="fast")
    assert argv[argv.index("--model") + 1] == str(tmp_path) and argv[argv.index("--served-model-name") + 1] == "fast"
    assert "--model" not in reference_argv(8124)  # the default model, as before


def test_long_soak_fit_failures_and_markers():
    from benchmarks.reliability_cluster import ENGINE
    from benchmarks.reliability_long import BEGIN as LB, END as LE, FAST_CONFIG, fit_slopes, render_markdown as lr
    from benchmarks.reliability_long import failures as long_failures
    from cluster.model_families import check_config

    check_config(FAST_CONFIG)  # the fast model passes the verified-families gate
    # warm-up ramp to answer 100, then flat router and a decode worker growing 5 MiB per 1,000 requests
    samples = [{"t": i, "n": n, "rss": {"router": 100.0 + min(n, 100) / 10 + (n % 7) * 0.01,
                                        "decode-0": 300.0 + min(n, 100) + max(0, n - 100) * 0.005,
                                        "reference": 200.0 + n * 0.01}}
               for i, n in enumerate(range(0, 10001, 25))]
    slopes = fit_slopes(samples, 1000)
    assert abs(slopes["router"]["slope_mib_per_1000"]) < 0.05
    assert abs(slopes["decode-0"]["slope_mib_per_1000"] - 5.0) < 1e-6
    assert slopes["decode-0"]["warm_mib"] == 404.5 and slopes["decode-0"]["start_mib"] == 300.0
    result = {"phases": {"soak": {"totals": {"completed": 9, "disconnected": 1, "lost": 0}, "sent": 10,
                                  "by_kind": {"chat": {"completed": 9}, "disconnect": {"disconnected": 1}},
                                  "concurrency": 8, "duration_s": 10.0},
                         "baseline": {"workers": {}, "not_at_baseline": []}},
              "config": {"engine": ENGINE, "rss_every_s": 2.0}, "rss_samples": samples,
              "rss_fit": {"from_answers": 1000, "slopes": slopes}}
    fails = long_failures(result)
    assert len(fails) == 1 and fails[0].startswith("RSS of decode-0 grew 45 MiB")  # the reference is not judged
    block = lr(result, "img/rss.png")
    assert "FAILED: RSS of decode-0" in block and "![RSS" in block and "| decode-0 |" in block
    doc = replace_generated(replace_generated("# Reliability\n", block, LB, LE), "the full run")
    assert doc.count(LB) == doc.count(LE) == doc.count(BEGIN) == 1 and "the full run" in doc
    again = replace_generated(doc, "again", LB, LE)
    assert again.count("again") == 1 and "the full run" in again
