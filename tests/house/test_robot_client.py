"""The robot's client distribution (clients/dreamzero-client) stays small and stands alone, checked by reading the
sources: its package stays under `MAX_LINES` lines (the goal is `GOAL_LINES`); it declares numpy, msgpack and
websockets and nothing else (the other transports are extras); and its tests (`ROBOT_CLIENT_TESTS`) import nothing
of ours beyond `dreamzero_client`, so they run in a virtualenv that holds only that package
(tests/e2e/test_light_client.py runs them there)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "clients" / "dreamzero-client"
GOAL_LINES = 2000  # issue 46's goal for the robot's client
#: the ceiling, which holds the goal; the package may only shrink below it. What is left is client code (three
#: transports, TLS, reading CURVE key files, the bounded codec that also reads replies) and its documentation: what
#: only the server ran (request sizing and decode pool, OpenPI frame builders, server-raised errors, the session
#: report type, the CURVE key generator `dreamzero-zmq-keys`) moved server-side
MAX_LINES = GOAL_LINES
#: what `pip install ./clients/dreamzero-client` brings, with no extra
DEPENDENCIES = {"numpy", "msgpack", "websockets"}
EXTRAS = {"http": {"httpx"}, "zmq": {"pyzmq"}}

#: the tests of the robot's client: the wire codec, the three transports, their errors, TLS
ROBOT_CLIENT_TESTS = (
    "tests/unit/client/test_codec.py",
    "tests/unit/client/test_http_client.py",
    "tests/unit/client/test_http_client_extra.py",
    "tests/unit/client/test_openpi_client.py",
    "tests/unit/client/test_zmq_client_extra.py",
    "tests/unit/client/test_quota.py",
    "tests/unit/client/test_tls.py",
    "tests/unit/client/test_fleet_fields.py",
)
#: what those tests may import besides the standard library: the client package, its libraries, and test-only ones
#: (tests/e2e/test_light_client.py installs these beside it)
TEST_LIBRARIES = ("pytest", "pytest-timeout", "msgpack-numpy", "cryptography", "uvicorn")
ALLOWED_TOP = {"dreamzero_client", "numpy", "msgpack", "websockets", "httpx", "zmq"} | {
    "pytest",
    "msgpack_numpy",
    "cryptography",
    "uvicorn",
}


def package_lines(root: Path = CLIENT) -> int:
    return sum(len(p.read_text().splitlines()) for p in (root / "dreamzero_client").rglob("*.py"))


def _imports(path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
    return found


def client_test_closure(tests: tuple[str, ...], root: Path = ROOT) -> tuple[list[str], list[Path]]:
    """(`file: module` for each import outside `ALLOWED_TOP` and the standard library, every file those tests need):
    the tests, the `tests.*` helpers they import (their module-level imports count: a helper's function-level import
    runs only for who calls it), the packages' `__init__.py` and tests/conftest.py, which pytest loads for them."""
    bad, seen = [], set()
    conftest = root / "tests" / "conftest.py"
    todo = [(conftest, True)] if conftest.is_file() else []
    todo += [(root / t, False) for t in tests]
    while todo:
        path, helper = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        init = path.parent / "__init__.py"
        if init.is_file() and init.parent != root:
            todo.append((init, True))
        for module in sorted(_imports(path, top_level_only=helper)):
            top = module.split(".")[0]
            if top == "tests":
                parts = module.split(".")
                target = root.joinpath(*parts).with_suffix(".py")
                todo.append((target if target.is_file() else root.joinpath(*parts, "__init__.py"), True))
            elif top not in ALLOWED_TOP and top not in sys.stdlib_module_names and top != "__future__":
                bad.append(f"{path.relative_to(root)}: {module}")
    return bad, sorted(seen)


def foreign_imports(tests: tuple[str, ...], root: Path = ROOT) -> list[str]:
    return client_test_closure(tests, root)[0]


def test_the_robot_client_package_is_under_its_line_budget():
    lines = package_lines()
    assert lines < MAX_LINES, (
        f"clients/dreamzero-client is {lines} lines (ceiling {MAX_LINES}): move what only the server runs"
    )


def test_the_robot_client_declares_only_numpy_msgpack_and_one_transport():
    project = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {r.split(">")[0].split("=")[0].split("[")[0].strip().lower() for r in reqs}  # noqa: E731
    assert names(project["dependencies"]) == DEPENDENCIES
    extras = {k: names(v) for k, v in project.get("optional-dependencies", {}).items()}
    assert extras == EXTRAS


def test_the_robot_clients_tests_import_only_the_robot_client():
    assert all((ROOT / t).is_file() for t in ROBOT_CLIENT_TESTS), [
        t for t in ROBOT_CLIENT_TESTS if not (ROOT / t).is_file()
    ]
    assert foreign_imports(ROBOT_CLIENT_TESTS) == []


def test_the_checks_catch_a_server_import_and_a_long_package(tmp_path):
    tests = tmp_path / "tests"
    (tests / "unit").mkdir(parents=True)
    (tests / "unit" / "test_a.py").write_text("import numpy\nfrom tests.helper import x\n\ndef f():\n    import ray\n")
    (tests / "helper.py").write_text("from dreamzero.errors import DreamZeroError\n\ndef g():\n    import torch\n")
    assert foreign_imports(("tests/unit/test_a.py",), tmp_path) == [
        "tests/unit/test_a.py: ray",
        "tests/helper.py: dreamzero.errors",
    ]
    package = tmp_path / "client" / "dreamzero_client"
    package.mkdir(parents=True)
    (package / "big.py").write_text("x = 1\n" * MAX_LINES)
    assert package_lines(tmp_path / "client") == MAX_LINES
