"""The DROID sim success heuristic, shared by every simulator adapter.

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
