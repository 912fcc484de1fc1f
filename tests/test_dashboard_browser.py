"""The dashboard in a real browser: Debian's headless Chromium driven by selenium through chromium-driver, on an
in-process 1P1D cluster of the fast model while streaming requests flow. The page must show both workers alive
and tokens flowing, then, without a reload, a stopped worker as dead. And the login with an API key, as a browser
does it: the form, a wrong key, the right key, and the page's polls on the session cookie. And a worker that is a
group of ranks: its ranks under its row.

Needs selenium (the `test` extra) and /usr/bin/chromium, /usr/bin/chromedriver (`apt-get install chromium
chromium-driver`; scripts/setup installs them when CI=true). Without them the test skips, except under CI=true,
where it fails. Selenium downloads nothing: the driver and the browser are given by path and SE_OFFLINE is set.

MLX_PD_DASHBOARD_SCREENSHOT=PATH also writes the screenshot there once the charts have a few samples (how
docs/img/dashboard.png is made: `MLX_PD_DASHBOARD_SCREENSHOT=docs/img/dashboard.png .venv/bin/python -m pytest
tests/test_dashboard_browser.py`).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Optional

import httpx
import pytest

from tests.cluster_helpers import running_cluster, slow_steps
from tests.engine_helpers import fast_model

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
MODEL = "SmolLM2-135M-Instruct"
IN_CI = os.environ.get("CI", "").lower() == "true"
SCREENSHOT_ENV = "MLX_PD_DASHBOARD_SCREENSHOT"

# the page's view of the workers, read from the stable data attributes of its rows and topology nodes
WORKERS_JS = """
return Array.from(document.querySelectorAll('#workers-body tr[data-worker]')).map(tr => ({
  name: tr.dataset.worker, alive: tr.dataset.alive === 'true', tokens: Number(tr.dataset.tokensPerS),
  node: (document.querySelector('#topology g[data-node="' + tr.dataset.worker + '"]') || {dataset: {}}).dataset.alive
}));
"""


def missing_tools() -> Optional[str]:
    """Why the browser test cannot run here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (it is in the test extra: pip install -e '.[test]')"
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.access(path, os.X_OK):
            return f"{path} is missing (apt-get install {package})"
    return None


@pytest.fixture
def browser(tmp_path, monkeypatch):
    """A headless Chromium (selenium WebDriver); skips without the tools, fails without them in CI."""
    missing = missing_tools()
    if missing:
        if IN_CI:
            pytest.fail(f"CI=true and the dashboard's browser test cannot run: {missing}")
        pytest.skip(missing)
    monkeypatch.setenv("SE_OFFLINE", "true")  # selenium manager must not fetch a driver or a browser
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1200", "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # the browser without the test process's LD_PRELOAD (scripts/env.sh's OpenBLAS): preloaded into Chromium's
    # sandboxed renderer, it crashes the tab
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER, env=env), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def traffic(base: str, stop: threading.Event, errors: list) -> threading.Thread:
    """Streaming completions one after another until `stop`; a failure is kept in `errors`."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "stream": True,
            "ignore_eos": True}

    def run() -> None:
        while not stop.is_set():
            try:
                with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
                    if r.status_code != 200:
                        errors.append(f"HTTP {r.status_code}")
                    for _ in r.iter_lines():
                        pass
            except httpx.HTTPError as exc:
                errors.append(exc)
                time.sleep(0.1)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_in_page(driver, pred, timeout_s: float, what: str):
    """Poll the page's workers view until `pred(view)`; fails naming `what` (and the view) at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        view = driver.execute_script(WORKERS_JS)
        if pred(view):
            return view
        assert time.monotonic() < deadline, f"the page did not show {what} within {timeout_s:.0f} s: {view}"
        time.sleep(0.2)


