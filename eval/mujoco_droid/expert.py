"""A scripted pick-and-place expert for the MuJoCo DROID scenes 1 (cube -> bowl) and 4 (either object into either
target, as the episode's instruction says), for demonstrations.

The expert reads the privileged object poses, plans a tool-centre-point path (above the cube, down, grasp, lift,
over the bowl, down, release, up) and turns each 15 Hz path point into absolute joint targets with damped
least-squares inverse kinematics on the scene's own MuJoCo model (so the targets are exact for the simulated arm).
The gripper points straight down with the home pose's wrist angle, so its fingers close along a base diagonal; the
scene turns the cube 45 degrees in its body (`scene.CUBE_FACING_FINGERS`) so that they meet two faces, and the
cube is never turned further, so no wrist rotation is needed. The can is round, so any finger direction holds it.
Heights depend on the object and the target (`_GRIP_Z`, `_RIM_Z`): the can is gripped higher than the cube, and an
object goes into the mug (9 cm walls) from higher than into the bowl; scene 1's path is what it always was.

Layouts (`LAYOUTS`, drawn by `sample_layout`): "wide" puts the cube and the bowl anywhere in a 0.22 m x 0.50 m
patch of the table in front of the robot (x 0.40..0.62 m, y -0.25..0.25 m), at least 0.18 m apart; either may be left
or right of the other. "compact" (what the shipped small default is trained and evaluated on) keeps the cube in a
0.12 m x 0.20 m patch on the robot's left and the bowl in one of the same size on its right: the cube still lands
anywhere within several of its own widths, so a policy has to look at the images to know where to reach.
"""

from __future__ import annotations

from dataclasses import dataclass

import mujoco
import numpy as np

from dreamzero.errors import ConfigError
from eval.mujoco_droid import table2
from eval.mujoco_droid.scene import HOME_QPOS

#: the "wide" table patch both objects are drawn from (m, base frame) and their minimum centre distance
LAYOUT_X = (0.40, 0.62)
LAYOUT_Y = (-0.25, 0.25)
MIN_SEPARATION_M = 0.18

_MAX_STEP_M = 0.012  # TCP travel per 15 Hz step (0.18 m/s)
_GRASP_Z = 0.028  # TCP height at the grasp (the cube's centre is 0.025 m above the table)
_HOVER_Z = 0.14  # approach height above the cube
_CARRY_Z = 0.20  # transport height
_RELEASE_Z = 0.12  # TCP height over the bowl when the gripper opens
_GRIP_HOLD_STEPS = 8  # steps to wait while the fingers close or open
#: TCP height above the object's base at the grasp: the cube at its centre; the 11 cm can near its top third, below
#: the palm (which sits about 4.5 cm above the TCP) and with the finger pads on the can
_GRIP_Z = {"cube": _GRASP_Z, "can": 0.075}
#: rim height of each target above its base, and the clearance of the held object's base over it at the release
_RIM_Z = {"bowl": 0.055, "mug": 0.094, "bin": 0.085}
_RIM_CLEARANCE_M = 0.02


def path_heights(object_name: str, target_name: str) -> tuple[float, float, float, float]:
    """TCP heights (grasp, hover, carry, release) for moving `object_name` into `target_name` (m above the table)."""
    if object_name not in _GRIP_Z or target_name not in _RIM_Z:
        raise ConfigError(f"expert: no grasp for {object_name!r} -> {target_name!r} (known: {sorted(_GRIP_Z)})")
    grasp = _GRIP_Z[object_name]
    release = max(_RELEASE_Z, _RIM_Z[target_name] + grasp + _RIM_CLEARANCE_M)
    return grasp, max(_HOVER_Z, grasp + 0.09), max(_CARRY_Z, release + 0.04), release


@dataclass(frozen=True)
class Layout:
    """Where scene 1's cube and bowl start (x, y in the base frame, m)."""

    object_xy: tuple[float, float]
    target_xy: tuple[float, float]


@dataclass(frozen=True)
class LayoutRange:
    """Where `sample_layout` may put each object: ((x_min, y_min), (x_max, y_max)) per object, and their minimum
    centre distance (m, base frame)."""

    object_box: tuple[tuple[float, float], tuple[float, float]]
    target_box: tuple[tuple[float, float], tuple[float, float]]
    min_separation_m: float


_WIDE_BOX = ((LAYOUT_X[0], LAYOUT_Y[0]), (LAYOUT_X[1], LAYOUT_Y[1]))
LAYOUTS = {
    "wide": LayoutRange(_WIDE_BOX, _WIDE_BOX, MIN_SEPARATION_M),
    "compact": LayoutRange(((0.44, 0.02), (0.56, 0.22)), ((0.44, -0.22), (0.56, -0.02)), 0.12),
}


