"""Offline export of the model's imagination: camera videos or a LeRobot episode in, input canvas and predicted video
out (MP4, optional GIF), through the embedded policy in this process (no server).

    dreamzero-export-video --dataset data/scene1 --episode 0 --out runs/export        # a LeRobot v3.0 episode
    dreamzero-export-video --video video.exterior_image_1_left=left.mp4 --video video.exterior_image_2_left=right.mp4 \\
        --video video.wrist_image_left=wrist.mp4 --prompt "put the cube in the bowl" --out runs/export --gif

The episode runs as a robot session would: the first chunk from frame 0, then one chunk every `action_horizon`
frames, each query carrying the frames at the embodiment's `frame_offsets` from its step (DROID: -23, -16, -8, 0).
Each chunk's predicted frames (`return_video`) show the next block; written out: `input.mp4` (the stitched canvas the
model read, one frame per query frame), `predicted.mp4` (every chunk's predicted frames, one continuous video), and
`side_by_side.mp4` (predicted | the canvas that followed). Camera videos give no robot state: it is zero, which the
model reads as a pose (fine for looking at its video, not for its actions). `--model-path` defaults to the shipped
trained model (embedded:small-scene1). Its frames are a smear of colour whatever the DiT predicts: it keeps the tiny
preset's VAE, random and frozen, whose decoder is no inverse of its encoder; a released checkpoint's Wan VAE decodes
the scene (docs/serving.md, "Offline: dreamzero-export-video"). Progress goes to stderr, the summary JSON to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from dreamzero.cli_help import DefaultsHelpFormatter
from dreamzero.embedded_default import SHIPPED_DEFAULT as DEFAULT_MODEL
from dreamzero.errors import ConfigError, DreamZeroError


def _stderr(line: str) -> None:
    """Progress for the person at the terminal; stdout keeps the one JSON summary a script reads."""
    print(f"dreamzero-export-video: {line}", file=sys.stderr, flush=True)


def _read(path: str) -> np.ndarray:
    from dreamzero.video_recorder import read_mp4

    return read_mp4(Path(path))


def episode_from_videos(specs: list[str], embodiment, prompt: str):
    """`KEY=PATH` per camera -> (views {key: [N, H, W, 3]}, zero state {key: [N, D]}, prompt)."""
    views = {}
    for spec in specs:
        key, sep, path = spec.partition("=")
        if not sep or key not in embodiment.video_keys:
            raise ConfigError(f"--video {spec!r}: expected KEY=PATH with KEY one of {list(embodiment.video_keys)}")
        views[key] = _read(path)
    missing = [k for k in embodiment.video_keys if k not in views]
    if missing:
        raise ConfigError(f"--video: no video for {missing} (the embodiment's cameras: {list(embodiment.video_keys)})")
    n = min(len(v) for v in views.values())
    state = {k: np.zeros((n, len(embodiment.state_normalisers[k].q01))) for k in embodiment.state_keys}
    return {k: v[:n] for k, v in views.items()}, state, prompt


def episode_from_dataset(root: str, index: int, embodiment, prompt: str | None):
    from dreamzero.lerobot_dataset import LeRobotDataset
    from dreamzero.train.data import load_episodes

    order = LeRobotDataset(root).episode_indices
    if index not in order:
        raise ConfigError(f"--episode {index}: {root} holds episodes {order[:10]}{'...' if len(order) > 10 else ''}")
    episode = load_episodes(root, embodiment, max_episodes=order.index(index) + 1)[-1]
    return episode.views, episode.state, prompt or episode.task


def export(
    policy, views: dict, state: dict, prompt: str, out: Path, chunks: int | None, gif: bool, fps: int, progress=None
) -> dict:
    """Run the episode chunk by chunk through `policy` (an EmbeddedPolicy) and write the videos; returns a summary.
    `progress`: called with one line per chunk and per file step (None: silent)."""
    from dreamzero.video_recorder import side_by_side, write_mp4

    say = progress or (lambda line: None)
    emb = policy.embodiment
    n = min(len(v) for v in views.values())
    horizon = emb.action_horizon
    steps = list(range(0, n, horizon))[:chunks]
    predicted, inputs, pairs = [], [], []
    hw = None
    started = time.monotonic()
    for k, step in enumerate(steps):
        say(f"chunk {k + 1}/{len(steps)} (frame {step} of {n}, {time.monotonic() - started:.0f} s so far)")
        at = [step] if k == 0 else [max(0, step + off) for off in emb.frame_offsets]
        obs = {key: v[at][None] for key, v in views.items()}
        obs.update({key: s[step][None].astype(np.float32) for key, s in state.items()})
        result = policy.infer(obs, ["export"], instructions=[prompt], reset=k == 0, return_video=True)
        video = result.video[0]  # [T, h, w, 3]
        hw = video.shape[1:3]
        canvas, _ = emb.preprocess(obs)
        inputs.append(_resize(np.asarray(canvas.images)[0], hw))
        predicted.append(video)
        nxt = [min(n - 1, step + horizon + off) for off in emb.frame_offsets]
        following, _ = emb.preprocess({**obs, **{key: v[nxt][None] for key, v in views.items()}})
        pairs.append(side_by_side(video, np.asarray(following.images)[0]))
    say(f"writing the videos to {out}")
    out.mkdir(parents=True, exist_ok=True)
    files = {"input": out / "input.mp4", "predicted": out / "predicted.mp4", "side_by_side": out / "side_by_side.mp4"}
    write_mp4(files["input"], np.concatenate(inputs), max(1, fps // 2))
    write_mp4(files["predicted"], np.concatenate(predicted), fps)
    write_mp4(files["side_by_side"], np.concatenate(pairs), fps)
    if gif:
        from PIL import Image

        frames = [Image.fromarray(f) for f in np.concatenate(pairs)]
        files["gif"] = out / "side_by_side.gif"
        frames[0].save(files["gif"], save_all=True, append_images=frames[1:], duration=int(1000 / fps), loop=0)
    summary = {"chunks": len(steps), "frames_per_chunk": int(predicted[0].shape[0]), "frame_hw": list(hw),
               "prompt": prompt, "files": {k: str(p) for k, p in files.items()}}  # fmt: skip
    (out / "export.json").write_text(json.dumps(summary, indent=1))
    return summary


def _resize(frames: np.ndarray, hw) -> np.ndarray:
    from dreamzero.video_recorder import resize_frames

    return resize_frames(frames, tuple(hw))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dreamzero-export-video", description=__doc__, formatter_class=DefaultsHelpFormatter
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", help="a LeRobot v3.0 dataset folder (with --episode)")
    src.add_argument("--video", action="append", metavar="KEY=PATH", help="one camera video per embodiment view")
    p.add_argument("--episode", type=int, default=0, help="episode index of --dataset")
    p.add_argument(
        "--prompt", default=None, help="the instruction (default: the episode's task; required with --video)"
    )
    p.add_argument("--model-path", default=DEFAULT_MODEL, help="checkpoint or embedded:<name> (default: %(default)s)")
    p.add_argument("--embodiment", default=None, help="embodiment tag (default: the checkpoint's)")
    p.add_argument("--chunks", type=int, default=None, help="at most this many chunks (default: the whole episode)")
    p.add_argument("--fps", type=int, default=5, help="frame rate of the predicted videos (default: %(default)s)")
    p.add_argument("--gif", action="store_true", help="also write side_by_side.gif")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: %(default)s)")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from dreamzero.policy import EmbeddedPolicy

        if args.video and not args.prompt:
            raise ConfigError("--prompt: required with --video (camera videos carry no instruction)")
        if args.chunks is not None and args.chunks < 1:
            raise ConfigError(f"--chunks: expected >= 1, got {args.chunks}")
        _stderr(f"loading {args.model_path} on {args.device}")
        policy = EmbeddedPolicy.load(args.model_path, embodiment=args.embodiment, device=args.device)
        _stderr("reading the episode")
        if args.video:
            views, state, prompt = episode_from_videos(args.video, policy.embodiment, args.prompt)
        else:
            views, state, prompt = episode_from_dataset(args.dataset, args.episode, policy.embodiment, args.prompt)
        summary = export(policy, views, state, prompt, args.out, args.chunks, args.gif, args.fps, _stderr)
    except DreamZeroError as exc:  # a configuration or checkpoint error: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
