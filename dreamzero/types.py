"""Plain data that crosses the boundaries between transforms, the model and the serving graph.

Everything here is numpy + builtins so it travels over Ray (and msgpack) without torch.
Shapes: B = batch rows (one row per session), T = frames, H/W = pixels, D = padded dims.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# the restart reasons are the wire's own (clients read them from each session report)
from dreamzero_client.wire.replies import RESTART_REASONS

__all__ = ["RESTART_REASONS", "ROW_OPTIONS", "ChunkResult", "ModelBatch", "SessionReport"]


@dataclass
class SessionReport:
    """Per-session continuity report, returned for every row of every response."""

    session_id: str
    step: int  # number of chunks this session has produced on this replica, including this one (1 after a restart)
    restarted: bool  # True if the state was (re)started for this call
    restart_reason: str | None  # one of RESTART_REASONS when restarted, else None
    frame_position: int  # current_start_frame after this call (latent frames)
    incarnation: str | None = None  # random id of this session state, new at every (re)start; echo it back
    rtc: str | None = None  # real-time chunking: "client_prefix" | "session_cache" | "cold_start"; None = not asked

    def to_dict(self) -> dict:
        extra = {} if self.rtc is None else {"rtc": self.rtc}
        return {
            "session_id": self.session_id,
            "step": self.step,
            "restarted": self.restarted,
            "restart_reason": self.restart_reason,
            "frame_position": self.frame_position,
            "incarnation": self.incarnation,
            **extra,
        }


@dataclass
class ModelBatch:
    """Normalised model inputs for B sessions: what the Policy deployment / pipeline consumes.

    This is exactly the "normalised form" RLinf sends, plus routing/session fields; the server builds it from a wire
    request (`deployments.preprocess`: `normalised_batch`, or the embodiment's transforms for the raw form).
    """

    images: np.ndarray  # uint8 [B, T, H, W, 3]: the stitched canvas, T in {1, 4} (T=4 stacks; 1 = single frame)
    state: np.ndarray  # float32 [B, 1, max_state_dim]: q99-normalised, zero padded
    state_mask: np.ndarray  # bool [B, 1, max_state_dim]
    prompts: list[str]  # B formatted prompts (template already applied)
    session_ids: list[str]  # B unique, non-empty
    negative_prompts: list[str] | None = None  # B strings; None -> the embodiment's/model default negative prompt
    reset_mask: list[bool] | None = None  # B bools; None -> all False
    expected_steps: list[int | None] | None = None  # per row: the step count the client believes the session is at
    # per row: the `incarnation` of the session state the client continued last (from SessionReport); with the step
    # it identifies the state exactly, so stale state whose step happens to match is never reused
    expected_incarnations: list[str | None] | None = None
    seeds: list[int] | None = None  # per row noise seed; None -> 1140 (every reference client's seed)
    embodiment_id: list[int] | None = None  # accepted for wire compatibility; ignored by the DiT (forced to 0)
    # real-time chunking (docs/rtc.md), per row; None everywhere = off and the chunk is exactly today's
    rtc_prefix_len: list[int | None] | None = None  # d: previous-chunk actions the robot runs while this one computes
    # s: previous-chunk actions run before this observation; None -> H - len(action_prefix row) or H - d
    rtc_exec_horizon: list[int | None] | None = None
    # per row None or [P, D] (P >= d): the previous chunk from this observation on (row i = new action i), robot
    # units when action_gain is set, else normalised; wins over the chunk the session cached
    action_prefix: list[np.ndarray | None] | None = None
    # float64 [B, max_action_dim] each: robot = gain * model + bias, the map postprocess applies before the gripper
    # rule for this row's state (gain 0: padding / constant dim); None = the normalised form (identity)
    action_gain: np.ndarray | None = None
    action_bias: np.ndarray | None = None
    # the key the caller routed this request by (`handle.options(session_id=key)`: explicit routing key, else the
    # first session id); the Policy replica reports the keys it holds so the session router keeps them there
    routing_key: str | None = None
    # per row: decode this chunk's predicted video (`ChunkResult.video`); None = no row asks, nothing is decoded
    return_video: list[bool] | None = None
    # the fleet's per-row fields (docs/fleet.md): "realtime" (a robot) or "batch" (an evaluation farm), set by the
    # door from the request, the tenant or the door's default; None = every row realtime
    traffic_class: list[str] | None = None
    # per row: when the client's buffer of actions runs out, wall clock (time.time() seconds); None = not stated
    deadline_at: list[float | None] | None = None

    def __len__(self) -> int:
        return len(self.session_ids)


#: the per-row options of a `ModelBatch` (beside its arrays, prompts and ids): name -> (what a row that leaves it unset
#: stands for, whether merged requests always get a list). Merged requests fill their unset rows with it
#: (deployments.batch_merge; `seeds` with the pipeline's default seed); the server sets them from the request's
#: `RowOptions` (deployments.requests.rows).
ROW_OPTIONS: dict[str, tuple[object, bool]] = {
    "negative_prompts": (None, False),  # all rows of a merge set it or none do (their stack key)
    "reset_mask": (False, True),
    "expected_steps": (None, True),
    "expected_incarnations": (None, True),
    "seeds": (None, True),
    "rtc_prefix_len": (None, False),
    "rtc_exec_horizon": (None, False),
    "action_prefix": (None, False),
    "return_video": (False, False),
    "traffic_class": ("realtime", False),
    "deadline_at": (None, False),
}


@dataclass
class ChunkResult:
    """Output of one pipeline call for a batch."""

    actions: np.ndarray  # float32 [B, action_horizon, max_action_dim=32], normalised, padded
    sessions: list[SessionReport]
    video_latents: np.ndarray | None = None  # float32 [B, z, 2, h, w] predicted latents (None unless requested)
    timings_ms: dict[str, float] = field(default_factory=dict)  # ms per stage: text, vae, prefill, denoise, ...
    dit_steps: int = 0  # DiT forward steps actually run (after static mask / dynamic skipping)
    # per row uint8 [T, H, W, 3] at the model-input canvas (T = 4 * num_frame_per_block) when the row asked
    # (`ModelBatch.return_video`), else None; None when no row asked
    video: list[np.ndarray | None] | None = None
