"""A pipeline stand-in for the Policy deployment that answers with a LeRobot episode's recorded actions.

`policy: {replay: {dataset: <dir>, episode: 0}}` in serve_config.yaml swaps the model for this, behind every transport
(HTTP raw and normalised forms, OpenPI WebSocket, ZMQ): the robot loop and the wire are debugged with no weights.
Each session walks the episode from its start, `stride` rows per call (the last row repeats past the end), and gets
the same continuity reports as with the model (restarts, steps, incarnations).

The Policy deployment returns model units, which postprocess turns into robot units (`robot = gain * model + bias`,
then the gripper rule). So recorded robot actions are encoded through the request's own action codec
(`ModelBatch.action_gain` / `action_bias`, filled by preprocess from the row's current state), and postprocess gives
them back exactly (a relative action key comes back as the recorded absolute value, whatever the current state);
only the gripper rule still applies (DROID binarises the gripper at 0.5). The normalised form has no codec: it gets
the q99-normalised recording (relative keys are not re-based: the state is not known in that form).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from dreamzero.config import PipelineConfig
from dreamzero.embodiments import Embodiment
from dreamzero.errors import CapacityError, InvalidObservation
from dreamzero.policy import ReplayPolicy
from dreamzero.sessions import fair_victim, plan_evictions, refuse_over_quota
from dreamzero.types import ChunkResult, ModelBatch, SessionReport


@dataclass
class _Cursor:
    step: int = 0
    row: int = 0
    reset_pending: bool = False
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex[:12])


class ReplayStore:
    """The replay's sessions: LRU-bounded like the model's store, with its groups (a server's tenants: `group_of`,
    `on_evict`, `check_group_room`, share-first eviction); `in` and `stats()` as the Policy deployment uses. A cursor
    has no TTL and holds no tensors, so a refused tenant is told to retry after `retry_after_s`."""

    def __init__(
        self,
        max_sessions: int,
        retry_after_s: float = 5.0,
        group_of: Callable[[str], str] | None = None,
        on_evict: Callable[[str, str], None] | None = None,
    ):
        self.max_sessions = max_sessions
        self.retry_after_s = retry_after_s
        self.cursors: dict[str, _Cursor] = {}  # least recently used first
        self.evictions = 0
        self._evicted: OrderedDict[str, None] = OrderedDict()  # ids evicted lately, to report "evicted"
        self._remember = max(1024, 16 * max_sessions)
        self.group_of = group_of
        self.on_evict = on_evict

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.cursors

    def was_evicted(self, session_id: str) -> bool:
        return session_id in self._evicted

    def evict_beyond_limit(self, used: str, protect=()) -> None:
        """Forget least recently used sessions beyond max_sessions (`used` was just inserted last) by the model's
        store's fair rule (`fair_victim`: never another tenant's session unless it is over its share and `used`'s
        tenant within its own); `protect` (the batch being answered) goes only as the last of `used`'s own."""
        self._evicted.pop(used, None)
        asking = {self._group(used)}
        while len(self.cursors) > self.max_sessions:
            idle = [sid for sid in self.cursors if sid != used and sid not in protect]
            victim = fair_victim(idle, self._count_by_group(), self.max_sessions, asking, self._group)
            if victim is None:
                victim = next((s for s in self.cursors if s != used and self._group(s) in asking), None)
            if victim is None:  # over the count rather than evict another tenant's session
                break
            del self.cursors[victim]
            self._evicted[victim] = None
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(victim, "lru")
        while len(self._evicted) > self._remember:
            self._evicted.popitem(last=False)

    def check_room(self, session_ids, busy=()) -> None:
        """`CapacityError` when the new sessions among `session_ids` cannot get a slot by the fair rule (nor from
        their own tenant's other sessions); evicts nothing (answering does)."""
        new = [sid for sid in dict.fromkeys(session_ids) if sid not in self.cursors]
        excess = len(self.cursors) + len(new) - self.max_sessions
        if not new or excess <= 0:
            return
        keep = set(busy) | set(session_ids)
        idle = [sid for sid in self.cursors if sid not in keep]
        asking = Counter(self._group(sid) for sid in new)
        victims, short = plan_evictions(
            idle, self._count_by_group() + asking, self.max_sessions, excess, set(asking), lambda _: 1, self._group
        )
        own = [s for s in self.cursors if self._group(s) in asking and s not in victims]  # storing may take them
        if short > len(own):
            raise CapacityError(
                f"session slots full: {len(new)} new session(s) need {excess} of sessions.max_sessions="
                f"{self.max_sessions} slots freed and only {excess - int(short) + len(own)} may be (this tenant's "
                "own idle sessions, or those of a tenant over its share; other tenants' sessions are never "
                "evicted); retry later, end sessions, or raise sessions.max_sessions / add replicas",
                retry_after_s=self.retry_after_s,
            )

    def group_counts(self) -> dict[str, int]:
        """Live sessions per group (the groups with none are absent)."""
        return dict(self._count_by_group())

    def check_group_room(
        self, session_ids, limit: int | None, total_limit: int | None = None, elsewhere: int = 0, label: str = "group"
    ) -> None:
        """`QuotaExceeded` when the new sessions among `session_ids` take their group past a session quota (as the
        model's store)."""
        new = Counter(self._group(sid) for sid in session_ids if sid not in self.cursors)
        if new:
            refuse_over_quota(self._count_by_group(), new, limit, total_limit, elsewhere, label,
                              lambda _group: self.retry_after_s)  # fmt: skip

    def _group(self, session_id: str) -> str:
        return "" if self.group_of is None else self.group_of(session_id)

    def _count_by_group(self) -> Counter[str]:
        return Counter(self._group(sid) for sid in self.cursors)

    def release(self, session_ids) -> None:
        """Admission bookkeeping of the model's store (a cursor holds no tensors: nothing to release)."""

    def stats(self) -> dict:
        # the keys of SessionStore.stats() that the Policy deployment's gauges read; a cursor holds no tensors
        return {"live": len(self.cursors), "max_sessions": self.max_sessions, "evictions": self.evictions, "bytes": 0}


