"""Flow-matching UniPC multistep solver (predictor-corrector, order 2, B(h) = expm1(h), x0 parametrisation).

Written from the UniPC paper (Zhao et al. 2023) for flow-matching models, where the network predicts the velocity
v = noise - x0 and the noisy sample is x_t = (1 - sigma) * x0 + sigma * noise. It follows the step-for-step
behaviour of the Wan / DreamZero `FlowUniPCMultistepScheduler` the released models were tuned with:
- grid: sigma = linspace(sigma_max, 0, n+1)[:-1] with sigma_max = 0.999 (the largest of 1000 training sigmas),
  shifted by s*sigma / (1 + (s-1)*sigma); timestep = int(1000 * sigma) (truncated); final sigma 0;
- every step: corrector (UniC) on the previous prediction, then predictor (UniP); the first step is first order
  (warm-up) and so is the last ("lower order final"); the corrector uses the order of the previous predictor.

Usage (the caller writes the loop, diffusers style):
    sched = FlowUniPCScheduler(num_inference_steps=16, shift=5.0)
    for i, t in enumerate(sched.timesteps):
        x = sched.step(model(x, t), i, x)
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dreamzero.errors import ConfigError


def _shifted_sigmas(num_inference_steps: int, shift: float, num_train_timesteps: int) -> np.ndarray:
    """[n] float64 shifted sigmas, before the final 0 and before any cast."""
    if num_inference_steps < 1:
        raise ConfigError(f"pipeline.num_inference_steps must be >= 1, got {num_inference_steps}")
    if shift <= 0:
        raise ConfigError(f"pipeline.sigma_shift must be > 0, got {shift}")
    # the largest training sigma (0.999) as the float32 training table holds it
    sigma_max = float(np.float32(1.0 - 1.0 / num_train_timesteps))
    sigmas = np.linspace(sigma_max, 0.0, num_inference_steps + 1)[:-1]
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flow_sigmas(num_inference_steps: int, shift: float, num_train_timesteps: int = 1000) -> np.ndarray:
    """The shifted sigma grid with the final 0 appended: [n + 1] float32."""
    sigmas = _shifted_sigmas(num_inference_steps, shift, num_train_timesteps)
    return np.concatenate([sigmas, [0.0]]).astype(np.float32)


def flow_timesteps(num_inference_steps: int, shift: float, num_train_timesteps: int = 1000) -> np.ndarray:
    """Integer timesteps fed to the network: int(1000 * shifted sigma), truncated. [n] int64."""
    return (_shifted_sigmas(num_inference_steps, shift, num_train_timesteps) * num_train_timesteps).astype(np.int64)


class FlowUniPCScheduler:
    """Order-2 bh2 UniPC on flow predictions; one instance per trajectory batch (video or action)."""

    def __init__(self, num_inference_steps: int = 16, shift: float = 5.0, solver_order: int = 2):
        if solver_order not in (1, 2):
            raise ConfigError(f"solver_order must be 1 or 2, got {solver_order}")
        self.order = solver_order
        self.sigmas = flow_sigmas(num_inference_steps, shift)
        self.timesteps = flow_timesteps(num_inference_steps, shift)
        self.num_inference_steps = num_inference_steps
        # log-SNR lambda = log(alpha / sigma), alpha = 1 - sigma; +inf at the final sigma 0
        s = self.sigmas.astype(np.float64)
        with np.errstate(divide="ignore"):
            self._lambdas = np.log(1.0 - s) - np.log(s)
        self.reset()

    def reset(self) -> None:
        self._x0_preds: list[torch.Tensor] = []  # the last `order` data predictions, newest last
        self._last_sample: torch.Tensor | None = None
        self._last_order = 0
        self._next_step = 0

    # -- coefficients (float64 scalars) --------------------------------------------------------------------------------

    def _h(self, i: int) -> float:
        """Log-SNR step from sigma_i to sigma_{i+1}."""
        return float(self._lambdas[i + 1] - self._lambdas[i])

    @staticmethod
    def _phi(h: float) -> tuple[float, float]:
        """(h_phi_1, B(h)) for the x0 parametrisation (hh = -h); h = +inf on the final step to sigma 0."""
        h_phi_1 = math.expm1(-h) if math.isfinite(h) else -1.0
        return h_phi_1, h_phi_1  # bh2: B(h) = expm1(-h)

    def _update(self, i: int, sample: torch.Tensor, m0: torch.Tensor, diffs: list[torch.Tensor], rhos) -> torch.Tensor:
        """x_{i+1} = (sigma_{i+1}/sigma_i) x - alpha_{i+1} h_phi_1 m0 - alpha_{i+1} B(h) sum(rho_k D_k)."""
        sig_t, sig_s = float(self.sigmas[i + 1]), float(self.sigmas[i])
        alpha_t = 1.0 - sig_t
        h_phi_1, b_h = self._phi(self._h(i))
        out = sample.double() * (sig_t / sig_s) - m0.double() * (alpha_t * h_phi_1)
        for rho, diff in zip(rhos, diffs):
            out = out - diff.double() * (alpha_t * b_h * rho)
        return out.to(sample.dtype)

    # -- step ----------------------------------------------------------------------------------------------------------

    def step(self, model_output: torch.Tensor, step_index: int, sample: torch.Tensor) -> torch.Tensor:
        """Advance `sample` from sigma[step_index] to sigma[step_index + 1] given the flow prediction there."""
        if step_index != self._next_step:
            raise ValueError(f"step {step_index} called, expected step {self._next_step} (call reset() to restart)")
        i = step_index
        x0 = sample - float(self.sigmas[i]) * model_output  # data prediction

        # 1. corrector (UniC): refine the sample just reached with the new prediction
        if i > 0 and self._last_sample is not None:
            sample = self._correct(i, x0)

        self._x0_preds = (self._x0_preds + [x0])[-self.order :]
        # 2. predictor (UniP): warm-up first order, then `order`, and first order on the last step
        order = min(self.order, self.num_inference_steps - i, self._last_order + 1)
        self._last_sample, self._last_order = sample, order
        m0 = self._x0_preds[-1]
        if order == 2:
            r = (self._lambdas[i - 1] - self._lambdas[i]) / self._h(i)
            prev = (self._x0_preds[-2] - m0) / r
            out = self._update(i, sample, m0, [prev], [0.5])
        else:
            out = self._update(i, sample, m0, [], [])
        self._next_step += 1
        return out

    def _correct(self, i: int, x0_new: torch.Tensor) -> torch.Tensor:
        """UniC update of step i-1 -> i using the fresh prediction at step i."""
        j = i - 1  # the step being corrected
        m0 = self._x0_preds[-1]  # prediction at step j
        h = self._h(j)
        diffs, rhos = [], []
        if self._last_order == 2:
            r = (self._lambdas[j - 1] - self._lambdas[j]) / h
            # order-2 UniC: rho solves [[1, 1], [r, 1]] rho = [phi_2, 2 phi_3] / B(h) for (D_prev, D_new), with
            # phi_2 = h_phi_1/hh - 1, phi_3 = phi_2/hh - 1/2 (hh = -h): UniPC's R rho = b system at rks = (r, 1)
            hh = -h
            h_phi_1 = math.expm1(hh)
            b_h = h_phi_1
            k1 = h_phi_1 / hh - 1.0
            k2 = k1 / hh - 0.5
            b = np.array([k1 / b_h, k2 * 2.0 / b_h])
            rho = np.linalg.solve(np.array([[1.0, 1.0], [r, 1.0]]), b)
            diffs.append((self._x0_preds[-2] - m0) / r)
            rhos.append(float(rho[0]))
            rho_new = float(rho[1])
        else:
            rho_new = 0.5
        diffs.append(x0_new - m0)
        rhos.append(rho_new)
        return self._update(j, self._last_sample, m0, diffs, rhos)
