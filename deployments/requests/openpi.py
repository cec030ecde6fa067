"""The OpenPI WebSocket door's decoder: a decoded OpenPI message -> `OpenPIRequest` (one row: its observation as
sent and its `RowOptions`), and the frames only the server sends (handshake, infer / reset replies, error frames).
Server-side only; the frame format and the key names live in `dreamzero_client.wire.openpi`, which clients use too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from deployments.requests import fields as f
from deployments.requests.rows import OPTION_KEYS, RowOptions
from dreamzero.errors import InvalidObservation, InvalidRequest
from dreamzero_client.wire import codec
from dreamzero_client.wire.openpi import OPENPI_CONTROL_KEYS, OPENPI_DEFAULT_SESSION, RESPONSE_FORMATS

OPENPI_ENDPOINTS = ("infer", "reset")
#: DreamZero's server answers reset with this text frame; vLLM-Omni with `{"status": <it>}` in msgpack
RESET_TEXT = "reset successful"
OPENPI_RESET_REPLY = {"status": RESET_TEXT}

#: the keys of the reference `PolicyServerConfig` (DreamZero's and vLLM-Omni's servers send exactly these): clients
#: build a dataclass from the handshake, so the plain handshake holds these and nothing else
HANDSHAKE_KEYS = (
    "image_resolution", "needs_wrist_camera", "n_external_cameras", "needs_stereo_camera", "needs_session_id",
    "action_space",
)  # fmt: skip
HANDSHAKE_FORMATS = ("plain", "extended")


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


_TEXT_KEY = re.compile(r"^[\w./:-]{1,128}$")
#: keys that are never observation: the protocol's control keys and every shared per-row option
CONTROL_KEYS = frozenset(OPENPI_CONTROL_KEYS) | frozenset(OPTION_KEYS)


@dataclass
class OpenPIRequest:
    endpoint: str  # "infer" | "reset"
    session_id: str
    observation: dict[str, np.ndarray]  # every non-control key, as sent (e.g. "observation/joint_position")
    rows: RowOptions  # one row under the client's session id; the door namespaces it and adds the socket's continuity
    reply_as_dict: bool  # {"actions": ...} on opt-in vs the bare array (what DreamZero's and vLLM-Omni's clients read)
    flavour: str = codec.OPENPI

    @property
    def prompt(self) -> str:
        return self.rows.prompts[0]


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
    if "response_format" in msg:
        reply_as_dict = f.choice(msg["response_format"], "response_format", RESPONSE_FORMATS) == "dict"
    else:
        reply_as_dict = default_dict
    observation = {}
    for k, v in msg.items():
        if k in CONTROL_KEYS:
            continue
        if not isinstance(k, str) or not _TEXT_KEY.match(k):
            name = str(k)[:64]
            raise InvalidObservation(f"observation key {name!r} is not a valid key", field=name)
        observation[k] = f.array(v, k)
    if endpoint == "infer" and prompt is None:
        raise InvalidObservation("'prompt' is required for infer", field="prompt")
    rows = RowOptions.read([prompt or ""], [session_id], None, msg)
    return OpenPIRequest(endpoint, session_id, observation, rows, reply_as_dict, flavour)
