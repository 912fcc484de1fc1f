"""The lab's topology file: topologies/lab-example.toml's shape on the lab's addresses.

The studio prefills (`prefill-0`, machine `mac-studio-1`) and serves the router; mini N decodes (`decode-<N-1>`,
machine `mac-mini-N`), or, with `decode_group`, the minis are one decode worker `decode-0`, a tensor-parallel
group whose rank N-1 runs on mini N (rank 0 leads it on mini-1; each rank's ring, step and heartbeat sockets
on its mini's address, `GROUP_PORTS`); every worker binds its host's address; `[ray] address` is the studio's
GCS; CurveZMQ keys (made by `cluster.transport.generate_keys`, what `mlx-pd keys` runs) guard every cluster
socket (not a group's own ring, step and heartbeat sockets, which take no keys yet). The
model is float32 (MLX's CPU backend): the random-weight 2-layer stand-in (`"fast"`, the default: a step costs
milliseconds, so a lab on a 2-core machine answers in seconds), the default SmolLM2 (`"default"`), or any
source `mlx-pd up` takes.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.lab.net import Host
from benchmarks.lab.ray_hosts import GCS_PORT

ROUTER_PORT = 8000
PREFILL_PORTS = {"control_port": 5601, "events_port": 5603}
DECODE_PORTS = {"control_port": 5611, "kv_port": 5612, "events_port": 5613}
GROUP_PORTS = {"ring_port": 5620, "step_port": 5621, "heartbeat_port": 5622}


def resolve_model(model: str) -> tuple[str, str, float]:
    """(source, served name, kv_cache_gb) of `model`: "fast", "default", or a folder / .gguf / repo id."""
    if model == "fast":
        from benchmarks.reliability_long import FAST_KV_GB, fast_model_dir

        path = fast_model_dir()
        return str(path), path.name, FAST_KV_GB
    if model == "default":
        from cluster.gguf_import import ensure_default_model
        from cluster.model import DEFAULT_MODEL

        return str(ensure_default_model("float32", progress=False)), DEFAULT_MODEL, 0.5
    path = Path(model).expanduser()
    return (str(path.resolve()), path.stem, 0.5) if path.exists() else (model, model.rsplit("/", 1)[-1], 0.5)


def _toml(value) -> str:
    return json.dumps(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) \
        else repr(value)


def topology_text(studio: Host, minis: list[Host], *, source: str, served_name: str, kv_cache_gb: float,
                  keys_dir: Path, routing: dict | None = None, engine: dict | None = None,
                  max_restarts: int = 1, decode_group: dict | None = None) -> str:
    """The lab's topology as TOML text. `routing` adds `[routing]` keys (e.g. heartbeat_s, dead_after_s);
    `engine` adds `[engine]` keys (e.g. kv_bits: the KV format in the pool and on the wire); `decode_group`
    (e.g. {"deadline_s": 5}: more `[workers.group]` keys) makes the minis one tensor-parallel decode group."""
    lines = ["# Written by the lab harness (benchmarks/lab): the shape of topologies/lab-example.toml on the",
             "# lab's network namespaces.",
             "[model]", f"source = {_toml(source)}", f"served_name = {_toml(served_name)}", "",
             "[engine]", 'dtype = "float32"', f"kv_cache_gb = {kv_cache_gb!r}",
             *[f"{key} = {_toml(value)}" for key, value in (engine or {}).items()], "",
             "[transfer]", "timeout_s = 30", "",
             "[routing]", 'policy = "prefix_aware"']
    lines += [f"{key} = {_toml(value)}" for key, value in (routing or {}).items()]
    lines += ["", "[security]", f"curve_keys_dir = {_toml(str(keys_dir))}", "",
              "[ray]", f'address = "{studio.ip}:{GCS_PORT}"', f"max_restarts = {max_restarts}", "",
              "[router]", f'host = "{studio.ip}"', f"port = {ROUTER_PORT}", "",
              "[[workers]]", 'name = "prefill-0"', 'role = "prefill"', f'machine = "{studio.resource}"',
              f'host = "{studio.ip}"']
    lines += [f"{key} = {port}" for key, port in PREFILL_PORTS.items()]
    for i, mini in enumerate(minis[:1] if decode_group is not None else minis):
        lines += ["", "[[workers]]", f'name = "decode-{i}"', 'role = "decode"', f'machine = "{mini.resource}"',
                  f'host = "{mini.ip}"']
        lines += [f"{key} = {port}" for key, port in DECODE_PORTS.items()]
    if decode_group is not None:
        ranks = [{"host": mini.ip, **GROUP_PORTS, **({"machine": mini.resource} if r else {})}
                 for r, mini in enumerate(minis)]
        lines += ["[workers.group]", 'parallel = "tensor"', 'backend = "ring"',
                  *[f"{key} = {_toml(value)}" for key, value in decode_group.items()],
                  "ranks = [" + ", ".join("{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in r.items()) + " }"
                                          for r in ranks) + "]"]
    return "\n".join(lines) + "\n"


def endpoint(studio: Host) -> str:
    """The router's OpenAI API, reached from any lab host."""
    return f"http://{studio.ip}:{ROUTER_PORT}/v1"
