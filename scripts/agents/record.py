#!/usr/bin/env python3
"""Record the exact HTTP requests that agent CLIs (Claude Code, Codex) send to a model server.

What it does
------------
1. Starts a small recording HTTP server on 127.0.0.1 (a free port). It logs every request it
   receives (method, path, query, headers with secret values redacted, JSON body) as one JSON file
   per request in a raw folder, and answers with minimal but valid replies so that the CLI
   proceeds:

   * ``POST /v1/messages`` (Anthropic Messages API, streamed or not): an assistant text "OK"; when
     ``"stream": true`` as the SSE events message_start / content_block_start /
     content_block_delta / content_block_stop / message_delta / message_stop;
   * ``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``;
   * ``POST /v1/responses`` (OpenAI Responses API, streamed or not): an assistant message "OK"; when
     streamed as the SSE events response.created / response.output_item.added /
     response.content_part.added / response.output_text.delta / response.output_text.done /
     response.content_part.done / response.output_item.done / response.completed (with a usage).
     A Codex compaction request (``input`` ending in ``{"type": "compaction_trigger"}``) gets one
     ``compaction`` output item, or the HTTP error chosen with ``--compaction-reply``;
   * ``GET /v1/models``: a one-model list;
   * anything else: 404, logged like the rest.

   With ``--tool-call NAME`` (repeatable), the first model request of a run that offers tools with
   those names (in the top-level ``tools``, inside a ``namespace`` tool, or in a Codex
   ``additional_tools`` input item) is answered with a call of each of them instead of text
   (Anthropic: ``tool_use`` blocks; Responses: ``function_call`` items, or ``custom_tool_call``
   items for freeform ``custom`` tools, carrying ``"namespace"`` when the tool sits in one), with
   harmless read-only arguments (``--tool-args`` overrides them). The CLI runs the tool and sends
   the result back in a follow-up request, which is recorded too; that one is answered with text,
   so the run ends.

2. Runs each installed CLI once, non-interactively, against the recorder, with a one-line prompt,
   in a fresh temporary working directory and a fresh temporary HOME (no user config leaks in):

   * ``claude``: ``claude -p PROMPT`` with ``ANTHROPIC_BASE_URL`` = the recorder and
     ``ANTHROPIC_API_KEY`` = a dummy; everything else default (model, thinking, betas);
   * ``claude-custom``: the same with ``ANTHROPIC_MODEL=<--claude-model>``, a model id Claude Code
     does not know (what a local server's users set); it changes ``max_tokens``,
     ``output_config`` and the betas;
   * ``codex``: ``codex exec --skip-git-repo-check PROMPT`` with ``CODEX_HOME`` = a temporary
     folder whose ``config.toml`` selects a custom model provider (``wire_api = "responses"``,
     ``base_url`` = the recorder, ``env_key`` = a variable holding a dummy key); the model is left
     at Codex's default (``codex exec`` defaults to ``--sandbox read-only``, approvals ``never``);
   * ``codex-custom``: the same with ``model = "<--codex-model>"`` in ``config.toml``, a model
     Codex has no bundled metadata for (what a local server's users configure). Codex then sends
     a quite different request (classic top-level ``tools``, no code mode);
   * ``codex-openai``: Codex's built-in ``openai`` provider with ``openai_base_url`` moved to the
     recorder (and ``CODEX_API_KEY`` = a dummy), as a user who only overrides the base URL gets.
     Codex then first tries the Responses websocket (``GET /v1/responses`` with ``Upgrade:
     websocket``, answered 404, so it falls back to HTTP) and, being "OpenAI", compacts remotely.
     The run sets ``model_auto_compact_token_limit = 1`` and makes a tool call (``exec`` unless
     ``--tool-call`` names others), so that a mid-turn compaction request follows the tool result.

3. Writes pretty JSON fixtures (``{"cli", "version", "note", "method", "path", "query", "headers",
   "body"}``) into ``--out``:

   * ``claude_code_first_request.json``: the first ``POST /v1/messages`` that carries tools;
   * ``claude_code_side_request.json``: the first other ``POST /v1/messages`` (a small-model side
     request), if there is one;
   * ``codex_first_request.json`` / ``codex_custom_model_first_request.json``: the first
     ``POST /v1/responses`` of each Codex run;
   * ``*_tool_result_request.json``: with ``--tool-call``, the follow-up that carries the
     ``tool_result`` block / ``function_call_output`` or ``custom_tool_call_output`` item;
   * ``agents_other_requests.json``: a list of further requests, each with its ``run``: the
     claude-custom run's first request; the codex-openai run's remote compaction (v2) request, a
     ``POST /v1/responses`` whose ``input`` ends in ``{"type": "compaction_trigger"}`` (only these
     are kept from those two "variant" runs: their other requests match the main runs', the
     codex-openai ones plus a trailing ``configuration_update`` input item); and one example of
     every other request kind seen (Claude Code's ``HEAD /api/hello`` probe, Codex's websocket
     ``GET /v1/responses``).

   Temporary paths are replaced by ``<WORKDIR>``, ``<HOME>``, ``<CODEX_HOME>``, ``<TMP>`` so that
   re-recordings diff cleanly (ids, dates and the OS string still change). The full raw log of
   every request stays in ``--raw`` (default: a new folder under /tmp, printed at the end).

How to run
----------
Install the CLIs outside the repo first (both ship their native binary in a per-platform npm
package, an optional dependency, so only the npm registry has to be reachable)::

    npm install --prefix /tmp/agent-clis @anthropic-ai/claude-code@latest @openai/codex@latest

Then, from the repository root::

    python3 scripts/agents/record.py --cli-dir /tmp/agent-clis --out tests/fixtures/agents \\
        --tool-call Read --tool-call exec --tool-call exec_command

(``Read`` is Claude Code's file reader, pointed at ``<WORKDIR>/hello.txt``; ``exec`` is Codex's
code-mode JavaScript tool in the ``functions`` namespace, sent a script that runs ``echo hi``
through ``tools.exec_command``; ``exec_command`` is the plain shell tool Codex offers a custom
model, sent ``{"cmd": "echo hi"}``.) ``--only RUN`` (repeatable; claude, claude-custom, codex,
codex-custom, codex-openai) records some runs only; ``--compaction-reply 400|404`` answers
compaction requests with that error instead (Codex 0.171 then fails the turn, after two retries
for a 404);
``--namespace-style omit|flat`` names a namespaced Responses tool call without its ``namespace``
field (Codex then answers ``unsupported call: NAME``, except for the default ``functions``
namespace); ``--serve`` only runs the recorder (to point a CLI at it by hand) until
``--timeout`` or Ctrl-C. Every wait has a deadline (``--timeout`` per CLI run). Python 3 standard
library only.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import http.server
import json
import os
import signal
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "agents"
DEFAULT_CLI_DIR = Path("/tmp/agent-clis")
DEFAULT_CUSTOM_MODEL = "SmolLM2-135M-Instruct"  # mlx-pd's default model
# Run label -> fixture file prefix. The "variant" runs keep a single request, in agents_other_requests.json.
RUNS = {"claude": "claude_code", "claude-custom": "claude_code_custom_model", "codex": "codex",
        "codex-custom": "codex_custom_model", "codex-openai": "codex_openai_provider"}
VARIANT_KEEP = {"claude-custom": "first_request", "codex-openai": "compaction_request"}
DUMMY_KEY = "sk-recorder-dummy-key"
CODEX_KEY_ENV = "RECORDER_API_KEY"
PROMPT = "Reply with the single word OK."
CLAUDE_TOOL_PROMPT = "Read the file hello.txt in the current directory and tell me what it says."
CODEX_TOOL_PROMPT = "Run `echo hi` in the shell and tell me what it printed."
HTTP_TIMEOUT = 60  # seconds a connection may sit idle

# Header names whose values are never written anywhere (the name stays, the value becomes "<redacted>").
SECRET_HEADER_WORDS = ("authorization", "api-key", "apikey", "token", "cookie", "secret", "password")

# Harmless read-only arguments for tools the recorder may call, by tool name ({workdir} is replaced).
# Function tools get a JSON object; freeform (custom) tools get a string.
DEFAULT_TOOL_ARGS: dict[str, Any] = {
    # Claude Code
    "Read": {"file_path": "{workdir}/hello.txt"},
    "Glob": {"pattern": "*.txt"},
    "Grep": {"pattern": "hello"},
    "Bash": {"command": "echo hi", "description": "Print hi"},
    # Codex
    "exec_command": {"cmd": "echo hi", "workdir": "{workdir}"},
    "shell_command": {"command": "echo hi", "workdir": "{workdir}"},
    "shell": {"command": ["echo", "hi"], "workdir": "{workdir}"},
    "exec": 'const r = await tools.exec_command({cmd: "echo hi"});\ntext(r.output);\n',
    "list_dir": {"dir_path": "{workdir}"},
    "read_file": {"file_path": "{workdir}/hello.txt"},
}


# --------------------------------------------------------------------------------------------------
# Request inspection
# --------------------------------------------------------------------------------------------------


def _redact_headers(headers: list[tuple[str, str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in headers:
        key = name.lower()
        if any(word in key for word in SECRET_HEADER_WORDS):
            value = "<redacted>"
        out[key] = value if key not in out else out[key] + ", " + value
    return out


def _decode_body(raw: bytes, encoding: str) -> tuple[Any, str | None]:
    """The request body as JSON (or text), and a note when it could not be decoded."""
    encoding = (encoding or "").strip().lower()
    try:
        if encoding == "gzip":
            raw = gzip.decompress(raw)
        elif encoding == "deflate":
            raw = zlib.decompress(raw)
        elif encoding == "zstd":
            try:
                from compression import zstd  # type: ignore[import-not-found]  # Python >= 3.14

                raw = zstd.decompress(raw)
            except ImportError:
                return None, f"zstd-compressed body ({len(raw)} bytes) not decoded (needs Python 3.14)"
    except Exception as exc:  # noqa: BLE001 - a recorder logs, it does not fail
        return None, f"could not decompress {encoding} body: {exc!r}"
    if not raw:
        return None, None
    text = raw.decode("utf-8", errors="replace")
    try:
        return json.loads(text), None
    except ValueError:
        return text, "body is not JSON"


def _tool_entries(body: Any) -> dict[str, tuple[str | None, str]]:
    """Every callable tool a request offers: name -> (namespace or None, "function" | "custom").

    Looks at the top-level ``tools`` list (Anthropic, OpenAI) and at Codex's ``additional_tools``
    input items (its "responses lite" mode carries tools there), descending into ``namespace`` tools.
    """
    found: dict[str, tuple[str | None, str]] = {}
    if not isinstance(body, dict):
        return found
    lists = [body.get("tools")]
    for item in body.get("input") or []:
        if isinstance(item, dict) and item.get("type") == "additional_tools":
            lists.append(item.get("tools"))

    def walk(tools: Any, namespace: str | None) -> None:
        for tool in tools if isinstance(tools, list) else []:
            if not isinstance(tool, dict):
                continue
            if tool.get("type") == "namespace":
                walk(tool.get("tools"), tool.get("name"))
            elif isinstance(tool.get("name"), str):
                kind = "custom" if tool.get("type") == "custom" else "function"
                found.setdefault(tool["name"], (namespace, kind))

    for tools in lists:
        walk(tools, None)
    return found


def _has_tool_result(body: Any) -> bool:
    if not isinstance(body, dict):
        return False
    for msg in body.get("messages") or []:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list) and any(
            isinstance(block, dict) and block.get("type") == "tool_result" for block in content
        ):
            return True
    items = body.get("input")
    if isinstance(items, list):
        return any(isinstance(i, dict) and str(i.get("type", "")).endswith("_call_output") for i in items)
    return False


def _is_compaction(body: Any) -> bool:
    items = body.get("input") if isinstance(body, dict) else None
    return bool(isinstance(items, list) and items and isinstance(items[-1], dict)
                and items[-1].get("type") == "compaction_trigger")


def _sse(events: list[tuple[str, dict[str, Any]]]) -> bytes:
    return b"".join(
        f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode() for name, data in events
    )


def _rid(prefix: str) -> str:
    return f"{prefix}_recorder_{uuid.uuid4().hex[:16]}"


# --------------------------------------------------------------------------------------------------
# Recorder server
# --------------------------------------------------------------------------------------------------


@dataclass
class ToolCall:
    name: str
    namespace: str | None
    kind: str  # "function" | "custom"
    args: Any  # dict for function tools, str for custom tools


class Recorder:
    """State shared by the request handler threads: the log folder, a counter, the tool plan."""

    def __init__(self, raw_dir: Path, tool_calls: list[str], tool_args: Any, namespace_style: str,
                 compaction_reply: str):
        self.raw_dir = raw_dir
        self.tool_calls = tool_calls
        self.tool_args = tool_args
        self.namespace_style = namespace_style
        self.compaction_reply = compaction_reply
        self.lock = threading.Lock()
        self.count = 0
        self.tool_call_sent: set[str] = set()  # run labels that already got their tool call
        self.label = "manual"
        self.workdir = str(raw_dir)

    def set_run(self, label: str, workdir: str, tool_calls: list[str]) -> None:
        with self.lock:
            self.label = label
            self.workdir = workdir
            self.tool_calls = tool_calls

    def log(self, entry: dict[str, Any]) -> None:
        with self.lock:
            self.count += 1
            entry = {"seq": self.count, "run": self.label, **entry}
            path = self.raw_dir / f"{self.count:04d}.json"
        path.write_text(json.dumps(entry, indent=2, ensure_ascii=False) + "\n")

    def pick_tool_calls(self, body: Any) -> list[ToolCall]:
        """The tool calls to answer this request with (empty: answer with text)."""
        if not self.tool_calls or _has_tool_result(body) or _is_compaction(body):
            return []
        offered = _tool_entries(body)
        with self.lock:
            if self.label in self.tool_call_sent:
                return []
            calls = []
            for name in self.tool_calls:
                if name in offered:
                    namespace, kind = offered[name]
                    args = self.tool_args if self.tool_args is not None else DEFAULT_TOOL_ARGS.get(name, {})
                    args = json.loads(json.dumps(args).replace("{workdir}", self.workdir))
                    if kind == "custom" and not isinstance(args, str):
                        args = json.dumps(args)
                    calls.append(ToolCall(name, namespace, kind, args))
            if calls:
                self.tool_call_sent.add(self.label)
            return calls


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "agent-recorder/1"
    recorder: Recorder  # set on the subclass made by make_server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def do_GET(self) -> None:
        self._handle()

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

    def _handle(self) -> None:
        self.connection.settimeout(HTTP_TIMEOUT)
        split = urlsplit(self.path)
        body, note = _decode_body(self._read_body(), self.headers.get("Content-Encoding", ""))
        entry: dict[str, Any] = {
            "time": time.time(),
            "method": self.command,
            "path": split.path,
            "query": dict(parse_qsl(split.query, keep_blank_values=True)),
            "headers": _redact_headers(list(self.headers.items())),
            "body": body,
        }
        if note:
            entry["body_note"] = note
        status, ctype, payload, reply_note = self._reply(split.path, body)
        entry["reply"] = {"status": status, "note": reply_note}
        self.recorder.log(entry)
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        if ctype.startswith("text/event-stream"):
            self.send_header("Cache-Control", "no-cache")
        self.send_header("request-id", _rid("req"))
        self.send_header("x-request-id", _rid("req"))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _reply(self, path: str, body: Any) -> tuple[int, str, bytes, str]:
        path = path.rstrip("/")
        if self.command == "POST" and path.endswith("/messages/count_tokens"):
            size = max(1, len(json.dumps(body)) // 4)
            return 200, "application/json", json.dumps({"input_tokens": size}).encode(), "count_tokens"
        if self.command == "POST" and path.endswith("/messages"):
            return self._anthropic(body if isinstance(body, dict) else {})
        if self.command == "POST" and path.endswith("/responses"):
            return self._responses(body if isinstance(body, dict) else {})
        if self.command == "GET" and path.endswith("/models"):
            data = {"object": "list",
                    "data": [{"id": "recorder-model", "object": "model", "created": 0, "owned_by": "recorder"}]}
            return 200, "application/json", json.dumps(data).encode(), "models"
        return self._error(404, f"recorder: no route {self.command} {path}")

    @staticmethod
    def _error(status: int, message: str) -> tuple[int, str, bytes, str]:
        kind = {400: "invalid_request_error", 404: "not_found_error"}.get(status, "api_error")
        err = {"type": "error", "error": {"type": kind, "message": message, "code": None, "param": None}}
        return status, "application/json", json.dumps(err).encode(), str(status)

    # ---- Anthropic Messages ------------------------------------------------------------------------

    def _anthropic(self, body: dict[str, Any]) -> tuple[int, str, bytes, str]:
        model = str(body.get("model") or "recorder-model")
        msg_id = _rid("msg")
        usage = {"input_tokens": 10, "output_tokens": 1, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        calls = self.recorder.pick_tool_calls(body)
        if calls:
            blocks = [{"type": "tool_use", "id": _rid("toolu"), "name": c.name, "input": c.args} for c in calls]
            stop, note = "tool_use", "tool_use " + ", ".join(c.name for c in calls)
        else:
            blocks = [{"type": "text", "text": "OK"}]
            stop, note = "end_turn", "text OK"
        if not body.get("stream"):
            message = {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": blocks,
                       "stop_reason": stop, "stop_sequence": None, "usage": usage}
            return 200, "application/json", json.dumps(message).encode(), note
        events: list[tuple[str, dict[str, Any]]] = [
            ("message_start", {"type": "message_start", "message": {
                "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": dict(usage, output_tokens=0)}}),
        ]
        for index, block in enumerate(blocks):
            if block["type"] == "tool_use":
                start = dict(block, input={})
                delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            else:
                start = {"type": "text", "text": ""}
                delta = {"type": "text_delta", "text": block["text"]}
            events += [
                ("content_block_start", {"type": "content_block_start", "index": index, "content_block": start}),
                ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}),
                ("content_block_stop", {"type": "content_block_stop", "index": index}),
            ]
        events += [
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                               "usage": {"output_tokens": 1}}),
            ("message_stop", {"type": "message_stop"}),
        ]
        return 200, "text/event-stream; charset=utf-8", _sse(events), note

    # ---- OpenAI Responses --------------------------------------------------------------------------

    def _responses(self, body: dict[str, Any]) -> tuple[int, str, bytes, str]:
        model = str(body.get("model") or "recorder-model")
        usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": 1, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 11}
        base = {"id": _rid("resp"), "object": "response", "created_at": int(time.time()), "model": model}
        items: list[dict[str, Any]] = []
        events: list[tuple[str, dict[str, Any]]] = []

        def added(index: int, item: dict[str, Any]) -> None:
            events.append(("response.output_item.added",
                           {"type": "response.output_item.added", "output_index": index, "item": item}))

        def done(index: int, item: dict[str, Any]) -> None:
            items.append(item)
            events.append(("response.output_item.done",
                           {"type": "response.output_item.done", "output_index": index, "item": item}))

        if _is_compaction(body):
            if self.recorder.compaction_reply != "ok":
                status = int(self.recorder.compaction_reply)
                return self._error(status, "recorder: compaction refused")[:3] + (f"compaction -> {status}",)
            item = {"type": "compaction", "id": _rid("cmp"), "encrypted_content": "recorder compaction summary"}
            added(0, item)
            done(0, item)
            note = "compaction item"
        elif calls := self.recorder.pick_tool_calls(body):
            for index, call in enumerate(calls):
                item_id, call_id = _rid("fc" if call.kind == "function" else "ctc"), _rid("call")
                name = call.name
                if call.namespace and self.recorder.namespace_style == "flat":
                    name = f"{call.namespace}__{call.name}"
                if call.kind == "function":
                    item = {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
                            "arguments": json.dumps(call.args), "status": "completed"}
                    field, kind = "arguments", "function_call_arguments"
                else:
                    item = {"type": "custom_tool_call", "id": item_id, "call_id": call_id, "name": name,
                            "input": call.args, "status": "completed"}
                    field, kind = "input", "custom_tool_call_input"
                if call.namespace and self.recorder.namespace_style == "field":
                    item["namespace"] = call.namespace
                added(index, dict(item, **{field: "", "status": "in_progress"}))
                ids = {"item_id": item_id, "output_index": index}
                events.append((f"response.{kind}.delta",
                               {"type": f"response.{kind}.delta", **ids, "delta": item[field]}))
                events.append((f"response.{kind}.done", {"type": f"response.{kind}.done", **ids, field: item[field]}))
                done(index, item)
            note = ", ".join(f"{i['type']} {i.get('namespace', '') + '.' if i.get('namespace') else ''}{i['name']}"
                             for i in items)
        else:
            text = "OK"
            item = {"type": "message", "id": _rid("msg"), "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}
            part = {"type": "output_text", "text": "", "annotations": []}
            ids = {"item_id": item["id"], "output_index": 0, "content_index": 0}
            added(0, dict(item, status="in_progress", content=[]))
            events += [
                ("response.content_part.added", {"type": "response.content_part.added", **ids, "part": part}),
                ("response.output_text.delta", {"type": "response.output_text.delta", **ids, "delta": text}),
                ("response.output_text.done", {"type": "response.output_text.done", **ids, "text": text}),
                ("response.content_part.done", {"type": "response.content_part.done", **ids,
                                                "part": dict(part, text=text)}),
            ]
            done(0, item)
            note = "text OK"
        completed = dict(base, status="completed", output=items, usage=usage)
        if not body.get("stream"):
            return 200, "application/json", json.dumps(completed).encode(), note
        events = [
            ("response.created", {"type": "response.created",
                                  "response": dict(base, status="in_progress", output=[], usage=None)}),
            *events,
            ("response.completed", {"type": "response.completed", "response": completed}),
        ]
        for seq, (_name, data) in enumerate(events):
            data["sequence_number"] = seq
        return 200, "text/event-stream; charset=utf-8", _sse(events), note


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def make_server(recorder: Recorder, port: int = 0) -> _Server:
    handler = type("BoundHandler", (Handler,), {"recorder": recorder})
    return _Server(("127.0.0.1", port), handler)


# --------------------------------------------------------------------------------------------------
# Running the CLIs
# --------------------------------------------------------------------------------------------------


def _bin(cli_dir: Path, name: str) -> Path:
    return cli_dir / "node_modules" / ".bin" / name


def _version(exe: Path, env: dict[str, str]) -> str:
    try:
        out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60, env=env,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"? ({exc!r})"
    lines = (out.stdout or out.stderr).strip().splitlines()
    return lines[0] if lines else "?"


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float, log: Path) -> int:
    """Run a CLI in its own process group with a hard deadline; stdout and stderr go to log."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    break
            out.write(f"\n[recorder] killed after the {timeout:.0f}s timeout\n")
            return 124


