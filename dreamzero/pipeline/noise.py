"""The starting noise of each row: from the row's seed on a CPU generator, so that a session's chunk does not depend
on the batch it shares or the device (or the caller's noise, for parity tests and replays)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from dreamzero.pipeline.rows import Row


def row_noise(
    rows: list[Row], shape_v: tuple, shape_a: tuple[int, int], noise: Mapping | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row noise from the row's seed on a CPU generator (or the caller's), fp32 on the model device.

    Video noise [G, *shape_v], action noise [G, *shape_a]; `noise` ({"video": [B, ...], "action": [B, ...]}, batch
    rows) replaces the seeded noise.
    """
    if noise is not None:
        v = torch.as_tensor(np.asarray(noise["video"]))[[r.index for r in rows]].float()
        a = torch.as_tensor(np.asarray(noise["action"]))[[r.index for r in rows]].float()
        if tuple(v.shape[1:]) != tuple(shape_v) or tuple(a.shape[1:]) != shape_a:
            raise ValueError(f"noise shapes {tuple(v.shape)}, {tuple(a.shape)}; want [B, *{shape_v}], [B, *{shape_a}]")
        return v.to(device), a.to(device)
    vs, acts = [], []
    for r in rows:
        # a fresh generator per tensor, as upstream re-seeds per call: identical across calls and batch layouts
        vs.append(torch.randn(shape_v, generator=torch.Generator().manual_seed(r.seed)))
        acts.append(torch.randn(shape_a, generator=torch.Generator().manual_seed(r.seed)))
    return torch.stack(vs).to(device), torch.stack(acts).to(device)
