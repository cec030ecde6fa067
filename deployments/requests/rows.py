"""A request's per-row options: one `RowOptions` object, built once by each door's decoder and carried unchanged
through the graph runner, the raw stages and the batcher to the model batch.

Every door reads the shared options (`OPTIONS`: seed, continuity echoes, real-time chunking, return_video) with the
same readers from its own option map (HTTP `parameters` / `runtime`, an OpenPI message, ZeroMQ `options`), so a
field is declared once here. `RowOptions.to_batch` is the one place the rows meet the model's `ModelBatch`.

A new per-row option (docs/architecture.md, "A new per-row option"): a `RowOptions` field and its `RowOption` entry
here, its `ModelBatch` field (with its merge fill in `ROW_OPTION_FILLS`) in `dreamzero/types.py`, the model code that
acts on it, and the JSON Schema entry in `serve_graph/wire_schema.py`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from deployments.requests import fields as f
from dreamzero.errors import InvalidObservation
from dreamzero.types import ModelBatch
from dreamzero_client.wire.generations import (
    MAX_DEADLINE_MS,
    MAX_EXPECTED_STEP,
    MAX_INCARNATION_LEN,
    MAX_RTC_ACTIONS,
    TRAFFIC_CLASSES,
)

#: the widest action vector a real-time chunking prefix may carry (docs/rtc.md)
MAX_ACTION_DIM = 32

# 1. Readers: a value as sent -> B rows (or None when not sent); errors name the field -----------------------------


def rtc_counts(v: Any, name: str, b: int) -> list[int | None] | None:
    """`rtc_prefix_len` / `rtc_exec_horizon`: null, one count for every row, or B entries of a count or null."""
    if v is None:
        return None
    rows = f.per_row(v, name, b, (int,))
    return [None if x is None else f.int_in(x, f"{name}[{i}]", 0, MAX_RTC_ACTIONS) for i, x in enumerate(rows)]


def _prefix_row(v: Any, name: str) -> np.ndarray:
    arr = f.array(v, name)
    if arr.dtype.kind not in "fiu":
        raise InvalidObservation(f"'{name}' must hold numbers, got dtype {arr.dtype}", field=name)
    if arr.ndim != 2 or not 1 <= arr.shape[0] <= MAX_RTC_ACTIONS or not 1 <= arr.shape[1] <= MAX_ACTION_DIM:
        raise InvalidObservation(
            f"'{name}' must be [P, D] actions (1 <= P <= {MAX_RTC_ACTIONS}, 1 <= D <= {MAX_ACTION_DIM}), "
            f"got shape {list(arr.shape)}",
            field=name,
        )
    arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        raise InvalidObservation(f"'{name}' holds NaN or infinite values", field=name)
    return arr


def action_prefixes(v: Any, name: str, b: int) -> list[np.ndarray | None] | None:
    """`action_prefix`: null, [P, D] for every row, [B, P, D], or B entries of [P, D] or null."""
    if v is None:
        return None
    rows = v if isinstance(v, np.ndarray) else f.as_list(v, name)
    if any(r is None for r in rows) or (len(rows) and not np.isscalar(rows[0]) and np.ndim(rows[0]) == 2):
        pass  # one entry per row (equal lengths or not)
    else:
        arr = _prefix_row(v, name)  # [P, D], the same prefix for every row
        return [arr] * b
    if len(rows) != b:
        raise InvalidObservation(f"'{name}' has {len(rows)} rows but the request has {b} sessions", field=name)
    return [None if r is None else _prefix_row(r, f"{name}[{i}]") for i, r in enumerate(rows)]


def seeds(v: Any, name: str, b: int) -> list[int] | None:
    """`seed`: one int (every row) or B ints."""
    if v is None:
        return None
    if isinstance(v, (list, tuple, np.ndarray)):
        return [f.int_in(s, f"{name}[{i}]", 0, f.MAX_SEED) for i, s in enumerate(f.per_row(v, name, b, ()))]
    return [f.int_in(v, name, 0, f.MAX_SEED)] * b


def expected_steps(v: Any, name: str, b: int) -> list[int | None] | None:
    """`expected_steps`: the `step` of each session's last reply (null: no expectation)."""
    if v is None:
        return None
    rows = f.per_row(v, name, b, (int,))
    return [None if s is None else f.int_in(s, f"{name}[{i}]", 0, MAX_EXPECTED_STEP) for i, s in enumerate(rows)]


