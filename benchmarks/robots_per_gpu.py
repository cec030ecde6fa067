"""Robots per GPU, measured: N simulated robots stepping at DROID's pace against one in-process pipeline.

Each robot asks for its next action chunk once per period (DROID: 24 actions at 15 Hz, one chunk per 1.6 s), its
first call a session start (one frame) and every later one a continuing chunk (4 new frames); the robots' phases are
spread evenly over the period, as a fleet's are. The calls go through the Policy's own batching rules, reused, not
copied: `deployments.batcher.ContinuousBatcher` (a batch forms when the model is free, at most `--max-rows` rows,
waiting `--wait-s` for company) and `deployments.batch_merge` (merge, run once, split), with one model thread as a
replica has. No Ray, no HTTP: what is measured is the model and the batching, which is what bounds a GPU's fleet.

Per N: the chunk latency (request to reply) p50 / p99 over every robot's chunks after its first (the session start
is reported apart), and whether every robot got every chunk within the period (a late chunk means the robot ran out
of actions). N doubles until a fleet misses; the largest N that kept pace is the figure.

    python benchmarks/robots_per_gpu.py                                    # tiny preset on this CPU
    python benchmarks/robots_per_gpu.py --preset droid_14b --device cuda --dtype bfloat16   # sizes from the planner
    python benchmarks/robots_per_gpu.py --preset tiny --robots 1,2 --chunks 3 --json out.json

`scripts/gpu-check.sh` runs it for the 14B and the 5B (`--results FILE`: each N's line appended as soon as it is
measured); CI runs it on the tiny preset (tests/unit/benchmarks/test_robots_per_gpu.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: DROID's chunk period: 24 actions at 15 Hz
DROID_PERIOD_S = 1.6


@dataclass
class FleetRun:
    """What one fleet of `robots` got."""

    robots: int
    latencies_ms: list[float] = field(default_factory=list)  # continuing chunks
    start_ms: list[float] = field(default_factory=list)  # each robot's session start
    late: int = 0  # chunks (any) that came after their period ran out
    batches: list[int] = field(default_factory=list)  # rows per model call
    errors: list[str] = field(default_factory=list)

    def summary(self, period_s: float) -> dict:
        lat = np.asarray(self.latencies_ms or [float("nan")])
        return {
            "robots": self.robots,
            "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)),
            "start_p50_ms": float(np.percentile(self.start_ms or [float("nan")], 50)),
            "chunks": len(self.latencies_ms) + len(self.start_ms),
            "late": self.late,
            "in_time": self.late == 0 and not self.errors and bool(self.latencies_ms),
            "mean_rows_per_call": float(np.mean(self.batches)) if self.batches else 0.0,
            "period_ms": period_s * 1000.0,
            "errors": self.errors[:3],
        }


def observation(pipe, robot: int, chunk: int, hw: tuple[int, int]):
    """Robot `robot`'s observation for its `chunk`-th call: one frame to start its session, then 4 new frames."""
    from dreamzero.pipeline.budget import warmup_batch

    batch = warmup_batch(pipe, 1, hw, step=1000 * robot + chunk)
    batch.session_ids = [f"robot-{robot}"]
    batch.prompts = [f"robot {robot}: put the marker in the cup"]
    if chunk == 0:
        batch.images = batch.images[:, -1:]
    return batch


def generate_groups(pipe, batches: list, rows_per_call: list[int], on_call=None) -> list:
    """The Policy's model thread: merge the requests that stack, one model call per group, split the results back
    (each call's rows appended to `rows_per_call`; `on_call(rows, ms)` told of each). Shared with fleet.py."""
    from deployments.batch_merge import merge_batches, plan_groups, split_result

    results = [None] * len(batches)
    for part in plan_groups(batches):
        group = [batches[i] for i in part]
        merged = merge_batches(group, default_seed=0)
        rows_per_call.append(len(merged))
        t0 = time.perf_counter()
        result = pipe.generate(merged)
        if on_call is not None:
            on_call(len(merged), (time.perf_counter() - t0) * 1e3)
        for i, res in zip(part, split_result(result, [len(b) for b in group])):
            results[i] = res
    return results


