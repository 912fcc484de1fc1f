"""The stages of a token's host time: py-spy's raw samples read into stacks (`parse_raw`) and each sampled stack
sorted into a stage (`classify`), for `mlx-pd bench host-profile` (benchmarks/host_profile.py). Idle is decided
first, by the leaf frame; then the innermost project frame (cluster/, router/, the roles) decides, with library
frames (MLX, uvicorn, h11, ZeroMQ, msgpack) as the fallback. Pure functions: no server, no py-spy."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
IDLE = "idle"
SCHEDULE, RUNNER, COMPUTE, READBACK = "schedule", "runner bookkeeping", "model compute", "sampling read-back"
UPDATE, DETOK, MESSAGES, HANDOFF = "scheduler update", "detokenization", "output messages", "event-loop handoff"
SSE, REQUEST, KV, OTHER = "SSE formatting and writes", "request handling", "KV transfer", "other"
STAGES = (SCHEDULE, RUNNER, COMPUTE, READBACK, UPDATE, DETOK, MESSAGES, HANDOFF, SSE, REQUEST, KV, OTHER)
LineText = Callable[[str, int], Optional[str]]  # (file as py-spy names it, line) -> that source line, or None


@dataclass(frozen=True)
class Frame:
    """One frame of a py-spy stack: function (``Class.method`` or ``function``), file (as py-spy shortens it,
    e.g. ``cluster/engine.py``, ``asyncio/base_events.py``) and line."""

    func: str
    file: str
    line: int = 0


_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?):(?P<line>\d+)\)$")
_THREAD = re.compile(r"^thread \((?P<tid>\d+|0x[0-9a-fA-F]+)\)(?::\s*(?P<name>.*))?$")


def parse_frame(text: str) -> Frame:
    """A frame from py-spy's ``func (file:line)``; text of another shape becomes a frame with that function."""
    m = _FRAME.match(text.strip())
    if not m:
        return Frame(text.strip(), "")
    return Frame(m["func"], m["file"], int(m["line"]))


@dataclass(frozen=True)
class Sample:
    """One line of ``py-spy record --format raw --threads``: a thread's stack (root first) seen `count` times."""

    tid: int
    thread: str
    frames: tuple[Frame, ...]
    count: int


def parse_raw(text: str) -> list[Sample]:
    """The samples of a raw py-spy file (``thread (TID): NAME;frame;...;frame COUNT`` a line). Lines without a
    thread frame (py-spy run without ``--threads``) get tid 0 and thread ``?``."""
    out = []
    for line in text.splitlines():
        line = line.rstrip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        try:
            n = int(count)
        except ValueError:
            continue
        parts = stack.split(";")
        tid, name = 0, "?"
        m = _THREAD.match(parts[0])
        if m:
            tid = int(m["tid"], 0)
            name = (m["name"] or "").strip() or "?"
            parts = parts[1:]
        out.append(Sample(tid, name, tuple(parse_frame(p) for p in parts if p), n))
    return out


# -- the classifier --------------------------------------------------------------------------------------------

def _short(func: str) -> str:
    """The function's own name: ``Class.method.<locals>.<lambda>`` -> its first two parts' last, e.g. method."""
    base = func.split(".<locals>")[0]
    return base.rsplit(".", 1)[-1]


