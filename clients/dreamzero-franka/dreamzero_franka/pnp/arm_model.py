"""TCP pose, Jacobian and inverse kinematics of the Franka arm with the Franka Hand.

Built on `franka.kinematics` (flange forward kinematics from Franka's published DH table). The TCP frame is the
one libfranka reports as O_T_EE for the Franka Hand (and that RLinf records as `tcp_pose`): 0.1034 m along the
flange's z axis, rotated -45 degrees about it.

The inverse kinematics is only used by the safety filter to prove that a Cartesian target can be reached with
every joint inside its limits by a small motion from the current configuration; it is a damped least-squares
iteration seeded with that configuration, not a global solver.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dreamzero_franka.common.kinematics import DH, HAND_TCP_OFFSET_M, link_transform
from dreamzero_franka.pnp.rotations import make_pose, matrix_to_rotvec, rot_z

_STALL_ITERATIONS = 4

#: flange -> TCP of the Franka Hand (libfranka's default NE_T_EE for the hand)
FLANGE_TO_TCP = make_pose([0.0, 0.0, HAND_TCP_OFFSET_M], rot_z(-np.pi / 4))


# each link is a constant part RotX(alpha) TransX(a) followed by RotZ(theta) TransZ(d); precompute the constant
_LINK_FIXED = np.stack([link_transform(a, 0.0, alpha, 0.0) for a, _, alpha in DH])
_LINK_D = DH[:, 1].copy()


def _frames(q: np.ndarray) -> np.ndarray:
    """(8, 4, 4): base -> frame i for joints 1..7, then the flange. Same chain as `kinematics.flange_pose`."""
    theta = np.zeros(8)
    theta[:7] = np.asarray(q, dtype=np.float64).reshape(7)
    c, s = np.cos(theta), np.sin(theta)
    rz = np.zeros((8, 4, 4))
    rz[:, 0, 0], rz[:, 0, 1], rz[:, 1, 0], rz[:, 1, 1] = c, -s, s, c
    rz[:, 2, 2], rz[:, 3, 3], rz[:, 2, 3] = 1.0, 1.0, _LINK_D
    links = _LINK_FIXED @ rz
    out = np.empty((8, 4, 4))
    pose = np.eye(4)
    for i in range(8):
        pose = pose @ links[i]
        out[i] = pose
    return out


def tcp_pose(q: np.ndarray) -> np.ndarray:
    """4x4 pose of the Franka Hand's TCP in the base frame (libfranka's O_T_EE)."""
    return _frames(q)[-1] @ FLANGE_TO_TCP


def tcp_jacobian(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(TCP pose, 6x7 geometric Jacobian [linear; angular] in the base frame).

    In Craig's convention joint i turns about the z axis of frame i, so column i is [z_i x (p - o_i); z_i].
    """
    frames = _frames(q)
    pose = frames[-1] @ FLANGE_TO_TCP
    z, o = frames[:7, :3, 2], frames[:7, :3, 3]
    jac = np.empty((6, 7))
    jac[:3] = np.cross(z, pose[:3, 3] - o).T
    jac[3:] = z.T
    return pose, jac


def pose_error(target: np.ndarray, pose: np.ndarray) -> np.ndarray:
    """(6,) [position error; rotation vector of target * pose^-1], both in the base frame."""
    return np.concatenate([target[:3, 3] - pose[:3, 3], matrix_to_rotvec(target[:3, :3] @ pose[:3, :3].T)])


@dataclass(frozen=True)
class IkResult:
    q: np.ndarray  # (7,) best configuration found, always inside [lower, upper]
    position_error_m: float
    rotation_error_rad: float
    converged: bool


def solve_ik(
    target: np.ndarray,
    seed: np.ndarray,
    lower: np.ndarray,
    upper: np.ndarray,
    tol_m: float = 1e-4,
    tol_rad: float = 1e-3,
    max_iterations: int = 60,
    damping: float = 0.05,
) -> IkResult:
    """Damped least squares from `seed`, every iterate clipped into [lower, upper].

    Clipping makes the answer honest for the safety filter: a target that needs a joint past its limit does not
    converge (the error stays), instead of converging to a configuration that cannot be commanded. The iteration
    also stops once the error has not shrunk for `_STALL_ITERATIONS` steps, which bounds the time spent proving that
    a target is unreachable (the filter may ask several times per control step).
    """
    q = np.clip(np.asarray(seed, dtype=np.float64).reshape(7), lower, upper)
    best, stalled = np.inf, 0
    for _ in range(max_iterations):
        pose, jac = tcp_jacobian(q)
        err = pose_error(target, pose)
        if np.linalg.norm(err[:3]) <= tol_m and np.linalg.norm(err[3:]) <= tol_rad:
            return IkResult(q, float(np.linalg.norm(err[:3])), float(np.linalg.norm(err[3:])), True)
        size = float(np.linalg.norm(err))
        stalled = stalled + 1 if size > 0.99 * best else 0
        best = min(best, size)
        if stalled >= _STALL_ITERATIONS:
            break
        jjt = jac @ jac.T + (damping**2) * np.eye(6)
        q = np.clip(q + jac.T @ np.linalg.solve(jjt, err), lower, upper)
    err = pose_error(target, tcp_pose(q))
    pos_err, rot_err = float(np.linalg.norm(err[:3])), float(np.linalg.norm(err[3:]))
    return IkResult(q, pos_err, rot_err, pos_err <= tol_m and rot_err <= tol_rad)
