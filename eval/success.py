"""The DROID sim success heuristic, shared by every simulator adapter, and the two-object scene's verdict.

sim-evals has no built-in success signal; the rule evaluators use on final object positions is: the object's base is
within 12 cm of the target's base in the table plane and not more than 8 cm below it.
"""

from __future__ import annotations

import numpy as np

XY_TOLERANCE_M = 0.12
Z_TOLERANCE_M = -0.08


def placed_in(object_pos, target_pos, xy_tol: float = XY_TOLERANCE_M, z_tol: float = Z_TOLERANCE_M) -> bool:
    """True iff |xy_obj - xy_target| < xy_tol and z_obj - z_target > z_tol (positions in metres, world frame)."""
    obj = np.asarray(object_pos, dtype=np.float64).reshape(-1)[:3]
    tgt = np.asarray(target_pos, dtype=np.float64).reshape(-1)[:3]
    return bool(np.linalg.norm(obj[:2] - tgt[:2]) < xy_tol and obj[2] - tgt[2] > z_tol)


#: an object whose centre of mass rose this far above where it started was lifted (a grasp), not nudged or knocked over
LIFTED_M = 0.03


def placement_outcome(
    poses: dict, object_name: str, target_name: str, other_object: str, other_target: str, other_lifted: bool
) -> dict:
    """The verdict of a scene with two objects and two targets, from the final `poses` (name -> position):

    success: the named object in the named target; wrong_target: the named object in the other target;
    wrong_object: the other object was lifted at some point (`other_lifted`) or ended in either target.
    """
    in_target = {t: placed_in(poses[object_name], poses[t]) for t in (target_name, other_target)}
    other_in = any(placed_in(poses[other_object], poses[t]) for t in (target_name, other_target))
    return {
        "success": in_target[target_name],
        "wrong_target": in_target[other_target],
        "wrong_object": bool(other_lifted or other_in),
    }
