"""`mlx-pd serve --tensor-parallel 2` as a user runs it, in processes of its own, when things go wrong:

- a follower rank killed while the group streams a request: the client's stream ends (an error, or the
  connection closing) and the serve ends with the group's exit code (75) once the heartbeat deadline passes,
  instead of hanging in a collective that will never return; before that, the group answers a greedy
  completion with the text one rank gives.
- a memory budget that the whole model plus its KV exceeds, but each rank's share plus its KV does not: one
  rank refuses to serve, naming memory_budget_gb; two ranks serve, and on SIGTERM stop together (the follower
  told to stop, not left to notice its leader's silence), leaving no temporary file behind.

Every wait is bounded; every process started here is ended here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from cluster.parallel.heartbeat import LOST_EXIT_CODE
from cluster.ports import free_port

REPO = Path(__file__).resolve().parents[1]
START_S = 120  # a serve answers /health within this (loading, the load check, both ranks)
DEADLINE_S = 10.0  # cluster.launch.local_group.local_plan's heartbeat deadline, which serve uses
EXIT_MARGIN_S = 20.0  # on top of the deadline: the next beat check, logging, a busy CI machine

# a small random llama whose weights the ranks split (MLP and attention; the embeddings are small): 28 MiB whole,
# 14.5 MiB a rank. Each rank's KV pool is --kv-cache-gb (a rank holds half the KV heads in as many bytes, so
# twice the blocks). Figures measured on MLX's CPU backend, in MiB:
#   one rank:  weights 28.0 + KV 25.6 = 53.6 held, MLX peak about 58 (the load check's work)
#   each of 2: weights 14.5 + KV 25.6 = 40.1 held, MLX peak about 42.5 (the sharded load reads whole tensors)
# so a budget of 48 MiB sits about 5 MiB clear of both.
BUDGET_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512,
                 "hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 2048, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                 "max_position_embeddings": 2048, "tie_word_embeddings": False, "attention_bias": False,
                 "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2}
KV_GB = 0.025
BUDGET_GB = 0.047


# -- processes ------------------------------------------------------------------------------------------------

class Serve:
    """One `python -m cluster.launch.cli serve ...` child in folder `home`: its output (stdout and stderr) in
    `log`, its temporary files (a group's plan, the ring's hostfile) in `tmp`."""

    def __init__(self, model: Path, home: Path, *flags: str):
        from cluster.launch.platform import preload_env

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log, self.tmp = home / "serve.log", home / "tmp"
        self.tmp.mkdir(parents=True)
        env = {**os.environ, **preload_env(), "PYTHONPATH": str(REPO), "NO_PROXY": "127.0.0.1,localhost",
               "no_proxy": "127.0.0.1,localhost", "TMPDIR": str(self.tmp)}
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "cluster.launch.cli", "serve", "--model", str(model),
                                          "--port", str(self.port), "--log-level", "warning", *flags],
                                         cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.followers: list[int] = []

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_healthy(self) -> None:
        """Return once /health answers 200; fail, with the serve's output, when it exits or takes too long."""
        deadline = time.monotonic() + START_S
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited {self.proc.returncode} before answering:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"serve did not answer /health within {START_S} s:\n{self.output()}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.followers = follower_pids(self.proc.pid)

    def exit_code(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"serve still runs after {timeout_s:.0f} s:\n{self.output()}") from None

    def stop(self) -> None:
        """End the serve (SIGTERM, then SIGKILL) and any follower it left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in self.followers:  # a follower runs in a session of its own: a group stopped normally ends it
            end_pid(pid)


def end_pid(pid: int, wait_s: float = 10.0) -> None:
    """SIGKILL `pid` unless it already ended within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if running(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def follower_pids(parent: int) -> list[int]:
    """The children of `parent` that run a group's following rank (`python -m cluster.parallel.rank`)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"cluster.parallel.rank" in cmdline:
            found.append(int(entry.name))
    return found


@contextmanager
def serving(model: Path, home: Path, *flags: str):
    serve = Serve(model, home, *flags)
    try:
        yield serve
    finally:
        serve.stop()


def complete(base: str, model: str, prompt, max_tokens: int) -> dict:
    r = httpx.post(base + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                   "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


class Stream:
    """A streaming completion read on a thread: its chunks, the error events, and how it ended."""

    def __init__(self, base: str, model: str, prompt: str, max_tokens: int):
        self.chunks: list[dict] = []
        self.errors: list[dict] = []
        self.done_marker = False
        self.transport_error = None
        self.first_tokens = threading.Event()
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        self.thread = threading.Thread(target=self._read, args=(base, body), daemon=True)
        self.thread.start()

    def _read(self, base: str, body: dict) -> None:
        try:
            # a read timeout bounds the wait for each next event; the serve ends well within it
            with httpx.stream("POST", base + "/v1/completions", json=body,
                              timeout=httpx.Timeout(10.0, read=DEADLINE_S + EXIT_MARGIN_S + 30)) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.done_marker = True
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.errors.append(event["error"])
                    else:
                        self.chunks.append(event)
                        if len(self.chunks) >= 3:
                            self.first_tokens.set()
        except httpx.HTTPError as exc:
            self.transport_error = exc
        finally:
            self.first_tokens.set()

    def finish_reasons(self) -> list:
        return [c["choices"][0].get("finish_reason") for c in self.chunks if c.get("choices")]


# -- a follower killed mid-stream ---------------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_a_group_answers_as_one_rank_and_ends_with_exit_75_when_a_follower_is_killed_mid_stream(tmp_path):
    from benchmarks.reliability_long import fast_model_dir
    from tests.live_server import live_model_server

    model_dir = fast_model_dir()
    name = model_dir.name
    prompts = ["Hello there", "The capital of France is", "1, 2, 3,"]
    with serving(model_dir, tmp_path / "group", "--tensor-parallel", "2", "--kv-cache-gb", "0.0625") as group:
        # one rank's answers, in this process, while the group loads
        with live_model_server(model_dir, kv_cache_gb=0.0625, skip_load_check=True) as (base, _):
            expected = [complete(base, name, p, 16)["choices"][0]["text"] for p in prompts]
        group.wait_healthy()
        assert len(group.followers) == 1, f"expected one following rank, found {group.followers}"
        (follower,) = group.followers
        got = [complete(group.base, name, p, 16)["choices"][0]["text"] for p in prompts]
        assert got == expected, "two tensor-parallel ranks answered greedy completions unlike one rank"

        stream = Stream(group.base, name, "Once upon a time", max_tokens=4000)
        assert stream.first_tokens.wait(60), "the stream never started"
        assert not stream.errors and stream.transport_error is None, (stream.errors, stream.transport_error)
        os.kill(follower, signal.SIGKILL)
        code = group.exit_code(DEADLINE_S + EXIT_MARGIN_S)
        stream.thread.join(30)
        assert not stream.thread.is_alive(), "the client's stream still waits after the serve ended"
        output = group.output()
        assert code == LOST_EXIT_CODE, f"serve exited {code}, not {LOST_EXIT_CODE}:\n{output}"
        # lost by its heartbeat's silence, or sooner by the ring's collective failing on the dropped connection
        assert "rank 1 lost" in output or "the group is broken" in output, output
        # the stream ended without finishing: an error event, or the connection closing with the process
        assert stream.errors or stream.transport_error is not None or not stream.done_marker, (
            stream.errors, stream.transport_error, stream.done_marker)
        assert not any(stream.finish_reasons()), stream.finish_reasons()
        assert len(stream.chunks) < 4000


# -- a memory budget one rank exceeds and two ranks meet ------------------------------------------------------

@pytest.mark.timeout(300)
def test_a_memory_budget_the_whole_model_exceeds_is_refused_on_one_rank_and_served_across_two_that_stop_together(
        tmp_path):
    import mlx.core as mx

    from benchmarks.random_models import random_model_dir
    from cluster.memory_budget import GB
    from tests.group_helpers import rank_parameter_bytes

    model_dir = random_model_dir("budget-llama", BUDGET_CONFIG, 0, tmp_path)
    whole = sum(v.nbytes for v in mx.load(str(model_dir / "model.safetensors")).values())
    share = rank_parameter_bytes(model_dir, 0, 2)
    kv = KV_GB * GB
    # the case this test is about: a budget between each rank's weights plus KV and the whole model's
    assert share + kv < BUDGET_GB * GB < whole + kv, (share / 2**20, whole / 2**20, kv / 2**20)
    flags = ("--kv-cache-gb", str(KV_GB), "--memory-budget-gb", str(BUDGET_GB))
    with serving(model_dir, tmp_path / "one", *flags) as one, \
            serving(model_dir, tmp_path / "two", "--tensor-parallel", "2", *flags) as two:
        code = one.exit_code(START_S)
        output = one.output()
        assert code != 0, output
        assert f"memory_budget_gb={BUDGET_GB}" in output, output
        two.wait_healthy()
        answer = complete(two.base, model_dir.name, [17, 23, 99, 301, 5], 8)
        assert answer["usage"]["completion_tokens"] >= 1, answer
        ranks_report = [line for line in two.output().splitlines() if " of 2: " in line and "MiB" in line]
        assert len(ranks_report) == 2, two.output()  # each rank's weights, KV and peak, logged at load

        # asked to stop (SIGTERM), the group stops as a whole: the leader tells its follower, which ends too,
        # and neither leaves a file behind (the plan, the ring's hostfile)
        (follower,) = two.followers
        two.proc.send_signal(signal.SIGTERM)
        code = two.exit_code(30)
        output = two.output()
        assert code == 0, f"serve exited {code} on SIGTERM:\n{output}"
        assert "rank 1: the group stopped" in output, output
        deadline = time.monotonic() + 15
        while running(follower) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(follower), "the follower outlived its stopped group"
        assert not list(two.tmp.glob("mlx-pd-*")), list(two.tmp.iterdir())


def test_a_pipeline_rank_over_its_budget_stops_every_rank_with_a_refusal_not_a_lost_group(tmp_path):
    """5 layers in a pipeline of 2: rank 0 holds 3, rank 1 holds 2, so a budget between their weights refuses
    rank 0 only. Rank 1, which passed, must refuse with it (exit 2, naming the rank that refused), not wait in a
    collective that rank 0 never joins until its heartbeat deadline ends the group as lost (exit 75)."""
    from cluster.memory_budget import GB
    from tests.group_helpers import model_folder, rank_parameter_bytes

    folder = model_folder("qwen3_moe", tmp_path, layers=5)
    heavy, light = (rank_parameter_bytes(folder, r, 2, "pipeline") for r in (0, 1))
    assert light < heavy
    budget = f"{(heavy + light) / 2 / GB:.6f}"
    t0 = time.monotonic()
    with serving(folder, tmp_path / "pp", "--pipeline-parallel", "2", "--kv-cache-gb", "0.001",
                 "--memory-budget-gb", budget) as group:
        code = group.exit_code(START_S)
        output = group.output()
    assert code == 2, f"exit {code}:\n{output}"
    assert "rank 0 of 2: the model's weights" in output and f"memory_budget_gb={budget}" in output, output
    assert "rank 1: rank 0 of the group refused to serve" in output, output
    assert "lost" not in output, output
    assert time.monotonic() - t0 < 60
