"""Phases 4-6 of `mlx-pd bench reliability`: the soak, the injected faults and the overload burst.

Every greedy request that runs to its end is compared with the single-node reference server's answer to the
same request (sent alone, one at a time, cached per request body: `References`). A request that differs is
sent again alone to the cluster once the load is over: equal then means the difference came from batching
(float rounding of a different batch flipping a near-tie of greedy decoding), not from the cluster.
"""

from __future__ import annotations

import asyncio
import signal
import time
import zlib
from typing import Callable, Optional

import httpx

from benchmarks.reliability_client import Reply, send
from benchmarks.reliability_cluster import ReliabilityCluster
from benchmarks.reliability_inputs import SPECULATIVE, SoakItem, long_document, reference_key
from benchmarks.reliability_report import Outcomes

MODEL = "SmolLM2-135M-Instruct"


class References:
    """The reference server's greedy answers, one request at a time, cached by `reference_key`."""

    def __init__(self, url: str, model: str = MODEL):
        self.url, self.model = url, model
        self.replies: dict[str, Reply] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._lock = asyncio.Lock()

    def want(self, client: httpx.AsyncClient, path: str, body: dict) -> str:
        key = reference_key(path, body)
        if key not in self._tasks:
            self._tasks[key] = asyncio.ensure_future(self._get(client, key, path, body))
        return key

    async def _get(self, client, key, path, body) -> None:
        ref = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "speculative")}
        async with self._lock:
            self.replies[key] = await send(client, self.url, path, {**ref, "model": self.model, "stream": False},
                                           timeout_s=900)

    async def wait(self) -> None:
        await asyncio.gather(*self._tasks.values())


def same(reply: Reply, ref: Optional[Reply]) -> bool:
    return ref is not None and ref.outcome == "completed" and reply.text == ref.text and \
        (reply.completion_tokens is None or ref.completion_tokens is None
         or reply.completion_tokens == ref.completion_tokens)


async def _run(c: ReliabilityCluster, client, item: SoakItem, **kw) -> Reply:
    return await send(client, c.router_url, item.path, {**item.body, "model": c.served_name}, c.headers(),
                      disconnect_after=item.disconnect_after, **kw)


async def _check(c: ReliabilityCluster, client, refs: References, done: list[tuple[SoakItem, Reply, str]],
                 tally: Outcomes) -> dict:
    """Compare completed greedy replies with the references; re-run differing ones alone."""
    await refs.wait()
    compared = equal = 0
    diffs = []
    for item, reply, key in done:
        ref = refs.replies.get(key)
        if ref is None or ref.outcome != "completed":
            tally.add(item.kind, "error", f"the reference failed: {ref.describe() if ref else 'none'}")
            continue
        compared += 1
        if same(reply, ref):
            equal += 1
            tally.add(item.kind, "completed")
            continue
        alone = await _run(c, client, item)
        verdict = "mismatch_batch_only" if same(alone, ref) else "mismatch"
        tally.add(item.kind, verdict, f"#{item.index} spec={item.speculative}: got {reply.text[:80]!r}, reference "
                                      f"{ref.text[:80]!r}, alone {alone.text[:80]!r}")
        diffs.append({"index": item.index, "kind": item.kind, "speculative": item.speculative, "verdict": verdict,
                      "got": reply.text, "reference": ref.text, "alone": alone.text})
    return {"compared": compared, "equal": equal, "differences": diffs[:20]}


def speculative_available(c: ReliabilityCluster) -> str:
    """'yes', or why not (the request field is missing from the schema, or the cluster refuses it)."""
    from router.openai.request import ChatCompletionRequest

    if "speculative" not in ChatCompletionRequest.model_fields:
        return "not available: the request schema has no `speculative` field"
    r = httpx.post(c.router_url + "/v1/chat/completions", headers=c.headers(), timeout=300, json={
        "model": c.served_name, "messages": [{"role": "user", "content": "Count from 1 to 10."}], "max_tokens": 8,
        "temperature": 0, "speculative": SPECULATIVE})
    return "yes" if r.status_code == 200 else f"not available: HTTP {r.status_code} {r.text[:200]}"


