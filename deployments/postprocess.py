"""Postprocess deployment (CPU): normalised, padded action chunks -> robot actions.

Slice per action key, un-normalise, relative -> absolute with the request's own current state (which travels with
the request in the `PostprocessContext`, never in a side table), then the embodiment's gripper rule.
"""

from __future__ import annotations

import numpy as np

from deployments.config.settings import StageSettings
from deployments.preprocess import load_embodiment
from dreamzero.embodiments import PostprocessContext


class PostprocessDeployment:
    def __init__(self, settings: StageSettings | None = None):
        # statistics as data: the checkpoint is never read
        self.embodiment = load_embodiment((settings or StageSettings()).embodiment)

    def run(self, actions: np.ndarray, context: PostprocessContext) -> np.ndarray:
        """[B, H, 32] normalised -> float32 [B, H, action_dim] (8 for DROID)."""
        return self.embodiment.postprocess(actions, context)

    def ready(self) -> bool:
        return True
