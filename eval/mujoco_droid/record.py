"""`dreamzero-record-demos`: record scripted-expert demonstrations of scene 1 as a LeRobot v3.0 dataset.

Each episode: a random layout (`expert.sample_layout`), the expert runs its plan plus a short hold at 15 Hz, and the
episode is kept only if the cube ended in the bowl (failed ones are counted and reported, never written). Columns use
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
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dreamzero.errors import ConfigError
from eval.env_contract import IMAGE_KEYS
from eval.mujoco_droid.expert import ScriptedExpert, reset_with_layout, sample_layout
from eval.mujoco_droid.lerobot_writer import Episode, write_dataset

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


def record_episode(env, expert: ScriptedExpert, seed: int) -> tuple[Episode, bool]:
    """One expert episode from layout seed `seed`; returns it and whether the cube ended in the bowl."""
    layout = sample_layout(np.random.default_rng(seed))
    obs = reset_with_layout(env, seed, layout)
    expert.reset()
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
        extra={"seed": seed, "object_xy": layout.object_xy, "target_xy": layout.target_xy},
    )
    return episode, bool(info["success"])


def record_demos(
    out: str | Path,
    num_episodes: int,
    seed: int = 0,
    image_size: tuple[int, int] = (180, 320),
    render_quality: str = "quality",
    max_attempts: int | None = None,
) -> dict:
    """Record `num_episodes` successful episodes under `out`; returns a summary (attempts, success rate, frames)."""
    from eval.mujoco_droid.env import MujocoDroidEnv

    if num_episodes < 1:
        raise ConfigError(f"episodes: expected >= 1, got {num_episodes}")
    max_attempts = max_attempts or 2 * num_episodes + 5
    env = MujocoDroidEnv(1, image_size=image_size, render_quality=render_quality, max_episode_steps=400)
    expert = ScriptedExpert(env)
    kept, attempts, t0 = [], 0, time.monotonic()
    try:
        while len(kept) < num_episodes:
            if attempts >= max_attempts:
                raise RuntimeError(f"only {len(kept)} of {attempts} expert episodes succeeded; stopping")
            episode, success = record_episode(env, expert, seed + attempts)
            attempts += 1
            log.info("episode seed %d: %d steps, success=%s", episode.extra["seed"], len(episode), success)
            if success:
                kept.append(episode)
    finally:
        env.close()
    root = write_dataset(out, kept, fps=env.control_hz, robot_type="franka_fr3_mujoco")
    (Path(root) / "meta" / "modality.json").write_text(json.dumps(MODALITY, indent=2))
    layouts = [{"episode_index": i, **e.extra} for i, e in enumerate(kept)]
    (Path(root) / "meta" / "layouts.json").write_text(json.dumps(layouts, indent=1))
    return {
        "episodes": len(kept), "attempts": attempts, "expert_success_rate": len(kept) / attempts,
        "frames": sum(len(e) for e in kept), "seconds": round(time.monotonic() - t0, 1), "root": str(root),
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dreamzero-record-demos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="new dataset directory")
    parser.add_argument("--episodes", type=int, default=50, help="successful episodes to keep")
    parser.add_argument("--seed", type=int, default=0, help="layout seed of the first attempt (then +1 each)")
    parser.add_argument("--image-size", type=int, nargs=2, default=(180, 320), metavar=("H", "W"))
    parser.add_argument("--render-quality", choices=("quality", "fast"), default="quality")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    summary = record_demos(args.out, args.episodes, args.seed, tuple(args.image_size), args.render_quality)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