def expected_incarnations(v: Any, name: str, b: int) -> list[str | None] | None:
    """`expected_incarnations`: the `incarnation` of each session's last reply (null: no expectation)."""
    if v is None:
        return None
    rows = f.per_row(v, name, b, (str,))
    for i, inc in enumerate(rows):
        if inc is not None and (not isinstance(inc, str) or not 0 < len(inc) <= MAX_INCARNATION_LEN):
            raise InvalidObservation(
                f"'{name}[{i}]' must be null or the 'incarnation' string of the last reply for that session, got "
                f"{inc!r}",
                field=f"{name}[{i}]",
            )
    return list(rows)


def traffic_classes(v: Any, name: str, b: int) -> list[str] | None:
    """`traffic_class`: one of TRAFFIC_CLASSES for every row, or B of them (None when not sent)."""
    if v is None:
        return None
    return [f.choice(c, f"{name}[{i}]", TRAFFIC_CLASSES) for i, c in enumerate(f.per_row(v, name, b, (str,)))]


def _seconds_or_ms(v: Any, name: str, lo: float, hi: float) -> float:
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or not lo <= v <= hi:
        raise InvalidObservation(f"'{name}' must be a number in [{lo:g}, {hi:g}], got {v!r}", field=name)
    return float(v)


def deadlines_ms(v: Any, name: str, b: int) -> list[float | None] | None:
    """`deadline_ms`: milliseconds from the server receiving the request until the row's client runs out of actions
    (actions left / control rate); one number for every row, or B entries of a number or null."""
    if v is None:
        return None
    rows = f.per_row(v, name, b, (int, float))
    return [None if d is None else _seconds_or_ms(d, f"{name}[{i}]", 0.0, MAX_DEADLINE_MS) for i, d in enumerate(rows)]


def observed_times(v: Any, name: str, b: int) -> list[float | None] | None:
    """`observed_at`: when the row's observation was taken, on the client's own clock (seconds, any epoch); echoed
    unchanged in the reply's session report. One number for every row, or B entries of a number or null."""
    if v is None:
        return None
    rows = f.per_row(v, name, b, (int, float))
    return [None if t is None else _seconds_or_ms(t, f"{name}[{i}]", -1e12, 1e12) for i, t in enumerate(rows)]


def flag(v: Any, name: str, b: int) -> bool:
    """A request-wide switch (false when not sent)."""
    return False if v is None else f.flag(v, name)


def continuity_fields(params: Mapping, b: int, prefix: str = "") -> tuple[list | None, list | None]:
    """`expected_steps` and `expected_incarnations` of B rows, each None when not sent."""
    return (
        expected_steps(params.get("expected_steps"), f"{prefix}expected_steps", b),
        expected_incarnations(params.get("expected_incarnations"), f"{prefix}expected_incarnations", b),
    )


# 2. The options every door reads the same way ---------------------------------------------------------------------


@dataclass(frozen=True)
class RowOption:
    """One per-row option: its `RowOptions` / `ModelBatch` attribute, its key in a door's option map, its reader,
    whether HTTP reads it from `runtime` (else `parameters`), and how its value becomes the batch's rows."""

    name: str
    wire: str
    read: Callable[[Any, str, int], Any]
    runtime: bool = False
    to_batch: Callable[[Any, int], Any] | None = lambda value, b: value  # None: not a batch field


OPTIONS: tuple[RowOption, ...] = (
    RowOption("seeds", "seed", seeds),
    RowOption("expected_steps", "expected_steps", expected_steps),
    RowOption("expected_incarnations", "expected_incarnations", expected_incarnations),
    RowOption("rtc_prefix_len", "rtc_prefix_len", rtc_counts),
    RowOption("rtc_exec_horizon", "rtc_exec_horizon", rtc_counts),
    RowOption("action_prefix", "action_prefix", action_prefixes),
    # request-wide on the wire, per row in the model batch (None: no row asks, nothing is decoded)
    RowOption("return_video", "return_video", flag, runtime=True, to_batch=lambda v, b: [True] * b if v else None),
    # the fleet's fields (docs/fleet.md); `deadline_ms` reaches the batch as `deadline_at` (RowOptions.to_batch),
    # `observed_at` stays at the door, which echoes it
    RowOption("traffic_class", "traffic_class", traffic_classes),
    RowOption("deadline_ms", "deadline_ms", deadlines_ms, to_batch=None),
    RowOption("observed_at", "observed_at", observed_times, to_batch=None),
)
#: the keys the options take in a door's option map (an OpenPI message keeps them out of its observation)
OPTION_KEYS = tuple(o.wire for o in OPTIONS)


