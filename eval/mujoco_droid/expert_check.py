"""How often does the scripted expert succeed on scene 4? Seeded episodes per instruction, no recording.

`python -m eval.mujoco_droid.expert_check --episodes 40 --seed 0` prints one JSON line per instruction (episodes,
successes, wrong_object, wrong_target, the seeds that failed) and one for all of them. Episode k of an instruction
uses layout seed `seed + k`, so the four instructions see the same layouts. Rendering is the smallest the env allows
(the expert reads poses, not pixels), about a second per episode on one CPU core.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import numpy as np

from dreamzero.errors import ConfigError
from eval.mujoco_droid import table2

HOLD_STEPS = 6  # as the recorder: the object has settled when the verdict is read


def run_expert(env, seed: int, detours: float = 0.0) -> dict:
    """One expert episode on `env` (a MujocoDroidEnv on scene 4) from `seed`, detours drawn as the recorder draws
    them; its `outcome()` at the end."""
    from eval.mujoco_droid.expert import SCENE4_RANGE, ScriptedExpert, sample_detours

    via = sample_detours(np.random.default_rng([seed, 1]), SCENE4_RANGE, detours)
    env.reset(seed=seed)
    expert = ScriptedExpert(env)
    expert.reset(via)
    for _ in range(min(expert.planned_steps + HOLD_STEPS, env.max_episode_steps)):
        env.step(expert.act())
    return env.outcome()


def expert_check(
    episodes: int, seed: int = 0, instructions: Sequence[str] = table2.INSTRUCTIONS, detours: float = 0.0
) -> list[dict]:
    from eval.mujoco_droid.env import MujocoDroidEnv

    if episodes < 1:
        raise ConfigError(f"episodes: expected >= 1, got {episodes}")
    rows, totals = [], {"episodes": 0, "successes": 0, "wrong_object": 0, "wrong_target": 0}
    for instruction in instructions:
        env = MujocoDroidEnv(
            table2.SCENE_ID, image_size=(16, 16), render_quality="fast", max_episode_steps=400, instruction=instruction
        )
        try:
            outcomes = [(s, run_expert(env, s, detours)) for s in range(seed, seed + episodes)]
        finally:
            env.close()
        row = {
            "instruction": instruction,
            "episodes": episodes,
            "successes": sum(o["success"] for _, o in outcomes),
            "wrong_object": sum(o["wrong_object"] for _, o in outcomes),
            "wrong_target": sum(o["wrong_target"] for _, o in outcomes),
            "failed_seeds": [s for s, o in outcomes if not o["success"]],
        }
        rows.append(row)
        for key in totals:
            totals[key] += row[key]
    return [*rows, {"instruction": "all", **totals}]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eval.mujoco_droid.expert_check", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--episodes", type=int, default=40, help="episodes per instruction (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="layout seed of the first episode (default: %(default)s)")
    parser.add_argument(
        "--instruction", choices=table2.INSTRUCTIONS, default=None, help="one instruction (default: all four)"
    )
    parser.add_argument(
        "--detours", type=float, default=0.0, metavar="P", help="detour probability, as the recorder's (default: 0)"
    )
    args = parser.parse_args(argv)
    try:
        chosen = [args.instruction] if args.instruction else table2.INSTRUCTIONS
        rows = expert_check(args.episodes, args.seed, chosen, args.detours)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
