"""Flow-matching UniPC: the upstream timestep grid and the upstream trajectory step by step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dreamzero.errors import ConfigError
from dreamzero.model.scheduler import FlowUniPCScheduler, flow_sigmas, flow_timesteps

UPSTREAM_GRID = [999, 986, 972, 955, 937, 916, 892, 865, 833, 795, 749, 694, 624, 535, 416, 249]


def test_sixteen_step_shift_five_grid():
    assert flow_timesteps(16, 5.0).tolist() == UPSTREAM_GRID
    assert FlowUniPCScheduler(16, 5.0).timesteps.tolist() == UPSTREAM_GRID


def test_sigmas_end_at_zero_and_decrease():
    s = flow_sigmas(16, 5.0)
    assert s.shape == (17,) and s[-1] == 0.0
    assert np.all(np.diff(s) < 0)
    assert flow_timesteps(8, 1.0).tolist() == (np.linspace(0.999, 0, 9)[:-1] * 1000).astype(int).tolist()


def test_bad_settings_fail_with_the_field():
    with pytest.raises(ConfigError, match="num_inference_steps"):
        flow_sigmas(0, 5.0)
    with pytest.raises(ConfigError, match="sigma_shift"):
        flow_sigmas(16, 0.0)


def test_exact_velocity_lands_on_the_data():
    """With the true flow velocity (noise - x0) every UniPC step stays on the straight path and ends at x0."""
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    sched = FlowUniPCScheduler(16, 5.0)
    x = noise * float(sched.sigmas[0]) + x0 * (1 - float(sched.sigmas[0]))
    for i in range(16):
        x = sched.step(noise - x0, i, x)
        sigma = float(sched.sigmas[i + 1])
        torch.testing.assert_close(x, sigma * noise + (1 - sigma) * x0, atol=1e-5, rtol=0)


def test_steps_must_run_in_order():
    sched = FlowUniPCScheduler(4, 5.0)
    x = torch.zeros(2)
    sched.step(x, 0, x)
    with pytest.raises(ValueError, match="expected step 1"):
        sched.step(x, 2, x)
    sched.reset()
    sched.step(x, 0, x)


@pytest.mark.parametrize("chunk", [1, 2])
def test_matches_upstream_trajectory(chunk, parity_fixture):
    """Fed upstream's guided velocities, our solver retraces upstream's samples (video and action)."""
    v = np.load(parity_fixture / "vectors.npz")
    assert np.array_equal(FlowUniPCScheduler(16, 5.0).sigmas, v["scheduler_sigmas"])
    samples = torch.from_numpy(v[f"chunk{chunk}_video_samples"])  # [17, 1, 16, 2, 4, 8]
    velocity = torch.from_numpy(v[f"chunk{chunk}_cfg_video_velocity"])  # [16, 1, 16, 2, 4, 8]
    sched = FlowUniPCScheduler(16, 5.0)
    x = samples[0]
    for i in range(16):
        x = sched.step(velocity[i], i, x)
        assert (x - samples[i + 1]).abs().max().item() < 1e-5, f"step {i}"
