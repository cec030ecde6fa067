"""House rule: a file path a docstring, comment or pyproject.toml names exists in the repository (a moved or renamed
file leaves no stale pointer behind). Checked by reading every Python file of the tree and pyproject.toml; a path
is read relative to the repository root or to `clients/`, as the client package's own files write it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("dreamzero", "deployments", "serve_graph", "eval", "clients", "tests", "scripts", "benchmarks")
#: the house-rule tests plant made-up files in copies of the tree
SKIPPED = ("tests/graph", "tests/house")
_TOP = "dreamzero|deployments|serve_graph|eval|clients|tests|docs|scripts|benchmarks"
PATH = re.compile(rf"(?<![\w./-])((?:{_TOP})/[\w./-]*\.(?:py|md|yaml|yml|toml|json|sh))")


def stale_references(root: Path) -> list[str]:
    files = [root / "pyproject.toml"]
    for top in SCANNED:
        files += [p for p in sorted((root / top).rglob("*.py")) if ".egg-info" not in str(p)]
    found = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        if not path.is_file() or rel.startswith(SKIPPED):
            continue
        text = path.read_text()
        for match in PATH.finditer(text):
            named = match.group(1).rstrip(".")
            if not ((root / named).exists() or any((d / named).exists() for d in (root / "clients").glob("*/"))):
                found.append(f"{rel}:{text[: match.start()].count(chr(10)) + 1}: {named}")
    return found


def test_every_named_file_exists():
    assert stale_references(ROOT) == []


def test_the_rule_catches_a_stale_reference(tmp_path):
    (tmp_path / "dreamzero").mkdir()
    (tmp_path / "dreamzero" / "here.py").write_text('"""See dreamzero/here.py and dreamzero/gone.py."""\n')
    (tmp_path / "pyproject.toml").write_text('deps = ["pyzmq"]  # deployments/zmq_ingress.py\n')
    assert stale_references(tmp_path) == ["pyproject.toml:1: deployments/zmq_ingress.py", "dreamzero/here.py:1: "
                                          "dreamzero/gone.py"]  # fmt: skip
