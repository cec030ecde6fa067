"""scripts/gpu_check.py's checks of what a GPU check (or its rehearsal) produced, without running a stage: the GPU
section of docs/benchmarks.md is complete only with every figure issue 32 lists (the batched chunk p50 / p95 for
1, 2, 4 and 8 sessions and the robots one GPU serves among them), and the latency benchmark's rows cover both
compile modes, each eager or compiled as its mode says. The stages themselves run in tests/e2e/test_gpu_rehearsal.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import gpu_check

STEP_MODES = ("16 steps", "8-step mask (upstream)", "dynamic skipping")


def figures_for(names) -> list[dict]:
    return [{"figure": n, "value": 1.0, "unit": "ms", "preset": "droid_14b", "tier": "cuda"} for n in names]


def bench_rows(modes=STEP_MODES, compiled=("dit",), ran=None) -> dict:
    rows = {m: {"compiled": "none"} for m in modes}
    rows |= {f"{m}, compile {c}": {"compiled": "dit.blocks"} for m in modes for c in compiled}
    for name, value in (ran or {}).items():
        rows[name]["compiled"] = value
    return {"rows": rows, "table": "| mode | compiled |\n|---|---|\n"}


@pytest.mark.parametrize("rehearse, sizes", [(False, (1, 2, 4, 8)), (True, (1, 2))])
def test_the_section_needs_every_batch_size_and_the_robots_per_gpu(rehearse, sizes):
    wanted = gpu_check.required_figures(rehearse)
    batched = [f"chunk_ms_{q}_batch_{n}" for n in sizes for q in ("p50", "p95")]
    assert set(wanted) == {*gpu_check.REQUIRED_FIGURES, *batched, "robots_per_gpu"}
    assert {"bf16_drift_max_abs", "chunk_ms_8_steps", "chunk_ms_16_steps", "weights_gib", "session_peak_gib",
            "session_budget_gib", "rows_chosen", "sessions_admitted"} <= set(wanted)  # fmt: skip
    gpu_check.check_section(figures_for(wanted), rehearse)
    for left_out in (batched[-1], "robots_per_gpu", "bf16_drift_max_abs"):
        with pytest.raises(gpu_check.StageFailed, match=f"the tier wrote no {left_out}"):
            gpu_check.check_section(figures_for(n for n in wanted if n != left_out), rehearse)


def test_the_rendered_section_holds_every_figure_and_the_latency_table():
    figures = figures_for(gpu_check.required_figures(False))
    bench = bench_rows()
    section = gpu_check.render_section(figures, bench, rehearse=False, took_s=400)
    assert all(f"| {f['figure']} | 1 | ms | droid_14b | cuda |" in section for f in figures)
    assert bench["table"].rstrip() in section and section.startswith("Run on one GPU.")


def test_the_benchmark_needs_both_compile_modes_each_as_its_mode_says():
    gpu_check.check_bench(bench_rows())
    with pytest.raises(gpu_check.StageFailed, match="no row for '16 steps, compile dit'"):
        gpu_check.check_bench(bench_rows(compiled=()))  # a tree without the compile knob skips the dit rows
    with pytest.raises(gpu_check.StageFailed, match="no row for '8-step mask \\(upstream\\)'"):
        gpu_check.check_bench(bench_rows(modes=("16 steps",)))
    with pytest.raises(gpu_check.StageFailed, match="row '16 steps' ran compiled='dit.blocks', its mode says 'none'"):
        gpu_check.check_bench(bench_rows(ran={"16 steps": "dit.blocks"}))  # defect 2: one model compiled in place
    with pytest.raises(gpu_check.StageFailed, match="its mode says 'dit.blocks'"):
        gpu_check.check_bench(bench_rows(ran={"dynamic skipping, compile dit": "none"}))
    with pytest.raises(gpu_check.StageFailed, match="wrote no rows"):
        gpu_check.check_bench({"rows": {}})


@pytest.mark.parametrize("ignores_sigint", [False, True])
def test_a_stopped_stage_leaves_nothing_of_its_process_group(tmp_path, ignores_sigint):
    """A stage past its bound (or interrupted) is stopped with its whole process group: what it started (a server,
    Ray) does not outlive it; SIGINT first (pytest's teardown), SIGKILL after the grace period."""
    import signal
    import subprocess
    import time

    child_pid = tmp_path / "child.pid"
    script = (
        "import signal, subprocess, sys, time\n"
        + ("signal.signal(signal.SIGINT, signal.SIG_IGN)\n" if ignores_sigint else "")
        + "child = subprocess.Popen(['sleep', '120'])\n"
        + f"open({str(child_pid)!r}, 'w').write(str(child.pid))\n"
        + "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    deadline = time.monotonic() + 30
    while not child_pid.exists() or not child_pid.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, "the stage never started its child"
        time.sleep(0.05)
    child = int(child_pid.read_text())
    t0 = time.monotonic()
    gpu_check.stop_group(proc, grace_s=1.0)
    assert proc.returncode == (-signal.SIGKILL if ignores_sigint else -signal.SIGINT)
    assert time.monotonic() - t0 < 15

    def alive(pid: int) -> bool:  # a zombie waiting for init to reap it is gone
        try:
            return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
        except OSError:
            return False

    for _ in range(100):
        if not alive(child):
            break
        time.sleep(0.05)
    assert not alive(child), f"the stage's child {child} outlived it"
