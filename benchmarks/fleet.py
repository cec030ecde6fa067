"""A fleet at the control pace: how many robots one replica keeps at pace, measured as the robots feel it.

N simulated robots, each a `DroidPolicy` ticking at its control rate the way the Franka loop does (benchmarks/
fleet_sim.py: DROID's 15 Hz, the evaluation's open-loop horizon of 8, real-time chunking by default; `--schedule
prefetch` or `sync` for the loop's other ways). Per robot: stalls (control ticks with no action to execute), hold
time, chunk latency, and the age of the observation behind each executed action. A robot keeps pace with 0 stalls and
its p99 chunk latency within the time its executing chunk had left when the query left (RTC: H - s actions).

The sweep doubles N and reports the largest N at which every robot keeps pace, side by side in one run with the way
the reference servers work: one session per server process, no cross-session batching (N worker processes, each with
its own pipeline and one torch thread, on the same cores). In-process (the default: no Ray, so it runs on
a GPU box too) the batched way is one embedded pipeline behind the Policy's own batcher and merge
(`deployments.batcher`, `deployments.batch_merge`: a model call takes realtime rows first, by deadline, where the
batcher orders by class); `--url` points the robots at a running server's door instead (http://, ws:// for OpenPI,
tcp://host:port for ZeroMQ; the reference way is then not run).

`--farm` runs the other scenario: one live robot beside an evaluation farm posting 16-environment requests (traffic
class `batch`) as fast as they are answered, through the same batcher with the traffic classes on and with first come,
first served; it reports the robot's stalls and the farm's throughput beside the farm's throughput alone.

    python benchmarks/fleet.py                                   # tiny preset, robots 1,2,4,8,16, both ways
    python benchmarks/fleet.py --model embedded:small-scene1     # the shipped small default
    python benchmarks/fleet.py --farm                            # a live robot beside a 16-environment farm
    python benchmarks/fleet.py --url ws://127.0.0.1:8000 --robots 1,2,4   # a running server's OpenPI door
    python benchmarks/fleet.py --write-docs                      # also write the tables into docs/benchmarks.md

CI runs a small fleet of it (tests/unit/benchmarks/test_fleet.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the sibling modules
from fleet_sim import (
    PROMPT,
    BatchedServer,
    ModelSpec,
    Pace,
    RobotStats,
    ServerLink,
    ZmqLink,
    load_policy,
    run_fleet,
    start_reference,
    torch_threads,
    warm_up,
)

from dreamzero_droid import droid
from dreamzero_droid.policy import DroidPolicy

WAYS = ("batched", "reference")


def summarize(way: str, robots: int, stats: list[RobotStats], pace: Pace, rows_per_call=()) -> dict:
    """One fleet's row of the table."""
    lat = [x for s in stats for x in s.latencies_ms]
    ages = [x for s in stats for x in s.ages_ms]
    budgets = [x for s in stats for x in s.budgets_ms]

    def pct(values, q):
        return float(np.percentile(values, q)) if values else float("nan")

    stalls = sum(s.stalls for s in stats)
    return {
        "way": way,
        "robots": robots,
        "at_pace": all(s.at_pace() for s in stats),
        "robots_at_pace": sum(s.at_pace() for s in stats),
        "stalls": stalls,
        "ticks": sum(s.ticks for s in stats),
        "hold_s": stalls * pace.period_s,
        "chunks": sum(s.chunks for s in stats),
        "p50_ms": pct(lat, 50),
        "p99_ms": pct(lat, 99),
        "budget_ms": min(budgets, default=0.0),
        "start_p50_ms": pct([s.start_ms for s in stats if s.start_ms is not None], 50),
        "age_p50_ms": pct(ages, 50),
        "age_p99_ms": pct(ages, 99),
        "dropped": sum(s.dropped for s in stats),
        "skipped": sum(s.skipped for s in stats),
        "late_ticks": sum(s.late_ticks for s in stats),
        "rows_per_call": float(np.mean(rows_per_call)) if len(rows_per_call) else None,
        "errors": [e for s in stats for e in s.errors][:3],
    }


