"""`scripts/gpu-check.sh --rehearse`: every stage of the GPU check on this CPU (the `offline` stage's test runs on
its own in CI: tests/e2e/test_gpu_offline_env.py), on a simulated 80 GiB and a simulated
141 GiB card (the slice and small presets, the shipped `serve_config.yaml` changed only as the README tells a GPU
user), ending in one PASS line; the batch sizes each card gets come from the memory planner (an 80 GiB card does not
time a batch of 4 14B sessions, a 141 GiB one does); and the script failing on the defect a read of the GPU path
found before any GPU run, when it is put back: `batching.max_batch_rows: null` (a batch as large as
`sessions.max_sessions`) in the shipped config. (A compiled row that ran eager code, or an eager one compiled code,
fails its stage, and a compiled stage that times out keeps the eager figures in the results file and in the written
docs, marked incomplete: tests/unit/scripts/test_gpu_check_stages.py, with a stand-in benchmark that writes its row
as the real one does; the real benchmark's rows reach the same files in the full run here.)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
#: the rehearsal bounds its stages itself (scripts/gpu_check.py --budget-s: 3000 s rehearsing); this test's bounds
#: sit above it, so the script's own FAIL line is what a slow run shows, not pytest's timeout (600 s by default)
REHEARSAL_BUDGET_S = 3000
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(REHEARSAL_BUDGET_S + 300)]

sys.path.insert(0, str(ROOT / "scripts"))
from gpu_check import STAGES, stop_group  # noqa: E402
from gpu_docs import read_results  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def kept_checkpoints(tmp_path_factory):
    """One folder for the slice checkpoints of every rehearsal in this module: each slice is written once (~20 s and
    2 GB), not once per tier process (tests/gpu/test_gpu_tier.py: `_kept`)."""
    folder = tmp_path_factory.mktemp("slices")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GPU_CHECK_CHECKPOINTS", str(folder))
        yield folder
    shutil.rmtree(folder, ignore_errors=True)  # ~5 GB


def rehearse(logs: Path, *args: str, timeout_s: float = REHEARSAL_BUDGET_S + 180) -> tuple[int, str, str]:
    """(exit code, last line, whole output) of `gpu-check.sh --rehearse <args>`. Run in its own process group, which
    is stopped whole if the run is cut short (its bound, or pytest's): no stage or server outlives the test."""
    proc = subprocess.Popen(
        [str(SCRIPT), "--rehearse", "--out", str(logs), *args], cwd=ROOT, stdout=subprocess.PIPE,
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


def section(out: Path) -> str:
    return (out / "benchmarks.md").read_text().split("## GPU\n", 1)[1].split("\n## ", 1)[0]


#: every stage but `offline`: in CI the air-gapped box's install runs as a test of its own
#: (tests/e2e/test_gpu_offline_env.py), on the other pytest-xdist worker, beside the rehearsal instead of after it
CI_STAGES = [s for s in STAGES if s != "offline"]


def test_the_rehearsal_of_every_stage_passes_on_both_cards(tmp_path):
    code, last, out = rehearse(tmp_path, "--only", ",".join(CI_STAGES))
    assert code == 0 and last.startswith("gpu-check rehearsal: PASS"), out[-6000:]
    assert "(env, smoke, eager, compiled, tier@80GiB, tier@141GiB, robots, robots_5b, latency_5b, fp8, cfg2)" in last
    results = read_results(tmp_path / "results.jsonl")
    fits = {(r["card"], r["figure"]): r["value"] for r in results if r.get("preset") == "droid_14b" and "card" in r}
    assert fits[("80GiB", "batch_fits_2")] == 1 and fits[("80GiB", "batch_fits_4")] == 0  # the planner's, per card
    assert fits[("141GiB", "batch_fits_4")] == 1 and fits[("141GiB", "batch_fits_8")] == 1
    assert {r.get("figure") for r in results} >= {"environment", "compile_smoke", "fleet", "fleet_at_pace"}
    text = section(tmp_path)
    assert "Incomplete" not in text and "### Against the references" in text and "1095 ms/chunk" in text


def test_the_old_rows_default_fails_the_tier_before_its_serve_run(tmp_path):
    """The tier builds the served config first (as `serve run` does, with this card's memory plan): the defect fails
    it there, in seconds, with the field named, where a serve run would fail the same way a minute later."""
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["applications"][0]["args"]["batching"]["max_batch_rows"] = None  # defect 1 put back
    defective = tmp_path / "serve_config.yaml"
    defective.write_text(yaml.safe_dump(config))
    code, last, out = rehearse(tmp_path, "--only", "tier", "--cards", "141GiB", "--tier-select", "served_config",
                               "--serve-config", str(defective))  # fmt: skip
    assert code == 1 and last.startswith("gpu-check rehearsal: FAIL tier:"), out[-6000:]
    log = (tmp_path / "logs" / "tier.txt").read_text()
    assert "batching.max_batch_rows=null (sessions.max_sessions=128)" in log, log[-6000:]
