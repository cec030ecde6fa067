"""Fakes for the LIBERO eval tests: a picklable backend whose envs speak robosuite's observation dict, a client
answering fixed chunks (`FakeClient`), and the evaluation's config for them (`libero_config`).

Lives in its own light module so spawned env workers can import it without pytest. The fake env's scene is a point
that moves by the action's first 3 dims; a task succeeds once the point's x passes `goal_x`. Its images are upside
down the way LIBERO's renderer delivers them: the marker row the flip must bring to the top is at the bottom.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from eval.libero.env import TaskInfo

FORK = "fork"  # fast worker start in tests; one test covers the default (spawn)
SIDE = 16
MARKER = 200  # value of the bottom-right pixel of a raw image: after the 180-degree turn it is the top-left one


def raw_image(value: int) -> np.ndarray:
    img = np.full((SIDE, SIDE, 3), value, dtype=np.uint8)
    img[-1, -1] = MARKER
    return img


@dataclass
class FakeEnv:
    instruction: str
    task_id: int
    goal_x: float
    hang_at_step: int | None = None
    crash_at_step: int | None = None
    pos: np.ndarray = field(default_factory=lambda: np.zeros(3))
    steps: int = 0

    def _obs(self) -> dict:
        return {
            "agentview_image": raw_image(10 + self.task_id),
            "robot0_eye_in_hand_image": raw_image(100 + self.task_id),
            "robot0_eef_pos": self.pos.copy(),
            "robot0_eef_quat": np.array([0.0, 0.0, 0.0, 1.0]),
            "robot0_gripper_qpos": np.array([0.04, -0.04]),
            "robot0_joint_pos": np.arange(7, dtype=np.float64),
        }

    def reset(self, init_index: int) -> dict:
        self.pos = np.array([0.0, 0.01 * init_index, 0.0])
        self.steps = 0
        return self._obs()

    def step(self, action) -> dict:
        action = np.asarray(action, dtype=np.float64)
        if action.shape != (7,):
            raise ValueError(f"action: expected 7 values, got {action.shape}")
        if self.hang_at_step is not None and self.steps == self.hang_at_step:
            time.sleep(3600)
        if self.crash_at_step is not None and self.steps == self.crash_at_step:
            raise RuntimeError("simulated MuJoCo instability")
        self.pos = self.pos + 0.1 * action[:3]
        self.steps += 1
        return self._obs()

    def is_success(self) -> bool:
        return bool(self.pos[0] >= self.goal_x)

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class FakeBackend:
    suite: str = "libero_spatial"
    num_tasks: int = 2
    num_init_states: int = 3
    goal_x: float = 0.25
    hang: tuple[int, int] | None = None  # (task id, step) at which that task's env hangs
    crash: tuple[int, int] | None = None  # (task id, step) at which that task's env raises

    def tasks(self) -> list[TaskInfo]:
        return [TaskInfo(i, f"put bowl {i} on the plate", self.num_init_states) for i in range(self.num_tasks)]

    def make(self, task_id: int) -> FakeEnv:
        hang = self.hang[1] if self.hang and self.hang[0] == task_id else None
        crash = self.crash[1] if self.crash and self.crash[0] == task_id else None
        return FakeEnv(f"put bowl {task_id} on the plate", task_id, self.goal_x, hang, crash)


@dataclass
class FakeClient:
    """Answers every row with the same 16-action chunk: +x (task 0 succeeds after 3 steps) or still (task 1)."""

    fail_calls: dict = field(default_factory=dict)  # call number -> exception to raise
    calls: list = field(default_factory=list)
    forgotten: list = field(default_factory=list)

    def generate(self, observation, prompts, session_ids, form="raw", reset=None, seed=None, **kw):
        images = observation["video.image"] if form == "raw" else observation["images"]
        self.calls.append(
            {
                "ids": list(session_ids),
                "reset": list(reset),
                "form": form,
                "prompts": list(prompts),
                "t": images.shape[1],
            }
        )
        if len(self.calls) in self.fail_calls:
            raise self.fail_calls[len(self.calls)]
        b = len(session_ids)
        actions = np.zeros((b, 16, 7 if form == "raw" else 32), dtype=np.float32)
        for i, prompt in enumerate(prompts):
            if "bowl 0" in prompt:
                actions[i, :, 0] = 1.0
        sessions = [{"session_id": sid, "step": 1, "restarted": r} for sid, r in zip(session_ids, reset)]
        return type("Result", (), {"actions": actions, "sessions": sessions})()

    def forget_sessions(self, ids):
        self.forgotten.append(ids)


def libero_config(tmp_path, **kw):
    """A `LiberoEvalConfig` for the fake envs: 3 envs, 12 steps, 4-action chunks, no video, forked workers."""
    from eval.libero.runner import LiberoEvalConfig

    base = dict(
        out_dir=tmp_path, num_envs=3, max_steps=12, action_chunk=4, settle_steps=1, record_video=False,
        step_timeout_s=20.0, reset_timeout_s=60.0, start_method=FORK,
    )  # fmt: skip
    return LiberoEvalConfig(**{**base, **kw})
