"""The stages of `scripts/gpu-check.sh` after install: each in its own process with its own timeout, each stage's
figures appended to a results file as soon as they exist, the GPU section of the docs written after every stage.

Stages, the most valuable figures first (`STAGES`; `--only` picks some):
  env         GPU, driver, torch, CUDA, Triton, NCCL, free memory (scripts/gpu_stages.py env)
  smoke       a ~10 s torch.compile of an SDPA block checked against eager (scripts/gpu_stages.py smoke)
  eager       DROID 14B latency per chunk, eager (benchmarks/model_latency.py --compile none)
  compiled    the same with `pipeline.compile: dit`, in its own process: a compile failure or overrun loses no eager row
  tier        the GPU test tier (pytest -m gpu tests/gpu), batch sizes and admission chosen from the device's memory
  robots      robots at DROID's pace on one GPU, DROID 14B in-process, batched and one session per call
              (benchmarks/fleet.py)
  robots_5b   the same for the 5B LIBERO model
  latency_5b  5B LIBERO latency at batch 1 and at the largest batch the planner allows
  fp8         the 14B eager row with fp8 DiT weights (dreamzero.model.fp8; what the planner picks on a 32 GB card)
  cfg2        the two-GPU CFG-parallel row (benchmarks/cfg_parallel.py), where two GPUs are present
  offline     the rehearsal only: the air-gapped box's install (tests/e2e/test_gpu_offline_env.py)

`--out DIR` (default .cache/gpu-check) receives, after every stage: `results.jsonl` (every figure, and one
`{"stage", "event": "end", "status", "took_s", "why"}` line per stage), `logs/<stage>.txt` and `benchmarks.md` (the
docs with the GPU section as written so far). On a GPU the section is also written into docs/benchmarks.md (`--docs`).
A stage that fails or times out is recorded and the next one runs; the section then says "Incomplete" and names it.
Each stage's timeout (`STAGE_S`, `--timeout stage=seconds`) is also cut to what is left of `--budget-s`.

`--rehearse` runs the stages on this CPU, as CI does, on two simulated cards (`--cards`, default 80GiB and 141GiB,
`DREAMZERO_SIMULATED_GPU`): small presets, the tier on every card (the second card runs only its memory-dependent
test, the planner's batch sizes: the rest does not depend on the card), the other stages once. The last line is
`gpu-check[ rehearsal]: PASS ...` or `... FAIL <stage>: <why>`; the exit code is 0 or 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_docs import read_results, render_section  # noqa: E402

from benchmarks.model_latency import write_docs  # noqa: E402

STAGES = ("env", "smoke", "eager", "compiled", "tier", "robots", "robots_5b", "latency_5b", "fp8", "cfg2", "offline")
REHEARSAL_ONLY = ("offline",)
#: each stage's own bound, seconds: on a GPU (sized for a ~10-minute window) / rehearsing on a 2-core CPU
STAGE_S = {
    "env": (30, 60), "smoke": (90, 300), "eager": (180, 300), "compiled": (240, 600), "tier": (300, 1500),
    "robots": (180, 180), "robots_5b": (150, 180), "latency_5b": (120, 300), "fp8": (120, 300),
    "cfg2": (300, 60), "offline": (60, 600),
}  # fmt: skip
#: the simulated cards of the rehearsal: an 80 GB H100 and a 141 GB H200
REHEARSAL_CARDS = ("80GiB", "141GiB")
#: the tier tests whose outcome depends on the card's memory (the second card runs only these): the planner's batch
#: sizes and the served config's fit. A rehearsal's batched test times at most 2 rows on every card and its admission
#: test sizes a device of its own, so on a second card they would repeat the first card's run (a minute of a 2-core
#: CPU) and show nothing new
CARD_TESTS = "planner or served_config"
#: the smallest slot worth starting a stage in
MIN_STAGE_S = 10.0
LATENCY = "benchmarks/model_latency.py"


class Clock:
    def __init__(self, budget_s: float):
        self.budget_s, self.t0 = budget_s, time.monotonic()

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
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


def run_stage(cmd: list[str], timeout_s: float, env: dict, log: Path) -> tuple[str, str]:
    """(status, why) of `cmd` run in its own process group, output in `log`: ok, failed or timeout."""
    print(f"gpu-check: {log.stem}: {' '.join(cmd)} (at most {timeout_s:.0f} s)", flush=True)
    with open(log, "a") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            return "timeout", f"did not finish within {timeout_s:.0f} s; log: {log}"
        except BaseException:  # interrupted (Ctrl+C, or the caller's own bound): leave nothing running
            stop_group(proc)
            raise
    tail = log.read_text(errors="replace")[-2000:]
    print(tail, flush=True)
    if proc.returncode != 0:
        last = [line for line in tail.splitlines() if line.strip()][-1:] or ["(no output)"]
        return "failed", f"exit {proc.returncode}: {last[0][:300]}; log: {log}"
    return "ok", ""


def stage_commands(stage: str, rehearse: bool, py: str, results: Path, card: str | None, args) -> list[list[str]]:
    """The command(s) of one stage (two for the rehearsal's model stages: none on a GPU needs more than one)."""
    lat = [py, args.bench_script, "--device", "cuda", "--dtype", "bfloat16", "--results", str(results)]
    # the fleet against the reference way that fits one GPU: one session per model call, on the same model
    fleet = [py, "benchmarks/fleet.py", "--results", str(results), "--reference", "one-at-a-time"]
    if stage in ("env", "smoke"):
        return [[py, "scripts/gpu_stages.py", stage, "--results", str(results)]]
    if stage in ("eager", "compiled"):
        compile_ = ["--compile", "none" if stage == "eager" else "dit", "--warmup", "1" if stage == "eager" else "2"]
        if not rehearse:
            return [[*lat, "--preset", "droid_14b", "--repeats", "5", *compile_]]
        # this CPU's bf16 kernels are slow: the rehearsal's rows in fp32 (the tier shows bf16), the mask's modes only
        modes = "16 steps,8-step mask (upstream)" if stage == "eager" else "8-step mask (upstream)"
        return [[*lat[:5], "float32", *lat[6:], "--preset", "tiny", "--repeats", "5", "--modes", modes, *compile_]]
    if stage == "fp8":  # the 14B's eager row with fp8 DiT weights (what the planner picks on a 32 GB card)
        fp8 = ["--dit-weights", "fp8", "--compile", "none", "--modes", "8-step mask (upstream)"]
        if not rehearse:
            return [[*lat, "--preset", "droid_14b", "--repeats", "5", *fp8]]
        return [[*lat[:5], "float32", *lat[6:], "--preset", "tiny", "--repeats", "5", *fp8]]
    if stage == "latency_5b":  # the rehearsal's CPU affords the tiny model at most 2 rows (the planner allows more)
        if rehearse:
            lat, size = [*lat[:5], "float32", *lat[6:]], ["--preset", "tiny", "--batch-cap", "2"]
        else:
            size = ["--preset", "libero_5b"]
        return [[*lat, *size, "--batch", "1,auto", "--compile", "none", "--modes", "8-step mask (upstream)"]]
    if stage in ("robots", "robots_5b"):
        if rehearse:  # this CPU's bf16 kernels are slow (the tier shows bf16): fp32, two scheduler steps
            name = "small" if stage == "robots" else "tiny"
            cpu = ["--device", "cpu", "--dtype", "float32", "--steps", "2"]
            return [[*fleet, "--preset", name, *cpu, "--robots", "1,2", "--seconds", "3"]]
        name = "droid_14b" if stage == "robots" else "libero_5b"
        gpu = ["--device", "cuda", "--dtype", "bfloat16"]
        return [[*fleet, "--preset", name, *gpu, "--robots", "1,4,8,16,32", "--seconds", "6"]]
    if stage == "tier":  # the slowest tests named in the stage's log: where a window's minutes went
        pytest = [py, "-m", "pytest", "-q", "-rs", "-s", "--durations=15", "-p", "no:cacheprovider"]
        cmd = [*pytest, "-m", "gpu", "tests/gpu"]
        select = args.tier_select or (CARD_TESTS if card is not None and card != args.cards[0] else None)
        return [cmd + (["-k", select] if select else [])]
    if stage == "cfg2":
        return [[py, "benchmarks/cfg_parallel.py", "--device", "cuda", "--json", str(results.parent / "cfg2.json")]]
    if stage == "offline":
        return [[py, "-m", "pytest", "-q", "-rs", "tests/e2e/test_gpu_offline_env.py", "-p", "no:cacheprovider"]]
    raise ValueError(stage)


def skip_reason(stage: str, rehearse: bool) -> str | None:
    if stage == "cfg2":
        if rehearse:
            return "a rehearsal simulates one GPU"
        import torch

        if torch.cuda.device_count() < 2:
            return f"{torch.cuda.device_count()} GPU here; the row needs two"
    return None


def check_latency_rows(results: list[dict], stage: str) -> str | None:
    """Why the latency rows of `stage` are wrong, or None: an eager row that ran compiled code, a compiled one that
    ran none (a fall-back to eager is reported in the docs, not failed: it is a finding)."""
    rows = [r for r in results if r.get("stage") == stage and "row" in r]
    if stage in ("eager", "compiled") and not rows:
        return "the benchmark wrote no rows"
    for r in rows:
        want = "dit.blocks" if r["compile"] == "dit" else "none"
        if r["compiled"] != want:
            return f"row {r['row']!r} ran compiled={r['compiled']!r}, its mode says {want!r}"
    return None


def after_cfg2(results: Path) -> None:
    """The CFG-parallel benchmark's two-GPU row into the results file (it writes its own JSON)."""
    out = results.parent / "cfg2.json"
    if not out.exists():
        return
    record = json.loads(out.read_text())
    for row in record.get("rows", []):
        modes = row.get("median_ms") or {}
        pair = next((v for k, v in modes.items() if "cfg_parallel: 2" in k), None)
        line = {
            "stage": "cfg2",
            "figure": "cfg_parallel",
            "preset": row.get("preset"),
            "chunk_ms": pair,
            "modes": modes,
        }
        with open(results, "a") as f:
            f.write(json.dumps(line) + "\n")


def write_section(docs: list[Path], results: Path, planned: list[str], rehearse: bool, took_s: float) -> None:
    body = render_section(read_results(results), planned, rehearse, took_s)
    intro = (
        "Written by `scripts/gpu-check.sh` after every stage (`scripts/gpu_check.py`): what each stage measured, "
        "next to the published figures it compares with and what differs."
    )
    for path in docs:
        write_docs(path, body, "## GPU", intro)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rehearse", action="store_true", help="every stage on this CPU, GPUs simulated (CI)")
    ap.add_argument("--budget-s", type=float, help="seconds for all stages (default 600 on a GPU, 3000 rehearsing)")
    ap.add_argument("--only", help=f"comma-separated stages to run, of {','.join(STAGES)}")
    ap.add_argument("--timeout", action="append", default=[], help="stage=seconds: that stage's own bound")
    ap.add_argument("--cards", help=f"rehearsal: simulated GPU sizes (default {','.join(REHEARSAL_CARDS)})")
    ap.add_argument("--serve-config", help="the Serve config the tier's serve test starts (default serve_config.yaml)")
    ap.add_argument("--tier-select", help="pytest -k expression: run only these tier tests")
    ap.add_argument("--bench-script", default=LATENCY, help="the latency benchmark to run")
    ap.add_argument("--docs", help="file whose GPU section is written (default docs/benchmarks.md on a GPU; "
                    "rehearsing: only the copy in --out)")  # fmt: skip
    ap.add_argument("--out", "--logs", dest="out", default=str(ROOT / ".cache" / "gpu-check"),
                    help="folder for results.jsonl, logs/ and the written docs")  # fmt: skip
    args = ap.parse_args(argv)
    stages = STAGES if not args.only else tuple(s.strip() for s in args.only.split(",") if s.strip())
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        ap.error(f"--only: unknown stage(s) {unknown}; use {list(STAGES)}")
    if not args.rehearse:
        stages = tuple(s for s in stages if s not in REHEARSAL_ONLY)
    bounds = {}
    for item in args.timeout:
        name, _, value = item.partition("=")
        if name not in STAGES or not value.replace(".", "", 1).isdigit():
            ap.error(f"--timeout {item!r}: give stage=seconds with a stage of {list(STAGES)}")
        bounds[name] = float(value)
    args.cards = [c.strip() for c in (args.cards or ",".join(REHEARSAL_CARDS)).split(",")] if args.rehearse else [None]
    label = "gpu-check rehearsal" if args.rehearse else "gpu-check"
    clock = Clock(args.budget_s or (3000.0 if args.rehearse else 600.0))
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    results.unlink(missing_ok=True)
    docs_copy = out / "benchmarks.md"
    shutil.copy(ROOT / "docs" / "benchmarks.md", docs_copy)
    docs = [docs_copy]
    if args.docs or not args.rehearse:  # never commit CPU figures: a rehearsal writes only the copy, unless told
        docs.append(Path(args.docs) if args.docs else ROOT / "docs" / "benchmarks.md")
    env = {**os.environ, "GPU_CHECK_FIGURES": str(results), "GPU_CHECK_RESULTS": str(results), "PYTHONHASHSEED": "0"}
    env.setdefault("RAY_AUTH_MODE", "disabled")
    if args.serve_config:
        env["GPU_CHECK_SERVE_CONFIG"] = str(Path(args.serve_config).resolve())
    planned = [f"{s}@{c}" if s == "tier" and len(args.cards) > 1 else s for s in stages for c in
               (args.cards if s == "tier" else [None])]  # fmt: skip
    planned = list(dict.fromkeys(planned))
    failures, gone = [], None  # gone: why no later stage can run (the environment stage found no GPU)
    for name in planned:
        stage, _, card = name.partition("@")
        card = card or args.cards[0]
        t0 = time.monotonic()
        status, why = "skipped", skip_reason(stage, args.rehearse)
        if gone is not None:
            status, why = "not run", gone
        elif why is None:
            limit = min(bounds.get(stage, STAGE_S[stage][1 if args.rehearse else 0]), clock.left())
            if clock.left() < MIN_STAGE_S:  # not run for lack of time: the run is incomplete (a failure)
                status, why = "no time", f"{clock.left():.0f} s of the budget left"
            else:
                stage_env = {**env, "GPU_CHECK_STAGE": stage, "GPU_CHECK_CARD": card or ""}
                if args.rehearse:
                    stage_env["DREAMZERO_SIMULATED_GPU"] = card
                    stage_env["GPU_CHECK_REHEARSAL"] = "1"
                status, why = "ok", ""
                for cmd in stage_commands(stage, args.rehearse, sys.executable, results, card, args):
                    status, why = run_stage(
                        cmd, limit - (time.monotonic() - t0), stage_env, out / "logs" / f"{name}.txt"
                    )
                    if status != "ok":
                        break
                if stage == "cfg2" and status == "ok":
                    after_cfg2(results)
                bad = check_latency_rows(read_results(results), stage) if status == "ok" else None
                if bad:
                    status, why = "failed", bad
        line = {"stage": name, "event": "end", "status": status, "took_s": round(time.monotonic() - t0, 1), "why": why}
        with open(results, "a") as f:
            f.write(json.dumps(line) + "\n")
        if status not in ("ok", "skipped"):
            failures.append((name, f"{status}: {why}"))
        if stage == "env" and status != "ok":
            gone = "the environment stage failed (no GPU seen)"
        print(f"gpu-check: {name}: {status}{': ' + why if why else ''}", flush=True)
        write_section(docs, results, planned, args.rehearse, clock.elapsed())
    print(f"gpu-check: results {results}; the GPU section written to {', '.join(map(str, docs))}", flush=True)
    if failures:
        print(f"{label}: FAIL {failures[0][0]}: {failures[0][1]}", flush=True)
        return 1
    print(f"{label}: PASS in {clock.elapsed():.0f} s ({', '.join(planned)})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
