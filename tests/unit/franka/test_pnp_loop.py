"""The franka_pnp episode loop on the simulated Cartesian arm: sessions, workspace, holds, operator, the CLI path."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from dreamzero_client.errors import ConfigError
from dreamzero_droid.policy import LinkReply
from dreamzero_franka.cli import main
from dreamzero_franka.common.loop import LoopConfig
from dreamzero_franka.common.operator import Command
from dreamzero_franka.common.sim_backends import SimGripper, SyntheticCamera
from dreamzero_franka.connect import DroidPolicy, connect_policy
from dreamzero_franka.pnp.cartesian import SimCartesianRobot
from dreamzero_franka.pnp.loop import PNP_CAMERAS, PnpEpisodeRunner, pnp_loop_config
from dreamzero_franka.pnp.observation import STATE_DIM, WIRE_IMAGE, WIRE_STATE, WIRE_WRIST
from dreamzero_franka.pnp.policy import PnpHttpLink, PnpOpenPILink, PnpPolicy, PnpQuery, frame_offsets
from dreamzero_franka.pnp.safety import PnpSafetyFilter
from tests.support.franka import FakeOpenPIServer, ScriptedOperator, pnp_chunk
from tests.support.franka_pnp import TARGET, task_poses


class PnpLink:
    """In-process link: `reply(query, index)` -> actions; records queries and resets; `fail_from` kills it."""

    name = "scripted-pnp"

    def __init__(self, reply=None, fail_from: int | None = None):
        self.reply = reply or (lambda query, i: pnp_chunk(i))
        self.fail_from = fail_from
        self.queries: list[PnpQuery] = []
        self.resets: list[str] = []

    def send(self, query: PnpQuery) -> LinkReply:
        index = len(self.queries)
        self.queries.append(query)
        if self.fail_from is not None and index >= self.fail_from:
            raise ConnectionError("connection refused (server killed)")
        return LinkReply(self.reply(query, index))

    def reset(self, session_id: str) -> None:
        self.resets.append(session_id)

    def close(self) -> None:
        pass


def _runner(link, max_steps=24, operator=None, **loop):
    poses = task_poses()
    robot = SimCartesianRobot(initial=poses.home_joints)
    gripper = SimGripper()
    cameras = {name: SyntheticCamera(name, height=240, width=320) for name in PNP_CAMERAS}
    for device in (robot, gripper, *cameras.values()):
        device.connect()
    policy = PnpPolicy(link, "put the block in the bin")
    runner = PnpEpisodeRunner(
        robot, gripper, cameras, policy, PnpSafetyFilter(poses),
        pnp_loop_config(max_steps=max_steps, **loop), operator or ScriptedOperator(),
    )  # fmt: skip
    return runner, robot, gripper, poses


def _inside(poses, xyz, tol=1e-6) -> bool:
    return bool(np.all(xyz >= poses.workspace_min - tol) and np.all(xyz <= poses.workspace_max + tol))


def test_episodes_reset_the_session_and_follow_the_chunks_inside_the_box():
    link = PnpLink()
    runner, robot, gripper, poses = _runner(link)
    results = runner.run(2)
    assert [r.status for r in results] == ["completed", "completed"], [r.reason for r in results]
    first, second = (r.session_id for r in results)
    assert first != second and first.startswith("franka-pnp-")
    assert link.resets == [first]  # episode 2 released episode 1's session
    assert [q.session_id for q in link.queries] == [first, first, second, second]  # 24 steps = 2 x 12 rows
    assert [q.first_call for q in link.queries] == [True, False, True, False]
    # each query is one step: two 128x128 views and the 19-number state, relative to the reset pose (zero at start)
    # a session's first query: one step (two 128x128 views, the 19-number state relative to the reset pose, zero at
    # the start); later ones: 4-frame blocks of the steps 9, 6, 3 and 0 back (12 executed rows), the newest state
    q0, q1 = link.queries[0].observation, link.queries[1].observation
    assert q0[WIRE_IMAGE].shape == q0[WIRE_WRIST].shape == (128, 128, 3) and q0[WIRE_STATE].shape == (STATE_DIM,)
    np.testing.assert_allclose(q0[WIRE_STATE][4:10], 0.0, atol=2e-3)
    assert q1[WIRE_IMAGE].shape == q1[WIRE_WRIST].shape == (4, 128, 128, 3) and q1[WIRE_STATE].shape == (STATE_DIM,)
    assert runner.policy.frame_offsets == (-9, -6, -3, 0)
    assert len({frame.tobytes() for frame in q1[WIRE_IMAGE]}) == 4  # four different steps (the pattern moves)
    # the arm moved, every pose command stayed in the box, and the gripper followed the +-1 rule (odd calls close)
    xyz = np.array([p[:3, 3] for p in robot.pose_commands])
    assert len(xyz) > 40 and np.ptp(xyz[:, 0]) > 0.02
    assert all(_inside(poses, p) for p in xyz)
    assert True in gripper.commands  # closed on the second chunk
    assert sum(r.holds for r in results) >= 2  # each episode ends with a hold


def test_random_chunks_never_leave_the_workspace_or_the_limits():
    rng = np.random.default_rng(7)
    link = PnpLink(reply=lambda q, i: rng.uniform(-1.0, 1.0, size=(24, 7)))
    runner, robot, _, poses = _runner(link, max_steps=60)
    result = runner.run_episode(0)
    assert result.status == "completed", result.reason
    cfg = runner.safety.config
    ref = None
    for pose in robot.pose_commands:
        # after a hold the filter starts from the measured pose, which the simulated controller reaches only within
        # its IK tolerance: a reference that far outside the rotation window may stay there, never go further out
        assert _inside(poses, pose[:3, 3]) and poses.contains_euler(_euler(pose), tol=cfg.ik_tol_rad + 1e-6)
        if ref is not None:
            assert np.linalg.norm(pose[:3, 3] - ref[:3, 3]) <= cfg.step_m + 1e-6
        ref = pose
    measured = [c.measured for c in robot.commands if c.kind == "send"]
    assert np.all(np.array(measured) >= cfg.joint_lower) and np.all(np.array(measured) <= cfg.joint_upper)


def _euler(pose):
    from dreamzero_franka.pnp.rotations import matrix_to_euler_xyz

    return matrix_to_euler_xyz(pose[:3, :3])


@pytest.mark.parametrize(
    "bad",
    [
        np.full((24, 7), np.nan),  # non-finite: the policy's own check
        np.zeros((24, 8)),  # DROID-shaped: the policy's own check
        np.full((24, 7), 5.0),  # beyond the action range: the safety filter's chunk check
    ],
)
def test_bad_chunks_hold_the_arm_and_fail_after_three(bad):
    link = PnpLink(reply=lambda q, i: bad)
    runner, robot, _, _ = _runner(link)
    result = runner.run_episode(0)
    assert result.status == "failed" and "3 chunks in a row rejected" in result.reason
    assert result.rejected_chunks == 3 and result.server_calls == 3
    assert robot.pose_commands == [] and robot.holding  # nothing of a bad chunk reached the arm


def test_server_loss_holds_and_fails_with_the_reason():
    runner, robot, _, _ = _runner(PnpLink(fail_from=1))
    result = runner.run_episode(0)
    assert result.status == "failed" and result.reason.startswith("server_unreachable")
    assert result.steps == 12 and robot.holding


def test_prefetch_and_operator_label():
    link = PnpLink()
    operator = ScriptedOperator(at_poll={20: [Command.SUCCESS]})
    runner, _, _, _ = _runner(link, max_steps=40, operator=operator, prefetch=True, prefetch_lead_steps=2)
    result = runner.run_episode(0)
    assert result.status == "completed" and result.label == "success" and result.steps == 20
    assert result.server_calls == 2  # the second chunk was queried 2 ticks early, in the background


def test_loop_rtc_leaves_franka_pnp_on_whole_chunks():
    """The tick is `EpisodeRunner`'s, RTC included; `PnpPolicy` has none, so a `loop.rtc` (the CLI passes --rtc to
    either embodiment) is left unused: whole 12-row chunks, queried as without it."""
    link = PnpLink()
    runner, robot, _, _ = _runner(link, rtc=True)
    result = runner.run_episode(0)
    assert result.status == "completed", result.reason
    assert result.server_calls == 2 and [q.first_call for q in link.queries] == [True, False]  # 24 steps = 2 x 12
    assert len(robot.pose_commands) == 24


def test_loop_rate_must_match_the_action_space():
    link = PnpLink()
    poses = task_poses()
    with pytest.raises(ValueError, match="control_hz"):
        PnpEpisodeRunner(
            SimCartesianRobot(), SimGripper(), {n: SyntheticCamera(n) for n in PNP_CAMERAS},
            PnpPolicy(link, "x"), PnpSafetyFilter(poses), LoopConfig(control_hz=15.0),
        )  # fmt: skip


def test_http_link_sends_the_raw_form_with_continuity_and_no_rtc_fields():
    class Client:
        def __init__(self):
            self.calls = []

        def generate(self, observation, prompt, session_id, **parameters):
            self.calls.append((observation, prompt, session_id, parameters))
            return SimpleNamespace(actions=[np.zeros((12, 7))], sessions=[{"step": 2}], timings={"model_ms": 1.0})

    obs = {WIRE_IMAGE: np.zeros((128, 128, 3), np.uint8), WIRE_WRIST: np.ones((128, 128, 3), np.uint8),
           WIRE_STATE: np.arange(19, dtype=np.float32)}  # fmt: skip
    client = Client()
    link = PnpHttpLink(client=client)
    first = link.send(PnpQuery("s1", "pick", obs, first_call=True, expected_step=3, expected_incarnation="inc"))
    later = link.send(PnpQuery("s1", "pick", obs, first_call=False, expected_step=3, expected_incarnation="inc"))
    assert first.session == {"step": 2} and first.timings == {"model_ms": 1.0} and first.actions.shape == (12, 7)
    (raw, prompt, sid, params), (_, _, _, later_params) = client.calls
    assert sorted(raw) == ["state.state", "video.image", "video.wrist_image"] and (prompt, sid) == ("pick", "s1")
    assert params == {"form": "raw", "expected_steps": [None], "expected_incarnations": [None]}  # first: none echoed
    assert later_params == {"form": "raw", "expected_steps": [3], "expected_incarnations": ["inc"]}
    assert later.actions.shape == (12, 7)


def test_wire_messages_of_both_links():
    obs = {WIRE_IMAGE: np.zeros((128, 128, 3), np.uint8), WIRE_WRIST: np.ones((128, 128, 3), np.uint8),
           WIRE_STATE: np.arange(19, dtype=np.float32)}  # fmt: skip
    query = PnpQuery("s1", "pick", obs, first_call=False, expected_step=3, expected_incarnation="inc")
    msg = PnpOpenPILink().message(query)
    assert msg["session_id"] == "s1" and msg["expected_steps"] == [3] and msg["expected_incarnations"] == ["inc"]
    assert msg[WIRE_STATE].shape == (19,) and msg["prompt"] == "pick"
    raw = PnpHttpLink(client=object()).raw_observation(query)
    assert raw["video.image"].shape == (1, 1, 128, 128, 3) and raw["state.state"].shape == (1, 19)
    block = {**obs, WIRE_IMAGE: np.zeros((4, 128, 128, 3), np.uint8), WIRE_WRIST: np.zeros((4, 128, 128, 3), np.uint8)}
    raw = PnpHttpLink(client=object()).raw_observation(PnpQuery("s1", "pick", block, first_call=False))
    assert raw["video.wrist_image"].shape == (1, 4, 128, 128, 3)
    assert frame_offsets(12) == (-9, -6, -3, 0) and frame_offsets(8) == (-6, -4, -2, 0)
    with pytest.raises(Exception, match="observation/state"):
        PnpPolicy(PnpLink(), "x").request({**obs, WIRE_STATE: np.zeros(8)})


def test_the_server_handshake_chooses_the_embodiment():
    with FakeOpenPIServer(embodiment="franka_pnp") as server:
        policy = connect_policy(server.url, "pick", embodiment=None)
        assert isinstance(policy, PnpPolicy) and isinstance(policy.link, PnpOpenPILink)
        policy.close()
        with pytest.raises(ConfigError, match="server runs franka_pnp"):
            connect_policy(server.url, "pick", embodiment="oxe_droid")
    with FakeOpenPIServer() as server:
        policy = connect_policy(server.url, "pick", embodiment=None)
        assert type(policy) is DroidPolicy
        policy.close()
    with FakeOpenPIServer(embodiment="eef_delta") as server:
        with pytest.raises(ConfigError, match="does not say which embodiment.*--embodiment"):
            connect_policy(server.url, "pick", embodiment=None)
        policy = connect_policy(server.url, "pick", embodiment="franka_pnp")  # the flag decides
        assert isinstance(policy, PnpPolicy)
        policy.close()


def _pose_flags(poses) -> list[str]:
    return [
        "--target-ee-pose", *map(str, TARGET),
        "--home-joints", *map(str, poses.home_joints),
    ]  # fmt: skip


def test_cli_runs_franka_pnp_episodes_chosen_by_the_handshake(tmp_path, capsys):
    poses = task_poses()
    with FakeOpenPIServer(embodiment="franka_pnp") as server:
        code = main(
            ["--server", server.url, "--prompt", "put the block in the bin", "--robot", "sim", "--cameras",
             "synthetic", "--unattended", "--no-video", "--episodes", "2", "--max-steps", "24", "--log-dir",
             str(tmp_path), *_pose_flags(poses)]
        )  # fmt: skip
    assert code == 0, capsys.readouterr()
    summaries = json.loads((tmp_path / "session_summary.json").read_text())
    assert [s["status"] for s in summaries] == ["completed", "completed"]
    ids = [s["session_id"] for s in summaries]
    assert server.events == [("infer", ids[0])] * 2 + [("reset", ids[0])] + [("infer", ids[1])] * 2
    steps = [json.loads(line) for line in (tmp_path / "episode_0001" / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 24
    cfg = PnpSafetyFilter(poses).config
    for step in steps:  # every logged command: inside the box, joints inside the limits minus the margin
        assert _inside(poses, np.array(step["command_pose"]).reshape(4, 4)[:3, 3])
        joints = np.array(step["command_joints"])
        assert np.all(joints >= cfg.lower - 1e-9) and np.all(joints <= cfg.upper + 1e-9)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--embodiment", "franka_pnp"], "--target-ee-pose is required"),
        (["--embodiment", "franka_pnp", "--target-ee-pose", "450", "0", "200", "3.14", "0", "0"], "millimetres"),
        (["--target-ee-pose", "0.45", "0", "0.2", "180", "0", "0"], "degrees"),
        (["--embodiment", "franka_pnp", "--cameras", "realsense", "--wrist", "1"], "--exterior-0"),
    ],
)
def test_franka_pnp_flags_are_checked_before_anything_connects(argv, message, capsys):
    base = [
        "--server",
        "ws://127.0.0.1:1",
        "--prompt",
        "x",
        "--robot",
        "sim",
        "--cameras",
        "synthetic",
        "--log-dir",
        "",
    ]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err


def test_the_server_side_franka_pnp_embodiment_matches_the_client():
    """The shipped statistics have RLinf's widths, and the handshake names the embodiment the client looks for."""
    from dreamzero.embodiments import get_embodiment

    emb = get_embodiment("franka_pnp")
    assert emb.state_dim == STATE_DIM and emb.action_dim == 7
    handshake = emb.openpi_server_config()
    assert handshake["embodiment"] == "franka_pnp" and handshake["action_space"] == "eef_delta"
    assert "embodiment" not in get_embodiment("libero_sim").openpi_server_config()


