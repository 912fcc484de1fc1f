"""Pieces for running the real agent CLIs (Claude Code, Codex) against `mlx-pd serve`.

- `long_context_model_dir()`: a random-weight llama as an mlx-lm folder (tests/family_helpers.py's llama config,
  float32, untied output head) with `max_position_embeddings = 131072` and SmolLM2's tokenizer and chat
  template, so the CLIs' 9-12k-token prompts fit with room to spare, as on a real long-context model. Its
  weights are random but for one feature: the end-of-turn token `<|im_end|>` wins greedy decoding wherever it is
  allowed (`end_turns_at_once`), so a plain answer ends at once and a forced tool call ends right after its
  arguments. Both CLIs fail a session whose answer stops at its token limit ("response exceeded the output
  token maximum", "Incomplete response returned"), and a purely random model never ends a turn;
- `serve(folder, name, aliases)`: `mlx-pd serve` on it as a subprocess (scripts/env.sh's environment), waiting
  for /health with a deadline, stopped at exit of the `with`;
- `ForcingProxy`: a loopback HTTP proxy between a CLI and the server. A random model never calls a tool on its
  own, so the proxy forces the tool choice of the first model request that offers a chosen tool (Anthropic
  `{"type": "tool", "name": ...}`, Responses `{"type": "function", "name": ...}`), caps every model request's
  `max_tokens` / `max_output_tokens` (a random model otherwise writes until the context is full) and sets
  `temperature` 0 (greedy, so a session is the same every run). It records every request (method, path,
  status, JSON body) and streams answers (SSE) through as they come;
- `agent_cli(name)`: the installed CLI's executable (scripts/agents/install puts them in
  $MLXPD_AGENT_CLIS, by default ~/.cache/mlx-pd/agent-clis); skips the test when it is missing, except in CI
  (CI=true), where that is a failure;
- `run_cli(...)`: runs a CLI in its own process group with a deadline, killing the group when it passes.
"""

from __future__ import annotations

import atexit
import functools
import gzip
import http.client
import http.server
import json
import os
import shutil
import signal
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
CONTEXT = 131072
MODEL_PATHS = ("/v1/messages", "/v1/responses")  # POSTs that run the model (count_tokens does not)
ANSWER_LIMIT = 4 << 20  # bytes of each answer the proxy keeps
CLI_VERSIONS = {"claude": "2.1.332", "codex": "0.171.0"}  # pinned in scripts/agents/install


