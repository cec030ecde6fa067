"""The model package never imports the checkpoint package (the readers depend on the model, not the reverse)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parents[3] / "dreamzero" / "model"


def _imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def test_no_model_module_names_the_checkpoint_package():
    files = sorted(MODEL_DIR.glob("*.py"))
    assert len(files) > 5
    offenders = {
        f.name: sorted(m for m in _imported_modules(f) if m.startswith("dreamzero.checkpoint") or m == "dreamzero")
        for f in files
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_importing_and_building_the_model_leaves_checkpoint_unimported():
    code = (
        "import sys\n"
        "from dreamzero.config import preset\n"
        "from dreamzero.model.dreamzero import DreamZeroModel\n"
        "import dreamzero.model.dit, dreamzero.model.scheduler, dreamzero.model.tokenizer\n"
        "DreamZeroModel.from_config(preset('libero_5b'), device='meta').release_tensors()\n"
        "print(sorted(m for m in sys.modules if m.startswith('dreamzero.checkpoint')))\n"
    )
    root = MODEL_DIR.parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
