"""The layer rule of docs/ARCHITECTURE.md holds: no module imports a layer above its own, no import
cycle between modules, and no library file passes 300 lines."""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("nanotrain", "weights", "tasks")
MAX_LINES = 300


def layers() -> dict[str, int]:
    """``room -> layer`` from the architecture page's table (``| 0 | config, tree, ... |``)."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    out = {}
    for level, rooms in re.findall(r"^\| (\d) \| ([^|]+) \|", text, flags=re.M):
        for room in rooms.split(","):
            out[room.strip().strip("`").rstrip("/")] = int(level)
    return out


def room(module: str) -> str:
    """``nanotrain.train.loop`` -> ``train``; ``nanotrain.config`` -> ``config``; ``weights.gpt2`` -> ``weights``."""
    parts = module.split(".")
    return parts[1] if parts[0] == "nanotrain" and len(parts) > 1 else parts[0]


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            out[name] = path
    return out


def imports(path: Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports (``from a import b`` counts ``a.b`` when that is a module)."""
    found = set()
    tree = ast.parse(path.read_text())
    # Imports under ``if TYPE_CHECKING:`` are for annotations only: they never run, so form no cycle.
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m in known and m.split(".")[0] in PACKAGES}


def test_no_module_imports_a_layer_above_its_own():
    level, mods = layers(), modules()
    unknown = sorted({room(m) for m in mods} - set(level) - {"nanotrain"})
    assert not unknown, f"rooms missing from docs/ARCHITECTURE.md's layer table: {unknown}"
    level["nanotrain"] = -1
    bad = [f"{m} (layer {level[room(m)]}) imports {i} (layer {level[room(i)]})"
           for m, path in mods.items() for i in imports(path, set(mods)) if level[room(i)] > level[room(m)]]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    mods = modules()
    graph = {m: imports(p, set(mods)) - {m} for m, p in mods.items()}
    # a package's __init__ re-exports its own modules: an edge into one's own package is not a cycle
    graph = {m: {i for i in deps if not m.startswith(i + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for i in graph[m]:
            if state.get(i) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(i):] + [m, i]))
            if i not in state:
                visit(i, stack + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_library_files_stay_small():
    long = [f"{p.relative_to(REPO)}: {n} lines" for pkg in ("nanotrain", "weights") for p in (REPO / pkg).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"library files over {MAX_LINES} lines (split them by concern): {long}"
