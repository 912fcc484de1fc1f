"""DESIGN §3: which package may import which, checked by walking every module's imports with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"cluster", "kv_transfer", "prefill_node", "decode_node", "router", "benchmarks"}
ALLOWED = {
    "cluster": set(),
    "kv_transfer": {"cluster"},
    "prefill_node": {"cluster", "kv_transfer"},
    "decode_node": {"cluster", "kv_transfer"},
    "router": {"cluster"},
    "benchmarks": {"cluster", "kv_transfer", "router"},  # tools: they measure every layer, in process too
}
# may import siblings inside functions (and cluster/launch*.py): the places that build workers and routers
LAZY_LAUNCHERS = {"cluster/local.py", "cluster/cli.py", "cluster/worker.py"}


def imports(path: Path):
    """Yield (top-level module, inside a function?) for each import in `path`."""
    tree = ast.parse(path.read_text())
    func_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            yield name.split(".")[0], name, id(node) in func_nodes


def modules():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield pkg, path, path.relative_to(ROOT).as_posix()


def test_packages_import_only_what_the_rule_allows():
    violations = []
    for pkg, path, rel in modules():
        for top, _, lazy in imports(path):
            if top in PACKAGES and top != pkg and top not in ALLOWED[pkg]:
                if not (lazy and (rel in LAZY_LAUNCHERS or rel.startswith("cluster/launch"))):
                    violations.append(f"{rel} imports {top}")
    assert violations == []


def test_only_launch_imports_ray_and_only_model_calls_mlx_lm_load():
    ray_users, loaders = [], []
    for _, path, rel in modules():
        for top, full, _ in imports(path):
            if top == "ray" and not rel.startswith("cluster/launch"):
                ray_users.append(rel)
        source = path.read_text()
        if ("from mlx_lm import load" in source or "mlx_lm.load(" in source) and rel != "cluster/model.py":
            loaders.append(rel)
    assert ray_users == [] and loaders == []
