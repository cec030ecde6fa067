"""A tiny deterministic stand-in for DreamZeroPipeline (same interface), used only while the real one is missing.

Actions encode (session step, row) so tests can see which session state produced them.
"""

from __future__ import annotations

import numpy as np

from dreamzero.config import preset
from dreamzero.types import ChunkResult, ModelBatch, SessionReport


class FakePipeline:
    action_horizon = 24
    max_action_dim = 32

    def __init__(self, max_sessions: int = 128, **_: object):
        self.config = preset("tiny")
        self.max_sessions = max_sessions
        self.sessions: dict[str, dict] = {}
        self.calls: list[int] = []

    @classmethod
    def load(cls, **kwargs: object) -> FakePipeline:
        return cls(**kwargs)

    def generate(self, batch: ModelBatch) -> ChunkResult:
        self.calls.append(len(batch))
        reports = []
        for i, sid in enumerate(batch.session_ids):
            state = self.sessions.get(sid)
            reason = None
            if state is None:
                reason = "new_session"
            elif batch.reset_mask and batch.reset_mask[i]:
                reason = "reset_requested"
            elif batch.expected_steps and batch.expected_steps[i] is not None and batch.expected_steps[i] != state["step"]:
                reason = "step_mismatch"
            elif state["prompt"] != batch.prompts[i]:
                reason = "prompt_changed"
            if reason is not None:
                state = self.sessions[sid] = {"step": 0, "prompt": batch.prompts[i]}
            state["step"] += 1
            reports.append(SessionReport(sid, state["step"], reason is not None, reason, 2 * state["step"] - 1))
        actions = np.zeros((len(batch), self.action_horizon, self.max_action_dim), np.float32)
        actions[:, :, 0] = np.array([r.step for r in reports], np.float32)[:, None] / 100.0
        return ChunkResult(actions=actions, sessions=reports, timings_ms={"denoise": 0.1})

    def reset_sessions(self, ids: list[str]) -> None:
        for sid in ids:
            self.sessions.pop(sid, None)

    def drop_sessions(self, ids: list[str]) -> None:
        self.reset_sessions(ids)

    def stats(self) -> dict:
        return {"live": len(self.sessions), "evictions": 0}
