"""Data flows one way: a lower layer of the package never imports a higher one.

Layers, lowest first; a module may import its own package and any lower layer. Imports
under ``if TYPE_CHECKING:`` are annotations only and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "dcp_ext"
LAYERS = [
    {"errors"},
    {"runtime"},
    {"formats", "observe", "ntp"},
    {"storage"},
    {"exchange", "planning", "megatron"},
    {"conversion"},
    {"cli"},
]
LAYER_OF = {name: n for n, names in enumerate(LAYERS) for name in names}


def part_of(path: Path) -> str:
    """The top-level package or module of ``dcp_ext`` a file belongs to."""
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def runtime_imports(tree: ast.Module) -> list[str]:
    """Modules imported outside ``if TYPE_CHECKING:`` blocks."""
    skipped = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for node in ast.walk(stmt)
    }
    out = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out.extend(alias.name for alias in node.names)
    return out


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if part_of(p) != "__init__")


def test_every_part_of_the_package_has_a_layer():
    assert {part_of(p) for p in MODULES} <= set(LAYER_OF)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_module_imports_only_lower_layers(path):
    own = part_of(path)
    for module in runtime_imports(ast.parse(path.read_text())):
        parts = module.split(".")
        if parts[0] != "dcp_ext" or len(parts) < 2 or parts[1] == own:
            continue
        assert LAYER_OF[parts[1]] < LAYER_OF[own], f"{path.relative_to(PACKAGE)} ({own}) imports {module}"
