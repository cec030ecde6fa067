"""Where a raw DROID request's serving time goes, stage by stage, in one process (no Ray, no model).

Every stage the served raw path runs outside the model, on the request the serving benchmark sends (three 180x320
cameras, 4-frame stacks, one row): the client's msgpack encode, the ingress decode + validation, the hops to and from
Preprocess and to Policy (Serve's gRPC transport pickles the arguments with cloudpickle: dumps + loads here, without
the socket), observation validation, the image transform per camera, stitch, the whole preprocess, postprocess.
The image stages run both ways, the one-pass canvas kernel and the previous CropResize + stitch, interleaved call by
call, so their ratio holds on a loaded machine. CPU time of this thread is reported next to the wall clock: on a shared
box the wall clock counts the time other processes held the core.

    python benchmarks/preprocess_breakdown.py                  # print
    python benchmarks/preprocess_breakdown.py --write-docs     # also write docs/benchmarks.md "Preprocess breakdown"
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the sibling helper module
from serving_common import droid_observation, machine_line, percentile, request_body, write_section

from deployments.requests.generations import parse_generation_request
from dreamzero_client.wire import codec


def _clock(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall ms, thread CPU ms) of one call."""
    w0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return (time.perf_counter() - w0) * 1e3, (time.thread_time() - c0) * 1e3


def _stages(frames: int) -> dict[str, Callable[[], object]]:
    from ray import cloudpickle

    from deployments.preprocess import PreprocessDeployment
    from dreamzero.embodiments.oxe_droid import EXTERIOR_1, OxeDroid

    def hop(obj):  # what Serve's gRPC transport does to an argument or a return value, minus the socket
        return cloudpickle.loads(cloudpickle.dumps(obj))

    fast = PreprocessDeployment()  # compiles the kernel and plans 180x320 (as a replica does at start)
    old = PreprocessDeployment()
    old.embodiment.canvas_writer = None  # CropResize per camera + stitch: the path before the canvas kernel
    emb: OxeDroid = fast.embodiment
    obs = droid_observation(frames, seed=1)
    body = request_body(obs, "bench", None)
    req = parse_generation_request(codec.decode_msgpack(body)[0])
    parsed = emb.parse_observation(req.observation, batched=True)
    views = parsed.views
    batch, ctx = fast.run(req)
    actions = np.random.default_rng(0).uniform(-1, 1, (1, emb.action_horizon, emb.max_action_dim)).astype(np.float32)
    writer = emb.canvas_writer
    canvas = np.empty((frames, *emb.canvas_hw, 3), np.uint8)
    plan = writer.plan(views[EXTERIOR_1].shape[2:4])
    ext1 = views[EXTERIOR_1].reshape(frames, *views[EXTERIOR_1].shape[2:])

    def resize_one_kernel():
        if plan is None:
            raise RuntimeError("the canvas kernel does not serve 180x320 here (numba missing?)")
        plan.run(ext1, canvas, 176, 0, 1, writer.table)

    resized = {k: emb.crop_resize(v.reshape(frames, *v.shape[2:]))[None] for k, v in views.items()}
    return {
        "client: build + msgpack encode": lambda: request_body(obs, "bench", None),
        "ingress: msgpack decode + request validation": lambda: parse_generation_request(codec.decode_msgpack(body)[0]),
        "hop ingress -> preprocess: cloudpickle request": lambda: hop(req),
        "preprocess: observation validation": lambda: emb.parse_observation(req.observation, batched=True),
        "one camera, old: CropResize (torch float)": lambda: emb.crop_resize(ext1),
        "one camera, new: canvas kernel into its slot": resize_one_kernel,
        "3 cameras, old: CropResize x3 + stitch": lambda: emb.stitch(
            {k: emb.crop_resize(v.reshape(frames, *v.shape[2:]))[None] for k, v in views.items()}
        ),
        "3 cameras, new: canvas kernel x3": lambda: writer.render(views),
        "stitch alone (old path)": lambda: emb.stitch(resized),
        "whole preprocess, old": lambda: old.run(req),
        "whole preprocess, new": lambda: fast.run(req),
        "hop preprocess -> ingress: cloudpickle (batch, context)": lambda: hop((batch, ctx)),
        "hop ingress -> policy: cloudpickle ModelBatch": lambda: hop(batch),
        "postprocess (+ its two hops)": lambda: hop(emb.postprocess(hop(actions), hop(ctx))),
    }


def run(n: int, warmup: int, frames: int) -> dict[str, tuple[list[float], list[float]]]:
    stages = _stages(frames)
    out: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in stages}
    for i in range(warmup + n):
        for name, fn in stages.items():  # interleaved: every stage once per round
            wall, cpu = _clock(fn)
            if i >= warmup:
                out[name][0].append(wall)
                out[name][1].append(cpu)
    return out


def report(results: dict[str, tuple[list[float], list[float]]], n: int, frames: int) -> str:
    lines = [
        f"One raw DROID row (3 cameras 180x320, {frames}-frame stacks, canvas {frames}x352x640), {machine_line()}; "
        f"{n} interleaved rounds. CPU = this thread's CPU time (robust to other processes on the core).",
        "",
        "| stage | wall p50 ms | CPU p50 ms |",
        "|---|---|---|",
    ]
    for name, (wall, cpu) in results.items():
        lines.append(f"| {name} | {percentile(wall, 50):.2f} | {percentile(cpu, 50):.2f} |")

    def ratio(old: str, new: str) -> str:
        r = np.asarray(results[old][1]) / np.maximum(np.asarray(results[new][1]), 1e-6)
        return f"{np.median(r):.1f}x"

    one = ratio("one camera, old: CropResize (torch float)", "one camera, new: canvas kernel into its slot")
    three = ratio("3 cameras, old: CropResize x3 + stitch", "3 cameras, new: canvas kernel x3")
    whole = ratio("whole preprocess, old", "whole preprocess, new")
    lines += [
        "",
        f"Old / new, median of the per-round CPU-time ratios: one camera {one}, three cameras incl. stitch {three}, "
        f"whole preprocess {whole}.",
        "",
        f"Reproduce: `python benchmarks/preprocess_breakdown.py --requests {n} --write-docs`.",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=30, help="measured rounds (every stage once per round)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--frames", type=int, default=4, help="frames per camera (4 = a stack after the first call)")
    ap.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", help="write the section into this file")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # as a CPU replica runs (Ray gives it one torch thread)
    results = run(args.requests, args.warmup, args.frames)
    text = report(results, args.requests, args.frames)
    print(text)
    if args.write_docs:
        write_section(
            Path(args.write_docs),
            "Preprocess breakdown",
            "Written by `benchmarks/preprocess_breakdown.py`.\n\n" + text,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
