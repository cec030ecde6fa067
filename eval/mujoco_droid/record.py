"""`dreamzero-record-demos`: record scripted-expert demonstrations of scene 1 or 4 as a LeRobot v3.0 dataset.

Each episode: a random layout (scene 1: `expert.sample_layout` from the `--layouts` ranges; scene 4:
`table2.sample_layout`, with the `--instruction` given or, with "all", one per episode from its seed), the expert runs
its plan plus a short hold at 15 Hz, and the episode is kept only if the named object ended in the named target
(failed ones are counted and reported, never written). Each episode's instruction is its LeRobot task. Columns use
DROID's names, so `dreamzero-make-metadata --tag oxe_droid` reads the result as it is:
    observation.state   [8]  joint_position (7) + gripper_position (1, 1 closed), before the step
    action              [8]  absolute joint targets (7) + gripper command (1), sent at that step
    observation.images.{exterior_image_1_left, exterior_image_2_left, wrist_image_left}   mp4 videos
plus `meta/modality.json` (GR00T style) naming the slices of the two vectors.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dreamzero.cli_help import DefaultsHelpFormatter
from dreamzero.errors import ConfigError, DreamZeroError
from dreamzero_droid.lerobot import (
    VIDEO_ENCODINGS,
    Episode,
    dataset_video_encoding,
    video_encoding_name,
    write_dataset,
)
from eval.env_contract import IMAGE_KEYS
from eval.mujoco_droid import table2
from eval.mujoco_droid.expert import (
    LAYOUTS,
    SCENE4_RANGE,
    ScriptedExpert,
    layout_range,
    reset_with_layout,
    sample_detours,
    sample_layout,
)

log = logging.getLogger(__name__)

#: our camera keys (eval.env_contract) -> DROID / LeRobot feature keys
VIDEO_FEATURES = dict(
    zip(
        IMAGE_KEYS,
        (
            "observation.images.exterior_image_1_left",
            "observation.images.exterior_image_2_left",
            "observation.images.wrist_image_left",
        ),
    )
)
MODALITY = {
    "state": {"joint_position": {"start": 0, "end": 7}, "gripper_position": {"start": 7, "end": 8}},
    "action": {"joint_position": {"start": 0, "end": 7}, "gripper_position": {"start": 7, "end": 8}},
    "video": {k.rsplit(".", 1)[-1]: {"original_key": k} for k in VIDEO_FEATURES.values()},
}
HOLD_STEPS = 6  # steps recorded after the plan ends, so the last frames show the cube at rest in the bowl


def record_episode(
    env, expert: ScriptedExpert, seed: int, layouts: str = "wide", detours: float = 0.0
) -> tuple[Episode, bool]:
    """One expert episode from layout seed `seed` (detours with probability `detours`, drawn from the same seed);
    returns it and whether the named object ended in the named target."""
    if env.scene_id == table2.SCENE_ID:  # the env's reset draws the layout and the instruction from the seed
        via = sample_detours(np.random.default_rng([seed, 1]), SCENE4_RANGE, detours)
        obs, _ = env.reset(seed=seed)
        expert.reset(via)
        poses = env.object_poses()
        extra = {
            "seed": seed,
            "instruction": env.instruction,
            **{f"{k}_xy": tuple(map(float, poses[k][:2])) for k in poses},
            "detour_reach_xy": via.reach,
            "detour_carry_xy": via.carry,
        }
    else:
        layout = sample_layout(np.random.default_rng(seed), layouts)
        via = sample_detours(np.random.default_rng([seed, 1]), layouts, detours)
        obs = reset_with_layout(env, seed, layout)
        expert.reset(via)
        extra = {
            "seed": seed,
            "object_xy": layout.object_xy,
            "target_xy": layout.target_xy,
            "detour_reach_xy": via.reach,
            "detour_carry_xy": via.carry,
        }
    states, actions, frames = [], [], {k: [] for k in VIDEO_FEATURES}
    for _ in range(min(expert.planned_steps + HOLD_STEPS, env.max_episode_steps)):
        action = expert.act()
        states.append(np.concatenate([obs["joint_position"], obs["gripper_position"]]))
        actions.append(action)
        for key in VIDEO_FEATURES:
            frames[key].append(obs[key])
        obs, _, _, _, info = env.step(action)
    episode = Episode(
        task=env.instruction,
        vectors={"observation.state": np.stack(states), "action": np.stack(actions)},
        videos={VIDEO_FEATURES[k]: np.stack(v) for k, v in frames.items()},
        extra=extra,
    )
    return episode, bool(info["success"])


def record_demos(
    out: str | Path,
    num_episodes: int,
    seed: int = 0,
    image_size: tuple[int, int] = (180, 320),
    render_quality: str = "quality",
    max_attempts: int | None = None,
    layouts: str | None = None,
    detours: float = 0.0,
    video: str = "standard",
    scene: int = 1,
    instruction: str | None = None,
) -> dict:
    """Record `num_episodes` successful episodes of `scene` (1, or 4 with `instruction`: one of
    `table2.INSTRUCTIONS`, or None / "all" for one per episode from its seed) under `out` (videos in encoding `video`,
    see dreamzero_droid.lerobot.VIDEO_ENCODINGS); returns a summary (attempts, success rate, frames).
    `layouts` (default "wide") is scene 1's; `detours` (a probability) applies to both."""
    from eval.mujoco_droid.env import MujocoDroidEnv

    if scene not in (1, table2.SCENE_ID):
        raise ConfigError(f"scene: the scripted expert records scenes 1 and {table2.SCENE_ID}, got {scene}")
    if scene == table2.SCENE_ID and layouts is not None:
        raise ConfigError(f"layouts: scene 1's option; scene {table2.SCENE_ID} draws its own layouts")
    if scene == 1 and instruction is not None:
        raise ConfigError(f"instruction: scene 1 has one; the instructions are scene {table2.SCENE_ID}'s")
    layouts = layouts or "wide"
    layout_range(layouts)  # fail on a bad name, probability, instruction or encoding before building the scene
    video_encoding_name(video)
    sample_detours(np.random.default_rng(0), layouts, detours)
    if num_episodes < 1:
        raise ConfigError(f"episodes: expected >= 1, got {num_episodes}")
    max_attempts = max_attempts or 2 * num_episodes + 5
    env = MujocoDroidEnv(
        scene, image_size=image_size, render_quality=render_quality, max_episode_steps=400, instruction=instruction
    )
    expert = ScriptedExpert(env)
    kept, attempts, t0 = [], 0, time.monotonic()
    try:
        while len(kept) < num_episodes:
            if attempts >= max_attempts:
                raise RuntimeError(f"only {len(kept)} of {attempts} expert episodes succeeded; stopping")
            episode, success = record_episode(env, expert, seed + attempts, layouts, detours)
            attempts += 1
            log.info("episode seed %d: %d steps, success=%s", episode.extra["seed"], len(episode), success)
            if success:
                episode.success = True
                kept.append(episode)
    finally:
        env.close()
    for episode in kept:
        episode.extra["layouts"] = layouts if scene == 1 else f"scene{scene}"
    root = _write(out, kept, env.control_hz, video)
    summary = {
        "episodes": len(kept), "attempts": attempts, "expert_success_rate": len(kept) / attempts,
        "frames": sum(len(e) for e in kept), "seconds": round(time.monotonic() - t0, 1), "root": str(root),
        "scene": scene, "tasks": dict(sorted(Counter(e.task for e in kept).items())),
    }  # fmt: skip
    (root / "meta" / "recording.json").write_text(json.dumps(summary, indent=1))
    return summary


