"""Per-stage wall time of one `generate` call (`ChunkResult.timings_ms`)."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class StageTimer:
    """Accumulates wall time per stage; synchronises CUDA so GPU work is charged to the stage that queued it."""

    def __init__(self, device: torch.device):
        self.ms: dict[str, float] = defaultdict(float)
        self._cuda = device.type == "cuda"

    @contextmanager
    def __call__(self, stage: str):
        if self._cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._cuda:
                torch.cuda.synchronize()
            self.ms[stage] += (time.perf_counter() - t0) * 1000.0
