"""OpenPI WebSocket frames: binary msgpack messages, the handshake config, requests and replies."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dreamzero_client.droid import OPENPI_DROID_KEY_MAP  # noqa: F401 - the DROID map lives with the DROID client
from dreamzero_client.errors import InvalidObservation, InvalidRequest
from dreamzero_client.wire import codec
from dreamzero_client.wire import fields as f
from dreamzero_client.wire.generations import action_prefixes, continuity_fields, rtc_counts

#: control keys of an OpenPI request; everything else is observation. `expected_steps` / `expected_incarnations`
#: (a list of one) carry the session's continuity fields, and `rtc_prefix_len` / `rtc_exec_horizon` /
#: `action_prefix` real-time chunking (docs/rtc.md), as in the HTTP body's `parameters`.
OPENPI_CONTROL_KEYS = (
    "endpoint", "session_id", "prompt", "seed", "response_format", "expected_steps", "expected_incarnations",
    "rtc_prefix_len", "rtc_exec_horizon", "action_prefix", "return_video",
)  # fmt: skip
OPENPI_ENDPOINTS = ("infer", "reset")
OPENPI_DEFAULT_SESSION = "default"
#: DreamZero's server answers reset with this text frame; vLLM-Omni with `{"status": <it>}` in msgpack
RESET_TEXT = "reset successful"
OPENPI_RESET_REPLY = {"status": RESET_TEXT}
_TEXT_KEY = re.compile(r"^[\w./:-]{1,128}$")


def pack_frame(obj: Any, flavour: str = codec.OPENPI) -> bytes:
    """A binary OpenPI frame (msgpack with openpi array markers unless the peer used msgpack-numpy)."""
    return codec.encode_msgpack(obj, flavour)


def unpack_frame(data: bytes | str, max_bytes: int | None = None) -> tuple[Any, str]:
    """Decode a binary frame; a text frame is an `InvalidRequest` (the protocol is binary msgpack)."""
    if isinstance(data, str):
        raise InvalidRequest("text frames are not part of the protocol; send binary msgpack frames")
    codec.check_size(data, max_bytes)
    return codec.decode_msgpack(data)


#: the keys of the reference `PolicyServerConfig` (DreamZero's and vLLM-Omni's servers send exactly these): clients
#: build a dataclass from the handshake, so the plain handshake holds these and nothing else
HANDSHAKE_KEYS = (
    "image_resolution", "needs_wrist_camera", "n_external_cameras", "needs_stereo_camera", "needs_session_id",
    "action_space",
)  # fmt: skip
#: query parameters a client may add to the WebSocket URL (all opt-in; other servers ignore a query string):
#: `handshake=extended` adds what else the server knows to the handshake frame (horizon, dims, model, embodiment,
#: options, a resume token), `response_format=dict|array` sets the connection's default infer reply shape, and
#: `resume=<token>` continues the sessions of an earlier connection
QUERY_HANDSHAKE, QUERY_RESPONSE_FORMAT, QUERY_RESUME = "handshake", "response_format", "resume"
HANDSHAKE_FORMATS = ("plain", "extended")
RESPONSE_FORMATS = ("array", "dict")


def handshake_config(
    image_resolution: tuple[int, int] = (180, 320),
    n_external_cameras: int = 2,
    needs_wrist_camera: bool = True,
    needs_stereo_camera: bool = False,
    needs_session_id: bool = True,
    action_space: str = "joint_position",
) -> dict:
    """The policy server config sent as the first frame of every connection (DROID defaults): exactly the six
    reference keys, so `PolicyServerConfig(**handshake)` works."""
    return {
        "image_resolution": [int(image_resolution[0]), int(image_resolution[1])],
        "needs_wrist_camera": bool(needs_wrist_camera),
        "n_external_cameras": int(n_external_cameras),
        "needs_stereo_camera": bool(needs_stereo_camera),
        "needs_session_id": bool(needs_session_id),
        "action_space": action_space,
    }


def split_server_config(cfg: Mapping[str, Any]) -> tuple[dict, dict]:
    """An embodiment's server config -> (the six-key handshake, everything else: served on opt-in only)."""
    handshake = handshake_config(**{k: cfg[k] for k in HANDSHAKE_KEYS if k in cfg})
    return handshake, {k: v for k, v in cfg.items() if k not in HANDSHAKE_KEYS}


