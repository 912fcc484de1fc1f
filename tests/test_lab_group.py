"""A tensor-parallel decode group across two "Macs" of the lab (benchmarks/lab: network namespaces joined by 1 Gbit/s
shaped links), in plain processes as `mlx-pd worker` and `mlx-pd router` run them, without Ray: rank 0 of
`decode-0` on mini-1, rank 1 on mini-2 (each rank's collective, steps and heartbeats on its own mini's address),
a prefill worker and the router on the studio, requests from the client host. The group's deadline is 5 s, the
router's 3 s.

- Greedy completions prefilled on the studio, their KV split into the group across the link, answer what one
  engine alone answers, and the router's dashboard shows the group's two ranks alive at their hosts.
- Rank 1 killed (SIGKILL) mid-stream: the stream ends with an SSE error event within the deadlines, never a hang,
  a new request gets a 503 while the group is down, and rank 0 exits with status 75 (its heartbeat gave the
  group up); the pair started again re-forms on the same ports and answers right, the router using it again.
- Rank 1's cable pulled mid-stream: the same ending, both ranks exit with status 75, and with the cable back the
  restarted pair answers right again.

Ray restarting the ranks as actors is in cluster/launch (RankActor); this test is the supervisor here. It needs
Linux, root and iproute2 (network namespaces): elsewhere it skips, saying why; under CI (CI=true) that is a
failure instead.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks.lab import Lab
from tests.lab_gate import require_lab
from tests.family_helpers import COMMON
from tests.group_helpers import model_folder

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 5.0  # the group's: a rank silent this long is lost
ROUTING = {"heartbeat_s": 0.5, "dead_after_s": 3.0, "local_prefill_max_tokens": 0}  # every prompt on the studio
ENGINE = {"num_blocks": 256, "block_size": 8}
ENDS_WITHIN_S = DEADLINE_S + ROUTING["dead_after_s"] + 4.0  # a fault to the stream's end, at most
UP_WITHIN_S = 60.0
MAX_TOKENS = 8
LEADER_IP, FOLLOWER_IP = "10.77.0.11", "10.77.0.12"

# run in the client host. `stream URL BODY`: {"status": N}, then the body's lines as they arrive. `post URL BODY`:
# {"status", "retry_after", "body"}. `wait URL TIMEOUT`: the router's dashboard state once every worker is alive
# and decode-0 reports its two ranks alive ({"ok": true, "state"}), or the last state after TIMEOUT s
CLIENT = r"""
import json, os, sys, time, httpx
mode, url = sys.argv[1], sys.argv[2]
base = url.split("/v1/")[0]
headers = {"Authorization": "Bearer " + os.environ["MLX_PD_API_KEY"]}
with httpx.Client(headers=headers, timeout=60) as client:
    if mode == "stream":
        with client.stream("POST", url, json=json.loads(sys.argv[3])) as r:
            print(json.dumps({"status": r.status_code}), flush=True)
            for line in r.iter_lines():
                if line:
                    print(line, flush=True)
    elif mode == "post":
        r = client.post(url, json=json.loads(sys.argv[3]))
        print(json.dumps({"status": r.status_code, "retry_after": r.headers.get("retry-after"),
                          "body": r.json()}))
    else:
        deadline, state = time.monotonic() + float(sys.argv[3]), None
        while time.monotonic() < deadline:
            try:
                state = client.get(base + "/dashboard/api/state", timeout=5).json()
            except (httpx.HTTPError, ValueError):
                time.sleep(0.3)
                continue
            workers = {w["name"]: w for w in state["workers"]}
            ranks = workers.get("decode-0", {}).get("ranks") or []
            if all(w["alive"] for w in workers.values()) and len(ranks) == 2 and all(k["alive"] for k in ranks):
                print(json.dumps({"ok": True, "state": state}))
                break
            time.sleep(0.3)
        else:
            print(json.dumps({"ok": False, "state": state}))
