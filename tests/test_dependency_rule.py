"""DESIGN §3: which package may import which, checked by walking every module's imports with `ast`.

Imports inside functions count as much as those at module level: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = {"cluster", "kv_transfer", "prefill_node", "decode_node", "router"}
PACKAGES = PRODUCT | {"benchmarks"}
ALLOWED = {
    "cluster": set(),  # the ground floor: no sibling at all
    "cluster/launch": PRODUCT - {"cluster"},  # the roof: wires every package together
    "kv_transfer": {"cluster"},
    "prefill_node": {"cluster", "kv_transfer"},
    "decode_node": {"cluster", "kv_transfer"},
    "router": {"cluster"},
    "benchmarks": {"cluster", "kv_transfer", "router"},  # a tool beside the product: it measures every layer
}


def imports(path: Path):
    """Yield (top-level package, full module name, names imported from it) for each import in `path`,
    at module level and inside functions alike."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0], alias.name, ()
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import of {node.module}"
            yield node.module.split(".")[0], node.module, tuple(a.name for a in node.names)


def modules():
    """(folder, path, module name) of every module of every package; folder is e.g. "cluster/launch"."""
    for pkg in sorted(PACKAGES):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT)
            parts = rel.with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            yield rel.parent.as_posix(), path, name


def rule_folder(folder: str) -> str:
    """The ALLOWED entry that governs `folder`: "cluster/launch" for the roof, else the top-level package."""
    return "cluster/launch" if folder == "cluster/launch" or folder.startswith("cluster/launch/") else \
        folder.split("/")[0]


def violations_of(folder: str, path: Path) -> list[str]:
    """The imports of the module at `path` (in `folder`, e.g. "cluster/launch") that the rule forbids: a
    sibling package its rule folder may not import, or, from the ground floor, the roof (`cluster.launch`),
    which shares the `cluster` package with it."""
    rule, own = rule_folder(folder), folder.split("/")[0]
    found = []
    for top, full, _ in imports(path):
        if top in PACKAGES and top != own and top not in ALLOWED[rule]:
            found.append(f"{path.name} imports {full}")
        if rule == "cluster" and (full == "cluster.launch" or full.startswith("cluster.launch.")):
            found.append(f"{path.name} (ground floor) imports the roof, {full}")
    return found


def test_packages_import_only_what_the_rule_allows():
    violations = [v for folder, path, _ in modules() for v in violations_of(folder, path)]
    assert violations == []


def test_a_ground_floor_module_importing_the_roof_is_a_violation(tmp_path):
    """Both sit in the `cluster` package, so the sibling-package check alone would let it through."""
    module = tmp_path / "kv_cache.py"
    module.write_text("from cluster.launch.cli import main\nimport cluster.launch\nimport cluster.pool\n")
    assert violations_of("cluster", module) == [
        "kv_cache.py (ground floor) imports the roof, cluster.launch.cli",
        "kv_cache.py (ground floor) imports the roof, cluster.launch"]
    assert violations_of("cluster/launch", module) == []


def test_no_product_module_imports_benchmarks():
    """The benchmarks are a tool beside the product: the server runs without them (and without their
    `[bench]` dependencies); `mlx-pd bench|profile` load the tool by name (cluster/launch/cli.py)."""
    users = [f"{path.relative_to(ROOT)} imports {full}" for folder, path, _ in modules()
             if folder.split("/")[0] in PRODUCT for top, full, _ in imports(path) if top == "benchmarks"]
    assert users == []


def test_only_launch_imports_ray_and_only_model_calls_mlx_lm_load():
    ray_users, loaders = [], []
    for folder, path, _ in modules():
        rel = path.relative_to(ROOT).as_posix()
        for top, _, _ in imports(path):
            if top == "ray" and rule_folder(folder) != "cluster/launch":
                ray_users.append(rel)
        source = path.read_text()
        if ("from mlx_lm import load" in source or "mlx_lm.load(" in source) and rel != "cluster/model.py":
            loaders.append(rel)
    assert ray_users == [] and loaders == []


def import_graph() -> tuple[dict[str, set[str]], dict[str, str]]:
    """(module -> the modules it imports, module -> its folder) over every package, with module-level and
    function-level imports. `from a.b import c` is an edge to the module a.b.c when there is one, else to a.b;
    importing a module also runs its packages' __init__, so a.b.c brings edges to a and a.b too."""
    folders = {name: folder for folder, _, name in modules()}
    graph: dict[str, set[str]] = {name: set() for name in folders}
    for _, path, name in modules():
        for _, full, names in imports(path):
            targets = [f"{full}.{n}" if f"{full}.{n}" in folders else full for n in names] or [full]
            for target in targets:
                parts = target.split(".")
                graph[name] |= {m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
                                if m in folders and m != name}
    return graph, folders


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of `graph` (iterative), each sorted; singletons included."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                out.append(sorted(component))
    return out


def test_strongly_connected_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert sorted(strongly_connected(graph)) == [["a", "b", "c"], ["d"], ["e"]]


def test_no_import_circle_spans_two_folders():
    """An import circle inside one folder is one owner's business; a circle between files of two folders
    (cluster/ and cluster/launch/ count as two) means the floors are not floors."""
    graph, folders = import_graph()
    spanning = [[f"{m} ({folders[m]})" for m in c] for c in strongly_connected(graph)
                if len({folders[m] for m in c}) > 1]
    assert spanning == []