def line(row: dict) -> str:
    rows = "" if row["rows_per_call"] is None else f", {row['rows_per_call']:.1f} rows per call"
    return (
        f"{row['way']:>9} {row['robots']:>3} robot(s): {'at pace' if row['at_pace'] else 'MISSED '} "
        f"({row['robots_at_pace']} at pace), stalls {row['stalls']} of {row['ticks']} ticks, chunk p50 "
        f"{row['p50_ms']:.0f} / p99 {row['p99_ms']:.0f} ms (budget {row['budget_ms']:.0f} ms), observation age p99 "
        f"{row['age_p99_ms']:.0f} ms, dropped {row['dropped']}, late ticks {row['late_ticks']}{rows}"
        + (f"; {row['errors'][0]}" if row["errors"] else "")
    )


def fleet_of(way: str, n: int, args, pace: Pace, shared) -> dict:
    """One fleet of `n` robots the `way` way; `shared`: the batched server, or the door's URL."""
    links, servers, rows_per_call = [], [], []
    if way == "reference" and args.reference == "processes":
        servers = start_reference(n, model_spec(args), args.reference_threads, args.cores)
        links = [ServerLink(s) for s in servers]
    elif isinstance(shared, dict):  # in-process: the batched server, and the one-at-a-time reference
        server = shared[way]
        links = [ServerLink(server) for _ in range(n)]
        server.rows_per_call.clear()
        rows_per_call = server.rows_per_call
    else:
        links = [door_link(shared) for _ in range(n)]
    policies = [DroidPolicy(link, prompt=PROMPT, session_prefix=f"fleet-{way}-{n}-{i}") for i, link in enumerate(links)]
    try:
        stats = run_fleet(policies, pace, args.seconds)
        return summarize(way, n, stats, pace, list(rows_per_call))
    finally:
        for p in policies:
            try:
                p.reset()  # the fleet's sessions go, so the next fleet starts on an empty store
            except Exception:  # noqa: BLE001 - a reference server already gone
                pass
            if not isinstance(p.link, ServerLink):
                p.close()
        for s in servers:
            s.close()


def batched_server(policy, args, classes: bool, max_rows: int | None = None) -> BatchedServer:
    return BatchedServer(policy, max_rows or args.max_rows, args.max_requests, args.wait_s, classes=classes,
                         rows_per_thread=args.rows_per_thread)  # fmt: skip


def model_spec(args) -> ModelSpec:
    return ModelSpec(model=args.model, preset=args.preset, device=args.device, dtype=args.dtype, steps=args.steps)


def model_name(args) -> str:
    return args.model or (f"{args.preset} (random weights)" if args.preset else "tiny (random weights)")


def door_link(url: str):
    if url.startswith("tcp://"):
        return ZmqLink(url)
    from dreamzero_droid.links import connect

    return connect(url, timeout_s=120.0)


def sweep(sizes: list[int], ways: tuple[str, ...], args, pace: Pace, shared, on_row=print) -> tuple[list, dict]:
    """Fleets of each size both ways, alternately, each way until it misses; (rows, the largest N at pace per way)."""
    rows, best, missed = [], dict.fromkeys(ways, 0), set()
    for n in sizes:
        for way in ways:
            if way in missed:
                continue
            row = fleet_of(way, n, args, pace, shared)
            rows.append(row)
            on_row(row)
            if row["at_pace"]:
                best[way] = max(best[way], n)
            else:
                missed.add(way)
        if missed >= set(ways):
            break
    return rows, best


# ---------------------------------------------------------------------------------------------------------------------
# The farm scenario
# ---------------------------------------------------------------------------------------------------------------------


def farm_observation(rows: int, frames: int, rng: np.random.Generator) -> dict:
    """`rows` environments' raw DROID observation of `frames` frames each."""
    from fleet_sim import observation

    frame = droid.make_frame(observation(0, rng))
    one = droid.raw_observation([frame] * frames)
    return {k: np.repeat(v, rows, axis=0) for k, v in one.items()}


