"""The rows of the lab's fault table (run by benchmarks/lab/faults.py): what each fault does and what is checked.

Each row function takes the `Run` (the lab, its client, the router's view) and a `Row` to fill: checks (each
must hold for the row to pass) and what happened, in words, from what the client and the router saw. Times are
on the client's clock. A cable is pulled with `Lab.link` (the host's bridge port down: nothing is reset); a
process is killed by its pid (the one listening on the port, `ss`; a Ray node by the process group of its `ray
start --block`, as the lab recorded it), never with `ray stop`, which would stop every Ray on the machine.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional, Sequence

from benchmarks.lab import net, ray_hosts
from benchmarks.lab.fault_client import Client, Watch, complete, wait_until
from benchmarks.lab.fault_probes import listener_pid, router_log_count, states
from benchmarks.lab.lab import Lab
from benchmarks.lab.net import LabError
from benchmarks.lab.topology import PREFILL_PORTS, ROUTER_PORT

DEAD_AFTER_S, HEARTBEAT_S, BLIP_S = 3.0, 0.5, 1.5
MAX_CUT_S = 12.0  # a cable is plugged back by then: Ray's GCS declares a node dead after 5 failed checks 3 s apart
STREAMS, SHORT, PROMPT_REPEATS = 4, 32, 300  # 300 x 12 tokens: a ~3,600-token prompt for row f
ROW_ORDER = "abcfedg"


def secs(t: Optional[float], since: float = 0.0) -> str:
    """`t - since` as "1.2 s", or "never" for a time that did not come."""
    return "never" if t is None else f"{t - since:.1f} s"


def mini_of(worker: str) -> str:
    """The lab host of a decode worker: decode-N runs on mini-(N+1)."""
    return f"mini-{int(worker.rsplit('-', 1)[1]) + 1}"


@dataclass
class Run:
    """The lab, its client and the router's view, shared by the rows; `cut`: the mini b leaves unplugged."""

    lab: Lab
    client: Client
    watch: Watch
    tokens: int
    cut: Optional[dict] = None
    n: int = 0


@dataclass
class Row:
    """One row's checks and what happened."""

    key: str
    checks: list = field(default_factory=list)
    happened: list = field(default_factory=list)
    data: dict = field(default_factory=dict)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        """Record a check (`detail`: what was seen); returns `ok`."""
        self.checks.append({"check": name, "ok": bool(ok), "detail": detail})
        return bool(ok)

    def result(self) -> dict:
        """{"row", "happened" (one line), "verdict" ("pass" when every check held), "checks", "data"}."""
        ok = bool(self.checks) and all(c["ok"] for c in self.checks)
        return {"row": self.key, "happened": "; ".join(self.happened), "verdict": "pass" if ok else "FAIL",
                "checks": self.checks, "data": self.data}


# -- helpers -------------------------------------------------------------------------------------------------

def send(run: Run, tag: str, max_tokens: int, k: int = 1, stream: bool = True, long: bool = False) -> list:
    """`k` requests with prompts of their own; [(record, future)]."""
    out = []
    for _ in range(k):
        run.n += 1
        text = (f"Document {tag}-{run.n}. " + "The lab has a studio and a mini on one bridge. " * PROMPT_REPEATS
                if long else f"Story {tag}-{run.n}: once upon a time, in a lab of small computers,")
        out.append(run.client.send(tag, text, max_tokens, stream))
    return out