#: scene 4 (`table2`): every body anywhere on its patch, so a detour's via point is drawn over the whole patch
SCENE4_RANGE = LayoutRange(
    ((table2.LAYOUT_X[0], table2.LAYOUT_Y[0]), (table2.LAYOUT_X[1], table2.LAYOUT_Y[1])),
    ((table2.LAYOUT_X[0], table2.LAYOUT_Y[0]), (table2.LAYOUT_X[1], table2.LAYOUT_Y[1])),
    table2.MIN_OBJECT_OBJECT_M,
)


def layout_range(name: str) -> LayoutRange:
    if name not in LAYOUTS:
        raise ConfigError(f"layouts: expected one of {sorted(LAYOUTS)}, got {name!r}")
    return LAYOUTS[name]


def sample_layout(rng: np.random.Generator, layouts: str = "wide") -> Layout:
    """A random cube / bowl placement from the named `LAYOUTS` entry, far enough apart (bounded retries)."""
    spec = layout_range(layouts)
    for _ in range(1000):
        a, b = (rng.uniform(*box) for box in (spec.object_box, spec.target_box))
        if np.linalg.norm(a - b) >= spec.min_separation_m:
            return Layout(tuple(float(v) for v in a), tuple(float(v) for v in b))
    raise RuntimeError(f"could not place the cube and the bowl apart (the {layouts!r} layout ranges are too small)")


@dataclass(frozen=True)
class Detours:
    """Via points the expert passes on its way (x, y in the base frame, m; None: the straight path).

    `reach` is visited at the approach height before the cube, `carry` at the transport height before the bowl.
    A detour puts the arm where the object is not, and the expert then corrects from there: demonstrations whose
    state alone no longer says where the object is, so a policy trained on them has to read it from the images.
    """

    reach: tuple[float, float] | None = None
    carry: tuple[float, float] | None = None


DETOUR_MARGIN_M = 0.04  # via points are drawn from the object's patch widened by this much on every side


def sample_detours(rng: np.random.Generator, layouts: str | LayoutRange, probability: float) -> Detours:
    """Each of the two detours independently with `probability`, its via point uniform over the (widened) patch of
    the object it leads to (`layouts`: a `LAYOUTS` name, or the ranges themselves, as scene 4's `SCENE4_RANGE`)."""
    if not 0.0 <= probability <= 1.0:
        raise ConfigError(f"detours: expected a probability in [0, 1], got {probability}")
    spec = layouts if isinstance(layouts, LayoutRange) else layout_range(layouts)

    def via(box) -> tuple[float, float] | None:
        lo, hi = np.asarray(box[0]) - DETOUR_MARGIN_M, np.asarray(box[1]) + DETOUR_MARGIN_M
        point = rng.uniform(lo, hi)  # drawn even when unused, so one episode's choices never shift the next's
        return (float(point[0]), float(point[1])) if rng.uniform() < probability else None

    return Detours(reach=via(spec.object_box), carry=via(spec.target_box))


def reset_with_layout(env, seed: int, layout: Layout) -> dict:
    """Reset `env` (a MujocoDroidEnv on scene 1) and move the cube and the bowl to `layout`; returns the observation."""
    if env.scene_id != 1:
        raise ConfigError(f"scene: the scripted expert does scene 1 (cube -> bowl), got scene {env.scene_id}")
    env.reset(seed=seed)
    for name, xy in ((env.scene.object_name, layout.object_xy), (env.scene.target_name, layout.target_xy)):
        adr = env._free_qpos[name]
        env.data.qpos[adr : adr + 3] = [xy[0], xy[1], 0.0]
        env.data.qpos[adr + 3 : adr + 7] = [1.0, 0.0, 0.0, 0.0]
    mujoco.mj_forward(env.model, env.data)
    return env._observation()


