"""The robot client's tests and what they may import, read from the sources: the house rule that they stand alone
(tests/house/test_robot_client.py) and the e2e test that runs them in a virtualenv holding only the robot's client
package (tests/e2e/test_light_client.py) both take the list and the closure from here. Standard library only."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: what `pip install ./clients/dreamzero-client` brings, with no extra
DEPENDENCIES = {"numpy", "msgpack", "websockets"}

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


def _conftests(test: Path, root: Path) -> list[Path]:
    """The conftest.py files pytest loads for `test`: tests/conftest.py and each one on the way down to its folder."""
    folders = [test.parent, *test.parent.parents]
    return [f / "conftest.py" for f in folders if f.is_relative_to(root / "tests") and (f / "conftest.py").is_file()]


def client_test_closure(tests: tuple[str, ...], root: Path = ROOT) -> tuple[list[str], list[Path]]:
    """(`file: module` for each import outside `ALLOWED_TOP` and the standard library, every file those tests need):
    the tests, the `tests.*` helpers they import (their module-level imports count: a helper's function-level import
    runs only for who calls it), the packages' `__init__.py` and the conftest.py files pytest loads for them."""
    bad, seen = [], set()
    todo = [(root / t, False) for t in tests]
    todo += [(conftest, True) for t in tests for conftest in _conftests(root / t, root)]
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
