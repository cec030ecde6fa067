"""The parts of benchmarks/fleet.py: simulated robots on the project's client runtime, and what they query.

A robot is a `dreamzero_droid.policy.DroidPolicy` over a link, ticking at its control rate as the Franka loop does
(`dreamzero_franka.common.loop`): every tick it observes (the policy's frame history), takes a chunk that is there
and due, and executes one action or, with none to execute, holds (a stall). Schedules (`Pace.schedule`):

- `sync`: the Franka loop's default: after `open_loop_horizon` actions the query blocks the loop (every tick it
  waits is a stall: a robot on `sync` keeps pace only if a chunk comes within one tick);
- `prefetch`: the query leaves `prefetch_lead_steps` ticks before the executed part runs out, and the new chunk
  takes over at its row `lead` (`--prefetch`);
- `rtc`: real-time chunking (`dreamzero_droid.rtc.RtcSchedule`, `--rtc`): the query leaves at row s, the old chunk
  runs on to its end while the next one is computed, the new one takes over at the row of the tick it is taken.

Which action a tick executes is the client runtime's choice (`dreamzero_droid.executor.ChunkExecutor`): a chunk
starts at the row of the actions executed since its observation (the ones whose time has passed are skipped), and
one with none left is dropped (counted) and asked again. What the robot records: stalls, chunk latency, the time its
executing chunk had left when each query left (its budget) and the age of the observation behind each action.

The robots query one of: `BatchedServer` (one embedded pipeline behind the Policy's own batcher and merge, no Ray),
`ProcessServer` (a worker process with its own pipeline answering one call at a time: the reference servers' way),
or a running server through a door (`dreamzero_droid.links` for HTTP and OpenPI, `ZmqLink` below for ZeroMQ).
"""
# Longer than ~400 lines on purpose: the robot's tick and the three kinds of server it queries are read together.

from __future__ import annotations

import asyncio
import functools
import multiprocessing as mp
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from dreamzero_droid import droid
from dreamzero_droid.policy import DroidPolicy, LinkReply, Query
from dreamzero_droid.rtc import RtcSchedule

SCHEDULES = ("sync", "prefetch", "rtc")
#: the longest a query may take before the robot counts it as an error (every wait has a bound)
CALL_TIMEOUT_S = 120.0
PROMPT = "put the marker in the cup"


@dataclass(frozen=True)
class Pace:
    """A robot's client settings; defaults: DROID's 15 Hz and the evaluation's open-loop horizon of 8."""

    control_hz: float = 15.0
    open_loop_horizon: int = 8
    schedule: str = "rtc"
    prefetch_lead_steps: int = 2

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {SCHEDULES}, got {self.schedule!r}")
        if not 0 < self.control_hz <= 100 or self.open_loop_horizon < 1:
            raise ValueError(f"control_hz in (0, 100] and open_loop_horizon >= 1, got {self}")
        if self.schedule == "prefetch" and not 1 <= self.prefetch_lead_steps < self.open_loop_horizon:
            raise ValueError(f"prefetch_lead_steps must be in [1, {self.open_loop_horizon}), got {self}")

    @property
    def period_s(self) -> float:
        return 1.0 / self.control_hz


@dataclass
class RobotStats:
    """What one robot felt."""

    robot: int
    ticks: int = 0  # ticks after its first chunk arrived
    stalls: int = 0  # of those, ticks with no action to execute
    start_ms: float | None = None  # its session's first chunk (reported apart)
    latencies_ms: list[float] = field(default_factory=list)  # every later chunk, as the client saw it
    budgets_ms: list[float] = field(default_factory=list)  # per query: what the executing chunk had left
    ages_ms: list[float] = field(default_factory=list)  # per executed action: its observation's age
    chunks: int = 0
    dropped: int = 0  # chunks taken with every action's time passed
    skipped: int = 0  # actions skipped because their time had passed
    late_ticks: int = 0  # ticks this process started over a period late (a loaded machine, not the server)
    errors: list[str] = field(default_factory=list)

    def p99_ms(self) -> float:
        return float(np.percentile(self.latencies_ms, 99)) if self.latencies_ms else float("nan")

    def at_pace(self) -> bool:
        """0 stalls, and the p99 chunk latency within the least time an executing chunk had left."""
        if self.errors or not self.latencies_ms or self.stalls:
            return False
        return self.p99_ms() <= min(self.budgets_ms, default=0.0)


