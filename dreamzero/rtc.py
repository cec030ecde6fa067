"""Real-time chunking (RTC): each new action chunk continues the chunk the robot is still executing.

Black, Galliker, Levine 2025 (arXiv 2506.07339, §4), training-free, as a soft clamp in x0 space (docs/rtc.md).
Indices: H = action horizon, d = inference delay (previous-chunk actions the robot executes while this chunk is
computed), s = execution horizon (previous-chunk actions executed before this chunk's observation was taken),
d <= s <= H - d. New action i aligns with previous action s + i, so the target is Y_i = prev[s + i] and the robot
switches to the new chunk at new action d (= previous action s + d).

Per scheduler step, with a the noisy actions at sigma and v the action velocity (flow: v = noise - x0):
    x0 = a - sigma v;   x0 += W (Y - x0);   v' = (a - x0) / sigma
with RTC's soft mask W (`soft_mask`), then a final exact write of the first d actions. `W = 0` wherever Y is unknown
(padded or constant dims, rows past the previous chunk), and rows that do not ask for RTC keep v bit for bit.

Units: a session keeps its last chunk in robot units (the affine map `robot = gain * model + bias` that postprocess
applies before the gripper rule, carried per row in ModelBatch.action_gain / action_bias) and re-encodes it with the
map of the NEW state, so relative actions (DROID joint deltas) are re-based on the joints the robot has now. Without
a map (the normalised form) everything stays in normalised units.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dreamzero.errors import InvalidObservation
from dreamzero.sessions import PreviousChunk, SessionState
from dreamzero.types import ModelBatch

#: where a row's target came from, reported per session (`SessionReport.rtc`)
SOURCES = ("client_prefix", "session_cache", "cold_start")
#: restarts of the model state that leave the robot moving: the previous chunk is still what it executes
CARRIED_ACROSS = ("prompt_changed", "single_frame", "window_full")


# ----------------------------------------------------------------------------------------------------------------------
# 1. The soft mask
# ----------------------------------------------------------------------------------------------------------------------


def soft_mask(horizon: int, d: int, s: int) -> np.ndarray:
    """W [horizon] float64: 1 for i < d; c_i (e^c_i - 1) / (e - 1), c_i = (H-s-i) / (H-s-d+1), for d <= i < H-s;
    0 from H - s on (the previous chunk ends there). Needs 0 <= d <= s <= H - d."""
    if not 0 <= d <= s <= horizon - d:
        raise ValueError(f"soft_mask needs 0 <= d ({d}) <= s ({s}) <= H - d ({horizon - d})")
    i = np.arange(horizon, dtype=np.float64)
    c = (horizon - s - i) / (horizon - s - d + 1)
    w = np.where(i < horizon - s, c * np.expm1(c) / (math.e - 1.0), 0.0)
    w[:d] = 1.0
    return w


# ----------------------------------------------------------------------------------------------------------------------
# 2. Per-row requests (validated before any session is touched)
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class RowRequest:
    d: int  # inference delay: new actions [0, d) are the previous chunk's, written exactly
    s: int  # execution horizon: new action i aligns with previous action s + i
    prefix: np.ndarray | None  # float64 [P, D] client prefix (row i = new action i), None -> the session's chunk


def _per_row(batch: ModelBatch, name: str) -> list:
    value = getattr(batch, name)
    if value is None:
        return [None] * len(batch)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != len(batch):
        got = len(value) if hasattr(value, "__len__") else type(value).__name__
        raise InvalidObservation(f"{name} needs one entry per row ({len(batch)}), got {got}", field=name)
    return list(value)


def _count(value, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InvalidObservation(f"{name} entries must be non-negative integers or None, got {value!r}", field=name)
    return int(value)


def _prefix(value, max_action_dim: int) -> np.ndarray | None:
    if value is None:
        return None
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidObservation("action_prefix rows must be numeric [P, D] arrays", field="action_prefix") from None
    if arr.ndim != 2 or arr.shape[0] < 1 or not 1 <= arr.shape[1] <= max_action_dim:
        raise InvalidObservation(
            f"action_prefix rows must be [P >= 1, 1 <= D <= {max_action_dim}], got shape {arr.shape}",
            field="action_prefix",
        )
    if not np.isfinite(arr).all():
        raise InvalidObservation("action_prefix holds NaN or inf", field="action_prefix")
    return arr


def _check_codec(batch: ModelBatch, max_action_dim: int) -> None:
    gain, bias = batch.action_gain, batch.action_bias
    if (gain is None) != (bias is None):
        name = "action_bias" if gain is not None else "action_gain"
        raise InvalidObservation(f"{name} is missing: action_gain and action_bias come together", field=name)
    want = (len(batch), max_action_dim)
    for name, value in (("action_gain", gain), ("action_bias", bias)):
        if value is None:
            continue
        if not isinstance(value, np.ndarray) or value.shape != want:
            raise InvalidObservation(f"{name} must be float [B, {want[1]}], got {getattr(value, 'shape', value)}", name)
        if not np.isfinite(value).all():
            raise InvalidObservation(f"{name} holds NaN or inf", field=name)


def requests(batch: ModelBatch, horizon: int, max_action_dim: int) -> list[RowRequest | None]:
    """Each row's RTC request (None: not asked). d = rtc_prefix_len, else the client prefix's length, else 0 (off);
    s = rtc_exec_horizon, else H - P for a client prefix of P rows, else H - d. Errors name the field."""
    _check_codec(batch, max_action_dim)
    lens, horizons = _per_row(batch, "rtc_prefix_len"), _per_row(batch, "rtc_exec_horizon")
    prefixes = _per_row(batch, "action_prefix")
    out: list[RowRequest | None] = []
    for i in range(len(batch)):
        d, s = _count(lens[i], "rtc_prefix_len"), _count(horizons[i], "rtc_exec_horizon")
        prefix = _prefix(prefixes[i], max_action_dim)
        if d is None:
            d = 0 if prefix is None else prefix.shape[0]
        if d == 0:
            out.append(None)
            continue
        if 2 * d > horizon:
            name = "rtc_prefix_len" if lens[i] is not None else "action_prefix"  # d defaults to the prefix length
            raise InvalidObservation(
                f"{name}: d = {d} (row {i}) leaves no valid execution horizon: RTC needs d <= s <= H - d, so "
                f"d <= {horizon // 2} for H = {horizon}",
                field=name,
            )
        if prefix is not None and prefix.shape[0] < d:
            raise InvalidObservation(
                f"action_prefix (row {i}) has {prefix.shape[0]} actions, rtc_prefix_len asks for {d}",
                field="action_prefix",
            )
        field = "rtc_exec_horizon"
        if s is None:
            s, field = (horizon - d, field) if prefix is None else (horizon - prefix.shape[0], "action_prefix")
        if not d <= s <= horizon - d:
            because = "" if field == "rtc_exec_horizon" else f" (a {prefix.shape[0]}-action prefix implies s = H - P)"
            raise InvalidObservation(
                f"RTC needs d <= s <= H - d; row {i} has d = {d}, s = {s}{because}, H = {horizon}", field=field
            )
        out.append(RowRequest(d, s, prefix))
    return out


# ----------------------------------------------------------------------------------------------------------------------
# 3. Units: model (normalised) <-> robot
# ----------------------------------------------------------------------------------------------------------------------


def to_robot(actions: np.ndarray, gain: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Model actions [..., A] -> robot units; NaN where gain is 0 (the dim carries no robot meaning)."""
    return np.where(gain != 0, gain * actions + bias, np.nan)