def test_the_page_follows_the_cluster_live(browser, tmp_path):
    with running_cluster(1, 1, loaded=fast_model(), routing="local_prefill_max_tokens = 0") as (base, client, workers):
        slow_steps(workers["decode-0"], 0.01)  # streams stay in flight long enough to be seen
        stop, errors = threading.Event(), []
        senders = [traffic(base, stop, errors) for _ in range(2)]
        try:
            browser.get(base + "/dashboard")
            view = wait_in_page(browser, lambda v: len(v) == 2 and all(w["alive"] and w["node"] == "true" for w in v)
                                and any(w["tokens"] > 0 for w in v), 30, "both workers alive with tokens flowing")
            assert {w["name"] for w in view} == {"prefill-0", "decode-0"}
            shot = os.environ.get(SCREENSHOT_ENV)
            if shot:  # the docs' picture: let the charts draw a few samples first
                deadline = time.monotonic() + 40
                while time.monotonic() < deadline and browser.execute_script(
                        "return samples.length") < 12:
                    time.sleep(0.5)
            assert browser.save_screenshot(str(tmp_path / "dashboard.png"))
            if shot:
                Path(shot).parent.mkdir(parents=True, exist_ok=True)
                assert browser.save_screenshot(shot)
            browser.execute_script("window.loadedOnce = 'yes'")  # gone if the page reloads
            updates = int(browser.find_element("tag name", "body").get_attribute("data-updates"))

            stop.set()  # the traffic ends first: this test is about the page, not about requests cut mid-handoff
            for t in senders:
                t.join(30)
            assert not any(t.is_alive() for t in senders) and not errors, errors
            workers["prefill-0"].stop()
            wait_in_page(browser, lambda v: any(w["name"] == "prefill-0" and not w["alive"] and w["node"] == "false"
                                                for w in v), client.routing.dead_after_s + 10, "the stopped worker dead")
            assert browser.execute_script("return window.loadedOnce") == "yes"  # no reload: the poll updated it
            assert int(browser.find_element("tag name", "body").get_attribute("data-updates")) > updates
            decode = next(w for w in browser.execute_script(WORKERS_JS) if w["name"] == "decode-0")
            assert decode["alive"]
            refused = [e for e in browser.get_log("browser") if "Content Security Policy" in e.get("message", "")]
            assert not refused, refused  # the page's inline script and style run under its own policy
        finally:
            stop.set()
            for t in senders:
                t.join(30)


def test_logging_in_with_the_api_key_in_a_browser(browser):
    """With an API key the browser lands on the login form, a wrong key shows an error, the right one opens the
    page, whose polls then carry the session cookie (a scripted engine stands in for the cluster)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    from router.app import create_app
    from tests.router_fakes import FakeEngine, ServerThread, load_tokenizer

    tokenizer = load_tokenizer()
    app = create_app(FakeEngine(tokenizer), tokenizer, served_model_names=[MODEL], api_key="browser-key")
    with ServerThread(app) as server:
        browser.get(server.url + "/dashboard")
        assert browser.current_url == server.url + "/dashboard/login"
        for key, outcome in (("wrong-key", "login"), ("browser-key", "dashboard")):
            field = browser.find_element(By.ID, "api_key")
            field.clear()
            field.send_keys(key)
            browser.find_element(By.CSS_SELECTOR, "#login button").click()
            if outcome == "login":
                error = WebDriverWait(browser, 10).until(EC.presence_of_element_located((By.ID, "login-error")))
                assert "wrong API key" in error.text
        WebDriverWait(browser, 10).until(EC.url_to_be(server.url + "/dashboard"))
        view = wait_in_page(browser, lambda v: len(v) == 1 and v[0]["alive"], 20, "the engine alive")
        assert view[0]["name"] == "engine"
        assert browser.find_element(By.ID, "live-status").get_attribute("data-state") == "live"


def test_a_worker_groups_ranks_show_under_its_row(browser):
    """A worker that is a tensor-parallel group of two ranks (a scripted cluster stands in): the page lists
    each rank under the worker's row, where it runs and whether the leader hears it, and the topology node
    names the group's shape."""
    from types import SimpleNamespace

    from router.app import create_app
    from tests.router_fakes import FakeEngine, ServerThread, load_tokenizer

    def rank(r: int, host: str, alive: bool) -> dict:
        return {"rank": r, "host": host, "alive": alive, "parameter_bytes": 12_000_000, "kv_bytes": 4_000_000,
                "peak_bytes": 20_000_000, "step_bytes": 0}

    tokenizer = load_tokenizer()
    engine = FakeEngine(tokenizer)
    engine.workers = [SimpleNamespace(spec=SimpleNamespace(name="decode-0", host="10.0.0.1", control_port=5611))]
    engine.worker_stats = lambda: [{"name": "decode-0", "role": "decode", "alive": True, "inflight": 0,
                                    "parallel": "tensor", "ranks": [rank(0, "10.0.0.1", True),
                                                                    rank(1, "10.0.0.2", False)]}]
    app = create_app(engine, tokenizer, served_model_names=[MODEL])
    with ServerThread(app) as server:
        browser.get(server.url + "/dashboard")
        ranks_js = """return Array.from(document.querySelectorAll('tr[data-ranks-of="decode-0"] span[data-rank]'))
            .map(s => [s.dataset.rank, s.dataset.alive, s.textContent]);"""
        deadline = time.monotonic() + 15
        while not browser.execute_script(ranks_js) and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = browser.execute_script(ranks_js)
        assert [(r, alive) for r, alive, _ in ranks] == [("0", "true"), ("1", "false")], ranks
        assert ranks[0][2].startswith("rank 0 10.0.0.1 alive · weights 12.0 MB · KV 4.0 MB")
        assert ranks[1][2].startswith("rank 1 10.0.0.2 lost")
        node = browser.execute_script(
            "return document.querySelector('#topology g[data-node=\"decode-0\"]').textContent")
        assert "decode · alive · tensor ×2" in node


