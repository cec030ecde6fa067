"""Hardware backends without hardware: lazy imports with install hints, RealSense BGR -> RGB, light imports,
the policy adapter (observation building, HTTP key mapping), and the image resize."""

from __future__ import annotations

import subprocess
import sys
import types

import numpy as np
import pytest

from dreamzero.errors import ConfigError, InvalidObservation, MissingDependency
from dreamzero_client.franka.contracts import DeviceError
from dreamzero_client.franka.images import resize_with_pad
from dreamzero_client.franka.policy import DroidPolicy, HttpTransport, PolicyError, connect_policy
from dreamzero_client.franka.safety import ChunkRejected
from dreamzero_client.franka.sim_backends import SimRobot
from tests.franka_support import ScriptedTransport


def test_missing_hardware_libraries_say_what_to_install(monkeypatch):
    from dreamzero_client.franka import franky_backend, realsense

    monkeypatch.setitem(sys.modules, "franky", None)  # makes `import franky` raise ImportError
    monkeypatch.setitem(sys.modules, "pyrealsense2", None)
    robot = franky_backend.FrankyRobot(franky_backend.FrankyConfig("172.16.0.2"))
    with pytest.raises(MissingDependency, match=r"franky-control.*dreamzero-serve\[franka\]"):
        robot.connect()
    with pytest.raises(MissingDependency, match="pyrealsense2"):
        realsense.RealSenseCamera("wrist", "123").connect()


class _FakeFrame:
    def __init__(self, data):
        self._data = data

    def __bool__(self):
        return self._data is not None

    def get_data(self):
        return self._data


def _fake_pyrealsense2(frame: np.ndarray | None, started: list):
    rs = types.ModuleType("pyrealsense2")
    rs.stream = types.SimpleNamespace(color="color")
    rs.format = types.SimpleNamespace(bgr8="bgr8")

    class Config:
        def enable_device(self, serial):
            started.append(("device", serial))

        def enable_stream(self, *args):
            started.append(("stream", args))

    class Pipeline:
        def start(self, config):
            started.append("start")

        def stop(self):
            started.append("stop")

        def wait_for_frames(self, timeout_ms):
            if frame is None:
                raise RuntimeError("Frame didn't arrive within 1000")
            return types.SimpleNamespace(get_color_frame=lambda: _FakeFrame(frame))

    rs.config, rs.pipeline = Config, Pipeline
    return rs


def test_realsense_converts_bgr_to_rgb(monkeypatch):
    from dreamzero_client.franka.realsense import RealSenseCamera

    bgr = np.zeros((480, 640, 3), np.uint8)
    bgr[..., 0] = 200  # blue in BGR
    started: list = []
    monkeypatch.setitem(sys.modules, "pyrealsense2", _fake_pyrealsense2(bgr, started))
    with RealSenseCamera("exterior_0", "f123") as cam:
        rgb = cam.observe()
    assert rgb.shape == (480, 640, 3) and rgb.flags.c_contiguous
    assert rgb[0, 0].tolist() == [0, 0, 200]  # blue is now the last channel
    assert ("device", "f123") in started and started[-1] == "stop"
    assert ("stream", ("color", 640, 480, "bgr8", 30)) in started


def test_realsense_frame_timeout_is_a_device_error(monkeypatch):
    from dreamzero_client.franka.realsense import RealSenseCamera

    monkeypatch.setitem(sys.modules, "pyrealsense2", _fake_pyrealsense2(None, []))
    with RealSenseCamera("wrist", "x") as cam, pytest.raises(DeviceError, match="no frame within 1000 ms"):
        cam.observe()
    with pytest.raises(ConfigError, match="serial"):
        RealSenseCamera("wrist", "")


def test_devices_require_connect():
    with pytest.raises(DeviceError, match="not connected"):
        SimRobot().observe()