async def run_fleet(pipe, robots: int, chunks: int, period_s: float, hw, max_rows: int, wait_s: float) -> FleetRun:
    """`robots` robots, `chunks` chunks each, through the Policy's batcher, one model thread."""
    from deployments.batcher import ContinuousBatcher

    out = FleetRun(robots)
    loop = asyncio.get_running_loop()
    model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="robots-model")

    async def run(batches):
        return await loop.run_in_executor(model_thread, generate_groups, pipe, batches, out.batches)

    def starts(batch) -> bool:
        return any(sid not in pipe.store for sid in batch.session_ids)

    batcher = ContinuousBatcher(run, max_batch_size=max_rows, wait_s=wait_s, wants_company=starts,
                                rows_of=len, max_batch_rows=max_rows)  # fmt: skip

    async def robot(i: int, t0: float) -> None:
        due = t0 + period_s * i / robots  # phases spread over one period
        for k in range(chunks):
            await asyncio.sleep(max(0.0, due - loop.time()))
            asked = loop.time()
            try:
                await asyncio.wait_for(batcher.submit(observation(pipe, i, k, hw)), timeout=max(60.0, 20 * period_s))
            except Exception as exc:  # noqa: BLE001 - recorded: a fleet with errors did not keep pace
                out.errors.append(f"robot {i} chunk {k}: {type(exc).__name__}: {exc}")
                return
            took = loop.time() - asked
            (out.start_ms if k == 0 else out.latencies_ms).append(took * 1000.0)
            if took > period_s:
                out.late += 1
            due = max(due + period_s, loop.time())  # a late robot asks again at once

    try:
        t0 = loop.time()
        await asyncio.gather(*(robot(i, t0) for i in range(robots)))
    finally:
        model_thread.shutdown(wait=True)
        pipe.drop_sessions([f"robot-{i}" for i in range(robots)])
    return out


def measure(pipe, sizes, chunks: int, period_s: float, hw, max_rows: int | None, wait_s: float, on_row=None):
    """Fleets of each size in turn, until one misses; (rows, the largest size that kept pace)."""
    rows, best = [], 0
    for n in sizes:
        fleet = asyncio.run(run_fleet(pipe, n, chunks, period_s, hw, max_rows or n, wait_s))
        row = fleet.summary(period_s)
        rows.append(row)
        if on_row is not None:
            on_row(row)
        print(
            f"{n} robot(s): p50 {row['p50_ms']:.0f} ms, p99 {row['p99_ms']:.0f} ms, late {row['late']} of "
            f"{row['chunks']}, {row['mean_rows_per_call']:.1f} rows per call",
            flush=True,
        )
        if not row["in_time"]:
            break
        best = n
    return rows, best


