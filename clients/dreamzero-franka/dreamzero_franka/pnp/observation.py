"""franka_pnp observation: two camera views and the 19-number state, as RLinf's real-world Franka env produces them.

Images: each camera frame (RGB, e.g. a 640x480 RealSense colour frame) is cropped to its centred square and resized
to 128x128 (bilinear); the first camera is `video.image` (the fixed exterior view), the second `video.wrist_image`.
The server then does DreamZero's 0.95 crop and 256x256 resize, as for the training data.

State (float32, 19): the env's state dict concatenated in sorted key order:
  [0]      gripper_position  finger opening, metres (sum of the two finger positions, 0 .. ~0.08)
  [1:4]    tcp_force         estimated external force (N)   [K_F_ext_hat_K[:3]]
  [4:10]   tcp_pose          x, y, z, rx, ry, rz of the TCP relative to the episode's reset pose (Euler xyz)
  [10:13]  tcp_torque        estimated external torque (Nm) [K_F_ext_hat_K[3:]]
  [13:19]  tcp_vel           TCP (v, w) mapped into the TCP frame by the inverse of `rlinf_adjoint`
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dreamzero_client.errors import ConfigError, InvalidObservation
from dreamzero_franka.pnp.cartesian import TcpState
from dreamzero_franka.pnp.rotations import matrix_to_euler_xyz, rlinf_adjoint

STATE_DIM = 19
#: slices of the state vector, by RLinf's key name
STATE_LAYOUT = {
    "gripper_position": slice(0, 1),
    "tcp_force": slice(1, 4),
    "tcp_pose": slice(4, 10),
    "tcp_torque": slice(10, 13),
    "tcp_vel": slice(13, 19),
}
#: OpenPI wire keys the server's franka_pnp embodiment maps onto video.image / video.wrist_image / state.state
WIRE_IMAGE = "observation/image"
WIRE_WRIST = "observation/wrist_image"
WIRE_STATE = "observation/state"


def centre_square(img: np.ndarray) -> np.ndarray:
    h, w = img.shape[:2]
    side = min(h, w)
    top, left = (h - side) // 2, (w - side) // 2
    return img[top : top + side, left : left + side]


def resize_bilinear(img: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """uint8 (H, W, 3) -> (out_h, out_w, 3), pixel-centre aligned like OpenCV's INTER_LINEAR."""
    h, w = img.shape[:2]
    if (h, w) == (out_h, out_w):
        return img.copy()
    src = img.astype(np.float32)
    ys = np.clip((np.arange(out_h) + 0.5) * h / out_h - 0.5, 0, h - 1)
    xs = np.clip((np.arange(out_w) + 0.5) * w / out_w - 0.5, 0, w - 1)
    y0, x0 = np.floor(ys).astype(int), np.floor(xs).astype(int)
    y1, x1 = np.minimum(y0 + 1, h - 1), np.minimum(x0 + 1, w - 1)
    wy, wx = (ys - y0)[:, None, None], (xs - x0)[None, :, None]
    top = src[y0][:, x0] * (1 - wx) + src[y0][:, x1] * wx
    bottom = src[y1][:, x0] * (1 - wx) + src[y1][:, x1] * wx
    return np.clip(np.rint(top * (1 - wy) + bottom * wy), 0, 255).astype(np.uint8)


@dataclass(frozen=True)
class PnpObservationConfig:
    image_hw: tuple[int, int] = (128, 128)  # RLinf's env frame size (what the training data holds)
    gripper_max_width_m: float = 0.08  # Franka Hand: converts the contract's closure in [0, 1] to an opening

    def __post_init__(self) -> None:
        if len(self.image_hw) != 2 or min(self.image_hw) < 16 or max(self.image_hw) > 1024:
            raise ConfigError(f"pnp_observation.image_hw must be two sizes in [16, 1024], got {self.image_hw}")
        if not 0 < self.gripper_max_width_m <= 0.2:
            raise ConfigError(
                f"pnp_observation.gripper_max_width_m must be in (0, 0.2] m, got {self.gripper_max_width_m}"
            )


class PnpObservationBuilder:
    """Builds the wire observation. `start_episode(reset_tcp)` must be called once the arm is at the reset pose."""

    def __init__(self, config: PnpObservationConfig | None = None):
        self.config = config or PnpObservationConfig()
        self._reset_inv: np.ndarray | None = None

    def start_episode(self, reset_tcp: np.ndarray) -> None:
        """The reference frame of `tcp_pose` (RLinf takes the TCP pose measured after the reset move)."""
        reset_tcp = np.asarray(reset_tcp, dtype=np.float64)
        if reset_tcp.shape != (4, 4) or not np.all(np.isfinite(reset_tcp)):
            raise InvalidObservation(f"reset_tcp must be a finite 4x4 pose, got {reset_tcp.shape}", field="reset_tcp")
        self._reset_inv = np.linalg.inv(reset_tcp)

    def image(self, frame: np.ndarray, field: str) -> np.ndarray:
        if not (isinstance(frame, np.ndarray) and frame.dtype == np.uint8 and frame.ndim == 3 and frame.shape[2] == 3):
            raise InvalidObservation(
                f"{field} must be a uint8 (H, W, 3) RGB frame, got {getattr(frame, 'shape', type(frame))}", field=field
            )
        return resize_bilinear(centre_square(frame), *self.config.image_hw)

    def state(self, tcp: TcpState, gripper_closure: float) -> np.ndarray:
        if self._reset_inv is None:
            raise InvalidObservation("start_episode(reset_tcp) was not called for this episode", field="tcp_pose")
        for name, value, shape in (("tcp.pose", tcp.pose, (4, 4)), ("tcp.twist", tcp.twist, (6,)),
                                   ("tcp.wrench", tcp.wrench, (6,))):  # fmt: skip
            arr = np.asarray(value, dtype=np.float64)
            if arr.shape != shape or not np.all(np.isfinite(arr)):
                raise InvalidObservation(f"{name} must be finite with shape {shape}, got {arr.shape}", field=name)
        if not (np.isfinite(gripper_closure) and -1e-6 <= gripper_closure <= 1 + 1e-6):
            raise InvalidObservation(f"gripper closure must be in [0, 1], got {gripper_closure}", field="gripper")
        relative = self._reset_inv @ tcp.pose
        out = np.empty(STATE_DIM, dtype=np.float64)
        out[STATE_LAYOUT["gripper_position"]] = (1.0 - np.clip(gripper_closure, 0, 1)) * self.config.gripper_max_width_m
        out[STATE_LAYOUT["tcp_force"]] = tcp.wrench[:3]
        out[STATE_LAYOUT["tcp_pose"]] = np.concatenate([relative[:3, 3], matrix_to_euler_xyz(relative[:3, :3])])
        out[STATE_LAYOUT["tcp_torque"]] = tcp.wrench[3:]
        out[STATE_LAYOUT["tcp_vel"]] = np.linalg.solve(rlinf_adjoint(tcp.pose), tcp.twist)
        return out.astype(np.float32)

    def build(
        self, exterior: np.ndarray, wrist: np.ndarray, tcp: TcpState, gripper_closure: float, prompt: str
    ) -> dict:
        """The OpenPI-style observation dict (add session id / endpoint fields as the transport needs)."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidObservation("prompt must be a non-empty task instruction", field="prompt")
        return {
            WIRE_IMAGE: self.image(exterior, "exterior"),
            WIRE_WRIST: self.image(wrist, "wrist"),
            WIRE_STATE: self.state(tcp, gripper_closure),
            "prompt": prompt,
        }
