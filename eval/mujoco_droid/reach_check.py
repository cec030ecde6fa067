"""Where does a policy send the tool? A teacher-forced check on recorded demonstrations, without a simulation.

`python -m eval.mujoco_droid.reach_check --model-path <checkpoint or embedded:name> --dataset <demos> --episodes 30:50`
(`--pipeline '{"sigma_shift": 12.0}'` screens inference-loop knobs the same way)

For each episode, one session asks the policy for chunk 1 at frame 0 and chunk 2 at frame 24, fed exactly what the
DROID client sends (the first frame, then frames 1, 8, 16, 24 with the state at 24: the expert's, not the policy's)
and the episode's own instruction (its LeRobot task: in scene 4 it names the object and the target).
Each chunk's last joint target goes through the arm's forward kinematics and is compared with the expert's target at
the same step. Per chunk it prints JSON: the mean horizontal error (cm) against the error of always answering the
mean expert endpoint, the correlation and slope of predicted on expert endpoint per axis, and the mean offset.
Chunk 1 starts from the same home pose in every layout, so only the images (and in scene 4 the words) can place it;
on scene-4 recordings each chunk also says how often its endpoint is nearer the object the instruction names than the
other object (`named_object_closer`, the policy's and the expert's count). Chunk 2 shows whether the
policy follows the state it is given (episodes recorded with `--detours` report separately: there the state after
chunk 1 does not point at the cube). It takes about a second per episode on a CPU, against minutes for a closed-loop
episode, which is why checkpoints are screened with it before a served evaluation.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from dreamzero.cli_help import pipeline_overrides_arg
from dreamzero.errors import ConfigError
from dreamzero.lerobot_dataset import LeRobotDataset
from dreamzero.train.data import read_video

CAMERAS = ("exterior_image_1_left", "exterior_image_2_left", "wrist_image_left")
QUERY_FRAMES = {0: [0], 24: [1, 8, 16, 24]}  # what the DROID client sends at each chunk's start (frame offsets)


def _episode_range(text: str, total: int) -> range:
    try:
        lo, hi = (int(v) for v in text.split(":"))
    except ValueError:
        raise ConfigError(f"episodes: expected START:STOP, got {text!r}") from None
    if not 0 <= lo < hi <= total:
        raise ConfigError(f"episodes: {text!r} is outside the dataset's {total} episodes")
    return range(lo, hi)


def _stats(pred: np.ndarray, expert: np.ndarray) -> dict:
    err = np.linalg.norm(pred[:, :2] - expert[:, :2], axis=1).mean()
    const = np.linalg.norm(expert[:, :2] - expert[:, :2].mean(0), axis=1).mean()

    def per_axis(fn):
        return [round(float(fn(i)), 2) if np.ptp(expert[:, i]) > 0 and np.ptp(pred[:, i]) > 0 else None for i in (0, 1)]

    return {
        "episodes": len(pred),
        "error_cm": round(float(err) * 100, 2),
        "constant_error_cm": round(float(const) * 100, 2),
        "corr_xy": per_axis(lambda i: np.corrcoef(pred[:, i], expert[:, i])[0, 1]),
        "slope_xy": per_axis(lambda i: np.polyfit(expert[:, i], pred[:, i], 1)[0]),
        "offset_cm_xy": [round(float(v) * 100, 2) for v in (pred[:, :2] - expert[:, :2]).mean(0)],
    }


def reach_check(policy_for: Callable[[int], object], dataset_root: str | Path, episodes: Sequence[int]) -> list[dict]:
    """Stats per chunk (1, 2) and group ("all", and "detour" / "straight" when both have 3+ episodes).

    policy_for(episode) -> an object with the policy interface (`infer(observation, session_id, instructions=, reset=,
    seed=)`).
    """
    import mujoco

    from eval.mujoco_droid.env import MujocoDroidEnv

    root = Path(dataset_root)
    dataset = LeRobotDataset(root)
    layouts_file = root / "meta" / "layouts.json"
    layouts = {r["episode_index"]: r for r in json.loads(layouts_file.read_text())} if layouts_file.is_file() else {}
    env = MujocoDroidEnv(1, image_size=(32, 48), render_quality="fast")

    def tcp(joints) -> np.ndarray:
        env.data.qpos[env._arm_qpos] = np.asarray(joints)[:7]
        mujoco.mj_kinematics(env.model, env.data)
        return env.data.site("tcp").xpos.copy()

    rows = []
    try:
        tasks = dataset.tasks()
        for ep in episodes:
            cols = dataset.episode_columns(ep, ["observation.state", "action", "task_index"])
            state, action = cols["observation.state"], cols["action"]
            instruction = tasks[int(cols["task_index"][0, 0])]
            if len(action) < 48:
                raise ConfigError(f"episodes: episode {ep} has {len(action)} steps, the check needs 48")
            videos = {c: read_video(root / "videos" / f"observation.images.{c}" / "chunk-000" / f"file-{ep:03d}.mp4")
                      for c in CAMERAS}  # fmt: skip
            policy, ends = policy_for(ep), []
            for k, (t, frames) in enumerate(QUERY_FRAMES.items()):
                obs = {f"video.{c}": videos[c][frames[0]] if len(frames) == 1 else videos[c][frames] for c in CAMERAS}
                obs["state.joint_position"] = state[t, :7].astype(np.float64)
                obs["state.gripper_position"] = state[t, 7:8].astype(np.float64)
                reply = policy.infer(obs, f"episode-{ep}", instructions=instruction, reset=k == 0, seed=0)
                chunk = np.asarray(reply.actions)
                ends.append((tcp(chunk[23]), tcp(action[t + 23])))
            layout = layouts.get(ep, {})
            rows.append((layout.get("detour_reach_xy") is not None, ends, _named_and_other(layout, instruction)))
    finally:
        env.close()
    out = []
    for chunk in range(len(QUERY_FRAMES)):
        groups = {"all": rows, "detour": [r for r in rows if r[0]], "straight": [r for r in rows if not r[0]]}
        for name, members in groups.items():
            if name != "all" and (len(members) < 3 or len(members) == len(rows)):
                continue
            pred = np.array([r[1][chunk][0] for r in members])
            expert = np.array([r[1][chunk][1] for r in members])
            row = {"chunk": chunk + 1, "group": name, **_stats(pred, expert)}
            if named := [(r[1][chunk], r[2]) for r in members if r[2] is not None]:
                # scene 4: how often the endpoint is nearer the object the words name than the other one
                closer = [[bool(np.linalg.norm(e[:2] - a) < np.linalg.norm(e[:2] - b)) for e in ends]
                          for ends, (a, b) in named]  # fmt: skip
                row["named_object_closer"] = {"policy": sum(c[0] for c in closer), "expert": sum(c[1] for c in closer),
                                              "episodes": len(named)}  # fmt: skip
            out.append(row)
    return out


def _named_and_other(layout: dict, instruction: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(xy of the object the instruction names, xy of the other) where the layout places both (scene 4), else None."""
    from eval.mujoco_droid.table2 import INSTRUCTIONS, task_for

    if instruction not in INSTRUCTIONS:
        return None
    task = task_for(instruction)
    named, other = layout.get(f"{task.object_name}_xy"), layout.get(f"{task.other_object}_xy")
    return None if named is None or other is None else (np.asarray(named), np.asarray(other))


