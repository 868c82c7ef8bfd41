"""The package's layers point one way (docs/ARCHITECTURE.md): a part may import only parts of lower
layers, never its own layer's siblings or anything above, and no module imports itself back through
others, inside a part either; lazy imports (inside functions) and ``TYPE_CHECKING`` imports
included. No exceptions list: a new edge that breaks this fails here."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "zaya_jax"

# Lowest first. The parts of one layer do not import each other.
LAYERS: list[set[str]] = [
    {"allocator", "files", "staging"},
    {"config"},
    {"ops", "rewards"},
    {"model"},
    {"loss", "optim", "data", "interop", "resilience"},
    {"lora"},
    {"parallel", "checkpoint"},
    {"programs", "pretrained"},
    {"engine"},
    {"generate", "scoring"},
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


def _module_file(module: str) -> Path | None:
    """The file of a ``zaya_jax`` module (``a/b.py`` or ``a/b/__init__.py``), None if it is none."""
    base = PACKAGE.parent.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


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
                # ``from zaya_jax import checkpoint`` imports the part ``checkpoint``, and
                # ``from zaya_jax.ops import attention`` the module ``ops.attention``
                name = f"{base}.{alias.name}"
                is_module = _module_file(name) is not None or (base == "zaya_jax" and alias.name in LAYER_OF)
                found.append((name if is_module else base, node.lineno))
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


def _module_of(path: Path) -> str:
    """``zaya_jax/a/b.py`` -> ``zaya_jax.a.b``; ``zaya_jax/a/__init__.py`` -> ``zaya_jax.a``."""
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def _import_graph() -> dict[str, dict[str, tuple[str, int]]]:
    """module -> {imported module: (importing file, line) of its first import}. An import names the
    module it names, or where that is not a module (``from zaya_jax.a import f``) its package's
    ``__init__``."""
    graph: dict[str, dict[str, tuple[str, int]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        edges = graph.setdefault(_module_of(path), {})
        for module, line in _imports(path):
            while module and _module_file(module) is None:
                module = module.rpartition(".")[0]
            if module:
                edges.setdefault(module, (str(path.relative_to(PACKAGE.parent)), line))
    return graph


def _components(graph: dict[str, dict[str, tuple[str, int]]]) -> list[list[str]]:
    """The strongly connected components of the graph (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, {}):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _cycles() -> list[str]:
    """One import cycle per strongly connected component of the module graph (a module importing
    itself included), as ``a -> b (file:line) -> a (file:line)`` with the rest of its component."""
    graph = _import_graph()
    found = []
    for component in _components(graph):
        start = component[0]
        if len(component) == 1 and start not in graph[start]:
            continue
        members = set(component)
        paths = {start: [start]}  # breadth-first: the shortest way back to ``start``
        queue = [start]
        while queue:
            node = queue.pop(0)
            if start in graph[node]:
                break
            for other in sorted(graph[node]):
                if other in members and other not in paths:
                    paths[other] = [*paths[node], other]
                    queue.append(other)
        cycle = [*paths[node], start]
        steps = [cycle[0]] + [
            f"{b} ({graph[a][b][0]}:{graph[a][b][1]})" for a, b in itertools.pairwise(cycle)
        ]
        rest = sorted(members - set(cycle))
        found.append(" -> ".join(steps) + (f"; its component also holds {', '.join(rest)}" if rest else ""))
    return sorted(found)


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


def test_no_module_imports_itself_back():
    """No import cycle among the modules, inside a part either (a package's ``__init__`` and the
    modules it imports included): each is a circle a lazy import only holds open."""
    cycles = _cycles()
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_cycle_check_sees_lazy_type_checking_and_package_imports(tmp_path):
    package = tmp_path / "zaya_jax" / "ops"
    package.mkdir(parents=True)
    sources = {
        "__init__.py": "",
        "ops/__init__.py": "from zaya_jax.ops.c import h\n",
        "ops/a.py": "from zaya_jax.ops.b import g\n",
        "ops/b.py": "def g():\n    from . import a\n",
        "ops/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from zaya_jax.ops import a, f\n",
        "ops/d.py": "import zaya_jax.ops.a\nfrom zaya_jax.ops import b\n",  # no cycle
    }
    for name, text in sources.items():
        (tmp_path / "zaya_jax" / name).write_text(text)
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path / "zaya_jax"
    try:
        found = _cycles()
    finally:
        PACKAGE = saved
    assert found == [
        "zaya_jax.ops -> zaya_jax.ops.c (zaya_jax/ops/__init__.py:1) -> zaya_jax.ops (zaya_jax/ops/c.py:3)",
        "zaya_jax.ops.a -> zaya_jax.ops.b (zaya_jax/ops/a.py:1) -> zaya_jax.ops.a (zaya_jax/ops/b.py:2)",
    ]


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


def test_no_module_is_longer_than_600_lines():
    """A module past 600 lines holds more than one job (issue 37): it is split, not waived."""
    long = [
        f"{path.relative_to(PACKAGE)} ({n} lines)"
        for path in sorted(PACKAGE.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > 600
    ]
    assert long == []


def test_the_training_loop_stays_a_driver():
    """``train/loop.py`` reads top to bottom: at most 250 lines, no function with more than six
    parameters (the step's mechanics live in ``pipeline`` and ``steps``)."""
    loop = PACKAGE / "train" / "loop.py"
    assert len(loop.read_text().splitlines()) <= 250
    wide = []
    for node in ast.walk(ast.parse(loop.read_text())):
        if isinstance(node, ast.FunctionDef):
            args = node.args
            count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
            if count > 6:
                wide.append(f"{node.name} ({count} parameters)")
    assert wide == []


def test_only_the_objectives_package_names_an_objective():
    """Which objective a run trains is asked of its spec (``zaya_jax.objectives.spec_for``); no
    other module tests ``train.objective`` by name or a producer by type."""
    pattern = re.compile(r"objective\s*(==|!=|\bin\b|\bnot in\b)|isinstance\(.*Rollouts")
    found = [
        f"{path.relative_to(PACKAGE)}:{i}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != "objectives"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []
