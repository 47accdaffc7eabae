"""The rooms of ``hf_lowzero/zero/`` import downward only, in the order the data flows
(docs/architecture.md), and no module imports itself back through others.

Read from the source (``ast``), so a lazy import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

ZERO = Path(__file__).resolve().parents[1] / "hf_lowzero" / "zero"
# Bottom to top. A module may import from its own room and from the rooms before it.
ROOMS = [
    "auto_interval",
    "zero_config",
    "runtime",
    "layout",
    "host",
    "grads",
    "update",
    "reads",
    "exact",
    "inner",
    "integrity",
    "top",
]


def _module(path: Path) -> str:
    parts = path.relative_to(ZERO).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__")


def _room(module: str) -> str:
    first = module.split(".")[0]
    return first if first in ROOMS else "top"  # build, facade, optimizer and the package itself


def _imports() -> dict[str, set[str]]:
    """Per module of hf_lowzero.zero (dotted below it), the modules of hf_lowzero.zero it imports."""
    found = {}
    for path in ZERO.rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hf_lowzero.zero"):
                base = node.module.removeprefix("hf_lowzero.zero").lstrip(".")
                for alias in node.names:  # `from hf_lowzero.zero.runtime import comm` imports a module
                    candidate = f"{base}.{alias.name}".lstrip(".")
                    names.add(candidate if (ZERO / Path(*candidate.split("."))).with_suffix(".py").exists() else base)
            elif isinstance(node, ast.Import):
                names |= {
                    a.name.removeprefix("hf_lowzero.zero.") for a in node.names if a.name.startswith("hf_lowzero.zero.")
                }
        found[_module(path)] = {n for n in names if n}
    return found


def test_rooms_import_downward_only():
    upward = [
        f"{module} ({_room(module)}) imports {imported} ({_room(imported)})"
        for module, imported_set in _imports().items()
        for imported in imported_set
        if ROOMS.index(_room(imported)) > ROOMS.index(_room(module))
    ]
    assert not upward, "imports from a higher room:\n" + "\n".join(sorted(upward))


def test_the_reducer_knows_the_integrity_checks_by_their_protocol_only():
    assert not any(imported.startswith("integrity") for imported in _imports()["grads.reducer"])


def test_no_import_cycle():
    graph = _imports()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(module) :], module]))
        if module in done:
            return
        for imported in graph.get(module, ()):
            visit(imported, [*path, module])
        done.add(module)

    for module in graph:
        visit(module, [])


def test_no_module_is_over_450_lines():
    long = {str(p.relative_to(ZERO)): n for p in ZERO.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long


# The package's rooms, bottom to top: a room imports only from rooms before it. Two named exceptions:
# ``python -m hf_lowzero.plan`` (the plan's command, an entry point that parses the Trainer's flags)
# and ``hf_lowzero.ray``'s deprecated aliases of the fine-tune job's names (a lazy import that goes
# away with them).
PACKAGE_ROOMS = [
    "process_guard", "zero", "data", "testing", "checkpoint", "consolidate", "snapshot", "simulation", "plan",
    "trainer", "ray", "recipes", "__init__",
]  # fmt: skip
ENTRY_POINTS = {("plan/__main__.py", "trainer"), ("ray/__init__.py", "recipes")}


def test_the_package_rooms_import_downward_only():
    root = ZERO.parent
    upward = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        room = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hf_lowzero."):
                target = node.module.split(".")[1]
                exempt = target == room or (rel.as_posix(), target) in ENTRY_POINTS
                if not exempt and PACKAGE_ROOMS.index(target) > PACKAGE_ROOMS.index(room):
                    upward.append(f"{rel} ({room}) imports {node.module}")
    assert not upward, "imports from a higher room:\n" + "\n".join(sorted(upward))
