"""The LIBERO evaluation loop, as RLinf runs it: B environments stepped together, one B-row request per chunk.

Episodes are (task, init state) pairs, run task-major. B slots each own an env worker process. At every chunk
boundary the idle slots start their next episode (reset to the init state, then a few still steps so the objects
settle), every running episode contributes one row to ONE request, and the reply's chunk is executed open loop
(`action_chunk` rows, 16 by default) by all slots in lockstep. An episode ends at its first success (success_once),
at the step limit, or on a failure: a failed or timed-out request fails the episodes of that request, a crashed or
hung env (each step bounded by `step_timeout_s`) fails its own episode and its worker is replaced. Every episode,
failed or not, is written to `episodes/<name>.json`; the run ends with `summary.json` / `summary.md` (the DROID
eval's summary, tasks in place of scenes) and optionally `report.html`.

Each episode executes through its own `dreamzero_droid.executor.ChunkExecutor` on the sim clock (steps / control rate,
which stands still while the lockstep request runs): every chunk starts at row 0, a reply is executed once, and the
episode's record carries the counters and the age of the observation behind its actions (`execution`).
"""
# Longer than ~400 lines on purpose: the lock-step loop over B environments, its per-slot bookkeeping and the records
# it writes change together.

from __future__ import annotations

import json
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dreamzero.errors import ConfigError
from dreamzero_droid.executor import ChunkExecutor
from dreamzero_droid.image_tools import resize_with_pad
from eval.libero.adapter import (
    FORMS,
    FRAME_OFFSETS,
    HISTORY_LEN,
    ChunkError,
    LiberoFrame,
    PreparedRequest,
    RequestCodec,
    frame_stack,
)
from eval.libero.env import CONTROL_HZ, TaskInfo, default_max_steps
from eval.libero.workers import EnvFailure, EnvWorker
from eval.recording import EpisodeRecorder, configure_ffmpeg, to_jsonable
from eval.summary import config_record, latency_stats, summarize, summary_markdown

#: failure reasons of a policy call (the DROID eval's vocabulary) plus the client's own errors
POLICY_FAILURE_REASONS = ("server_unreachable", "timeout", "error_reply", "bad_chunk", "client_error")


