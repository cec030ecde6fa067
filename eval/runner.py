"""The DROID evaluation loop: N episodes per scene against any `DroidEnv` through any `PolicyLink`.

Per episode: reset the env; every step hand the observation to the client runtime's `DroidPolicy` (which resizes
it to 180x320 and keeps the frame history); every `open_loop_horizon` steps (or when the chunk runs out) query it;
execute the chunk's rows open loop with DROID's gripper rule; stop at termination, truncation or the step limit;
judge success on the final object positions; reset the policy (the server forgets the session, the next episode gets
a new id). A policy failure ends the episode, is recorded with its reason, and the run goes on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dreamzero.errors import ConfigError
from dreamzero_client import droid
from dreamzero_client.policy import DroidPolicy, PolicyCallError
from eval.env_contract import DroidEnv, check_droid_observation
from eval.recording import EpisodeRecorder, to_jsonable
from eval.summary import summarize, summary_markdown


@dataclass
class EvalConfig:
    out_dir: Path
    scenes: tuple[int, ...] = (1,)
    episodes_per_scene: int = 1
    open_loop_horizon: int = 8
    max_steps: int | None = None  # None: the env's own limit (450 = 30 s on DROID)
    seed: int = 0
    record_video: bool = True
    image_size: tuple[int, int] = droid.IMAGE_HW  # of the recorded video frames
    extra: dict = field(default_factory=dict)  # free-form facts recorded in run.json (simulator, link, ...)

    def validate(self) -> None:
        if not self.scenes:
            raise ConfigError("scenes: expected at least one scene")
        if self.episodes_per_scene < 1:
            raise ConfigError(f"episodes_per_scene: expected >= 1, got {self.episodes_per_scene}")
        if self.open_loop_horizon < 1:
            raise ConfigError(f"open_loop_horizon: expected >= 1, got {self.open_loop_horizon}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps: expected >= 1 or None, got {self.max_steps}")


def run_episode(env: DroidEnv, policy: DroidPolicy, config: EvalConfig, episode: int, progress=None) -> dict:
    """One episode; returns its record (also written to `<out_dir>/episodes/<name>.json`)."""
    scene = env.scene_id
    name = f"scene{scene}_ep{episode:03d}"
    session_id = policy.session_id
    seed = config.seed + 1000 * scene + episode
    max_steps = min(config.max_steps or env.max_episode_steps, env.max_episode_steps)
    recorder = EpisodeRecorder(
        config.out_dir, name, fps=env.control_hz, record_video=config.record_video, frame_size=config.image_size
    )
    started = time.perf_counter()
    latencies_ms: list[float] = []
    failure = None
    reset_error = None
    sessions: list[dict] = []
    restarts: list[dict] = []
    steps = 0
    terminated = truncated = False
    try:
        obs, _ = env.reset(seed=seed)
        check_droid_observation(obs)
        recorder.add_frame(obs)
        chunk: np.ndarray | None = None
        row = 0
        while steps < max_steps:
            queried, latency_ms = False, None
            if chunk is None or row >= min(config.open_loop_horizon, len(chunk)):
                try:
                    reply = policy.infer({**obs, "prompt": env.instruction})
                except PolicyCallError as exc:
                    failure = {"reason": exc.reason, "message": exc.detail, "step": steps}
                    break
                chunk, row, queried, latency_ms = reply.actions, 0, True, reply.latency_ms
                latencies_ms.append(latency_ms)
                if reply.session:
                    sessions.append(reply.session)
                if reply.restarted:
                    restarts.append({"step": steps, "reason": reply.restarted})
            else:
                policy.observe(obs)
            action = chunk[row].copy()
            action[7] = droid.binarize_gripper(chunk[row][7])
            obs, reward, terminated, truncated, info = env.step(action)
            check_droid_observation(obs)
            recorder.add_frame(obs)
            recorder.add_step(
                {
                    "step": steps,
                    "queried": queried,
                    "chunk_latency_ms": latency_ms,
                    "chunk_row": row,
                    "action": action,
                    "raw_gripper": float(chunk[row][7]),
                    "joint_position": np.asarray(obs["joint_position"], dtype=np.float64),
                    "gripper_position": np.asarray(obs["gripper_position"], dtype=np.float64),
                    "reward": float(reward),
                    "terminated": bool(terminated),
                    "truncated": bool(truncated),
                    "object_poses": env.object_poses(),
                }
            )
            row += 1
            steps += 1
            if progress is not None:
                progress.update(1)
            if terminated or truncated:
                break
    finally:
        recorder.close()
        try:
            policy.reset()
        except PolicyCallError as exc:  # the episode's result stands; the failed reset is noted
            reset_error = str(exc)
    success = failure is None and env.is_success()
    if progress is not None:
        progress.update(max_steps - steps)  # skipped steps of an episode that ended early
    record = {
        "name": name,
        "scene_id": scene,
        "episode": episode,
        "instruction": env.instruction,
        "session_id": session_id,
        "seed": seed,
        "success": bool(success),
        "num_steps": steps,
        "max_steps": max_steps,
        "terminated": bool(terminated),
        "truncated": bool(truncated),
        "server_calls": len(latencies_ms),
        "latencies_ms": latencies_ms,
        "failure": failure,
        "reset_error": reset_error,
        "final_object_poses": env.object_poses(),
        "server_sessions": sessions,
        "session_restarts": restarts,  # the server lost the session's state mid-episode
        "video": str(recorder.video_path.relative_to(config.out_dir)) if recorder.video_path else None,
        "wall_s": time.perf_counter() - started,
    }
    record["record"] = str(recorder.write_json(record).relative_to(config.out_dir))
    return record


def run_evaluation(
    env_factory: Callable[[int], DroidEnv], policy: DroidPolicy, config: EvalConfig, show_progress: bool = False
) -> dict:
    """Run every scene's episodes, write `summary.json`, `summary.md` and `run.json`; return the summary.

    `env_factory(scene_id)` builds the env of one scene; it is closed before the next scene's env is built.
    """
    from tqdm import tqdm

    config.validate()
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    episodes: list[dict] = []
    total = None if config.max_steps is None else len(config.scenes) * config.episodes_per_scene * config.max_steps
    with tqdm(total=total, unit="step", desc="DROID eval", disable=not show_progress, dynamic_ncols=True) as bar:
        for scene in config.scenes:
            env = env_factory(scene)
            try:
                for ep in range(config.episodes_per_scene):
                    bar.set_postfix_str(f"scene {scene} ep {ep}")
                    episodes.append(run_episode(env, policy, config, ep, progress=bar))
                    bar.set_postfix_str(f"scene {scene} ep {ep}: {'success' if episodes[-1]['success'] else 'fail'}")
            finally:
                env.close()
    summary = summarize(episodes)
    summary["config"] = to_jsonable({k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()})
    summary["policy_link"] = getattr(policy, "name", type(policy).__name__)
    summary["episode_records"] = [
        {k: ep[k] for k in ("name", "scene_id", "episode", "success", "num_steps", "video", "record", "failure")}
        for ep in episodes
    ]
    (out / "summary.json").write_text(json.dumps(to_jsonable(summary), indent=1))
    (out / "summary.md").write_text(summary_markdown(summary))
    return summary
