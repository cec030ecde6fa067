"""State noise with relabelled targets: teach a relative-action policy to head for where the expert was going.

A policy served in closed loop starts each chunk from where its last chunk ended, a little off the expert's path;
teacher-forced training only ever shows it the expert's own states, so it learns to add the expert's deltas to
wherever it is, and the offsets add up chunk after chunk. Here each block's state gets Gaussian noise n (raw units,
on the state keys that relative actions are added to) and the block's action targets are relabelled to reach the
same absolute joints: delta' = (expert target - (state + n)) = delta - n. The images are left alone, so they still
show the arm where it was (a small inconsistency the policy sees in closed loop too: the wrist camera moves with the
arm, the state says where it is). Applied to encoded batches, after the encoding cache: each step draws new noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dreamzero.embodiments.base import Embodiment
from dreamzero.errors import ConfigError


@dataclass(frozen=True)
class StateNoisePlan:
    """Model-width columns of the perturbed state dims and of the action dims relabelled with them, and the scale from
    raw units to each normalised column (2 / span)."""

    state_cols: np.ndarray  # [D] int
    action_cols: np.ndarray  # [D] int
    state_scale: np.ndarray  # [D] float
    action_scale: np.ndarray  # [D] float


def _columns(keys, normalisers) -> dict[str, np.ndarray]:
    out, start = {}, 0
    for key in keys:
        dim = normalisers[key].dim
        out[key] = np.arange(start, start + dim)
        start += dim
    return out


def state_noise_plan(embodiment: Embodiment) -> StateNoisePlan:
    """The plan for `embodiment`'s relative actions; an embodiment without any has nothing to relabel."""
    if not embodiment.relative_actions:
        raise ConfigError(f"state_noise: {embodiment.tag} has no relative actions, so there is nothing to relabel")
    state_at = _columns(embodiment.state_keys, embodiment.state_normalisers)
    action_at = _columns(embodiment.action_keys, embodiment.action_normalisers)
    s_cols, a_cols, s_scale, a_scale = [], [], [], []
    for rule in embodiment.relative_actions:
        s_norm, a_norm = embodiment.state_normalisers[rule.state_key], embodiment.action_normalisers[rule.action_key]
        s_span, a_span = s_norm.q99 - s_norm.q01, a_norm.q99 - a_norm.q01
        # constant dims carry no information (postprocess maps them to their constant): leave them alone
        keep = (s_span > 0) & (a_span > 0)
        s_cols.append(state_at[rule.state_key][keep])
        a_cols.append(action_at[rule.action_key][keep])
        s_scale.append(2.0 / s_span[keep])
        a_scale.append(2.0 / a_span[keep])
    return StateNoisePlan(*(np.concatenate(x) for x in (s_cols, a_cols, s_scale, a_scale)))


def perturb_states(
    state: torch.Tensor,
    actions: torch.Tensor,
    plan: StateNoisePlan,
    sigma: float,
    generator: torch.Generator | None,
    unit_noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """New (state [B, K, 1, S], actions [B, K, A, D]) with noise of std `sigma` (raw units) per block and dim; both
    stay in [-1, 1] as training targets always are. `unit_noise` [B, K, D]: standard normal draws made beforehand (a
    distributed step's rows of the global batch's); None draws them from `generator`."""
    b, k = state.shape[:2]
    if unit_noise is None:
        unit_noise = draw_state_noise(plan, generator, b, k)
    noise = unit_noise.to(state.device) * sigma
    state, actions = state.clone(), actions.clone()
    s_cols, a_cols = torch.as_tensor(plan.state_cols), torch.as_tensor(plan.action_cols)
    s_scale = torch.as_tensor(plan.state_scale, dtype=state.dtype, device=state.device)
    a_scale = torch.as_tensor(plan.action_scale, dtype=actions.dtype, device=actions.device)
    state[:, :, 0, s_cols] = (state[:, :, 0, s_cols] + noise * s_scale).clamp(-1.0, 1.0)
    actions[:, :, :, a_cols] = (actions[:, :, :, a_cols] - (noise * a_scale)[:, :, None, :]).clamp(-1.0, 1.0)
    return state, actions


def draw_state_noise(plan: StateNoisePlan, generator: torch.Generator, rows: int, blocks: int) -> torch.Tensor:
    """Standard normal [rows, blocks, D] on the generator's device (the draw `perturb_states` makes)."""
    return torch.randn((rows, blocks, len(plan.state_cols)), generator=generator, device=generator.device)