@dataclass
class LiberoEvalConfig:
    out_dir: Path
    suite: str = "libero_spatial"
    task_ids: tuple[int, ...] | None = None  # None: every task of the suite
    init_states: tuple[int, ...] | None = None  # init-state indexes per task; None: all of them (50 in LIBERO)
    num_envs: int = 8  # B: environments stepped together, rows of one request
    form: str = "raw"  # "raw" (libero_sim keys) or "normalised" (RLinf's client-side normalisation)
    action_chunk: int = 16  # actions executed open loop per request (the libero_sim horizon)
    # frames per row: 4 (a stack over the last chunk: the session continues on the server) or 1 (the current frame:
    # the server restarts the session from it every chunk, as with RLinf's adapter); None: 4 raw, 1 normalised
    frame_stack: int | None = None
    max_steps: int | None = None  # None: the suite's published limit (220 for LIBERO-Spatial)
    settle_steps: int = 10  # still steps after setting the init state, not counted as episode steps
    step_timeout_s: float = 60.0  # one lockstep step of all envs (the first step of a fresh env compiles: slow)
    reset_timeout_s: float = 600.0  # starting an episode, env creation included
    request_timeout_s: float | None = None  # per request; None: the client's own timeout
    seed: int = 0  # per-row request seeds are seed + episode number
    record_video: bool = True
    predicted_video: bool = False  # ask for each chunk's predicted frames: imagined vs real per episode
    start_method: str = "spawn"
    extra: dict = field(default_factory=dict)  # free-form facts recorded in summary.json

    def validate(self) -> None:
        for name in ("num_envs", "action_chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.form not in FORMS:
            raise ConfigError(f"form: expected one of {list(FORMS)}, got {self.form!r}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps: expected >= 1 or None, got {self.max_steps}")
        if self.frame_stack not in (None, 1, len(FRAME_OFFSETS)):
            raise ConfigError(f"frame_stack: expected 1, {len(FRAME_OFFSETS)} or None, got {self.frame_stack}")
        if self.settle_steps < 0:
            raise ConfigError(f"settle_steps: expected >= 0, got {self.settle_steps}")
        for name in ("step_timeout_s", "reset_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: expected > 0, got {getattr(self, name)}")

    @property
    def frames_per_row(self) -> int:
        if self.frame_stack is not None:
            return self.frame_stack
        return len(FRAME_OFFSETS) if self.form == "raw" else 1

    @property
    def step_limit(self) -> int:
        return self.max_steps if self.max_steps is not None else default_max_steps(self.suite)


def plan_episodes(
    tasks: Sequence[TaskInfo], task_ids: Sequence[int] | None, init_states: Sequence[int] | None
) -> list[tuple[TaskInfo, int]]:
    """(task, init index) pairs, task-major; unknown task ids or init indexes fail naming the field."""
    by_id = {t.task_id: t for t in tasks}
    chosen = list(task_ids) if task_ids is not None else sorted(by_id)
    plan = []
    for tid in chosen:
        if tid not in by_id:
            raise ConfigError(f"task_ids: no task {tid} in this suite (tasks: {sorted(by_id)})")
        task = by_id[tid]
        indexes = list(init_states) if init_states is not None else list(range(task.num_init_states))
        for i in indexes:
            if not 0 <= i < task.num_init_states:
                raise ConfigError(f"init_states: task {tid} has init states 0..{task.num_init_states - 1}, got {i}")
            plan.append((task, i))
    if not plan:
        raise ConfigError("task_ids / init_states: nothing to evaluate")
    return plan


def classify_policy_error(exc: BaseException) -> str:
    """A failed request's reason, in the DROID eval's vocabulary."""
    from dreamzero_client.errors import ProtocolError, ServerError, ServerUnavailableError

    if isinstance(exc, TimeoutError) or (isinstance(exc, ServerUnavailableError) and "timeout" in str(exc).lower()):
        return "timeout"
    if isinstance(exc, ServerUnavailableError):
        return "server_unreachable"
    if isinstance(exc, ServerError):
        return "error_reply"
    if isinstance(exc, ProtocolError | ChunkError):
        return "bad_chunk"
    return "client_error"


class LiberoRecorder(EpisodeRecorder):
    """The DROID recorder with a two-view frame (agent view | wrist view, both upright)."""

    def __init__(self, out_dir: Path, name: str, fps: float, record_video: bool, frame_size: tuple[int, int]):
        super().__init__(out_dir, name, fps=fps, record_video=False, frame_size=frame_size)
        if record_video:
            import mediapy

            configure_ffmpeg()
            self.video_path = self.out_dir / "videos" / f"{name}.mp4"
            self.video_path.parent.mkdir(parents=True, exist_ok=True)
            h, w = frame_size
            self._writer = mediapy.VideoWriter(self.video_path, shape=(h, 2 * w), fps=fps)
            self._writer.__enter__()

    def add_frame(self, frame: LiberoFrame) -> None:  # type: ignore[override]
        if self._writer is None:
            return
        views = [resize_with_pad(v, *self.frame_size) for v in (frame.image, frame.wrist_image)]  # as the DROID video
        self._writer.add_image(np.concatenate(views, axis=1))
        self.frames_written += 1


@dataclass
class Episode:
    task: TaskInfo
    init_index: int
    number: int  # position in the plan
    name: str
    session_id: str
    recorder: LiberoRecorder
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY_LEN))  # LiberoFrames, current last
    steps: int = 0
    success_once: bool = False
    success_step: int | None = None
    failure: dict | None = None
    latencies_ms: list[float] = field(default_factory=list)
    sessions: list[dict] = field(default_factory=list)
    chunk: np.ndarray | None = None
    started: float = field(default_factory=time.perf_counter)
    step_wall_s: list[float] = field(default_factory=list)
    first_call: bool = True
    imagined: Any = None  # eval.imagined.ImaginedTrack with --predicted-video
    # which row runs at a step, on the sim clock; no wall bound: the sim waits for every request
    executor: ChunkExecutor = field(default_factory=lambda: ChunkExecutor(CONTROL_HZ, max_observation_age_s=None))

    @property
    def sim_time(self) -> float:
        return self.steps / CONTROL_HZ


@dataclass
class Slot:
    index: int
    worker: EnvWorker | None = None
    episode: Episode | None = None


