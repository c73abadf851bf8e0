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
    """``nanotrain.core.train.loop`` -> ``train``; ``nanotrain.config`` -> ``config``; ``weights.gpt2`` -> ``weights``."""
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
    # Every import counts, inside a function or under ``if TYPE_CHECKING:`` too: an import that does not run at
    # load time still makes each of two files need the other to be read, and that is the circle we refuse.
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    # importing ``a.b.c`` runs ``a/b/__init__.py`` first: that package is imported too, and can close a cycle
    found |= {m.rsplit(".", 1)[0] for m in set(found) if "." in m}
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


# An engine imports the core and the foundation; it imports another engine only where it composes it. Each edge
# here is one the house has on purpose, with why; a new one is a decision, written down here first.
ENGINES = ("stream", "data_parallel", "tensor_parallel", "pipeline", "compose", "checkpoint")
ENGINE_EDGES = {
    ("compose", "tensor_parallel"): "the 3D model is the tensor-parallel model cut into stages",
    ("compose", "pipeline"): "those stages walked by a pipeline schedule",
    ("compose", "data_parallel"): "each stage's units reduced and updated by the data-parallel optimizer",
    ("stream", "data_parallel"): "ZeRO-Offload: its shards on the data-parallel engine's buckets and collectives, "
                                 "its trainer wrapped by that engine's DataParallelTrainer",
    ("data_parallel", "checkpoint"): "its shards of masters and moments read from the single-process state's slices",
    ("checkpoint", "tensor_parallel"): "a tensor-parallel leaf's slice follows its TP plan",
}


def test_engines_import_only_the_engines_they_compose():
    mods = modules()
    found = {(room(m), room(i)): f"{m} imports {i}" for m, p in mods.items() for i in imports(p, set(mods))
             if room(m) in ENGINES and room(i) in ENGINES and room(m) != room(i)}
    new = [why for edge, why in sorted(found.items()) if edge not in ENGINE_EDGES]
    assert not new, "an engine imports another it does not compose (list it in ENGINE_EDGES, with why):\n" + \
        "\n".join(new)
    gone = sorted(set(ENGINE_EDGES) - set(found))
    assert not gone, f"ENGINE_EDGES lists edges the code no longer has (strike them): {gone}"


def test_library_files_stay_small():
    long = [f"{p.relative_to(REPO)}: {n} lines" for pkg in ("nanotrain", "weights") for p in (REPO / pkg).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"library files over {MAX_LINES} lines (split them by concern): {long}"


# The model seam (docs/ARCHITECTURE.md, "Where new things go"): a family is a folder under nanotrain/core/models/, and
# only the registry imports it; nothing else in the library names a family's leaves or its config class.
FAMILY_FOLDERS = ("nanotrain/core/models/gpt2/", "nanotrain/core/models/llama/")
REGISTRY = "nanotrain/core/models/registry.py"
# A peer that is GPT-2 by design: the DTensor benchmark's own nn.Module GPT-2.
SEAM_ALLOWED = ("tasks/bench/peers/dtensor.py",)
GPT2_WORDS = re.compile(r"\bGPT2Config\b"
                        r"|[\"'](wte|wpe|ln_f_[wb]|qkv_[wb]|proj_[wb]|fc_[wb]|fc_proj_[wb]|ln_[12]_[wb])[\"']"
                        r"|\bc_attn\b|\bc_fc\b")
FAMILY_IMPORT = re.compile(r"nanotrain\.core\.models\.(gpt2|llama)\b"
                           r"|from nanotrain\.core\.models import[^\n]*\b(gpt2|llama)\b")


def _library_files() -> list[tuple[str, str]]:
    out = []
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            rel = str(path.relative_to(REPO))
            if not rel.startswith(FAMILY_FOLDERS) and rel not in SEAM_ALLOWED:
                out.append((rel, path.read_text()))
    return out


def test_engines_never_name_a_family():
    named = [f"{rel}: {m.group(0)}" for rel, text in _library_files() for m in GPT2_WORDS.finditer(text)]
    assert not named, "GPT-2's config or leaf names outside nanotrain/core/models/gpt2/ (read the ModelSpec):\n" + \
        "\n".join(named)


def test_only_the_registry_imports_a_family():
    bad = [f"{rel}: {m.group(0)}" for rel, text in _library_files() if rel != REGISTRY
           for m in FAMILY_IMPORT.finditer(text)]
    assert not bad, "a family folder imported outside nanotrain/core/models/registry.py (use model_spec/preset):\n" + \
        "\n".join(bad)
