"""`benchmarks/model_latency.py` (the GPU check's model figures, scripts/gpu-check.sh) runs on this tree: its modes
follow PipelineConfig's knobs, and a CPU run of the tiny preset prints its table."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the script's sibling modules

import model_latency


def test_compile_modes_come_from_the_pipeline_config():
    modes, notes = model_latency.build_modes(["none", "dit"])
    assert not notes  # this tree has the `compile` knob
    assert set(modes) == set(model_latency.MODES) | {f"{m}, compile dit" for m in model_latency.MODES}
    assert all(m["compile"] == "none" for name, m in modes.items() if "compile dit" not in name)


def test_a_tiny_cpu_run_prints_its_table(capsys):
    assert model_latency.main(["--preset", "tiny", "--device", "cpu", "--warmup", "0", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "|" in out and "tiny" in out