def run_farm(server: BatchedServer, rows: int, stop: threading.Event, seconds: float, tag: str) -> float:
    """A farm posting `rows`-environment requests back to back until `stop` or `seconds`; rows answered per second."""
    rng = np.random.default_rng(7)
    ids = [f"farm-{tag}-{j}" for j in range(rows)]
    first, later = farm_observation(rows, 1, rng), farm_observation(rows, 4, rng)
    steps, done = None, 0
    t0 = time.monotonic()
    while not stop.is_set() and time.monotonic() - t0 < seconds:
        obs = first if steps is None else later
        _, sessions = server.infer(obs, ids, [PROMPT] * rows, expected_steps=steps, traffic_class="batch")
        steps = [getattr(s, "step", None) for s in sessions]
        done += rows
    took = time.monotonic() - t0
    server.reset(ids)
    return done / took if took > 0 else 0.0


def farm_scenario(policy, args, pace: Pace) -> list[dict]:
    """One live robot beside a farm, traffic classes on, then first come, first served."""
    return [farm_run(policy, args, pace, classes) for classes in (True, False)]


def farm_run(policy, args, pace: Pace, classes: bool) -> dict:
    """The farm alone, then the farm and one live robot, through one batcher."""
    server = batched_server(policy, args, classes)
    rates: list[float] = []
    stop = threading.Event()

    def farm() -> None:
        rates.append(run_farm(server, args.farm_rows, stop, args.seconds * 4, f"with-{classes}"))

    try:
        alone = run_farm(server, args.farm_rows, threading.Event(), args.seconds / 2, f"alone-{classes}")
        thread = threading.Thread(target=farm, daemon=True)
        thread.start()
        time.sleep(1.0)  # the farm is going before the robot starts
        link = ServerLink(server)
        robot = DroidPolicy(link, prompt=PROMPT, session_prefix=f"fleet-farm-{classes}")
        (stats,) = run_fleet([robot], pace, args.seconds)
        stop.set()
        thread.join(timeout=args.seconds * 4 + 120)
        robot.reset()
    finally:
        stop.set()
        server.close()
    row = summarize("classes on" if classes else "first come", 1, [stats], pace, list(server.rows_per_call))
    rate = rates[0] if rates else 0.0
    row.update(farm_rows_per_s=rate, farm_alone_rows_per_s=alone, farm_share=rate / alone if alone else 0.0)
    print(f"{line(row)}; farm {rate:.1f} rows/s with the robot, {alone:.1f} alone ({row['farm_share']:.0%})")
    return row


# ---------------------------------------------------------------------------------------------------------------------
# The tables
# ---------------------------------------------------------------------------------------------------------------------

FLEET_HEAD = (
    "| way | robots | every robot at pace | stalls (of ticks) | chunk p50 ms | chunk p99 ms | budget ms | "
    "observation age p99 ms | dropped chunks | rows per call |\n|---|---|---|---|---|---|---|---|---|---|"
)


def fleet_table(rows: list[dict]) -> str:
    def cells(r):
        per_call = "" if r["rows_per_call"] is None else f"{r['rows_per_call']:.1f}"
        return (
            f"| {r['way']} | {r['robots']} | {'yes' if r['at_pace'] else 'no'} | {r['stalls']} ({r['ticks']}) | "
            f"{r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['budget_ms']:.0f} | {r['age_p99_ms']:.0f} | {r['dropped']} | "
            f"{per_call} |"
        )

    return FLEET_HEAD + "\n" + "\n".join(cells(r) for r in rows)


def farm_table(rows: list[dict]) -> str:
    head = (
        "| batcher | robot stalls (of ticks) | robot chunk p99 ms | budget ms | farm rows/s with the robot | "
        "farm rows/s alone | farm's share |\n|---|---|---|---|---|---|---|"
    )
    body = [
        f"| {r['way']} | {r['stalls']} ({r['ticks']}) | {r['p99_ms']:.0f} | {r['budget_ms']:.0f} | "
        f"{r['farm_rows_per_s']:.1f} | {r['farm_alone_rows_per_s']:.1f} | {r['farm_share']:.0%} |"
        for r in rows
    ]
    return head + "\n" + "\n".join(body)