def read_episodes(root: str | Path) -> list[Episode]:
    """The episodes of a dataset this recorder wrote (vectors, decoded videos, layout records), in episode order."""
    from dreamzero.train.data import episode_video
    from dreamzero_droid.lerobot import LeRobotDataset, episode_marks

    dataset = LeRobotDataset(root)
    layouts = {r["episode_index"]: r for r in json.loads((Path(root) / "meta" / "layouts.json").read_text())}
    tasks = dataset.tasks()
    marks = {m["episode_index"]: m["success"] for m in episode_marks(root)}
    episodes = []
    for e in dataset.episode_indices:
        cols = dataset.episode_columns(e, ["observation.state", "action", "task_index"])
        extra = {k: v for k, v in layouts[e].items() if k != "episode_index"}
        episodes.append(
            Episode(
                task=tasks[int(cols["task_index"][0, 0])],
                vectors={k: cols[k].astype(np.float32) for k in ("observation.state", "action")},
                videos={k: episode_video(dataset, e, k) for k in VIDEO_FEATURES.values()},
                extra=extra,
                success=marks.get(e),
            )
        )
    return episodes


def merge_datasets(out: str | Path, parts: Sequence[str | Path]) -> Path:
    """One dataset at `out` holding every episode of `parts` (datasets this recorder wrote), in order; the videos are
    decoded and written again in the first part's encoding, and the statistics are recomputed over the union."""
    episodes = [e for part in parts for e in read_episodes(part)]
    fps = json.loads((Path(parts[0]) / "meta" / "info.json").read_text())["fps"]
    return _write(out, episodes, fps, dataset_video_encoding(parts[0]))


def _write(out: str | Path, episodes: list[Episode], fps: float, video: str = "standard") -> Path:
    root = write_dataset(out, episodes, fps=fps, robot_type="franka_fr3_mujoco", video=video, modality=MODALITY)
    records = [{"episode_index": i, **e.extra} for i, e in enumerate(episodes)]
    (Path(root) / "meta" / "layouts.json").write_text(json.dumps(records, indent=1))
    return Path(root)


