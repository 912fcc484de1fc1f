"""The lab harness (benchmarks/lab): Macs as network namespaces of this machine, Ray across them, mlx-pd on top.

Two short labs on the fast random-weight model, with the router's liveness deadline short (a ping every 0.5 s,
dead after 3 s) and Ray's record of the last `ray start` (`ray_current_cluster`, in the Ray temp folder of
every command run in the lab) pointing at an address where nothing runs, so `mlx-pd up`, `status` and
`down` must go by the topology's `[ray] address` alone:

- a studio and one mini: one request from the client host, prefilled on the studio, its KV over the link to
  the mini with CurveZMQ on (a client without the keys gets no answer from a worker), answers what a
  single-node server of the same model answers (greedy, float32);
- a studio and two minis: a stream decoding on a mini whose cable is pulled for longer than the deadline
  moves to the other mini and completes.

They need Linux, root and iproute2 (network namespaces): elsewhere they skip, saying why; under CI (CI=true)
that is a failure instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from benchmarks.lab import Lab
from tests.lab_gate import require_lab
from benchmarks.lab.ray_hosts import mlx_pd_cli

ROUTING = {"heartbeat_s": 0.5, "dead_after_s": 3.0}
STALE_RAY_ADDRESS = "10.77.0.250:6379"  # in the lab's subnet, where no host is
# a client run in the client host: prints {"status": N}, then the body's lines as they arrive; with PEEK > 0 also
# the router's dashboard state ({"state": ...}, its requests in flight and its view of each worker) after PEEK
# lines and once more after the body
CLIENT = r"""
import json, os, sys, httpx
url, body, peek = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
state = url.split("/v1/")[0] + "/dashboard/api/state"
with httpx.Client(headers={"Authorization": "Bearer " + os.environ["MLX_PD_API_KEY"]}, timeout=120) as client:
    with client.stream("POST", url, json=body) as r:
        print(json.dumps({"status": r.status_code}), flush=True)
        for n, line in enumerate(line for line in r.iter_lines() if line):
            print(line, flush=True)
            if n + 1 == peek:
                print(json.dumps({"state": client.get(state).json()}), flush=True)
    if peek:
        print(json.dumps({"state": client.get(state).json()}), flush=True)
"""
# a ping to a worker's control socket from the client host: "answered" or "silent" within 3 s
PING = r"""
import sys, zmq
from cluster.protocol import Ping, pack
from cluster.transport import CurveKeys, client_socket
endpoint, keys = sys.argv[1], sys.argv[2]
sock = client_socket(zmq.Context(), zmq.DEALER, endpoint, CurveKeys.load(keys) if keys != "-" else None)
try:
    sock.send(pack(Ping(seq=1)))
    print("answered" if sock.poll(3000) else "silent")
except zmq.Again:
    print("silent")
