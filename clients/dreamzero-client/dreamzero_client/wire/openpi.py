"""OpenPI WebSocket frames: binary msgpack messages, the control keys, the query parameters and error frames.

The server's first frame (the handshake) holds the six keys of openpi's `PolicyServerConfig` (`image_resolution`,
`needs_wrist_camera`, `n_external_cameras`, `needs_stereo_camera`, `needs_session_id`, `action_space`); infer
replies are the bare float32 [H, D] array or ``{"actions": ..., ...}``; reset replies ``{"status": ...}`` or a text
frame. The server's side (message parser, handshake and reply builders): `deployments.requests.openpi`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dreamzero_client.errors import InvalidRequest
from dreamzero_client.wire import codec

#: control keys of an OpenPI request; everything else is observation. `expected_steps` / `expected_incarnations`
#: (a list of one) carry the session's continuity fields, and `rtc_prefix_len` / `rtc_exec_horizon` /
#: `action_prefix` real-time chunking (docs/rtc.md), `traffic_class` / `deadline_ms` / `observed_at` the fleet's fields
#: (docs/fleet.md), as in the HTTP body's `parameters`.
OPENPI_CONTROL_KEYS = (
    "endpoint", "session_id", "prompt", "seed", "response_format", "expected_steps", "expected_incarnations",
    "rtc_prefix_len", "rtc_exec_horizon", "action_prefix", "return_video", "traffic_class", "deadline_ms",
    "observed_at",
)  # fmt: skip
#: OpenPI / RoboArena observation key -> the DROID embodiment's raw key (the server's OpenPI adapter and the DROID
#: runtime read this one). Exterior 0 is the canvas' bottom-left view (raw keys count from 1), exterior 1 bottom-right.
OPENPI_DROID_KEY_MAP = {
    "observation/exterior_image_0_left": "video.exterior_image_1_left",
    "observation/exterior_image_1_left": "video.exterior_image_2_left",
    "observation/wrist_image_left": "video.wrist_image_left",
    "observation/joint_position": "state.joint_position",
    "observation/gripper_position": "state.gripper_position",
}
#: sent by DROID clients, unused by DreamZero (the server ignores it)
OPENPI_CARTESIAN_KEY = "observation/cartesian_position"
OPENPI_DEFAULT_SESSION = "default"


def pack_frame(obj: Any, flavour: str = codec.OPENPI) -> bytes:
    """A binary OpenPI frame (msgpack with openpi array markers unless the peer used msgpack-numpy)."""
    return codec.encode_msgpack(obj, flavour)


def unpack_frame(data: bytes | str, max_bytes: int | None = None) -> tuple[Any, str]:
    """Decode a binary frame; a text frame is an `InvalidRequest` (the protocol is binary msgpack)."""
    if isinstance(data, str):
        raise InvalidRequest("text frames are not part of the protocol; send binary msgpack frames")
    codec.check_size(data, max_bytes)
    return codec.decode_msgpack(data)


#: query parameters a client may add to the WebSocket URL (all opt-in; other servers ignore a query string):
#: `handshake=extended` adds what else the server knows to the handshake frame (horizon, dims, model, embodiment,
#: options, a resume token), `response_format=dict|array` sets the connection's default infer reply shape, and
#: `resume=<token>` continues the sessions of an earlier connection
QUERY_HANDSHAKE, QUERY_RESPONSE_FORMAT, QUERY_RESUME = "handshake", "response_format", "resume"
RESPONSE_FORMATS = ("array", "dict")


def is_error_frame(obj: Any) -> bool:
    return isinstance(obj, Mapping) and obj.get("type") == "error"