def _percentiles(values: list[float]) -> dict:
    v = sorted(values)
    return {"p50": v[len(v) // 2], "p95": v[min(len(v) - 1, int(len(v) * 0.95))], "max": v[-1]} if v else {}


async def soak(c: ReliabilityCluster, items: list[SoakItem], concurrency: int, log: Callable[[str], None],
               speculative: str, progress: Optional[dict] = None) -> dict:
    """Send `items` with `concurrency` in flight; every greedy, non-disconnected reply must equal the
    reference; no error, nothing lost. `progress["n"]` counts the answers so far (for a caller's sampler).
    RSS is recorded every 50 answers (every 5 % of them beyond 1,000)."""
    tally = Outcomes()
    done: list = []
    sem = asyncio.Semaphore(concurrency)
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0),
                                 limits=httpx.Limits(max_connections=concurrency + 8)) as client:
        refs = References(c.reference_url, c.served_name)
        progress = progress if progress is not None else {}
        progress["n"] = 0
        every = max(50, len(items) // 20)
        elapsed: dict[str, list[float]] = {}
        rss_series: list = []

        async def one(item: SoakItem) -> None:
            async with sem:
                reply = await _run(c, client, item)
            progress["n"] += 1
            elapsed.setdefault(item.kind, []).append(reply.elapsed_s)
            if progress["n"] % every == 0 or progress["n"] == len(items):
                rss_series.append([progress["n"], {k: round(v) for k, v in c.rss().items()}])
                log(f"  soak: {progress['n']}/{len(items)} after {time.monotonic() - t0:.0f} s; RSS MiB "
                    f"{rss_series[-1][1]}")
            if item.compare and reply.outcome == "completed":
                done.append((item, reply, refs.want(client, item.path, item.body)))
            elif item.disconnect_after is not None and reply.outcome in ("disconnected", "completed"):
                tally.add(item.kind, "disconnected" if reply.outcome == "disconnected" else "completed")
            else:
                tally.add(item.kind, reply.outcome if reply.outcome != "completed" else "completed",
                          None if reply.outcome == "completed" else f"#{item.index}: {reply.describe()}")

        await asyncio.gather(*(one(i) for i in items))
        duration = time.monotonic() - t0
        log(f"  soak: all {len(items)} answered in {duration:.0f} s; comparing with the reference")
        checked = await _check(c, client, refs, done, tally)
    result = tally.as_dict()
    stats = [c.probe(w["name"]) or {} for w in c.workers if w["role"] == "decode"]
    result["draft_tokens"] = {"drafted": sum(s.get("num_draft_tokens") or 0 for s in stats),
                             "accepted": sum(s.get("num_accepted_tokens") or 0 for s in stats)}
    result.update(checked, concurrency=concurrency, duration_s=duration, speculative=speculative,
                  speculative_requests=sum(1 for i in items if i.speculative), references=len(refs.replies),
                  latency_s={k: _percentiles(v) for k, v in sorted(elapsed.items())}, rss_series=rss_series)
    result["totals"]["mismatch"] = result["totals"].get("mismatch", 0)
    return result


# -- 5. faults -----------------------------------------------------------------------------------------------

def _fault_items(n_short: int, n_long: int, max_tokens: int, tag: str) -> list[SoakItem]:
    from benchmarks.loadgen import load_prompts

    qs = load_prompts()[40:]
    items = [SoakItem(i, "chat", "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": qs[i % len(qs)]}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}, True)
             for i in range(n_short)]
    items += [SoakItem(n_short + j, "long", "/v1/completions",
                       {"prompt": long_document(1000 + j + zlib.crc32(tag.encode()) % 997, 700) + "\nSummary:", "max_tokens": 24,
                        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}, True)
              for j in range(n_long)]
    return items