class ExpertThroughBounds:
    """The recorded expert (a ReplayPolicy) with its joint deltas sent through an embodiment's action normalisation."""

    def __init__(self, replay, embodiment):
        self.replay, self.norm = replay, embodiment.action_normalisers["action.joint_position"]

    def infer(self, observation: dict, session_id: str, instructions=None, reset=False, seed: int | None = None):
        result = self.replay.infer(observation, session_id, instructions=instructions, reset=reset, seed=seed)
        actions = np.array(result.actions, np.float64)
        joints = np.asarray(observation["state.joint_position"], np.float64)
        actions[:, :7] = joints + self.norm.unnormalise(self.norm.normalise(actions[:, :7] - joints))
        return type("Chunk", (), {"actions": actions})()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eval.mujoco_droid.reach_check", description=__doc__.split("\n\n")[0]
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--model-path", help="checkpoint folder or embedded:<name>")
    which.add_argument(
        "--expert-through", help="no model: the expert through this metadata.json's (or checkpoint's) action bounds"
    )
    parser.add_argument(
        "--pipeline",
        type=pipeline_overrides_arg,
        default=None,
        help="inference-loop overrides for --model-path, e.g. '{\"sigma_shift\": 12.0}' (screen knobs before shipping)",
    )
    parser.add_argument("--dataset", required=True, help="recorded demonstrations (use episodes the model never saw)")
    parser.add_argument("--episodes", default=None, help="START:STOP (default: all)")
    args = parser.parse_args(argv)
    if args.pipeline is not None and args.expert_through is not None:
        parser.error("--pipeline applies to --model-path only (the expert runs no inference loop)")
    import torch

    from dreamzero.embedded_default import resolve_model_path
    from dreamzero.policy import EmbeddedPolicy

    try:
        torch.set_num_threads(1)
        total = len(LeRobotDataset(args.dataset).episode_indices)
        episodes = _episode_range(args.episodes, total) if args.episodes else range(total)
        if args.expert_through is not None:
            from dreamzero.embodiments import get_embodiment
            from dreamzero.metadata import read_metadata_file
            from dreamzero.policy import ReplayPolicy

            embodiment = get_embodiment("oxe_droid", read_metadata_file(args.expert_through))

            def policy_for(ep):
                return ExpertThroughBounds(ReplayPolicy(args.dataset, ep, embodiment=embodiment), embodiment)
        else:
            policy = EmbeddedPolicy.load(resolve_model_path(args.model_path), overrides=args.pipeline)

            def policy_for(_ep):
                return policy

        for row in reach_check(policy_for, args.dataset, episodes):
            print(json.dumps(row))
        return 0
    except ConfigError as exc:  # a bad path, range or override: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
