"""Adapter for the Isaac Lab DROID benchmark (`arhanjain/sim-evals`) behind `eval.env_contract`.

Isaac Lab 2.2 / Isaac Sim 5.0 need an NVIDIA RTX GPU; they are an optional extra, imported only when an env is made.
Two registration layouts exist and both are supported:
  - old: one id `DROID`; the scene is chosen on the config with `cfg.set_scene(1|2|3)`
  - new: one id per scene (`DROID-CubeInBowl`, `DROID-CanInMug`, `DROID-BananaInBin`), assets under
    `SIM_EVALS_ASSET_ROOT`
Observations `obs["policy"]` (batched, num_envs = 1): `external_cam`, `external_cam_2` (new layout only), `wrist_cam`
uint8 [1, H, W, 3]; `arm_joint_pos` [1, 7]; `gripper_pos` [1, 1] in [0, 1]. Actions: a float tensor [1, 8].
sim-evals has no success signal; success is the shared heuristic on the final object positions (`eval.success`).
The scene's object names inside the Isaac scene are configurable because they come from the USD assets.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from dreamzero.errors import ConfigError, InvalidObservation, MissingDependency
from eval.success import placed_in

INSTALL_HINT = (
    "The Isaac Lab DROID adapter needs Isaac Sim 5.0 + Isaac Lab 2.2 (NVIDIA RTX GPU, Python 3.11) and sim-evals:\n"
    "  pip install 'dreamzero-serve[isaac]'   # isaaclab[all,isaacsim]==2.2.0, see Isaac Lab's install guide\n"
    "  git clone https://github.com/arhanjain/sim-evals && pip install -e sim-evals\n"
    "  download the scene assets (huggingface.co/datasets/owhan/DROID-sim-environments) and export "
    "SIM_EVALS_ASSET_ROOT=<dir>\n"
    "Without a GPU, use the local MuJoCo scene instead: dreamzero-eval --sim mujoco"
)
LEGACY_ENV_ID = "DROID"


@dataclass(frozen=True)
class IsaacScene:
    scene_id: int
    env_id: str  # per-scene id of the new layout
    instruction: str
    object_name: str  # rigid-object names in the Isaac scene (override with object_names=...)
    target_name: str


SCENES: dict[int, IsaacScene] = {
    1: IsaacScene(1, "DROID-CubeInBowl", "put the cube in the bowl", "cube", "bowl"),
    2: IsaacScene(2, "DROID-CanInMug", "pick up the can and put it in the mug", "can", "mug"),
    3: IsaacScene(3, "DROID-BananaInBin", "put the banana in the bin", "banana", "bin"),
}


def _numpy(x: Any) -> np.ndarray:
    """torch tensor (any device) or array -> numpy."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def map_observation(obs: dict) -> dict[str, np.ndarray]:
    """sim-evals observation -> the DROID contract's keys (env 0 of the batch).

    A missing `external_cam_2` (old layout) becomes a black frame: DreamZero-DROID was trained with dropped views.
    """
    policy = obs.get("policy") if isinstance(obs, dict) else None
    if not isinstance(policy, dict):
        raise InvalidObservation("obs['policy']: missing; is this a sim-evals DROID env?", field="policy")

    def image(key: str) -> np.ndarray:
        if key not in policy:
            raise InvalidObservation(f"obs['policy']['{key}']: missing (keys: {sorted(policy)})", field=key)
        img = _numpy(policy[key])
        img = img[0] if img.ndim == 4 else img
        if img.ndim != 3 or img.shape[-1] not in (3, 4):
            raise InvalidObservation(f"obs['policy']['{key}']: expected [1, H, W, 3], got {list(img.shape)}", field=key)
        img = img[..., :3]
        if img.dtype != np.uint8:  # float renders in [0, 1] or [0, 255]
            scale = 255.0 if img.max(initial=0) <= 1.0 else 1.0
            img = np.clip(img * scale, 0, 255).astype(np.uint8)
        return np.ascontiguousarray(img)

    def vector(key: str, size: int) -> np.ndarray:
        if key not in policy:
            raise InvalidObservation(f"obs['policy']['{key}']: missing (keys: {sorted(policy)})", field=key)
        arr = _numpy(policy[key]).astype(np.float64).reshape(-1)
        if arr.size < size:
            raise InvalidObservation(f"obs['policy']['{key}']: expected {size} values, got {arr.size}", field=key)
        return arr[:size]

    ext0 = image("external_cam")
    ext1 = image("external_cam_2") if "external_cam_2" in policy else np.zeros_like(ext0)
    return {
        "exterior_image_0_left": ext0,
        "exterior_image_1_left": ext1,
        "wrist_image_left": image("wrist_cam"),
        "joint_position": vector("arm_joint_pos", 7),
        "gripper_position": np.clip(vector("gripper_pos", 1), 0.0, 1.0),
    }