class LiberoEvaluation:
    """Runs a plan of episodes on `config.num_envs` env workers against `client` (an `ActionClient`)."""

    def __init__(self, backend: Any, client: Any, config: LiberoEvalConfig, metadata: Any = None, progress=None):
        config.validate()
        self.backend, self.client, self.config = backend, client, config
        self.codec = RequestCodec(config.form, metadata)
        self.out = Path(config.out_dir)
        self.records: list[dict] = []
        self.request_latencies_ms: list[float] = []
        self.progress = progress
        self.run_id = uuid.uuid4().hex[:8]

    # 1. Episode lifecycle ------------------------------------------------------------------------------------------

    def _new_episode(self, task: TaskInfo, init_index: int, number: int) -> Episode:
        name = f"task{task.task_id:02d}_init{init_index:03d}"
        side = self.codec.embodiment.view_hw if self.codec.embodiment is not None else (256, 256)
        recorder = LiberoRecorder(self.out, name, CONTROL_HZ, self.config.record_video, tuple(side))
        session = f"libero-eval-{self.run_id}-{name}"
        episode = Episode(task, init_index, number, name, session, recorder)
        if self.config.predicted_video:
            episode.imagined = libero_track(self.codec.embodiment)
        return episode

    def _finish(self, slot: Slot, failure: dict | None = None) -> None:
        ep = slot.episode
        slot.episode = None
        if failure is not None and ep.failure is None:
            ep.failure = failure
        ep.recorder.close()
        self.client.forget_sessions(ep.session_id)
        record = {
            "name": ep.name,
            "scene_id": ep.task.task_id,  # the summary and report group by scene: a task here
            "task_id": ep.task.task_id,
            "episode": ep.init_index,
            "init_state": ep.init_index,
            "instruction": ep.task.instruction,
            "suite": self.config.suite,
            "session_id": ep.session_id,
            "slot": slot.index,
            "success": ep.success_once and ep.failure is None,
            "success_once": ep.success_once,
            "success_step": ep.success_step,
            "num_steps": ep.steps,
            "max_steps": self.config.step_limit,
            "server_calls": len(ep.latencies_ms),  # requests this episode's row was part of
            "latencies_ms": ep.latencies_ms,
            "failure": ep.failure,
            "server_sessions": ep.sessions,
            "step_wall_ms": latency_stats([s * 1000.0 for s in ep.step_wall_s]),
            "execution": ep.executor.stats(),  # stalls, skipped rows, observation ages (sim seconds)
            "video": str(ep.recorder.video_path.relative_to(self.out)) if ep.recorder.video_path else None,
            "imagined": None if ep.imagined is None else ep.imagined.finish(self.out, ep.name, fps=5),
            "wall_s": time.perf_counter() - ep.started,
        }
        record["record"] = str(ep.recorder.write_json(record).relative_to(self.out))
        self.records.append(record)
        if self.progress is not None:
            self.progress.update(1)
            self.progress.set_postfix_str(f"{ep.name}: {'success' if record['success'] else 'fail'}")

    def _fail_worker(self, slot: Slot, exc: EnvFailure) -> None:
        """The env of `slot` failed: record the episode and drop the worker (a fresh one runs the next episode)."""
        if slot.worker is not None:
            slot.worker.kill()
            slot.worker = None
        self._finish(slot, {"reason": exc.reason, "message": exc.detail, "step": slot.episode.steps})

    # 2. The three phases of a chunk --------------------------------------------------------------------------------

    def _start_episodes(self, slots: list[Slot], pending: deque) -> None:
        starting = []
        for slot in slots:
            if slot.episode is None and pending:
                task, init_index, number = pending.popleft()
                slot.episode = self._new_episode(task, init_index, number)
                if slot.worker is None:
                    slot.worker = EnvWorker(self.backend, f"libero-env-{slot.index}", self.config.start_method)
                try:
                    slot.worker.send_reset(task.task_id, init_index, self.config.settle_steps)
                    starting.append(slot)
                except EnvFailure as exc:
                    self._fail_worker(slot, exc)
        deadline = time.monotonic() + self.config.reset_timeout_s
        for slot in starting:
            try:
                frame, _ = slot.worker.receive(deadline)
                slot.episode.history.append(frame)
                slot.episode.recorder.add_frame(frame)
                if slot.episode.imagined is not None:
                    slot.episode.imagined.observed(0, frame)
            except EnvFailure as exc:
                self._fail_worker(slot, exc)

    def _query(self, active: list[Slot]) -> None:
        """ONE request for every running episode; a failure ends all of them with its reason."""
        episodes = [s.episode for s in active]
        marks = [ep.executor.mark(ep.sim_time) for ep in episodes]
        started = time.perf_counter()
        prepared: PreparedRequest | None = None
        try:
            n = self.config.frames_per_row
            stacks = [frame_stack(ep.history, n) for ep in episodes]
            prepared = self.codec.build(stacks, [ep.task.instruction for ep in episodes])
            result = self.client.generate(
                prepared.observation,
                prepared.prompts,
                [ep.session_id for ep in episodes],
                form=prepared.form,
                reset=[ep.first_call for ep in episodes],
                seed=[self.config.seed + ep.number for ep in episodes],
                negative_prompts=prepared.negative_prompts,
                timeout_s=self.config.request_timeout_s,
                **({"return_video": True} if self.config.predicted_video else {}),
            )
            chunks = self.codec.actions(result.actions, prepared)
        except Exception as exc:  # noqa: BLE001  (any failure of the call is recorded; the run goes on)
            failure = {"reason": classify_policy_error(exc), "message": f"{type(exc).__name__}: {exc}"}
            for slot in active:
                self._finish(slot, {**failure, "step": slot.episode.steps})
            return
        latency_ms = (time.perf_counter() - started) * 1000.0
        self.request_latencies_ms.append(latency_ms)
        by_id = {s.get("session_id"): s for s in result.sessions if isinstance(s, dict)}
        video = getattr(result, "video", None)
        for i, (ep, chunk, mark) in enumerate(zip(episodes, chunks, marks)):
            ep.executor.offer(chunk, mark, ep.sim_time)  # row 0: the sim stood still during the request
            ep.chunk, ep.first_call = chunk, False
            ep.latencies_ms.append(latency_ms)
            if ep.imagined is not None:
                ep.imagined.predicted(ep.steps, None if video is None else video[i])
            if ep.session_id in by_id:
                ep.sessions.append(by_id[ep.session_id])

    def _execute_chunk(self, active: list[Slot]) -> None:
        """Step every running episode through its chunk open loop, in lockstep, one bounded step at a time."""
        rows = min(self.config.action_chunk, *(len(s.episode.chunk) for s in active))
        limit = self.config.step_limit
        for row in range(rows):
            live = [s for s in active if s.episode is not None]
            if not live:
                return
            sent = []
            t0 = time.perf_counter()
            for slot in live:
                nxt = slot.episode.executor.next_action(slot.episode.sim_time)
                if nxt is None:  # nothing left to execute (a refused or used-up chunk): never a stale action
                    self._finish(slot, {"reason": "stale_chunk", "message": "no chunk to execute",
                                        "step": slot.episode.steps})  # fmt: skip
                    continue
                try:
                    slot.worker.send_step(nxt[1])
                    sent.append(slot)
                except EnvFailure as exc:
                    self._fail_worker(slot, exc)
            deadline = time.monotonic() + self.config.step_timeout_s
            for slot in sent:
                ep = slot.episode
                try:
                    frame, success = slot.worker.receive(deadline)
                except EnvFailure as exc:
                    self._fail_worker(slot, exc)
                    continue
                ep.step_wall_s.append(time.perf_counter() - t0)
                ep.history.append(frame)
                ep.recorder.add_frame(frame)
                ep.recorder.add_step(
                    {
                        "step": ep.steps,
                        "queried": row == 0,
                        "chunk_row": row,
                        "action": ep.chunk[row],
                        "state": frame.state,
                        "joint_position": frame.joint_position,
                        "gripper_position": frame.state[6:7],  # first finger (m): the report's gripper trace
                        "success": success,
                    }
                )
                ep.steps += 1
                if ep.imagined is not None:
                    ep.imagined.observed(ep.steps, frame)
                if success and not ep.success_once:
                    ep.success_once, ep.success_step = True, ep.steps
                if ep.success_once or ep.steps >= limit:
                    self._finish(slot)

    # 3. The run ------------------------------------------------------------------------------------------------------

    def run(self, plan: list[tuple[TaskInfo, int]]) -> list[dict]:
        pending = deque((task, init, number) for number, (task, init) in enumerate(plan))
        slots = [Slot(i) for i in range(min(self.config.num_envs, len(plan)))]
        try:
            while pending or any(s.episode is not None for s in slots):
                self._start_episodes(slots, pending)
                active = [s for s in slots if s.episode is not None]
                if not active:
                    continue
                self._query(active)
                active = [s for s in active if s.episode is not None]
                if active:
                    self._execute_chunk(active)
        finally:
            for slot in slots:
                if slot.episode is not None:  # interrupted: keep what we have
                    self._finish(slot, {"reason": "interrupted", "message": "run stopped", "step": slot.episode.steps})
                if slot.worker is not None:
                    slot.worker.close()
        return sorted(self.records, key=lambda r: (r["task_id"], r["init_state"]))