async def _fault_run(c: ReliabilityCluster, items: list[SoakItem], inject) -> tuple[Outcomes, dict, float]:
    """Run `items` at once while `inject(started)` (a coroutine) injects the fault; tally the outcomes."""
    tally, info = Outcomes(), {}
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=30.0)) as client:
        refs = References(c.reference_url, c.served_name)
        tasks = [asyncio.ensure_future(_run(c, client, it, timeout_s=900)) for it in items]
        info.update(await inject(tasks) or {})
        replies = await asyncio.gather(*tasks)
        done = []
        for it, r in zip(items, replies):
            if r.outcome == "completed":
                done.append((it, r, refs.want(client, it.path, it.body)))
            else:
                tally.add(it.kind, r.outcome, f"#{it.index}: {r.describe()}")
        checked = await _check(c, client, refs, done, tally)
        info.update(compared=checked["compared"], equal=checked["equal"])
    return tally, info, time.monotonic() - t0


def _summary(tally: Outcomes, info: dict) -> str:
    t = tally.as_dict()["totals"]
    return (", ".join(f"{k} {v}" for k, v in t.items() if v or k in ("completed", "lost"))
            + f"; completed output equal to the reference {info.get('equal', 0)}/{info.get('compared', 0)}")


async def fault_kill(c: ReliabilityCluster, log, n_streams: int = 8) -> dict:
    """SIGKILL the busier decode worker mid-stream; each stream must finish (migrated) or end with an error;
    then restart it and check the router uses it again."""
    items = _fault_items(n_streams - 2, 2, 64, "kill")
    killed = {}

    async def inject(tasks):
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            stats = {w: c.probe(w) or {} for w in ("decode-0", "decode-1")}
            running = {w: s.get("num_running", 0) for w, s in stats.items()}
            if sum(running.values()) >= 3:
                break
            await asyncio.sleep(0.3)
        await asyncio.sleep(1.0)  # let them stream a few tokens
        victim = max(running, key=running.get)
        in_flight = sum(not t.done() for t in tasks)
        c.kill(victim, signal.SIGKILL)
        killed.update(victim=victim, running_on_victim=running[victim], in_flight=in_flight)
        log(f"  killed {victim} (-9) with {running[victim]} sequences running on it, {in_flight} requests in flight")
        return dict(killed)

    tally, info, duration = await _fault_run(c, items, inject)
    victim = killed["victim"]
    restart_s = c.restart(victim)
    log(f"  restarted {victim}: answers pings after {restart_s:.0f} s")
    before = (c.probe(victim) or {}).get("tokens_out", 0)
    recovered, waited = False, 0.0
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        while not recovered and time.monotonic() - t0 < 120:
            batch = [SoakItem(i, "chat", "/v1/chat/completions", {
                "messages": [{"role": "user", "content": f"Recovery check {i}: name a color."}], "max_tokens": 8,
                "temperature": 0}, False) for i in range(8)]
            await asyncio.gather(*(_run(c, client, it) for it in batch))
            recovered = (c.probe(victim) or {}).get("tokens_out", 0) > before
            waited = time.monotonic() - t0
    log(f"  {victim} serves again: {recovered} (after {waited:.0f} s of requests)")
    t = tally.as_dict()
    return {"inputs": f"{len(items)} greedy streams (6 chats, 2 long prompts) of 64/24 tokens",
            "injected": f"kill -9 {victim} with {killed['running_on_victim']} sequences on it", "load":
            f"{len(items)} requests at once, {duration:.0f} s", "lost": t["totals"].get("lost", 0),
            "outcome": _summary(tally, info) + f"; restarted in {restart_s:.0f} s, serves again: "
                                               f"{'yes' if recovered else 'NO'}",
            "recovered": recovered, "recovery": f"tokens_out of the restarted worker grew: {recovered}",
            "restart_s": restart_s, **killed, **t, **info}


