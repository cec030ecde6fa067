"""Rotation and pose helpers in plain numpy (the client does not depend on scipy).

Conventions, matching RLinf's real-world Franka stack:
- Euler angles are scipy's lower-case "xyz" (extrinsic, about the fixed base axes x, then y, then z):
  R = Rz(rz) @ Ry(ry) @ Rx(rx).
- Quaternions are (x, y, z, w).
- A pose is a 4x4 homogeneous matrix; a 6-vector pose is (x, y, z, rx, ry, rz) with the Euler angles above.
"""

from __future__ import annotations

import numpy as np


def rot_x(a: float) -> np.ndarray:
    c, s = np.cos(a), np.sin(a)
    return np.array([[1.0, 0.0, 0.0], [0.0, c, -s], [0.0, s, c]])


def rot_y(a: float) -> np.ndarray:
    c, s = np.cos(a), np.sin(a)
    return np.array([[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]])


def rot_z(a: float) -> np.ndarray:
    c, s = np.cos(a), np.sin(a)
    return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


def euler_xyz_to_matrix(euler: np.ndarray) -> np.ndarray:
    rx, ry, rz = np.asarray(euler, dtype=np.float64).reshape(3)
    return rot_z(rz) @ rot_y(ry) @ rot_x(rx)


def matrix_to_euler_xyz(rot: np.ndarray) -> np.ndarray:
    """Inverse of `euler_xyz_to_matrix`; ry in [-pi/2, pi/2], rx and rz in (-pi, pi]."""
    r = np.asarray(rot, dtype=np.float64)
    ry = np.arcsin(np.clip(-r[2, 0], -1.0, 1.0))
    if abs(r[2, 0]) < 1.0 - 1e-9:
        rx = np.arctan2(r[2, 1], r[2, 2])
        rz = np.arctan2(r[1, 0], r[0, 0])
    else:  # gimbal lock: only rx - rz (or rx + rz) is defined; put it all in rx
        rz = 0.0
        rx = np.arctan2(-r[1, 2], r[1, 1])
    return np.array([rx, ry, rz])


def quat_to_matrix(quat_xyzw: np.ndarray) -> np.ndarray:
    x, y, z, w = np.asarray(quat_xyzw, dtype=np.float64).reshape(4) / np.linalg.norm(quat_xyzw)
    return np.array(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
            [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
            [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
        ]
    )


def matrix_to_quat(rot: np.ndarray) -> np.ndarray:
    """(x, y, z, w) with w >= 0, by the largest-diagonal branch (stable for every rotation)."""
    r = np.asarray(rot, dtype=np.float64)
    trace = r[0, 0] + r[1, 1] + r[2, 2]
    if trace > 0:
        s = 2.0 * np.sqrt(1.0 + trace)
        q = [(r[2, 1] - r[1, 2]) / s, (r[0, 2] - r[2, 0]) / s, (r[1, 0] - r[0, 1]) / s, 0.25 * s]
    elif r[0, 0] > r[1, 1] and r[0, 0] > r[2, 2]:
        s = 2.0 * np.sqrt(1.0 + r[0, 0] - r[1, 1] - r[2, 2])
        q = [0.25 * s, (r[0, 1] + r[1, 0]) / s, (r[0, 2] + r[2, 0]) / s, (r[2, 1] - r[1, 2]) / s]
    elif r[1, 1] > r[2, 2]:
        s = 2.0 * np.sqrt(1.0 + r[1, 1] - r[0, 0] - r[2, 2])
        q = [(r[0, 1] + r[1, 0]) / s, 0.25 * s, (r[1, 2] + r[2, 1]) / s, (r[0, 2] - r[2, 0]) / s]
    else:
        s = 2.0 * np.sqrt(1.0 + r[2, 2] - r[0, 0] - r[1, 1])
        q = [(r[0, 2] + r[2, 0]) / s, (r[1, 2] + r[2, 1]) / s, 0.25 * s, (r[1, 0] - r[0, 1]) / s]
    q = np.asarray(q)
    q /= np.linalg.norm(q)
    return -q if q[3] < 0 else q


def rotvec_to_matrix(rotvec: np.ndarray) -> np.ndarray:
    """Rodrigues: rotation by |v| about v / |v|."""
    v = np.asarray(rotvec, dtype=np.float64).reshape(3)
    angle = float(np.linalg.norm(v))
    if angle < 1e-12:
        return np.eye(3) + skew(v)
    k = skew(v / angle)
    return np.eye(3) + np.sin(angle) * k + (1.0 - np.cos(angle)) * (k @ k)


def matrix_to_rotvec(rot: np.ndarray) -> np.ndarray:
    """Log map through the quaternion, so angles near pi stay accurate; the angle is in [0, pi]."""
    q = matrix_to_quat(rot)
    sin_half = float(np.linalg.norm(q[:3]))
    if sin_half < 1e-12:
        return 2.0 * q[:3]
    angle = 2.0 * np.arctan2(sin_half, q[3])
    return q[:3] / sin_half * angle


def rotation_angle(rot: np.ndarray) -> float:
    """Angle (rad) of a rotation matrix, in [0, pi]."""
    return float(np.linalg.norm(matrix_to_rotvec(rot)))


def skew(v: np.ndarray) -> np.ndarray:
    x, y, z = np.asarray(v, dtype=np.float64).reshape(3)
    return np.array([[0.0, -z, y], [z, 0.0, -x], [-y, x, 0.0]])


def wrap_to_pi(angle: np.ndarray) -> np.ndarray:
    """Wrap to [-pi, pi)."""
    return (np.asarray(angle, dtype=np.float64) + np.pi) % (2 * np.pi) - np.pi


def make_pose(position: np.ndarray, rot: np.ndarray) -> np.ndarray:
    pose = np.eye(4)
    pose[:3, :3] = rot
    pose[:3, 3] = np.asarray(position, dtype=np.float64).reshape(3)
    return pose


def pose_from_xyz_euler(vec6: np.ndarray) -> np.ndarray:
    v = np.asarray(vec6, dtype=np.float64).reshape(6)
    return make_pose(v[:3], euler_xyz_to_matrix(v[3:]))


def pose_to_xyz_euler(pose: np.ndarray) -> np.ndarray:
    return np.concatenate([pose[:3, 3], matrix_to_euler_xyz(pose[:3, :3])])


def interpolate_pose(start: np.ndarray, end: np.ndarray, t: float) -> np.ndarray:
    """Straight line in position, geodesic in orientation; t = 0 gives start, t = 1 gives end."""
    delta = matrix_to_rotvec(end[:3, :3] @ start[:3, :3].T)
    rot = rotvec_to_matrix(t * delta) @ start[:3, :3]
    return make_pose(start[:3, 3] + t * (end[:3, 3] - start[:3, 3]), rot)


def rlinf_adjoint(pose: np.ndarray) -> np.ndarray:
    """The 6x6 matrix RLinf's RelativeFrame uses to map a TCP-frame (v, w) action into the base frame.

    Block form [[R, 0], [skew(p) R, R]]: v_base = R v and w_base = R w + skew(p) R v. The second term is not the
    textbook twist adjoint (that one adds skew(p) R w to v), but it is exactly what produced the training actions
    (the recorder applied its inverse) and what RLinf executes, so it is reproduced as is.
    """
    rot, p = pose[:3, :3], pose[:3, 3]
    adj = np.zeros((6, 6))
    adj[:3, :3] = rot
    adj[3:, 3:] = rot
    adj[3:, :3] = skew(p) @ rot
    return adj
