"""scripts/gpu_check.py's checks and plans, without running a stage: which command each stage runs on a GPU and in
the rehearsal (the 14B eager and compiled in separate processes; the tier once per simulated card, the second card
only its card-dependent tests), the latency rows' check (each row eager or compiled as its mode says), and a stopped
stage leaving nothing of its process group. The stages themselves run in tests/unit/scripts/test_gpu_check_stages.py
(with a stand-in benchmark) and tests/e2e/test_gpu_rehearsal.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))

import gpu_check

ARGS = SimpleNamespace(bench_script="benchmarks/model_latency.py", tier_select=None, cards=["80GiB", "141GiB"])


def commands(stage: str, rehearse: bool, card=None) -> list[list[str]]:
    return gpu_check.stage_commands(stage, rehearse, "python", Path("/r/results.jsonl"), card, ARGS)


def test_eager_and_compiled_are_separate_processes_of_the_14b_on_a_gpu():
    ((eager,), (compiled,)) = commands("eager", False), commands("compiled", False)
    for cmd, value in ((eager, "none"), (compiled, "dit")):
        assert cmd[cmd.index("--preset") + 1] == "droid_14b" and cmd[cmd.index("--compile") + 1] == value
        assert int(cmd[cmd.index("--repeats") + 1]) >= 5 and "--results" in cmd  # median of at least 5 chunks
    (five,) = commands("latency_5b", False)
    assert five[five.index("--preset") + 1] == "libero_5b" and five[five.index("--batch") + 1] == "1,auto"
    assert [c[c.index("--preset") + 1] for c in (*commands("robots", False), *commands("robots_5b", False))] == [
        "droid_14b", "libero_5b"]  # fmt: skip


def test_the_rehearsal_runs_the_tier_per_card_the_second_only_for_what_depends_on_it():
    ((first,), (second,)) = commands("tier", True, "80GiB"), commands("tier", True, "141GiB")
    assert "-k" not in first and second[second.index("-k") + 1] == gpu_check.CARD_TESTS
    assert "planner" in gpu_check.CARD_TESTS and "served_config" in gpu_check.CARD_TESTS  # the card's own


def test_latency_rows_must_run_as_their_mode_says():
    def row(mode, compile_, ran):
        return {
            "stage": "compiled" if compile_ == "dit" else "eager",
            "row": mode,
            "compile": compile_,
            "compiled": ran,
        }

    good = [row("16 steps", "none", "none"), row("16 steps, compile dit", "dit", "dit.blocks")]
    assert (
        gpu_check.check_latency_rows(good, "eager") is None and gpu_check.check_latency_rows(good, "compiled") is None
    )
    bad = [row("16 steps", "none", "dit.blocks")]  # one model compiled in place, run by an eager row
    assert "ran compiled='dit.blocks', its mode says 'none'" in gpu_check.check_latency_rows(bad, "eager")
    assert "wrote no rows" in gpu_check.check_latency_rows([], "compiled")


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
        # explicit either way: a child inherits an ignored SIGINT, and this test's process may have one (an earlier
        # test's library on the same xdist worker)
        + f"signal.signal(signal.SIGINT, signal.{'SIG_IGN' if ignores_sigint else 'default_int_handler'})\n"
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
    # a loaded machine may take seconds to run the SIGINT handler: the grace is only short where it is ignored
    gpu_check.stop_group(proc, grace_s=1.0 if ignores_sigint else 30.0)
    assert proc.returncode == (-signal.SIGKILL if ignores_sigint else -signal.SIGINT)
    assert time.monotonic() - t0 < 45

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
