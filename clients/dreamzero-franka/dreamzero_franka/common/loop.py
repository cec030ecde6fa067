"""The Franka deployment loop (15 Hz for DROID, 10 Hz for franka_pnp): episodes of observe -> (query) -> safety
filter -> command, with operator controls.

Per episode:
1. a fresh session id (the previous episode's session is released on the server); the arm moves home, the gripper opens;
2. every tick (1 / control_hz): read the operator's commands, observe arm + gripper + cameras and hand the
   observation to the policy (its frame history needs every tick), query the server when the executed part of the
   current chunk (open-loop horizon, 8 rows by default) is used up, pass the next row through the safety filter, send
   the joint targets and (on change) the gripper command by DROID's rule, log the step;
3. with `prefetch`, the next query is sent `prefetch_lead_steps` ticks early from a background thread and the new
   chunk starts that many rows in (its first rows belong to ticks that already happened); with `rtc` instead, the
   lead is the measured delay d and the server continues the executing chunk (`dreamzero_droid.rtc`, docs/rtc.md):
   the query leaves at row s, the old chunk runs on until the reply is there and d ticks have passed, and the new
   one starts at the row of that tick (d when on time); the arm holds only if the old chunk runs out first;
4. which row runs at a tick is `dreamzero_droid.executor.ChunkExecutor`'s (docs/fleet.md, "Clients"): a chunk starts
   at row = actions executed since its query's observation (prefetch's lead, RTC's delay: the same rows as above on
   time), and a chunk that is stale (nothing left, its observation older than `max_observation_age_s`, a query from
   before a restarted session or a retried connection, a duplicate) is never executed: the arm holds and the next
   tick queries again from a fresh observation. Every query carries its observation time, the class "realtime" and,
   with prefetch / RTC, its deadline (`fleet_fields`);
5. the episode ends after `max_steps`, on an operator label / abort / quit, on Ctrl+C (aborted), or as failed with
   its reason (server lost, too many rejected chunks, a device fault). The arm holds on every way out;
6. with a `dataset` (`--record-dataset`, `recording.py`), every tick also queues its frame (the views as the
   policy saw them, the state, the command sent) to the recorder's writer thread, and the episode's end marks it
   (the operator's label, or aborted / failed with the reason), whichever way it ended.

The tick (`EpisodeRunner._control`: timing, chunk scheduling, prefetch / RTC, rejections, holds, logging, the
episode's end) exists once; what is the embodiment's goes through the hooks of section 3 (`go_home`, `read_devices`,
`accept_chunk`, `execute_row`, `log_entry`, `dataset_frame`), which `droid.loop.DroidEpisodeRunner` fills in for
DROID's joint control and `pnp.loop.PnpEpisodeRunner` for franka_pnp's Cartesian control.
"""
# Longer than ~400 lines on purpose: one control tick (observe, query / prefetch / RTC, safety filter, command, log)
# must read top to bottom in one file.

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from dreamzero_client.errors import ConfigError, DreamZeroError
from dreamzero_droid.executor import DEFAULT_MAX_OBSERVATION_AGE_S, ChunkExecutor, ObservationMark
from dreamzero_droid.policy import Chunk, ChunkRejected, PolicyCallError, SessionPolicy
from dreamzero_droid.rtc import RtcSchedule, switch_jump
from dreamzero_franka.common.contracts import Camera, DeviceError, Gripper, Robot
from dreamzero_franka.common.episode_log import EpisodeLog
from dreamzero_franka.common.guards import CommandGate, Watchdog
from dreamzero_franka.common.limits import DROID_HOME
from dreamzero_franka.common.operator import Command, Operator

logger = logging.getLogger(__name__)


