"""In-process policies: raw observation + session ids -> robot actions, with no Ray and no server.

    policy = EmbeddedPolicy.load()                        # the shipped trained default, as serve_config.yaml
    policy = EmbeddedPolicy.load(None)                    # the random tiny model, DROID, synthetic statistics
    policy = EmbeddedPolicy.load("/ckpt/DreamZero-DROID")  # a real checkpoint (its experiment_cfg/metadata.json)
    out = policy.infer(observation, "robot-0", "pick up the cup")   # unbatched: out.actions is [24, 8]
    policy.reset(["robot-0"])

`ReplayPolicy` answers with the recorded actions of a LeRobot episode behind the same interface, to debug a wire
protocol or a robot loop without weights.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dreamzero.embedded_default import SHIPPED_DEFAULT
from dreamzero.embodiments import Embodiment, get_embodiment
from dreamzero.errors import ConfigError, InvalidRequest
from dreamzero.lerobot_dataset import ColumnSlice, LeRobotDataset, get_preset
from dreamzero.metadata import EmbodimentMetadata
from dreamzero.session_notice import SingleFrameNotice
from dreamzero.types import SessionReport

logger = logging.getLogger(__name__)

#: what `EmbeddedPolicy.load()` loads when given no path: the trained model serve_config.yaml serves, so that a
#: newcomer's first call predicts like the server's; `None` still picks the random tiny model
DEFAULT_MODEL = SHIPPED_DEFAULT


@dataclass
class PolicyResult:
    """Robot actions for B sessions ([H, D] when the observation was unbatched) and one report per session."""

    actions: np.ndarray  # float32 [B, H, D] or [H, D]
    sessions: list[SessionReport]
    timings_ms: dict[str, float] = field(default_factory=dict)
    video: np.ndarray | None = None  # uint8 [B, T, H, W, 3] (or [T, H, W, 3]) predicted frames, when asked


# ---------------------------------------------------------------------------------------------------------------------
# 1. Per-row request arguments
# ---------------------------------------------------------------------------------------------------------------------


def _per_row(value, n: int, name: str) -> list | None:
    """None -> None; a scalar -> n copies; a sequence -> checked to have n items."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        return [value] * n
    items = list(value)
    if len(items) != n:
        raise InvalidRequest(f"{name}: expected {n} values (one per row), received {len(items)}")
    return items


def _session_ids(session_ids, n: int) -> list[str]:
    ids = [session_ids] if isinstance(session_ids, str) else list(session_ids or [])
    if len(ids) != n:
        raise InvalidRequest(f"session_ids: expected {n} ids (one per observation row), received {len(ids)}")
    if any(not isinstance(s, str) or not s for s in ids):
        raise InvalidRequest(f"session_ids: every id must be a non-empty string, received {ids}")
    if len(set(ids)) != n:
        raise InvalidRequest(f"session_ids: ids must be unique within a request, received {ids}")
    return ids


def _reset_mask(reset, n: int) -> list[bool]:
    mask = _per_row(bool(reset) if isinstance(reset, (bool, np.bool_)) else reset, n, "reset")
    return [bool(r) for r in mask] if mask is not None else [False] * n


def _action_prefix(prefix, n: int, batched: bool, action_dim: int) -> list[np.ndarray | None] | None:
    """RLDX-1's `action_prefix`: [P, D] (every row, or the one row of an unbatched call), [B, P, D], or B entries
    of [P, D] / None; robot units, D = the embodiment's action dims."""
    if prefix is None:
        return None
    try:
        arr = np.asarray(prefix, np.float64)
    except (TypeError, ValueError):  # ragged, or rows left out with None: one entry per row
        arr = None
    if arr is None:
        rows = [None if p is None else np.asarray(p, np.float64) for p in prefix]
    elif arr.ndim == 2:
        rows = [arr] * n
    elif arr.ndim == 3 and batched:
        rows = list(arr)
    else:
        want = "[B, P, D] or [P, D]" if batched else "[P, D]"
        raise InvalidRequest(f"action_prefix: expected {want}, received shape {arr.shape}")
    if len(rows) != n:
        raise InvalidRequest(f"action_prefix: expected {n} rows (one per observation row), received {len(rows)}")
    for p in rows:
        if p is not None and (p.ndim != 2 or p.shape[1] != action_dim):
            raise InvalidRequest(f"action_prefix: rows must be [P, {action_dim}] robot actions, received {p.shape}")
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# 2. The embedded policy
# ---------------------------------------------------------------------------------------------------------------------


