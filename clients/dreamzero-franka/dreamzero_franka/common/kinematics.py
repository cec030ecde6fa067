"""Forward kinematics of the Franka arm (FR3 / Panda share the geometry) from its published DH parameters.

Franka documents the arm in Craig's (modified) DH convention: each link transform is
RotX(alpha) @ TransX(a) @ RotZ(theta) @ TransZ(d). The flange sits 0.107 m past joint 7 and the Franka Hand's TCP
another 0.1034 m along the flange's z axis; at the DROID home pose this puts the TCP at about (0.360, 0.0, 0.387) m.
"""

from __future__ import annotations

import numpy as np

#: rows: joints 1..7 then the flange; columns: a (m), d (m), alpha (rad) (pnp/arm_model.py builds its Jacobian on it)
DH = np.array(
    [
        [0.0, 0.333, 0.0],
        [0.0, 0.0, -np.pi / 2],
        [0.0, 0.316, np.pi / 2],
        [0.0825, 0.0, np.pi / 2],
        [-0.0825, 0.384, -np.pi / 2],
        [0.0, 0.0, np.pi / 2],
        [0.088, 0.0, np.pi / 2],
        [0.0, 0.107, 0.0],  # flange (fixed)
    ]
)
HAND_TCP_OFFSET_M = 0.1034  # Franka Hand TCP along the flange z axis


def link_transform(a: float, d: float, alpha: float, theta: float) -> np.ndarray:
    """One link of Craig's convention: RotX(alpha) @ TransX(a) @ RotZ(theta) @ TransZ(d) (4x4)."""
    ca, sa, ct, st = np.cos(alpha), np.sin(alpha), np.cos(theta), np.sin(theta)
    return np.array(
        [
            [ct, -st, 0.0, a],
            [st * ca, ct * ca, -sa, -d * sa],
            [st * sa, ct * sa, ca, d * ca],
            [0.0, 0.0, 0.0, 1.0],
        ]
    )


def flange_pose(q: np.ndarray) -> np.ndarray:
    """4x4 pose of the flange in the base frame for joint positions q (7,)."""
    q = np.asarray(q, dtype=np.float64).reshape(7)
    pose = np.eye(4)
    for (a, d, alpha), theta in zip(DH, [*q, 0.0]):
        pose = pose @ link_transform(a, d, alpha, theta)
    return pose


def tcp_position(q: np.ndarray, tcp_offset_m: float = HAND_TCP_OFFSET_M) -> np.ndarray:
    """(3,) position of the gripper's tool centre point in the base frame (m)."""
    pose = flange_pose(q)
    return pose[:3, 3] + pose[:3, 2] * tcp_offset_m
