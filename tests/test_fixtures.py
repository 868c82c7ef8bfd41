"""Test fixtures live where fixtures live: a model, config or helper that several test modules use is
in ``tests/fixtures.py`` or a helper module beside them (``tests/random_model.py``,
``tests/data/corpora.py``, ``tests/parallel/processes.py``, ...), never in a ``test_*.py`` module that
others import; and the bench scripts, with the campaign code they share with CI tests
(``bench/campaigns/``), import nothing from ``tests``. Every import counts, lazy ones (inside
functions) included, and so does a dotted name in a string (an ``rl.reward=module:function``
override, ``python -m module``) that makes a program import a test module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("tests", "bench", "zaya_jax", "notebooks", "scripts")
TEST_MODULE_NAME = re.compile(r"(?<![\w/.])tests(?:\.\w+)*\.test_\w+")


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import in ``tree``: ``from a.b import c`` gives ``a.b`` and ``a.b.c``
    (``c`` may be a module)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def confinement_violations(root: Path) -> list[str]:
    """Every import of a ``test_*`` module (by a module or by a string that names one), and every
    import of ``tests`` by a module under ``bench/``, in the Python files below ``root``."""
    problems = []
    for top in SCANNED:
        for path in sorted((root / top).rglob("*.py")):
            where = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=where)
            for line, module in _imports(tree):
                parts = module.split(".")
                tests = [i for i, part in enumerate(parts) if part.startswith("test_")]
                if tests:
                    problems.append(
                        f"{where}:{line} imports the test module {'.'.join(parts[: tests[0] + 1])}"
                    )
                elif top == "bench" and parts[0] == "tests":
                    problems.append(f"{where}:{line} (bench) imports from tests")
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    for name in TEST_MODULE_NAME.findall(node.value):
                        problems.append(f"{where}:{node.lineno} names the test module {name} in a string")
    return sorted(set(problems))


def test_no_module_imports_a_test_module_and_no_bench_script_imports_tests():
    assert confinement_violations(ROOT) == []


def test_the_check_sees_each_kind_of_import(tmp_path):
    loop = ".".join(["tests", "train", "test_loop"])  # (not spelled out: this file's strings are checked)
    (tmp_path / "tests" / "train").mkdir(parents=True)
    (tmp_path / "tests" / "train" / "test_loop.py").write_text("MINI = []\n")
    (tmp_path / "tests" / "fixtures.py").write_text("MINI = []\n")
    (tmp_path / "tests" / "test_ok.py").write_text("from tests.fixtures import MINI\nimport tests.fixtures\n")
    (tmp_path / "tests" / "test_a.py").write_text(f"from {loop} import MINI\n")
    (tmp_path / "tests" / "helper.py").write_text("def f():\n    from tests.train import test_loop\n")
    (tmp_path / "tests" / "test_b.py").write_text(f'GRPO = ["rl.reward={loop}:reward"]\n')
    (tmp_path / "bench" / "campaigns").mkdir(parents=True)
    (tmp_path / "bench" / "campaigns" / "c.py").write_text("import tests.fixtures\n")
    (tmp_path / "bench" / "script.py").write_text("from tests import fixtures\nimport bench.campaigns.c\n")
    assert confinement_violations(tmp_path) == [
        "bench/campaigns/c.py:1 (bench) imports from tests",
        "bench/script.py:1 (bench) imports from tests",
        f"tests/helper.py:2 imports the test module {loop}",
        f"tests/test_a.py:1 imports the test module {loop}",
        f"tests/test_b.py:1 names the test module {loop} in a string",
    ]
