"""The Franka app's parts (clients/dreamzero-franka, docs/franka.md): `common` is what DROID joint control (`droid`)
and franka_pnp (`pnp`) share, so it imports neither of them nor the app's top (`cli`, `connect`, `recording`,
`franky_backend`); `droid` and `pnp` never import each other. Checked by reading every import, function-level ones
included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "clients" / "dreamzero-franka" / "dreamzero_franka"
#: part -> the parts of the app it may import (besides itself)
ALLOWED = {"common": set(), "droid": {"common"}, "pnp": {"common"}}


def part_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "dreamzero_franka" or len(parts) < 2:
        return None
    return parts[1]


def crossings(app: Path = APP) -> list[str]:
    bad = []
    for part, allowed in ALLOWED.items():
        for path in sorted((app / part).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    names = [node.module]
                for module in names:
                    target = part_of(module)
                    if target is not None and target != part and target not in allowed:
                        bad.append(f"{part}/{path.relative_to(app / part)} -> {module}")
    return bad


def test_common_stands_below_droid_and_pnp():
    assert {p.name for p in APP.iterdir() if p.is_dir() and p.name != "__pycache__"} >= set(ALLOWED)
    assert crossings() == []


def test_a_planted_upward_import_is_caught(tmp_path):
    for part in ALLOWED:
        (tmp_path / part).mkdir()
    (tmp_path / "common" / "gate.py").write_text("def f():\n    from dreamzero_franka.pnp.loop import X\n")
    (tmp_path / "droid" / "loop.py").write_text(
        "import dreamzero_franka.pnp.policy\nfrom dreamzero_franka.common import x\n"
    )
    assert crossings(tmp_path) == [
        "common/gate.py -> dreamzero_franka.pnp.loop",
        "droid/loop.py -> dreamzero_franka.pnp.policy",
    ]
