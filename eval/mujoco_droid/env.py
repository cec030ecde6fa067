"""`MujocoDroidEnv`: the local DROID-like scene as a gymnasium env that follows `eval.env_contract`.

Control matches DROID's: 15 Hz absolute joint targets for the 7 arm joints (position actuators, gravity compensated)
plus a gripper command in [0, 1] (1 closed). Observations carry the same keys as the Isaac Lab sim-evals adapter.
Rendering is headless (set MUJOCO_GL=egl before mujoco is imported; this module sets it when unset).
"""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")

import gymnasium as gym
import mujoco
import numpy as np

from dreamzero.errors import ConfigError
from eval.env_contract import IMAGE_KEYS
from eval.mujoco_droid import table2
from eval.mujoco_droid.scene import (
    ARM_JOINTS,
    CONTROL_HZ,
    FINGER_JOINTS,
    FINGER_OPEN_M,
    HOME_QPOS,
    SUBSTEPS,
    build_scene,
    scene_spec,
)
from eval.success import LIFTED_M, placed_in, placement_outcome

RENDER_QUALITIES = ("quality", "fast")
#: our camera names, in the order of IMAGE_KEYS
_CAMERAS = ("exterior_cam_0", "exterior_cam_1", "wrist_cam")
_GRIPPER_CTRL_OPEN = 255.0  # franky-sim's hand actuator: 255 = open, 0 = closed