def _base_env(home: Path) -> dict[str, str]:
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "USER", "LOGNAME", "SHELL")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    (home / "tmp").mkdir(exist_ok=True)  # the CLIs' scratch folders stay in the run's folder
    env.update({"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
                "XDG_CACHE_HOME": str(home / ".cache"), "TMPDIR": str(home / "tmp"), "NO_COLOR": "1"})
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


def claude_command(exe: Path, base_url: str, home: Path, prompt: str,
                   model: str | None = None) -> tuple[list[str], dict[str, str]]:
    """``claude -p`` against the recorder (ANTHROPIC_MODEL set only for the claude-custom run)."""
    env = _base_env(home)
    env.update({"ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": DUMMY_KEY})
    if model:
        env["ANTHROPIC_MODEL"] = model
    return [str(exe), "-p", prompt], env


def codex_command(exe: Path, base_url: str, home: Path, prompt: str, model: str | None,
                  extra_config: list[str], builtin_openai: bool = False) -> tuple[list[str], dict[str, str]]:
    """``codex exec`` against the recorder: a custom provider, or the built-in one moved to the recorder."""
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    lines = [f"model = {json.dumps(model)}"] if model else []
    lines += extra_config
    env = _base_env(home)
    env["CODEX_HOME"] = str(codex_home)
    if builtin_openai:
        # The built-in "openai" provider with its base URL moved: Codex treats it as OpenAI (websocket
        # transport first, remote compaction v2). Auto-compact after any usage, to see a compaction.
        lines += [f'openai_base_url = "{base_url}/v1"', "model_auto_compact_token_limit = 1"]
        env["CODEX_API_KEY"] = DUMMY_KEY
    else:
        lines += ['model_provider = "recorder"', "", "[model_providers.recorder]", 'name = "recorder"',
                  f'base_url = "{base_url}/v1"', f'env_key = "{CODEX_KEY_ENV}"', 'wire_api = "responses"',
                  "request_max_retries = 0", "stream_max_retries = 0"]
        env[CODEX_KEY_ENV] = DUMMY_KEY
    (codex_home / "config.toml").write_text("\n".join(lines) + "\n")
    return [str(exe), "exec", "--skip-git-repo-check", prompt], env


