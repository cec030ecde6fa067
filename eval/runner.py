"""The DROID evaluation loop: N episodes per scene against any `DroidEnv` through any `PolicyLink`.

Per episode: reset the env; every step hand the observation to the client runtime's `DroidPolicy` (which resizes
it to 180x320 and keeps the frame history); every `open_loop_horizon` steps (or when the chunk runs out) query it;
execute the chunk's rows open loop with DROID's gripper rule; stop at termination, truncation or the step limit;
judge success on the final object positions; reset the policy (the server forgets the session, the next episode gets
a new id). A policy failure ends the episode, is recorded with its reason, and the run goes on.

With `rtc` (real-time chunking, docs/rtc.md "Clients") the next query leaves while the current chunk still runs, on
the timeline of `dreamzero_droid.rtc.RtcSchedule`. Sim steps are synchronous, so the delay is emulated: the reply
is there at once, and the env executes d more actions of the old chunk (`rtc_delay_steps`, else the measured round
trip in control steps) before it switches to row d of the new one. Every episode records its chunk switches and the
jump at each one (`switch_jump`), with or without RTC, so the two runs can be compared.

Which row runs at a step is `dreamzero_droid.executor.ChunkExecutor`'s, on the sim's clock (steps / control rate,
which stands still during a query): a chunk starts at the actions executed since its observation (0 for a plain
query, d for RTC), and a chunk that is stale (a reply that says the server restarted the session, or older than
`max_observation_age_s` when set) is never executed: the policy is asked again from the same step's observation,
once; a second stale chunk fails the episode ("stale_chunk"). Each episode records the executor's counters
(`execution`) and its refused chunks (`stale_chunks`).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dreamzero.errors import ConfigError
from dreamzero_droid import droid
from dreamzero_droid.executor import ChunkExecutor
from dreamzero_droid.policy import Chunk, DroidPolicy, PolicyCallError
from dreamzero_droid.rtc import RtcSchedule, switch_jump
from eval.env_contract import DroidEnv, check_droid_observation
from eval.recording import EpisodeRecorder, dataset_frame, open_dataset, to_jsonable
from eval.summary import config_record, summarize, summary_markdown


@dataclass
class EvalConfig:
    out_dir: Path
    scenes: tuple[int, ...] = (1,)
    episodes_per_scene: int = 1
    open_loop_horizon: int = 8
    max_steps: int | None = None  # None: the env's own limit (450 = 30 s on DROID)
    seed: int = 0
    record_video: bool = True
    image_size: tuple[int, int] = droid.IMAGE_HW  # of the recorded video frames
    extra: dict = field(default_factory=dict)  # free-form facts recorded in summary.json (simulator, link, ...)
    rtc: bool = False  # real-time chunking: query ahead, emulate the delay, switch at row d
    rtc_delay_steps: int | None = None  # the emulated delay d; None: the measured round trip in control steps
    predicted_video: bool = False  # ask for each chunk's predicted frames; imagined vs real per episode (eval.imagined)
    record_dataset: Path | None = None  # every episode also into this LeRobot v3.0 dataset (eval.recording)
    # sim seconds; None: no wall bound (the sim waits for every query: a chunk's age is its executed rows)
    max_observation_age_s: float | None = None

    def validate(self) -> None:
        if not self.scenes:
            raise ConfigError("scenes: expected at least one scene")
        if self.episodes_per_scene < 1:
            raise ConfigError(f"episodes_per_scene: expected >= 1, got {self.episodes_per_scene}")
        if self.open_loop_horizon < 1:
            raise ConfigError(f"open_loop_horizon: expected >= 1, got {self.open_loop_horizon}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps: expected >= 1 or None, got {self.max_steps}")
        if self.max_observation_age_s is not None and not self.max_observation_age_s > 0:
            raise ConfigError(f"max_observation_age_s: expected > 0 or None, got {self.max_observation_age_s}")
        if self.rtc_delay_steps is not None and (not self.rtc or self.rtc_delay_steps < 1):
            raise ConfigError(
                f"rtc_delay_steps: expected >= 1 with rtc on, got {self.rtc_delay_steps} (rtc={self.rtc})"
            )

    def rtc_schedule(self, control_hz: float) -> RtcSchedule | None:
        if not self.rtc:
            return None
        return RtcSchedule(self.open_loop_horizon, control_hz, delay_steps=self.rtc_delay_steps)


def _switch_stats(switches: list[dict], deltas: list[float]) -> dict:
    jumps = [sw["jump"] for sw in switches if sw["jump"] is not None]
    return {
        "count": len(jumps),
        "mean": float(np.mean(jumps)) if jumps else None,
        "max": float(np.max(jumps)) if jumps else None,
        "step_delta_mean": float(np.mean(deltas)) if deltas else None,  # the motion of one step inside a chunk
    }


def run_episode(
    env: DroidEnv,
    policy: DroidPolicy,
    config: EvalConfig,
    episode: int,
    progress=None,
    schedule: RtcSchedule | None = None,
    dataset=None,
) -> dict:
    """One episode; returns its record (also written to `<out_dir>/episodes/<name>.json`).

    `schedule`: the RTC timeline (kept across episodes for its delay estimate); made from `config` when None.
    `dataset`: a `dreamzero_droid.lerobot.DatasetRecorder` that gets the episode's steps (frames the policy saw,
    state, the action executed) and its outcome."""
    scene = env.scene_id
    name = f"scene{scene}_ep{episode:03d}"
    session_id = policy.session_id
    seed = config.seed + 1000 * scene + episode
    max_steps = min(config.max_steps or env.max_episode_steps, env.max_episode_steps)
    recorder = EpisodeRecorder(
        config.out_dir, name, fps=env.control_hz, record_video=config.record_video, frame_size=config.image_size
    )
    started = time.perf_counter()
    latencies_ms: list[float] = []
    failure = None
    reset_error = None
    sessions: list[dict] = []
    restarts: list[dict] = []
    switches: list[dict] = []  # every change of chunk after the first: step, row, jump (+ d, s, rtc source with RTC)
    deltas: list[float] = []  # joint-target change between consecutive steps of one chunk
    rtc_requests: list[dict] = []
    stale: list[dict] = []  # refused chunks: step, reason
    executor = ChunkExecutor(env.control_hz, config.max_observation_age_s)
    steps = 0
    terminated = truncated = False
    schedule = schedule if schedule is not None else config.rtc_schedule(env.control_hz)
    if schedule is not None:
        schedule.reset()
    imagined = imagined_track() if config.predicted_video else None
    last_obs = None  # with `imagined`: the newest observation seen

    def jump(first_new: np.ndarray) -> float | None:
        return None if last_action is None else switch_jump(last_action, first_new)

    def now() -> float:  # the sim's clock: it stands still while a query runs
        return steps / env.control_hz

    def fresh(query_obs: dict) -> tuple[Chunk, int]:
        """A plain query of this step, and the row its chunk starts at; a stale reply is asked again once."""
        for attempt in range(2):
            mark = executor.mark(now())
            reply = policy.infer(query_obs) if attempt == 0 else policy.send(policy.request(query_obs, record=False))
            took(reply)
            if reply.restarted:
                executor.invalidate()  # the server lost the session: no chunk asked before this reply is executed
            offer = executor.offer(reply.actions, mark, now())
            if offer.accepted:
                return reply, offer.row
            stale.append({"step": steps, "reason": offer.reason})
        raise PolicyCallError("stale_chunk", f"two stale chunks in a row at step {steps} (last: {offer.reason})")

    def took(reply: Chunk) -> None:
        latencies_ms.append(reply.latency_ms)
        if schedule is not None:
            schedule.add_latency(reply.latency_ms)
        if reply.session:
            sessions.append(reply.session)
        if reply.restarted:
            restarts.append({"step": steps, "reason": reply.restarted})
        if imagined is not None:
            imagined.predicted(steps, reply.video)

    try:
        obs, _ = env.reset(seed=seed)
        check_droid_observation(obs)
        recorder.add_frame(obs)
        if dataset is not None:
            dataset.begin_episode(env.instruction)
        chunk: np.ndarray | None = None
        pending: Chunk | None = None  # RTC: the reply to the query in flight (here at once: the sim waits for it)
        pending_mark = None  # the executor's record of the observation `pending` answers
        row = 0
        last_action: np.ndarray | None = None  # the chunk row executed at the previous step (raw gripper)
        while steps < max_steps:
            queried, latency_ms, switched, observed = False, None, False, False
            if imagined is not None:
                imagined.observed(steps, obs)
            query_obs = {**obs, "prompt": env.instruction}
            try:
                if pending is not None:  # RTC: switch once d steps of the old chunk have run
                    new_row = schedule.switch_row(ready=True)
                    if new_row is not None:
                        asked = schedule.switched()
                        offer = executor.offer(pending.actions, pending_mark, now())
                        if offer.accepted:  # on the sim's clock the row is new_row: d executed actions since
                            switches.append({"step": steps, "row": offer.row, "jump": jump(pending.actions[offer.row]),
                                             "prefix_len": asked.prefix_len, "exec_horizon": asked.exec_horizon,
                                             "rtc": pending.rtc})  # fmt: skip
                            chunk, row, switched = pending.actions, offer.row, True
                        else:  # stale: ask again below, from this step's observation
                            stale.append({"step": steps, "reason": offer.reason})
                            chunk = None
                        pending = None
                if chunk is None or (schedule is None and row >= min(config.open_loop_horizon, len(chunk))):
                    reply, start = fresh(query_obs)
                    observed = queried = True
                    if chunk is not None:  # it replaces the chunk whose open-loop rows ran out
                        switched = True
                        switches.append({"step": steps, "row": start, "jump": jump(reply.actions[start])})
                    chunk, row, latency_ms = reply.actions, start, reply.latency_ms
                elif schedule is not None and pending is None:
                    asked = schedule.plan(chunk, row)
                    if asked is not None:
                        pending_mark = executor.mark(now())
                        pending = policy.send(policy.request(query_obs, rtc=asked))
                        if pending.restarted:
                            executor.invalidate()
                        schedule.sent(asked, len(chunk))
                        observed = queried = True
                        took(pending)
                        latency_ms = pending.latency_ms
                        rtc_requests.append({"step": steps, "prefix_len": asked.prefix_len,
                                             "exec_horizon": asked.exec_horizon,
                                             "sent": pending.rtc_request is not None, "rtc": pending.rtc})  # fmt: skip
            except PolicyCallError as exc:
                failure = {"reason": exc.reason, "message": exc.detail, "step": steps}
                break
            if not observed:
                policy.observe(obs)
            nxt = executor.next_action(now())
            if nxt is None:  # the chunk's observation aged past max_observation_age_s
                failure = {"reason": "stale_chunk", "message": "the chunk's observation is too old", "step": steps}
                break
            row, raw = nxt
            if not switched and last_action is not None:
                deltas.append(switch_jump(last_action, raw))
            last_action = raw
            action = raw.copy()
            action[7] = droid.binarize_gripper(raw[7])
            if dataset is not None:
                dataset.add_frame(*dataset_frame(obs, action, config.image_size))
            obs, reward, terminated, truncated, info = env.step(action)
            check_droid_observation(obs)
            last_obs = obs
            recorder.add_frame(obs)
            recorder.add_step(
                {
                    "step": steps,
                    "queried": queried,
                    "chunk_latency_ms": latency_ms,
                    "chunk_row": row,
                    "action": action,
                    "raw_gripper": float(raw[7]),
                    "joint_position": np.asarray(obs["joint_position"], dtype=np.float64),
                    "gripper_position": np.asarray(obs["gripper_position"], dtype=np.float64),
                    "reward": float(reward),
                    "terminated": bool(terminated),
                    "truncated": bool(truncated),
                    "object_poses": env.object_poses(),
                }
            )
            row += 1
            steps += 1
            if progress is not None:
                progress.update(1)
            if terminated or truncated:
                break
    finally:
        recorder.close()
        if imagined is not None and last_obs is not None:
            imagined.observed(steps, last_obs)  # the frame after the last action
        try:
            policy.reset()
        except PolicyCallError as exc:  # the episode's result stands; the failed reset is noted
            reset_error = str(exc)
    success = failure is None and env.is_success()
    if dataset is not None:  # kept either way, marked: a failed episode is data too (and a policy failure says why)
        outcome = "aborted" if failure is not None else ("success" if success else "failure")
        dataset.end_episode(success=bool(success), outcome=outcome, note=failure and failure["reason"])
    if progress is not None:
        progress.update(max_steps - steps)  # skipped steps of an episode that ended early
    record = {
        "name": name,
        "scene_id": scene,
        "episode": episode,
        "instruction": env.instruction,
        "session_id": session_id,
        "seed": seed,
        "success": bool(success),
        "num_steps": steps,
        "max_steps": max_steps,
        "terminated": bool(terminated),
        "truncated": bool(truncated),
        "server_calls": len(latencies_ms),
        "latencies_ms": latencies_ms,
        "failure": failure,
        "reset_error": reset_error,
        "final_object_poses": env.object_poses(),
        "outcome": env.outcome() if hasattr(env, "outcome") else None,  # scene 4: wrong object / target (eval.summary)
        "server_sessions": sessions,
        "session_restarts": restarts,  # the server lost the session's state mid-episode
        "chunk_switches": switches,
        "stale_chunks": stale,  # replies refused by the chunk executor (restarted session, too old)
        "execution": executor.stats(),  # stalls, skipped rows, observation ages (sim seconds)
        "switch_jump": _switch_stats(switches, deltas),  # rad over the 7 joint targets
        "rtc": None
        if schedule is None
        else {"requests": rtc_requests, "fallback": getattr(policy, "rtc_fallback", None)},
        "video": str(recorder.video_path.relative_to(config.out_dir)) if recorder.video_path else None,
        "imagined": None
        if imagined is None
        else imagined.finish(config.out_dir, name, fps=max(1, round(env.control_hz / 3))),
        "wall_s": time.perf_counter() - started,
    }
    record["record"] = str(recorder.write_json(record).relative_to(config.out_dir))
    return record


def imagined_track():
    from dreamzero.embodiments import get_embodiment
    from eval.imagined import ImaginedTrack

    return ImaginedTrack(get_embodiment("oxe_droid"))


def run_evaluation(
    env_factory: Callable[[int], DroidEnv], policy: DroidPolicy, config: EvalConfig, show_progress: bool = False
) -> dict:
    """Run every scene's episodes, write `summary.json` and `summary.md`; return the summary.

    `env_factory(scene_id)` builds the env of one scene; it is closed before the next scene's env is built.
    """
    from dreamzero.progress import progress_bar

    config.validate()
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    episodes: list[dict] = []
    schedule: RtcSchedule | None = None  # one for the run: its delay estimate outlives the episodes
    total = None if config.max_steps is None else len(config.scenes) * config.episodes_per_scene * config.max_steps
    dataset = None
    with progress_bar(total, "DROID eval", "step", enabled=show_progress, dynamic_ncols=True) as bar:
        try:
            for scene in config.scenes:
                env = env_factory(scene)
                try:
                    schedule = schedule or config.rtc_schedule(env.control_hz)
                    if config.record_dataset is not None and dataset is None:
                        dataset = open_dataset(config.record_dataset, env.control_hz)
                    for ep in range(config.episodes_per_scene):
                        bar.set_postfix_str(f"scene {scene} ep {ep}")
                        episodes.append(
                            run_episode(env, policy, config, ep, progress=bar, schedule=schedule, dataset=dataset)
                        )
                        bar.set_postfix_str(
                            f"scene {scene} ep {ep}: {'success' if episodes[-1]['success'] else 'fail'}"
                        )
                finally:
                    env.close()
        finally:
            if dataset is not None:  # an interrupted run still closes its open episode (marked aborted)
                dataset.close()
    summary = summarize(episodes)
    summary["config"] = to_jsonable(config_record(config))
    summary["policy_link"] = getattr(policy, "name", type(policy).__name__)
    summary["switch_jump"] = _switch_stats(  # the step delta: the mean of the episodes' means
        [sw for ep in episodes for sw in ep["chunk_switches"]],
        [ep["switch_jump"]["step_delta_mean"] for ep in episodes if ep["switch_jump"]["step_delta_mean"] is not None],
    )
    if config.rtc:
        summary["rtc"] = {
            "delay_steps": config.rtc_delay_steps or "measured",
            "fallback": getattr(policy, "rtc_fallback", None),
            "server_sources": dict(Counter(r["rtc"] for ep in episodes for r in ep["rtc"]["requests"])),
        }
    if dataset is not None:
        summary["recorded_dataset"] = {  # loop_seconds: what recording cost the control loop; the writes ran beside it
            "path": str(config.record_dataset), "episodes": dataset.episodes_written, "frames": dataset.frames_queued,
            "loop_seconds": round(dataset.loop_seconds, 4), "writer_seconds": round(dataset.write_seconds, 3),
        }  # fmt: skip
    summary["episode_records"] = [
        {k: ep[k] for k in ("name", "scene_id", "episode", "success", "num_steps", "video", "record", "failure")}
        for ep in episodes
    ]
    (out / "summary.json").write_text(json.dumps(to_jsonable(summary), indent=1))
    (out / "summary.md").write_text(summary_markdown(summary))
    return summary