"""


@pytest.fixture
def lab(request):
    """The lab's network (a studio, two minis, the client), no Ray, in a short folder of its own; torn down
    after the test (every process left in its hosts ended), its folder removed unless the test failed."""
    require_lab()
    failed = request.session.testsfailed
    root = Path(tempfile.mkdtemp(prefix="mlxpd-labg-", dir="/tmp"))
    folder = model_folder("llama", root / "models")
    lab = Lab(root / "lab", prefix=f"mlxpd-labg{os.getpid()}-", minis=2, rate="1gbit", model=str(folder),
              routing=ROUTING, engine=ENGINE, decode_group={"deadline_s": DEADLINE_S}, echo=lambda line: None)
    lab.folder = folder
    try:
        lab.start(ray=False)
        yield lab
    finally:
        problems = lab.down()
        if request.session.testsfailed == failed and not problems:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"the lab's logs: {lab.root}", file=sys.stderr)
        assert problems == []


def _prompts() -> list[list[int]]:
    rng = np.random.RandomState(7)
    return [rng.randint(100, COMMON["vocab_size"], size=n).tolist() for n in (61, 130)]


def _alone(folder: Path, prompts: list[list[int]]) -> list[str]:
    """One engine alone: each prompt's greedy text."""
    from cluster.config import EngineConfig
    from cluster.engine import EngineCore
    from cluster.model import load_model, read_model_spec
    from tests.engine_helpers import greedy, run

    model, tokenizer = load_model(folder, "float32")
    engine = EngineCore(model, tokenizer, read_model_spec(folder, "lab-group"),
                        EngineConfig(dtype="float32", num_blocks=256, block_size=8))
    out = run(engine, [greedy(f"p{i}", p, MAX_TOKENS, ignore_eos=True) for i, p in enumerate(prompts)])
    return [out[f"p{i}"].text for i in range(len(prompts))]


