"""Hardware backends without hardware: lazy imports with install hints, RealSense BGR -> RGB, light imports, and
`connect_policy` (the DROID client logic itself is tested in tests/unit/droid_runtime/test_runtime.py)."""

from __future__ import annotations

import subprocess
import sys
import types

import numpy as np
import pytest

from dreamzero.errors import ConfigError, InvalidObservation, MissingDependency
from dreamzero_droid.links import HttpLink, OpenPILink
from dreamzero_franka.common.contracts import DeviceError
from dreamzero_franka.common.sim_backends import SimRobot
from dreamzero_franka.connect import DroidPolicy, connect_policy
from tests.support.franka import FakeOpenPIServer


def test_missing_hardware_libraries_say_what_to_install(monkeypatch):
    from dreamzero_franka import franky_backend
    from dreamzero_franka.common import realsense

    monkeypatch.setitem(sys.modules, "franky", None)  # makes `import franky` raise ImportError
    monkeypatch.setitem(sys.modules, "pyrealsense2", None)
    robot = franky_backend.FrankyRobot(franky_backend.FrankyConfig("172.16.0.2"))
    with pytest.raises(MissingDependency, match=r"franky-control.*dreamzero-client\[franka\]"):
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
    from dreamzero_franka.common.realsense import RealSenseCamera

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
    from dreamzero_franka.common.realsense import RealSenseCamera

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
        "import sys, dreamzero_franka.cli, dreamzero_franka.droid.loop;"
        "import dreamzero_franka.franky_backend, dreamzero_franka.common.realsense;"
        "heavy = [m for m in ('torch', 'ray', 'franky', 'pyrealsense2', 'transformers') if m in sys.modules];"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_connect_policy_builds_the_shared_runtime_policy():
    with FakeOpenPIServer() as server:
        policy = connect_policy(server.url, "wipe the table")  # connects at once: a bad URL fails before any motion
        assert isinstance(policy, DroidPolicy) and isinstance(policy.link, OpenPILink)
        assert policy.session_id.startswith("franka-") and policy.prompt == "wipe the table"
        assert policy.link.server_metadata["image_resolution"] == [180, 320]
        policy.close()
    assert isinstance(connect_policy("http://127.0.0.1:1", "x").link, HttpLink)
    with pytest.raises(ConfigError, match="ws://"):
        connect_policy("tcp://robot:1", "x")
    with pytest.raises(InvalidObservation, match="prompt"):
        connect_policy("http://127.0.0.1:1", "  ")