@dataclass
class OpenPIRequest:
    endpoint: str  # "infer" | "reset"
    session_id: str
    prompt: str | None
    seed: int | None
    observation: dict[str, np.ndarray]  # every non-control key, as sent (e.g. "observation/joint_position")
    reply_as_dict: bool  # {"actions": ...} on opt-in vs the bare array (what DreamZero's and vLLM-Omni's clients read)
    flavour: str = codec.OPENPI
    expected_step: int | None = None  # `step` of the session's last reply, echoed by the client
    expected_incarnation: str | None = None  # `incarnation` of the session's last reply, echoed by the client
    rtc_prefix_len: int | None = None  # real-time chunking (docs/rtc.md): d
    rtc_exec_horizon: int | None = None  # s
    action_prefix: np.ndarray | None = None  # [P, D] in robot units
    return_video: bool = False  # the reply (then a dict) also carries "video": uint8 [T, H, W, 3] predicted frames


def parse_openpi_request(msg: Any, flavour: str = codec.OPENPI, default_dict: bool = False) -> OpenPIRequest:
    """Validate a decoded OpenPI message. A missing `endpoint` means infer.

    Reply shape: the message's ``response_format: "dict" | "array"``; else `default_dict` (the connection's
    `?response_format=`), else the bare array, as both DreamZero reference servers answer.
    """
    if not isinstance(msg, Mapping):
        raise InvalidRequest(f"an OpenPI message must be a msgpack map, got {f.type_name(msg)}")
    endpoint = f.choice(msg.get("endpoint", "infer"), "endpoint", OPENPI_ENDPOINTS)
    session_id = msg.get("session_id", OPENPI_DEFAULT_SESSION)
    if not isinstance(session_id, str) or not session_id or len(session_id) > f.MAX_SESSION_ID_LEN:
        raise InvalidObservation(f"'session_id' must be a non-empty string, got {session_id!r}", field="session_id")
    prompt = msg.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise InvalidObservation(f"'prompt' must be a string, got {f.type_name(prompt)}", field="prompt")
    seed = None if msg.get("seed") is None else f.int_in(msg["seed"], "seed", 0, f.MAX_SEED)
    if "response_format" in msg:
        reply_as_dict = f.choice(msg["response_format"], "response_format", RESPONSE_FORMATS) == "dict"
    else:
        reply_as_dict = default_dict
    observation = {}
    for k, v in msg.items():
        if k in OPENPI_CONTROL_KEYS:
            continue
        if not isinstance(k, str) or not _TEXT_KEY.match(k):
            name = str(k)[:64]
            raise InvalidObservation(f"observation key {name!r} is not a valid key", field=name)
        observation[k] = f.array(v, k)
    if endpoint == "infer" and prompt is None:
        raise InvalidObservation("'prompt' is required for infer", field="prompt")
    steps, incarnations = continuity_fields(msg, 1)
    prefix_len = rtc_counts(msg.get("rtc_prefix_len"), "rtc_prefix_len", 1)
    horizon = rtc_counts(msg.get("rtc_exec_horizon"), "rtc_exec_horizon", 1)
    prefix = action_prefixes(msg.get("action_prefix"), "action_prefix", 1)
    return OpenPIRequest(
        endpoint, session_id, prompt, seed, observation, reply_as_dict, flavour,
        expected_step=steps[0] if steps else None, expected_incarnation=incarnations[0] if incarnations else None,
        rtc_prefix_len=prefix_len[0] if prefix_len else None, rtc_exec_horizon=horizon[0] if horizon else None,
        action_prefix=prefix[0] if prefix else None,
        return_video=f.flag(msg.get("return_video", False), "return_video"),
    )  # fmt: skip


def infer_reply(actions: np.ndarray, as_dict: bool, extra: Mapping[str, Any] | None = None) -> Any:
    """The infer reply: the bare float32 array, or ``{"actions": array, **extra}``."""
    actions = np.ascontiguousarray(actions, dtype=np.float32)
    return {"actions": actions, **(extra or {})} if as_dict else actions


def error_frame(message: str, code: str | None = None, field: str | None = None) -> dict:
    """``{"type": "error", "message": ...}`` (vllm-omni style); the server keeps the socket open after it."""
    frame: dict[str, Any] = {"type": "error", "message": message}
    if code is not None:
        frame["code"] = code
    if field is not None:
        frame["field"] = field
    return frame


def is_error_frame(obj: Any) -> bool:
    return isinstance(obj, Mapping) and obj.get("type") == "error"