class IsaacDroidEnv(gym.Env):
    """A sim-evals env (already made) behind the DROID env contract. Build real ones with `make_isaac_env`."""

    def __init__(
        self,
        env: Any,
        scene_id: int,
        max_episode_steps: int = 450,
        object_names: tuple[str, str] | None = None,
        warmup_resets: int = 1,
    ):
        if scene_id not in SCENES:
            raise ConfigError(f"scene: expected one of {sorted(SCENES)}, got {scene_id!r}")
        self.env = env
        self.scene = SCENES[scene_id]
        self.scene_id = scene_id
        self.instruction = self.scene.instruction
        self.control_hz = 15.0
        self.max_episode_steps = max_episode_steps
        self.object_name, self.target_name = object_names or (self.scene.object_name, self.scene.target_name)
        self.action_space = gym.spaces.Box(-np.pi * 2, np.pi * 2, shape=(8,), dtype=np.float32)
        self._warmup_resets = warmup_resets  # sim-evals loads materials on the second reset
        self._steps = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        for _ in range(self._warmup_resets):
            self.env.reset(seed=seed)
        self._warmup_resets = 0
        obs, info = self.env.reset(seed=seed)
        self._steps = 0
        return map_observation(obs), dict(info or {})

    def step(self, action):
        action = np.asarray(action, dtype=np.float32).reshape(-1)
        if action.shape != (8,) or not np.all(np.isfinite(action)):
            raise ConfigError(f"action: expected 8 finite floats (7 joint targets + gripper), got {action.shape}")
        obs, reward, terminated, truncated, info = self.env.step(self._to_env_action(action))
        self._steps += 1
        truncated = bool(_numpy(truncated).reshape(-1)[0]) or self._steps >= self.max_episode_steps
        return (
            map_observation(obs),
            float(_numpy(reward).reshape(-1)[0]),
            bool(_numpy(terminated).reshape(-1)[0]),
            truncated,
            dict(info or {}),
        )

    def _to_env_action(self, action: np.ndarray):
        import torch

        device = getattr(self.env.unwrapped, "device", "cpu")
        return torch.as_tensor(action, dtype=torch.float32, device=device).reshape(1, 8)

    def _rigid(self, name: str):
        scene = self.env.unwrapped.scene
        try:
            return scene[name]
        except KeyError as exc:
            known = sorted(scene.keys()) if hasattr(scene, "keys") else "?"
            raise ConfigError(
                f"object_names: the Isaac scene has no object {name!r} (it has {known}); "
                "pass object_names=(object, target)"
            ) from exc

    def object_poses(self) -> dict[str, np.ndarray]:
        poses = {}
        for name in (self.object_name, self.target_name):
            data = self._rigid(name).data
            pos = _numpy(data.root_pos_w).reshape(-1, 3)[0]
            quat = _numpy(data.root_quat_w).reshape(-1, 4)[0]  # (w, x, y, z) in Isaac Lab
            poses[name] = np.concatenate([pos, quat]).astype(np.float64)
        return poses

    def is_success(self) -> bool:
        poses = self.object_poses()
        return placed_in(poses[self.object_name], poses[self.target_name])

    def close(self):
        self.env.close()


# -- building real envs (lazy Isaac imports) ----------------------------------------------------------------------
_APP = None


def _launch_isaac(headless: bool = True):
    """Start the Isaac Sim app once per process (must precede any other isaaclab import)."""
    global _APP
    try:
        from isaaclab.app import AppLauncher
    except ImportError as exc:
        raise MissingDependency(INSTALL_HINT) from exc
    if _APP is None:
        _APP = AppLauncher(headless=headless, enable_cameras=True).app
    try:
        import sim_evals.environments  # noqa: F401  (registers the DROID gym ids)
        from isaaclab_tasks.utils import parse_env_cfg
    except ImportError as exc:
        raise MissingDependency(INSTALL_HINT) from exc
    return parse_env_cfg


def resolve_env_id(scene_id: int, layout: str, registered: set[str]) -> str:
    """The gym id to make. layout: "legacy" (DROID + set_scene), "per_scene", "auto" (per-scene id if registered)."""
    if scene_id not in SCENES:
        raise ConfigError(f"scene: expected one of {sorted(SCENES)}, got {scene_id!r}")
    if layout not in ("auto", "legacy", "per_scene"):
        raise ConfigError(f"isaac layout: expected 'auto', 'legacy' or 'per_scene', got {layout!r}")
    per_scene = SCENES[scene_id].env_id
    if layout == "per_scene" or (layout == "auto" and per_scene in registered):
        return per_scene
    return LEGACY_ENV_ID


def make_isaac_env(
    scene_id: int,
    layout: str = "auto",
    device: str = "cuda:0",
    headless: bool = True,
    asset_root: str | None = None,
    max_episode_steps: int = 450,
    object_names: tuple[str, str] | None = None,
) -> IsaacDroidEnv:
    """Make a sim-evals DROID env for `scene_id`. Raises MissingDependency (with install steps) without Isaac Lab."""
    if asset_root:
        os.environ["SIM_EVALS_ASSET_ROOT"] = str(asset_root)
    parse_env_cfg = _launch_isaac(headless)
    env_id = resolve_env_id(scene_id, layout, set(gym.registry.keys()))
    cfg = parse_env_cfg(env_id, device=device, num_envs=1, use_fabric=True)
    if env_id == LEGACY_ENV_ID:
        cfg.set_scene(scene_id)
    env = gym.make(env_id, cfg=cfg)
    return IsaacDroidEnv(env, scene_id, max_episode_steps=max_episode_steps, object_names=object_names)