# --------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------


def _scrub(value: Any, replacements: list[tuple[str, str]]) -> Any:
    text = json.dumps(value, ensure_ascii=False)
    for old, new in replacements:
        text = text.replace(json.dumps(old)[1:-1], new)
    return json.loads(text)


def _fixture(cli: str, version: str, entry: dict[str, Any], note: str) -> dict[str, Any]:
    return {"cli": cli, "version": version, "note": note, "method": entry["method"], "path": entry["path"],
            "query": entry["query"], "headers": entry["headers"], "body": entry["body"]}


def _kind(entry: dict[str, Any]) -> str:
    body = entry.get("body")
    keys = ""
    if isinstance(body, dict):
        keys = " keys=" + hashlib.sha1(",".join(sorted(body)).encode()).hexdigest()[:8]
    return f"{entry['method']} {entry['path']}{keys}"


def select_fixtures(prefix: str, cli: str, version: str,
                    entries: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Pick one run's named fixtures from its raw log, and one example of each other request kind."""
    model_path = "/v1/messages" if cli == "claude-code" else "/v1/responses"
    calls = [e for e in entries if e["method"] == "POST" and e["path"] == model_path and isinstance(e["body"], dict)]
    chosen: dict[str, dict[str, Any]] = {}
    used: set[int] = set()

    def take(name: str, entry: dict[str, Any] | None, note: str) -> None:
        if entry is not None and entry["seq"] not in used:
            chosen[f"{prefix}_{name}.json"] = _fixture(cli, version, entry, note)
            used.add(entry["seq"])

    agent = [e for e in calls if not _is_compaction(e["body"])]
    first = next((e for e in agent if _tool_entries(e["body"])), agent[0] if agent else None)
    take("first_request", first, f"first {model_path} request (the agent turn, with its tools)")
    take("tool_result_request", next((e for e in agent if _has_tool_result(e["body"])), None),
         f"the {model_path} request that carries the result of the recorder's tool call")
    take("compaction_request", next((e for e in calls if _is_compaction(e["body"])), None),
         "a remote compaction (v2) request: the history plus a trailing compaction_trigger item")
    if cli == "claude-code":
        take("side_request", next((e for e in agent if e["seq"] not in used and not e["body"].get("tools")), None),
             "first /v1/messages request without tools (a side request)")
    seen = {_kind(e) for e in entries if e["seq"] in used}
    others = []
    for e in entries:
        if e["seq"] not in used and _kind(e) not in seen:
            seen.add(_kind(e))
            others.append(_fixture(cli, version, e, f"{_kind(e)} (seq {e['seq']}, answered {e['reply']['status']})"))
    return chosen, others


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cli-dir", type=Path, default=DEFAULT_CLI_DIR,
                        help="npm --prefix folder holding node_modules/.bin/{claude,codex} (default %(default)s)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture folder (default %(default)s)")
    parser.add_argument("--raw", type=Path, default=None, help="folder for the raw request log (default: under /tmp)")
    parser.add_argument("--only", action="append", choices=RUNS, default=None,
                        help="record these runs only (repeatable; default: all)")
    parser.add_argument("--claude-model", default=DEFAULT_CUSTOM_MODEL,
                        help="ANTHROPIC_MODEL for the claude-custom run (default %(default)s)")
    parser.add_argument("--codex-model", default=DEFAULT_CUSTOM_MODEL,
                        help="model for the codex-custom run (default %(default)s)")
    parser.add_argument("--codex-config", action="append", default=[], metavar="TOML_LINE",
                        help="extra top-level line for Codex's config.toml, e.g. 'model_auto_compact_token_limit = 1'")
    parser.add_argument("--tool-call", action="append", default=[], metavar="NAME",
                        help="answer the first model request that offers tool NAME with a call of it (repeatable)")
    parser.add_argument("--tool-args", type=json.loads, default=None, metavar="JSON",
                        help="arguments for the tool call(s) ({workdir} is replaced); default: built in per tool")
    parser.add_argument("--namespace-style", choices=("field", "omit", "flat"), default="field",
                        help="how a call of a namespaced Responses tool names it: a 'namespace' field (default), "
                             "no namespace at all, or the flat name NAMESPACE__NAME")
    parser.add_argument("--compaction-reply", choices=("ok", "400", "404"), default="ok",
                        help="answer to a Codex compaction request (default: one compaction item)")
    parser.add_argument("--prompt", default=None, help="prompt for every CLI (default depends on --tool-call)")
    parser.add_argument("--timeout", type=float, default=180,
                        help="seconds each CLI run may take (default %(default)s)")
    parser.add_argument("--port", type=int, default=0, help="recorder port (default: a free one)")
    parser.add_argument("--serve", action="store_true", help="only run the recorder, until --timeout or Ctrl-C")
    args = parser.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="agent-record-"))
    raw_dir = args.raw or (tmp / "raw")
    raw_dir.mkdir(parents=True, exist_ok=True)
    recorder = Recorder(raw_dir, args.tool_call, args.tool_args, args.namespace_style, args.compaction_reply)
    server = make_server(recorder, args.port)
    base_url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
    print(f"recorder listening on {base_url}; raw log in {raw_dir}", flush=True)

    if args.serve:
        try:
            time.sleep(args.timeout)
        except KeyboardInterrupt:
            pass
        server.shutdown()
        return 0

    runs = args.only or list(RUNS)
    args.out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    all_others: list[dict[str, Any]] = []
    status = 0
    seen_kinds: set[str] = set()
    for label in runs:
        is_claude = label.startswith("claude")
        cli = "claude-code" if is_claude else "codex"
        exe = _bin(args.cli_dir, "claude" if is_claude else "codex")
        if not exe.exists():
            print(f"{label}: {exe} not found; install it with npm install --prefix {args.cli_dir} ...",
                  file=sys.stderr)
            status = 1
            continue
        work, home = tmp / f"{label}-work", tmp / f"{label}-home"
        work.mkdir()
        home.mkdir()
        (work / "hello.txt").write_text("hello from the recorder\n")
        tool_calls = list(args.tool_call)
        if label == "codex-openai":
            tool_calls = tool_calls or ["exec"]  # a tool call makes the turn go on: mid-turn compaction
        prompt = args.prompt or (PROMPT if not tool_calls else CLAUDE_TOOL_PROMPT if is_claude else CODEX_TOOL_PROMPT)
        if is_claude:
            model = args.claude_model if label == "claude-custom" else None
            cmd, env = claude_command(exe, base_url, home, prompt, model)
        else:
            model = args.codex_model if label == "codex-custom" else None
            cmd, env = codex_command(exe, base_url, home, prompt, model, args.codex_config,
                                     builtin_openai=label == "codex-openai")
        version = _version(exe, env)
        recorder.set_run(label, str(work), tool_calls)
        log = tmp / f"{label}.log"
        t0 = time.monotonic()
        rc = _run(cmd, env, work, args.timeout, log)
        time.sleep(0.5)  # let a request that raced the exit be logged
        entries = [json.loads(p.read_text()) for p in sorted(raw_dir.glob("*.json"))]
        entries = [e for e in entries if e["run"] == label]
        print(f"{label} ({version}): exit {rc} after {time.monotonic() - t0:.1f}s, {len(entries)} requests; "
              f"output in {log}", flush=True)
        for e in entries:
            print(f"  #{e['seq']:<3} {e['method']:5} {e['path']:30} -> {e['reply']['status']} {e['reply']['note']}")
        if rc != 0:
            print("  output tail:\n    " + "\n    ".join(log.read_text(errors="replace").splitlines()[-15:]))
        replacements = [(str(work), "<WORKDIR>"), (str(home / ".codex"), "<CODEX_HOME>"), (str(home), "<HOME>"),
                        (str(tmp), "<TMP>")]
        chosen, others = select_fixtures(RUNS[label], cli, version, entries)
        if label in VARIANT_KEEP:
            # A variant run: keep only the request that is new (its others match the main run's), as an
            # entry of agents_other_requests.json rather than a file of its own.
            kept = [v for k, v in chosen.items() if k.endswith(f"_{VARIANT_KEEP[label]}.json")]
            if not kept:
                print(f"  {label}: no {VARIANT_KEEP[label]} recorded", file=sys.stderr)
                status = 1
            all_others.extend(_scrub(dict(k, run=label), replacements) for k in kept)
            chosen = {}
        elif not any(k.endswith("_first_request.json") for k in chosen):
            print(f"  {label}: no model request recorded", file=sys.stderr)
            status = 1
        for name, fixture in chosen.items():
            path = args.out / name
            path.write_text(json.dumps(_scrub(fixture, replacements), indent=2, ensure_ascii=False) + "\n")
            written.append(path)
        for other in others:  # one example of each other request kind, over all runs
            if _kind(other) not in seen_kinds:
                seen_kinds.add(_kind(other))
                all_others.append(_scrub(dict(other, run=label), replacements))

    if all_others:
        path = args.out / "agents_other_requests.json"
        path.write_text(json.dumps(all_others, indent=2, ensure_ascii=False) + "\n")
        written.append(path)
    server.shutdown()
    server.server_close()
    print("wrote:")
    for path in written:
        print(f"  {path} ({path.stat().st_size} bytes)")
    print(f"raw log: {raw_dir}; work folders and CLI output under {tmp} (delete when done)")
    return status


if __name__ == "__main__":
    sys.exit(main())