class MujocoDroidEnv(gym.Env):
    """DROID scene 1, 2, 3 or 4 on MuJoCo (CPU). See `eval.env_contract` for the observation / action layout.

    Scene 4 (`table2`) holds two objects and two targets: `instruction` picks one of its four instructions, or
    None / "all" draws one per episode from the reset seed; `task_object` / `task_target` name the episode's pair.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": CONTROL_HZ}

    def __init__(
        self,
        scene_id: int = 1,
        image_size: tuple[int, int] = (180, 320),
        render_quality: str = "quality",
        max_episode_steps: int = 450,
        object_jitter_m: float = 0.02,
        terminate_on_success: bool = False,
        render_mode: str | None = None,
        layouts: str | None = None,
        instruction: str | None = None,
    ):
        if render_quality not in RENDER_QUALITIES:
            raise ConfigError(f"render_quality: expected one of {RENDER_QUALITIES}, got {render_quality!r}")
        if max_episode_steps < 1:
            raise ConfigError(f"max_episode_steps: expected >= 1, got {max_episode_steps}")
        height, width = (int(v) for v in image_size)
        if not (16 <= height <= 720 and 16 <= width <= 1280):
            raise ConfigError(f"image_size: expected (H, W) within (16..720, 16..1280), got {image_size}")
        if render_mode not in (None, "rgb_array"):
            raise ConfigError(f"render_mode: expected None or 'rgb_array', got {render_mode!r}")
        if layouts is not None:
            from eval.mujoco_droid.expert import layout_range

            layout_range(layouts)  # a bad name fails here, naming the known ones
            if scene_id != 1:
                raise ConfigError(f"layouts: the sampled layouts are scene 1's (cube -> bowl), got scene {scene_id}")
        self.scene = scene_spec(scene_id)
        if scene_id == table2.SCENE_ID:
            self._instruction_choice = table2.check_instruction_choice(instruction)
        elif instruction is not None and instruction != self.scene.instruction:
            raise ConfigError(
                f"instruction: scene {scene_id} has one, {self.scene.instruction!r}; the instructions are scene "
                f"{table2.SCENE_ID}'s, got {instruction!r}"
            )
        # None: the scene's fixed positions + jitter; a `expert.LAYOUTS` name: the demonstrations' layout distribution,
        # drawn from the reset seed as `dreamzero-record-demos` draws it (disjoint seeds = held-out layouts)
        self.layouts = layouts
        self.scene_id = scene_id
        self.instruction = self.scene.instruction
        self.task_object, self.task_target = self.scene.object_name, self.scene.target_name
        self.control_hz = CONTROL_HZ
        self.max_episode_steps = max_episode_steps
        self.render_mode = render_mode
        self._jitter = float(object_jitter_m)
        self._terminate_on_success = terminate_on_success

        # 1. Model, data and index lookups
        self.model = build_scene(scene_id)
        self.data = mujoco.MjData(self.model)
        self._arm_qpos = np.array([self.model.joint(j).qposadr[0] for j in ARM_JOINTS])
        self._finger_qpos = np.array([self.model.joint(j).qposadr[0] for j in FINGER_JOINTS])
        self._bodies = {name: self.model.body(name).id for name in self.scene.bodies}
        self._free_qpos = {name: self.model.joint(f"{name}_free").qposadr[0] for name in self.scene.bodies}
        self._start_z: dict[str, float] = {}
        # objects whose centre of mass rose LIFTED_M above its start this episode (the centre, not the base: a can or
        # cube knocked over raises its base, not its centre)
        self._lifted: set[str] = set()
        lo, hi = self.model.jnt_range[[self.model.joint(j).id for j in ARM_JOINTS]].T
        self.joint_low, self.joint_high = lo.copy(), hi.copy()

        # 2. Spaces
        self.action_space = gym.spaces.Box(
            low=np.append(lo, 0.0).astype(np.float32), high=np.append(hi, 1.0).astype(np.float32), dtype=np.float32
        )
        image = gym.spaces.Box(0, 255, shape=(height, width, 3), dtype=np.uint8)
        self.observation_space = gym.spaces.Dict(
            {
                **{key: image for key in IMAGE_KEYS},
                # joints can overshoot their limits by a hair under contact, so the bound is loose
                "joint_position": gym.spaces.Box(-2 * np.pi, 2 * np.pi, shape=(7,), dtype=np.float32),
                "gripper_position": gym.spaces.Box(0.0, 1.0, shape=(1,), dtype=np.float32),
            }
        )

        # 3. Renderer: "fast" draws collision geometry only, no multisampling (CI); "quality" draws the meshes
        self.model.vis.quality.offsamples = 0 if render_quality == "fast" else 4
        self._renderer = mujoco.Renderer(self.model, height=height, width=width)
        self._scene_option = mujoco.MjvOption()
        if render_quality == "fast":
            self._scene_option.geomgroup[2] = 0  # visual meshes off
            self._scene_option.geomgroup[3] = 1  # collision meshes on
        self._renderer.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
        self._renderer.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
        self._steps = 0

    # -- gymnasium API -----------------------------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        mujoco.mj_resetData(self.model, self.data)
        self.data.qpos[self._arm_qpos] = HOME_QPOS
        self.data.qpos[self._finger_qpos] = FINGER_OPEN_M
        placements, jitter_m = (
            ((self.scene.object_name, self.scene.object_xy), (self.scene.target_name, self.scene.target_xy)),
            self._jitter,
        )
        if self.scene_id == table2.SCENE_ID:
            rng = np.random.default_rng(seed) if seed is not None else self.np_random
            task = table2.episode_instruction(
                seed if seed is not None else int(rng.integers(2**31)), self._instruction_choice
            )
            self.instruction, self.task_object, self.task_target = task.instruction, task.object_name, task.target_name
            placements, jitter_m = tuple(table2.sample_layout(rng).items()), 0.0
        elif self.layouts is not None:
            from eval.mujoco_droid.expert import sample_layout

            rng = np.random.default_rng(seed) if seed is not None else self.np_random
            layout = sample_layout(rng, self.layouts)
            placements = ((self.scene.object_name, layout.object_xy), (self.scene.target_name, layout.target_xy))
            jitter_m = 0.0
        for name, xy in placements:
            adr = self._free_qpos[name]
            jitter = self.np_random.uniform(-jitter_m, jitter_m, size=2) if jitter_m > 0 else np.zeros(2)
            self.data.qpos[adr : adr + 3] = [xy[0] + jitter[0], xy[1] + jitter[1], 0.0]
            self.data.qpos[adr + 3 : adr + 7] = [1.0, 0.0, 0.0, 0.0]
        self.data.ctrl[:7] = HOME_QPOS
        self.data.ctrl[7] = _GRIPPER_CTRL_OPEN
        mujoco.mj_forward(self.model, self.data)
        self._steps = 0
        self._start_z = {name: float(self.data.xipos[bid][2]) for name, bid in self._bodies.items()}
        self._lifted = set()
        return self._observation(), self._info()

    def step(self, action):
        action = np.asarray(action, dtype=np.float64).reshape(-1)
        if action.shape != (8,) or not np.all(np.isfinite(action)):
            raise ConfigError(f"action: expected 8 finite floats (7 joint targets + gripper), got {action.shape}")
        self.data.ctrl[:7] = np.clip(action[:7], self.joint_low, self.joint_high)
        self.data.ctrl[7] = _GRIPPER_CTRL_OPEN * (1.0 - float(np.clip(action[7], 0.0, 1.0)))
        mujoco.mj_step(self.model, self.data, nstep=SUBSTEPS)
        self._steps += 1
        for name, bid in self._bodies.items():  # sampled once per control step: a grasp holds for many
            if self.data.xipos[bid][2] - self._start_z.get(name, 0.0) > LIFTED_M:
                self._lifted.add(name)
        success = self.is_success()
        terminated = bool(success and self._terminate_on_success)
        truncated = self._steps >= self.max_episode_steps
        return self._observation(), float(success), terminated, truncated, self._info(success)

    def render(self):
        if self.render_mode != "rgb_array":
            return None
        images = self._images()
        return np.concatenate([images[k] for k in IMAGE_KEYS], axis=1)

    def close(self):
        if getattr(self, "_renderer", None) is not None:
            self._renderer.close()
            self._renderer = None

    # -- DROID contract extras ---------------------------------------------------------------------------------------
    def object_poses(self) -> dict[str, np.ndarray]:
        return {
            name: np.concatenate([self.data.xpos[bid], self.data.xquat[bid]]).astype(np.float64)
            for name, bid in self._bodies.items()
        }

    def is_success(self) -> bool:
        poses = self.object_poses()
        return placed_in(poses[self.task_object], poses[self.task_target])

    def outcome(self) -> dict | None:
        """Scene 4: the episode's instruction and verdict so far (`eval.success.placement_outcome`: success,
        wrong_object, wrong_target); None on the one-object scenes, whose verdict is `is_success`."""
        if self.scene.other_object is None:
            return None
        task = table2.task_for(self.instruction)
        verdict = placement_outcome(
            self.object_poses(),
            task.object_name,
            task.target_name,
            task.other_object,
            task.other_target,
            other_lifted=task.other_object in self._lifted,
        )
        return {"instruction": self.instruction, "object": task.object_name, "target": task.target_name, **verdict}

    def tcp_position(self) -> np.ndarray:
        """Tool centre point in the base frame (the base sits at the world origin)."""
        return self.data.site("tcp").xpos.copy()

    # -- internals ---------------------------------------------------------------------------------------------------
    def _images(self) -> dict[str, np.ndarray]:
        images = {}
        for key, cam in zip(IMAGE_KEYS, _CAMERAS):
            self._renderer.update_scene(self.data, camera=cam, scene_option=self._scene_option)
            images[key] = self._renderer.render().copy()
        return images

    def _observation(self) -> dict[str, np.ndarray]:
        fingers = self.data.qpos[self._finger_qpos].sum() / (2 * FINGER_OPEN_M)  # 1 open .. 0 closed
        return {
            **self._images(),
            "joint_position": self.data.qpos[self._arm_qpos].astype(np.float32),
            "gripper_position": np.array([np.clip(1.0 - fingers, 0.0, 1.0)], dtype=np.float32),
        }

    def _info(self, success: bool | None = None) -> dict:
        return {
            "scene_id": self.scene_id,
            "success": self.is_success() if success is None else success,
            "step": self._steps,
        }
