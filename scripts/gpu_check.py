"""The stages of `scripts/gpu-check.sh` after install, each bounded by the time left; the GPU section of the docs.

On a GPU (one H200, under 8 minutes): the GPU tier (`pytest -m gpu tests/gpu`: bf16 drift, 14B chunks at 8 and 16
steps, batched chunks, session memory against its accounting, admission until the budget is full, `serve run` of
the shipped config where Ray is installed) and the DROID 14B latency benchmark with `pipeline.compile` none and dit;
every figure goes into the "GPU" section of docs/benchmarks.md, so committing that file records the run.

`--rehearse` runs the same stages on this CPU, as CI does: a GPU of 141 GiB simulated (`DREAMZERO_SIMULATED_GPU`:
"cuda" is the CPU in bf16, device memory a declared capacity with the byte accounting), the 14B- and 5B-shaped slice
presets instead of the full models (inside the tier), the benchmark on the tiny preset in both compile modes, the
air-gapped box's install (a Python without Ray given only the wheel folder: tests/e2e/test_gpu_offline_env.py), and
the section written to a scratch copy of the docs and checked complete. What the rehearsal cannot show is kernel speed,
the real allocator and NCCL (docs/model.md). The last line is `gpu-check[ rehearsal]: PASS ...` or
`... FAIL <stage>: <why>`; the exit code is 0 or 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.model_latency import write_docs  # noqa: E402

#: the GPU's memory the rehearsal simulates (an H200)
REHEARSAL_GPU = "141GiB"
STAGES = ("tier", "bench", "offline", "docs")
#: stages a GPU run skips: the offline path is the GPU box's own install there (gpu-check.sh does it before the clock)
REHEARSAL_ONLY = ("offline",)
#: figures the tier writes (tests/gpu/figures.py); the GPU section is complete only with every one of them
REQUIRED_FIGURES = (
    "bf16_drift_max_abs",
    "chunk_ms_8_steps",
    "chunk_ms_16_steps",
    "weights_gib",
    "session_peak_gib",
    "session_budget_gib",
    "rows_chosen",
    "sessions_admitted",
)
#: sessions batched in one call whose chunk p50 / p95 the tier must have written: a GPU's batch sizes (how many
#: robots one GPU serves), and the rehearsal's (tests/gpu/test_gpu_tier.py: BATCH_SIZES)
BATCH_SIZES = {"gpu": (1, 2, 4, 8), "rehearsal": (1, 2)}
#: seconds kept back for the stages after the tier (the benchmark needs at least this much)
BENCH_MIN_S = 90


class StageFailed(Exception):
    def __init__(self, stage: str, why: str):
        super().__init__(f"{stage}: {why}")
        self.stage, self.why = stage, why


class Clock:
    """The budget, counted from the start of the stages (after install)."""

    def __init__(self, budget_s: float):
        self.budget_s, self.t0 = budget_s, time.monotonic()

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def run(stage: str, cmd: list[str], timeout_s: float, env: dict, log: Path) -> None:
    """`cmd` with its output in `log` (and on stdout); StageFailed on a non-zero exit or past `timeout_s`."""
    if timeout_s < 10:
        raise StageFailed(stage, f"no time left ({timeout_s:.0f} s of the budget)")
    print(f"gpu-check: {stage}: {' '.join(cmd)} (at most {timeout_s:.0f} s)", flush=True)
    with open(log, "w") as out:
        # its own process group: a stage stopped early takes what it started with it (a `serve run`, Ray)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            raise StageFailed(stage, f"did not finish within {timeout_s:.0f} s; log: {log}") from None
        except BaseException:  # interrupted (Ctrl+C, or the caller's own bound): leave nothing running
            stop_group(proc)
            raise
    tail = log.read_text()[-3000:]
    print(tail, flush=True)
    if proc.returncode != 0:
        last = [line for line in tail.splitlines() if line.strip()][-1:] or ["(no output)"]
        raise StageFailed(stage, f"exit {proc.returncode}: {last[0][:300]}; log: {log}")


def stop_group(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGINT to the stage's process group (pytest then runs its teardown: servers stop), SIGKILL after `grace_s`."""
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGINT:  # the leader is gone; its group may still hold children
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return