# --------------------------------------------------------------------------------------------------
# The model folder and the server
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def long_context_model_dir() -> Path:
    """The llama folder (see the module docstring), built once per session into a temporary folder removed at
    exit: config.json, model.safetensors (float32 weights from seed 21), SmolLM2's tokenizer files with its
    chat template."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from transformers import AutoTokenizer

    from cluster.gguf_import import ensure_default_model
    from tests.family_helpers import COMMON, CONFIGS, build

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_default_model(progress=False)))
    root = Path(tempfile.mkdtemp(prefix="agent-cli-model-"))
    atexit.register(shutil.rmtree, root, True)
    folder = root / "llama-131k"
    config = {"model_type": "llama", **COMMON, **CONFIGS["llama"], "tie_word_embeddings": False,
              "vocab_size": len(tokenizer), "max_position_embeddings": CONTEXT}
    model = build("llama", config, seed=21)
    end_turns_at_once(model, config["eos_token_id"])
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(str(folder))
    return folder


def end_turns_at_once(model, eos: int, weight: float = 100.0) -> None:
    """Make `eos` the greedy choice at every position of the random llama `model`: residual feature 0 is a
    constant (every token's embedding has 0.1 there, no attention or MLP output writes to it), and only `eos`'s
    output row reads it (`weight`; the other rows' entry is 0). After the final RMSNorm that feature is
    positive, so `eos`'s logit is about `weight` times it, far above the others (random, about +-1). Constrained
    decoding (a forced tool call) still masks `eos` until the call is complete."""
    import mlx.core as mx

    inner = model.model
    inner.embed_tokens.weight[:, 0] = 0.1
    for layer in inner.layers:
        layer.self_attn.o_proj.weight[0, :] = 0.0
        layer.mlp.down_proj.weight[0, :] = 0.0
    model.lm_head.weight[:, 0] = 0.0
    model.lm_head.weight[eos, 0] = weight
    mx.eval(model.parameters())


def _free_port() -> int:
    from cluster.ports import free_port

    return free_port()


def server_env() -> dict[str, str]:
    """This process's environment plus scripts/env.sh's (the OpenBLAS preload), no proxies for loopback."""
    env = dict(os.environ)
    out = subprocess.run(["bash", "-c", "source scripts/env.sh && printf %s \"${LD_PRELOAD:-}\""], cwd=REPO,
                         capture_output=True, text=True, timeout=30, env=env)
    if out.stdout:
        env["LD_PRELOAD"] = out.stdout
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


@contextmanager
def serve(folder: Path, name: str, aliases: tuple[str, ...] = (), kv_cache_gb: float = 0.5,
          start_deadline: float = 120) -> Iterator[str]:
    """`mlx-pd serve --model FOLDER --served-model-name NAME ALIASES... --port P` as a subprocess; yields its base
    URL once /health answers 200 (within `start_deadline` seconds). Its output goes to a log file whose tail is in
    the failure message when it does not start. SIGTERM at the end, SIGKILL if it is still up after 20 s."""
    port = _free_port()
    log_path = Path(tempfile.mkdtemp(prefix="agent-cli-serve-")) / "serve.log"
    cmd = [str(REPO / ".venv" / "bin" / "mlx-pd"), "serve", "--model", str(folder), "--served-model-name", name,
           *aliases, "--port", str(port), "--kv-cache-gb", str(kv_cache_gb), "--log-level", "warning"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=server_env(), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_deadline
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"mlx-pd serve exited {proc.returncode}:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"mlx-pd serve did not answer /health in {start_deadline:.0f} s:\n"
                                     f"{_tail(log_path)}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.25)
        yield base
    finally:
        _stop(proc)
        shutil.rmtree(log_path.parent, ignore_errors=True)


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"


# --------------------------------------------------------------------------------------------------
# The proxy
# --------------------------------------------------------------------------------------------------


@dataclass
class Exchange:
    """One request through the proxy: what the CLI sent (after the proxy's rewrite) and the server's status."""

    method: str
    path: str
    body: Any  # the JSON body as forwarded (None without one)
    status: int = 0
    rewritten: list[str] = field(default_factory=list)  # what the proxy changed, e.g. "tool_choice=NAME"
    answer: bytes = b""  # the answer's body (its first ANSWER_LIMIT bytes)
    seconds: float = 0.0  # from the request's arrival to the answer's last byte

    @property
    def prompt_tokens(self) -> Optional[int]:
        """The prompt's length in tokens as the answer's usage reports it (cached tokens included)."""
        for line in self.answer.decode("utf-8", "replace").splitlines():
            if not line.startswith("data:"):
                continue
            try:
                event = json.loads(line[5:])
            except ValueError:
                continue
            if event.get("type") == "message_start":
                usage = event["message"].get("usage") or {}
                return (usage.get("input_tokens") or 0) + (usage.get("cache_read_input_tokens") or 0)
            if event.get("type") == "response.completed":
                return ((event["response"].get("usage") or {}).get("input_tokens"))
        return None

    @property
    def is_model_request(self) -> bool:
        return self.method == "POST" and self.path.split("?")[0].rstrip("/") in MODEL_PATHS

    def summary(self) -> str:
        extra = f" [{', '.join(self.rewritten)}]" if self.rewritten else ""
        text = "" if self.status == 200 else " " + self.answer[:600].decode("utf-8", "replace")
        return f"{self.method} {self.path} -> {self.status}{extra}{text}"


def offered_tools(body: Any) -> set[str]:
    """The names of the tools a request offers (top-level `tools`, inside `namespace` tools too)."""
    names: set[str] = set()

    def walk(tools: Any) -> None:
        for tool in tools if isinstance(tools, list) else []:
            if isinstance(tool, dict):
                if tool.get("type") == "namespace":
                    walk(tool.get("tools"))
                elif isinstance(tool.get("name"), str):
                    names.add(tool["name"])

    walk(body.get("tools") if isinstance(body, dict) else None)
    return names


class ForcingProxy:
    """The proxy of the module docstring, on a free loopback port (`base_url`); a context manager.

    `force_tool` is the tool whose call the first model request that offers it is made to return;
    `max_tokens` caps every model request's output; `exchanges` lists every request in arrival order.
    """

    def __init__(self, upstream: str, force_tool: str, max_tokens: int, timeout: float = 300):
        self.upstream = upstream.removeprefix("http://")
        self.force_tool = force_tool
        self.max_tokens = max_tokens
        self.timeout = timeout
        self.exchanges: list[Exchange] = []
        self.forced = False
        self.lock = threading.Lock()
        handler = type("Handler", (_ProxyHandler,), {"proxy": self})
        self.server = _ThreadingServer(("127.0.0.1", 0), handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                       daemon=True)

    def __enter__(self) -> "ForcingProxy":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)

    def rewrite(self, path: str, body: Any, exchange: Exchange) -> Any:
        """The body to forward: the first request offering the tool gets a forced tool_choice; every model
        request gets the token cap and temperature 0."""
        if not isinstance(body, dict) or not exchange.is_model_request:
            return body
        body = dict(body)
        anthropic = path.split("?")[0].rstrip("/").endswith("/messages")
        with self.lock:
            force = not self.forced and self.force_tool in offered_tools(body)
            self.forced = self.forced or force
        if force:
            body["tool_choice"] = ({"type": "tool", "name": self.force_tool} if anthropic
                                   else {"type": "function", "name": self.force_tool})
            exchange.rewritten.append(f"tool_choice={self.force_tool}")
        key = "max_tokens" if anthropic else "max_output_tokens"
        body[key] = min(int(body.get(key) or self.max_tokens), self.max_tokens)
        body["temperature"] = 0
        exchange.rewritten.append(f"{key}={body[key]}")
        return body

    def model_requests(self) -> list[Exchange]:
        return [e for e in self.exchanges if e.is_model_request]

    def report(self) -> str:
        return "\n".join(f"  {i}. {e.summary()}" for i, e in enumerate(self.exchanges))


class _ThreadingServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authorization",
               "proxy-authenticate", "content-length", "content-encoding", "host", "accept-encoding"}


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    proxy: ForcingProxy

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def do_GET(self) -> None:
        self._forward()

    do_POST = do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_GET

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline(65537).strip().split(b";")[0] or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline(65537)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _forward(self) -> None:
        proxy = self.proxy
        self.connection.settimeout(proxy.timeout)
        raw = self._read_body()
        encoding = self.headers.get("Content-Encoding", "").strip().lower()
        if encoding == "gzip":
            raw = gzip.decompress(raw)
        elif encoding:
            raise RuntimeError(f"the proxy cannot read a {encoding} request body ({self.command} {self.path})")
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        start = time.monotonic()
        exchange = Exchange(self.command, self.path, body)
        with proxy.lock:
            proxy.exchanges.append(exchange)
        if body is not None:
            exchange.body = body = proxy.rewrite(self.path, body, exchange)
            raw = json.dumps(body).encode()
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
        headers["Content-Length"] = str(len(raw))
        upstream = http.client.HTTPConnection(proxy.upstream, timeout=proxy.timeout)
        try:
            upstream.request(self.command, self.path, body=raw if raw or self.command != "GET" else None,
                             headers=headers)
            answer = upstream.getresponse()
            exchange.status = answer.status
            self.send_response(answer.status)
            for key, value in answer.getheaders():
                if key.lower() not in HOP_HEADERS:
                    self.send_header(key, value)
            if self.command == "HEAD":
                self.send_header("Content-Length", answer.getheader("Content-Length") or "0")
                self.end_headers()
                return
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while True:
                chunk = answer.read1(65536)  # what has arrived: SSE events go on as they come
                if not chunk:
                    break
                if len(exchange.answer) < ANSWER_LIMIT:
                    exchange.answer += chunk[:ANSWER_LIMIT - len(exchange.answer)]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        finally:
            exchange.seconds = time.monotonic() - start
            upstream.close()


# --------------------------------------------------------------------------------------------------
# The CLIs
# --------------------------------------------------------------------------------------------------


def cli_dir() -> Path:
    """Where scripts/agents/install puts the CLIs: $MLXPD_AGENT_CLIS, else ~/.cache/mlx-pd/agent-clis."""
    return Path(os.environ.get("MLXPD_AGENT_CLIS") or Path.home() / ".cache" / "mlx-pd" / "agent-clis")


def agent_cli(name: str) -> Path:
    """The executable of CLI `name` ("claude" or "codex") at its pinned version. Without it (or without node):
    skip, except in CI (CI=true), where it is a failure, so CI never skips these tests silently."""
    exe = cli_dir() / "node_modules" / ".bin" / name
    why = None
    if shutil.which("node") is None:
        why = "node is not installed (the agent CLIs are npm packages; scripts/agents/install needs node and npm)"
    elif not exe.exists():
        why = f"{exe} is not installed (run scripts/agents/install; .ci/run does in CI)"
    else:
        version = installed_version(name)
        if version != CLI_VERSIONS[name]:
            why = (f"{name} {version} is installed at {exe}, not the pinned {CLI_VERSIONS[name]} "
                   f"(run scripts/agents/install)")
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return exe


def installed_version(name: str) -> Optional[str]:
    package = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex"}[name]
    try:
        meta = json.loads((cli_dir() / "node_modules" / package / "package.json").read_text())
    except (OSError, ValueError):
        return None
    return meta.get("version")


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    """A clean environment for a CLI: PATH and locale from this process, HOME and the XDG folders and TMPDIR in
    `home` (no user config leaks in), no proxies for loopback, plus `extra`."""
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "USER", "LOGNAME", "SHELL")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    env.update({"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "XDG_CACHE_HOME": str(home / ".cache"),
                "TMPDIR": str(home / "tmp"), "NO_COLOR": "1", "NO_PROXY": "127.0.0.1,localhost",
                "no_proxy": "127.0.0.1,localhost"})
    env.update(extra)
    return env


@dataclass
class CliRun:
    returncode: int
    output: str
    seconds: float


def run_cli(cmd: list[str], env: dict[str, str], cwd: Path, deadline: float) -> CliRun:
    """Run `cmd` in its own process group, stdin closed, output captured; past `deadline` seconds the group gets
    SIGTERM, then SIGKILL, and the return code is 124."""
    start = time.monotonic()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            _stop(proc)
            rc = 124
        out.seek(0)
        text = out.read().decode("utf-8", "replace")
    return CliRun(rc, text, time.monotonic() - start)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
