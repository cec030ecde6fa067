"""The franka_pnp episode loop: DROID's loop (sessions, operator keys, prefetch, watchdog, logs) with franka_pnp's
observation, action space and safety filter.

Per episode (`EpisodeRunner.run_episode` does the session reset, the operator label and the logs):
1. start: a fresh session id; optionally the joint home (`TaskPoses.home_joints`), the gripper opens, the slow
   Cartesian move to the reset pose through the safety filter, then the reset TCP pose becomes the reference of
   the state's relative pose (RLinf measures it after its reset move);
2. every tick (1 / control_hz, 10 Hz): operator keys, observe TCP + gripper + both cameras, build the 19-number
   observation; query when the executed part of the chunk is used up (or take the prefetched chunk); every chunk
   passes `PnpSafetyFilter.check_chunk` (a rejected one is not executed: the arm holds); each row goes through
   `PnpSafetyFilter.step` from the measured pose and the result is sent as a TCP pose (or the arm holds); the gripper
   follows RLinf's +-0.5 rule;
3. on server loss the arm holds and the episode fails with the reason; after any hold or pause the filter restarts
   from the measured pose.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from dreamzero_client.franka.contracts import Camera, Gripper
from dreamzero_client.franka.episode_log import EpisodeLog
from dreamzero_client.franka.loop import CommandGate, EpisodeResult, EpisodeRunner, LoopConfig, _EpisodeEnd
from dreamzero_client.franka.operator import Operator
from dreamzero_client.franka.pnp.cartesian import CartesianRobot
from dreamzero_client.franka.pnp.observation import WIRE_IMAGE, WIRE_WRIST, PnpObservationBuilder
from dreamzero_client.franka.pnp.policy import PnpPolicy, frame_offsets
from dreamzero_client.franka.pnp.reset_move import go_to_pose
from dreamzero_client.franka.pnp.safety import PnpChunkRejected, PnpSafetyFilter
from dreamzero_client.franka.safety import Watchdog
from dreamzero_client.policy import Chunk, ChunkRejected, PolicyCallError

logger = logging.getLogger(__name__)

#: camera names of a franka_pnp rig, in RLinf's order (first serial = main image = the fixed exterior view)
PNP_CAMERAS = ("exterior", "wrist")


def pnp_loop_config(**overrides) -> LoopConfig:
    """RLinf's franka_pnp timing: 10 Hz, whole 12-row chunks (its eval config), 240 steps per episode."""
    return LoopConfig(**{"control_hz": 10.0, "open_loop_horizon": 12, "max_steps": 240, **overrides})


