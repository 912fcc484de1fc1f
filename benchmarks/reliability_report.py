"""Accounting and the Markdown report of `mlx-pd bench reliability` (pure: no network, no processes).

    tally = Outcomes(); tally.add("chat", "completed"); tally.total("completed")
    failures(result)                      what breaks an acceptance rule (empty list: every rule held)
    render_markdown(result)               the tables that docs/RELIABILITY.md holds between the markers
    replace_generated(doc, block)         doc with the text between BEGIN/END markers replaced by block

Outcomes of one request (the soak, the faults, the overload burst):
    completed     finished normally (stop or length), output checked where a reference exists
    disconnected  the client closed the stream on purpose (soak: a deliberate fault)
    error         a clear error: an HTTP 4xx/5xx status or an SSE error event, with a message
    refused       503 with Retry-After (overload)
    lost          none of these: the stream ended without a finish or an error, or never ended (timeout)
A lost request is always a failure. An error is a failure unless a fault was injected on purpose.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable, Optional

BEGIN = "<!-- BEGIN GENERATED: mlx-pd bench reliability -->"
END = "<!-- END GENERATED: mlx-pd bench reliability -->"
OUTCOMES = ("completed", "disconnected", "error", "refused", "lost")


class Outcomes:
    """Counts of outcomes per kind of request, plus a few examples of each non-completed outcome."""

    def __init__(self) -> None:
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.examples: dict[str, list] = defaultdict(list)

    def add(self, kind: str, outcome: str, example: Optional[str] = None, keep: int = 5) -> None:
        if outcome not in OUTCOMES and not outcome.startswith("mismatch"):
            raise ValueError(f"unknown outcome {outcome!r}: one of {', '.join(OUTCOMES)} or mismatch*")
        self.counts[kind][outcome] += 1
        if example is not None and len(self.examples[outcome]) < keep:
            self.examples[outcome].append(f"{kind}: {example}"[:300])

    def total(self, outcome: Optional[str] = None) -> int:
        return sum(c[outcome] if outcome else sum(c.values()) for c in self.counts.values())

    def as_dict(self) -> dict:
        return {"by_kind": {k: dict(c) for k, c in sorted(self.counts.items())},
                "totals": {o: self.total(o) for o in self._outcomes()}, "sent": self.total(),
                "examples": {k: v for k, v in self.examples.items()}}

    def _outcomes(self) -> list[str]:
        seen = {o for c in self.counts.values() for o in c}
        return [o for o in OUTCOMES if o in seen or o in ("completed", "lost")] + sorted(seen - set(OUTCOMES))


def _get(d: dict, *path, default=0):
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return default
        d = d[key]
    return d


def failures(result: dict) -> list[str]:
    """Every acceptance rule of the reliability run that `result` breaks, in words (empty: all held). Phases that did
    not run are not failures (the report says they were skipped)."""
    out: list[str] = []
    p = result.get("phases", {})
    for name, phase in [*p.items(), *p.get("faults", {}).items()]:
        if isinstance(phase, dict) and phase.get("harness_error"):
            out.append(f"{name}: the harness failed: {phase['harness_error']}")
    if any(isinstance(v, dict) and v.get("harness_error") for v in p.values()):
        p = {k: v for k, v in p.items() if not (isinstance(v, dict) and v.get("harness_error"))}
    if "api_fuzz" in p:
        a = p["api_fuzz"]
        if a.get("server_errors"):
            out.append(f"API fuzz: {a['server_errors']} answers were 5xx")
        if a.get("violations"):
            out.append(f"API fuzz: {a['violations']} answers broke the published schema")
        if not a.get("healthy_after"):
            out.append("API fuzz: /health was not 200 afterwards")
    if "access" in p:
        a = p["access"]
        if _get(a, "http", "unauthorized_expected") != _get(a, "http", "unauthorized_got"):
            out.append("access: a request without the right API key was not answered 401")
        if _get(a, "curve", "answered"):
            out.append(f"access: {a['curve']['answered']} probes without the CurveZMQ keys got an answer")
        if a.get("non_loopback"):
            out.append(f"access: listening beyond 127.0.0.1: {', '.join(a['non_loopback'])}")
        if a.get("key_secrets_private") is False:
            out.append(f"access: CurveZMQ secret key files readable by others ({a.get('key_file_modes')})")
        if a.get("secrets_found"):
            out.append(f"access: secrets found in {', '.join(a['secrets_found'])}")
    if "wire_fuzz" in p:
        w = p["wire_fuzz"]
        if w.get("unexpected_answers"):
            out.append(f"wire fuzz: {w['unexpected_answers']} garbage messages were answered unexpectedly")
        if w.get("missing_answers"):
            out.append(f"wire fuzz: {w['missing_answers']} messages that must be refused got no answer")
        if not w.get("workers_alive_after", True) or not w.get("served_after", True):
            out.append("wire fuzz: a worker stopped serving")
    if "soak" in p:
        s = p["soak"]
        for key, what in (("lost", "lost"), ("error", "ended in an error"), ("mismatch", "differed from the reference")):
            n = _get(s, "totals", key)
            if n:
                out.append(f"soak: {n} requests {what}")
    if "faults" in p:
        for name, f in p["faults"].items():
            if isinstance(f, dict) and f.get("lost"):
                out.append(f"fault {name}: {f['lost']} requests lost")
            if isinstance(f, dict) and f.get("recovered") is False:
                out.append(f"fault {name}: the cluster did not recover ({f.get('recovery', '')})")
    if "overload" in p:
        o = p["overload"]
        if _get(o, "totals", "lost") or _get(o, "totals", "error"):
            out.append(f"overload: {_get(o, 'totals', 'lost')} lost, {_get(o, 'totals', 'error')} errors other "
                       "than 503")
        if o.get("refused_without_retry_after"):
            out.append(f"overload: {o['refused_without_retry_after']} 503s without Retry-After")
    if "baseline" in p:
        b = p["baseline"]
        for name in b.get("not_at_baseline", []):
            out.append(f"baseline: {name} did not return to baseline ({b['workers'].get(name)})")
    return out


def warnings(result: dict) -> list[str]:
    """What is worth a look without breaking a rule: RSS over 1.2x its warm value, greedy answers that
    differed only under batching (equal when sent alone)."""
    p, out = result.get("phases", {}), []
    for name in _get(p, "baseline", "rss_over_1_2x", default=[]):
        out.append(f"RSS of {name} {p['baseline']['rss'][name]['ratio']:.2f}x its warm value")
    for phase in [p.get("soak", {}), *p.get("faults", {}).values()]:
        n = _get(phase, "totals", "mismatch_batch_only")
        if n:
            out.append(f"{n} greedy answers differed from the reference under load but equalled it alone")
    return out


# -- Markdown ------------------------------------------------------------------------------------------------

def _table(head: Iterable[str], rows: Iterable[Iterable]) -> str:
    head = list(head)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _kinds(counts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "-"


def _outcome_cells(o: dict) -> str:
    t = o.get("totals", {})
    return ", ".join(f"{k} {v}" for k, v in t.items() if v or k in ("completed", "lost")) or "-"


def summary_rows(result: dict) -> list[list]:
    """One row per phase: what was tried, what was injected, the load, what was lost, the outcome."""
    p, rows = {}, []
    for name, phase in result.get("phases", {}).items():
        if isinstance(phase, dict) and phase.get("harness_error"):
            rows.append([name, "-", "-", "-", "?", f"the harness failed: {phase['harness_error']}"])
        else:
            p[name] = phase
    if "api_fuzz" in p:
        a = p["api_fuzz"]
        rows.append(["1 API fuzz", f"{a['requests']} generated requests over {len(a.get('operations', {}))} "
                     f"operations ({_kinds(a.get('modes', {}))})", "-", "-", 0,
                     f"5xx {a['server_errors']}, schema violations {a['violations']}, statuses "
                     f"{_kinds(a.get('statuses', {}))}; /health after: {'200' if a.get('healthy_after') else 'NOT 200'}"
                     + (f"; schema-valid requests answered 400: {a['positive_rejected_400']} (fields: "
                        f"{_kinds(a.get('positive_rejected_fields', {}))})" if a.get("positive_rejected_400") else "")])
    if "access" in p:
        a = p["access"]
        rows.append(["2 access", f"{_get(a, 'http', 'unauthorized_expected')} HTTP requests with no/wrong key; "
                     f"{_get(a, 'curve', 'probes')} ZeroMQ peers without the keys on {_get(a, 'curve', 'sockets')} "
                     f"sockets; {len(a.get('listening', []))} listening sockets; "
                     f"{a.get('files_scanned', 0)} logs/cmdlines scanned", "-", "-", 0,
                     f"401 {_get(a, 'http', 'unauthorized_got')}/{_get(a, 'http', 'unauthorized_expected')}; "
                     f"answered without keys {_get(a, 'curve', 'answered')}; beyond 127.0.0.1 "
                     f"{len(a.get('non_loopback', []))}; secrets found {len(a.get('secrets_found', []))}"])
    if "wire_fuzz" in p:
        w = p["wire_fuzz"]
        rows.append(["3 wire fuzz", f"{w['sent']} frames to {len(w.get('sockets', []))} sockets "
                     f"(control {w.get('sent_control', 0)}, KV {w.get('sent_kv', 0)})", "-", "-", 0,
                     f"answers {_kinds(w.get('answers', {}))}; unexpected {w.get('unexpected_answers', 0)}, "
                     f"missing {w.get('missing_answers', 0)}; held right after: "
                     f"{_kinds({k: _kinds(v) for k, v in w.get('held_after_each_socket', {}).items()})}; "
                     f"workers alive {'yes' if w.get('workers_alive_after') else 'NO'}, serving after "
                     f"{'yes' if w.get('served_after') else 'NO'}"])
    if "soak" in p:
        s = p["soak"]
        rows.append(["4 soak", _kinds({k: sum(v.values()) for k, v in s.get("by_kind", {}).items()}),
                     f"{_get(s, 'totals', 'disconnected')} client disconnects",
                     f"{s['sent']} requests, concurrency {s['concurrency']}, {s['duration_s']:.0f} s",
                     _get(s, "totals", "lost"),
                     f"{_outcome_cells(s)}; greedy compared {s.get('compared', 0)}, equal {s.get('equal', 0)}; "
                     f"speculative: {s.get('speculative', '-')}"
                     + (f" ({_get(s, 'draft_tokens', 'accepted')} of {_get(s, 'draft_tokens', 'drafted')} draft tokens "
                        "accepted)" if _get(s, "draft_tokens", "drafted") else "")])
    for name, f in p.get("faults", {}).items():
        if not isinstance(f, dict):
            continue
        if f.get("harness_error"):
            rows.append([f"5 fault: {name}", "-", "-", "-", "?", f"the harness failed: {f['harness_error']}"])
            continue
        rows.append([f"5 fault: {name}", f.get("inputs", "-"), f.get("injected", "-"), f.get("load", "-"),
                     f.get("lost", "-") if f.get("lost") is not None else "n/a", f.get("outcome", "-")])
    if "overload" in p:
        o = p["overload"]
        rows.append(["6 overload", f"{o['sent']} short requests at once (capacity {o.get('capacity', '?')})", "-",
                     f"{o['sent']} requests, concurrency {o['sent']}, {o['duration_s']:.0f} s",
                     _get(o, "totals", "lost"),
                     f"{_outcome_cells(o)}; 503 with Retry-After {o.get('refused_with_retry_after', 0)}; peak RSS "
                     f"{o.get('peak_rss_mib', 0):.0f} MiB (before {o.get('rss_before_mib', 0):.0f} MiB)"])
    if "baseline" in p:
        b = p["baseline"]
        rows.append(["7 baseline", f"{len(b.get('workers', {}))} workers probed", "-", "-", 0,
                     f"at baseline: {', '.join(b.get('at_baseline', [])) or 'none'}; not: "
                     f"{', '.join(b.get('not_at_baseline', [])) or 'none'}; RSS end/warm max "
                     f"{b.get('max_rss_ratio', 0):.2f}x"])
    return rows


def render_markdown(result: dict) -> str:
    """The generated part of docs/RELIABILITY.md: the run's header, the summary table and the detail tables."""
    p = {k: v for k, v in result.get("phases", {}).items() if not (isinstance(v, dict) and v.get("harness_error"))}
    fails = failures(result)
    out = [f"Run: `{result.get('command', 'mlx-pd bench reliability')}` on {result.get('machine', '?')}, "
           f"{result.get('started', '?')}, {result.get('duration_s', 0) / 60:.1f} min. "
           f"Verdict: **{'every rule held' if not fails else 'FAILED: ' + '; '.join(fails)}**"
           + (f" (to look at: {'; '.join(warnings(result))})" if warnings(result) else "") + ".", ""]
    if result.get("notes"):
        out += [f"- {n}" for n in result["notes"]] + [""]
    out += [_table(["phase", "inputs tried", "faults injected", "load held", "lost", "outcome"], summary_rows(result)),
            ""]
    if "api_fuzz" in p:
        ops = p["api_fuzz"].get("operations", {})
        out += ["API fuzz per operation (requests sent, 5xx, schema violations):", "",
                _table(["operation", "requests", "5xx", "violations", "statuses"],
                       [[op, v["requests"], v["server_errors"], v["violations"], _kinds(v.get("statuses", {}))]
                        for op, v in ops.items()]), ""]
    if "wire_fuzz" in p:
        w = p["wire_fuzz"]
        kinds = sorted(set(w.get("by_kind", {}).get("control", {})) | set(w.get("by_kind", {}).get("kv", {})))
        out += ["Wire fuzz per kind (frames sent to all control sockets / all KV sockets):", "",
                _table(["kind", "control", "KV"], [[k, _get(w, "by_kind", "control", k, default="-"),
                                                      _get(w, "by_kind", "kv", k, default="-")] for k in kinds]), ""]
    if "soak" in p:
        s = p["soak"]
        heads = ["kind"] + [o for o in (*OUTCOMES, "mismatch") if any(o in v for v in s.get("by_kind", {}).values())
                            or o in ("completed", "lost")]
        lat = s.get("latency_s", {})
        cell = lambda k, q: f"{lat[k][q]:.1f}" if lat.get(k) else "-"  # noqa: E731
        out += ["Soak per kind (latency: seconds from sending to the end of the answer, under the soak's load):", "",
                _table(heads + ["p50 s", "p95 s"], [[k] + [v.get(o, 0) for o in heads[1:]] + [cell(k, "p50"),
                                                                                             cell(k, "p95")]
                                                    for k, v in s.get("by_kind", {}).items()]), ""]
        series = s.get("rss_series", [])
        if series:
            names = list(series[-1][1])
            out += ["Resident memory during the soak (MiB, after that many answers):", "",
                    _table(["answers"] + names, [[n] + [mem.get(k, "-") for k in names] for n, mem in series]), ""]
    if "baseline" in p:
        b = p["baseline"]
        rows = []
        for name, st in b.get("workers", {}).items():
            mem = b.get("rss", {}).get(name, {})
            rows.append([name, f"{st.get('kv_blocks_free', '?')}/{st.get('kv_blocks_total', '?')}",
                         st.get("num_running", "?"), st.get("num_waiting", "?"), st.get("transfers_inflight", "-"),
                         st.get("awaiting_kv", "-"), f"{mem.get('warm_mib', 0):.0f}", f"{mem.get('end_mib', 0):.0f}",
                         f"{mem.get('ratio', 0):.2f}x" + (" (over 1.2x)" if mem.get("ratio", 0) > 1.2 else "")])
        for name, mem in b.get("rss", {}).items():
            if name not in b.get("workers", {}):
                rows.append([name, "-", "-", "-", "-", "-", f"{mem.get('warm_mib', 0):.0f}",
                             f"{mem.get('end_mib', 0):.0f}", f"{mem.get('ratio', 0):.2f}x"])
        out += ["After every phase (workers probed with a Ping on their control sockets; RSS after warm-up vs at "
                "the end):", "", _table(["process", "KV free/total", "running", "waiting", "transfers",
                                         "awaiting KV", "RSS warm MiB", "RSS end MiB", "ratio"], rows), ""]
    return "\n".join(out).rstrip() + "\n"


def replace_generated(doc: str, block: str, begin: str = BEGIN, end: str = END) -> str:
    """`doc` with the text between the markers `begin` and `end` replaced by `block` (appended when absent)."""
    if begin in doc and end in doc and doc.index(begin) < doc.index(end):
        head, rest = doc.split(begin, 1)
        _, tail = rest.split(end, 1)
        return f"{head}{begin}\n{block.rstrip()}\n{end}{tail}"
    return f"{doc.rstrip()}\n\n{begin}\n{block.rstrip()}\n{end}\n"


def write_outputs(result: dict, block: str, out: Optional[str], markdown: Optional[str], begin: str = BEGIN,
                  end: str = END) -> int:
    """Print `block`, write `result` as JSON to `out` and `block` into the generated section (between `begin`
    and `end`) of the Markdown file `markdown` (either may be None). Returns the exit code: 1 when the result
    lists failures, else 0."""
    print(block)
    if out:
        Path(out).write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    if markdown:
        path = Path(markdown)
        doc = path.read_text(encoding="utf-8") if path.exists() else "# Reliability\n"
        path.write_text(replace_generated(doc, block, begin, end), encoding="utf-8")
    return 1 if result["failures"] else 0