class EmbeddedPolicy:
    """Embodiment transforms -> DreamZero pipeline -> inverse transforms, in this process."""

    def __init__(self, pipeline, embodiment: Embodiment):
        horizon = getattr(pipeline, "action_horizon", embodiment.action_horizon)
        if horizon != embodiment.action_horizon:
            raise ConfigError(
                f"the model predicts {horizon}-step chunks, embodiment {embodiment.tag} expects "
                f"{embodiment.action_horizon}: pick the embodiment the checkpoint was trained for"
            )
        self.pipeline = pipeline
        self.embodiment = embodiment
        self._warn_single_frame = SingleFrameNotice(logger)

    @classmethod
    def load(
        cls,
        model_path: str | Path | None = DEFAULT_MODEL,
        embodiment: str | None = None,
        metadata: EmbodimentMetadata | dict | str | Path | None = None,
        device=None,
        **pipeline_kwargs,
    ) -> EmbeddedPolicy:
        """Load a checkpoint and its embodiment.

        model_path: a checkpoint of any layout, `embedded:<name>` (a model shipped in the package), or None (the
        random tiny model); left out: `DEFAULT_MODEL`, the shipped trained default.
        embodiment: a tag; None -> the checkpoint config's tag (oxe_droid for the tiny default).
        metadata: None -> `<model_path>/experiment_cfg/metadata.json` when it exists, else the shipped synthetic file.
        """
        from dreamzero.embedded_default import resolve_model_path
        from dreamzero.pipeline import DreamZeroPipeline  # torch-heavy; keep `import dreamzero.policy` light

        if isinstance(model_path, str):
            model_path = resolve_model_path(model_path)  # "embedded:<name>" -> the shipped folder; others as given
        pipeline = DreamZeroPipeline.load(model_path, device=device, **pipeline_kwargs)
        model_config = getattr(pipeline.model, "config", None)
        tag = embodiment or getattr(model_config, "embodiment_tag", None) or "oxe_droid"
        if metadata is None and model_path is not None:
            candidate = Path(model_path) / "experiment_cfg" / "metadata.json"
            metadata = candidate if candidate.is_file() else None
            if metadata is None:
                logger.warning("%s has no experiment_cfg/metadata.json: using the SYNTHETIC statistics", model_path)
        return cls(pipeline, get_embodiment(tag, metadata))

    def infer(
        self,
        observation: dict,
        session_ids: str | Sequence[str],
        instructions: str | Sequence[str | None] | None = None,
        reset: bool | Sequence[bool] = False,
        seed: int | Sequence[int] | None = None,
        expected_steps: int | Sequence[int | None] | None = None,
        rtc_prefix_len: int | Sequence[int | None] | None = None,
        action_prefix: np.ndarray | Sequence[np.ndarray | None] | None = None,
        rtc_exec_horizon: int | Sequence[int | None] | None = None,
        return_video: bool = False,
    ) -> PolicyResult:
        """One action chunk per session. An unbatched observation gives actions [H, D] (session_ids may be a str).
        `return_video`: the result also holds the predicted frames of the chunk (`video`, docs/model.md).

        Real-time chunking (docs/rtc.md), per row or one value for all: `rtc_prefix_len` d = actions of the previous
        chunk the robot executes while this one computes; `rtc_exec_horizon` s = actions of it executed before this
        observation (default H - d); `action_prefix` [P, D] robot actions from this observation on, which win over
        the chunk the session kept. The first d actions returned are then the previous chunk's; skip them.
        """
        t0 = time.perf_counter()
        batch, context = self.embodiment.preprocess(observation, instructions)
        n = len(batch)
        model_batch = batch.to_model_batch(
            _session_ids(session_ids, n),
            reset_mask=_reset_mask(reset, n),
            expected_steps=_per_row(expected_steps, n, "expected_steps"),
            seeds=_per_row(seed, n, "seed"),
            rtc_prefix_len=_per_row(rtc_prefix_len, n, "rtc_prefix_len"),
            rtc_exec_horizon=_per_row(rtc_exec_horizon, n, "rtc_exec_horizon"),
            action_prefix=_action_prefix(action_prefix, n, context.batched, self.embodiment.action_dim),
        )
        if return_video:
            model_batch.return_video = [True] * n
        t1 = time.perf_counter()
        result = self.pipeline.generate(model_batch)
        t2 = time.perf_counter()
        actions = self.embodiment.postprocess(result.actions, context)
        t3 = time.perf_counter()
        timings = {"preprocess": (t1 - t0) * 1e3, **result.timings_ms, "model": (t2 - t1) * 1e3,
                   "postprocess": (t3 - t2) * 1e3, "total": (t3 - t0) * 1e3}  # fmt: skip
        self._warn_single_frame(result.sessions)
        video = None if result.video is None else np.stack(result.video)
        if video is not None and not context.batched:
            video = video[0]
        return PolicyResult(actions if context.batched else actions[0], list(result.sessions), timings, video)

    def reset(self, session_ids: str | Sequence[str]) -> None:
        """Restart these sessions at their next call."""
        self.pipeline.reset_sessions([session_ids] if isinstance(session_ids, str) else list(session_ids))