"""


@pytest.fixture
def make_lab(request):
    """A function that starts (not deploys) a lab in a short folder of its own (Ray's socket paths must stay
    short) with namespaces named after this process; every lab is torn down after the test, and its folder
    removed unless the test failed (its logs are there)."""
    require_lab()
    labs, failed = [], request.session.testsfailed

    def make(minis: int, rate: str = "10gbit", routing: dict | None = None) -> Lab:
        root = Path(tempfile.mkdtemp(prefix="mlxpd-labt-", dir="/tmp"))
        lab = Lab(root, prefix=f"mlxpd-labt{os.getpid()}-", minis=minis, rate=rate,
                  routing={**ROUTING, **(routing or {})}, echo=lambda line: None)
        labs.append(lab)
        lab.start()
        stale = root / "tmp" / "ray" / "ray_current_cluster"  # Ray's temp folder of the lab's commands
        stale.parent.mkdir(parents=True)
        stale.write_text(STALE_RAY_ADDRESS)
        return lab

    yield make
    problems = [problem for lab in labs for problem in lab.down()]
    for lab in labs:
        if request.session.testsfailed == failed and not problems:
            shutil.rmtree(lab.root, ignore_errors=True)
        else:
            print(f"the lab's logs: {lab.root}", file=sys.stderr)
    assert problems == []


def _client(lab: Lab, path: str, body: dict, peek: int = 0) -> subprocess.Popen:
    return subprocess.Popen(lab.command("client", [sys.executable, "-c", CLIENT, f"{lab.endpoint}{path}",
                                                   json.dumps(body), str(peek)]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=lab.env())


def _post(lab: Lab, path: str, body: dict) -> dict:
    proc = _client(lab, path, body)
    out, err = proc.communicate(timeout=180)
    lines = out.splitlines()
    assert proc.returncode == 0 and lines and json.loads(lines[0]) == {"status": 200}, out + err
    return json.loads("".join(lines[1:]))


def _rows(lab: Lab, timeout_s: float = 10.0) -> dict[str, dict]:
    """`cluster.launch.ray_up.status` of the lab (what `mlx-pd status` prints), run in the studio: {worker name:
    its row}, with its KV bytes and tokens."""
    code = ("import json, sys; from cluster.launch.ray_up import status; "
            "print(json.dumps(status(sys.argv[1], timeout_s=float(sys.argv[2]))))")
    r = lab.run("studio", [sys.executable, "-c", code, lab.state.topology, str(timeout_s)], capture_output=True,
                text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return {row["name"]: row for row in json.loads(r.stdout.strip().splitlines()[-1])}


def test_a_request_crosses_the_link_with_curve_and_answers_as_single_node(make_lab):
    from benchmarks.reliability_long import FAST_KV_GB, fast_model_dir
    from tests.live_server import live_model_server

    lab = make_lab(minis=1, rate="1gbit", routing={"local_prefill_max_tokens": 0})  # every prompt on the studio
    lab.deploy(timeout_s=240)
    assert {h.name: h.ip for h in lab.state.hosts} == {"studio": "10.77.0.10", "mini-1": "10.77.0.11",
                                                       "client": "10.77.0.100"}
    assert [r["rate"] for r in lab.status()] == ["1Gbit"] * 3 and lab.endpoint == "http://10.77.0.10:8000/v1"

    body = {"model": lab.state.served_name, "max_tokens": 24, "temperature": 0,
            "prompt": "The lab has a studio and a mini on one bridge. " * 12 + "What does the mini do?"}
    answer = _post(lab, "/completions", body)
    with live_model_server(fast_model_dir(), dtype="float32", kv_cache_gb=FAST_KV_GB) as (base, _):
        import httpx

        reference = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()
    assert answer["choices"][0]["text"] == reference["choices"][0]["text"] != ""
    assert answer["usage"] == reference["usage"]

    rows = _rows(lab)
    assert rows["prefill-0"]["kv_bytes_sent"] == rows["decode-0"]["kv_bytes_received"] > 0  # KV crossed the link
    worker = "tcp://10.77.0.11:5611"  # decode-0's control socket, from the client host
    ping = [sys.executable, "-c", PING, worker]
    assert lab.run("client", ping + ["-"], capture_output=True, text=True).stdout.strip() == "silent"
    assert lab.run("client", ping + [str(lab.root / "keys")], capture_output=True, text=True).stdout.strip() == \
        "answered"

    r = lab.run("studio", [mlx_pd_cli(), "status", lab.state.topology], capture_output=True, text=True)
    assert r.returncode == 0 and re.search(r"decode-0@mac-mini-1\s+decode\s+10\.77\.0\.11\s+alive", r.stdout), \
        r.stdout + r.stderr
    r = lab.run("studio", [mlx_pd_cli(), "down", lab.state.topology], capture_output=True, text=True)
    assert r.returncode == 0 and "stopped decode-0@mac-mini-1" in r.stderr, r.stderr


def test_a_stream_on_a_mini_whose_cable_is_pulled_completes_on_the_other(make_lab):
    lab = make_lab(minis=2)
    lab.deploy(timeout_s=240)
    body = {"model": lab.state.served_name, "prompt": "Once upon a time", "max_tokens": 600, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    proc = _client(lab, "/completions", body, peek=5)
    minis = {"decode-0": "mini-1", "decode-1": "mini-2"}
    cut, finish, usage, errors, after = None, None, None, [], None
    t0 = time.monotonic()
    for line in proc.stdout:
        assert time.monotonic() - t0 < 240, "the stream did not end"
        if line.startswith('{"state"'):
            state = json.loads(line)["state"]
            if cut is None:  # the router's view, five chunks in: the stream decodes on one mini
                [request] = state["requests"]
                cut = request["workers"][-1]
                assert request["phase"] == "decode" and cut in minis, request
                lab.link(minis[cut], up=False)  # that mini drops off the network, mid-stream
            else:
                after = {w["name"]: w for w in state["workers"]}
        elif line.startswith("data: {"):
            chunk = json.loads(line[len("data: "):])
            errors += [chunk["error"]] if "error" in chunk else []
            usage = chunk.get("usage") or usage
            finish = next((c["finish_reason"] for c in chunk.get("choices", []) if c.get("finish_reason")), finish)
    assert proc.wait(timeout=30) == 0, proc.stderr.read()
    assert cut is not None and errors == []
    assert finish == "length" and usage["completion_tokens"] == 600  # the whole answer, none lost or repeated
    other = "decode-1" if cut == "decode-0" else "decode-0"
    assert after[cut]["alive"] is False and after[other]["alive"] is True, after
    assert after[other]["tokens_out"] > 0  # the other mini decoded the rest
    assert lab.status()[[h.name for h in lab.state.hosts].index(minis[cut])]["link"] == "down"
