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


# The package's rooms, bottom to top: a room imports only from rooms before it, with no exception.
# The plan's command, which parses the Trainer's flags, lives in trainer/ (``plan_cli.py``), and
# hf_lowzero.ray exports nothing of the fine-tune job in recipes/ (issue 56).
PACKAGE_ROOMS = [
    "lazy_names", "process_guard", "zero", "data", "testing", "checkpoint", "consolidate", "snapshot", "simulation",
    "timing", "plan", "trainer", "ray", "recipes", "__init__",
]  # fmt: skip


def _package_imports(root: Path) -> list[tuple[str, str, str]]:
    """(file relative to ``root``, its room, the hf_lowzero module it imports) for every import of the
    package under ``root``, in any form: ``from hf_lowzero.x import y``, ``import hf_lowzero.x``,
    ``from hf_lowzero import x``; at the top or inside a function."""
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        room = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "hf_lowzero":
                modules = [f"hf_lowzero.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            found += [(rel.as_posix(), room, m) for m in modules if m.startswith("hf_lowzero.")]
    return found


def _upward_imports(root: Path) -> list[str]:
    upward = []
    for rel, room, module in _package_imports(root):
        target = module.split(".")[1]
        unknown = {room, target} - set(PACKAGE_ROOMS)
        if unknown:
            upward.append(f"{rel} ({room}) imports {module}: add {sorted(unknown)} to PACKAGE_ROOMS")
        elif PACKAGE_ROOMS.index(target) > PACKAGE_ROOMS.index(room):
            upward.append(f"{rel} ({room}) imports {module}")
    return sorted(upward)


def test_the_package_rooms_import_downward_only():
    upward = _upward_imports(ZERO.parent)
    assert not upward, "imports from a higher room:\n" + "\n".join(upward)


def test_the_plan_imports_nothing_above_it_and_ray_nothing_of_the_recipes():
    """The two arrows that ran back up until issue 56, named: plan -> trainer (the plan's command) and
    ray -> recipes (deprecated aliases of the fine-tune job)."""
    imports = _package_imports(ZERO.parent)
    above_plan = PACKAGE_ROOMS[PACKAGE_ROOMS.index("plan") + 1 :]
    assert not [i for i in imports if i[1] == "plan" and i[2].split(".")[1] in above_plan]
    assert not [i for i in imports if i[1] == "ray" and i[2].startswith("hf_lowzero.recipes")]
    assert ("trainer/plan_cli.py", "trainer", "hf_lowzero.plan.planner") in imports  # the command calls down


def test_the_package_check_finds_an_upward_import_in_any_form(tmp_path):
    """The check can fail: an upward import planted in each form it reads is reported, a downward one is not."""
    planted = {
        "plan/cli.py": "def main():\n    from hf_lowzero.trainer.arguments import LowZeroTrainingArguments\n",
        "ray/__init__.py": "import hf_lowzero.recipes.clm_ray\n",
        "simulation/launch.py": "from hf_lowzero import plan\n",
        "trainer/auto.py": "from hf_lowzero.plan.planner import plan_memory\nfrom . import arguments\n",
    }
    for rel, source in planted.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(source)
    assert _upward_imports(tmp_path) == [
        "plan/cli.py (plan) imports hf_lowzero.trainer.arguments",
        "ray/__init__.py (ray) imports hf_lowzero.recipes.clm_ray",
        "simulation/launch.py (simulation) imports hf_lowzero.plan",
    ]
