"""Tests of the benchmark harness (benchmarks/*), with no model: statistics on known data, SSE parsing,
and load runs against a tiny fake OpenAI server (FastAPI + uvicorn, in-process on a free port) that
streams fixed chunks with known delays.

Run as a script (`python -m tests.test_bench PORT`) this file *is* that fake server, which the
comparison test starts twice as subprocesses in place of mlx-pd and mlx_lm.server.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import sys
import threading
import time

import pytest
from fastapi import FastAPI, Request  # module level: FastAPI resolves the string annotations here
from fastapi.responses import JSONResponse, StreamingResponse

from benchmarks import cli, compare
from benchmarks.loadgen import WorkloadConfig, load_prompts, make_prompts, run_benchmark, run_load, send_request
from benchmarks.servers import ServerProcess, free_port, process_memory
from benchmarks.sse import SSEParser, iter_events, parse_chunk
from benchmarks.stats import RequestRecord, percentile, summarize

FIRST_DELAY_S = 0.15  # fake server: time to the first token
TOKEN_GAP_S = 0.02  # fake server: time between tokens


def make_fake_app(received: list | None = None):
    """A fake OpenAI server. Tokens are "t0 ", "t1 ", ...; the prompt "FAIL" gets a 400; model "no-usage"
    gets no usage chunk; a keepalive comment and a role-only chunk come first, as real servers send."""
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        if received is not None:
            received.append(body)
        if "FAIL" in body["messages"][-1]["content"]:
            return JSONResponse({"error": {"message": "you asked for it", "type": "invalid_request_error"}}, 400)
        n = body.get("max_tokens", 4)

        async def events():
            def chunk(delta, finish=None):
                return "data: " + json.dumps({"object": "chat.completion.chunk", "choices": [
                    {"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"

            yield ": keepalive 0/10\n\n"
            await asyncio.sleep(FIRST_DELAY_S)
            yield chunk({"role": "assistant", "content": ""})
            for i in range(n):
                if i:
                    await asyncio.sleep(TOKEN_GAP_S)
                yield chunk({"content": f"t{i} "}, "length" if i == n - 1 else None)
            if body.get("model") != "no-usage" and (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": 9, "completion_tokens": n, "prompt_tokens_details": {"cached_tokens": 4}}
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_server():
    """(base URL, list of received bodies) of a fake server running in a background thread."""
    import uvicorn

    received: list = []
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(make_fake_app(received), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", received
    server.should_exit = True
    thread.join(timeout=10)


# --- statistics ---------------------------------------------------------------------------------------

def test_percentiles_on_known_data():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([4, 1, 3, 2], 0) == 1 and percentile([4, 1, 3, 2], 100) == 4
    assert percentile(range(1, 101), 99) == pytest.approx(99.01)
    assert percentile(range(1, 101), 90) == pytest.approx(90.1)
    assert percentile([7], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="101"):
        percentile([1], 101)


def test_percentiles_match_numpy():
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    data = [rng.expovariate(1.0) for _ in range(97)]
    for q in (1, 50, 90, 99, 99.9):
        assert percentile(data, q) == pytest.approx(float(np.percentile(data, q)))


def test_summarize_tpot_throughput_and_errors():
    recs = [RequestRecord(index=0, ttft_s=0.1, e2e_s=1.1, output_tokens=11, itls_s=[0.1] * 10),
            RequestRecord(index=1, ttft_s=0.3, e2e_s=2.3, output_tokens=11, itls_s=[0.2] * 10),
            RequestRecord(index=2, error="HTTP 500: boom")]
    assert recs[0].tpot_s == pytest.approx(0.1) and recs[1].tpot_s == pytest.approx(0.2)
    assert recs[2].tpot_s is None and not recs[2].ok
    s = summarize(recs, duration_s=2.0)
    assert (s["requests"], s["errors"], s["output_tokens_total"]) == (3, 1, 22)
    assert s["output_throughput"] == pytest.approx(11.0) and s["request_throughput"] == pytest.approx(1.0)
    assert s["ttft_s"]["p50"] == pytest.approx(0.2) and s["ttft_s"]["max"] == pytest.approx(0.3)
    assert s["tpot_s"]["mean"] == pytest.approx(0.15)
    assert s["itl_s"]["p50"] == pytest.approx(0.15)  # 10 x 0.1 and 10 x 0.2 pooled
    assert RequestRecord(index=3, ttft_s=0.1, e2e_s=0.1, output_tokens=1).tpot_s is None


# --- SSE ----------------------------------------------------------------------------------------------

def test_sse_parser_comments_multiline_and_unterminated():
    lines = [": keepalive 1/2", "data: {\"a\":", "data: 1}", "", "event: x", "data:[DONE]"]
    assert list(iter_events(lines)) == ['{"a":\n1}', "[DONE]"]
    p = SSEParser()
    assert list(p.feed("data: x\r\n")) == [] and list(p.feed("\r\n")) == ["x"]


def test_parse_chunk_formats():
    mlx_lm_style = {"object": "chat.completion.chunk", "choices": [
        {"index": 0, "finish_reason": None, "delta": {"role": "assistant", "content": " Paris"}}]}
    assert parse_chunk(json.dumps(mlx_lm_style)).content == " Paris"
    role_only = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    assert parse_chunk(json.dumps(role_only)).content == ""
    completion = {"choices": [{"index": 0, "text": "hi", "finish_reason": "length"}]}
    c = parse_chunk(json.dumps(completion))
    assert (c.content, c.finish_reason) == ("hi", "length")
    usage = {"object": "chat.completion", "choices": [], "usage": {"completion_tokens": 8}}
    assert parse_chunk(json.dumps(usage)).usage_tokens == 8
    assert parse_chunk('{"error": {"message": "stalled"}}').error == "server error in stream: stalled"
    assert parse_chunk("[DONE]").done
    assert "bad JSON" in parse_chunk("{nope").error


# --- prompts and config -------------------------------------------------------------------------------

def test_prompt_set_and_unique_prefixes():
    base = load_prompts()
    assert 40 <= len(base) <= 80 and len(set(base)) == len(base)
    a = make_prompts(120, seed=1)
    assert len(set(a)) == 120 and all(p.startswith("[req ") for p in a)
    assert a == make_prompts(120, seed=1) and a != make_prompts(120, seed=2)
    shared = make_prompts(5, seed=1, shared_prefix=True)
    assert all(p in base for p in shared)


def test_workload_endpoint_and_body():
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/chat/completions"):
        assert WorkloadConfig(url=url).endpoint == "http://h:1/v1/chat/completions"
    body = WorkloadConfig(url="http://h:1", max_tokens=7).body("hi")
    assert body["max_tokens"] == 7 and body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["stream"] is True and "model" not in body and "logit_bias" not in body
    assert WorkloadConfig(url="u", suppress_token_ids=(0, 2)).body("x")["logit_bias"] == {"0": -100.0, "2": -100.0}
    with pytest.raises(ValueError, match="max_tokens"):
        WorkloadConfig(url="http://h:1", max_tokens=0)


# --- against the fake server --------------------------------------------------------------------------

def _send(url: str, prompt: str, model=None, n: int = 5) -> RequestRecord:
    import httpx

    async def go():
        async with httpx.AsyncClient(timeout=30) as client:
            return await send_request(client, WorkloadConfig(url=url, max_tokens=n, model=model), 0, prompt,
                                      time.perf_counter())

    return asyncio.run(go())


def test_stream_timing_against_fake_server(fake_server):
    url, _ = fake_server
    rec = _send(url, "hello", n=5)
    assert rec.ok, rec.error
    assert rec.text == "t0 t1 t2 t3 t4 " and rec.finish_reason == "length"
    assert (rec.output_tokens, rec.usage_tokens, rec.content_chunks) == (5, 5, 5)
    assert (rec.prompt_tokens, rec.cached_tokens) == (9, 4)
    # Lower bounds from the server's delays, upper bounds from the request's own end: the first token comes
    # before the gaps and the gaps before the end, however loaded the machine is. The server sends token k no
    # earlier than FIRST_DELAY_S + k gaps, so it arrives no earlier; a single gap has no lower bound (a token
    # read late by a busy client shortens the gap after it), so the bounds are on arrival times.
    assert FIRST_DELAY_S <= rec.ttft_s and rec.ttft_s + sum(rec.itls_s) <= rec.e2e_s + 1e-6
    arrivals = [rec.ttft_s + sum(rec.itls_s[:k]) for k in range(5)]
    assert len(rec.itls_s) == 4 and all(t >= FIRST_DELAY_S + k * TOKEN_GAP_S * 0.8 for k, t in enumerate(arrivals))
    assert rec.tpot_s == pytest.approx((rec.e2e_s - rec.ttft_s) / 4)
    assert rec.e2e_s >= FIRST_DELAY_S + 4 * TOKEN_GAP_S * 0.8


def test_tokens_counted_from_chunks_without_usage(fake_server):
    rec = _send(fake_server[0], "hello", model="no-usage", n=3)
    assert rec.ok and rec.usage_tokens is None and rec.output_tokens == 3


def test_http_error_is_recorded(fake_server):
    rec = _send(fake_server[0], "please FAIL")
    assert not rec.ok and rec.error.startswith("HTTP 400") and "you asked for it" in rec.error


def test_end_to_end_closed_loop(fake_server):
    url, received = fake_server
    received.clear()
    result = asyncio.run(run_benchmark(WorkloadConfig(url=url, max_tokens=4), num_requests=6, concurrency=3,
                                       warmup_requests=2, seed=5, progress=False))
    s = result["summary"]
    assert (s["requests"], s["errors"], s["output_tokens_total"]) == (6, 0, 24)
    assert len(received) == 8  # 2 warm-up + 6 measured
    warm, measured = received[:2], received[2:]
    assert all(b["messages"][0]["content"].startswith("[warm ") for b in warm)
    prompts = [b["messages"][0]["content"] for b in measured]
    assert len(set(prompts)) == 6 and all(p.startswith("[req ") for p in prompts)
    assert all(b["ignore_eos"] and b["stream_options"]["include_usage"] for b in measured)
    assert s["prompt_tokens_mean"] == 9 and s["cached_tokens_mean"] == 4
    # 6 requests, 3 at a time, each >= FIRST_DELAY_S + 3 gaps: at least two waves
    assert s["duration_s"] >= 2 * (FIRST_DELAY_S + 3 * TOKEN_GAP_S) * 0.9
    assert s["ttft_s"]["p99"] >= FIRST_DELAY_S and s["output_throughput"] == pytest.approx(24 / s["duration_s"])
    assert len(result["records"]) == 6 and result["records"][0]["tpot_s"] > 0
    json.dumps(result)  # JSON-ready


def test_poisson_arrivals_and_errors(fake_server):
    url, _ = fake_server
    prompts = ["a", "b", "FAIL c", "d"]
    records, duration = asyncio.run(run_load(WorkloadConfig(url=url, max_tokens=2), prompts, rate=20.0,
                                             seed=1, progress=False))
    assert [r.index for r in records] == [0, 1, 2, 3]
    assert [r.ok for r in records] == [True, True, False, True]
    starts = [r.start_s for r in records]
    assert starts == sorted(starts) and duration > 0


def test_cli_url_mode_writes_json(fake_server, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = cli.main(["--url", fake_server[0], "--concurrency", "2", "--num-requests", "4", "--max-tokens", "3",
                   "--no-progress", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["summary"]["requests"] == 4 and data["config"]["concurrency"] == 2
    captured = capsys.readouterr()
    assert "TTFT" in captured.out
    plots = [tmp_path / "r-latency-cdf.png", tmp_path / "r-throughput.png"]  # next to the JSON by default
    assert all(p.stat().st_size > 0 for p in plots) and f"plots: {plots[0]}, {plots[1]}" in captured.err
    quiet = tmp_path / "quiet.json"
    assert cli.main(["--url", fake_server[0], "--concurrency", "1", "--num-requests", "2", "--max-tokens", "3",
                     "--no-progress", "--out", str(quiet), "--no-plot"]) == 0
    assert quiet.is_file() and not list(tmp_path.glob("quiet*.png"))
    assert cli.main(["--url", fake_server[0], "--max-tokens", "0"]) == 2


# --- comparison pieces ---------------------------------------------------------------------------------

def test_rounds_order_and_ratios():
    assert compare.split_rounds(list(range(10)), 3) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert compare.split_rounds([1, 2], 5) == [[1], [2]]
    assert [compare.round_order(r)[0] for r in range(4)] == [compare.OURS, compare.THEIRS, compare.THEIRS,
                                                             compare.OURS]
    def summ(tp, ttft, tpot):
        d = {"p50": ttft, "p99": 2 * ttft}
        return {"output_throughput": tp, "request_throughput": tp / 10, "ttft_s": d,
                "tpot_s": {"p50": tpot, "p99": tpot}, "e2e_s": {"p50": 1.0, "p99": 1.0}}
    r = compare.ratios(summ(30, 0.1, 0.05), summ(20, 0.2, 0.05))
    assert r["output_throughput"] == pytest.approx(1.5) and r["ttft_s_p99"] == pytest.approx(0.5)
    assert r["tpot_s_p50"] == pytest.approx(1.0)


def test_eos_token_ids(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 0, "content": "<|endoftext|>"}]}))
    assert compare.eos_token_ids(str(tmp_path)) == (0, 2, 7)


def test_process_memory_of_self():
    mem = process_memory(os.getpid())
    assert mem["rss_mib"] > 10 and mem["processes"] >= 1


def test_server_process_lifecycle(tmp_path):
    port = free_port()
    srv = ServerProcess("fake", [sys.executable, "-m", "tests.test_bench", str(port)], port, log_dir=str(tmp_path),
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with srv:
        assert srv.wait_healthy(deadline_s=60) >= 0
        assert srv.memory()["rss_mib"] > 1
    assert srv.proc.poll() is not None
    dead = ServerProcess("dead", [sys.executable, "-c", "raise SystemExit(3)"], free_port(), log_dir=str(tmp_path))
    with dead, pytest.raises(RuntimeError, match="exited with code 3"):
        dead.wait_healthy(deadline_s=30)


def test_compare_end_to_end_with_fake_servers(monkeypatch, tmp_path):
    """The whole --compare flow with both "servers" being this file's fake server."""
    fake = lambda port, *a, **k: [sys.executable, "-m", "tests.test_bench", str(port)]  # noqa: E731
    monkeypatch.setattr(compare, "mlx_pd_command", fake)
    monkeypatch.setattr(compare, "mlx_lm_command", fake)
    result = compare.run_compare([1, 2], [2, 4], max_tokens=3, model_dir=str(tmp_path), rounds=2,
                                 min_round_waves=1, health_deadline_s=60, progress=False, log=None)
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 2]
    for level in result["levels"]:
        assert level["rounds"] == 2
        for name in (compare.OURS, compare.THEIRS):
            assert level["servers"][name]["errors"] == 0
            assert level["servers"][name]["output_tokens_mean"] == 3
        assert level["sanity"]["identical_text"] == level["num_requests"]
    assert result["suppressed_token_ids"] == []  # tmp_path has no config.json
    assert result["memory"][compare.OURS]["rss_mib"] > 1
    from benchmarks.report import markdown_compare

    assert "ratio ours/theirs" in markdown_compare(result)


if __name__ == "__main__":  # the fake server as a process: python -m tests.test_bench PORT
    import uvicorn

    uvicorn.run(make_fake_app(), host="127.0.0.1", port=int(sys.argv[1]), log_level="error")
