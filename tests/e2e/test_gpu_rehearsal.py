"""`scripts/gpu-check.sh --rehearse`: every stage of the GPU check on this CPU (a 141 GiB GPU simulated, the slice
presets, the shipped `serve_config.yaml` changed only as the README tells a GPU user), ending in one PASS line; and
the same script failing on the two defects a read of the GPU path found before any GPU run, when they are put back:
1. `batching.max_batch_rows: null` (a batch as large as `sessions.max_sessions`) in the shipped config;
2. a latency benchmark whose compile-none modes run the DiT blocks a compiled mode compiled in place.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
#: the rehearsal bounds its stages itself (scripts/gpu_check.py --budget-s: 1500 s rehearsing); this test's bounds
#: sit above it, so the script's own FAIL line is what a slow run shows, not pytest's timeout (600 s by default)
REHEARSAL_BUDGET_S = 1500
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(REHEARSAL_BUDGET_S + 300)]

sys.path.insert(0, str(ROOT / "scripts"))
from gpu_check import stop_group  # noqa: E402


def rehearse(logs: Path, *args: str, timeout_s: float = REHEARSAL_BUDGET_S + 180) -> tuple[int, str, str]:
    """(exit code, last line, whole output) of `gpu-check.sh --rehearse <args>`. Run in its own process group, which
    is stopped whole if the run is cut short (its bound, or pytest's): no stage or server outlives the test."""
    proc = subprocess.Popen(
        [str(SCRIPT), "--rehearse", "--logs", str(logs), *args], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except BaseException:
        stop_group(proc)
        raise
    out = stdout + stderr
    lines = [line for line in stdout.splitlines() if line.strip()]
    return proc.returncode, (lines[-1] if lines else ""), out


def test_the_rehearsal_of_every_stage_passes(tmp_path):
    code, last, out = rehearse(tmp_path)
    assert code == 0 and last.startswith("gpu-check rehearsal: PASS"), out[-6000:]
    assert "(tier, bench, offline, docs)" in last


def test_the_old_rows_default_fails_the_serve_step(tmp_path):
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["applications"][0]["args"]["batching"]["max_batch_rows"] = None  # defect 1 put back
    defective = tmp_path / "serve_config.yaml"
    defective.write_text(yaml.safe_dump(config))
    code, last, out = rehearse(tmp_path, "--only", "tier", "--tier-select", "serve_run_14b", "--serve-config",
                               str(defective))  # fmt: skip
    assert code == 1 and last.startswith("gpu-check rehearsal: FAIL tier:"), out[-6000:]
    log = (tmp_path / "gpu-tier.txt").read_text()
    assert "batching.max_batch_rows=null (sessions.max_sessions=128)" in log, log[-6000:]


def test_a_benchmark_that_runs_compiled_code_in_its_none_rows_fails(tmp_path):
    source = (ROOT / "benchmarks" / "model_latency.py").read_text()
    guard = "    with compiled_only(pipe.model, pipe.compiled):"
    assert guard in source, "the benchmark no longer runs each chunk under compiled_only: update this test"
    defective = source.replace(guard, "    with contextlib.nullcontext():  # defect 2 put back")
    defective = defective.replace("import argparse\n", "import argparse\nimport contextlib\n", 1)
    defective = defective.replace("Path(__file__).resolve().parents[1]", repr(str(ROOT)), 1)
    script = tmp_path / "model_latency.py"
    script.write_text(defective)
    code, last, out = rehearse(tmp_path, "--only", "bench", "--bench-script", str(script))
    assert code == 1, out[-6000:]
    assert last.startswith("gpu-check rehearsal: FAIL bench: row '16 steps' ran compiled='dit.blocks'"), last
