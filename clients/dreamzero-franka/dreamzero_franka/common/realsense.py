"""Intel RealSense colour cameras through pyrealsense2 (imported lazily; `pip install 'dreamzero-client[franka]'`).

The colour stream is opened as bgr8 (what most RealSense setups use) and converted to RGB here, so the rest of the
client only ever sees RGB. Each camera is selected by serial number (`rs-enumerate-devices` lists them).
"""

from __future__ import annotations

import numpy as np

from dreamzero_client.errors import ConfigError, MissingDependency
from dreamzero_franka.common.contracts import Camera, DeviceError

INSTALL_HINT = "pip install 'dreamzero-client[franka]'  (or: pip install pyrealsense2)"


def import_pyrealsense2():
    try:
        import pyrealsense2 as rs
    except ImportError as exc:
        raise MissingDependency(f"RealSense cameras need pyrealsense2, which is not installed: {INSTALL_HINT}") from exc
    return rs


class RealSenseCamera(Camera):
    def __init__(
        self,
        name: str,
        serial: str,
        width: int = 640,
        height: int = 480,
        fps: int = 30,
        timeout_ms: int = 1000,
    ):
        super().__init__(name)
        if not serial:
            raise ConfigError(f"camera {name!r}: a RealSense serial number is required")
        if width <= 0 or height <= 0 or fps <= 0 or timeout_ms <= 0:
            raise ConfigError(f"camera {name!r}: width, height, fps and timeout_ms must be positive")
        self.serial, self.width, self.height, self.fps, self.timeout_ms = serial, width, height, fps, timeout_ms
        self._pipeline = None

    def _connect(self) -> None:
        rs = import_pyrealsense2()
        pipeline = rs.pipeline()
        config = rs.config()
        config.enable_device(self.serial)
        config.enable_stream(rs.stream.color, self.width, self.height, rs.format.bgr8, self.fps)
        try:
            pipeline.start(config)
        except RuntimeError as exc:
            raise DeviceError(f"camera {self.name!r} (serial {self.serial}) failed to start: {exc}") from exc
        self._pipeline = pipeline

    def _disconnect(self) -> None:
        try:
            self._pipeline.stop()
        finally:
            self._pipeline = None

    def observe(self) -> np.ndarray:
        self._require_connected()
        try:
            frames = self._pipeline.wait_for_frames(self.timeout_ms)
        except RuntimeError as exc:
            raise DeviceError(f"camera {self.name!r}: no frame within {self.timeout_ms} ms ({exc})") from exc
        color = frames.get_color_frame()
        if not color:
            raise DeviceError(f"camera {self.name!r}: the frame set holds no colour frame")
        bgr = np.asanyarray(color.get_data())
        if bgr.shape != (self.height, self.width, 3):
            raise DeviceError(f"camera {self.name!r}: expected {(self.height, self.width, 3)}, got {bgr.shape}")
        return np.ascontiguousarray(bgr[..., ::-1])  # BGR -> RGB
