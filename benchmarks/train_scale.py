"""dreamzero-train on Ray Train: 2 workers x 1 thread (DDP, and FSDP2) against 1 worker x 1 thread, the same global
batch and seeds.

Every arm runs through `run_distributed` (Ray Train TorchTrainer, gloo), on the tiny embedded model and a small
synthetic DROID-keyed dataset, rounds interleaved. Reported: samples/s of the optimizer steps after the first two
(start-up, first-touch allocation), the wall time of the whole run (Ray start, worker start, model load, steps), and
the loss of every step in every arm with the largest difference from 1 worker (both strategies take the
single-process step, so the curves agree to round-off).

    python benchmarks/train_scale.py                 # print
    python benchmarks/train_scale.py --write-docs    # also write docs/benchmarks.md "Training: 2 workers vs 1 (CPU)"
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the sibling helper module
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serving_common import machine_line, write_section

from dreamzero.train.distributed import run_distributed
from dreamzero.train.trainer import TrainConfig
from dreamzero_droid.lerobot import Episode, write_dataset
from eval.mujoco_droid.record import MODALITY, VIDEO_FEATURES

TITLE = "Training: 2 workers vs 1 (CPU)"
WARM_STEPS = 2


def _dataset(root: Path, episodes: int = 4, length: int = 60) -> Path:
    """Smooth random joint paths and frames whose colour follows them (as the training tests' fixture)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(episodes):
        joints = np.cumsum(rng.normal(0, 0.02, size=(length, 7)), axis=0) + rng.normal(0, 0.3, size=7)
        grip = (np.arange(length) >= length // 2).astype(np.float64)[:, None]
        state = np.concatenate([joints, grip], 1).astype(np.float32)
        base = rng.integers(0, 255, size=(1, 64, 112, 3))
        frames = np.clip(base + (np.tanh(joints[:, :3]) * 60)[:, None, None, :], 0, 255).astype(np.uint8)
        vectors = {"observation.state": state, "action": np.concatenate([joints + 0.01, grip], 1).astype(np.float32)}
        out.append(Episode(task="put the cube in the bowl", vectors=vectors,
                           videos={k: frames for k in VIDEO_FEATURES.values()}))  # fmt: skip
    write_dataset(root, out, fps=15.0, robot_type="synthetic")
    (root / "meta" / "modality.json").write_text(json.dumps(MODALITY))
    return root


ARMS = {"1 x 1": (1, "ddp"), "2 x 1, DDP": (2, "ddp"), "2 x 1, FSDP2": (2, "fsdp")}


def _arm(dataset: Path, out: Path, workers: int, strategy: str, steps: int, batch: int) -> dict:
    cfg = TrainConfig(dataset=str(dataset), out=str(out), steps=steps, batch_size=batch, blocks=2, lr=1e-3,
                      warmup_steps=0, save_every=steps, seed=0, strategy=strategy)  # fmt: skip
    t0 = time.monotonic()
    records = run_distributed(cfg, num_workers=workers, resume=False, threads_per_worker=1)
    wall = time.monotonic() - t0
    timed = records[WARM_STEPS:]
    return {
        "samples_per_s": batch * len(timed) / sum(r["seconds"] for r in timed),
        "wall_s": wall,
        "losses": [r["loss"] for r in records],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=4, help="global batch (both arms)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args(argv)
    import ray
    import torch

    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        dataset = _dataset(Path(tmp) / "ds")
        for r in range(args.rounds):
            for i, (arm, (workers, strategy)) in enumerate(ARMS.items()):
                res = _arm(dataset, Path(tmp) / f"run-{i}-{r}", workers, strategy, args.steps, args.batch_size)
                results[arm].append(res)
                print(f"round {r} {arm}: {res['samples_per_s']:.2f} samples/s, wall {res['wall_s']:.1f} s", flush=True)
    ray.shutdown()
    sps = {arm: statistics.median(x["samples_per_s"] for x in results[arm]) for arm in ARMS}
    wall = {arm: statistics.median(x["wall_s"] for x in results[arm]) for arm in ARMS}
    curves = {arm: results[arm][0]["losses"] for arm in ARMS}
    base = curves["1 x 1"]
    diffs = {arm: max(abs(a - b) for a, b in zip(base, curves[arm])) for arm in ARMS}
    rels = {arm: max(abs(a - b) / abs(a) for a, b in zip(base, curves[arm])) for arm in ARMS}
    spread = {
        arm: (min(x["samples_per_s"] for x in results[arm]), max(x["samples_per_s"] for x in results[arm]))
        for arm in ARMS
    }
    table = "\n".join(
        f"| {arm} | {sps[arm]:.2f} ({spread[arm][0]:.2f}-{spread[arm][1]:.2f}) | {sps[arm] / sps['1 x 1']:.2f}x | "
        f"{wall[arm]:.1f} |"
        for arm in ARMS
    )
    rows = "\n".join(
        f"| {i + 1} | " + " | ".join(f"{curves[arm][i]:.6f}" for arm in ARMS) + " |" for i in range(len(base))
    )
    largest = ", ".join(f"{arm} {diffs[arm]:.2e} ({rels[arm]:.1e} relative)" for arm in list(ARMS)[1:])
    body = f"""Written by `benchmarks/train_scale.py`.

Tiny embedded model, synthetic DROID-keyed dataset (4 episodes of 60 frames), 2 blocks per clip, global batch
{args.batch_size}, {args.steps} steps, seed 0, fp32; every arm through Ray Train (`run_distributed`, gloo), each worker
1 torch thread, {args.rounds} rounds interleaved (medians); {machine_line()}.

| workers x threads | samples/s after step {WARM_STEPS}: median (range) | vs 1 worker | whole run, wall s |
|---|---|---|---|
{table}

Loss per step, first round (the same global batch and noise in every arm); largest difference from 1 worker:
{largest}: float round-off of the gradient reduction carried through AdamW.

| step | {" | ".join(ARMS)} |
|---|{"---|" * len(ARMS)}
{rows}

The machine has 2 cores shared with other jobs, so 2 workers have at most the two cores that 1 worker leaves half idle:
the ratio is what data parallelism gains here, not what 8 GPUs gain (each worker computes half the clips, plus the
gradient reduction over gloo each step). Under other jobs' load the rounds of one arm can differ as much as the arms
do: compare arms only where their ranges do not overlap. FSDP2 all-gathers every block's parameters before it runs,
in forward and again in backward, and reduce-scatters its gradients, so on a model this small it is not expected to
be faster than DDP; it is for models whose state does not fit one device (docs/training.md). What the table shows
without doubt is the loss curves: both strategies take the single-process steps.

Reproduce: `python benchmarks/train_scale.py --write-docs`.
"""
    print(body)
    if args.write_docs:
        write_section(Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md", TITLE, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