class Cluster:
    """The lab's processes: `mlx-pd worker` / `router` in their hosts, each logging to the lab's folder."""

    def __init__(self, lab: Lab):
        self.lab, self.procs = lab, {}
        self.env = {**lab.env(), "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}

    def start(self, name: str, host: str, args: list[str]) -> subprocess.Popen:
        with open(self.lab.root / f"{name}.log", "a") as log:
            proc = subprocess.Popen(self.lab.command(host, [sys.executable, "-m", "cluster.launch.cli", *args]),
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                                    cwd=REPO)
        self.procs[name] = proc
        return proc

    def start_group(self) -> None:
        topology = self.lab.state.topology
        self.start("rank1", "mini-2", ["worker", topology, "decode-0", "--rank", "1"])
        self.start("rank0", "mini-1", ["worker", topology, "decode-0"])

    def exit_code(self, name: str, within_s: float) -> int:
        try:
            return self.procs[name].wait(within_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} still runs {within_s:.0f} s on ({self.log(name)})")

    def log(self, name: str) -> str:
        return (self.lab.root / f"{name}.log").read_text(errors="replace")[-3000:]

    def client(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(self.lab.command("client", [sys.executable, "-c", CLIENT, *args]),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env)

    def post(self, body: dict) -> dict:
        out, err = self.client("post", f"{self.lab.endpoint}/completions", json.dumps(body)).communicate(timeout=90)
        assert out.strip(), err[-2000:]
        return json.loads(out)

    def wait_up(self) -> dict:
        """The router's dashboard state once every worker and both ranks are alive in its view."""
        out, err = self.client("wait", f"{self.lab.endpoint}/completions", str(UP_WITHIN_S)).communicate(
            timeout=UP_WITHIN_S + 30)
        got = json.loads(out) if out.strip() else {"ok": False, "state": err[-2000:]}
        assert got["ok"], f"the cluster is not up within {UP_WITHIN_S:.0f} s: {got['state']}\n" + "\n".join(
            f"-- {name}:\n{self.log(name)}" for name in self.procs)
        return got["state"]


def _greedy_texts(cluster: Cluster, folder: Path, prompts: list[list[int]]) -> list[str]:
    texts = []
    for p in prompts:
        r = cluster.post({"model": folder.name, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
                          "ignore_eos": True})
        assert r["status"] == 200, r
        texts.append(r["body"]["choices"][0]["text"])
    return texts


def _stream_until_fault(cluster: Cluster, folder: Path, fault) -> dict:
    """A long greedy stream from the client; `fault()` runs once five chunks have arrived. Returns {"chunks",
    "errors", "finish", "ended_s" (from the fault to the stream's end)}; fails if it has not ended within
    ENDS_WITHIN_S of the fault."""
    body = {"model": folder.name, "prompt": _prompts()[0][:40], "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    proc = cluster.client("stream", f"{cluster.lab.endpoint}/completions", json.dumps(body))
    lines: "queue.Queue[str | None]" = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    chunks, errors, finish, faulted, status = 0, [], None, None, None
    deadline = time.monotonic() + 60.0
    while True:
        limit = (faulted + ENDS_WITHIN_S) if faulted is not None else deadline
        try:
            line = lines.get(timeout=max(0.0, limit - time.monotonic()))
        except queue.Empty:
            proc.kill()
            pytest.fail(f"the stream did not end within {ENDS_WITHIN_S:.0f} s of the fault (a hang): "
                        f"{chunks} chunks" if faulted else f"the stream stalled before the fault: {chunks} chunks")
        if line is None:
            break
        if line.startswith('{"status"'):
            status = json.loads(line)["status"]
        elif line.startswith("data: {"):
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                errors.append(chunk["error"])
            else:
                chunks += 1
            finish = next((c["finish_reason"] for c in chunk.get("choices", []) if c.get("finish_reason")), finish)
            if chunks == 5 and faulted is None:
                fault()
                faulted = time.monotonic()
    ended = time.monotonic()
    assert proc.wait(10) == 0 and status == 200, proc.stderr.read()[-2000:]
    assert faulted is not None, f"the stream ended after {chunks} chunks, before the fault"
    return {"chunks": chunks, "errors": errors, "finish": finish, "ended_s": ended - faulted}


def test_a_tensor_parallel_decode_group_across_the_link_answers_and_comes_back_after_a_kill_and_a_cut(lab):
    t0 = time.monotonic()
    lab.write_topology()
    prompts = _prompts()
    cluster = Cluster(lab)
    cluster.start("prefill", "studio", ["worker", lab.state.topology, "prefill-0"])
    cluster.start_group()
    cluster.start("router", "studio", ["router", lab.state.topology])
    alone = _alone(lab.folder, prompts)  # while the cluster loads
    state = cluster.wait_up()
    up_s = time.monotonic() - t0

    # prefilled on the studio, the KV split into the group over the link: what one engine alone answers
    assert _greedy_texts(cluster, lab.folder, prompts) == alone
    state = cluster.wait_up()
    workers = {w["name"]: w for w in state["workers"]}
    decode = workers["decode-0"]
    assert decode["parallel"] == "tensor"
    assert [(k["rank"], k["host"], k["alive"]) for k in decode["ranks"]] == [(0, LEADER_IP, True),
                                                                              (1, FOLLOWER_IP, True)]
    assert all(k["parameter_bytes"] > 0 and k["kv_bytes"] > 0 for k in decode["ranks"])
    assert decode["kv_bytes_received"] == workers["prefill-0"]["kv_bytes_sent"] > 0
    assert decode["ranks"][1]["step_bytes"] > 0  # rank 0 handed rank 1 its steps and its share of the KV

    # rank 1 killed mid-stream: an error event, not a hang; rank 0 gives the group up with status 75
    killed = _stream_until_fault(cluster, lab.folder, lambda: cluster.procs["rank1"].kill())
    assert killed["errors"] and killed["finish"] != "length" and killed["chunks"] < 400, killed
    assert cluster.exit_code("rank0", DEADLINE_S + 10) == 75, cluster.log("rank0")
    refused = cluster.post({"model": lab.folder.name, "prompt": prompts[0], "max_tokens": MAX_TOKENS})
    assert refused["status"] == 503 and refused["retry_after"], refused  # no decode worker while it is down
    restart = time.monotonic()
    cluster.start_group()  # the same ports, at once: the pair re-forms
    cluster.wait_up()
    back_after_kill_s = time.monotonic() - restart
    assert _greedy_texts(cluster, lab.folder, prompts) == alone

    # rank 1's cable pulled mid-stream: the same ending; both ranks give the group up with status 75
    cut = _stream_until_fault(cluster, lab.folder, lambda: lab.link("mini-2", up=False))
    assert cut["errors"] and cut["finish"] != "length", cut
    assert cluster.exit_code("rank0", DEADLINE_S + 10) == 75, cluster.log("rank0")
    assert cluster.exit_code("rank1", DEADLINE_S + 10) == 75, cluster.log("rank1")
    lab.link("mini-2", up=True)
    restart = time.monotonic()
    cluster.start_group()
    cluster.wait_up()
    back_after_cut_s = time.monotonic() - restart
    assert _greedy_texts(cluster, lab.folder, prompts) == alone
    assert cluster.procs["prefill"].poll() is None and cluster.procs["router"].poll() is None
    print(f"lab group: up in {up_s:.1f} s; stream ended {killed['ended_s']:.1f} s after the kill, "
          f"{cut['ended_s']:.1f} s after the cut; the group back in {back_after_kill_s:.1f} s and "
          f"{back_after_cut_s:.1f} s; {time.monotonic() - t0:.1f} s in all", file=sys.stderr)