def finish(pending: list, timeout_s: float) -> list[dict]:
    """Wait for every request (at most `timeout_s` in all); one still open is recorded as hung."""
    deadline = time.monotonic() + timeout_s
    for rec, fut in pending:
        try:
            fut.result(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - a timeout here is a hang; the record says what was seen
            rec["exception"] = rec["exception"] or f"no end within {timeout_s:.0f} s (hang)"
    return [rec for rec, _ in pending]


def decoding(pending: list, chunks: int = 5, timeout_s: float = 60.0) -> bool:
    """Wait until every stream has `chunks` chunks of text (or ended); False at the deadline."""
    return wait_until(lambda: all(r["chunks"] >= chunks or r["end_s"] is not None for r, _ in pending), timeout_s)


def busiest_decode(run: Run) -> tuple[str, int]:
    """(the live decode worker with the most requests in flight now, how many)."""
    state = run.client.state() or {}
    rows = [w for w in state.get("workers", []) if w["role"] == "decode" and w["alive"]]
    best = max(rows, key=lambda w: (w["inflight"] or 0, w["name"] == "decode-0"))
    return best["name"], best["inflight"] or 0


def wait_alive(run: Run, names: Sequence[str], alive: bool, since: float, timeout_s: float) -> Optional[float]:
    """Wait until the router's view of every worker of `names` is `alive`; the client time it became so (the
    last of them to change at or after `since`; `since` if none had to), or None at the deadline."""
    if not wait_until(lambda: all(run.watch.alive.get(n) is alive for n in names), timeout_s, 0.05):
        return None
    return max([since] + [t for t in (run.watch.went(n, alive, since) for n in names) if t is not None])


def outcome(recs: list[dict]) -> str:
    """One line over requests: how many completed, and what the others got."""
    done = sum(complete(r) for r in recs)
    text = f"{done}/{len(recs)} complete ({recs[0]['max_tokens']} tokens each, no error event)" if recs else "none"
    others = [r for r in recs if not complete(r)]
    for r in others:
        what = (r["exception"] or (f"{r['status']} Retry-After {r['retry_after']}" if r["status"] != 200 else
                f"SSE error event after {r['chunks']} chunks" if r["errors"] else
                f"200 with {r['tokens']} tokens, finish {r['finish']}"))
        text += f"; one: {what}"
    return text


def gone(run: Run) -> list[str]:
    """The decode workers whose mini's Ray node was killed (row d): they never come back."""
    lab = run.lab
    return [n for n in run.watch.alive if n.startswith("decode-") and not ray_hosts.is_ours(
        lab.state.ray_pids.get(mini_of(n), 0), lab.root, mini_of(n))]


def settle(run: Run) -> None:
    """Every cable plugged back, every worker alive in the router's view (but those `gone`), nothing in flight
    (LabError if not)."""
    lab = run.lab
    for row in lab.status():
        if row["link"] == "down":
            lab.link(row["host"], True)
    run.cut = None
    if wait_alive(run, [n for n in run.watch.alive if n not in gone(run)], True, run.client.now(), 60.0) is None:
        raise LabError(f"workers not alive after the cables were plugged back: {run.watch.alive}")
    if not wait_until(lambda: (run.client.state() or {}).get("requests_inflight") == 0, 60.0, 0.5):
        raise LabError("requests still in flight on the router a minute after the last row")


# -- the rows --------------------------------------------------------------------------------------------------

def row_a(run: Run, row: Row) -> None:
    """Row a: a mini's cable out for BLIP_S while streams decode on it: they complete, the worker stays alive."""
    pending = send(run, "a", run.tokens, STREAMS)
    row.check("the streams were decoding when the cable was pulled", decoding(pending))
    target, on = busiest_decode(run)
    host, t_cut = mini_of(target), run.client.now()
    running = sum(r["end_s"] is None for r, _ in pending)
    run.lab.link(host, False)
    time.sleep(BLIP_S)
    run.lab.link(host, True)
    recs = finish(pending, 180.0)
    time.sleep(2 * HEARTBEAT_S)
    dead_at = run.watch.went(target, False, t_cut)
    row.check("every stream complete", all(complete(r) for r in recs), outcome(recs))
    view = "alive throughout" if dead_at is None else f"dead {secs(dead_at, t_cut)} after the cut"
    row.check(f"{target} alive throughout in the router's view", dead_at is None, view)
    row.happened += [f"{host}'s cable ({target}, {on} of {STREAMS} streams; {running} running) out {BLIP_S:g} s",
                     outcome(recs), f"longest pause between chunks {max(r['max_gap_s'] for r in recs):.2f} s",
                     f"the router's view of {target}: {view}"]


def row_b(run: Run, row: Row) -> None:
    """Row b: every mini's cable out (clear errors, no hang), then one mini's past the deadline (its streams move)."""
    lab, minis = run.lab, [h.name for h in run.lab.minis]
    decodes = [n for n in run.watch.alive if n.startswith("decode-")]
    pending = send(run, "b-all", run.tokens, 2)
    row.check("the streams were decoding when every cable was pulled", decoding(pending))
    t_cut = run.client.now()
    for m in minis:
        lab.link(m, False)
    during = send(run, "b-during", SHORT) + send(run, "b-during", SHORT, stream=False)
    t_dead = wait_alive(run, decodes, False, t_cut, DEAD_AFTER_S + 10.0)
    after = send(run, "b-after", SHORT) + send(run, "b-after", SHORT, stream=False)
    bound = 2 * DEAD_AFTER_S + 20.0
    recs = finish(pending + during + after, bound)
    t_end = run.client.now()
    for m in minis:
        lab.link(m, True)
    t_back = wait_alive(run, decodes, True, t_end, 30.0)
    row.check("every decode worker marked dead", t_dead is not None)
    row.check(f"every request ended within {bound:.0f} s", all(r["exception"] is None for r in recs),
              outcome(recs))
    started = [r for r, _ in pending]
    row.check("each stream cut mid-answer ended with an SSE error event",
              all(r["status"] == 200 and r["errors"] and not complete(r) for r in started))
    fresh = [r for r, _ in during + after]
    row.check("each request without an answer yet got 503 + Retry-After",
              all(r["status"] == 503 and r["retry_after"] for r in fresh))
    row.happened += [f"every mini out {t_end - t_cut:.1f} s: all decode workers dead in the router's view "
                     f"{secs(t_dead, t_cut)} after the cut; 2 streams mid-answer: "
                     + ", ".join(f"SSE error event ({r['errors'][0]['code']}) after {r['chunks']} chunks"
                                 if r["errors"] else outcome([r]) for r in started)
                     + "; 4 new requests (2 sent at the cut, 2 once all were dead): "
                     + ", ".join(f"{r['status']} Retry-After {r['retry_after']} in {r['end_s'] - r['sent_at']:.1f} s"
                                 for r in fresh)
                     + f"; alive again {secs(t_back, t_end)} after the plug"]
    settle(run)
    # one mini out past the deadline: its streams move to the other
    pending = send(run, "b", run.tokens, STREAMS)
    row.check("the streams were decoding when one cable was pulled", decoding(pending))
    target, on = busiest_decode(run)
    host, other = mini_of(target), next(n for n in decodes if n != target)
    before = run.watch.tokens_out.get(other, 0)
    t_cut = run.client.now()
    lab.link(host, False)
    run.cut = {"host": host, "worker": target, "at": t_cut, "plugged": None}
    t_dead = wait_alive(run, [target], False, t_cut, DEAD_AFTER_S + 10.0)
    ended = wait_until(lambda: all(r["end_s"] is not None for r, _ in pending), MAX_CUT_S - (run.client.now() - t_cut))
    if not ended:  # Ray would declare the node dead soon: the partition heals now (row c measures from here)
        lab.link(host, True)
        run.cut["plugged"] = run.client.now()
    recs = finish(pending, 180.0)
    time.sleep(3 * HEARTBEAT_S)
    grew = run.watch.tokens_out.get(other, 0) - before
    row.check(f"{target} marked dead within {DEAD_AFTER_S:g} s + 2 s", t_dead is not None
              and t_dead - t_cut <= DEAD_AFTER_S + 2.0, secs(t_dead, t_cut))
    row.check("every stream complete", all(complete(r) for r in recs), outcome(recs))
    row.check(f"{other} decoded the rest", grew > 0 and run.watch.alive.get(other) is True, f"+{grew} tokens")
    row.happened += [f"{host}'s cable ({target}, {on} of {STREAMS} streams) out: {target} dead in the router's view "
                     f"{secs(t_dead, t_cut)} after the cut; " + outcome(recs)
                     + f", {other} sent {grew} more tokens; the last ended "
                     f"{secs(max(r['end_s'] for r in recs), t_cut)} after the cut"]


def row_c(run: Run, row: Row) -> None:
    """Row c: the cable b left out plugged back (or a partition made here): the worker is alive and used again."""
    lab = run.lab
    if run.cut is None:  # c alone: make the partition first
        target = "decode-0"
        t_cut = run.client.now()
        lab.link(mini_of(target), False)
        run.cut = {"host": mini_of(target), "worker": target, "at": t_cut, "plugged": None}
        row.check(f"{target} marked dead", wait_alive(run, [target], False, t_cut, DEAD_AFTER_S + 10.0) is not None)
    cut = run.cut
    if cut["plugged"] is None:
        lab.link(cut["host"], True)
        cut["plugged"] = run.client.now()
    target = cut["worker"]
    t_alive = wait_alive(run, [target], True, cut["plugged"], 30.0)
    row.check(f"{target} alive again in the router's view", t_alive is not None)
    status = states(run.lab)
    row.check("`mlx-pd status` shows it alive", status.get(target) == "alive", json.dumps(status))
    run.watch.reset_peaks()
    before = run.watch.tokens_out.get(target, 0)
    recs = finish(send(run, "c", 64, 2 * STREAMS), 180.0)
    time.sleep(3 * HEARTBEAT_S)
    grew, peak = run.watch.tokens_out.get(target, 0) - before, run.watch.peak_inflight.get(target, 0)
    row.check("every request complete", all(complete(r) for r in recs), outcome(recs))
    row.check(f"{target} used again", grew > 0, f"+{grew} tokens, up to {peak} in flight")
    row.happened += [f"{cut['host']}'s cable back {cut['plugged'] - cut['at']:.1f} s after the cut: {target} alive "
                     f"again in the router's view {secs(t_alive, cut['plugged'])} later; "
                     f"`mlx-pd status`: {status.get(target)}",
                     f"{len(recs)} new streams: " + outcome(recs) + f"; {target} ran up to {peak} of them "
                     f"(+{grew} tokens)"]
    run.cut = None


def row_d(run: Run, row: Row) -> None:
    """Row d: a mini's Ray node killed under streams: they move; `mlx-pd status` shows its worker not alive."""
    lab = run.lab
    pending = send(run, "d", run.tokens, STREAMS)
    row.check("the streams were decoding when the node was killed", decoding(pending))
    target, on = busiest_decode(run)
    host = mini_of(target)
    pgid = lab.state.ray_pids[host]
    if not ray_hosts.is_ours(pgid, lab.root, host):
        raise LabError(f"Ray on {host} (pid {pgid}) is not running")
    seen: list = []  # (s after the kill, `mlx-pd status` state of the target), polled while the streams run

    def poll_status() -> bool:
        deadline = time.monotonic() + 120.0
        while time.monotonic() < deadline:
            state = states(run.lab).get(target, "?")
            if not seen or seen[-1][1] != state:
                seen.append((round(run.client.now() - t_kill, 1), state))
            if state in ("restarting", "dead", "absent"):  # Ray's own verdict, past "unhealthy"
                break
            time.sleep(1.0)
        return any(state not in ("alive", "?") for _, state in seen)

    t_kill = run.client.now()
    os.killpg(pgid, signal.SIGKILL)
    with ThreadPoolExecutor(1) as pool:
        status_shown = pool.submit(poll_status)
        t_dead = wait_alive(run, [target], False, t_kill, DEAD_AFTER_S + 10.0)
        recs = finish(pending, 180.0)
        left = net.pids_in(lab.state.host(host).ns)
        shown = status_shown.result(timeout=300)
    row.check(f"{target} dead in the router's view", t_dead is not None)
    row.check("every stream complete", all(complete(r) for r in recs), outcome(recs))
    row.check("`mlx-pd status` shows it not alive", shown, json.dumps(seen))
    row.data.update(status_seen=seen, processes_left=left)
    row.happened += [f"Ray on {host} ({target}, {on} of {STREAMS} streams) killed: {target} dead in the router's "
                     f"view {secs(t_dead, t_kill)} later; " + outcome(recs),
                     f"`mlx-pd status` of {target} after the kill: "
                     + " -> ".join(f"{state} at {t:.0f} s" for t, state in seen),
                     f"{len(left)} processes left in {host}"]


def row_e(run: Run, row: Row, tag: str = "e") -> None:
    """Row e: the router's process killed: Ray restarts it; it serves and every worker (but those `gone`) is alive."""
    lab, away = run.lab, gone(run)  # row g: the router restarted while a mini's node is gone (after row d)
    pid = listener_pid(lab, "studio", ROUTER_PORT)
    t_kill = run.client.now()
    os.kill(pid, signal.SIGKILL)
    down = wait_until(lambda: run.client.get_json("/health", 2.0)[0] != 200, 10.0, 0.05)
    ok = down and wait_until(lambda: run.client.get_json("/health", 2.0)[0] == 200, 240.0, 0.25)
    t_health = run.client.now()

    def every_worker_alive() -> bool:  # asked now: the watch saw nothing while the router was away
        workers = (run.client.state() or {}).get("workers") or [{"name": "?", "alive": False}]
        return all(w["alive"] is (w["name"] not in away) for w in workers)

    t_alive = run.client.now() if ok and wait_until(every_worker_alive, 60.0, 0.1) else None
    new = listener_pid(lab, "studio", ROUTER_PORT) if ok else None
    recs = finish(send(run, tag, SHORT, STREAMS) + send(run, tag, SHORT, stream=False), 120.0)
    status = states(run.lab)
    which = f"every worker but {', '.join(away)}" if away else "every worker"
    row.check("the router answers /health again", ok and new != pid, f"pid {pid} -> {new}")
    row.check(f"{which} alive in its view", t_alive is not None)
    row.check("requests succeed", all(complete(r) for r in recs), outcome(recs))
    row.happened += [f"router (pid {pid}) killed{' while ' + ', '.join(away) + ' is gone' if away else ''}: "
                     f"/health 200 again after {secs(t_health if ok else None, t_kill)} (pid {new}), {which} "
                     f"alive in its view after {secs(t_alive, t_kill)}", f"{len(recs)} requests: " + outcome(recs),
                     f"`mlx-pd status` router: {status.get('router')}"]


def row_g(run: Run, row: Row) -> None:
    """Row g: row e while row d's mini is gone: the restarted router serves with the workers left."""
    if not gone(run):
        raise LabError("row g follows row d: no mini's Ray node is gone")
    row_e(run, row, "g")


def row_f(run: Run, row: Row) -> None:
    """Row f: prefill-0 killed while it prefills long prompts: they are re-run on their decode workers, complete."""
    lab, needle = run.lab, " on its decode worker "  # the router's log line of a re-run
    before_out = run.watch.tokens_out.get("prefill-0", 0)
    [base] = finish(send(run, "f-base", SHORT, long=True), 240.0)
    time.sleep(3 * HEARTBEAT_S)
    row.check("without the fault, the long prompt is prefilled by prefill-0", complete(base)
              and run.watch.tokens_out.get("prefill-0", 0) > before_out, outcome([base]))
    pid = listener_pid(lab, "studio", PREFILL_PORTS["control_port"])
    logged = router_log_count(lab, needle)
    pending = send(run, "f", SHORT, 2, long=True)

    def prefilling() -> bool:  # placed there, no first token yet, and prefill-0's last report shows it running
        state = run.client.state() or {}
        running = any(w["name"] == "prefill-0" and (w["running"] or 0) > 0 for w in state.get("workers", []))
        return running and any(r["phase"] == "prefill" and "prefill-0" in r["workers"] for r in state["requests"])

    if not row.check("a request was seen running on prefill-0", wait_until(prefilling, 60.0, 0.02)):
        finish(pending, 240.0)
        return
    t_kill = run.client.now()
    os.kill(pid, signal.SIGKILL)
    recs = finish(pending, 240.0)
    reran = router_log_count(lab, needle) - logged
    after = [r for r in recs if r["first_at"] is not None and r["first_at"] > t_kill]
    t_back = wait_alive(run, ["prefill-0"], True, t_kill, 120.0)
    row.check("every request complete", all(complete(r) for r in recs), outcome(recs))
    row.check("a request had no first token when the prefill worker died", bool(after),
              f"{len(after)} of {len(recs)}; router log: {reran} re-run on the decode worker")
    row.data.update(ttft_base_s=base["ttft_s"], ttft_s=[r["ttft_s"] for r in recs], reruns_logged=reran)
    row.happened += [f"prefill-0 (pid {pid}) killed {t_kill - recs[0]['sent_at']:.2f} s after 2 ~3,600-token "
                     f"prompts were sent; {len(after)} had no first token yet; router log: {reran} re-run on the "
                     "decode worker", outcome(recs) + "; TTFT " + ", ".join(secs(r["ttft_s"]) for r in recs) +
                     f" against {secs(base['ttft_s'])} without the fault",
                     f"prefill-0 restarted by Ray, alive again {secs(t_back, t_kill)} after the kill"]


ROWS = {"a": row_a, "b": row_b, "c": row_c, "d": row_d, "e": row_e, "f": row_f, "g": row_g}