def setting_line(args, pace: Pace, device: str) -> str:
    where = f"a running server at {args.url}" if args.url else "in-process"
    return (
        f"{model_name(args)} on {device}, {where}; robots at {pace.control_hz:g} Hz, open-loop "
        f"horizon {pace.open_loop_horizon}, schedule `{pace.schedule}`, {args.seconds:g} s per fleet; batcher "
        f"{args.max_rows} rows per call, {args.max_requests} requests, wait {args.wait_s} s, "
        f"torch threads: one per {args.rows_per_thread} rows of a call, at most {torch_threads()}; "
        f"{reference_words(args)}; run "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} (load average {os.getloadavg()[0]:.1f})."
    )


def reference_words(args) -> str:
    if getattr(args, "reference", None) == "one-at-a-time":
        return "reference: one session per model call, first come first served, on the same model"
    return f"reference servers: {args.reference_threads or 'cores // N'} torch thread(s) each"


def device_name(dev) -> str:
    import torch

    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)


def append_result(args, line: dict) -> None:
    """One JSON line into `--results` (the GPU check's file: each fleet is kept as soon as it is measured)."""
    if args.results:
        line = {"stage": os.environ.get("GPU_CHECK_STAGE", "fleet"), **line}
        with open(args.results, "a", encoding="utf-8") as f:
            f.write(json.dumps(line, default=str) + "\n")


def write_docs(path: Path, title: str, body: str) -> None:
    from serving_common import write_section

    if not path.is_absolute():
        path = Path(__file__).resolve().parents[1] / path
    write_section(path, title, body)


def reproduce(argv) -> list[str]:
    """This run's arguments without the ones naming this machine's files (`--json FILE`)."""
    args = list(argv if argv is not None else sys.argv[1:])
    out, skip = [], False
    for a in args:
        if skip or a.startswith("--json="):
            skip = False
            continue
        skip = a == "--json"
        if not skip:
            out.append(a)
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a checkpoint or embedded:<name> (default: the random tiny model)")
    ap.add_argument(
        "--preset", help="a preset with random weights instead of --model (the GPU check: droid_14b, libero_5b)"
    )
    ap.add_argument("--device", help="cuda, cpu, ... (default: the checkpoint's, else cuda where present)")
    ap.add_argument("--dtype", help="bfloat16, float32, ... (default: the checkpoint's or the device's)")
    ap.add_argument("--steps", type=int, help="pipeline.num_inference_steps (default: the model's plan)")
    ap.add_argument("--url", help="a running server's door: http://, ws:// (OpenPI) or tcp://host:port (ZeroMQ)")
    ap.add_argument("--robots", default="1,2,4,8,16", help="comma-separated fleet sizes, tried in order")
    ap.add_argument("--seconds", type=float, default=12.0, help="how long each fleet runs")
    ap.add_argument("--hz", type=float, default=15.0, help="control rate (DROID: 15)")
    ap.add_argument("--horizon", type=int, default=8, help="open-loop horizon (the evaluation's default: 8)")
    ap.add_argument("--schedule", default="rtc", choices=("sync", "prefetch", "rtc"))
    ap.add_argument("--lead", type=int, default=2, help="--schedule prefetch: ticks early the query leaves")
    ap.add_argument("--max-rows", type=int, default=32, help="batching.max_batch_rows (CPU auto: 32)")
    ap.add_argument("--max-requests", type=int, default=16, help="batching.max_batch_size (shipped: 16)")
    ap.add_argument("--wait-s", type=float, default=0.005, help="batching.batch_wait_timeout_s (shipped: 0.005)")
    ap.add_argument("--rows-per-thread", type=int, default=4, help="policy.rows_per_thread on CPU (shipped: 4)")
    ap.add_argument("--cores", type=int, help="cores the reference servers share (default: this machine's)")
    ap.add_argument(
        "--reference-threads",
        type=int,
        default=1,
        help="torch threads per reference server (0: cores // N; default 1, see docs/benchmarks.md)",
    )
    ap.add_argument(
        "--reference",
        choices=("processes", "one-at-a-time"),
        help="the reference way: one server process per robot (default on CPU) or, where N copies of the model do "
        "not fit (default on a GPU), one session per model call, first come first served, on the same model",
    )
    ap.add_argument("--no-reference", action="store_true", help="the batched way only")
    ap.add_argument("--results", help="append each fleet's row (JSON lines, the GPU check's results file)")
    ap.add_argument("--farm", action="store_true", help="one live robot beside a farm, classes on and off")
    ap.add_argument("--farm-rows", type=int, default=16, help="environments per farm request")
    ap.add_argument("--json", help="write the rows to this JSON file")
    ap.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", help="write the tables into this file")
    args = ap.parse_args(argv)
    sizes = [int(w) for w in args.robots.split(",") if w.strip()]
    if not sizes or min(sizes) < 1:
        ap.error(f"--robots {args.robots!r}: give positive fleet sizes")
    if args.preset is not None:
        from dreamzero.config.presets import PRESETS

        if args.preset not in PRESETS:
            ap.error(f"--preset {args.preset!r}: known presets are {', '.join(sorted(PRESETS))}")
    if args.model and args.preset:
        ap.error("give --model (a checkpoint) or --preset (random weights), not both")
    if args.url and (args.preset or args.device or args.dtype):
        ap.error("--url measures a running server: --preset, --device and --dtype belong to the in-process run")
    if args.url and args.farm:
        ap.error("--farm runs in-process (it compares the batcher with and without classes): leave out --url")
    try:
        pace = Pace(args.hz, args.horizon, args.schedule, args.lead)
    except ValueError as exc:
        ap.error(str(exc))
    return args, sizes, pace