def main(argv=None) -> int:
    import torch

    from benchmarks.model_latency import CANVAS, build_model
    from dreamzero.pipeline import DreamZeroPipeline
    from dreamzero.pipeline.budget import warmup_canvas_hw
    from dreamzero.sessions import SessionStore

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted({*CANVAS, "small"}))
    ap.add_argument("--model-path", help="checkpoint directory (default: the preset with random weights)")
    ap.add_argument("--device")
    ap.add_argument("--dtype")
    ap.add_argument("--robots", default="auto", help="comma-separated fleet sizes; auto: doubling, from the planner")
    ap.add_argument("--chunks", type=int, default=6, help="chunks per robot (the first is its session start)")
    ap.add_argument("--period-s", type=float, default=DROID_PERIOD_S, help="seconds between a robot's chunks")
    ap.add_argument("--max-rows", type=int, help="rows per model call (default: the planner's, else the fleet size)")
    ap.add_argument("--wait-s", type=float, default=0.005, help="batching.batch_wait_timeout_s (shipped: 0.005)")
    ap.add_argument("--steps", type=int, help="pipeline.num_inference_steps (default: the preset's)")
    ap.add_argument("--json", help="write the rows to this JSON file")
    ap.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", help="write the table into this file")
    ap.add_argument("--results", help="append each fleet's line to this JSON-lines file as soon as it is measured")
    args = ap.parse_args(argv)
    if args.chunks < 2:
        ap.error("--chunks must be at least 2 (the first chunk starts the session)")
    args.batch = 1
    model = build_model(args)
    overrides = {"num_inference_steps": args.steps, "dit_step_mask": None} if args.steps else None
    pipe = DreamZeroPipeline(model, model.config.pipeline.with_overrides(overrides), SessionStore(4096))
    hw = warmup_canvas_hw(pipe)
    device = pipe.device
    name = args.model_path or args.preset
    sizes, max_rows, note = fleet_plan(args, model, device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"

    def on_row(row: dict) -> None:
        if args.results:
            line = {"stage": os.environ.get("GPU_CHECK_STAGE", "robots_per_gpu"), "figure": "robots_fleet",
                    "preset": name, "device": device_name, "max_rows": max_rows, **row}  # fmt: skip
            with open(args.results, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")

    pipe.generate(observation(pipe, 10_000, 0, hw))  # lazy initialisation, not any fleet's
    pipe.drop_sessions(["robot-10000"])
    t0 = time.perf_counter()
    rows, best = measure(pipe, sizes, args.chunks, args.period_s, hw, max_rows, args.wait_s, on_row)
    record = {"preset": name, "device": device_name, "period_s": args.period_s, "chunks": args.chunks,
              "max_rows": max_rows, "note": note, "rows": rows, "robots_in_time": best,
              "took_s": time.perf_counter() - t0}  # fmt: skip
    if args.results:
        with open(args.results, "a", encoding="utf-8") as f:
            f.write(json.dumps({"stage": os.environ.get("GPU_CHECK_STAGE", "robots_per_gpu"),
                                "figure": "robots_per_gpu", "value": best, "preset": name, "device": device_name,
                                "note": note}) + "\n")  # fmt: skip
    print(f"{name} on {device_name}: {best} robot(s) kept DROID's pace ({note})")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    if args.write_docs:
        write_table(Path(args.write_docs), record, args)
    return 0


def write_table(path: Path, record: dict, args) -> None:
    """This run's table into docs/benchmarks.md, one section per device kind (runs of several presets on CPU append
    their rows under the same heading)."""
    from benchmarks.model_latency import write_docs

    if not path.is_absolute():
        path = Path(__file__).resolve().parents[1] / path
    heading = "## Robots per GPU (" + ("CPU" if record["device"].startswith("cpu") else "GPU") + ")"
    steps = f"{args.steps} scheduler steps" if args.steps else "the preset's step plan"
    rows = [
        f"| {record['preset']} | {r['robots']} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['start_p50_ms']:.0f} | "
        f"{r['late']} of {r['chunks']} | {'yes' if r['in_time'] else 'no'} | {r['mean_rows_per_call']:.1f} |"
        for r in record["rows"]
    ]
    old = path.read_text() if path.exists() else ""
    kept = []
    if heading in old:  # the rows of the other presets already there
        body = old.split(heading + "\n", 1)[1].split("\n## ", 1)[0]
        kept = [line for line in body.splitlines() if line.startswith("| ") and not line.startswith("| preset")
                and not line.startswith(f"| {record['preset']} |")]  # fmt: skip
    best, missed = {}, set()  # per preset, the largest fleet before the first that missed
    for line in [*kept, *rows]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        preset, robots, in_time = cells[0], int(cells[1]), cells[6] == "yes"
        best.setdefault(preset, 0)
        if preset in missed:
            continue
        if in_time:
            best[preset] = max(best[preset], robots)
        else:
            missed.add(preset)
    largest = ", ".join(f"{name} {n}" for name, n in best.items())
    table = [
        f"{record['device']}, {record['chunks']} chunks per robot every {record['period_s']} s, {steps}, random "
        f"weights; run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} (load average "
        f"{os.getloadavg()[0]:.1f}). Largest fleet that kept pace: {largest}.",
        "",
        "| preset | robots | chunk p50 ms | chunk p99 ms | session start p50 ms | late chunks | every chunk in time | "
        "rows per call |",
        "|---|---|---|---|---|---|---|---|",
        *kept,
        *rows,
    ]
    intro = (
        "Written by `benchmarks/robots_per_gpu.py --write-docs`: N simulated robots at DROID's pace (a 24-action chunk "
        "per 1.6 s) through the Policy's batcher against one in-process pipeline; on CPU a check of the method, not a "
        "GPU figure (the GPU's are in the GPU section)."
    )
    write_docs(path, "\n".join(table) + "\n", heading, intro)


def fleet_plan(args, model, device) -> tuple[list[int], int | None, str]:
    """(fleet sizes, rows per call, a note saying where they came from)."""
    from benchmarks.gpu_sizing import device_memory_bytes, fleet_sizes, largest_rows

    capacity = device_memory_bytes(device)
    rows = args.max_rows
    note = "rows per call: the fleet size (no device memory to plan)" if capacity is None else ""
    if capacity is not None and rows is None:
        rows, why = largest_rows(model.config, capacity, model.dtype)
        note = f"rows per call from the planner: {why}"
        rows = rows or 1
    if args.robots != "auto":
        sizes = [int(w) for w in args.robots.split(",") if w.strip()]
        if not sizes or min(sizes) < 1:
            raise SystemExit(f"--robots {args.robots!r}: give positive fleet sizes or auto")
    else:
        sizes = fleet_sizes(model.config, capacity, model.dtype)
    return sizes, rows, note


if __name__ == "__main__":
    raise SystemExit(main())
