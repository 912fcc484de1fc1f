"""Phase 3 of `mlx-pd bench reliability`: hostile frames on every control and KV socket of the live workers
(the frames come from benchmarks/reliability_inputs.py)."""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Callable, Optional

import httpx

from benchmarks.reliability_cluster import ReliabilityCluster
from benchmarks.reliability_inputs import control_garbage, kv_garbage

MODEL = "SmolLM2-135M-Instruct"


# kind -> (answers allowed, the one required): a bit-flipped valid `generate` may still be a valid request
# (it then runs, or is refused as a duplicate); everything else must go unanswered.
_ANSWERS = {"generate_invalid": ({"rejected"}, "rejected"), "offer_wrong_format": ({"refused"}, "refused"),
            "mutated": ({"rejected", "output"}, None), "generate_abandoned": ({"output"}, None)}


_HELD = ("requests", "num_running", "num_waiting", "awaiting_kv", "transfers_inflight", "orphans")


def kv_format(c: ReliabilityCluster) -> dict:
    from cluster.config import EngineConfig
    from cluster.model import served_model
    from kv_transfer.handshake import KVFormat

    _, spec = served_model(MODEL, MODEL, c.engine["dtype"])
    cfg = EngineConfig(**{k: v for k, v in c.engine.items() if k in EngineConfig.__dataclass_fields__})
    return KVFormat.of(spec, cfg).model_dump()


def _header(frames: list) -> dict:
    import msgpack

    try:
        d = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    except Exception:
        return {}
    return d if isinstance(d, dict) else {}


def _rid(frames: list) -> Optional[str]:
    d = _header(frames)
    req = d.get("request")
    rid = req.get("request_id") if isinstance(req, dict) else d.get("request_id")
    return rid if isinstance(rid, str) else None


def _sync(sock, sock_kind: str, sync_frames: list, timeout_s: float) -> list[dict]:
    """Send a message that is always answered and wait for its answer; returns every answer before it.
    The worker handles one peer's messages in order, so everything sent earlier has been handled."""
    sock.send_multipart(sync_frames)
    token = "pong" if sock_kind == "control" else "refused"
    seen = []
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0 and sock.poll(int(left * 1000)):
        d = _header(sock.recv_multipart())
        if d.get("type") == token and (sock_kind == "control" or d.get("request_id", "").startswith("sync-")):
            return seen
        seen.append(d)
    raise RuntimeError(f"no {token} within {timeout_s:.0f} s: the worker stopped answering")


def wire_fuzz(c: ReliabilityCluster, per_kind: int, log: Callable[[str], None], seed: int = 0) -> dict:
    """Hostile frames, sent WITH the CurveZMQ keys (an authenticated but buggy or malicious peer), to every
    control and KV socket; the worker must drop them (or answer, for the kinds that expect an answer), keep
    answering pings, and serve a real request afterwards. One peer per socket: a message that is always
    answered before and after the garbage proves the connection was up and every frame was handled."""
    import zmq

    from cluster.protocol import Ping, pack
    from cluster.transport import client_socket

    rng = random.Random(f"wire:{seed}")
    fmt = kv_format(c)
    by_kind: dict[str, Counter] = {"control": Counter(), "kv": Counter()}
    answers: Counter = Counter()
    unexpected, missing, sockets, alive_during, left_behind = [], 0, [], {}, {}
    t0 = time.monotonic()
    for w in c.workers:
        for sock_kind in ("control", "kv"):
            endpoint = c.endpoint(w["name"], sock_kind)
            if endpoint is None:
                continue
            sockets.append(f"{w['name']} {sock_kind}")
            garbage = control_garbage(rng, per_kind, w["role"]) if sock_kind == "control" else \
                kv_garbage(rng, per_kind, fmt)
            before = c.probe(w["name"]) or {}
            sync_offer = next(f for k, f in kv_garbage(rng, 1, fmt) if k == "offer_wrong_format")
            n_sync = [0]

            def sync_frames() -> list:
                if sock_kind == "control":
                    return [pack(Ping(seq=1))]
                n_sync[0] += 1
                d = _header(sync_offer)
                d["request_id"] = f"sync-{n_sync[0]}"
                import msgpack
                return [msgpack.packb(d, use_bin_type=True)]

            ctx = zmq.Context()
            try:
                sock = client_socket(ctx, zmq.DEALER, endpoint, c.keys)
                _sync(sock, sock_kind, sync_frames(), 60)
                want: dict[str, str] = {}  # request id -> the answer it must get
                kind_of: dict[str, str] = {}
                for kind, frames in garbage:
                    sock.send_multipart(frames)
                    by_kind[sock_kind][kind] += 1
                    rid = _rid(frames)
                    if rid is not None:
                        kind_of.setdefault(rid, kind)
                        if _ANSWERS.get(kind, (set(), None))[1]:
                            want[rid] = _ANSWERS[kind][1]
                got = _sync(sock, sock_kind, sync_frames(), 120)
                time.sleep(0.5)  # outputs of (mutated but valid) requests that ran
                while sock.poll(0):
                    got.append(_header(sock.recv_multipart()))
                sock.close(linger=0)
            finally:
                ctx.destroy(linger=0)
            answered = set()
            for d in got:
                out = d.get("output") if isinstance(d.get("output"), dict) else {}
                rid = d.get("request_id") or out.get("request_id")
                kind, t = kind_of.get(rid, "unattributed"), str(d.get("type"))
                answers[f"{kind} -> {t}"] += 1
                answered.add((rid, t))
                if t not in _ANSWERS.get(kind, (set(), None))[0]:
                    unexpected.append(f"{w['name']} {sock_kind} {kind} ({rid}) -> {t}")
            for rid, t in want.items():
                if (rid, t) not in answered:
                    missing += 1
                    unexpected.append(f"{w['name']} {sock_kind} {kind_of[rid]} ({rid}): no {t!r} answer")
            after = c.probe(w["name"])
            alive_during[f"{w['name']} {sock_kind}"] = after is not None
            held = {k: after.get(k, 0) - before.get(k, 0) for k in _HELD if after and after.get(k, 0) != before.get(k, 0)}
            if after and after.get("kv_blocks_free") != before.get("kv_blocks_free"):
                held["kv_blocks_used"] = before.get("kv_blocks_free", 0) - after.get("kv_blocks_free", 0)
            if held:
                left_behind[f"{w['name']} {sock_kind}"] = held
            log(f"  {w['name']} {sock_kind}: {len(garbage)} frames handled; answers so far {dict(answers)}")
    r = httpx.post(c.router_url + "/v1/chat/completions", headers=c.headers(), timeout=300, json={
        "model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 12, "temperature": 0})
    served = r.status_code == 200 and "Paris" in r.text
    names = [w["name"] for w in c.workers]
    return {"sent": sum(sum(k.values()) for k in by_kind.values()), "sent_control": sum(by_kind["control"].values()),
            "sent_kv": sum(by_kind["kv"].values()), "sockets": sockets,
            "by_kind": {k: dict(sorted(v.items())) for k, v in by_kind.items()}, "answers": dict(answers),
            "unexpected_answers": len(unexpected) - missing, "missing_answers": missing,
            "unexpected_detail": unexpected[:20], "alive_after_each_socket": alive_during,
            "held_after_each_socket": left_behind,
            "workers_alive_after": all(alive_during.values()) and all(c.procs[n].proc.poll() is None for n in names),
            "served_after": served, "served_status": r.status_code, "duration_s": time.monotonic() - t0}
