"""The dashboard (`GET /dashboard`, its state JSON and its login): the router's history on a clock of the test's
own, the state of an in-process 1P1D cluster of the fast model while a request runs and after, a stopped worker,
the page's self-containment, the login with an API key, and single-node mode on a live server. The page in a
real browser: tests/test_dashboard_browser.py."""

from __future__ import annotations

import re
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from cluster.stats import WorkerStats
from router.app import create_app
from router.dashboard_history import DashboardHistory, percentile
from router.dashboard_web import COOKIE
from tests.cluster_helpers import running_cluster, slow_steps
from tests.engine_helpers import fast_model
from tests.live_server import live_server
from tests.router_fakes import MODEL, FakeEngine, ServerThread, load_tokenizer

ALL_REMOTE = "local_prefill_max_tokens = 0"  # every request goes through the prefill worker
KEY = "dashboard-test-key"


def wait_for(fetch, pred, timeout_s: float, what: str):
    """Call `fetch()` until `pred(result)` holds; the last result. Fails naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = fetch()
        if pred(got):
            return got
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f} s; last state: {got}"
        time.sleep(0.2)


def state_of(base: str, **headers) -> dict:
    r = httpx.get(base + "/dashboard/api/state", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def workers_by_name(state: dict) -> dict:
    return {w["name"]: w for w in state["workers"]}


def stream_completion(base: str, max_tokens: int, got_tokens: threading.Event, **headers) -> threading.Thread:
    """A streaming completion on a thread; `got_tokens` is set once a few tokens have arrived."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}

    def run() -> None:
        seen = 0
        with httpx.stream("POST", base + "/v1/completions", json=body, headers=headers, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen += 1
                    if seen >= 3:
                        got_tokens.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# -- the history, on a clock of the test's own ------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_history_samples_each_interval_with_its_percentiles_rates_and_worker_deltas():
    clock = Clock()
    reports = [{"name": "decode-0", "tokens_out": 0, "kv_bytes_received": 0.0}]
    h = DashboardHistory(interval_s=2.0, span_s=10.0, summary_s=4.0, worker_reports=lambda: reports, clock=clock)
    h.roll(100.0)  # the worker's first reading, the baseline of its rates
    assert list(h.samples) == []  # the first interval is still open
    h.begin("a", 100.0)
    h.record("a", 100.5, 1, ttft=0.5)
    h.record("a", 101.0, 2, itl=0.25)
    assert h.inflight(101.5) == [{"request_id": "a", "age_s": 1.5, "tokens": 3, "ttft_s": 0.5}]
    h.record("a", 101.5, 1, itl=0.5, tpot=0.3, e2e=1.5, finished=True)
    h.end("a")
    h.end("never-begun")  # ignored
    assert h.inflight(101.5) == []
    clock.now = 102.1
    reports[0].update(tokens_out=40, kv_bytes_received=1000.0)
    h.roll()  # closes [100, 102)
    (first,) = h.samples
    assert first["requests_per_s"] == 0.5 and first["finished_per_s"] == 0.5 and first["tokens_per_s"] == 2.0
    assert first["ttft"] == {"p50": 0.5, "p90": 0.5, "p99": 0.5, "count": 1}
    assert first["itl"]["count"] == 3 and first["itl"]["p50"] == 0.25 and first["itl"]["p99"] == pytest.approx(0.495)
    assert first["tpot"]["p50"] == 0.3 and first["e2e"]["p50"] == 1.5
    assert first["workers"] == {"decode-0": {"tokens_per_s": pytest.approx(40 / 2.1),
                                             "kv_bytes_per_s": pytest.approx(1000 / 2.1),
                                             "ssd_blocks_written_per_s": 0.0, "ssd_blocks_loaded_per_s": 0.0}}
    # an idle stretch of three intervals: [102, 104) with the worker's delta, then zero samples
    clock.now = 108.1
    reports[0].update(tokens_out=100, kv_bytes_received=1600.0)
    h.roll()
    assert len(h.samples) == 4
    latest = h.samples[-1]
    assert latest["tokens_per_s"] == 0 and latest["ttft"] == {"p50": None, "p90": None, "p99": None, "count": 0}
    assert latest["workers"]["decode-0"]["tokens_per_s"] == pytest.approx(60 / 6.0)
    assert latest["workers"]["decode-0"]["kv_bytes_per_s"] == pytest.approx(600 / 6.0)
    assert [round(b["t"] - a["t"], 6) for a, b in zip(h.samples, list(h.samples)[1:])] == [2.0, 2.0, 2.0]
    # the summary covers the last summary_s: the request's interval has left it
    assert h.summary()["ttft"]["count"] == 0
    # a restarted worker (its counter went down) counts from zero; a dead one (no report) has no rate
    clock.now = 110.1
    reports[:] = [{"name": "decode-0", "tokens_out": 8}, {"name": "prefill-0"}]
    h.roll()
    idle = {"tokens_per_s": 0.0, "kv_bytes_per_s": 0.0, "ssd_blocks_written_per_s": 0.0,
            "ssd_blocks_loaded_per_s": 0.0}
    assert h.worker_rates == {"decode-0": dict(idle, tokens_per_s=pytest.approx(4.0)), "prefill-0": idle}
    # a stretch longer than the ring keeps the ring's length of samples, the last one ending at the last boundary
    clock.now = 200.0
    h.roll()
    assert len(h.samples) == 5 and h.samples[-1]["t"] - h.samples[0]["t"] == pytest.approx(8.0)


def test_history_rates_each_workers_ssd_tier_writes_and_loads():
    clock = Clock()
    report = {"name": "decode-0", "tokens_out": 0, "ssd_blocks_written": 10.0, "ssd_blocks_loaded": 0.0}
    h = DashboardHistory(interval_s=2.0, span_s=10.0, worker_reports=lambda: [report], clock=clock)
    h.roll(100.0)  # the baseline
    clock.now = 102.0
    report.update(ssd_blocks_written=50.0, ssd_blocks_loaded=8.0)
    h.roll()
    rates = h.samples[-1]["workers"]["decode-0"]
    assert rates["ssd_blocks_written_per_s"] == pytest.approx(20.0) and rates["ssd_blocks_loaded_per_s"] == 4.0
    clock.now = 104.0
    report.update(ssd_blocks_written=6.0)  # a restarted worker's tier counts from zero
    h.roll()
    assert h.worker_rates["decode-0"]["ssd_blocks_written_per_s"] == pytest.approx(3.0)
    assert h.worker_rates["decode-0"]["ssd_blocks_loaded_per_s"] == 0.0


def test_percentile_interpolates_between_ranks():
    assert percentile([], 0.5) is None
    assert percentile([1.0], 0.99) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([0.0, 10.0], 0.9) == pytest.approx(9.0)


# -- cluster mode ------------------------------------------------------------------------------------------------


def test_cluster_state_shows_workers_a_running_request_and_the_rates_after():
    with running_cluster(1, 1, loaded=fast_model(), routing=ALL_REMOTE) as (base, client, workers):
        slow_steps(workers["decode-0"], 0.05)  # the request stays in flight for seconds
        state = state_of(base)
        assert state["mode"] == "cluster" and state["version"] == 1 and state["model"] == MODEL
        rows = workers_by_name(state)
        assert set(rows) == {"prefill-0", "decode-0"}
        for name, row in rows.items():
            spec = next(w.spec for w in client.workers if w.spec.name == name)
            assert row["alive"] is True and row["role"] == name.split("-")[0]
            assert row["address"] == f"{spec.host}:{spec.control_port}"
            assert row["kv_blocks_total"] > 0 and row["kv_blocks_used"] + row["kv_blocks_free"] == row["kv_blocks_total"]
            assert row["ssd_tier"] == "off"  # no SSD tier unless the topology asks for one
        got_tokens = threading.Event()
        thread = stream_completion(base, 80, got_tokens)
        assert got_tokens.wait(60), "the stream delivered no tokens"
        state = state_of(base)
        (req,) = state["requests"]
        assert state["requests_inflight"] == 1
        assert req["workers"] == ["prefill-0", "decode-0"] and req["phase"] == "decode"
        assert req["tokens"] >= 3 and req["age_s"] > 0 and req["ttft_s"] > 0
        assert workers_by_name(state)["decode-0"]["inflight"] == 1
        thread.join(120)
        assert not thread.is_alive()

        def rates_seen(s: dict) -> bool:
            samples = s["history"]["samples"]
            return (workers_by_name(s)["decode-0"]["tokens_out"] == 79  # its reports caught up (pings every 0.5 s)
                    and any(x["workers"].get("decode-0", {}).get("tokens_per_s", 0) > 0 for x in samples)
                    and any(x["workers"].get("prefill-0", {}).get("kv_bytes_per_s", 0) > 0 for x in samples)
                    and any(x["tokens_per_s"] > 0 for x in samples))

        state = wait_for(lambda: state_of(base), rates_seen, 20, "worker token and KV rates in the history")
        assert state["requests"] == [] and state["requests_inflight"] == 0
        assert state["router"]["requests_total"] == 1 and state["router"]["tokens_total"] == 80
        summary = state["summary"]
        assert summary["ttft"]["count"] == 1 and summary["itl"]["count"] == 79 and summary["e2e"]["count"] == 1
        assert 0 < summary["itl"]["p50"] <= summary["itl"]["p90"] <= summary["itl"]["p99"]
        rows = workers_by_name(state)
        assert rows["prefill-0"]["tokens_out"] == 1 and rows["prefill-0"]["kv_bytes_sent"] > 0
        assert rows["decode-0"]["kv_bytes_received"] == rows["prefill-0"]["kv_bytes_sent"]
        # `since` keeps the newer samples only
        last = state["history"]["samples"][-1]["t"]
        later = httpx.get(base + "/dashboard/api/state", params={"since": last}, timeout=30).json()
        assert all(s["t"] > last for s in later["history"]["samples"])


def test_cluster_state_shows_each_workers_ssd_tier_filling_as_blocks_are_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_PD_CACHE", str(tmp_path))  # the tier's folders (kv-tier/<worker>)
    prompt = list(range(100, 400))  # several whole blocks
    with running_cluster(1, 1, loaded=fast_model(), routing=ALL_REMOTE, engine="ssd_cache_gb = 0.05") as (
            base, client, workers):
        rows = workers_by_name(wait_for(lambda: state_of(base), lambda s: all(
            w["ssd_tier"] is not None for w in s["workers"]), 10, "both workers' first reports"))
        for row in rows.values():
            assert row["ssd_tier"] == "on" and row["ssd_budget_bytes"] > 0 and row["ssd_bad_blocks"] == 0
            assert row["ssd_load_bytes_per_s"] is None  # nothing loaded yet
        r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                                        "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text

        def written(s: dict) -> bool:
            row = workers_by_name(s)["prefill-0"]
            return (row["ssd_blocks_written"] > 0 and row["ssd_blocks"] > 0 and 0 < row["ssd_bytes"]
                    and any(x["workers"].get("prefill-0", {}).get("ssd_blocks_written_per_s", 0) > 0
                            for x in s["history"]["samples"]))

        state = wait_for(lambda: state_of(base), written, 15, "the prefill worker's blocks written to its tier")
        row = workers_by_name(state)["prefill-0"]
        assert row["ssd_bytes"] <= row["ssd_budget_bytes"] and row["ssd_blocks"] <= row["ssd_blocks_written"]


def test_a_stopped_worker_shows_dead():
    with running_cluster(1, 1, loaded=fast_model()) as (base, client, workers):
        assert all(w["alive"] for w in state_of(base)["workers"])
        workers["prefill-0"].stop()
        deadline = client.routing.dead_after_s + 10  # the liveness deadline (a dropped connection is seen sooner)
        state = wait_for(lambda: state_of(base), lambda s: not workers_by_name(s)["prefill-0"]["alive"], deadline,
                         "the stopped worker shown dead")
        rows = workers_by_name(state)
        assert rows["decode-0"]["alive"] and rows["prefill-0"]["running"] is None  # no report from the dead
        assert state["router"]["healthy"]  # a decode worker still serves


# -- the page and the login (a scripted engine) ----------------------------------------------------------------


def fake_app(api_key=None):
    tokenizer = load_tokenizer()
    engine = FakeEngine(tokenizer)
    return create_app(engine, tokenizer, served_model_names=[MODEL], api_key=api_key), engine


def scripted_ssd_cluster():
    """A scripted engine (FakeEngine) standing in for a cluster of four workers whose reports are real
    `WorkerStats` reports: decode-0's SSD tier has loaded blocks, prefill-0's has loaded none, decode-1 has no
    tier (a budget of 0), decode-2 is dead (no report)."""
    tokenizer = load_tokenizer()
    engine = FakeEngine(tokenizer)
    names = ("prefill-0", "decode-0", "decode-1", "decode-2")
    engine.workers = [SimpleNamespace(spec=SimpleNamespace(name=n, host="10.0.0.1", control_port=5600 + i))
                      for i, n in enumerate(names)]
    tiers = {
        "prefill-0": dict(ssd_blocks=30, ssd_bytes=12e6, ssd_budget_bytes=50e9, ssd_blocks_written=30.0),
        "decode-0": dict(ssd_blocks=120, ssd_bytes=48e6, ssd_budget_bytes=2e9, ssd_blocks_written=150.0,
                         ssd_blocks_dropped=3.0, ssd_blocks_loaded=40.0, ssd_bytes_loaded=16e6,
                         ssd_load_seconds=0.008, ssd_bad_blocks=1.0),
        "decode-1": {},
    }

    def worker_stats() -> list[dict]:
        out = []
        for n in names:
            report = WorkerStats(name=n, role=n.split("-")[0], **tiers[n]).report() if n in tiers else {}
            out.append(dict(report, name=n, role=n.split("-")[0], alive=n in tiers, inflight=0))
        return out

    engine.worker_stats = worker_stats
    return create_app(engine, tokenizer, served_model_names=[MODEL])


def test_state_shows_each_workers_ssd_tier_or_off():
    with TestClient(scripted_ssd_cluster()) as c:
        rows = workers_by_name(c.get("/dashboard/api/state").json())
    tiered = rows["decode-0"]
    assert tiered["ssd_tier"] == "on"
    assert {k: tiered[k] for k in ("ssd_blocks", "ssd_bytes", "ssd_budget_bytes", "ssd_blocks_written",
                                   "ssd_blocks_dropped", "ssd_blocks_loaded", "ssd_bad_blocks")} == {
        "ssd_blocks": 120, "ssd_bytes": 48e6, "ssd_budget_bytes": 2e9, "ssd_blocks_written": 150.0,
        "ssd_blocks_dropped": 3.0, "ssd_blocks_loaded": 40.0, "ssd_bad_blocks": 1.0}
    assert tiered["ssd_load_bytes_per_s"] == pytest.approx(16e6 / 0.008)  # 2 GB/s
    assert rows["prefill-0"]["ssd_tier"] == "on" and rows["prefill-0"]["ssd_load_bytes_per_s"] is None
    assert rows["decode-1"]["ssd_tier"] == "off" and rows["decode-1"]["ssd_budget_bytes"] == 0
    dead = rows["decode-2"]
    assert dead["ssd_tier"] is None and dead["ssd_blocks"] is None and dead["ssd_load_bytes_per_s"] is None


def test_the_page_is_self_contained():
    app, _ = fake_app()
    with TestClient(app) as c:
        r = c.get("/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert "http://" not in page and "https://" not in page  # no other host, not even a namespace URI
    assert not re.search(r"<script[^>]*\bsrc\s*=", page, re.I) and not re.search(r"<link\b", page, re.I)
    assert "@import" not in page and "url(" not in page and "<iframe" not in page and "<img" not in page
    assert page.count("<script>") == 1 and page.count("<style>") == 1
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "'unsafe-inline'" not in csp
    assert "/dashboard/api/state" in page and 'data-worker' in page and 'data-alive' in page


def test_login_with_an_api_key():
    app, _ = fake_app(api_key=KEY)
    with TestClient(app) as c:
        r = c.get("/dashboard", follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/dashboard/login"
        r = c.get("/dashboard/api/state")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = c.get("/dashboard/login")
        assert r.status_code == 200 and 'name="api_key"' in r.text and 'action="/dashboard/login"' in r.text
        assert c.get("/v1/models").status_code == 401  # the API stays closed

        r = c.post("/dashboard/login", data={"api_key": "wrong"}, follow_redirects=False)
        assert r.status_code == 401 and "wrong API key" in r.text and 'name="api_key"' in r.text
        assert COOKIE not in r.headers.get("set-cookie", "")
        assert c.post("/dashboard/login", data={"api_key": KEY, "user": "x"}).status_code == 400
        form = {"content-type": "application/x-www-form-urlencoded"}
        r = c.post("/dashboard/login", content=b"", headers=form)
        assert r.status_code == 400 and "api_key is missing" in r.text
        assert c.post("/dashboard/login", json={"api_key": KEY}).status_code == 415
        assert c.post("/dashboard/login", content=b"api_key=" + b"x" * 5000, headers=form).status_code == 413
        c.cookies.set(COOKIE, "0" * 64)  # a forged cookie
        assert c.get("/dashboard/api/state").status_code == 401
        c.cookies.clear()

        r = c.post("/dashboard/login", data={"api_key": KEY}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/dashboard"
        cookie = r.headers["set-cookie"]
        assert cookie.startswith(COOKIE + "=") and "HttpOnly" in cookie and "samesite=strict" in cookie.lower()
        assert KEY not in cookie and "Path=/dashboard" in cookie
        assert c.get("/dashboard").status_code == 200
        assert c.get("/dashboard/api/state").status_code == 200
        assert c.get("/dashboard/login", follow_redirects=False).status_code == 303  # already logged in
        assert c.get("/v1/models").status_code == 401  # the cookie opens the dashboard only
        token = c.cookies.get(COOKIE)

    other, _ = fake_app(api_key=KEY)  # another router process: another secret, so the cookie is no good there
    with TestClient(other) as c:
        c.cookies.set(COOKIE, token)
        assert c.get("/dashboard/api/state").status_code == 401
        assert c.get("/dashboard/api/state", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert c.get("/dashboard/api/state", headers={"x-api-key": KEY}).status_code == 200
        assert c.get("/dashboard/api/state", headers={"Authorization": "Bearer nope"}).status_code == 401


def test_bad_query_parameters_are_refused():
    app, _ = fake_app()
    with TestClient(app) as c:
        assert c.get("/dashboard/api/state", params={"since": "soon"}).status_code == 400
        assert c.get("/dashboard/api/state", params={"since": "nan"}).status_code == 400
        r = c.get("/dashboard/api/state", params={"limit": "3"})
        assert r.status_code == 400 and "limit" in r.json()["error"]["message"]
        assert c.get("/dashboard", params={"x": "1"}).status_code == 400
        assert c.get("/dashboard/login", params={"next": "/"}).status_code == 400
        # without a key the login leads straight to the page
        assert c.get("/dashboard/login", follow_redirects=False).headers["location"] == "/dashboard"


def test_a_client_that_leaves_leaves_no_request_in_flight():
    app, engine = fake_app()
    engine.stall = True  # the engine never answers: the request stays in flight until the client leaves
    with ServerThread(app) as server:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4},
                       timeout=1.0)
        state = wait_for(lambda: state_of(server.url), lambda s: s["requests_inflight"] == 0, 10,
                         "the abandoned request gone from the in-flight list")
        assert state["router"]["requests_total"] == 1


# -- single-node mode -------------------------------------------------------------------------------------------


def test_single_node_serves_the_page_and_state():
    with live_server(api_key=KEY, loaded=fast_model()) as (base, _):
        auth = {"Authorization": f"Bearer {KEY}"}
        page = httpx.get(base + "/dashboard", headers=auth, timeout=30)
        assert page.status_code == 200 and 'id="workers-body"' in page.text
        state_of(base, **auth)  # the engine's first reading: its rates' baseline
        got_tokens = threading.Event()
        thread = stream_completion(base, 200, got_tokens, **auth)
        assert got_tokens.wait(60)
        state = state_of(base, **auth)
        assert state["mode"] == "single-node"
        (row,) = state["workers"]
        assert row["name"] == "engine" and row["role"] == "single-node" and row["alive"] is True
        assert row["address"] == "in-process" and row["kv_blocks_total"] > 0
        assert row["ssd_tier"] == "off"  # no SSD tier unless one is asked for
        if state["requests"]:  # the stand-in model may already be done with 200 tokens
            assert state["requests"][0]["workers"] == ["engine"]
        thread.join(60)
        state = wait_for(lambda: state_of(base, **auth),
                         lambda s: any(x["workers"].get("engine", {}).get("tokens_per_s", 0) > 0
                                       for x in s["history"]["samples"]), 20, "the engine's tokens/s")
        assert state["summary"]["ttft"]["count"] == 1 and state["router"]["tokens_total"] == 200