def read_options(
    b: int, params: Mapping, prefix: str = "", runtime: Mapping | None = None, runtime_prefix: str | None = None
) -> dict[str, Any]:
    """Every option of `OPTIONS` for B rows, read from a door's option map (`runtime`: HTTP's second map, for the
    options that live there), with errors naming `<prefix><key>`."""
    out = {}
    for o in OPTIONS:
        source, at = (runtime, runtime_prefix) if o.runtime and runtime is not None else (params, prefix)
        out[o.name] = o.read(source.get(o.wire), f"{at}{o.wire}", b)
    return out


# 3. The object ------------------------------------------------------------------------------------------------------


@dataclass
class RowOptions:
    """What a request asks of each of its B rows (one row per session)."""

    prompts: list[str]  # B instructions
    session_ids: list[str]  # B unique, non-empty
    reset_mask: list[bool]  # B (all False when not sent)
    negative_prompts: list[str] | None = None  # HTTP only; None: the embodiment's / model's default
    seeds: list[int] | None = None  # per row; None: the model's default seed
    expected_steps: list[int | None] | None = None  # per row: `step` of the session's last reply
    expected_incarnations: list[str | None] | None = None  # per row: `incarnation` of the session's last reply
    # real-time chunking (docs/rtc.md), per row; None = not asked. action_prefix rows are [P, D] float64 in robot
    # units (raw form) or normalised units (normalised form)
    rtc_prefix_len: list[int | None] | None = None
    rtc_exec_horizon: list[int | None] | None = None
    action_prefix: list[np.ndarray | None] | None = None
    return_video: bool = False  # the reply also carries each row's predicted frames, uint8 [B, T, H, W, 3]
    # the fleet (docs/fleet.md): per row "realtime" | "batch" (None: the tenant's or the door's default), the
    # milliseconds until the client's buffer runs out, and the client's observation time (echoed)
    traffic_class: list[str] | None = None
    deadline_ms: list[float | None] | None = None
    observed_at: list[float | None] | None = None
    received_at: float = dataclasses.field(default_factory=time.time)  # wall clock when the door decoded it

    @classmethod
    def read(
        cls,
        prompts: list[str],
        session_ids: list[str],
        reset_mask: list[bool] | None,
        params: Mapping,
        prefix: str = "",
        runtime: Mapping | None = None,
        runtime_prefix: str | None = None,
        negative_prompts: list[str] | None = None,
    ) -> RowOptions:
        """The rows a door's decoder read: its own prompts, ids and reset, and the shared `OPTIONS` from its map."""
        b = len(session_ids)
        options = read_options(b, params, prefix, runtime, runtime_prefix)
        reset = [False] * b if reset_mask is None else list(reset_mask)
        return cls(list(prompts), list(session_ids), reset, negative_prompts, **options)

    def __len__(self) -> int:
        return len(self.session_ids)

    def replace(self, **changes: Any) -> RowOptions:
        """A copy with some fields changed (a door's session namespace, its echoed continuity)."""
        return dataclasses.replace(self, **changes)

    def to_batch(self, batch: ModelBatch) -> ModelBatch:
        """Set these rows on a `ModelBatch` the request's form built (arrays, prompts): the one conversion."""
        n = len(self)
        if len(batch) != n:
            raise InvalidObservation(
                f"the observation holds {len(batch)} rows but the request has {n} sessions", field="session_ids"
            )
        batch.reset_mask = list(self.reset_mask)
        if self.negative_prompts is not None:
            batch.negative_prompts = list(self.negative_prompts)
        for o in OPTIONS:
            if o.to_batch is not None:
                setattr(batch, o.name, o.to_batch(getattr(self, o.name), n))
        batch.deadline_at = self.deadlines_at()
        return batch

    def with_classes(self, tenant_class: str | None = None) -> RowOptions:
        """These rows with every traffic class resolved (docs/fleet.md): the request's own `traffic_class` wins, else
        the tenant's, else "realtime" for a request of one row (a robot) and "batch" for more (a farm posting N
        environments)."""
        if self.traffic_class is not None:
            return self
        default = tenant_class or ("realtime" if len(self) == 1 else "batch")
        return self.replace(traffic_class=[default] * len(self))

    def deadlines_at(self) -> list[float | None] | None:
        """Each row's deadline on the wall clock (`received_at` + `deadline_ms`), None when no row states one."""
        if self.deadline_ms is None:
            return None
        return [None if d is None else self.received_at + d / 1000.0 for d in self.deadline_ms]