def test_client_package_stays_light():
    code = (
        "import sys, dreamzero_client.franka.cli, dreamzero_client.franka.loop;"
        "import dreamzero_client.franka.franky_backend, dreamzero_client.franka.realsense;"
        "heavy = [m for m in ('torch', 'ray', 'franky', 'pyrealsense2', 'transformers') if m in sys.modules];"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_resize_with_pad_follows_droid():
    img = np.full((720, 1280, 3), 77, np.uint8)
    assert resize_with_pad(img, 180, 320).shape == (180, 320, 3)
    assert np.all(resize_with_pad(img, 180, 320) == 77)
    same = np.zeros((180, 320, 3), np.uint8)
    assert resize_with_pad(same, 180, 320) is same
    padded = resize_with_pad(np.full((480, 640, 3), 255, np.uint8), 180, 320)
    # 480x640 -> 180x240 centred: black bars of 40 columns each side
    assert np.all(padded[:, :40] == 0) and np.all(padded[:, -40:] == 0) and np.all(padded[:, 40:280] == 255)
    with pytest.raises(InvalidObservation) as info:
        resize_with_pad(np.zeros((180, 320), np.uint8), 180, 320, field="images['wrist']")
    assert info.value.field == "images['wrist']"


def _obs_inputs():
    images = {role: np.zeros((180, 320, 3), np.uint8) for role in ("exterior_0", "exterior_1", "wrist")}
    return np.arange(7) * 0.1, 0.25, images


def test_policy_adapter_builds_droid_observations_and_validates_chunks():
    transport = ScriptedTransport(lambda obs, i: np.zeros((24, 8), np.float32) if i == 0 else np.zeros((24, 9)))
    policy = DroidPolicy(transport, "wipe the table")
    sid = policy.new_session()
    obs = policy.build_observation(*_obs_inputs())
    assert obs["session_id"] == sid and obs["prompt"] == "wipe the table"
    assert obs["observation/gripper_position"].tolist() == [0.25]
    assert obs["observation/cartesian_position"].shape == (6,)
    chunk = policy.infer(obs)
    assert chunk.actions.shape == (24, 8) and chunk.latency_ms >= 0 and chunk.session_id == sid
    with pytest.raises(ChunkRejected, match=r"shape \(H, 8\)"):
        policy.infer(obs)
    with pytest.raises(InvalidObservation, match="wrist"):
        policy.build_observation(np.zeros(7), 0.0, {"exterior_0": obs["observation/exterior_image_0_left"]})
    with pytest.raises(InvalidObservation, match="prompt"):
        DroidPolicy(transport, "  ")


def test_policy_adapter_turns_transport_failures_into_policy_errors():
    policy = DroidPolicy(ScriptedTransport(fail_from=0), "x")
    with pytest.raises(PolicyError, match="server reset failed: ConnectionError"):
        policy.new_session()
    with pytest.raises(PolicyError, match="server lost: ConnectionError"):
        policy.infer(policy.build_observation(*_obs_inputs()))


def test_http_transport_maps_openpi_keys_to_the_raw_form():
    calls = []

    class FakeActionClient:
        def generate(self, observation, prompts, session_ids, form):
            calls.append((observation, prompts, session_ids, form))
            return types.SimpleNamespace(
                actions=np.ones((1, 24, 8), np.float32), sessions=[{"session_id": session_ids, "step": 1}], timings={}
            )

        def reset_sessions(self, ids):
            calls.append(("reset", ids))

        def close(self):
            calls.append("close")

    transport = HttpTransport(FakeActionClient())
    policy = DroidPolicy(transport, "open the drawer")
    sid = policy.new_session()
    chunk = policy.infer(policy.build_observation(*_obs_inputs()))
    assert calls[0] == ("reset", sid)
    observation, prompt, session, form = calls[1]
    assert (prompt, session, form) == ("open the drawer", sid, "raw")
    assert observation["video.exterior_image_1_left"].shape == (1, 1, 180, 320, 3)
    assert observation["video.wrist_image_left"].shape == (1, 1, 180, 320, 3)
    assert observation["state.joint_position"].shape == (1, 7)
    assert observation["state.gripper_position"].shape == (1, 1)
    assert chunk.actions.shape == (24, 8) and chunk.extras["sessions"][0]["step"] == 1

    # later calls carry the last 4 query frames (the oldest repeated while fewer), like the WebSocket server builds
    joints, gripper, images = _obs_inputs()
    stacks = {1: [0, 0, 0, 1], 2: [0, 0, 1, 2], 3: [0, 1, 2, 3], 4: [1, 2, 3, 4]}  # pixel value = call index
    for value, expected in stacks.items():
        policy.infer(policy.build_observation(joints, gripper, {k: v + value for k, v in images.items()}))
        stack = calls[-1][0]["video.exterior_image_2_left"]
        assert stack.shape == (1, 4, 180, 320, 3)
        assert [int(stack[0, t, 0, 0, 0]) for t in range(4)] == expected
    # a new session starts from a single frame again
    policy.new_session()
    policy.infer(policy.build_observation(*_obs_inputs()))
    assert calls[-1][0]["video.wrist_image_left"].shape == (1, 1, 180, 320, 3)


def test_connect_policy_rejects_unknown_schemes():
    with pytest.raises(ConfigError, match="--server"):
        connect_policy("tcp://robot:1")