def read_figures(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def required_figures(rehearse: bool) -> tuple[str, ...]:
    """Every figure the GPU section must hold: the fixed ones, then chunk p50 / p95 per batch size and the robots
    one GPU serves."""
    sizes = BATCH_SIZES["rehearsal" if rehearse else "gpu"]
    batched = tuple(f"chunk_ms_{q}_batch_{n}" for n in sizes for q in ("p50", "p95"))
    return (*REQUIRED_FIGURES, *batched, "robots_per_gpu")


def check_bench(record: dict) -> None:
    """Both compile modes ran for every step mode (at least 16 steps and the 8-step mask), every compile-none row
    eager and every compiled row compiled (the benchmark's own observation)."""
    rows = record.get("rows") or {}
    if not rows:
        raise StageFailed("bench", "the benchmark wrote no rows")
    eager = {name for name in rows if "compile" not in name}
    compiled = {name.removesuffix(", compile dit") for name in rows if name.endswith(", compile dit")}
    missing = sorted({"16 steps", "8-step mask (upstream)"} - eager) + sorted(
        f"{name}, compile dit" if name in eager else name for name in eager ^ compiled
    )
    if missing:
        raise StageFailed("bench", f"no row for {', '.join(repr(m) for m in missing)}: run --compile none,dit")
    for name, row in rows.items():
        want = "dit.blocks" if "compile dit" in name else "none"
        if row.get("compiled") != want:
            raise StageFailed("bench", f"row {name!r} ran compiled={row.get('compiled')!r}, its mode says {want!r}")


def render_section(figures: list[dict], bench: dict | None, rehearse: bool, took_s: float) -> str:
    """The GPU section's body: the tier's figures, then the benchmark's table."""
    what = "Rehearsal on CPU (a simulated GPU, slice presets): the path works; no speed figure counts."
    lines = [
        f"{what if rehearse else 'Run on one GPU.'} Stages took {took_s:.0f} s; run "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        "| figure | value | unit | preset | tier | note |",
        "|---|---|---|---|---|---|",
    ]
    for f in figures:
        value = f["value"]
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        lines.append(
            f"| {f['figure']} | {shown} | {f.get('unit', '')} | {f.get('preset', '')} | {f.get('tier', '')} | "
            f"{f.get('note', '')} |"
        )
    if bench is not None:
        lines += ["", "Latency (`benchmarks/model_latency.py`):", "", bench["table"].rstrip()]
    return "\n".join(lines) + "\n"


def check_section(figures: list[dict], rehearse: bool) -> None:
    missing = [name for name in required_figures(rehearse) if not any(f["figure"] == name for f in figures)]
    if missing:
        raise StageFailed("docs", f"the tier wrote no {', '.join(missing)} (GPU_CHECK_FIGURES)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rehearse", action="store_true", help="every stage on this CPU, a GPU simulated (CI)")
    ap.add_argument("--budget-s", type=float, help="seconds for all stages (default 470 on a GPU, 1500 rehearsing)")
    ap.add_argument("--only", help=f"comma-separated stages to run, of {','.join(STAGES)}")
    ap.add_argument("--serve-config", help="the Serve config the tier's serve test starts (default serve_config.yaml)")
    ap.add_argument("--tier-select", help="pytest -k expression: run only these tier tests (the docs stage then "
                    "checks what they wrote)")  # fmt: skip
    ap.add_argument("--bench-script", default="benchmarks/model_latency.py", help="the latency benchmark to run")
    ap.add_argument("--docs", help="file whose GPU section is written (default docs/benchmarks.md; a scratch copy "
                    "when rehearsing)")  # fmt: skip
    ap.add_argument("--logs", default=str(ROOT / ".cache" / "gpu-check"), help="folder for the stages' logs")
    args = ap.parse_args(argv)
    stages = STAGES if not args.only else tuple(s.strip() for s in args.only.split(","))
    if not args.rehearse:
        stages = tuple(s for s in stages if s not in REHEARSAL_ONLY)
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        ap.error(f"--only: unknown stage(s) {unknown}; use {list(STAGES)}")
    label = "gpu-check rehearsal" if args.rehearse else "gpu-check"
    clock = Clock(args.budget_s or (1500.0 if args.rehearse else 470.0))
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    figures_path = logs / "figures.jsonl"
    figures_path.unlink(missing_ok=True)
    env = {**os.environ, "GPU_CHECK_FIGURES": str(figures_path), "PYTHONHASHSEED": "0"}
    env.setdefault("RAY_AUTH_MODE", "disabled")
    if args.rehearse:
        env["DREAMZERO_SIMULATED_GPU"] = env.get("DREAMZERO_SIMULATED_GPU") or REHEARSAL_GPU
    if args.serve_config:
        env["GPU_CHECK_SERVE_CONFIG"] = str(Path(args.serve_config).resolve())
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    bench: dict | None = None
    try:
        preflight(args.rehearse)
        if "tier" in stages:
            timeout = clock.left() - (BENCH_MIN_S if "bench" in stages else 0)
            pytest = [sys.executable, "-m", "pytest", "-q", "-rs", "-s", "-p", "no:cacheprovider"]
            cmd = [*pytest, "-m", "gpu", "tests/gpu"]
            cmd += ["-k", args.tier_select] if args.tier_select else []
            run("tier", cmd, timeout, env, logs / "gpu-tier.txt")
        if "bench" in stages:
            out = scratch / "bench.json"
            preset = ["--preset", "tiny", "--repeats", "1", "--warmup", "0"] if args.rehearse else [
                "--preset", "droid_14b", "--repeats", "2", "--warmup", "1"]  # fmt: skip
            cmd = [sys.executable, args.bench_script, *preset, "--device", "cuda", "--dtype", "bfloat16",
                   "--compile", "none,dit", "--json", str(out)]  # fmt: skip
            run("bench", cmd, clock.left() - 5, env, logs / "bench.txt")
            bench = json.loads(out.read_text())
            check_bench(bench)
        if "offline" in stages:  # the air-gapped box's path: a Python without Ray, installed from the wheel folder
            cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "tests/e2e/test_gpu_offline_env.py", "-p",
                   "no:cacheprovider"]  # fmt: skip
            run("offline", cmd, clock.left() - 5, {**env, "GPU_CHECK_REHEARSAL": "1"}, logs / "offline.txt")
        if "docs" in stages:
            figures = read_figures(figures_path)
            check_section(figures, args.rehearse)
            docs = Path(args.docs) if args.docs else ROOT / "docs" / "benchmarks.md"
            if args.rehearse and not args.docs:  # never commit CPU figures: write a scratch copy, check it
                docs = scratch / "benchmarks.md"
                shutil.copy(ROOT / "docs" / "benchmarks.md", docs)
            intro = "Written by `scripts/gpu-check.sh` (every figure of the GPU tier and the 14B latency benchmark)."
            write_docs(docs, render_section(figures, bench, args.rehearse, clock.elapsed()), "## GPU", intro)
            section = docs.read_text().split("## GPU", 1)[1]
            table = bench["table"].rstrip() if bench is not None else ""
            if any(f"| {name} |" not in section for name in required_figures(args.rehearse)) or table not in section:
                raise StageFailed("docs", f"the GPU section of {docs} is incomplete")
            print(f"gpu-check: wrote the GPU section of {docs}", flush=True)
    except StageFailed as exc:
        print(f"{label}: FAIL {exc.stage}: {exc.why}", flush=True)
        return 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{label}: PASS in {clock.elapsed():.0f} s ({', '.join(stages)})", flush=True)
    return 0


def preflight(rehearse: bool) -> None:
    """torch sees the GPU (or, rehearsing, a simulated one stands in for it)."""
    import torch

    if rehearse:
        if torch.cuda.is_available():
            print("gpu-check: a real GPU is present; the rehearsal still simulates one on the CPU", flush=True)
        return
    if not torch.cuda.is_available():
        raise StageFailed("preflight", f"torch {torch.__version__} (CUDA build {torch.version.cuda}) sees no GPU")
    p = torch.cuda.get_device_properties(0)
    print(f"gpu-check: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