@dataclass
class LoopConfig:
    control_hz: float = 15.0
    open_loop_horizon: int = 8  # rows of each chunk executed before the next query
    max_steps: int = 450  # 30 s at 15 Hz
    prefetch: bool = False  # query the next chunk in the background while executing the current one
    prefetch_lead_steps: int = 2  # how many ticks early the prefetch query is sent
    rtc: bool = False  # prefetch with the measured delay, the server continues the executing chunk (docs/rtc.md)
    rtc_max_delay_steps: int | None = None  # cap on the measured delay (always at most H // 2)
    chunk_wait_s: float = 30.0  # how long the arm may hold waiting for a late prefetched chunk
    max_rejected_chunks: int = 3  # consecutive rejected (or stale) chunks before the episode fails
    # no executed action answers an observation older than this (s; None: no wall bound); an older chunk is dropped
    max_observation_age_s: float | None = DEFAULT_MAX_OBSERVATION_AGE_S
    query_retries: int = 0  # queries that failed to reach the server retried in a row (arm held) before failing
    fleet_fields: bool = True  # send observed_at, traffic_class "realtime" and the deadline with every query
    watchdog_timeout_s: float = 0.5  # hold the arm when no command was sent for this long
    home: tuple[float, ...] = tuple(DROID_HOME.tolist())
    home_timeout_s: float = 15.0
    gripper_timeout_s: float = 5.0
    log_dir: str | None = None  # None: no per-episode files
    record_video: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.control_hz <= 100:
            raise ConfigError(f"loop.control_hz must be in (0, 100], got {self.control_hz}")
        if self.open_loop_horizon < 1:
            raise ConfigError(f"loop.open_loop_horizon must be >= 1, got {self.open_loop_horizon}")
        if self.max_steps < 1:
            raise ConfigError(f"loop.max_steps must be >= 1, got {self.max_steps}")
        if self.prefetch and not 1 <= self.prefetch_lead_steps < self.open_loop_horizon:
            raise ConfigError(
                f"loop.prefetch_lead_steps must be in [1, open_loop_horizon={self.open_loop_horizon}), "
                f"got {self.prefetch_lead_steps}"
            )
        if self.rtc and self.prefetch:
            raise ConfigError("loop.rtc: RTC prefetches with the measured delay; leave loop.prefetch off")
        if self.query_retries < 0:
            raise ConfigError(f"loop.query_retries must be >= 0, got {self.query_retries}")
        if self.max_observation_age_s is not None and not self.max_observation_age_s > 0:
            raise ConfigError(f"loop.max_observation_age_s must be positive or None, got {self.max_observation_age_s}")
        if self.rtc_max_delay_steps is not None and self.rtc_max_delay_steps < 1:
            raise ConfigError(f"loop.rtc_max_delay_steps must be >= 1 or None, got {self.rtc_max_delay_steps}")
        if len(self.home) != 7:
            raise ConfigError(f"loop.home must hold 7 joint positions, got {len(self.home)}")
        for name in ("chunk_wait_s", "watchdog_timeout_s", "home_timeout_s", "gripper_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"loop.{name} must be positive, got {getattr(self, name)}")

    @property
    def period_s(self) -> float:
        return 1.0 / self.control_hz

    @property
    def min_chunk_rows(self) -> int:
        """Rows a chunk needs: the executed part, shifted by the prefetch lead (RTC: at least 2, d <= s <= H - d)."""
        if self.rtc:
            return max(self.open_loop_horizon, 2)
        return self.open_loop_horizon + (self.prefetch_lead_steps if self.prefetch else 0)


@dataclass
class EpisodeResult:
    episode_index: int
    session_id: str
    status: str  # "completed" | "aborted" | "failed"
    reason: str | None  # why it was aborted / failed
    label: str | None  # "success" | "failure" (operator) or None
    steps: int
    server_calls: int
    latencies_ms: list[float] = field(default_factory=list)
    rejected_chunks: int = 0
    stale_chunks: int = 0  # replies refused as stale (ChunkExecutor's reasons); the arm held and asked again
    retried_queries: int = 0  # queries that failed to reach the server and were asked again (`query_retries`)
    holds: int = 0
    execution: dict = field(default_factory=dict)  # ChunkExecutor.stats(): stalls, skipped rows, observation ages
    clamps: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0
    log_dir: str | None = None

    @property
    def mean_latency_ms(self) -> float | None:
        return float(np.mean(self.latencies_ms)) if self.latencies_ms else None

    def summary(self) -> dict:
        out = asdict(self)
        out["mean_latency_ms"] = self.mean_latency_ms
        return out


class StaleChunk(Exception):
    """A reply the chunk executor refused (`dreamzero_droid.executor.REFUSALS`): the arm holds and asks again."""

    def __init__(self, reason: str, row: int, age_s: float):
        super().__init__(f"stale chunk ({reason}): it would start at row {row}, observation {age_s:.2f} s old")
        self.reason, self.row, self.age_s = reason, row, age_s

    def describe(self) -> str:
        return self.reason


class EpisodeEnd(Exception):
    """Ends the running episode with `status` ("completed" | "aborted" | "failed"), `reason` and `label`; raised
    inside the episode (the tick, the operator keys, a hook) and caught by `run_episode`."""

    def __init__(self, status: str, reason: str | None = None, label: str | None = None):
        super().__init__(reason or status)
        self.status, self.reason, self.label = status, reason, label


class EpisodeRunner:
    """Runs episodes on connected devices, through an embodiment's hooks (section 3). `cameras` maps the
    embodiment's camera names to cameras; `safety`: its safety filter (`reset()` after a hold); `dataset`: a
    `dreamzero_droid.lerobot.DatasetRecorder` that gets every episode (None: no recording)."""

    #: what the tick treats as a refused chunk (the arm holds, the loop asks again, too many in a row fail the
    #: episode); the first is the policy's own check (`validate_chunk`), an embodiment may add its `accept_chunk`'s
    rejections: tuple[type[Exception], ...] = (ChunkRejected,)
    #: the gripper state the tick assumes after `go_home` (None: unknown, the first row commands the gripper)
    gripper_after_home: bool | None = None

    def __init__(
        self,
        robot: Robot,
        gripper: Gripper,
        cameras: dict[str, Camera],
        policy: SessionPolicy,
        safety,
        config: LoopConfig | None = None,
        operator: Operator | None = None,
        dataset=None,
    ):
        self.robot, self.gripper, self.cameras, self.policy = robot, gripper, cameras, policy
        self.dataset = dataset
        self.safety = safety
        self.config = config or LoopConfig()
        self.operator = operator or Operator()
        self.policy.min_rows = max(self.policy.min_rows, self.config.min_chunk_rows)
        self.quit_requested = False
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="franka-prefetch")
        self.chunks = ChunkExecutor(self.config.control_hz, self.config.max_observation_age_s)
        rtc = self.config.rtc  # one schedule for the session: its delay estimate outlives the episodes
        self.rtc = RtcSchedule(self.config.open_loop_horizon, self.config.control_hz,
                               max_delay_steps=self.config.rtc_max_delay_steps) if rtc else None  # fmt: skip

    # 1. one episode ------------------------------------------------------------------------------------------------
    def run_episode(self, episode_index: int) -> EpisodeResult:
        cfg = self.config
        gate = CommandGate(self.robot)
        result = EpisodeResult(episode_index, "", "completed", None, None, steps=0, server_calls=0)
        log = EpisodeLog(cfg.log_dir, episode_index, cfg.control_hz, cfg.record_video) if cfg.log_dir else None
        if log is not None:
            result.log_dir = str(log.dir)
        watchdog = Watchdog(cfg.watchdog_timeout_s, on_expire=gate.hold)
        t0 = time.monotonic()
        self._pending: concurrent.futures.Future | None = None
        self._pending_mark: ObservationMark | None = None
        self.chunks.reset()
        if self.rtc is not None:
            self.rtc.reset()
        try:
            self.policy.reset()  # releases the previous episode's session; a new session id
            result.session_id = self.policy.session_id
            self.go_home(gate)
            if self.dataset is not None:
                self.dataset.begin_episode(self.policy.prompt)
            with watchdog:
                self._control(result, gate, watchdog, log)
        except EpisodeEnd as end:
            result.status, result.reason, result.label = end.status, end.reason, end.label
        except PolicyCallError as exc:
            result.status, result.reason = "failed", str(exc)
        except DeviceError as exc:
            result.status, result.reason = "failed", f"device error: {type(exc).__name__}: {exc}"
            self._try_recover()
        except DreamZeroError as exc:  # e.g. a camera frame of the wrong shape (InvalidObservation)
            result.status, result.reason = "failed", f"{type(exc).__name__}: {exc}"
        except KeyboardInterrupt:
            result.status, result.reason = "aborted", "interrupted (Ctrl+C)"
            self.quit_requested = True
        except Exception as exc:  # a bug or an unexpected library error: hold, record, then re-raise
            self._safe_hold(gate)
            result.status, result.reason = "failed", f"unexpected error: {type(exc).__name__}: {exc}"
            self._end_recording(result)
            if log is not None:
                log.close({**result.summary(), "prompt": self.policy.prompt, "config": asdict(cfg)})
            raise
        finally:
            self._safe_hold(gate)
            self._drain_prefetch()
            result.holds = gate.holds
            result.execution = self.chunks.stats()
            result.duration_s = time.monotonic() - t0
            if result.status == "failed":
                logger.error("episode %d failed: %s", episode_index, result.reason)
        if result.label is None and result.status != "failed" and not self.quit_requested:
            cmd = self.operator.wait(
                {Command.SUCCESS, Command.FAILURE, Command.NEXT},
                "label the episode: [y] success / [n] failure / Enter to skip",
            )
            result.label = {Command.SUCCESS: "success", Command.FAILURE: "failure"}.get(cmd)
            self.quit_requested |= cmd is Command.QUIT
        self._end_recording(result)
        if log is not None:
            log.close({**result.summary(), "prompt": self.policy.prompt, "config": asdict(cfg)})
        return result

    # 2. the control tick ------------------------------------------------------------------------------------------
    def _control(self, result: EpisodeResult, gate: CommandGate, watchdog: Watchdog, log: EpisodeLog | None) -> None:
        cfg, ex = self.config, self.chunks
        chunk: Chunk | None = None
        rows: np.ndarray | None = None  # the rows of `chunk` that `accept_chunk` let through; None: ask for a chunk
        executed = 0  # rows executed since `chunk` took over
        rejected_in_a_row = failed_in_a_row = 0
        last: np.ndarray | None = None  # RTC: the old chunk's last executed action, for the switch's jump
        self._gripper_closed = self.gripper_after_home
        next_tick = time.monotonic()
        for step in range(cfg.max_steps):
            tick_start = time.monotonic()
            self._handle_operator(gate, watchdog)
            record: dict = {"step": step, "t": tick_start, "queried": False}
            obs, reading = self.read_devices(record)
            observed = False  # each tick's frame enters the policy's history exactly once

            # 2a. a new chunk when the executed part of the current one is used up (RTC: when the schedule says)
            rtc_row = self._rtc_switch_row() if self.rtc is not None and chunk is not None else None
            if rows is None or (executed >= cfg.open_loop_horizon and self.rtc is None) or rtc_row is not None:
                answered = False  # a reply counts as a server call even when `accept_chunk` refuses it
                try:
                    if self._pending is not None:
                        self.policy.observe(obs)
                        observed = True
                        last = ex.last_action
                        mark = self._pending_mark
                        chunk = self._take_prefetched(gate)
                        if self.rtc is not None and rtc_row is None:
                            self.rtc.reset()  # the old chunk stopped before its switch: the schedule starts again
                    else:
                        observed = True  # the request records the frame before the query can fail
                        mark = ex.mark(time.monotonic())
                        chunk = self.policy.send(self._request(obs, mark))
                    answered = True
                    failed_in_a_row = 0
                    result.server_calls += 1
                    result.latencies_ms.append(chunk.latency_ms)
                    if self.rtc is not None:
                        self.rtc.add_latency(chunk.latency_ms)
                    record.update(queried=True, latency_ms=chunk.latency_ms, server=chunk.session)
                    if chunk.restarted:  # the server lost the session: nothing asked before this reply is executed
                        record["session_restarted"] = chunk.restarted
                        ex.invalidate()
                    rows = self.accept_chunk(chunk)
                    offer = ex.offer(rows, mark, time.monotonic())
                    if not offer.accepted:
                        raise StaleChunk(offer.reason, offer.row, offer.age_s)
                    executed, rejected_in_a_row = 0, 0
                    record.update(chunk_seq=mark.seq, start_row=offer.row)
                    if rtc_row is not None and last is not None:
                        record.update(rtc_switch_row=offer.row, rtc_source=chunk.rtc,
                                      switch_jump=switch_jump(last, rows[offer.row]))  # fmt: skip
                except (*self.rejections, StaleChunk) as exc:
                    if not answered:  # the reply itself was unusable
                        result.server_calls += 1
                    if isinstance(exc, StaleChunk):
                        result.stale_chunks += 1
                        record.update(stale=exc.describe())
                    else:
                        result.rejected_chunks += 1
                        record.update(rejected=self.describe_rejection(exc))
                    rejected_in_a_row += 1
                    chunk = rows = None
                    gate.hold()
                    ex.hold()
                    record.update(queried=True, held=True)
                    logger.warning("chunk refused (%d in a row): %s", rejected_in_a_row, exc)
                    if rejected_in_a_row >= cfg.max_rejected_chunks:
                        raise EpisodeEnd(
                            "failed", f"{rejected_in_a_row} chunks in a row rejected; last: {exc}"
                        ) from exc
                    self._finish_tick(log, record, obs, reading, result, step, next_tick)
                    next_tick = self._sleep_until(next_tick + cfg.period_s)
                    continue
                except PolicyCallError as exc:
                    gate.hold()
                    failed_in_a_row += 1
                    if exc.reason not in ("server_unreachable", "timeout") or failed_in_a_row > cfg.query_retries:
                        raise
                    # a retried connection: the arm holds, and no reply to a query asked before it is executed
                    result.retried_queries += 1
                    ex.invalidate()
                    ex.hold()
                    chunk = rows = None
                    if self.rtc is not None:
                        self.rtc.reset()
                    record.update(queried=True, held=True, query_failed=str(exc))
                    logger.warning("query failed (%d in a row), asking again: %s", failed_in_a_row, exc)
                    self._finish_tick(log, record, obs, reading, result, step, next_tick)
                    next_tick = self._sleep_until(next_tick + cfg.period_s)
                    continue

            # 2b. prefetch: `lead` ticks before the executed part runs out, query from this tick's observation; the
            # new chunk's row 0 is this tick's action, so it starts at row `lead` when it takes over
            if cfg.prefetch and self._pending is None and executed == cfg.open_loop_horizon - cfg.prefetch_lead_steps:
                self._prefetch(obs, deadline_rows=cfg.prefetch_lead_steps)
                observed = True
            # RTC: the query leaves at row s of the current chunk with d = the measured delay (docs/rtc.md)
            asked = self.rtc.plan(rows, ex.next_row) if self.rtc is not None and self._pending is None else None
            if asked is not None:
                self._prefetch(obs, deadline_rows=ex.rows_left(), rtc=asked, record=not observed)
                self.rtc.sent(asked, len(rows))
                record.update(rtc_request={"prefix_len": asked.prefix_len, "exec_horizon": asked.exec_horizon})
                observed = True
            if not observed:
                self.policy.observe(obs)

            # 2c. the safety filter, then the command (after a hold the filter starts again from the measured state)
            now = time.monotonic()
            nxt = ex.next_action(now)
            if nxt is None:  # the chunk's observation aged past max_observation_age_s: hold, ask again next tick
                chunk = rows = None
                gate.hold()
                record.update(held=True, stale="observation_expired")
                self._finish_tick(log, record, obs, reading, result, step, next_tick)
                next_tick = self._sleep_until(next_tick + cfg.period_s)
                continue
            row, action = nxt
            record.update(obs_age_s=ex.ages_s[-1], chunk_seq=ex.current_seq)
            if gate.was_held():
                self.safety.reset()
            for name in self.execute_row(action, row, reading, gate, watchdog, record):
                result.clamps[name] = result.clamps.get(name, 0) + 1
            executed += 1  # the policy's min_rows keeps the row inside the chunk (open-loop horizon + lead)

            self._finish_tick(log, record, obs, reading, result, step, next_tick)
            next_tick = self._sleep_until(next_tick + cfg.period_s)

    def _request(self, obs: dict, mark: ObservationMark, deadline_rows: int | None = None, **kwargs):
        """The policy's query of `obs` with the fleet's fields (a policy whose queries have none sends none)."""
        query = self.policy.request(obs, **kwargs)
        if not self.config.fleet_fields or not hasattr(query, "observed_at"):
            return query
        wall = time.time() - (time.monotonic() - mark.at)  # the observation's time on the wall clock (unix s)
        deadline = None if deadline_rows is None else deadline_rows * self.config.period_s * 1e3
        return dataclasses.replace(query, observed_at=wall, traffic_class="realtime", deadline_ms=deadline)

    def _prefetch(self, obs: dict, deadline_rows: int, **kwargs) -> None:
        """Send the query of this tick's observation in the background (the current chunk runs on meanwhile)."""
        self._pending_mark = self.chunks.mark(time.monotonic())
        query = self._request(obs, self._pending_mark, deadline_rows, **kwargs)
        self._pending = self._executor.submit(self.policy.send, query)

    def _finish_tick(self, log, record, obs, reading, result, step, next_tick) -> None:
        result.steps = step + 1
        if self.dataset is not None:  # a copy into the writer's queue; the disk is the writer thread's
            self.dataset.add_frame(*self.dataset_frame(obs, reading, record))
        if log is None:
            return
        fields, views = self.log_entry(obs, reading)
        record.update(fields)
        record.update(
            tick_ms=(time.monotonic() - record["t"]) * 1e3,
            late_ms=max(0.0, (record["t"] - next_tick) * 1e3),
        )
        log.step(record, views)

    def send_gripper(self, closed: bool | None) -> bool | None:
        """Command the gripper when `closed` differs from its last command (None keeps it); the state after. Only
        changes are sent: a gripper command takes a while and runs one at a time."""
        if closed is not None and closed != self._gripper_closed:
            self.gripper.send(closed)
            self._gripper_closed = closed
        return self._gripper_closed

    def _rtc_switch_row(self) -> int | None:
        """The row the new chunk starts at this tick, or None to keep executing the old one."""
        if self._pending is None:
            return None
        row = self.rtc.switch_row(ready=self._pending.done())
        if row is not None:
            self.rtc.switched()
        return row

    def _take_prefetched(self, gate: CommandGate) -> Chunk:
        """The prefetched chunk; if it is late the arm holds while we wait (bounded by chunk_wait_s)."""
        future, self._pending = self._pending, None
        if not future.done():
            gate.hold()
        try:
            return future.result(timeout=self.config.chunk_wait_s)
        except concurrent.futures.TimeoutError as exc:
            future.cancel()
            raise PolicyCallError("timeout", f"no chunk within {self.config.chunk_wait_s:.1f} s") from exc

    def _handle_operator(self, gate: CommandGate, watchdog: Watchdog) -> None:
        for cmd in self.operator.poll():
            if cmd is Command.PAUSE:
                gate.hold()
                cmd = self.operator.wait(
                    {Command.PAUSE, Command.RESUME, Command.ABORT, Command.SUCCESS, Command.FAILURE},
                    "paused (arm holding): [p]/[r] resume, [a]bort, [y]/[n] label and end",
                )
                watchdog.feed()
                if cmd in (Command.PAUSE, Command.RESUME):
                    continue
            if cmd is Command.ABORT:
                raise EpisodeEnd("aborted", "aborted by the operator")
            if cmd is Command.SUCCESS:
                raise EpisodeEnd("completed", None, "success")
            if cmd is Command.FAILURE:
                raise EpisodeEnd("completed", None, "failure")
            if cmd is Command.QUIT:
                self.quit_requested = True
                raise EpisodeEnd("aborted", "quit by the operator")

    @staticmethod
    def _sleep_until(deadline: float) -> float:
        now = time.monotonic()
        if deadline > now:
            time.sleep(deadline - now)
            return deadline
        return now  # overran (e.g. a synchronous query): restart the schedule instead of catching up

    # 3. the embodiment's hooks (DROID joint control: droid/loop.py; franka_pnp: pnp/loop.py) --------------------------
    def go_home(self, gate: CommandGate) -> None:
        """Before the first tick: move to the start pose, open the gripper, start the safety filter afresh."""
        raise NotImplementedError

    def read_devices(self, record: dict) -> tuple[dict, tuple]:
        """Observe the devices: (the policy's observation of this tick, the reading `execute_row` and `log_entry` get
        back); may add fields to the tick's `record`."""
        raise NotImplementedError

    def accept_chunk(self, chunk: Chunk) -> np.ndarray:
        """The rows of a new chunk to execute; raise one of `rejections` to refuse the chunk whole. By default the
        policy's own check (`validate_chunk`) is the whole check: every row still passes the safety filter."""
        return chunk.actions

    @staticmethod
    def describe_rejection(exc: Exception) -> str:
        """A refused chunk's note in the step log."""
        return str(exc)

    def execute_row(
        self, action: np.ndarray, row: int, reading: tuple, gate: CommandGate, watchdog: Watchdog, record: dict
    ) -> tuple[str, ...]:
        """Pass one row through the safety filter, command the arm (through `gate`; feed `watchdog` when a command
        went out) and the gripper (`send_gripper`), note it in `record`; returns the names of the limits that
        changed the command."""
        raise NotImplementedError

    def log_entry(self, obs: dict, reading: tuple) -> tuple[dict, list[np.ndarray]]:
        """(the measured fields of the step log, the views of the episode video)."""
        raise NotImplementedError

    def dataset_frame(self, obs: dict, reading: tuple, record: dict) -> tuple[dict, dict]:
        """(images, vectors) of the tick for `dataset` (columns: recording.py)."""
        raise NotImplementedError

    # 4. ways out ---------------------------------------------------------------------------------------------------
    def _end_recording(self, result: EpisodeResult) -> None:
        """Close the episode in `dataset`, marked by its result. A recorder that failed ends the session (its error
        is logged; every later episode would fail at its first tick)."""
        if self.dataset is None:
            return
        try:
            self.dataset.end_episode(**episode_marks(result.status, result.reason, result.label))
        except DreamZeroError as exc:
            logger.error("%s; stopping the session", exc)
            self.quit_requested = True

    def _safe_hold(self, gate: CommandGate) -> None:
        try:
            gate.hold()
        except Exception:
            logger.exception("could not hold the arm at the end of the episode")

    def _try_recover(self) -> None:
        try:
            if not self.robot.recover():
                logger.error("automatic error recovery failed; check the robot before the next episode")
        except Exception:
            logger.exception("automatic error recovery raised")

    def _drain_prefetch(self) -> None:
        """Wait (bounded) for an in-flight query so it never overlaps the next episode's reset."""
        future, self._pending = self._pending, None
        if future is not None:
            try:
                future.result(timeout=self.config.chunk_wait_s)
            except Exception as exc:  # noqa: BLE001 - its result belongs to an episode that is over
                logger.info("discarded the in-flight query of the finished episode: %s", exc)

    # 5. a whole deployment session ----------------------------------------------------------------------------------
    def run(self, episodes: int) -> list[EpisodeResult]:
        results: list[EpisodeResult] = []
        try:
            for index in range(episodes):
                cmd = self.operator.wait(
                    {Command.START, Command.NEXT},
                    f"episode {index + 1}/{episodes}: {self.policy.prompt!r} -- [s]tart (or Enter) / [q]uit",
                )
                if cmd not in (Command.START, Command.NEXT):
                    break
                result = self.run_episode(index)
                results.append(result)
                self.operator.say(
                    f"episode {index + 1}: {result.status}"
                    + (f" ({result.reason})" if result.reason else "")
                    + (f", label {result.label}" if result.label else "")
                    + f", {result.steps} steps, {result.server_calls} server calls"
                )
                if self.quit_requested:
                    break
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)
        return results


def episode_marks(status: str, reason: str | None, label: str | None) -> dict:
    """`end_episode`'s arguments for an episode result: success from the operator's label (None: not asked or
    skipped, unknown); outcome from it for an episode that ran to its end or was labelled, else "failed" for a fault
    (server lost, device error, too many refused chunks) or "aborted" for a stop (operator, Ctrl+C), the reason as
    the note."""
    success = {"success": True, "failure": False}.get(label)
    if status == "completed":
        return {"success": success, "outcome": None, "note": None}
    return {"success": success, "outcome": "failed" if status == "failed" else "aborted", "note": reason}