# ---------------------------------------------------------------------------------------------------------------------
# 1. One robot
# ---------------------------------------------------------------------------------------------------------------------


def observation(robot: int, rng: np.random.Generator) -> dict:
    """A DROID observation at the wire's image size (no resize on the robot's side)."""
    obs = {cam: rng.integers(0, 256, (*droid.IMAGE_HW, 3), dtype=np.uint8) for cam in droid.CAMERAS}
    obs["joint_position"] = rng.uniform(-1, 1, droid.NUM_JOINTS).astype(np.float32)
    obs["gripper_position"] = np.array([robot % 2], np.float32)
    return obs


#: the fleet's per-row fields a query carries (docs/fleet.md), None: not sent
FLEET_FIELDS = ("traffic_class", "deadline_ms", "observed_at")


def fleet_fields(query: Query) -> dict:
    return {k: getattr(query, k) for k in FLEET_FIELDS if getattr(query, k, None) is not None}


def run_robot(index: int, policy: DroidPolicy, pace: Pace, ticks: int, t0: float, stats: RobotStats,
              traffic_class: str = "realtime") -> None:  # fmt: skip
    """`ticks` control ticks of one robot from monotonic time `t0`; what it felt goes into `stats`. The action of
    each tick is the client runtime's choice (`dreamzero_droid.executor.ChunkExecutor`: a chunk starts at the row of
    the actions executed since its observation, and is dropped when none is left). Every query carries the fleet's
    fields as the Franka loop's do: `observed_at`, the class and, unless it blocks, `deadline_ms`."""
    from dreamzero_droid.executor import ChunkExecutor

    period, horizon = pace.period_s, pace.open_loop_horizon
    rtc = RtcSchedule(horizon, pace.control_hz) if pace.schedule == "rtc" else None
    executor = ChunkExecutor(pace.control_hz)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"robot-{index}")
    frames = [observation(index, np.random.default_rng(1000 * index + k)) for k in range(4)]  # cheap to cycle
    chunk, executed = None, 0  # the executing chunk's actions; its actions executed (the loop's open-loop count)
    pending = None  # (future, its observation's mark, the tick it left, the least ticks before it may take over)
    next_t = t0

    def ask(obs: dict, tick: int, now: float, actions_left: int, min_k: int, asked=None):
        """Send this tick's query in the background; `actions_left`: what the executing chunk has left for it."""
        deadline_ms = actions_left * period * 1e3
        query = policy.request(obs, rtc=asked, observed_at=time.time(), traffic_class=traffic_class,
                               deadline_ms=deadline_ms if actions_left else None)  # fmt: skip
        if policy.calls > 1:
            stats.budgets_ms.append(deadline_ms)
        return pool.submit(policy.send, query), executor.mark(now), tick, min_k

    try:
        for tick in range(ticks):
            time.sleep(max(0.0, next_t - time.monotonic()))
            now = time.monotonic()
            if now > next_t + period:  # this process overran a tick: restart the schedule, as the Franka loop does
                stats.late_ticks += 1
                next_t = now
            next_t += period
            obs, observed = frames[tick % 4], False
            # 1. a reply that is there and due is offered to the executor (which drops it if nothing is left of it)
            if pending is not None and pending[0].done() and tick - pending[2] >= pending[3]:
                future, mark, _, _ = pending
                pending = None
                got = future.result()
                if stats.start_ms is None:
                    stats.start_ms = got.latency_ms
                else:
                    stats.latencies_ms.append(got.latency_ms)
                stats.chunks += 1
                if rtc is not None:  # the delay estimate learns from every chunk, as the Franka loop's does
                    rtc.add_latency(got.latency_ms)
                    if rtc.pending is not None:
                        rtc.switched()
                if executor.offer(got.actions, mark, now).accepted:
                    chunk, executed = got.actions, 0
            # 2. the next query, by the schedule
            if pending is None:
                if executor.rows_left() == 0:
                    pending = ask(obs, tick, now, 0, 0)
                elif pace.schedule == "sync" and executed >= horizon:
                    pending = ask(obs, tick, now, 0, 0)
                elif pace.schedule == "prefetch" and executed == horizon - pace.prefetch_lead_steps:
                    pending = ask(obs, tick, now, pace.prefetch_lead_steps, pace.prefetch_lead_steps)
                elif rtc is not None:
                    asked = rtc.plan(chunk, executor.next_row)
                    if asked is not None:
                        rtc.sent(asked, len(chunk))
                        pending = ask(obs, tick, now, executor.rows_left(), asked.prefix_len, asked)
                observed = pending is not None and pending[2] == tick
            if not observed:
                policy.observe(obs)
            # 3. execute one action, or hold (sync / prefetch: the loop executes `horizon` actions of a chunk)
            if pace.schedule != "rtc" and executed >= horizon:
                executor.hold()
                acted = False
            else:
                acted = executor.next_action(now) is not None
                executed += acted
            if stats.start_ms is not None:
                stats.ticks += 1
                stats.stalls += not acted
    except Exception as exc:  # noqa: BLE001 - recorded: a robot with an error did not keep pace
        stats.errors.append(f"robot {index}: {type(exc).__name__}: {exc}")
    finally:
        counts = executor.stats()
        stats.ages_ms = [a * 1e3 for a in executor.ages_s]
        stats.dropped = counts["dropped_stale"] + counts["dropped_invalidated"] + counts["duplicates"]
        stats.skipped = counts["skipped_actions"]
        if pending is not None:
            try:
                pending[0].result(timeout=CALL_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - the run is over; its reply is not counted
                pass
        pool.shutdown(wait=True)


def run_fleet(policies: list[DroidPolicy], pace: Pace, seconds: float) -> list[RobotStats]:
    """Every robot for `seconds`, their phases spread over one open-loop horizon, as a fleet's are."""
    n = len(policies)
    ticks = max(2, round(seconds * pace.control_hz))
    stats = [RobotStats(i) for i in range(n)]
    t0 = time.monotonic() + 0.05
    spread = pace.open_loop_horizon * pace.period_s
    threads = [threading.Thread(target=run_robot, args=(i, p, pace, ticks, t0 + spread * i / n, stats[i]),
                                daemon=True) for i, p in enumerate(policies)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + spread + 2 * CALL_TIMEOUT_S)
        if t.is_alive():
            stats[threads.index(t)].errors.append("robot thread did not end")
    return stats


# ---------------------------------------------------------------------------------------------------------------------
# 2. What the robots query in this process: the server's interface, and its link
# ---------------------------------------------------------------------------------------------------------------------


def _session_dict(report) -> dict | None:
    return report.to_dict() if hasattr(report, "to_dict") else report


class ServerLink:
    """A `dreamzero_droid.policy.Link` to a server object of this process (`infer(observation, ids, prompts,
    **options)` -> (robot actions [B, H, D], session reports))."""

    name = "inprocess"

    def __init__(self, server):
        self.server = server

    def send(self, query: Query) -> LinkReply:
        options = {"expected_steps": None if query.first_call else [query.expected_step]}
        if query.rtc is not None:
            options.update(rtc_prefix_len=[query.rtc.prefix_len], rtc_exec_horizon=[query.rtc.exec_horizon])
            if query.rtc.action_prefix is not None:
                options["action_prefix"] = [query.rtc.action_prefix]
        actions, sessions = self.server.infer(droid.raw_observation(query.frames), [query.session_id],
                                              [query.prompt], **options, **fleet_fields(query))  # fmt: skip
        return LinkReply(actions[0], _session_dict(sessions[0]))

    def reset(self, session_id: str) -> None:
        self.server.reset([session_id])

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class ModelSpec:
    """What the fleet serves: `model` (a checkpoint or embedded:<name>; None: the random tiny model) or `preset` (a
    preset with random weights, `benchmarks/model_latency.py`'s: the GPU check's 14B and 5B), on `device` / `dtype`
    (None: the checkpoint's or the machine's), with `steps` scheduler steps (None: the model's plan)."""

    model: str | None = None
    preset: str | None = None
    device: str | None = None
    dtype: str | None = None
    steps: int | None = None


def load_policy(spec: ModelSpec | str | None = None, threads: int | None = None):
    """The embedded policy (`dreamzero.policy.EmbeddedPolicy`) of `spec` (a string or None: `ModelSpec(model=)`)."""
    import torch

    from dreamzero.embedded_default import resolve_model_path
    from dreamzero.policy import EmbeddedPolicy

    spec = spec if isinstance(spec, ModelSpec) else ModelSpec(model=spec)
    if threads:
        torch.set_num_threads(threads)
    overrides = {"num_inference_steps": spec.steps, "dit_step_mask": None} if spec.steps else {}
    if spec.preset is None:
        return EmbeddedPolicy.load(model_path=resolve_model_path(spec.model), max_sessions=4096, device=spec.device,
                                   **overrides)  # fmt: skip
    from types import SimpleNamespace

    from model_latency import build_model

    from dreamzero.embodiments import get_embodiment
    from dreamzero.pipeline import DreamZeroPipeline
    from dreamzero.sessions import SessionStore

    model = build_model(SimpleNamespace(model_path=None, preset=spec.preset, device=spec.device, dtype=spec.dtype))
    pipe = DreamZeroPipeline(model, model.config.pipeline.with_overrides(overrides or None), SessionStore(4096))
    return EmbeddedPolicy(pipe, get_embodiment(model.config.embodiment_tag))


def embodiment_observation(policy, raw: dict) -> dict:
    """A DROID robot's raw observation in the served embodiment's form: the same frames under its cameras (in order)
    and its state's width (zero-padded or cut), so a fleet of DROID robots can load any model (the GPU check's 5B is
    LIBERO's). The model's cost does not depend on what the frames show."""
    emb = policy.embodiment
    if emb.tag == "oxe_droid":
        return raw
    cams = [v for k, v in raw.items() if k.startswith("video.")]
    obs = {key: cams[i % len(cams)] for i, key in enumerate(emb.video_keys)}
    droid_state = np.concatenate([v for k, v in raw.items() if k.startswith("state.")], axis=-1)
    for key, width in emb.state_widths.items():
        obs[key] = fit_width(droid_state, width, np.float32)
    return obs


def fit_width(values, width: int, dtype=None) -> np.ndarray:
    """`values` [..., D] as [..., width]: the first columns kept, zero-padded or cut."""
    values = np.asarray(values)
    out = np.zeros((*values.shape[:-1], width), dtype or values.dtype)
    take = min(width, values.shape[-1])
    out[..., :take] = values[..., :take]
    return out


def embodiment_options(policy, options: dict) -> dict:
    """The robot's real-time chunking prefix (DROID's 8 columns) cut or padded to the served embodiment's actions."""
    prefixes = options.get("action_prefix")
    width = policy.embodiment.action_dim
    if not prefixes or policy.embodiment.tag == "oxe_droid":
        return options
    fitted = [None if p is None else fit_width(p, width, np.float32) for p in prefixes]
    return {**options, "action_prefix": fitted}


def droid_actions(actions: np.ndarray) -> np.ndarray:
    """An embodiment's actions [B, H, D] as DROID's [B, H, 8] (zero-padded or cut), what the robot runtime executes."""
    return actions if actions.shape[-1] == droid.ACTION_DIM else fit_width(actions, droid.ACTION_DIM)


def warm_up(policy) -> None:
    """A session start and a continuing chunk, so no fleet pays the lazy initialisation."""
    rng = np.random.default_rng(0)
    frame = droid.make_frame(observation(0, rng))
    for frames, step in (([frame], None), ([frame] * 4, 1)):
        policy.infer(embodiment_observation(policy, droid.raw_observation(frames)), ["warm-up"], [PROMPT],
                     expected_steps=[step])  # fmt: skip
    policy.reset(["warm-up"])


@functools.cache
def torch_threads() -> int:
    """This process's torch threads before any call set them: the most a CPU model call uses."""
    import torch

    return torch.get_num_threads()


class BatchedServer:
    """One embedded pipeline behind the Policy's own batcher (`deployments.batcher.ContinuousBatcher`, a batch forms
    when the model is free), built with the Policy's rules (`deployments.admission`: a request's class, its earliest
    deadline, the replica's measured cost per call) and its merge (`deployments.batch_merge`), one model thread with
    the replica's torch threads per call on CPU (`deployments.engine.CpuThreads`), the door's transforms in the
    caller's thread. `classes`: `batching.traffic_classes` (False: first come, first
    served). The Policy's admission is not run: a fleet is measured past the pace it would refuse."""

    def __init__(self, policy, max_rows: int = 32, max_requests: int = 16, wait_s: float = 0.005,
                 classes: bool = True, floor_calls: int = 4, rows_per_thread: int = 4):  # fmt: skip
        from robots_per_gpu import generate_groups

        from deployments.admission import CallCost, earliest_deadline, traffic_class
        from deployments.batcher import ContinuousBatcher
        from deployments.engine import CpuThreads

        self.policy, self.classes = policy, classes
        self.rows_per_call: list[int] = []
        self.cost = CallCost()
        self._model = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleet-model")
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fleet-batcher", daemon=True)
        self._thread.start()
        pipe = policy.pipeline

        # on CPU, the replica's torch threads per call (`policy.rows_per_thread`: one per 4 rows, 1 for small calls)
        threads = CpuThreads(torch_threads(), rows_per_thread) if pipe.device.type == "cpu" else None

        def call(batches):
            if threads is not None:
                threads.use_for(sum(len(b) for b in batches))
            return generate_groups(pipe, batches, self.rows_per_call, self.cost.add)

        async def run(batches):
            return await asyncio.get_running_loop().run_in_executor(self._model, call, batches)

        def starts(batch) -> bool:
            return any(sid not in pipe.store for sid in batch.session_ids)

        self.batcher = ContinuousBatcher(run, max_requests, wait_s, wants_company=starts, rows_of=len,
                                         max_batch_rows=max_rows, class_of=traffic_class,
                                         deadline_of=earliest_deadline, sessions_of=lambda b: b.session_ids,
                                         call_ms=self.cost.predict, floor_calls=floor_calls,
                                         clock=time.time)  # fmt: skip
        self.batcher.classes = classes

    def infer(self, observation: dict, session_ids: list[str], prompts: list[str], expected_steps=None,
              traffic_class: str | None = None, deadline_ms: float | None = None, observed_at=None, **rtc):  # fmt: skip
        received = time.time()
        emb = self.policy.embodiment
        batch, context = emb.preprocess(embodiment_observation(self.policy, observation), prompts)
        rtc = embodiment_options(self.policy, rtc)
        n = len(batch)
        model_batch = batch.to_model_batch(list(session_ids), reset_mask=[False] * n, expected_steps=expected_steps,
                                           **rtc)  # fmt: skip
        if traffic_class is not None:  # as a door sets them (the batcher reads them only with classes on)
            model_batch.traffic_class = [traffic_class] * n
        if deadline_ms is not None:
            model_batch.deadline_at = [received + deadline_ms / 1e3] * n
        from deployments.batch_slices import join_results, slices

        parts = [model_batch]
        if self.batcher.classes and traffic_class == "batch":  # as the Policy cuts a farm's request
            parts = slices(model_batch, self.batcher.slice_rows())

        async def submit_all():
            return await asyncio.gather(*(self.batcher.submit(part) for part in parts))

        future = asyncio.run_coroutine_threadsafe(submit_all(), self.loop)
        result = join_results(future.result(timeout=CALL_TIMEOUT_S))
        return droid_actions(emb.postprocess(result.actions, context)), list(result.sessions)

    def reset(self, session_ids: list[str]) -> None:
        self.policy.pipeline.drop_sessions(list(session_ids))

    def close(self) -> None:
        def stop() -> None:
            for task in asyncio.all_tasks(self.loop):
                task.cancel()  # the batcher's worker
            self.loop.call_soon(self.loop.stop)

        self.loop.call_soon_threadsafe(stop)
        self._thread.join(timeout=10)
        self._model.shutdown(wait=True)
        self.loop.close()


def _worker(conn, model: ModelSpec | str | None, threads: int) -> None:
    """A reference server: its own pipeline, one call at a time, over a pipe."""
    try:
        policy = load_policy(model, threads)
        warm_up(policy)
        conn.send(("ready", None))
    except Exception as exc:  # noqa: BLE001 - handed to the parent, which reports it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        kind, args, kwargs = msg
        try:
            if kind == "reset":
                policy.reset(*args)
                conn.send(("ok", None))
            else:
                observation, *rest = args
                out = policy.infer(embodiment_observation(policy, observation), *rest,
                                   **embodiment_options(policy, kwargs))  # fmt: skip
                conn.send(("ok", (droid_actions(out.actions), [_session_dict(s) for s in out.sessions])))
        except Exception as exc:  # noqa: BLE001 - the caller's error
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class ProcessServer:
    """One worker process with its own pipeline: one session per server process, no cross-session batching."""

    def __init__(self, model: ModelSpec | str | None, threads: int, start_timeout_s: float = 600.0):
        ctx = mp.get_context("spawn")  # torch's threads and fork do not mix
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker, args=(child, model, threads), daemon=True)
        self.process.start()
        self._timeout = start_timeout_s
        self._lock = threading.Lock()

    def wait_ready(self) -> None:
        if not self._conn.poll(self._timeout):
            raise TimeoutError(f"reference server {self.process.pid} not ready within {self._timeout:.0f} s")
        try:
            kind, detail = self._conn.recv()
        except EOFError:
            kind, detail = "error", f"process {self.process.pid} ended (exit code {self.process.exitcode})"
        if kind != "ready":
            raise RuntimeError(f"reference server failed to start: {detail}")

    def _call(self, kind: str, *args, **kwargs):
        with self._lock:
            self._conn.send((kind, args, kwargs))
            if not self._conn.poll(CALL_TIMEOUT_S):
                raise TimeoutError(f"reference server {self.process.pid}: no reply within {CALL_TIMEOUT_S:.0f} s")
            kind, out = self._conn.recv()
        if kind != "ok":
            raise RuntimeError(out)
        return out

    def infer(self, observation, session_ids, prompts, traffic_class=None, deadline_ms=None, observed_at=None,
              **options):  # fmt: skip
        actions, sessions = self._call("infer", observation, session_ids, prompts, **options)
        return actions, sessions

    def reset(self, session_ids: list[str]) -> None:
        self._call("reset", list(session_ids))

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=10)