def idle_leaf(leaf: Frame) -> bool:
    """True when a stack whose innermost Python frame is `leaf` is waiting with nothing to do: an I/O selector's
    ``select`` (the event loop in epoll, a metrics server), a ``threading`` wait (condition, event, lock, join),
    a ``queue`` get, an executor or pool thread waiting for work, a ZeroMQ poll or pyzmq's garbage-collector
    thread, the worker loop's control
    poll (``InProcessControl.poll``/``ZmqControl.poll``: a queue or socket wait of at most 20 ms), a parked
    owner thread (cluster/owner_threads.py ``_serve``)."""
    file, func, name = leaf.file, leaf.func, _short(leaf.func)
    if file.endswith("selectors.py") and "select" in name:
        return True
    if file.endswith("threading.py") and name in ("wait", "join", "_wait_for_tstate_lock", "acquire"):
        return True
    if file.endswith("queue.py") and not file.startswith("asyncio") and name in ("get", "put"):
        return True
    if file.endswith("concurrent/futures/thread.py") and name == "_worker":
        return True
    if file.endswith("socketserver.py") and name == "serve_forever":
        return True
    if file.startswith("zmq") and ("poll" in name.lower() or file.startswith("zmq/utils/garbage")):
        return True  # a poll, or pyzmq's garbage-collector thread blocked in its socket's recv
    if file.endswith("cluster/control.py") and func in ("InProcessControl.poll", "ZmqControl.poll"):
        return True
    if file.endswith("cluster/owner_threads.py") and name == "_serve":
        return True
    return False


_MLX = ("mlx/", "mlx_lm/", "nn/layers/", "nn/utils", "mlx.core")
_SCHEDULING = {"schedule", "_schedule_prefill", "_schedule_decode", "_chunk", "_blocks_needed", "expire",
               "admit_prefilled", "has_work", "queue_full", "report_computed", "add"}
_PROJECT = ("cluster/", "router/", "decode_node/", "prefill_node/", "kv_transfer/")


def _leaf_call(text: Optional[str]) -> Optional[str]:
    """The stage of an MLX call on a project leaf line (the C call itself is not a Python frame)."""
    if not text:
        return None
    if ".tolist()" in text or ".item()" in text:
        return READBACK
    if "mx.eval(" in text or "async_eval(" in text:
        return COMPUTE
    return None


def project_stage(frame: Frame, leaf: bool, line_text: Optional[str] = None) -> Optional[str]:
    """The stage a project frame puts its stack in (None: no rule, its caller decides). `leaf`: this frame is
    the innermost one, and `line_text` its source line (read for MLX calls made from it, see `_leaf_call`)."""
    file, func, name = frame.file, frame.func, _short(frame.func)
    if leaf:
        stage = _leaf_call(line_text)
        if stage:
            return stage
    if file.endswith("cluster/engine.py"):
        if name == "_resolve":
            return UPDATE
        if name in ("step", "has_work"):
            return SCHEDULE
        if name in ("_execute", "_defers"):
            return RUNNER
        if name in ("add_request", "check_request", "abort", "release"):
            return REQUEST
        return OTHER
    if file.endswith("cluster/runner.py"):
        return RUNNER
    if file.endswith("cluster/sampling.py"):
        return COMPUTE
    if file.endswith("cluster/scheduler.py"):
        return SCHEDULE if name in _SCHEDULING else UPDATE
    if file.endswith("cluster/detokenizer.py"):
        return DETOK
    if file.endswith("cluster/protocol.py"):
        return MESSAGES
    if file.endswith("cluster/control.py"):
        if func.startswith("ZmqControl."):
            return MESSAGES
        return HANDOFF if name == "submit" else None  # InProcessControl delivery: the peer's callable decides
    if file.endswith("cluster/launch/single_node.py"):
        return HANDOFF
    if file.endswith("cluster/worker.py"):
        if name in ("emit", "_send", "_publish_events", "_after_step", "_reject"):
            return MESSAGES
        if name in ("_on_control", "_poll_control", "_admit", "_on_generate", "_on_abort"):
            return REQUEST
        if name == "_guard":
            return None
        return OTHER  # the loop itself, stats, calls
    if file.endswith(("decode_node/worker.py", "prefill_node/worker.py")):
        if name in ("_on_generate", "_on_abort", "_admit"):
            return REQUEST
        if name == "_after_step" and file.startswith("decode_node"):
            return MESSAGES
        return KV  # transfers: _poll_transfers, the prefill worker's handoff after a step
    if file.startswith(("kv_transfer/", "prefill_node/", "decode_node/")):
        return KV
    if file.endswith("router/cluster_client.py"):
        if name in ("_deliver", "generate"):
            return HANDOFF
        if name in ("_reader", "_on_message", "_send", "_post", "_post_all", "send_all", "_end"):
            return MESSAGES
        if name in ("_dispatch", "hashed", "cached_blocks", "_wait_for_decode_worker"):
            return REQUEST
        return OTHER  # heartbeat, liveness, KV events
    if file.endswith("router/streams.py"):
        return SSE if name in ("sse_event", "__call__") or func.startswith("SSEResponse") else HANDOFF
    if file.endswith("router/serving.py"):
        return SSE if name in ("_events", "_collect", "frame", "end_of_stream") else REQUEST
    if file.startswith("router/") and file.endswith(("openai/format.py", "openai/output.py", "choices.py",
                                                     "anthropic/format.py", "responses/format.py")):
        return SSE
    if file.endswith("router/metrics.py") and ("send" in func or name == "__call__"):
        return None  # the metrics middleware passing a response through: what it passes decides
    if file.endswith(("router/metrics.py", "cluster/stats.py", "cluster/stats_metrics.py")) or "dashboard" in file:
        return OTHER
    if file.startswith("router/"):
        return REQUEST  # parsing, validation, templates, tokenization, placement
    return None  # cluster/kv/, prefix matching, sequences, reasoning, grammar, launch: the caller decides


