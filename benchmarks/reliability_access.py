"""Phase 2 of `mlx-pd bench reliability`: who may talk to the cluster.

401 without the right API key (and a constant-time comparison); no answer to ZeroMQ peers without the
CurveZMQ keys on any control, KV or events socket; nothing listening beyond 127.0.0.1; the CurveZMQ secrets
readable by their owner only; no secret in any log, command line, worker stats or the `mlx-pd status` table.
"""

from __future__ import annotations

import inspect
import random
import re
import subprocess
import time
from collections import Counter
from typing import Callable, Optional

import httpx

from benchmarks.reliability_cluster import ReliabilityCluster
from benchmarks.reliability_wire import kv_format

MODEL = "SmolLM2-135M-Instruct"


def curve_probes(c: ReliabilityCluster, strangers: dict, traffic: Callable[[], None]) -> dict:
    """For every control, KV and events socket and every stranger (label -> CurveKeys or None for plain TCP):
    send what an authorized peer gets an answer to (a ping; an offer in a wrong KV format, answered
    `refused`; events are published while `traffic()` runs requests through the router) and count answers.
    The same probes with the cluster's keys must be answered (the positive control)."""
    import zmq

    from benchmarks.reliability_inputs import kv_garbage
    from cluster.protocol import Ping, pack
    from cluster.transport import client_socket

    offer = next(f for k, f in kv_garbage(random.Random(0), 1, kv_format(c)) if k == "offer_wrong_format")
    ctx = zmq.Context()
    socks = []  # (worker, kind, label, socket)
    try:
        for w in c.workers:
            for kind in ("control", "kv", "events"):
                endpoint = c.endpoint(w["name"], kind)
                if endpoint is None:
                    continue
                for label, keys in [*strangers.items(), ("the cluster's keys", c.keys)]:
                    if kind == "events":
                        sock = client_socket(ctx, zmq.SUB, endpoint, keys)
                        sock.setsockopt(zmq.SUBSCRIBE, b"")
                    else:
                        sock = client_socket(ctx, zmq.DEALER, endpoint, keys)
                        sock.send_multipart([pack(Ping(seq=1))] if kind == "control" else offer)
                    socks.append((w["name"], kind, label, sock))
        time.sleep(0.5)  # SUB sockets need their handshakes done before anything is published
        traffic()
        time.sleep(1.5)
        answered, detail, positive = 0, [], Counter()
        for name, kind, label, sock in socks:
            got = bool(sock.poll(0))
            if label == "the cluster's keys":
                positive[kind] += got
            elif got:
                answered += 1
                detail.append(f"{name} {kind} answered {label}")
        sockets = len({(n, k) for n, k, _, _ in socks})
        return {"sockets": sockets, "probes": sockets * len(strangers), "answered": answered,
                "answered_detail": detail, "strangers": list(strangers),
                "with_keys_answered": dict(positive), "with_keys_sockets": dict(Counter(k for n, k, l, _ in socks
                                                                                      if l == "the cluster's keys"))}
    finally:
        for *_, sock in socks:
            sock.close(linger=0)
        ctx.destroy(linger=0)


