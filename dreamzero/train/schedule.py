"""Training-time flow-matching schedule: the sigma table, timestep sampling and the per-timestep loss weight.

Re-derived from upstream DreamZero's training scheduler (`FlowMatchScheduler(shift=5, sigma_min=0,
extra_one_step=True)` with `set_timesteps(1000, training=True)`), which the released checkpoints were trained with:
- table: sigma_i = shift(s_i), s = linspace(1, 0, 1001)[:-1], shift(s) = 5 s / (1 + 4 s); timestep_i = 1000 sigma_i;
- a training timestep is an index i drawn uniformly from [0, 1000) (one per latent block; "STANDARD" mode);
- noisy x_t = (1 - sigma) x0 + sigma eps, target v = eps - x0 (the network predicts the velocity);
- weight w_i = exp(-2 ((t_i - 500) / 1000)^2), shifted so its minimum is 0 and scaled to mean 1 over the table,
  which favours mid-range noise levels and gives the nearly clean end almost no weight.
"""

from __future__ import annotations

import torch

NUM_TRAIN_TIMESTEPS = 1000
SIGMA_SHIFT = 5.0


class TrainingSchedule:
    """Sigma / timestep / weight tables on one device (float32)."""

    def __init__(self, shift: float = SIGMA_SHIFT, num_timesteps: int = NUM_TRAIN_TIMESTEPS, device="cpu"):
        s = torch.linspace(1.0, 0.0, num_timesteps + 1, dtype=torch.float64)[:-1]
        sigmas = shift * s / (1 + (shift - 1) * s)
        timesteps = sigmas * num_timesteps
        bell = torch.exp(-2 * ((timesteps - num_timesteps / 2) / num_timesteps) ** 2)
        bell = bell - bell.min()
        weights = bell * (num_timesteps / bell.sum())
        self.num_timesteps = num_timesteps
        self.sigmas = sigmas.float().to(device)
        self.timesteps = timesteps.float().to(device)
        self.weights = weights.float().to(device)

    def sample_indices(self, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        """Uniform table indices (int64, on the generator's device)."""
        return torch.randint(0, self.num_timesteps, shape, generator=generator, device=generator.device)

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x_t for per-row indices idx [B] (broadcast over the trailing dims of x0)."""
        sigma = self.sigmas[idx.to(self.sigmas.device)].to(x0.device, x0.dtype)
        sigma = sigma.reshape(sigma.shape + (1,) * (x0.ndim - sigma.ndim))
        return (1 - sigma) * x0 + sigma * noise
