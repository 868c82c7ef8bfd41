"""The package's layers point one way (docs/ARCHITECTURE.md): a part may import only parts of lower
layers, never its own layer's siblings or anything above, lazy imports (inside functions) and
``TYPE_CHECKING`` imports included. No exceptions list: a new edge that breaks this fails here."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "zaya_jax"

# Lowest first. The parts of one layer do not import each other.
LAYERS: list[set[str]] = [
    {"allocator", "files", "staging"},
    {"config"},
    {"ops"},
    {"model"},
    {"loss", "optim", "data", "parallel", "interop", "checkpoint", "resilience"},
    {"programs", "pretrained"},
    {"generate"},
    {"objectives"},
    {"train", "eval"},
    {"lm", "config_reference"},
    {"cli", "harness", "__main__", "__init__"},
]
LAYER_OF = {part: level for level, parts in enumerate(LAYERS) for part in parts}


def _part(module: str) -> str:
    """The top-level part of ``zaya_jax.<part>...`` (``__init__`` for the package itself)."""
    bits = module.split(".")
    return bits[1] if len(bits) > 1 else "__init__"


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported zaya_jax module, line) for every import in ``path``, wherever it appears."""
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    package = ".".join(relative.parts if relative.name == "__init__" else relative.parts[:-1])
    package = package.removesuffix(".__init__")
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                # ``from zaya_jax import checkpoint`` imports the part ``checkpoint``
                is_part = base == "zaya_jax" and alias.name in LAYER_OF
                found.append((f"{base}.{alias.name}" if is_part else base, node.lineno))
    return [
        (module, line) for module, line in found if module == "zaya_jax" or module.startswith("zaya_jax.")
    ]


def _violations() -> list[str]:
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        me = relative.parts[0].removesuffix(".py")
        if me not in LAYER_OF:
            problems.append(f"{relative}: part {me!r} is in no layer; add it to LAYERS")
            continue
        for module, line in _imports(path):
            other = _part(module)
            if other == me:
                continue
            if other not in LAYER_OF:
                problems.append(f"{relative}:{line} imports {module}, whose part is in no layer")
            elif LAYER_OF[other] >= LAYER_OF[me]:
                problems.append(
                    f"{relative}:{line} ({me}, layer {LAYER_OF[me]}) imports {module} (layer {LAYER_OF[other]})"
                )
    return problems


def test_imports_point_down_the_layers():
    assert _violations() == []


def test_the_check_sees_lazy_and_relative_imports(tmp_path):
    source = tmp_path / "zaya_jax" / "model" / "x.py"
    source.parent.mkdir(parents=True)
    source.write_text(
        "def f():\n    from zaya_jax.train import loop\n    from ..lm import load\n    from zaya_jax import cli\n"
    )
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path / "zaya_jax"
    try:
        found = [_part(module) for module, _ in _imports(source)]
    finally:
        PACKAGE = saved
    assert found == ["train", "lm", "cli"]


def test_no_function_is_longer_than_80_lines():
    """One job per function (docs/ARCHITECTURE.md): a function past 80 lines is split, not waived."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []
