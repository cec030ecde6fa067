"""Which scheduler steps run the DiT: the static mask (`pipeline.dit_step_mask`), every step, or the dynamic
cosine-similarity rule (`pipeline.dynamic_skip`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dreamzero.config import PipelineConfig


class StepPlan:
    """Which scheduler steps run the DiT: the static mask, every step, or the dynamic cosine-similarity rule."""

    def __init__(self, cfg: PipelineConfig):
        self.cfg = cfg
        self._skip_left = 0
        self._prev_v: torch.Tensor | None = None

    def should_run(self, i: int) -> bool:
        if self.cfg.dynamic_skip:
            if i < self.cfg.dynamic_skip_warmup or self._skip_left == 0:
                return True
            self._skip_left -= 1
            return False
        mask = self.cfg.dit_step_mask
        return True if mask is None else bool(mask[i])

    def observe(self, i: int, v: torch.Tensor) -> None:
        """After a DiT step: compare the guided video velocity with the previous one and plan the next skip.

        Rows of one forward share the decision, so the least similar row decides (min over rows).
        """
        if not self.cfg.dynamic_skip:
            return
        # the first `warmup` steps always run; from the last of them on, a similar pair may skip the next steps
        if self._prev_v is not None and i >= self.cfg.dynamic_skip_warmup - 1:
            sim = F.cosine_similarity(v.flatten(1).float(), self._prev_v.flatten(1).float(), dim=1).min().item()
            for thr, n in sorted(self.cfg.dynamic_skip_thresholds, reverse=True):
                if sim > thr:
                    self._skip_left = n
                    break
        self._prev_v = v
