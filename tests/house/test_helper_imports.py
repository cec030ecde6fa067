"""House rule (docs/testing.md, "One helper convention"): code shared between test modules lives in a module of
`tests/support/` named for its topic, and a shared fixture in a `conftest.py`. So no file of the tests or the
benchmarks imports a test module (`test_*.py`: importing one runs its module-level setup again and, for a fixture,
hides where it comes from) nor a `conftest.py` (pytest loads those itself and hands their fixtures out by name; a
conftest holds fixtures and hooks only). Checked by parsing every Python file under tests/ and benchmarks/: imports
inside functions count, relative ones are resolved. Beside tests/support/, the only helper module of a tier is
`TIER_HELPERS`'s, each with its reason.
`test_a_planted_import_of_a_test_module_or_a_conftest_fails` plants each kind of violation in a made-up tree.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("tests", "benchmarks")
#: helper modules of a tier outside tests/support -> why they stay there
TIER_HELPERS = {
    # the GPU tier's output: the figure lines its one test module writes and scripts/gpu_check.py and
    # scripts/gpu_docs.py read (stdlib only, named by path there); no other test takes it
    "tests/gpu/figures.py": "the GPU tier's figures file format",
}


def _module(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def imported_names(source: str, module: str, is_package: bool) -> set[str]:
    """Every module or name `source` imports, anywhere in the file, relative imports made absolute."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from package import test_module`
    return found


def _is_test_module_or_conftest(path: Path) -> bool:
    return path.name.startswith("test_") or path.name == "conftest.py"


def forbidden_imports(root: Path) -> list[str]:
    """`file: module` for each import of a test module or a conftest (the file of the tests or benchmarks that does)."""
    files = {p for top in SCANNED for p in (root / top).rglob("*.py") if "__pycache__" not in p.parts}
    by_module = {_module(p, root): p for p in files if p.is_relative_to(root / "tests")}
    found = []
    for path in sorted(files):
        names = imported_names(path.read_text(), _module(path, root), path.name == "__init__.py")
        targets = set()
        for name in names:
            while name and name not in by_module:  # a name inside a module resolves to that module
                name = name.rpartition(".")[0]
            if name and by_module[name] != path and _is_test_module_or_conftest(by_module[name]):
                targets.add(name)
        found += [f"{path.relative_to(root)}: {t}" for t in sorted(targets)]
    return found


def stray_helpers(root: Path) -> list[str]:
    """Modules under tests/ that are neither a test module, a conftest, a package's `__init__`, in tests/support/,
    nor one of `TIER_HELPERS`: a second home for shared code."""
    return [
        rel
        for path in sorted((root / "tests").rglob("*.py"))
        if "__pycache__" not in path.parts
        and not _is_test_module_or_conftest(path)
        and path.name != "__init__.py"
        and not path.is_relative_to(root / "tests" / "support")
        and (rel := path.relative_to(root).as_posix()) not in TIER_HELPERS
    ]


def test_no_test_module_or_conftest_is_imported():
    found = forbidden_imports(ROOT)
    assert found == [], f"move what is shared to a tests/support/<topic>.py module (a fixture: a conftest.py): {found}"


def test_shared_code_lives_in_tests_support():
    assert all((ROOT / p).is_file() for p in TIER_HELPERS), [p for p in TIER_HELPERS if not (ROOT / p).is_file()]
    found = stray_helpers(ROOT)
    assert found == [], f"move these to tests/support/<topic>.py, or list them in TIER_HELPERS with why: {found}"


def test_a_planted_import_of_a_test_module_or_a_conftest_fails(tmp_path):
    tests = tmp_path / "tests"
    for folder in ("unit", "cluster", "support"):
        (tests / folder).mkdir(parents=True)
        (tests / folder / "__init__.py").write_text("")
    (tests / "__init__.py").write_text("")
    (tmp_path / "benchmarks").mkdir()
    (tests / "support" / "things.py").write_text("X = 1\n")
    (tests / "cluster" / "conftest.py").write_text("API_KEY = 'k'\n")
    (tests / "unit" / "test_a.py").write_text("from tests.support.things import X\n\nHELPER = X\n")
    assert forbidden_imports(tmp_path) == [] and stray_helpers(tmp_path) == []

    plants = {
        "from tests.unit.test_a import HELPER": "tests.unit.test_a",
        "from tests.unit import test_a": "tests.unit.test_a",
        "import tests.unit.test_a": "tests.unit.test_a",
        "from .test_a import HELPER": "tests.unit.test_a",  # relative
        "def f():\n    from tests.cluster.conftest import API_KEY": "tests.cluster.conftest",  # inside a function
        "from tests.cluster import conftest": "tests.cluster.conftest",
    }
    for line, target in plants.items():
        (tests / "unit" / "test_b.py").write_text(line + "\n")
        assert forbidden_imports(tmp_path) == [f"tests/unit/test_b.py: {target}"], line
    (tests / "unit" / "test_b.py").unlink()
    (tmp_path / "benchmarks" / "bench.py").write_text("from tests.unit.test_a import HELPER\n")  # benchmarks too
    assert forbidden_imports(tmp_path) == ["benchmarks/bench.py: tests.unit.test_a"]

    (tests / "unit" / "helpers.py").write_text("Y = 2\n")  # a second home for shared code
    assert stray_helpers(tmp_path) == ["tests/unit/helpers.py"]
