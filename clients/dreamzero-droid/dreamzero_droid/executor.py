"""Which action a robot (or a simulated one) executes at a control tick, so that no chunk is executed stale.

    executor = ChunkExecutor(control_hz=15.0)          # max_observation_age_s: DEFAULT_MAX_OBSERVATION_AGE_S
    mark = executor.mark(now)                           # the tick whose observation a query is built from
    ...                                                 # the query goes out, the reply comes back
    offer = executor.offer(chunk.actions, mark, now)    # accepted, or refused with a reason (counted)
    action = executor.next_action(now)                  # at each tick: (row, action), or None (a stall, counted)

The executor is clock-agnostic: every call takes `now` in the caller's seconds (the robot passes `time.monotonic()`;
a simulation its own sim time, which does not advance during a lockstep query). It keeps one count, the actions
executed so far, and each `mark` records it beside the observation's time, so a chunk's age is known two ways:

- in actions: a chunk starts at row = actions executed since its observation (its first rows describe ticks that
  already happened: prefetch's lead and RTC's delay d; a blocking query with the arm held starts at row 0). Those
  rows are skipped and counted; a chunk with no row left is dropped as stale;
- in wall time: a chunk whose observation is older than `max_observation_age_s` is dropped as stale, when offered
  and at every tick after (the rest of an executing chunk expires too), so no executed action answers an
  observation older than the bound.

A chunk is known by its query's sequence number (`mark.seq`): one already offered is refused as a duplicate, one
older than the newest chunk accepted is refused, and after `invalidate()` (a reconnect, a session reset, a reply that
says the server restarted the session) no chunk from an observation marked before it is accepted. Holds (ticks the
arm held still) do not count as executed actions. `stats()` gives the counters and the age (seconds) of the
observation behind each executed action.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dreamzero_client.errors import ConfigError

#: the default wall bound on an executed action's observation age: three DROID chunks (24 actions at 15 Hz = 1.6 s
#: each). A blocking query keeps its chunk up to this minus the executed part (8 rows: ~0.5 s); slower servers set it.
DEFAULT_MAX_OBSERVATION_AGE_S = 5.0
#: why `offer` refused a chunk
REFUSALS = ("invalidated", "duplicate", "older", "no_rows_left", "too_old")


@dataclass(frozen=True)
class ObservationMark:
    """The observation a query was built from: its sequence number, its time (the caller's clock, seconds) and the
    actions executed before it."""

    seq: int
    at: float
    executed: int


@dataclass(frozen=True)
class Offer:
    accepted: bool
    reason: str | None  # one of REFUSALS when refused
    row: int  # the first row to execute (accepted), or the row it would have started at
    age_s: float  # the observation's age when offered


class ChunkExecutor:
    """The one place a client decides which action to execute at a tick (see the module docstring)."""

    def __init__(self, control_hz: float, max_observation_age_s: float | None = DEFAULT_MAX_OBSERVATION_AGE_S):
        if not control_hz > 0:
            raise ConfigError(f"executor.control_hz must be positive, got {control_hz}")
        if max_observation_age_s is not None and not max_observation_age_s > 0:
            raise ConfigError(f"max_observation_age_s must be positive or None, got {max_observation_age_s}")
        self.control_hz, self.max_observation_age_s = control_hz, max_observation_age_s
        self._seq = 0  # sequence numbers never restart: a reply of a past episode stays refused
        self.reset()

    def reset(self) -> None:
        """A new episode: nothing executing, counters at zero, every earlier mark invalid."""
        self.executed = 0  # actions executed (holds excluded)
        self._actions: np.ndarray | None = None
        self._mark: ObservationMark | None = None
        self._row = 0
        self._last_action: np.ndarray | None = None
        self._valid_from = self._seq
        self._offered: set[int] = set()
        self.stalls = self.holds = self.dropped_stale = self.dropped_invalidated = 0
        self.skipped_actions = self.duplicates = self.refused_older = 0
        self.ages_s: list[float] = []

    # 1. queries and replies ----------------------------------------------------------------------------------------
    def mark(self, now: float) -> ObservationMark:
        """Record the observation of this tick (taken before this tick's action) for the query built from it."""
        self._seq += 1
        return ObservationMark(self._seq, float(now), self.executed)

    def executed_since(self, mark: ObservationMark) -> int:
        return self.executed - mark.executed

    def invalidate(self) -> None:
        """A reconnect, a session reset or a restarted session: refuse every chunk of an observation marked before
        now. The chunk executing goes on within its bounds (its actions were fresh when they came); a caller that
        must not move on it holds instead of asking `next_action`."""
        self._valid_from = self._seq

    def offer(self, actions: np.ndarray, mark: ObservationMark, now: float) -> Offer:
        """Take `actions` [H, D] (the reply to the query of `mark`) as the chunk to execute from the next tick on,
        starting at row = actions executed since `mark`; or refuse it (counted) and keep what was executing."""
        row, age = self.executed_since(mark), float(now) - mark.at
        reason = None
        if mark.seq <= self._valid_from:
            reason, self.dropped_invalidated = "invalidated", self.dropped_invalidated + 1
        elif mark.seq in self._offered:
            reason, self.duplicates = "duplicate", self.duplicates + 1
        elif self._mark is not None and mark.seq < self._mark.seq:
            reason, self.refused_older = "older", self.refused_older + 1
        elif row >= len(actions):
            reason, self.dropped_stale = "no_rows_left", self.dropped_stale + 1
        elif self._too_old(age):
            reason, self.dropped_stale = "too_old", self.dropped_stale + 1
        self._offered.add(mark.seq)
        if reason is None:
            self._actions, self._mark, self._row = np.asarray(actions), mark, row
            self.skipped_actions += row
        return Offer(reason is None, reason, row, age)

    # 2. ticks ------------------------------------------------------------------------------------------------------
    def next_action(self, now: float) -> tuple[int, np.ndarray] | None:
        """(row, action) to execute at this tick, counted as executed with its observation's age; None when nothing
        is left to execute (a stall, counted): no chunk, the chunk used up, or its observation now too old."""
        if self._actions is not None and self._too_old(float(now) - self._mark.at):
            self.dropped_stale += 1
            self._drop()
        if self._actions is None or self._row >= len(self._actions):
            self._drop()
            self.stalls += 1
            return None
        row = self._row
        self._row += 1
        self.executed += 1
        self.ages_s.append(float(now) - self._mark.at)
        self._last_action = self._actions[row]
        return row, self._last_action

    def hold(self) -> None:
        """A tick the arm held still for another reason than a stall (a refused chunk, a pause): counted, and not an
        executed action."""
        self.holds += 1

    def rows_left(self) -> int:
        """Rows of the executing chunk not executed yet (0 when none)."""
        return 0 if self._actions is None else max(0, len(self._actions) - self._row)

    @property
    def next_row(self) -> int | None:
        """The row of the executing chunk the next tick executes, or None when none is executing."""
        return None if self._actions is None else self._row

    @property
    def last_action(self) -> np.ndarray | None:
        """The action executed last (None before the first)."""
        return self._last_action

    @property
    def current_seq(self) -> int | None:
        """The query sequence number of the chunk executing (or last executed), or None."""
        return None if self._mark is None else self._mark.seq

    def _too_old(self, age: float) -> bool:
        return self.max_observation_age_s is not None and age > self.max_observation_age_s

    def _drop(self) -> None:
        self._actions, self._row = None, 0

    # 3. report -----------------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """The counters and the observation age of the executed actions (seconds: p50, p99, max; None before any)."""
        ages = np.asarray(self.ages_s, dtype=np.float64)

        def pct(q: float) -> float | None:
            return float(np.percentile(ages, q)) if ages.size else None

        return {
            "executed": self.executed,
            "stalls": self.stalls,
            "holds": self.holds,
            "dropped_stale": self.dropped_stale,
            "dropped_invalidated": self.dropped_invalidated,
            "skipped_actions": self.skipped_actions,
            "duplicates": self.duplicates,
            "refused_older": self.refused_older,
            "observation_age_s": {"p50": pct(50), "p99": pct(99), "max": float(ages.max()) if ages.size else None},
        }