def test_the_ssd_tier_panel_shows_each_workers_tier_or_off(browser):
    """The SSD KV tier panel (a scripted cluster stands in, tests/test_dashboard.py's `scripted_ssd_cluster`): a
    worker with a tier shows its disk used of its budget, blocks, hits, load rate, blocks written, dropped and bad
    files; one whose tier loaded nothing shows a dash for the load rate; one without a tier shows "off"; a dead
    one, dashes."""
    from tests.router_fakes import ServerThread
    from tests.test_dashboard import scripted_ssd_cluster

    with ServerThread(scripted_ssd_cluster()) as server:
        browser.get(server.url + "/dashboard")
        rows_js = """return Object.fromEntries(Array.from(document.querySelectorAll('#ssd-body tr[data-worker]'))
            .map(tr => [tr.dataset.worker, Object.assign({tier: tr.dataset.ssdTier}, Object.fromEntries(
              Array.from(tr.querySelectorAll('td[data-field]')).map(td => [td.dataset.field, td.textContent]))) ]));"""
        deadline = time.monotonic() + 15
        while len(browser.execute_script(rows_js)) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        rows = browser.execute_script(rows_js)
        assert set(rows) == {"prefill-0", "decode-0", "decode-1", "decode-2"}, rows
        tiered = rows["decode-0"]
        assert tiered == {"tier": "on", "name": "decode-0", "ssd-disk": "48 MB / 2.0 GB", "ssd-blocks": "120",
                          "ssd-hits": "40", "ssd-hits-per-s": "0.0", "ssd-load-rate": "2.0 GB/s",
                          "ssd-written": "150", "ssd-written-per-s": "0.0", "ssd-dropped": "3", "ssd-bad": "1"}
        fill = browser.execute_script(
            "return document.querySelector('#ssd-body tr[data-worker=\"decode-0\"] .bar > i').style.width")
        assert fill == "2.4%"  # 48 MB of 2 GB
        assert rows["prefill-0"]["ssd-disk"] == "12 MB / 50 GB" and rows["prefill-0"]["ssd-load-rate"] == "–"
        assert rows["decode-1"] == {"tier": "off", "name": "decode-1", "ssd-tier": "off"}
        dead = rows["decode-2"]
        assert dead["tier"] == "" and all(dead[f] == "–" for f in ("ssd-disk", "ssd-blocks", "ssd-hits", "ssd-bad"))
