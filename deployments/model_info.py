"""What the front doors report about the served model: one `Policy.info` call, read once per door process.

HTTP's `/v1/actions/metadata` and `/v1/models`, the OpenPI handshake and the ZeroMQ door's modality config all read
it, so every door describes the model the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deployments.requests import openpi
from dreamzero.embodiments import Embodiment


@dataclass(frozen=True)
class ModelInfo:
    config_name: str  # the checkpoint's preset name ("droid_14b", "tiny", "replay", "custom")
    action_horizon: int  # actions per chunk
    action_dim: int  # robot action dims of the embodiment (8 for DROID)
    padded_action_dim: int  # the model's padded action width (32)
    max_state_dim: int
    default_seed: int
    num_inference_steps: int
    openpi_handshake: dict[str, Any]  # the first frame of every OpenPI WebSocket connection: the six reference keys
    openpi_extras: dict[str, Any]  # what else the embodiment's server config says (horizon, dims, ...): on opt-in
    max_batch_rows: int | None = None  # session rows per model call the replica settled on (`auto` or as set)
    memory: dict[str, Any] | None = None  # the replica's rows, session byte budget and device (budget.ServingMemory)

    @classmethod
    def from_policy(cls, info: dict[str, Any], embodiment: Embodiment) -> ModelInfo:
        """`info`: `PolicyDeployment.info()`; the embodiment gives the robot's action width and the handshake keys."""
        action_dim = int(getattr(embodiment, "action_dim", info["max_action_dim"]))
        handshake, extras = openpi.split_server_config(embodiment.openpi_server_config())
        extras.setdefault("action_horizon", int(info["action_horizon"]))
        extras.setdefault("action_dim", action_dim)
        return cls(
            config_name=info["config_name"],
            action_horizon=int(info["action_horizon"]),
            action_dim=action_dim,
            padded_action_dim=int(info["max_action_dim"]),
            max_state_dim=int(info["max_state_dim"]),
            default_seed=int(info["default_seed"]),
            num_inference_steps=int(info["num_inference_steps"]),
            openpi_handshake=handshake,
            openpi_extras=extras,
            max_batch_rows=info.get("max_batch_rows"),
            memory=info.get("memory"),
        )