def libero_track(embodiment=None):
    """An `ImaginedTrack` on LIBERO's frames: the libero_sim canvas of the frames at the adapter's offsets."""
    from eval.imagined import ImaginedTrack
    from eval.libero.adapter import raw_observation

    if embodiment is None:
        from dreamzero.embodiments import get_embodiment

        embodiment = get_embodiment("libero_sim")

    def canvas(frames: list) -> np.ndarray:
        batch, _ = embodiment.preprocess(raw_observation([frames]), batched=True)
        return np.asarray(batch.images)[0]

    return ImaginedTrack(canvas=canvas, keep=lambda frame: frame, offsets=FRAME_OFFSETS, block_steps=HISTORY_LEN)


def summarize_libero(records: list[dict], config: LiberoEvalConfig, request_latencies_ms: list[float]) -> dict:
    """The DROID summary over tasks, plus success_once per task and overall and the request-level figures."""
    summary = summarize(records)
    summary["suite"] = config.suite
    summary["success_once"] = {
        "overall": summary["success_rate"],
        "per_task": {tid: s["success_rate"] for tid, s in summary["per_scene"].items()},
    }
    # one request carries B rows: count requests, not rows, and time them once each
    summary["requests"] = len(request_latencies_ms)
    summary["request_latency_ms"] = latency_stats(request_latencies_ms)
    summary["latency_ms"] = summary["request_latency_ms"]
    summary["server_calls"] = summary["requests"]
    cfg = config_record(config)
    cfg["open_loop_horizon"] = config.action_chunk  # the name the report reads
    cfg["max_steps"] = config.step_limit
    cfg["frame_stack"] = config.frames_per_row
    cfg["extra"] = {"simulator": "libero", "benchmark": "LIBERO", **config.extra}
    summary["config"] = to_jsonable(cfg)
    summary["episode_records"] = [
        {k: r[k] for k in ("name", "scene_id", "episode", "success", "num_steps", "video", "record", "failure")}
        for r in records
    ]
    return summary


def run_libero_evaluation(
    backend: Any,
    client: Any,
    config: LiberoEvalConfig,
    metadata: Any = None,
    show_progress: bool = False,
) -> dict:
    """Plan the episodes, run them, write `summary.json` and `summary.md`; returns the summary.

    `backend`: `eval.libero.env.LiberoBackend(suite)` or a fake with `tasks()` / `make(task_id)` (picklable);
    `client`: a `dreamzero_client.http_client.ActionClient` (or anything with its `generate` / `forget_sessions`);
    `metadata`: the libero_sim statistics for the normalised form (path, checkpoint dir, dict, None = shipped).
    """
    from dreamzero.progress import progress_bar

    config.validate()
    plan = plan_episodes(backend.tasks(), config.task_ids, config.init_states)
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with progress_bar(len(plan), "LIBERO eval", "episode", enabled=show_progress) as bar:
        evaluation = LiberoEvaluation(backend, client, config, metadata, progress=bar)
        records = evaluation.run(plan)
    summary = summarize_libero(records, config, evaluation.request_latencies_ms)
    (out / "summary.json").write_text(json.dumps(to_jsonable(summary), indent=1))
    (out / "summary.md").write_text(summary_markdown(summary))
    return summary
