"""The import graph has one direction: schemas <- core runtime <- rollout API <- producers,
consumers <- commands. Read from the source with ``ast`` (imports inside functions count:
they are dependencies too), so the rule holds without importing anything."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "streamer", "producers", "consumers", "ops")

# module prefix -> layer; the longest matching prefix wins. A module may import its own
# layer and the ones below it, never one above.
LAYERS = {
    "schemas": 0,  # the wire contract
    "streamer": 1,  # the shared runtime every role stands on
    "streamer.rollout": 2,  # what rollout authors write against
    "producers": 3,  # the sampling side
    "consumers": 3,  # the trainer side
    "streamer.cli": 4,  # the operator commands
    "streamer.__main__": 4,
    "ops": 4,
}
SIBLINGS = {"producers": "consumers", "consumers": "producers"}  # one layer, never each other


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The first-party modules ``path`` imports (``from pkg import mod`` counts as mod)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {m: imports(p, known) - {m} for m, p in known.items()}


def layer(module: str) -> tuple[str, int]:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return prefix, LAYERS[prefix]


def upward(g: dict[str, set[str]]) -> list[str]:
    out = []
    for m, deps in sorted(g.items()):
        top, mine = layer(m)
        for d in sorted(deps):
            their_top, theirs = layer(d)
            if theirs > mine or SIBLINGS.get(top) == their_top:
                out.append(f"{m} (layer {top}) imports {d} (layer {their_top})")
    return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_a_higher_layer():
    assert upward(graph()) == []


def test_no_modules_import_each_other():
    assert cycles(graph()) == []


def test_the_checks_see_a_violation(tmp_path):
    """The checks are not vacuous: a core module importing a command, and two modules
    importing each other, are both reported."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "streamer" / "cli").mkdir()
    (tmp_path / "streamer" / "cli" / "__init__.py").write_text("from streamer import keys\n")
    (tmp_path / "streamer" / "keys.py").write_text("def f():\n    from streamer.cli import main\n")
    (tmp_path / "consumers" / "a.py").write_text("from producers import b\n")
    (tmp_path / "producers" / "b.py").write_text("import schemas\n")
    g = graph(tmp_path)
    assert upward(g) == [
        "consumers.a (layer consumers) imports producers (layer producers)",
        "consumers.a (layer consumers) imports producers.b (layer producers)",
        "streamer.keys (layer streamer) imports streamer.cli (layer streamer.cli)",
    ]
    assert cycles(g) == [["streamer.cli", "streamer.keys"]]