def start_reference(
    n: int, model: ModelSpec | str | None, threads: int | None = None, cores: int | None = None
) -> list:
    """`n` reference servers sharing this machine's cores: `threads` torch threads each (None: `cores // n`, at
    least 1)."""
    threads = threads or max(1, (cores or os.cpu_count() or 1) // n)
    servers = [ProcessServer(model, threads) for _ in range(n)]
    try:
        for s in servers:
            s.wait_ready()
    except BaseException:
        for s in servers:
            s.close()
        raise
    return servers


# ---------------------------------------------------------------------------------------------------------------------
# 3. A running server's ZeroMQ door (HTTP and OpenPI: dreamzero_droid.links)
# ---------------------------------------------------------------------------------------------------------------------


class ZmqLink:
    """`get_action` on the ZeroMQ door (docs/zmq.md) for one DROID row, with the query's fleet fields."""

    name = "zmq"

    def __init__(self, url: str, timeout_s: float = CALL_TIMEOUT_S):
        from dreamzero_client.zmq_client import ZmqPolicyClient

        host, _, port = url.removeprefix("tcp://").rpartition(":")
        self.client = ZmqPolicyClient(host or "127.0.0.1", int(port), timeout_s=timeout_s)

    def send(self, query: Query) -> LinkReply:
        obs = droid.raw_observation(query.frames)
        obs["annotation.language.language_instruction"] = [query.prompt]
        options = {"session_ids": [query.session_id]}
        if not query.first_call and query.expected_step is not None:
            options["expected_steps"] = [query.expected_step]
        action, info = self.client.get_action(obs, options, **fleet_fields(query))
        actions = np.concatenate([np.asarray(v)[0] for v in action.values()], axis=-1)
        sessions = info.get("sessions") if isinstance(info, dict) else None
        return LinkReply(actions, sessions[0] if sessions else None)

    def reset(self, session_id: str) -> None:
        self.client.reset({"session_ids": [session_id]})

    def close(self) -> None:
        self.client.close()