def library_stage(frame: Frame) -> Optional[str]:
    """A library frame's stage when no project frame decides (partial stacks, the server's own plumbing)."""
    file, name = frame.file, _short(frame.func)
    if file.startswith(("uvicorn/", "h11/", "starlette/", "anyio/", "fastapi/", "httptools/")):
        if "send" in name or "write" in name or file.endswith("starlette/responses.py"):
            return SSE
        return REQUEST
    if file.startswith("asyncio/"):
        if "write" in name and "self" not in name:
            return SSE
        if name in ("_read_ready", "_read_ready__get_buffer", "_read_ready__data_received", "data_received"):
            return REQUEST
        return HANDOFF  # the loop's own machinery: _run_once, handles, futures, queues, the self-pipe
    if file.startswith(("zmq/", "msgpack/")):
        return MESSAGES
    if file.startswith(("transformers/", "tokenizers/")):
        return DETOK
    return None


def classify(frames: Sequence[Frame], line_text: Optional[LineText] = None) -> str:
    """The stage of one sampled stack (`frames` root first; `line_text(file, line)` reads a source line, for
    MLX calls made from a project leaf). Idle by the leaf frame first (`idle_leaf`); then from the leaf up the
    first MLX/mlx-lm frame or project frame with a rule (`project_stage`) decides; else the innermost library
    frame with a stage (`library_stage`); else `other`."""
    if not frames:
        return OTHER
    leaf = frames[-1]
    if idle_leaf(leaf):
        return IDLE
    for i in range(len(frames) - 1, -1, -1):
        f = frames[i]
        if f.file.startswith(_MLX):
            return COMPUTE
        if f.file.startswith(_PROJECT):
            text = line_text(f.file, f.line) if (line_text and i == len(frames) - 1) else None
            stage = project_stage(f, i == len(frames) - 1, text)
            if stage:
                return stage
    for f in reversed(frames):
        stage = library_stage(f)
        if stage:
            return stage
    return OTHER


def repo_line_text(root: Path = REPO_ROOT) -> LineText:
    """A `LineText` over this repository's files (py-spy names them relative to the repository root)."""
    cache: dict[str, list[str]] = {}

    def text(file: str, line: int) -> Optional[str]:
        if file not in cache:
            try:
                cache[file] = (root / file).read_text(encoding="utf-8").splitlines()
            except (OSError, ValueError):
                cache[file] = []
        lines = cache[file]
        return lines[line - 1] if 0 < line <= len(lines) else None

    return text
