"""A rule the CPU tests cannot check by running: inside ``with torch.cuda.stream(side):``,
``torch.cuda.current_stream()`` is the side stream itself, so a copy that must wait for the compute stream
has to read it before entering the block. Twice a write-back waited on its own stream and copied weights
before their update (every streamed GPU run until it was found); this reads the library's source for it."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "nanotrain"


def _calls(node: ast.AST, name: str) -> list[int]:
    return [n.lineno for n in ast.walk(node) if isinstance(n, ast.Call) and ast.unparse(n.func).endswith(name)]


def test_no_current_stream_inside_a_side_stream_block():
    found = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.With) and any(_calls(item.context_expr, "cuda.stream") for item in node.items):
                found += [f"{path.relative_to(ROOT.parent)}:{line}" for stmt in node.body
                          for line in _calls(stmt, "current_stream")]
    assert not found, f"current_stream() read inside a torch.cuda.stream block (read it before): {found}"