class ArmIK:
    """Damped least-squares IK for the `tcp` site on a private copy of the scene's data (the sim is never touched)."""

    def __init__(self, model: mujoco.MjModel, arm_qpos_adr: np.ndarray, joint_low, joint_high):
        self.model = model
        self.data = mujoco.MjData(model)
        self.site = model.site("tcp").id
        self.adr = np.asarray(arm_qpos_adr)
        self.dofs = np.array([model.jnt_dofadr[model.jnt_qposadr.tolist().index(a)] for a in self.adr])
        self.low, self.high = np.asarray(joint_low), np.asarray(joint_high)
        self.data.qpos[self.adr] = HOME_QPOS
        mujoco.mj_kinematics(model, self.data)
        self.down = self.data.site_xmat[self.site].reshape(3, 3).copy()  # tool orientation at home: straight down

    def solve(self, target: np.ndarray, q0: np.ndarray, iterations: int = 30, tol_m: float = 1e-4) -> np.ndarray:
        """Joint positions (7,) that put the TCP at `target` (3,) pointing down, starting from q0."""
        q = np.array(q0, dtype=np.float64)
        jp, jr = np.zeros((3, self.model.nv)), np.zeros((3, self.model.nv))
        for _ in range(iterations):
            self.data.qpos[self.adr] = q
            mujoco.mj_kinematics(self.model, self.data)
            mujoco.mj_comPos(self.model, self.data)
            pos = self.data.site_xpos[self.site]
            rot = self.data.site_xmat[self.site].reshape(3, 3)
            err_p = target - pos
            # orientation error: axis-angle of down @ rot^T, small-angle form
            r = self.down @ rot.T
            err_r = 0.5 * np.array([r[2, 1] - r[1, 2], r[0, 2] - r[2, 0], r[1, 0] - r[0, 1]])
            if np.linalg.norm(err_p) < tol_m and np.linalg.norm(err_r) < 1e-3:
                break
            mujoco.mj_jacSite(self.model, self.data, jp, jr, self.site)
            jac = np.vstack([jp[:, self.dofs], jr[:, self.dofs]])  # [6, 7]
            err = np.concatenate([err_p, err_r])
            lam = 1e-4
            dq = jac.T @ np.linalg.solve(jac @ jac.T + lam * np.eye(6), err)
            # null space: drift towards the home posture so the elbow stays up
            null = np.eye(7) - np.linalg.pinv(jac) @ jac
            dq += null @ (0.1 * (HOME_QPOS - q))
            q = np.clip(q + dq, self.low, self.high)
        return q


class ScriptedExpert:
    """Plans one episode from the object poses at reset; `act()` returns the next 15 Hz action (8,)."""

    def __init__(self, env):
        self.env = env
        self.ik = ArmIK(env.model, env._arm_qpos, env.joint_low, env.joint_high)
        self._plan: list[tuple[np.ndarray, float]] = []
        self._i = 0
        self._q = HOME_QPOS.copy()

    def reset(self, detours: Detours | None = None) -> None:
        """Plan from the current object positions (call after the env reset), through `detours`' via points."""
        poses = self.env.object_poses()
        # the episode's pair: the scene's one, or on scene 4 the one its instruction names
        cube = poses[self.env.task_object][:3]
        bowl = poses[self.env.task_target][:3]
        grasp_z, hover_z, carry_z, release_z = path_heights(self.env.task_object, self.env.task_target)
        start = self.env.tcp_position()
        above_cube = np.array([cube[0], cube[1], hover_z])
        grasp = np.array([cube[0], cube[1], grasp_z])
        lift = np.array([cube[0], cube[1], carry_z])
        over_bowl = np.array([bowl[0], bowl[1], carry_z])
        release = np.array([bowl[0], bowl[1], release_z])
        detours = detours or Detours()
        reach = [] if detours.reach is None else [(start, np.array([*detours.reach, hover_z]), 0.0)]
        carry = [] if detours.carry is None else [(lift, np.array([*detours.carry, carry_z]), 1.0)]
        legs = [
            *reach,
            (reach[0][1] if reach else start, above_cube, 0.0),
            (above_cube, grasp, 0.0),
            (grasp, grasp, 1.0),
            (grasp, lift, 1.0),
            *carry,
            (carry[0][1] if carry else lift, over_bowl, 1.0),
            (over_bowl, release, 1.0),
            (release, release, 0.0),
            (release, over_bowl, 0.0),
        ]
        plan: list[tuple[np.ndarray, float]] = []
        for a, b, grip in legs:
            if np.array_equal(a, b):
                plan += [(b.copy(), grip)] * _GRIP_HOLD_STEPS
            else:
                n = max(2, int(np.ceil(np.linalg.norm(b - a) / _MAX_STEP_M)))
                plan += [(a + (b - a) * (k / n), grip) for k in range(1, n + 1)]
        self._plan, self._i = plan, 0
        self._q = self.env.data.qpos[self.env._arm_qpos].copy()

    @property
    def done(self) -> bool:
        return self._i >= len(self._plan)

    @property
    def planned_steps(self) -> int:
        return len(self._plan)

    def act(self) -> np.ndarray:
        """Next action: 7 absolute joint targets + gripper (1 closed); holds the last point once the plan is done."""
        target, grip = self._plan[min(self._i, len(self._plan) - 1)]
        self._i += 1
        self._q = self.ik.solve(target, self._q)
        return np.append(self._q, grip).astype(np.float32)
