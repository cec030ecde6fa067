"""Assemble the local DROID-like MuJoCo scene with `mujoco.MjSpec`.

The arm is the FR3 + Franka hand that the `franky-sim` wheel ships (menagerie's model, Apache-2.0), mounted at the world
origin on a table whose top is the plane z = 0. DROID's platform is a Panda with a Robotiq 2F-85; the FR3 has the same
kinematic chain, so the home pose puts the tool centre point within a few millimetres of DROID's (0.360, 0.0, 0.387).

Objects per scene (stand-ins for the Isaac Lab USD assets):
  1. cube -> bowl      "put the cube in the bowl"
  2. can  -> mug       "pick up the can and put it in the mug"
  3. banana -> bin     "put the banana in the bin"
  4. the cube and the can, the bowl and the mug at once, four instructions over them (`eval.mujoco_droid.table2`)
Every object is a free body whose origin sits at its base, so the success rule compares like with like.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import mujoco
import numpy as np

from dreamzero.errors import ConfigError, MissingDependency

#: DROID's home pose (rad) and the FR3 joint limits (from the model file)
HOME_QPOS = np.array([0.0, -math.pi / 5, 0.0, -4 * math.pi / 5, 0.0, 3 * math.pi / 5, 0.0])
ARM_JOINTS = tuple(f"fr3_joint{i}" for i in range(1, 8))
FINGER_JOINTS = ("finger_joint1", "finger_joint2")
FINGER_OPEN_M = 0.04  # travel of one finger
#: the cube's yaw in its body: 45 degrees, so that the fingers of the straight-down gripper at DROID's home pose (which
#: close along a base diagonal) meet two faces; an axis-aligned cube put them on two opposite vertical edges, a grasp
#: that squeezes the cube out unless the tool is within about 0.6 cm (half a finger pad) of the diagonal
CUBE_FACING_FINGERS = [math.cos(math.pi / 8), 0.0, 0.0, math.sin(math.pi / 8)]
#: tool centre point below the flange; the Franka hand's TCP (the DROID value is measured at the 2F-85's TCP)
TCP_OFFSET_M = 0.1034
CONTROL_HZ = 15.0
SUBSTEPS = 33  # 33 physics steps per 15 Hz control step (timestep ~2 ms)

CAMERA_NAMES = ("exterior_cam_0", "exterior_cam_1", "wrist_cam")


@dataclass(frozen=True)
class SceneSpec:
    """One DROID evaluation scene: which object goes where, and the prompt."""

    scene_id: int
    instruction: str
    object_name: str
    target_name: str
    object_xy: tuple[float, float]
    target_xy: tuple[float, float]
    # scene 4: a second object and a second target on the table; which pair the episode asks for is in its words
    other_object: str | None = None
    other_target: str | None = None

    @property
    def bodies(self) -> tuple[str, ...]:
        """Every free body of the scene: objects first, then targets."""
        names = (self.object_name, self.other_object, self.target_name, self.other_target)
        return tuple(n for n in names if n is not None)


SCENES: dict[int, SceneSpec] = {
    1: SceneSpec(1, "put the cube in the bowl", "cube", "bowl", (0.50, 0.15), (0.50, -0.15)),
    2: SceneSpec(2, "pick up the can and put it in the mug", "can", "mug", (0.48, -0.15), (0.52, 0.15)),
    3: SceneSpec(3, "put the banana in the bin", "banana", "bin", (0.45, 0.18), (0.55, -0.18)),
    # positions here are only where the bodies are built; every reset draws the layout (table2.sample_layout)
    4: SceneSpec(4, "put the cube in the bowl", "cube", "bowl", (0.42, 0.20), (0.58, -0.20), "can", "mug"),
}


def scene_spec(scene_id: int) -> SceneSpec:
    if scene_id not in SCENES:
        raise ConfigError(f"scene: expected one of {sorted(SCENES)}, got {scene_id!r}")
    return SCENES[scene_id]


def franky_sim_assets() -> Path:
    """Directory holding `fr3.xml` and `meshes/` inside the installed franky-sim wheel."""
    try:
        import franky_sim
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependency(
            "the MuJoCo DROID scene needs the FR3 model shipped by franky-sim: pip install 'dreamzero-serve[sim]'"
        ) from exc
    assets = Path(franky_sim.__file__).resolve().parent / "assets"
    if not (assets / "fr3.xml").is_file():  # pragma: no cover
        raise MissingDependency(f"franky-sim is installed but {assets / 'fr3.xml'} is missing; reinstall franky-sim")
    return assets


def look_at_quat(pos, target, up=(0.0, 0.0, 1.0)) -> np.ndarray:
    """Quaternion (w, x, y, z) of a MuJoCo camera at `pos` looking at `target` (cameras look along their -z)."""
    pos, target, up = (np.asarray(v, dtype=np.float64) for v in (pos, target, up))
    forward = target - pos
    forward /= np.linalg.norm(forward)
    right = np.cross(forward, up)
    right /= np.linalg.norm(right)
    cam_up = np.cross(right, forward)
    mat = np.stack([right, cam_up, -forward], axis=1)  # columns: camera x, y, z in the parent frame
    quat = np.zeros(4)
    mujoco.mju_mat2Quat(quat, mat.reshape(-1))
    return quat


# 1. The robot (FR3 + hand from franky-sim) -------------------------------------------------------------------------
def _load_robot(assets: Path) -> mujoco.MjSpec:
    """The FR3 file is the base spec (attaching it under a prefix would rename every joint and actuator)."""
    spec = mujoco.MjSpec.from_file(str(assets / "fr3.xml"))
    spec.meshdir = str(assets / "meshes")  # the file says "assets", the wheel ships "meshes"
    for key in list(spec.keys):
        spec.delete(key)  # its "home" keyframe is franky-sim's (and sized for the arm alone); ours is HOME_QPOS
    for body in spec.bodies:
        if body.name.startswith("fr3_link") or body.name in ("hand", "left_finger", "right_finger"):
            body.gravcomp = 1.0  # a real Franka compensates gravity; without it the arm sags ~0.007 rad
    for name in FINGER_JOINTS:
        joint = spec.joint(name)
        joint.frictionloss = 0.0  # the inherited arm friction stalls the fingers
        joint.armature = 0.001
        _set_scalar(joint, "damping", 2.0)
    # Tool centre point and the wrist camera ride on the hand.
    hand = spec.body("hand")
    hand.add_site(name="tcp", pos=[0.0, 0.0, TCP_OFFSET_M], size=[0.005, 0, 0], rgba=[1, 0, 0, 0.0], group=4)
    # DROID's wrist camera sits beside the gripper and looks past the fingers; hand +z points along the fingers.
    cam_pos = np.array([0.09, 0.0, -0.01])
    hand.add_camera(name="wrist_cam", pos=cam_pos, quat=look_at_quat(cam_pos, [0.0, 0.0, 0.22], up=[1, 0, 0]), fovy=70)
    return spec


def _set_scalar(element, attr: str, value: float) -> None:
    """mujoco 4 turned some joint scalars (damping) into small arrays; write the first entry either way."""
    try:
        setattr(element, attr, value)
    except TypeError:
        arr = np.array(getattr(element, attr), dtype=np.float64)
        arr.reshape(-1)[0] = value
        setattr(element, attr, arr)


# 2. Table, lights and exterior cameras ------------------------------------------------------------------------------
def _add_room(spec: mujoco.MjSpec) -> None:
    world = spec.worldbody
    world.add_geom(
        name="floor", type=mujoco.mjtGeom.mjGEOM_PLANE, size=[3, 3, 0.1], pos=[0, 0, -0.75], rgba=[0.35, 0.35, 0.38, 1]
    )
    world.add_geom(
        name="table",
        type=mujoco.mjtGeom.mjGEOM_BOX,
        size=[0.55, 0.6, 0.02],
        pos=[0.35, 0.0, -0.02],
        rgba=[0.55, 0.42, 0.3, 1],
        friction=[1.0, 0.005, 0.0001],
    )
    world.add_light(name="key", pos=[0.4, 0.0, 1.6], dir=[0, 0, -1], diffuse=[0.7, 0.7, 0.7], castshadow=False)
    world.add_light(name="fill", pos=[-0.5, 0.8, 1.2], dir=[0.5, -0.5, -0.7], diffuse=[0.3, 0.3, 0.3], castshadow=False)
    # DROID's two exterior cameras face the workspace from either side of the robot, a little in front of the base.
    workspace = [0.35, 0.0, 0.22]
    for name, pos in (("exterior_cam_0", [0.95, 0.6, 0.6]), ("exterior_cam_1", [0.95, -0.6, 0.6])):
        world.add_camera(name=name, pos=pos, quat=look_at_quat(pos, workspace), fovy=65)


# 3. Scene objects -----------------------------------------------------------------------------------------------------
def _free_body(spec: mujoco.MjSpec, name: str, xy) -> mujoco.MjsBody:
    body = spec.worldbody.add_body(name=name, pos=[xy[0], xy[1], 0.0])
    body.add_freejoint(name=f"{name}_free")
    return body


def _ring(body, name: str, radius: float, height: float, thickness: float, rgba, pieces: int = 12, z0: float = 0.0):
    """Open container wall: `pieces` boxes around a circle (MuJoCo has no concave primitives)."""
    half_len = radius * math.tan(math.pi / pieces) + thickness / 2
    for i in range(pieces):
        ang = 2 * math.pi * i / pieces
        body.add_geom(
            name=f"{name}_wall{i}",
            type=mujoco.mjtGeom.mjGEOM_BOX,
            size=[thickness / 2, half_len, height / 2],
            pos=[radius * math.cos(ang), radius * math.sin(ang), z0 + height / 2],
            quat=[math.cos(ang / 2), 0, 0, math.sin(ang / 2)],
            rgba=rgba,
            mass=0.02,
        )


def _add_object(spec: mujoco.MjSpec, name: str, xy) -> None:
    box, cyl, cap = mujoco.mjtGeom.mjGEOM_BOX, mujoco.mjtGeom.mjGEOM_CYLINDER, mujoco.mjtGeom.mjGEOM_CAPSULE
    obj = _free_body(spec, name, xy)
    if name == "cube":
        obj.add_geom(
            name="cube_geom",
            type=box,
            size=[0.025] * 3,
            pos=[0, 0, 0.025],
            quat=CUBE_FACING_FINGERS,
            rgba=[0.85, 0.1, 0.1, 1],
            mass=0.05,
        )
    elif name == "can":
        obj.add_geom(
            name="can_geom", type=cyl, size=[0.03, 0.055], pos=[0, 0, 0.055], rgba=[0.2, 0.5, 0.8, 1], mass=0.08
        )
    else:  # banana: two capsules bent at the middle
        for i, ang in enumerate((0.35, -0.35)):
            sign = 1 if i == 0 else -1
            obj.add_geom(
                name=f"banana_geom{i}",
                type=cap,
                size=[0.018, 0.045],
                pos=[sign * 0.04, 0.0, 0.018 + 0.012 * (1 - abs(sign))],
                quat=[math.cos((math.pi / 2 + ang) / 2), 0, math.sin((math.pi / 2 + ang) / 2), 0],
                rgba=[0.95, 0.85, 0.2, 1],
                mass=0.05,
            )


def _add_target(spec: mujoco.MjSpec, name: str, xy) -> None:
    box, cyl = mujoco.mjtGeom.mjGEOM_BOX, mujoco.mjtGeom.mjGEOM_CYLINDER
    target = _free_body(spec, name, xy)
    if name == "bowl":
        target.add_geom(
            name="bowl_base", type=cyl, size=[0.07, 0.005], pos=[0, 0, 0.005], rgba=[0.9, 0.9, 0.95, 1], mass=0.1
        )
        _ring(target, "bowl", radius=0.08, height=0.05, thickness=0.01, rgba=[0.9, 0.9, 0.95, 1], z0=0.005)
    elif name == "mug":
        target.add_geom(
            name="mug_base", type=cyl, size=[0.045, 0.004], pos=[0, 0, 0.004], rgba=[0.95, 0.95, 0.9, 1], mass=0.1
        )
        _ring(target, "mug", radius=0.048, height=0.09, thickness=0.008, rgba=[0.95, 0.95, 0.9, 1], pieces=10, z0=0.004)
        target.add_geom(
            name="mug_handle",
            type=box,
            size=[0.02, 0.006, 0.03],
            pos=[0.07, 0, 0.05],
            rgba=[0.95, 0.95, 0.9, 1],
            mass=0.01,
        )
    else:  # bin: a square open box
        grey = [0.3, 0.3, 0.32, 1]
        target.add_geom(name="bin_base", type=box, size=[0.1, 0.1, 0.005], pos=[0, 0, 0.005], rgba=grey, mass=0.2)
        for i, (x, y, sx, sy) in enumerate(
            ((0.1, 0, 0.005, 0.1), (-0.1, 0, 0.005, 0.1), (0, 0.1, 0.1, 0.005), (0, -0.1, 0.1, 0.005))
        ):
            target.add_geom(name=f"bin_wall{i}", type=box, size=[sx, sy, 0.04], pos=[x, y, 0.045], rgba=grey, mass=0.05)


def _add_objects(spec: mujoco.MjSpec, scene: SceneSpec) -> None:
    _add_object(spec, scene.object_name, scene.object_xy)
    _add_target(spec, scene.target_name, scene.target_xy)
    if scene.other_object is not None:  # built away from the first pair; the env's reset places every body
        _add_object(spec, scene.other_object, (scene.object_xy[0], -scene.object_xy[1]))
    if scene.other_target is not None:
        _add_target(spec, scene.other_target, (scene.target_xy[0], -scene.target_xy[1]))


def build_scene_spec(scene_id: int) -> mujoco.MjSpec:
    """The full scene as an (uncompiled) MjSpec: robot, table, cameras, the scene's object and target."""
    scene = scene_spec(scene_id)
    spec = _load_robot(franky_sim_assets())
    spec.modelname = f"droid_scene{scene_id}"
    spec.option.timestep = 1.0 / (CONTROL_HZ * SUBSTEPS)
    spec.option.integrator = mujoco.mjtIntegrator.mjINT_IMPLICITFAST
    spec.visual.global_.offwidth = 1280
    spec.visual.global_.offheight = 720
    _add_room(spec)
    _add_objects(spec, scene)
    return spec


def build_scene(scene_id: int) -> mujoco.MjModel:
    return build_scene_spec(scene_id).compile()
