"""Does a checkpoint use the image? The action loss of first blocks with each clip's own images against another
layout's images (docs/training.md, "Does the model use the image at all?").

    python -m dreamzero.train.probe --checkpoint runs/x/checkpoint-0001500 --dataset demos/ --episodes 30:50

Each clip starts at frame 0 (the robot's home pose, the same state in every layout), so the images are the only input
that tells the layouts apart. "Other" gives every clip the anchor latent, i2v conditioning, CLIP features and block
video of the next clip in the set; the state, actions and noise stay. ratio = other / own: 1.0 means the image is
ignored; above 1, the model's actions depend on what it sees.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence

import torch

from dreamzero.errors import ConfigError
from dreamzero.train.objective import EncodedBatch, teacher_forced_loss
from dreamzero.train.schedule import TrainingSchedule


def swap_images(batch: EncodedBatch) -> EncodedBatch:
    """Every clip with the visual inputs of the next clip (the last with the first's)."""
    perm = torch.roll(torch.arange(batch.block_latents.shape[0]), 1)

    def take(t):
        return None if t is None else t[perm]

    return dataclasses.replace(
        batch,
        anchor_latent=batch.anchor_latent[perm],
        y=take(batch.y),
        clip_feature=take(batch.clip_feature),
        block_latents=batch.block_latents[perm],
    )


@torch.no_grad()
def image_reliance(dit, batch: EncodedBatch, seeds: int = 8) -> dict:
    """Mean action loss of `batch` with its own images and with swapped ones, over the same `seeds` noise draws."""
    if batch.block_latents.shape[0] < 2:
        raise ConfigError("probe: needs at least 2 clips (episodes) to swap images between")
    if seeds < 1:
        raise ConfigError(f"seeds: expected >= 1, got {seeds}")
    was_training = dit.training
    dit.eval()
    schedule = TrainingSchedule(device=batch.block_latents.device)
    out = {}
    for name, b in (("own", batch), ("other", swap_images(batch))):
        losses = []
        for seed in range(seeds):
            gen = torch.Generator(device=batch.block_latents.device).manual_seed(seed)
            losses.append(teacher_forced_loss(dit, b, schedule, gen).action.item())
        out[name] = sum(losses) / len(losses)
    dit.train(was_training)
    out["ratio"] = out["other"] / out["own"] if out["own"] > 0 else float("nan")
    return out


def _episode_range(text: str) -> slice:
    try:
        start, _, stop = text.partition(":")
        return slice(int(start) if start else None, int(stop) if stop else None)
    except ValueError:
        raise ConfigError(f"episodes: expected START:STOP (e.g. 30:50), got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dreamzero.train.probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a checkpoint dreamzero-train wrote (or any model_path)")
    p.add_argument("--dataset", required=True, help="LeRobot v3.0 dataset (use episodes the run did not train on)")
    p.add_argument("--episodes", default=":", help="START:STOP slice of the dataset's episodes (default: all)")
    p.add_argument("--embodiment", default="oxe_droid")
    p.add_argument("--seeds", type=int, default=8, help="noise draws per clip")
    args = p.parse_args(argv)

    from dreamzero.checkpoint import load_model
    from dreamzero.embedded_default import resolve_model_path
    from dreamzero.embodiments import get_embodiment
    from dreamzero.metadata import read_metadata_file
    from dreamzero.train.data import load_episodes, make_clip
    from dreamzero.train.objective import encode_clips

    path = resolve_model_path(args.checkpoint)
    model = load_model(path, device="cpu", dtype=torch.float32)
    embodiment = get_embodiment(args.embodiment, read_metadata_file(path))
    episodes = load_episodes(args.dataset, embodiment)[_episode_range(args.episodes)]
    batch = encode_clips(model, [make_clip(e, 0, 1, embodiment) for e in episodes])
    print(json.dumps({"clips": len(episodes), **image_reliance(model.model, batch, args.seeds)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