async def fault_stall(c: ReliabilityCluster, log, stall_s: float, n_long: int = 3, n_short: int = 3) -> dict:
    """SIGSTOP the prefill worker for `stall_s` while long prompts are being prefilled, then SIGCONT."""
    items = _fault_items(n_short, n_long, 24, f"stall-{stall_s}")

    async def inject(tasks):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (c.probe("prefill-0") or {}).get("num_running"):
            await asyncio.sleep(0.2)
        c.kill("prefill-0", signal.SIGSTOP)
        in_flight = sum(not t.done() for t in tasks)
        log(f"  SIGSTOP prefill-0 for {stall_s:.0f} s with {in_flight} requests in flight")
        await asyncio.sleep(stall_s)
        c.kill("prefill-0", signal.SIGCONT)
        return {"in_flight": in_flight}

    tally, info, duration = await _fault_run(c, items, inject)
    alive = c.probe("prefill-0") is not None
    before = (c.probe("prefill-0") or {}).get("kv_blocks_sent", 0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:  # does the router use it again?
        t0, used = time.monotonic(), False
        while not used and time.monotonic() - t0 < 90:
            await _run(c, client, SoakItem(0, "long", "/v1/completions", {
                "prompt": long_document(5000 + int(time.monotonic()), 300) + "\nSummary:", "max_tokens": 4,
                "temperature": 0}, False))
            used = (c.probe("prefill-0") or {}).get("kv_blocks_sent", 0) > before
    t = tally.as_dict()
    return {"inputs": f"{n_long} long prompts (~900 tokens) + {n_short} chats, streamed",
            "injected": f"SIGSTOP prefill-0 for {stall_s:.0f} s, then SIGCONT",
            "load": f"{len(items)} requests at once, {duration:.0f} s", "lost": t["totals"].get("lost", 0),
            "outcome": _summary(tally, info) + f"; prefill-0 used again afterwards: {'yes' if used else 'NO'}",
            "recovered": alive and used, "recovery": f"answers pings {alive}, ships KV again {used}",
            "stall_s": stall_s, **info, **t}


def lost_messages_note() -> dict:
    return {"inputs": "-", "injected": "not injected on the live cluster (see the reading)", "load": "-",
            "lost": None, "outcome": "covered by library tests: tests/test_kv_transfer.py::"
            "test_lost_done_message_times_out_both_sides, test_receiver_dying_after_reservation_times_out_the_"
            "sender, test_sender_vanishing_mid_transfer_frees_the_receivers_blocks"}


# -- 6. overload ---------------------------------------------------------------------------------------------

async def overload(c: ReliabilityCluster, burst: int, log) -> dict:
    """`burst` short requests at once, far beyond the decode workers' running + waiting bounds: each must
    complete or get 503 with Retry-After; RSS is sampled throughout."""
    engine = c.engine
    capacity = 2 * (engine["max_num_seqs"] + engine["max_waiting"])
    tally, peak, retry = Outcomes(), {}, {"with": 0, "without": 0}
    before = c.rss()
    stop = asyncio.Event()

    async def sample():
        while not stop.is_set():
            for name, mib in c.rss().items():
                peak[name] = max(peak.get(name, 0.0), mib)
            await asyncio.sleep(0.5)

    t0 = time.monotonic()
    sampler = asyncio.ensure_future(sample())
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=60.0),
                                 limits=httpx.Limits(max_connections=burst + 8)) as client:
        bodies = [{"model": c.served_name, "prompt": f"Overload {i}: write one sentence about the sea.",
                   "max_tokens": 16, "ignore_eos": True, "temperature": 0} for i in range(burst)]
        replies = await asyncio.gather(*(send(client, c.router_url, "/v1/completions", b, c.headers(),
                                              timeout_s=900) for b in bodies))
    stop.set()
    await sampler
    for r in replies:
        if r.status == 503:
            retry["with" if r.retry_after else "without"] += 1
        tally.add("burst", r.outcome, None if r.outcome in ("completed", "refused") else r.describe())
    t = tally.as_dict()
    log(f"  overload: {t['totals']}; 503 with Retry-After {retry['with']}, without {retry['without']}")
    return {"sent": burst, "capacity": capacity, "duration_s": time.monotonic() - t0, **t,
            "refused_with_retry_after": retry["with"], "refused_without_retry_after": retry["without"],
            "retry_after_values": sorted({r.retry_after for r in replies if r.retry_after}),
            "rss_before_mib": sum(before.values()), "peak_rss_mib": sum(peak.values()), "peak_rss_by_process": peak}