class PnpEpisodeRunner(EpisodeRunner):
    """Runs franka_pnp episodes. `cameras` maps PNP_CAMERAS to cameras; `robot` is a `CartesianRobot`."""

    def __init__(
        self,
        robot: CartesianRobot,
        gripper: Gripper,
        cameras: dict[str, Camera],
        policy: PnpPolicy,
        safety: PnpSafetyFilter,
        config: LoopConfig | None = None,
        operator: Operator | None = None,
        builder: PnpObservationBuilder | None = None,
        joint_reset: bool = True,
    ):
        missing = [name for name in PNP_CAMERAS if name not in cameras]
        if missing:
            raise ValueError(f"cameras: franka_pnp needs {list(PNP_CAMERAS)}, missing {missing}")
        config = config or pnp_loop_config()
        if abs(config.control_hz - safety.space.control_hz) > 1e-9:
            raise ValueError(
                f"loop.control_hz ({config.control_hz}) must be the action space's rate ({safety.space.control_hz} Hz):"
                " each row is one step of that length"
            )
        super().__init__(robot, gripper, cameras, policy, None, config, operator)
        policy.set_frame_offsets(frame_offsets(config.open_loop_horizon))
        self.filt = safety
        self.builder = builder or PnpObservationBuilder()
        self.joint_reset = joint_reset

    def _go_home(self, gate: CommandGate) -> None:
        cfg, poses = self.config, self.filt.poses
        if self.joint_reset:
            self.robot.move_to(np.asarray(poses.home_joints, dtype=np.float64), timeout_s=cfg.home_timeout_s)
        self.gripper.open(timeout_s=cfg.gripper_timeout_s)
        go_to_pose(self.robot, self.filt, poses.reset_pose, timeout_s=cfg.home_timeout_s)
        self.builder.start_episode(self.robot.observe_tcp().pose)
        self.filt.reset()
        gate.was_held()

    def _control(self, result: EpisodeResult, gate: CommandGate, watchdog: Watchdog, log: EpisodeLog | None) -> None:
        cfg = self.config
        chunk: Chunk | None = None
        rows: np.ndarray | None = None
        row = executed = 0
        rejected_in_a_row = 0
        gripper_closed: bool | None = False  # the reset opened it
        next_tick = time.monotonic()
        for step in range(cfg.max_steps):
            tick_start = time.monotonic()
            self._handle_operator(gate, watchdog)
            tcp = self.robot.observe_tcp()
            closure = self.gripper.observe()
            frames = {name: self.cameras[name].observe() for name in PNP_CAMERAS}
            obs = self.builder.build(frames["exterior"], frames["wrist"], tcp, closure, self.policy.prompt)
            record: dict = {"step": step, "t": tick_start, "queried": False, "state": obs["observation/state"]}
            observed = False  # each tick's frame enters the policy's history exactly once

            # 1. a new chunk when the executed part of the current one is used up; it must pass the chunk check
            if rows is None or executed >= cfg.open_loop_horizon:
                try:
                    if self._pending is not None:
                        self.policy.observe(obs)
                        observed = True
                        chunk, row = self._take_prefetched(gate), cfg.prefetch_lead_steps
                    else:
                        observed = True  # infer records the frame before it can fail
                        chunk, row = self.policy.infer(obs), 0
                    result.server_calls += 1
                    result.latencies_ms.append(chunk.latency_ms)
                    record.update(queried=True, latency_ms=chunk.latency_ms, server=chunk.session)
                    if chunk.restarted:
                        record["session_restarted"] = chunk.restarted
                    rows = self.filt.check_chunk(chunk.actions, self.robot.observe_tcp(), cfg.min_chunk_rows)
                    executed, rejected_in_a_row = 0, 0
                except (ChunkRejected, PnpChunkRejected) as exc:
                    if isinstance(exc, ChunkRejected):  # the reply itself was unusable (counted above otherwise)
                        result.server_calls += 1
                    result.rejected_chunks += 1
                    rejected_in_a_row += 1
                    rows = None
                    gate.hold()
                    record.update(queried=True, rejected=f"{exc.field}: {exc}", held=True)
                    logger.warning("chunk rejected (%d in a row): %s", rejected_in_a_row, exc)
                    if rejected_in_a_row >= cfg.max_rejected_chunks:
                        raise _EpisodeEnd(
                            "failed", f"{rejected_in_a_row} chunks in a row rejected; last: {exc}"
                        ) from exc
                    self._finish_pnp_tick(log, record, obs, closure, result, step, next_tick)
                    next_tick = self._sleep_until(next_tick + cfg.period_s)
                    continue
                except PolicyCallError:
                    gate.hold()
                    raise

            # 2. prefetch from this tick's observation; the new chunk's row 0 is this tick's action
            if cfg.prefetch and self._pending is None and executed == cfg.open_loop_horizon - cfg.prefetch_lead_steps:
                self._pending = self._executor.submit(self.policy.send, self.policy.request(obs))
                observed = True
            if not observed:
                self.policy.observe(obs)

            # 3. the safety filter from the measured pose, then the command (a TCP pose, or hold)
            action = rows[row]
            if gate.was_held():
                self.filt.reset()
            cmd = self.filt.step(action, tcp)
            if cmd.hold:
                gate.hold()
                record["held"] = True
            else:
                gate.send_pose(cmd.pose, cmd.joints)
                watchdog.feed()
            if cmd.gripper_closed is not None and cmd.gripper_closed != gripper_closed:
                self.gripper.send(cmd.gripper_closed)
                gripper_closed = cmd.gripper_closed
            for name in cmd.clamped:
                result.clamps[name] = result.clamps.get(name, 0) + 1
            record.update(chunk_row=row, action=action, clamped=list(cmd.clamped), gripper_command=gripper_closed)
            if cmd.pose is not None:
                record.update(command_pose=cmd.pose, command_joints=cmd.joints)
            row += 1  # the policy's min_rows keeps row inside the chunk (open-loop horizon + prefetch lead)
            executed += 1

            record["tcp"] = tcp.pose
            self._finish_pnp_tick(log, record, obs, closure, result, step, next_tick)
            next_tick = self._sleep_until(next_tick + cfg.period_s)

    def _finish_pnp_tick(self, log, record, obs, closure, result, step, next_tick) -> None:
        result.steps = step + 1
        if log is None:
            return
        record.update(
            gripper_position=closure,
            tick_ms=(time.monotonic() - record["t"]) * 1e3,
            late_ms=max(0.0, (record["t"] - next_tick) * 1e3),
        )
        log.step(record, [obs[WIRE_IMAGE], obs[WIRE_WRIST]])  # the two views as the server receives them
