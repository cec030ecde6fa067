"""Serving overhead: the same tiny-model request through the Ray Serve graph vs the embedded in-process policy.

Three served forms, each against its embedded call: `normalised` (HTTP, the model's canvas), `raw` (HTTP, three DROID
cameras through Preprocess / Postprocess) and `openpi` (the raw DROID observation under OpenPI keys over the OpenPI
WebSocket, one camera frame stack per message). Both sides run in one process run, interleaved call by call
(embedded, served, embedded, ...), each on its own session with the identical sequence of inputs (first call 1
frame, then 4-frame stacks), so the model work is the same and the difference is what serving adds. The hop-by-hop
split comes from the per-stage timings every response carries plus the client's wall clock.

    python benchmarks/serving_overhead.py                      # print
    python benchmarks/serving_overhead.py --write-docs         # also write docs/benchmarks.md "Serving overhead"
    python benchmarks/serving_overhead.py --forms raw,openpi   # a subset of the forms

The raw forms run twice in the same run: with the shipped stage placement (`preprocess.placement: auto`, so these
requests are transformed in the ingress; postprocess in the ingress) and with both stages on their replicas
(`placement: replicas`, the hop each way), rows `raw [replicas]` and `openpi [replicas]`; `--placements auto` skips
the second deployment.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the sibling helper module
from serving_common import (
    BASE_ARGS,
    GEN,
    MSGPACK,
    deploy,
    droid_observation,
    front_door,
    front_door_flags,
    machine_line,
    normalised_observation,
    percentile,
    request_body,
    start_serve,
    stop_serve,
    tiny_canvas,
    write_section,
)

from dreamzero_client.openpi_client import OpenPIClient
from dreamzero_client.wire import codec, routes

FORMS = ("normalised", "raw", "openpi")
#: app args per stage placement (docs/serving.md, "Where the raw-form stages run"); only raw forms depend on it
PLACEMENTS = {
    "auto": {},
    "replicas": {"preprocess": {"placement": "replicas"}, "postprocess": {"placement": "replicas"}},
}
#: OpenPI wire key of each raw DROID key (the DROID client's names)
OPENPI_KEYS = {
    "video.exterior_image_1_left": "observation/exterior_image_0_left",
    "video.exterior_image_2_left": "observation/exterior_image_1_left",
    "video.wrist_image_left": "observation/wrist_image_left",
    "state.joint_position": "observation/joint_position",
    "state.gripper_position": "observation/gripper_position",
}


def _embedded(form: str):
    """A callable (observation, session, expected_step) -> (step, wall ms) running the model in this process."""
    if form == "normalised":
        from dreamzero.pipeline import DreamZeroPipeline
        from dreamzero.types import ModelBatch

        pipeline = DreamZeroPipeline.load(None, device="cpu", max_sessions=64)

        def call(obs, sid, expected):
            batch = ModelBatch(
                images=obs["images"], state=obs["state"], state_mask=obs["state_mask"], prompts=["pick up the cup"],
                session_ids=[sid], expected_steps=None if expected is None else [expected],
            )  # fmt: skip
            t0 = time.perf_counter()
            result = pipeline.generate(batch)
            return result.sessions[0].step, (time.perf_counter() - t0) * 1e3

        return call
    from dreamzero.policy import EmbeddedPolicy

    policy = EmbeddedPolicy.load(None, embodiment="oxe_droid", device="cpu", max_sessions=64)

    def call(obs, sid, expected):
        t0 = time.perf_counter()
        result = policy.infer(obs, [sid], "pick up the cup", expected_steps=expected)
        return result.sessions[0].step, (time.perf_counter() - t0) * 1e3

    return call


def _openpi_frame(obs: dict, session_id: str) -> dict:
    """The raw DROID row as one OpenPI message: no batch dim, [T, H, W, 3] stacks (a 4-stack is used as sent)."""
    frame = {OPENPI_KEYS[k]: v[0] for k, v in obs.items()}
    return {**frame, "prompt": "pick up the cup", "session_id": session_id}


def run_openpi(base_url: str, n: int, warmup: int) -> dict:
    """The OpenPI WebSocket against the embedded raw call, interleaved; timings from the reply dict."""
    embedded = _embedded("raw")
    walls: dict[str, list[float]] = {"embedded": [], "served": [], "served minus its model call": []}
    hops: dict[str, list[float]] = {}
    step = None
    host, port = base_url.split("//", 1)[1].rsplit(":", 1)
    with OpenPIClient(host, int(port), path=routes.OPENPI_WS_PATH, timeout_s=300, ping_interval_s=None) as ws:
        for i in range(warmup + n):
            obs = droid_observation(1 if i == 0 else 4, seed=i)
            step, ms = embedded(obs, "emb-openpi", step)
            frame = _openpi_frame(obs, "srv-openpi")
            t0 = time.perf_counter()
            reply = ws.infer(frame)
            wall = (time.perf_counter() - t0) * 1e3
            if i < warmup:
                continue
            t = reply["timings"]
            walls["embedded"].append(ms)
            walls["served"].append(wall)
            walls["served minus its model call"].append(wall - t["model.model_call"])
            split = {
                "client <-> front door <-> ingress (WS, msgpack both ways, frame buffers)": wall - t["graph"],
                "preprocess hop (incl. transforms)": t.get("preprocess", 0.0),
                "ingress <-> policy hop (queue, batching wait, transfer)": t["policy"] - t["model.model_call"],
                "model call on the replica": t["model.model_call"],
                "postprocess hop (incl. transforms)": t.get("postprocess", 0.0),
            }
            for k, v in split.items():
                hops.setdefault(k, []).append(v)
    return {"form": "openpi", "n": n, "walls": walls, "hops": hops}


def run(form: str, base_url: str, n: int, warmup: int) -> dict:
    if form == "openpi":
        return run_openpi(base_url, n, warmup)
    make_obs = normalised_observation if form == "normalised" else droid_observation
    embedded = _embedded(form)
    walls: dict[str, list[float]] = {"embedded": [], "served": [], "served minus its model call": []}
    hops: dict[str, list[float]] = {}
    step = {"embedded": None, "served": None}
    with httpx.Client(timeout=300, trust_env=False) as client:
        for i in range(warmup + n):
            obs = make_obs(1 if i == 0 else 4, seed=i)
            s, ms = embedded(obs, f"emb-{form}", step["embedded"])
            step["embedded"] = s
            body = request_body(obs, f"srv-{form}", step["served"])
            t0 = time.perf_counter()
            resp = client.post(base_url + GEN, content=body, headers=MSGPACK)
            wall = (time.perf_counter() - t0) * 1e3
            resp.raise_for_status()
            out = codec.decode_msgpack(resp.content)[0]
            step["served"] = out["sessions"][0]["step"]
            if i < warmup:
                continue
            t = out["timings"]
            walls["embedded"].append(ms)
            walls["served"].append(wall)
            walls["served minus its model call"].append(wall - t["model.model_call"])
            split = {
                "client <-> front door <-> ingress (HTTP, encode)": wall - t["ingress_total"],
                "ingress decode + validate": t["decode"],
                "preprocess hop (incl. transforms)": t.get("preprocess", 0.0),
                "ingress <-> policy hop (queue, batching wait, transfer)": t["policy"] - t["model.model_call"],
                "model call on the replica": t["model.model_call"],
                "postprocess hop (incl. transforms)": t.get("postprocess", 0.0),
            }
            for k, v in split.items():
                hops.setdefault(k, []).append(v)
    return {"form": form, "n": n, "walls": walls, "hops": hops}


def report(results: list[dict], proxy_fast_path: bool, haproxy: bool = False) -> str:
    h, w = tiny_canvas()
    proxy = front_door(proxy_fast_path, haproxy)
    lines = [
        f"Tiny embedded model (random weights, shipped pipeline defaults), normalised canvas {h}x{w} (the model's "
        "input size), raw DROID 3x180x320 (HTTP `raw`; `openpi`: the same over the OpenPI WebSocket); shipped "
        "replica settings (`serve_graph.builder.REPLICA_ENV`), "
        f"{proxy}; one session per side, {machine_line()}.",
        "",
        "| form | path | p50 ms | p99 ms |",
        "|---|---|---|---|",
    ]
    for r in results:
        for path, vals in r["walls"].items():
            lines.append(f"| {r['form']} | {path} | {percentile(vals, 50):.1f} | {percentile(vals, 99):.1f} |")
        emb, srv = r["walls"]["embedded"], r["walls"]["served"]
        lines.append(
            f"| {r['form']} | served p50 - embedded p50 | {percentile(srv, 50) - percentile(emb, 50):.1f} | "
            f"{percentile(srv, 99) - percentile(emb, 99):.1f} |"
        )
    lines += [
        "",
        "`served minus its model call` is the serving overhead measured per request (client wall clock minus the",
        "replica's own model time for that request); it is robust to the model-time noise of a shared machine, which",
        "dominates the difference of the two wall-clock distributions.",
    ]
    lines += ["", "Hop-by-hop split of the served path (median ms per request):", ""]
    lines += ["| form | hop | p50 ms |", "|---|---|---|"]
    for r in results:
        for hop, vals in r["hops"].items():
            if any(vals):
                lines.append(f"| {r['form']} | {hop} | {percentile(vals, 50):.1f} |")
    lines += [
        "",
        f"{results[0]['n']} measured calls per side after warm-up, interleaved. Reproduce: "
        f"`python benchmarks/serving_overhead.py{front_door_flags(proxy_fast_path, haproxy)} --write-docs`.",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=30, help="measured calls per side and form")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--forms", default=",".join(FORMS), help=f"comma list of {', '.join(FORMS)}")
    ap.add_argument(
        "--proxy-fast-path",
        action="store_true",
        help="start Ray with RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0, as a user starts `serve run` (docs/serving.md)",
    )
    ap.add_argument("--haproxy", action="store_true", help="start Ray with RAY_SERVE_ENABLE_HA_PROXY=1 (HAProxy front)")
    ap.add_argument(
        "--placements",
        default=",".join(PLACEMENTS),
        help="stage placements to measure the raw forms with: auto (shipped), replicas (both stages on replicas)",
    )
    ap.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", help="write the section into this file")
    args = ap.parse_args(argv)
    import torch

    # The embedded side runs the model as the policy replica does: Ray gives a replica with num_cpus 0 one torch
    # thread (OMP_NUM_THREADS=1). Two threads here would also leave OpenMP workers spinning after each embedded call,
    # on the very cores the next served request needs (on 2 cores that alone added ~5 ms to every served request).
    torch.set_num_threads(1)
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    unknown = sorted(set(forms) - set(FORMS))
    if unknown:
        raise SystemExit(f"--forms: unknown {unknown}; choose from {list(FORMS)}")
    placements = [p.strip() for p in args.placements.split(",") if p.strip()]
    if not placements or set(placements) - set(PLACEMENTS):
        raise SystemExit(f"--placements: choose from {list(PLACEMENTS)}")
    base_url = start_serve(proxy_fast_path=args.proxy_fast_path, haproxy=args.haproxy)
    results = []
    try:
        for placement in placements:
            todo = forms if placement == "auto" else [f for f in forms if f != "normalised"]
            if not todo:
                continue
            if results:  # the previous app answers /health until it is gone
                from ray import serve

                serve.delete("bench")
            deploy(base_url, {**BASE_ARGS, **PLACEMENTS[placement]})
            for form in todo:
                result = run(form, base_url, args.requests, args.warmup)
                if placement != "auto":
                    result["form"] = f"{form} [{placement}]"
                results.append(result)
    finally:
        stop_serve()
    text = report(results, args.proxy_fast_path, args.haproxy)
    print(text)
    if args.write_docs:
        write_section(
            Path(args.write_docs), "Serving overhead", "Written by `benchmarks/serving_overhead.py`.\n\n" + text
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