# ---------------------------------------------------------------------------------------------------------------------
# 3. The replay policy
# ---------------------------------------------------------------------------------------------------------------------


class ReplayPolicy:
    """Recorded actions of one LeRobot episode, served chunk by chunk per session behind the policy interface.

    Each call returns rows [cursor, cursor + H) of the episode (the last row repeated past its end) and advances the
    session's cursor by `stride` (default H; use the number of rows your loop executes, e.g. 8 on DROID).
    Observations are still validated, so wire-format bugs show up exactly as with a real model.
    """

    def __init__(
        self,
        dataset_dir: str | Path,
        episode_index: int = 0,
        embodiment: str | Embodiment = "oxe_droid",
        action_columns: Sequence[str] | None = None,
        stride: int | None = None,
        metadata: EmbodimentMetadata | dict | str | Path | None = None,
    ):
        self.embodiment = embodiment if isinstance(embodiment, Embodiment) else get_embodiment(embodiment, metadata)
        dataset = LeRobotDataset(dataset_dir)
        slices = self._action_slices(dataset, action_columns)
        frames = dataset.episode_columns(episode_index, sorted({s.column for s in slices}))
        self.actions = np.concatenate([s.take(frames[s.column]) for s in slices], axis=1).astype(np.float32)
        if self.actions.shape[1] != self.embodiment.action_dim:
            raise ConfigError(
                f"episode {episode_index} actions have {self.actions.shape[1]} dims, {self.embodiment.tag} has "
                f"{self.embodiment.action_dim} ({self.embodiment.action_widths}); pass action_columns"
            )
        self.action_horizon = self.embodiment.action_horizon
        self.stride = stride or self.action_horizon
        if self.stride < 1:
            raise ConfigError(f"stride must be >= 1, got {self.stride}")
        self._cursor: dict[str, int] = {}
        self._step: dict[str, int] = {}
        self._reset_pending: set[str] = set()

    def _action_slices(self, dataset: LeRobotDataset, action_columns) -> list[ColumnSlice]:
        if action_columns:
            return [ColumnSlice.parse(c if "=" in c else f"{c}={c}") for c in action_columns]
        _, slices = dataset.resolve_slices(get_preset(self.embodiment.tag))
        by_name = {s.name: s for s in slices}
        ordered = []
        for key in self.embodiment.action_keys:  # the embodiment's concat order, not the dataset's
            name = key.split(".", 1)[1]
            if name not in by_name:
                raise ConfigError(
                    f"the dataset defines actions {sorted(by_name)}, {self.embodiment.tag} needs {name!r}"
                )
            ordered.append(by_name[name])
        return ordered

    def _chunk(self, start: int) -> np.ndarray:
        idx = np.minimum(np.arange(start, start + self.action_horizon), len(self.actions) - 1)
        return self.actions[idx]

    def infer(
        self,
        observation: dict,
        session_ids: str | Sequence[str],
        instructions: str | Sequence[str | None] | None = None,
        reset: bool | Sequence[bool] = False,
        seed: int | Sequence[int] | None = None,
        expected_steps: int | Sequence[int | None] | None = None,
    ) -> PolicyResult:
        t0 = time.perf_counter()
        parsed = self.embodiment.parse_observation(observation)
        n = parsed.batch_size
        ids = _session_ids(session_ids, n)
        resets = _reset_mask(reset, n)
        expected = _per_row(expected_steps, n, "expected_steps") or [None] * n
        chunks, reports = [], []
        for sid, r, exp in zip(ids, resets, expected):
            reason = None
            if sid not in self._cursor:
                reason = "new_session"
            elif r or sid in self._reset_pending:
                reason = "reset_requested"
            elif exp is not None and int(exp) != self._step[sid]:
                reason = "step_mismatch"
            if reason is not None:
                self._cursor[sid], self._step[sid] = 0, 0
                self._reset_pending.discard(sid)
            chunks.append(self._chunk(self._cursor[sid]))
            self._cursor[sid] = min(self._cursor[sid] + self.stride, len(self.actions))
            self._step[sid] += 1
            reports.append(SessionReport(sid, self._step[sid], reason is not None, reason, self._cursor[sid]))
        actions = np.stack(chunks)
        return PolicyResult(actions if parsed.batched else actions[0], reports,
                            {"total": (time.perf_counter() - t0) * 1e3})  # fmt: skip

    def reset(self, session_ids: str | Sequence[str]) -> None:
        ids = [session_ids] if isinstance(session_ids, str) else list(session_ids)
        self._reset_pending.update(s for s in ids if s in self._cursor)
