"""The client side of real-time chunking (docs/rtc.md, "Clients"): when to send the next query, what it asks, and
which row of the new chunk the robot executes first. Pure bookkeeping: no I/O, no threads.

One tick = one control step: observe, then command one action. With H the chunk length, d the inference delay in
ticks and s the execution horizon:

- the current chunk `p` is about to execute row s at tick t: the query leaves now, built from this tick's
  observation, with `rtc_prefix_len = d`, `rtc_exec_horizon = s` and (optionally) `action_prefix = p[s:]`, the
  actions the robot executes from this tick on if nothing changes; p[s] is still executed at tick t;
- at tick t + k (k = 1, 2, ...) the robot executes p[s + k] until the reply is there and k >= d, then switches to
  row k of the new chunk `n` (new action i aligns with old action s + i). On time that is n[d], right after p[s+d-1];
  n[0 .. d-1] equal p[s .. s+d-1] and are skipped;
- late: when the old chunk is used up (k = H - s), the arm holds until the reply comes and n[H - s] follows p[H-1].

s = min(max(open_loop_horizon, d), H - d): the query cadence is the open-loop horizon, as without RTC, unless the
delay needs a longer one; d <= s <= H - d as the server requires. d is fixed (the sim evaluation emulates it) or a
running estimate: ceil(p90 of the recent round trips / control period), bounded to [1, H // 2].
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from dreamzero_client.errors import ConfigError

log = logging.getLogger("dreamzero.clients.rtc")

#: the request fields of RTC (HTTP `parameters.*`, OpenPI keys of the same names)
RTC_FIELDS = ("rtc_prefix_len", "rtc_exec_horizon", "action_prefix")


@dataclass(frozen=True, eq=False)  # eq would compare the prefix arrays element-wise
class RtcRequest:
    """What one query asks of the server."""

    prefix_len: int  # d: actions of the current chunk the robot executes while the next one is computed
    exec_horizon: int  # s: row of the current chunk executing when the query leaves
    action_prefix: np.ndarray | None = None  # float64 [H - s, 8] robot units: p[s:], row i aligns with new action i

    def without_prefix(self) -> RtcRequest:
        return replace(self, action_prefix=None)


class DelayEstimator:
    """Inference delay in control steps from the recent round trips: ceil(quantile / control period)."""

    def __init__(self, control_hz: float, quantile: float = 0.9, window: int = 16):
        if not control_hz > 0:
            raise ConfigError(f"rtc.control_hz must be positive, got {control_hz}")
        if not 0 < quantile <= 1 or window < 1:
            raise ConfigError(f"rtc: quantile must be in (0, 1] and window >= 1, got {quantile}, {window}")
        self.period_ms = 1e3 / control_hz
        self.quantile = quantile
        self._latencies: deque[float] = deque(maxlen=window)

    def add(self, latency_ms: float) -> None:
        if math.isfinite(latency_ms) and latency_ms >= 0:
            self._latencies.append(float(latency_ms))

    def steps(self) -> int | None:
        """The estimate (>= 1), or None before the first round trip."""
        if not self._latencies:
            return None
        latency = float(np.quantile(np.asarray(self._latencies), self.quantile))
        return max(1, math.ceil(latency / self.period_ms - 1e-9))  # exactly 2 periods is 2 steps, not 3


@dataclass
class _Pending:
    request: RtcRequest
    horizon: int  # H of the chunk the query continues
    ticks: int = 0  # ticks since the query left


class RtcSchedule:
    """The RTC timeline of one robot (see the module docstring). Per tick, before commanding the current chunk's
    `row`: `switch_row(ready)` while a query is pending, else `plan(actions, row)`; `sent` / `switched` record it.

    `delay_steps` fixes d (the sim evaluation); otherwise d is `estimator.steps()`, fed by `add_latency`, capped at
    `max_delay_steps` and at H // 2. The estimate is kept across episodes (it is the server's, not the episode's).
    """

    def __init__(
        self,
        open_loop_horizon: int,
        control_hz: float,
        delay_steps: int | None = None,
        max_delay_steps: int | None = None,
        send_prefix: bool = True,
        quantile: float = 0.9,
        window: int = 16,
    ):
        if open_loop_horizon < 1:
            raise ConfigError(f"rtc.open_loop_horizon must be >= 1, got {open_loop_horizon}")
        for name, value in (("delay_steps", delay_steps), ("max_delay_steps", max_delay_steps)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"rtc.{name} must be an integer >= 1 or None, got {value!r}")
        self.open_loop_horizon, self.fixed_delay, self.max_delay = open_loop_horizon, delay_steps, max_delay_steps
        self.send_prefix = send_prefix
        self.estimator = DelayEstimator(control_hz, quantile, window)
        self.pending: _Pending | None = None
        self._warned_cap = False

    def add_latency(self, latency_ms: float) -> None:
        self.estimator.add(latency_ms)

    def reset(self) -> None:
        """A new episode: nothing pending (the delay estimate stays)."""
        self.pending = None

    def delay(self, horizon: int) -> int:
        """d for a chunk of `horizon` rows: fixed, else estimated (the cap before the first round trip)."""
        cap = horizon // 2
        if self.fixed_delay is not None:
            if self.fixed_delay > cap:
                raise ConfigError(
                    f"rtc.delay_steps = {self.fixed_delay} is too long for chunks of {horizon} actions: RTC needs "
                    f"d <= s <= H - d, so d <= {cap}"
                )
            return self.fixed_delay
        if self.max_delay is not None:
            cap = min(cap, self.max_delay)
        estimate = self.estimator.steps()
        if estimate is not None and estimate > cap and not self._warned_cap:
            self._warned_cap = True  # once: the latency is the server's, it will not change every query
            log.warning(
                "measured delay %d steps is over the cap %d: late chunks keep the old one longer", estimate, cap
            )
        return max(1, min(cap, estimate if estimate is not None else cap))

    def plan(self, actions: np.ndarray, row: int) -> RtcRequest | None:
        """The query to send at the tick that is about to execute `row` of `actions` [H, D], or None (not yet)."""
        if self.pending is not None:
            raise RuntimeError("RtcSchedule.plan: a query is already pending; call switch_row until it switches")
        horizon = len(actions)
        if horizon < 2:
            raise ConfigError(f"rtc needs chunks of at least 2 actions, got {horizon}")
        d = self.delay(horizon)
        if row < min(max(self.open_loop_horizon, d), horizon - d):
            return None
        s = min(row, horizon - 1)
        d = min(d, horizon - s)  # the delay grew past this row's room: ask what still fits (a late reply waits)
        prefix = np.array(actions[s:], dtype=np.float64) if self.send_prefix else None
        return RtcRequest(d, s, prefix)

    def sent(self, request: RtcRequest, horizon: int) -> None:
        self.pending = _Pending(request, horizon)

    def switch_row(self, ready: bool) -> int | None:
        """Once per tick after the query's tick: the new chunk's row to execute now, or None (keep executing the
        old chunk at row s + k). H - s means the old chunk is used up: wait for the reply, then start there."""
        if self.pending is None:
            raise RuntimeError("RtcSchedule.switch_row: no query is pending")
        self.pending.ticks += 1
        k, room = self.pending.ticks, self.pending.horizon - self.pending.request.exec_horizon
        if k >= room:
            return room
        if ready and k >= self.pending.request.prefix_len:
            return k
        return None

    def switched(self) -> RtcRequest:
        """The new chunk took over; returns the request it answered."""
        if self.pending is None:
            raise RuntimeError("RtcSchedule.switched: no query is pending")
        pending, self.pending = self.pending, None
        return pending.request


def switch_jump(previous_action: np.ndarray, next_action: np.ndarray, dims: int = 7) -> float:
    """Euclidean distance over the first `dims` dims (DROID: the 7 joint targets, rad) between the last action of the
    old chunk and the first of the new one."""
    a, b = np.asarray(previous_action, np.float64)[:dims], np.asarray(next_action, np.float64)[:dims]
    return float(np.linalg.norm(b - a))


def refused_fields(exc: BaseException) -> set[str]:
    """The RTC fields an error reply names (its `field`, else its message), following the exception's causes.

    An older server answers 422 naming the field it does not know; a newer one names the field whose value it
    refuses. Either way the client drops what was named and asks again."""
    named: set[str] = set()
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        field = getattr(exc, "field", None)
        if isinstance(field, str):
            leaf = field.split(".")[-1].split("[")[0]  # "parameters.action_prefix[0]" -> "action_prefix"
            named.update({leaf} & set(RTC_FIELDS))
        text = " ".join(str(part) for part in (getattr(exc, "message", ""), exc))
        named.update(name for name in RTC_FIELDS if name in text)
        exc = exc.__cause__ or exc.__context__
    return named
