"""CFG-parallel vs one process, per chunk: the two guidance branches on two ranks (`policy.cfg_parallel: 2`) against
both branches as one batch in one process.

On this CPU, at the same total threads: two ranks with one thread each (gloo, one branch each) vs one process with
two threads vs one process with one thread. On CUDA (`--device cuda`, two GPUs; `scripts/gpu-check.sh` runs it where
two are present): two GPUs with one rank each (NCCL) vs one GPU running both branches. Each rank's process sees only
its own GPU (`CUDA_VISIBLE_DEVICES` set per rank, `rank_visible_devices`), as Ray gives each actor of a
`cfg_parallel: 2` replica its one GPU: NCCL then runs over the layout a served replica has, not one process seeing both.

Within one run every mode runs in the same two worker processes, taking turns chunk by chunk, so a busy machine slows
them alike and the ratios compare like with like: worker 0 runs the one-process modes alone (worker 1 idles, blocked
on its pipe) and both workers run the pair mode as ranks 0 and 1. Presets run one after the other (one pair of
workers each) and the table gets one row per preset.

- `tiny`, `droid_14b` (GPU): the whole loop (`DreamZeroPipeline.generate`: VAE, prefill, denoise) of a continuing
  session, the upstream 8-of-16 step mask; restart chunks are not timed. Random weights.
- `droid_14b_slice` (CPU): DROID 14B's DiT shapes (width 5120, 40 heads, 880 tokens per latent frame, 2 frames per
  block, 24 actions) with 1 block, fp32, random weights: the denoise of one chunk on a bare DiT after one prefilled
  frame (the rest of the loop is the same work in every mode) with `--steps` DiT steps. A full chunk runs 8; one
  14B-width step takes about a minute on one core here, so the default is 1 (the ratio is per step).

    python benchmarks/cfg_parallel.py                                          # tiny and the 14B slice, this CPU
    python benchmarks/cfg_parallel.py --preset tiny --repeats 3
    python benchmarks/cfg_parallel.py --write-docs                             # the CPU table of docs/benchmarks.md
    python benchmarks/cfg_parallel.py --device cuda --write-docs               # two GPUs: DROID 14B, bf16
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SECTIONS = {"cpu": "## CFG-parallel (two ranks on one CPU)", "cuda": "## CFG-parallel (two GPUs)"}
#: mode -> (which pipeline, torch threads); the first mode is the baseline of the ratios
MODES = {
    "cpu": {
        "one process, 1 thread": ("single", 1),
        "one process, 2 threads": ("single", 2),
        "two ranks x 1 thread (cfg_parallel: 2)": ("pair", 1),
    },
    "cuda": {"one GPU, both branches": ("single", None), "two GPUs, one branch each (cfg_parallel: 2)": ("pair", None)},
}
DEFAULT_PRESETS = {"cpu": "tiny,droid_14b_slice", "cuda": "droid_14b"}
#: the canvas sent per preset (the model's own input size)
CANVAS = {"tiny": (32, 64), "droid_14b": (352, 640)}
START_TIMEOUT_S = 900.0  # a worker builds its model(s) within this (the 14B's random init on a GPU, a slow CPU)
CHUNK_TIMEOUT_S = 900.0  # one chunk of one mode (a 14B-width CPU step takes about a minute)


class Loop:
    """The whole loop of a model preset: a session per row, continuing chunks timed (restarts run untimed).

    One model serves both pipelines of this worker: "single" (both branches here) and "pair" (this rank's branch).
    """

    def __init__(self, preset_name: str, batch: int, device, dtype):
        from dreamzero.config import preset
        from dreamzero.model.dreamzero import DreamZeroModel
        from dreamzero.model.tokenizer import build_local_tokenizer
        from dreamzero.pipeline import DreamZeroPipeline
        from dreamzero.sessions import SessionStore

        cfg = preset(preset_name)
        model = DreamZeroModel.from_config(cfg, device=device, dtype=dtype, seed=0)
        model.text_encoder.tokenizer = build_local_tokenizer(cfg.text_encoder.vocab_size)
        self.pipes = {k: DreamZeroPipeline(model, cfg.pipeline, SessionStore(batch + 1)) for k in ("single", "pair")}
        self.batch, self.hw, self.calls = batch, CANVAS[preset_name], {"single": 0, "pair": 0}
        self.what = f"whole chunk, {sum(cfg.pipeline.dit_step_mask)} DiT steps"

    def attach(self, group) -> None:
        self.pipes["pair"].branch_group = group

    def chunk(self, kind: str) -> float:
        """One timed continuing chunk (running the untimed restart first where the session is new or its window
        full)."""
        from benchmarks.model_latency import make_batch

        pipe = self.pipes[kind]
        while True:
            frames = 1 if self.calls[kind] % 4 == 0 else 4  # both presets' windows fill after 4 chunks
            t0 = time.perf_counter()
            batch = make_batch(self.batch, frames, self.hw, self.calls[kind])  # model_latency's, same inputs
            res = pipe.generate(batch)  # ends on the host: synced
            took = time.perf_counter() - t0
            self.calls[kind] += 1
            if frames == 4 and not any(s.restarted for s in res.sessions):
                return took


class SliceDenoise:
    """The denoise of one chunk on DROID 14B's DiT shapes (1 block), after one prefilled latent frame."""

    def __init__(self, batch: int, steps: int, rank: int):
        import torch

        from dreamzero.config import preset
        from dreamzero.model.dit import CausalWanDiT
        from dreamzero.pipeline.denoise import prefill_block

        torch.manual_seed(0)
        cfg = preset("droid_14b_slice")
        self.dit = CausalWanDiT(cfg.dit).eval().requires_grad_(False)
        d = cfg.dit
        self.loop = cfg.pipeline.with_overrides({"num_inference_steps": steps, "dit_step_mask": None})
        self.what = f"denoise, {steps} DiT step{'s' if steps > 1 else ''} (of 8 per chunk)"
        lat_hw = (44, 80)  # the 352 x 640 canvas in latents
        gen = torch.Generator().manual_seed(1)
        self.video = torch.randn(batch, d.out_dim, d.num_frame_per_block, *lat_hw, generator=gen)
        self.action = torch.randn(batch, d.num_action_per_block, d.action_dim, generator=gen)
        self.state = torch.randn(batch, 1, d.max_state_dim, generator=gen)
        self.y = torch.randn(batch, d.in_dim - d.out_dim, 1 + d.num_frame_per_block, *lat_hw, generator=gen)
        text = torch.randn(2 * batch, d.text_len, d.text_dim, generator=gen)  # session-major: s0 cond, s0 uncond, ..
        clip = torch.randn(2 * batch, 257, d.image_dim, generator=gen)
        first = torch.randn(2 * batch, d.out_dim, 1, *lat_hw, generator=gen)
        # worker 0 runs both kinds; worker 1 only its branch's rows of the pair (a 14B-width prefill is not free)
        kinds = {"single": slice(None), "pair": slice(0, None, 2)} if rank == 0 else {"pair": slice(1, None, 2)}
        self.ctx, self.caches = {}, {}
        with torch.no_grad():
            for kind, rows in kinds.items():
                ctx = self.dit.embed_context(text[rows], clip[rows])
                y0 = self.y[:, :, :1].repeat_interleave(2 if kind == "single" else 1, dim=0)
                self.ctx[kind] = ctx
                self.caches[kind] = prefill_block(
                    self.dit, first[rows], context_emb=ctx, kv_cache=None, start_frame=0, y=y0
                )
        self.group = None

    def attach(self, group) -> None:
        self.group = group

    def chunk(self, kind: str) -> float:
        from dreamzero.pipeline.denoise import denoise_block

        t0 = time.perf_counter()
        denoise_block(
            self.dit, self.loop, video_noise=self.video, action_noise=self.action, state=self.state,
            context_emb=self.ctx[kind], kv_cache=self.caches[kind], start_frame=1, y=self.y[:, :, 1:],
            branch_group=self.group if kind == "pair" else None,
        )  # fmt: skip
        return time.perf_counter() - t0


def rank_visible_devices(rank: int, visible: str | None) -> str:
    """`CUDA_VISIBLE_DEVICES` for rank `rank`'s process: the rank-th of the GPUs this process may use (`visible`: its
    own `CUDA_VISIBLE_DEVICES`, None for all), so that each rank sees one GPU as cuda:0, as under Ray."""
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else ["0", "1"]
    if rank >= len(devices):
        raise ValueError(f"CUDA_VISIBLE_DEVICES={visible!r} names {len(devices)} GPU(s); rank {rank} needs its own")
    return devices[rank]


def worker(rank: int, port: int, args: dict, conn) -> None:
    """One process: rank `rank` of the pair; worker 0 also runs the one-process modes."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from dreamzero.pipeline.cfg_parallel import BranchGroup

    if args["device"] == "cuda":
        if torch.cuda.device_count() != 1:  # run_preset gave this rank one GPU, as Ray gives each actor its own
            raise SystemExit(f"rank {rank} sees {torch.cuda.device_count()} GPUs; it must see only its own")
        device, dtype = torch.device("cuda", 0), torch.bfloat16
        torch.cuda.set_device(device)
    else:
        device, dtype = torch.device("cpu"), torch.float32
        torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size=3, is_master=False, timeout=timedelta(seconds=600))
    if args["preset"] == "droid_14b_slice":
        if device.type != "cpu":
            raise SystemExit("the 14B slice is a CPU rehearsal of the shapes; on a GPU use --preset droid_14b")
        work = SliceDenoise(args["batch"], args["steps"], rank)
    else:
        work = Loop(args["preset"], args["batch"], device, dtype)
    group = BranchGroup(store, rank, device, timeout_s=CHUNK_TIMEOUT_S)  # both workers built: the rendezvous
    work.attach(group)
    conn.send(("ready", work.what))
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        kind, threads = cmd
        if threads is not None:
            torch.set_num_threads(threads)
        conn.send(work.chunk(kind))
    group.close()


def _recv(conn, timeout_s: float, what: str):
    if not conn.poll(timeout_s):
        raise TimeoutError(f"a worker did not {what} within {timeout_s:g} s")
    return conn.recv()


def run_preset(preset_name: str, args) -> tuple[str, dict[str, float]]:
    """The modes of one preset in one pair of workers: (what a chunk timed, median ms per mode)."""
    from datetime import timedelta

    import torch.distributed as dist

    modes = MODES[args.device]
    ctx = mp.get_context("spawn")
    # the rendezvous lives here (a client of its own); the workers are ranks 0 and 1
    master = dist.TCPStore("127.0.0.1", 0, 3, True, timedelta(seconds=600), wait_for_workers=False)
    conns, procs = [], []
    spec = {"preset": preset_name, "device": args.device, "batch": args.batch, "steps": args.steps}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    for rank in (0, 1):
        here, there = ctx.Pipe()
        p = ctx.Process(target=worker, args=(rank, master.port, spec, there), daemon=True)
        if args.device == "cuda":  # a spawned child takes the environment as it is at start()
            os.environ["CUDA_VISIBLE_DEVICES"] = rank_visible_devices(rank, visible)
        try:
            p.start()
        finally:
            if visible is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible
        conns.append(here)
        procs.append(p)
    try:
        what = [_recv(c, START_TIMEOUT_S, "start") for c in conns][0][1]
        times = {m: [] for m in modes}
        warmup, repeats = (0, args.slice_repeats) if preset_name == "droid_14b_slice" else (args.warmup, args.repeats)
        for rep in range(warmup + repeats):
            for mode, (kind, threads) in modes.items():
                targets = conns if kind == "pair" else conns[:1]
                for c in targets:
                    c.send((kind, threads))
                took = max(_recv(c, CHUNK_TIMEOUT_S, "finish a chunk") for c in targets)  # the pair: both done
                if rep >= warmup:
                    times[mode].append(took * 1000.0)
                print(f"{preset_name} | {mode}: {took * 1000.0:.0f} ms", file=sys.stderr, flush=True)
        for c in conns:
            c.send(None)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return what, {m: statistics.median(v) for m, v in times.items()}


def table(device: str, rows: list[tuple[str, str, int, dict[str, float]]]) -> str:
    modes = list(MODES[device])
    lines = ["| preset | timed | sessions | " + " | ".join(modes) + " |", "|---|---|---|" + "---|" * len(modes)]
    for preset_name, what, batch, med in rows:
        base = med[modes[0]]
        cells = [f"{med[m]:.0f} ms ({base / med[m]:.2f}x)" for m in modes]
        lines.append(f"| {preset_name} | {what} | {batch} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def intro(device: str, args, load: tuple[float, float]) -> str:
    runs = f"{args.warmup} warm-up and {args.repeats} timed chunks per mode"
    if device == "cpu":
        runs += f" ({args.slice_repeats} timed, no warm-up, for the 14B slice)"
    if device == "cuda":
        return (
            "Written by `benchmarks/cfg_parallel.py --device cuda --write-docs` (run by `scripts/gpu-check.sh` where "
            f"two GPUs are present). bf16, random weights, eager; {runs}, the modes taking turns. Median; in "
            "brackets the speed-up over one GPU running both branches."
        )
    return (
        "Written by `benchmarks/cfg_parallel.py --write-docs`: both presets in one run, the three modes taking turns "
        f"chunk by chunk in the same two worker processes; {runs}. Median; in brackets the speed-up over one process "
        "with one thread. The last two columns use the same two cores. fp32, random weights, on this "
        f"{os.cpu_count()}-core CPU shared with other work: 1-minute load average {load[0]:.1f} when the run "
        f"started, {load[1]:.1f} when it ended (its own one or two busy processes included; more than the cores "
        "means the modes did not have them to themselves). Read the ratios, not the milliseconds."
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=sorted(MODES))
    ap.add_argument("--preset", help="comma-separated presets (default: tiny,droid_14b_slice on cpu, droid_14b on "
                    "cuda)")  # fmt: skip
    ap.add_argument("--batch", type=int, default=1, help="sessions per chunk")
    ap.add_argument("--steps", type=int, default=1, help="DiT steps of the 14B slice's denoise")
    ap.add_argument("--warmup", type=int, default=1, help="untimed chunks per mode (whole-loop presets)")
    ap.add_argument("--repeats", type=int, default=5, help="timed chunks per mode (whole-loop presets)")
    ap.add_argument("--slice-repeats", type=int, default=3, help="timed chunks per mode of the 14B slice (no warm-up: "
                    "a step takes about a minute)")  # fmt: skip
    ap.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", help="write the table into this file")
    ap.add_argument("--json", help="also write the medians to this JSON file")
    args = ap.parse_args(argv)
    presets = [p.strip() for p in (args.preset or DEFAULT_PRESETS[args.device]).split(",") if p.strip()]
    known = set(CANVAS) | ({"droid_14b_slice"} if args.device == "cpu" else set())
    unknown = [p for p in presets if p not in known]
    if unknown:
        ap.error(f"--preset {unknown}: on {args.device} use one of {sorted(known)}")
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            ap.error(f"--device cuda needs two GPUs (one per rank); torch sees {torch.cuda.device_count()}")
    rows, load0 = [], os.getloadavg()[0]
    for p in presets:
        what, med = run_preset(p, args)
        rows.append((p, what, args.batch, med))
    text = table(args.device, rows)
    print(text, end="")
    load = (load0, os.getloadavg()[0])
    record = {"device": args.device, "load_avg_1min": load}
    record["rows"] = [{"preset": p, "timed": w, "median_ms": m} for p, w, _, m in rows]
    print(json.dumps(record))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    if args.write_docs:
        from benchmarks.model_latency import write_docs

        write_docs(Path(args.write_docs), text, SECTIONS[args.device], intro(args.device, args, load))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