def listening_sockets(pids: dict[str, int]) -> list[dict]:
    """Every TCP/UDP socket our processes (and their children) listen on, from `ss -ltunpH`."""
    from benchmarks.host_cpu import process_tree

    owner = {p: name for name, pid in pids.items() for p in process_tree(pid)}
    try:
        text = subprocess.run(["ss", "-ltunpH"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return [{"error": f"ss failed: {exc}"}]
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 6:
            continue
        for pid in (int(p) for p in re.findall(r"pid=(\d+)", line)):
            if pid in owner:
                out.append({"process": owner[pid], "proto": parts[0], "address": parts[4]})
                break
    return out


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host.startswith("127.") or host == "::1" or host == "localhost"


def access(c: ReliabilityCluster, log: Callable[[str], None], soak_text: Optional[str] = None) -> dict:
    """401 without the right key; no answer to ZeroMQ peers without the CurveZMQ keys; loopback only;
    no secret in logs, command lines or `mlx-pd status`."""
    out: dict = {}
    if c.api_key:
        wrong = ["", "Bearer", "Bearer wrong", "Bearer  " + c.api_key[1:], f"Bearer {c.api_key[:-1]}", f"Bearer {c.api_key}x",
                 f"Basic {c.api_key}", f"bearer{c.api_key}", c.api_key]
        targets = [("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 2}),
                   ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
                   ("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None),
                   ("POST", "/reset_prefix_cache", None), ("GET", "/openapi.json", None), ("GET", "/docs", None)]
        got, expected, other = 0, 0, Counter()
        for method, path, body in targets:
            for header in wrong:
                headers = {"Authorization": header} if header else {}
                r = httpx.request(method, c.router_url + path, json=body, headers=headers, timeout=60)
                expected += 1
                if r.status_code == 401 and r.headers.get("www-authenticate"):
                    got += 1
                else:
                    other[f"{path} {header[:12]!r} -> {r.status_code}"] += 1
        ok = httpx.get(c.router_url + "/v1/models", headers=c.headers(), timeout=60).status_code
        exempt = {p: httpx.get(c.router_url + p, timeout=60).status_code for p in ("/health", "/metrics")}
        from router.app import BearerAuthMiddleware

        out["http"] = {"unauthorized_expected": expected, "unauthorized_got": got, "not_401": dict(other),
                       "with_key": ok, "exempt_without_key": exempt,
                       "constant_time_compare": "hmac.compare_digest" in inspect.getsource(BearerAuthMiddleware)}
        log(f"  HTTP: {got}/{expected} answered 401; with the key {ok}; exempt {exempt}")
    else:
        out["http"] = {"skipped": "no API key configured (--no-api-key)"}
    if c.keys is not None:
        import zmq

        from cluster.transport import CurveKeys

        stranger_pub, stranger_sec = zmq.curve_keypair()
        strangers = {"plain TCP (no CurveZMQ)": None,
                     "CurveZMQ with an unauthorized client key": CurveKeys(
                         c.keys.server_public, c.keys.server_secret, stranger_pub, stranger_sec, (stranger_pub,))}

        def traffic() -> None:  # new prompts: their blocks are stored, so every worker involved publishes
            for i in range(3):
                httpx.post(c.router_url + "/v1/chat/completions", headers=c.headers(), timeout=300, json={
                    "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": f"Access probe {i} "
                                                                   f"{random.random()}: " + "tell me a story " * 60}]})

        out["curve"] = curve_probes(c, strangers, traffic)
        log(f"  CurveZMQ: {out['curve']['probes']} stranger probes on {out['curve']['sockets']} sockets, answered "
            f"{out['curve']['answered']}; with the keys answered {out['curve']['with_keys_answered']}")
    else:
        out["curve"] = {"skipped": "no CurveZMQ keys configured (--no-curve)"}
    if c.keys_dir is not None:  # secrets readable by the owner only (mlx-pd keys makes them so)
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in [c.keys_dir, *sorted(c.keys_dir.iterdir())]}
        out["key_file_modes"] = modes
        out["key_secrets_private"] = all(int(m, 8) & 0o077 == 0 for n, m in modes.items()
                                         if n.endswith("_secret") or n == c.keys_dir.name)
    listening = listening_sockets(c.pids())
    out["listening"] = [f"{s['process']} {s['proto']} {s['address']}" for s in listening]
    out["non_loopback"] = [f"{s['process']} {s['address']}" for s in listening
                           if "address" in s and not _is_loopback(s["address"])]
    log(f"  listening: {len(listening)} sockets, beyond loopback: {out['non_loopback'] or 'none'}")
    out.update(scan_secrets(c, soak_text))
    return out


def scan_secrets(c: ReliabilityCluster, extra_text: Optional[str] = None) -> dict:
    """Look for the API key and the CurveZMQ secret keys in every log, every command line and the
    `mlx-pd status` table over the live workers' stats."""
    from cluster.launch.ray_up import format_status

    secrets = {}
    if c.api_key:
        secrets["API key"] = c.api_key.encode()
    if c.keys is not None:
        secrets["server secret key"] = c.keys.server_secret
        secrets["client secret key"] = c.keys.client_secret
    places: dict[str, bytes] = {}
    for path in c.log_files():
        try:
            places[f"log {path.name}"] = path.read_bytes()
        except OSError:
            continue
    for name, pid in c.pids().items():
        try:
            places[f"cmdline of {name}"] = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
    rows = []
    for w in c.workers:
        st = c.probe(w["name"]) or {}
        places[f"stats of {w['name']}"] = repr(st).encode()
        rows.append({"actor": st.get("actor", w["name"]), "role": w["role"], "host": st.get("host", "127.0.0.1"),
                     "state": "alive" if st else "unreachable", "running": st.get("num_running"),
                     "waiting": st.get("num_waiting"),
                     "kv_blocks_used": (st["kv_blocks_total"] - st["kv_blocks_free"]) if st else None,
                     "kv_blocks_free": st.get("kv_blocks_free"), "prefix_cache_hit_rate": st.get("prefix_cache_hit_rate")})
    rows.append({"actor": "router", "role": "router", "host": "127.0.0.1", "state": "alive",
                 "endpoint": c.router_url + "/v1"})
    places["mlx-pd status table"] = format_status(rows).encode()
    if extra_text:
        places["harness output"] = extra_text.encode()
    found = [f"{what} in {where}" for where, blob in places.items() for what, s in secrets.items() if s in blob]
    return {"files_scanned": len(places), "secrets_checked": sorted(secrets), "secrets_found": found}