def to_model(robot: np.ndarray, gain: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Robot actions [..., A] -> model units under this row's map; NaN where gain is 0."""
    safe = np.where(gain != 0, gain, 1.0)
    return np.where(gain != 0, (robot - bias) / safe, np.nan)


def remember(batch: ModelBatch, row: int, actions: np.ndarray) -> PreviousChunk:
    """What a session keeps of the chunk it returns: [H, A] in robot units when the row has a map, else normalised."""
    actions = np.asarray(actions, np.float64)
    if batch.action_gain is None:
        return PreviousChunk(actions.copy(), "normalised")
    return PreviousChunk(to_robot(actions, batch.action_gain[row], batch.action_bias[row]), "robot")


def carried_chunk(state: SessionState | None, reason: str | None) -> PreviousChunk | None:
    """The previous chunk a restarted session keeps: only across restarts that do not stop the robot."""
    return state.prev_chunk if state is not None and reason in CARRIED_ACROSS else None


# ----------------------------------------------------------------------------------------------------------------------
# 4. The guide the denoising loop calls
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class ActionGuide:
    """Targets and weights for G rows of actions [G, A, ad] (fp32, on the model's device)."""

    target: torch.Tensor  # Y in model units, 0 where the weight is 0
    weight: torch.Tensor  # W per action and dim
    hard: torch.Tensor  # bool: the first d actions on known dims, written exactly at the end

    def velocity(self, a: torch.Tensor, v: torch.Tensor, sigma: float) -> torch.Tensor:
        """The clamped velocity for the step at `sigma`. Written as v - W (Y - x0) / sigma, which equals
        (a - x0') / sigma with x0' = x0 + W (Y - x0), so that wherever W is 0 v comes back bit for bit."""
        x0 = a - sigma * v
        return v - self.weight * (self.target - x0) / sigma

    def finish(self, a: torch.Tensor) -> torch.Tensor:
        """The final hard write of the prefix."""
        return torch.where(self.hard, self.target, a)


def row_target(req: RowRequest, prev: PreviousChunk | None, units: str, gain, bias, width: int):
    """Y [m, width] in model units (NaN = unknown) and its source, or (None, "cold_start")."""
    if req.prefix is not None:
        y = np.full((req.prefix.shape[0], width), np.nan)
        y[:, : req.prefix.shape[1]] = req.prefix
        source = "client_prefix"
    elif prev is not None and prev.units == units:
        y, source = prev.actions[req.s :], "session_cache"  # Y_i = prev[s + i]
    else:
        return None, "cold_start"
    if gain is not None:
        y = to_model(y, gain, bias)
    return y, source


def plan(
    batch: ModelBatch, states: list[SessionState], horizon: int, shape: tuple[int, int], device: torch.device
) -> tuple[ActionGuide | None, list[str | None]]:
    """The guide for the rows of `batch` (states in batch order) and each row's source (None: RTC not asked).

    `shape` is the model's action block (rows A >= horizon, dims ad); a client prefix wins over the session's chunk;
    with neither (or a chunk in other units) the row starts cold. None when no row is steered: the loop is today's.
    """
    n_act, width = shape
    reqs = requests(batch, horizon, width)
    units = "normalised" if batch.action_gain is None else "robot"
    target, weight = np.zeros((len(states), n_act, width)), np.zeros((len(states), n_act, width))
    hard = np.zeros((len(states), n_act, width), bool)
    sources: list[str | None] = [None] * len(states)
    for row, (req, state) in enumerate(zip(reqs, states)):
        if req is None:
            continue
        gain = None if batch.action_gain is None else batch.action_gain[row]
        bias = None if batch.action_bias is None else batch.action_bias[row]
        y, sources[row] = row_target(req, state.prev_chunk, units, gain, bias, width)
        if y is None:
            continue
        y = y[: horizon - req.s]  # the previous chunk ends at new action H - s
        known = np.isfinite(y)
        m = y.shape[0]
        target[row, :m] = np.where(known, y, 0.0)
        weight[row, :m] = np.where(known, soft_mask(horizon, req.d, req.s)[:m, None], 0.0)
        hard[row, : req.d] = known[: req.d]
    if not weight.any():
        return None, sources
    guide = ActionGuide(
        torch.from_numpy(target.astype(np.float32)).to(device),
        torch.from_numpy(weight.astype(np.float32)).to(device),
        torch.from_numpy(hard).to(device),
    )
    return guide, sources