def record_in_parallel(out: str | Path, num_episodes: int, seed: int, workers: int, argv: Sequence[str]) -> dict:
    """`workers` recorder processes, each on its own seed range (seed + 10000 k), then one merged dataset at `out`."""
    import subprocess

    parts_dir = Path(out).with_name(Path(out).name + ".parts")
    shares = [num_episodes // workers + (k < num_episodes % workers) for k in range(workers)]
    procs = []
    for k, share in enumerate(shares):
        cmd = [sys.executable, "-m", "eval.mujoco_droid.record", *argv, "--workers", "1"]
        cmd += ["--out", str(parts_dir / f"part-{k}"), "--episodes", str(share), "--seed", str(seed + 10000 * k)]
        procs.append(subprocess.Popen(cmd))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"recorder workers exited with {codes}; partial datasets are in {parts_dir}")
    summaries = [json.loads((parts_dir / f"part-{k}" / "meta" / "recording.json").read_text()) for k in range(workers)]
    root = merge_datasets(out, [parts_dir / f"part-{k}" for k in range(workers)])
    attempts = sum(s["attempts"] for s in summaries)
    return {
        "episodes": num_episodes, "attempts": attempts, "expert_success_rate": num_episodes / attempts,
        "frames": sum(s["frames"] for s in summaries), "seconds": max(s["seconds"] for s in summaries),
        "root": str(root), "workers": workers, "scene": summaries[0].get("scene", 1),
        "tasks": dict(sorted(sum((Counter(s.get("tasks", {})) for s in summaries), Counter()).items())),
    }  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dreamzero-record-demos", description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("--out", required=True, help="new dataset directory (absent or empty)")
    parser.add_argument("--episodes", type=int, default=50, help="successful episodes to keep (default: %(default)s)")
    parser.add_argument(
        "--seed", type=int, default=0, help="layout seed of the first attempt, then +1 each (default: %(default)s)"
    )
    parser.add_argument(
        "--image-size", type=int, nargs=2, default=(180, 320), metavar=("H", "W"),
        help="camera image height and width (default: 180 320)",
    )  # fmt: skip
    parser.add_argument(
        "--render-quality",
        choices=("quality", "fast"),
        default="quality",
        help="renderer setting (default: %(default)s)",
    )
    parser.add_argument(
        "--scene",
        type=int,
        choices=(1, table2.SCENE_ID),
        default=1,
        help=f"1: the cube into the bowl; {table2.SCENE_ID}: two objects, two targets, four instructions "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--instruction",
        "--instructions",
        dest="instruction",
        choices=(*table2.INSTRUCTIONS, table2.ALL),
        default=None,
        help=f"scene {table2.SCENE_ID}: one instruction, or 'all' for one per episode from its seed, balanced "
        "(default: all)",
    )
    parser.add_argument(
        "--layouts",
        choices=sorted(LAYOUTS),
        default=None,
        help="scene 1: cube / bowl placement ranges (default: wide)",
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="recorder processes, seed ranges 10000 apart (default: %(default)s)"
    )
    parser.add_argument(
        "--detours", type=float, default=0.0, metavar="P",
        help="probability of each detour (a via point before the cube, one before the bowl) per episode "
        "(default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--video", choices=sorted(VIDEO_ENCODINGS), default="standard",
        help="H.264 encoding: standard (yuv420p, lossy) or lossless (yuv444p CRF 0, ~2.5x larger; frames as rendered) "
        "(default: %(default)s)",
    )  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        summary = _run(args)
    except DreamZeroError as exc:  # a configuration error: one line, as argparse's own, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


def _run(args) -> dict:
    if args.workers < 1:
        raise ConfigError(f"--workers: expected >= 1, got {args.workers}")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):  # refuse before minutes of recording, not after
        raise ConfigError(f"--out: {out} exists and is not an empty directory; pick a new one")
    if args.workers > 1:
        shared = ["--image-size", *map(str, args.image_size), "--render-quality", args.render_quality]
        shared += ["--scene", str(args.scene), "--detours", str(args.detours), "--video", args.video]
        shared += ["--layouts", args.layouts] if args.layouts else []
        shared += ["--instruction", args.instruction] if args.instruction else []
        return record_in_parallel(args.out, args.episodes, args.seed, args.workers, shared)
    return record_demos(
        args.out,
        args.episodes,
        args.seed,
        tuple(args.image_size),
        args.render_quality,
        layouts=args.layouts,
        detours=args.detours,
        video=args.video,
        scene=args.scene,
        instruction=args.instruction,
    )


if __name__ == "__main__":
    raise SystemExit(main())