def test_pnp_fills_the_base_loops_hooks_and_imports_nothing_private():
    """franka_pnp runs DROID's one control tick: it overrides only public hooks of `EpisodeRunner` (never the tick,
    `_control`, or another private method), and no module of the franka package imports a private name of another."""
    import ast
    from pathlib import Path

    from dreamzero_franka.common.loop import EpisodeRunner

    overridden = {n for n in vars(PnpEpisodeRunner) if n in vars(EpisodeRunner) and not n.startswith("__")}
    assert overridden >= {"go_home", "read_devices", "accept_chunk", "execute_row"}, overridden
    assert [n for n in overridden if n.startswith("_")] == []
    assert "_control" not in vars(PnpEpisodeRunner)

    franka = Path(__file__).resolve().parents[3] / "clients" / "dreamzero-franka" / "dreamzero_franka"
    private = [
        f"{path.relative_to(franka)}: from {node.module} import {alias.name}"
        for path in sorted(franka.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        and (node.level or (node.module or "").startswith(("dreamzero_client", "dreamzero_droid")))
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert private == []


def test_pnp_queries_carry_the_fleet_fields_and_the_links_send_them():
    """franka_pnp queries are a live robot's too: the observation's wall-clock time and the realtime class go with
    each (no deadline: its loop executes whole chunks and asks when one runs out); `fleet_fields=False` sends none."""
    import time

    link = PnpLink()
    runner, *_ = _runner(link, max_steps=12)
    before = time.time()
    runner.run(1)
    query = link.queries[0]
    assert query.traffic_class == "realtime" and query.deadline_ms is None
    assert before <= query.observed_at <= time.time()
    message = PnpOpenPILink().message(query)
    assert message["traffic_class"] == ["realtime"] and message["observed_at"] == [query.observed_at]
    quiet = PnpLink()
    runner, *_ = _runner(quiet, max_steps=12, fleet_fields=False)
    runner.run(1)
    assert quiet.queries[0].observed_at is None and quiet.queries[0].traffic_class is None