def main(argv=None) -> int:
    args, sizes, pace = parse_args(argv)
    policy = None
    if args.url:
        device = "a running server"
        shared, ways = args.url, ("batched",)
    else:
        policy = load_policy(model_spec(args))
        warm_up(policy)
        dev = policy.pipeline.device
        device = f"cpu ({os.cpu_count()} cores)" if dev.type == "cpu" else device_name(dev)
        args.reference = args.reference or ("processes" if dev.type == "cpu" else "one-at-a-time")
        ways = ("batched",) if args.no_reference else WAYS
        shared = None
        if not args.farm:
            shared = {"batched": batched_server(policy, args, classes=True)}
            if "reference" in ways and args.reference == "one-at-a-time":
                shared["reference"] = batched_server(policy, args, classes=False, max_rows=1)
    record: dict = {"setting": setting_line(args, pace, device)}
    try:
        if args.farm:
            record["farm"] = farm_scenario(policy, args, pace)
        else:

            def on_row(row: dict) -> None:
                print(line(row), flush=True)
                append_result(args, {"figure": "fleet", "model": model_name(args), "device": device, **row})

            rows, best = sweep(sizes, ways, args, pace, shared, on_row=on_row)
            record.update(rows=rows, largest_at_pace=best)
            print("largest N at pace: " + ", ".join(f"{w} {n}" for w, n in best.items()), flush=True)
            append_result(args, {"figure": "fleet_at_pace", "model": model_name(args), "device": device,
                                 "reference": args.reference, "setting": record["setting"], **best})  # fmt: skip
    finally:
        for server in shared.values() if isinstance(shared, dict) else ():
            server.close()
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    if args.write_docs:
        name = args.model or args.preset or "tiny"
        kind = "CPU" if device.startswith("cpu") else "GPU" if policy is not None else "served"
        again = f"Reproduce: `python benchmarks/fleet.py {' '.join(reproduce(argv))}`."
        if args.farm:
            body = f"{record['setting']}\n\n{farm_table(record['farm'])}\n\n{again}\n"
            write_docs(Path(args.write_docs), f"Fleet: a live robot beside a farm ({name}, {kind})", body)
        else:
            best = record["largest_at_pace"]
            ratio = f" ({best['batched'] / best['reference']:.1f}x)" if best.get("reference") else ""
            summary = "Largest N at pace: " + ", ".join(f"{w} {n}" for w, n in best.items()) + ratio + "."
            body = f"{record['setting']} {summary}\n\n{fleet_table(record['rows'])}\n\n{again}\n"
            write_docs(Path(args.write_docs), f"Fleet at the control pace ({name}, {kind})", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
