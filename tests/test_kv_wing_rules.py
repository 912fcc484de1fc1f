"""The KV wing's boundaries: only it (and the runner and the model structure, which map layers to groups, and the
load check, which crosses each kind's boundaries on purpose) names a kind of KV cache group; `Sequence` holds tokens, counters and sampling state and nothing of the KV; the wing
imports nothing of the engine."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

from cluster.sequence import Sequence
from tests.test_dependency_rule import imports

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("cluster", "kv_transfer", "prefill_node", "decode_node", "router")
# the wing, the two files that map a model's layers onto groups, and the load check, whose probe crosses every
# window and restores a recurrent state from a snapshot to prove them
ALLOWED = ("cluster/kv/", "cluster/runner.py", "cluster/model_structure.py", "cluster/load_check.py")
# the kinds and their fields: sliding windows (`window_table`, `seq.window`...), recurrent state, its snapshots and
# the restore points they make (a plain local `window` elsewhere is a text or time window, not a KV group's)
KIND_WORDS = ("recurrent", "sliding", "state_snapshot", "snapshots", "restore_point", "restorable")
# user-facing settings (CLI flags, topology keys) keep their documented names; reading them is not naming a kind
SETTINGS = {"state_cache_gb", "state_snapshot_interval"}
# the engine's own modules, which the wing must not import
ENGINE = {"cluster.engine", "cluster.scheduler", "cluster.sequence", "cluster.runner", "cluster.prefix_match",
          "cluster.worker", "cluster.connector", "cluster.speculation"}


def identifiers(path: Path):
    """(line, identifier) for every name, attribute, argument, keyword, definition and import alias in `path`
    (not strings or comments: messages to users may say what a layer is)."""
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, ast.keyword) and node.arg:
            names = [node.arg]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.alias):
            names = [node.asname or node.name.split(".")[-1]]
        for name in names:
            yield getattr(node, "lineno", 0), name, isinstance(node, ast.Attribute)


def kind_names(path: Path) -> list[str]:
    """The identifiers of `path` that name a group kind or its fields."""
    def names_a_kind(name: str, attribute: bool) -> bool:
        low = name.lower()
        return any(w in low for w in KIND_WORDS) or ("window" in low and (low != "window" or attribute))

    return [f"{path.relative_to(ROOT)}:{line} {name}" for line, name, attribute in identifiers(path)
            if name not in SETTINGS and names_a_kind(name, attribute)]


def product_files():
    for pkg in PRODUCT:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(ALLOWED) and rel not in ALLOWED:
                yield path


def test_no_product_file_outside_the_wing_names_a_group_kind():
    found = [hit for path in product_files() for hit in kind_names(path)]
    assert found == []


def test_the_kind_rule_catches_a_kind_named_by_attribute_or_argument(tmp_path):
    """A file that reads a window table or passes a recurrent state is caught; a message that says "window" is
    not."""
    module = tmp_path / "m.py"
    module.write_text("def f(seq, recurrent_state=None):\n    x = seq.window_table\n    y = seq.window\n"
                      "    window = 'sliding window'\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert kind_names(module) == ["m.py:1 recurrent_state", "m.py:2 window_table", "m.py:3 window"]
    finally:
        ROOT = saved


def test_sequence_holds_no_kv_and_no_untyped_field():
    hints = typing.get_type_hints(Sequence, include_extras=False, localns=_sequence_types())
    names = {f.name for f in dataclasses.fields(Sequence)}
    assert not names & {"block_table", "window_table", "recurrent_state", "pending_snapshot", "chunk_snapshots"}
    untyped = [n for n, t in hints.items() if t in (typing.Any, object) or typing.Any in typing.get_args(t)]
    assert untyped == []


def _sequence_types() -> dict:
    import mlx.core as mx

    from cluster.detokenizer import OutputText
    from cluster.grammar import GrammarMatcher
    from cluster.reasoning_state import ReasoningState
    from cluster.speculation import DraftState, SequenceSpeculation
    return {"mx": mx, "OutputText": OutputText, "GrammarMatcher": GrammarMatcher, "ReasoningState": ReasoningState,
            "DraftState": DraftState, "SequenceSpeculation": SequenceSpeculation}


def test_the_kv_wing_imports_nothing_of_the_engine():
    found = [f"{path.relative_to(ROOT)} imports {full}" for path in sorted((ROOT / "cluster/kv").rglob("*.py"))
             for _, full, _ in imports(path) if full in ENGINE]
    assert found == []