class ReplayPipeline:
    """`generate(ModelBatch) -> ChunkResult` from recorded actions (the interface `DreamZeroPipeline` offers)."""

    def __init__(
        self,
        embodiment: Embodiment,
        dataset: str,
        episode: int = 0,
        stride: int | None = None,
        action_columns: list[str] | None = None,
        max_sessions: int = 128,
        store: ReplayStore | None = None,
    ):
        self.replay = ReplayPolicy(dataset, episode, embodiment, action_columns, stride)
        self.embodiment = embodiment
        self.action_horizon = int(embodiment.action_horizon)
        self.max_action_dim = int(embodiment.max_action_dim)
        self.config = PipelineConfig()
        # what `/v1/models` and `/v1/actions/metadata` report as the config: say plainly that no model answers
        self.model = SimpleNamespace(config=SimpleNamespace(name="replay", embodiment_tag=embodiment.tag, dit=None))
        self.store = store if store is not None else ReplayStore(max_sessions)  # a server's: with its tenants
        self._lock = threading.Lock()
        recorded = self.replay.actions.astype(np.float64)
        # normalised-form answer: q99 per action key, padded to the model's width
        per_key = self.embodiment.split_actions(recorded)
        norm = np.concatenate([self.embodiment.action_normalisers[k].normalise(v) for k, v in per_key.items()], -1)
        self._normalised = np.zeros((len(recorded), self.max_action_dim))
        self._normalised[:, : norm.shape[1]] = norm
        self._recorded = np.zeros((len(recorded), self.max_action_dim))
        self._recorded[:, : recorded.shape[1]] = recorded

    # --- the pipeline interface ---------------------------------------------------------------------------------
    def generate(self, batch: ModelBatch, return_latents: bool = False) -> ChunkResult:
        t0 = time.perf_counter()
        if len(set(batch.session_ids)) != len(batch):
            raise InvalidObservation("session ids must be unique within a batch", field="session_ids")
        actions = np.zeros((len(batch), self.action_horizon, self.max_action_dim), np.float32)
        reports = []
        with self._lock:
            for i, sid in enumerate(batch.session_ids):
                cursor, reason = self._resolve(batch, i, sid)
                rows = np.minimum(np.arange(cursor.row, cursor.row + self.action_horizon), len(self._recorded) - 1)
                actions[i] = self._encode(batch, i, rows)
                cursor.row = min(cursor.row + self.replay.stride, len(self._recorded))
                cursor.step += 1
                rtc = "cold_start" if _asked_rtc(batch, i) else None  # recorded actions ignore any target
                reports.append(
                    SessionReport(sid, cursor.step, reason is not None, reason, cursor.row, cursor.incarnation, rtc)
                )
        return ChunkResult(actions, reports, timings_ms={"total": (time.perf_counter() - t0) * 1e3})

    def admit(self, batch: ModelBatch, busy=()) -> None:
        """The model pipeline's admission step: recorded actions hold no tensors, so only the count can refuse."""
        with self._lock:
            self.store.check_room(batch.session_ids, busy)

    def reset_sessions(self, session_ids) -> None:
        with self._lock:
            for sid in session_ids:
                if sid in self.store.cursors:
                    self.store.cursors[sid].reset_pending = True

    def drop_sessions(self, session_ids) -> int:
        with self._lock:
            return sum(self.store.cursors.pop(sid, None) is not None for sid in session_ids)

    def stats(self) -> dict:
        return self.store.stats()

    # --- helpers ------------------------------------------------------------------------------------------------
    def _resolve(self, batch: ModelBatch, i: int, sid: str) -> tuple[_Cursor, str | None]:
        cursors = self.store.cursors
        cursor = cursors.pop(sid, None)  # re-inserted last: the dict order is least recently used first
        expected = batch.expected_steps[i] if batch.expected_steps else None
        expected_inc = batch.expected_incarnations[i] if batch.expected_incarnations else None
        reason = None
        if cursor is None:
            reason = "evicted" if self.store.was_evicted(sid) else "new_session"
        elif (batch.reset_mask and batch.reset_mask[i]) or cursor.reset_pending:
            reason = "reset_requested"
        elif (expected is not None and int(expected) != cursor.step) or (
            expected_inc is not None and expected_inc != cursor.incarnation
        ):
            reason = "step_mismatch"
        if reason is not None:
            cursor = _Cursor()
        cursors[sid] = cursor
        self.store.evict_beyond_limit(sid, batch.session_ids)
        return cursor, reason

    def _encode(self, batch: ModelBatch, i: int, rows: np.ndarray) -> np.ndarray:
        """Recorded rows -> model units for this row: through its action codec (raw form), else q99-normalised."""
        if batch.action_gain is None:
            return self._normalised[rows]
        gain, bias = batch.action_gain[i], batch.action_bias[i]
        safe = np.where(gain != 0, gain, 1.0)
        return np.where(gain != 0, (self._recorded[rows] - bias) / safe, 0.0)


def _asked_rtc(batch: ModelBatch, i: int) -> bool:
    return any(
        (getattr(batch, name) or [None] * len(batch))[i] is not None
        for name in ("rtc_prefix_len", "rtc_exec_horizon", "action_prefix")
    )
