"""scripts/gpu_check.py keeps what it gets (issue 44): each stage in its own process with its own timeout, every
figure in the results file as soon as the stage writes it, the GPU section written after every stage and marked
incomplete where a stage did not finish, all of it in `--out`.

The latency stages run a stand-in for benchmarks/model_latency.py (`--bench-script`): it appends a row as the real one
does, and with `--compile dit` it then hangs, as a compile that overruns does. The real benchmark's rows go through the
same path in the rehearsal (tests/e2e/test_gpu_rehearsal.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402
import gpu_docs  # noqa: E402

ROW = {"compiled": "none", "batch": 1, "dit_steps": 8.0, "chunk_ms": 1200.0, "chunk_ms_min": 1100.0,
       "chunk_ms_max": 1300.0, "chunks": 5, "positions": [2, 4, 6, 2, 4], "denoise_ms": 900.0, "restart_ms": 1500.0,
       "restarts": 2, "first_restart_ms": 1600.0, "first_chunks_ms": [1250.0], "compile_ms": 150.0, "graphs": 0,
       "recompiles_steady": 0, "graph_breaks": 0, "peak_mb": 1.0, "preset": "tiny"}  # fmt: skip
STAND_IN = textwrap.dedent(
    """
    import json, os, sys, time
    args = sys.argv[1:]
    results, compile_ = args[args.index("--results") + 1], args[args.index("--compile") + 1]
    mode = "8-step mask (upstream)" + ("" if compile_ == "none" else ", compile dit")
    row = {**json.loads(os.environ["STAND_IN_ROW"]), "mode": mode, "row": mode, "compile": compile_}
    if compile_ == "dit":
        row["compiled"] = os.environ.get("STAND_IN_COMPILED", "dit.blocks")
    with open(results, "a") as f:
        f.write(json.dumps({"stage": os.environ["GPU_CHECK_STAGE"], **row}) + "\\n")
    if compile_ == "dit" and os.environ.get("STAND_IN_HANG"):
        time.sleep(600)  # an overrunning compile: the stage's timeout must end it
    """
)


def run(tmp_path, monkeypatch, *argv, **env) -> tuple[int, str, list[dict], str]:
    script = tmp_path / "bench.py"
    script.write_text(STAND_IN)
    monkeypatch.setenv("STAND_IN_ROW", json.dumps(ROW))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "out"
    code = gpu_check.main(["--rehearse", "--out", str(out), "--bench-script", str(script), *argv])
    section = (out / "benchmarks.md").read_text().split("## GPU\n", 1)[1].split("\n## ", 1)[0]
    return code, str(out), gpu_docs.read_results(out / "results.jsonl"), section


def test_a_compiled_stage_that_times_out_keeps_the_eager_figures_in_results_and_docs(tmp_path, monkeypatch, capsys):
    code, out, results, section = run(tmp_path, monkeypatch, "--only", "eager,compiled", "--timeout", "compiled=3",
                                      STAND_IN_HANG="1")  # fmt: skip
    assert code == 1 and "gpu-check rehearsal: FAIL compiled: timeout" in capsys.readouterr().out
    ends = {r["stage"]: r["status"] for r in results if r.get("event") == "end"}
    assert ends == {"eager": "ok", "compiled": "timeout"}
    rows = [r["row"] for r in results if "row" in r]
    assert rows == ["8-step mask (upstream)", "8-step mask (upstream), compile dit"]  # written before the hang
    assert "**Incomplete**: compiled (timeout: did not finish within 3 s" in section
    assert "| eager | tiny | 8-step mask (upstream) | none | 1 |" in section
    assert "| `tiny` (standing in for DROID 14B) chunk, 8-step mask, eager, one GPU | 1200 ms |" in section
    assert (Path(out) / "logs" / "eager.txt").exists() and (Path(out) / "logs" / "compiled.txt").exists()


def test_the_section_is_written_after_each_stage_not_at_the_end(tmp_path, monkeypatch):
    """A check stopped between stages (here: the second stage's process is told to fail) still leaves the first
    stage's section in --out, complete for that stage and naming the one that failed."""
    code, _, results, section = run(tmp_path, monkeypatch, "--only", "eager,compiled",
                                    STAND_IN_COMPILED="none")  # fmt: skip
    assert code == 1  # a compiled row that ran eager code is a wrong row: the stage fails, the eager rows stay
    assert "compiled (failed: row '8-step mask (upstream), compile dit' ran compiled='none'" in section
    assert "| eager | ok |" in section


def test_every_stage_passing_gives_a_complete_section(tmp_path, monkeypatch, capsys):
    code, _, results, section = run(tmp_path, monkeypatch, "--only", "eager,compiled")
    assert code == 0 and "gpu-check rehearsal: PASS" in capsys.readouterr().out
    assert "Incomplete" not in section and "| compiled | ok |" in section


def test_a_fall_back_to_eager_is_reported_not_hidden():
    row = {**ROW, "stage": "compiled", "row": "8-step mask (upstream), compile dit", "mode": "8-step mask (upstream), "
           "compile dit", "compile": "dit", "compiled": "dit.blocks", "fell_back_to_eager": True}  # fmt: skip
    body = gpu_docs.render_section([row], ["compiled"], rehearse=False, took_s=1.0)
    assert "dit.blocks (fell back to eager)" in body and "**fell back to eager**" in body


def test_bad_timeouts_are_refused_naming_the_option(tmp_path):
    run_ = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--timeout", "compiled=soon",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run_.returncode == 2 and "--timeout 'compiled=soon'" in run_.stderr
