"""One typed settings object per deployment, built and bound by `serve_graph.builder` (Ray Serve LLM's pattern).

Each deployment gets exactly what it applies, made of the same section objects the YAML was validated against
(`deployments.config.sections`, `CheckpointArgs`), held whole: no field is copied out of a section, no args dict is
parsed again in the replica. The objects are frozen pydantic models, pickled into the replicas as they are (not
validated again there). Nothing here names a path that a CPU stage would open: the embodiment's statistics travel as
data (`EmbodimentSettings`), and only the policy gets `model_path`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from deployments.config.app import CheckpointArgs, resolve_device
from deployments.config.sections import (
    BatchingArgs,
    HttpArgs,
    PolicyArgs,
    PostprocessArgs,
    PreprocessArgs,
    SessionArgs,
    Strict,
    TenantsArgs,
    VideoArgs,
    ZmqArgs,
)


class EmbodimentSettings(Strict):
    """The embodiment a deployment transforms for, with the statistics `build_app` read once."""

    tag: str = Field("oxe_droid", description="Embodiment tag (dreamzero.embodiments).")
    metadata: dict[str, Any] | None = Field(
        None, description="{tag: metadata.json entry} as read by build_app; None: the embodiment's shipped file."
    )


class StageSettings(Strict):
    """A Preprocess or Postprocess replica: the embodiment whose transforms it runs."""

    embodiment: EmbodimentSettings = Field(default_factory=EmbodimentSettings)


class GraphSettings(Strict):
    """The one request path of a front door (`deployments.graph_runner.GraphRunner`)."""

    embodiment: EmbodimentSettings = Field(default_factory=EmbodimentSettings)
    preprocess: PreprocessArgs = Field(default_factory=PreprocessArgs, description="Where raw transforms run.")
    postprocess: PostprocessArgs = Field(default_factory=PostprocessArgs, description="Where actions are made.")
    request_timeout_s: float = Field(300.0, gt=0, description="Bound on one request's trip through the graph.")
    max_rows: int = Field(128, ge=1, description="Most session rows a request may carry (sessions.max_sessions).")
    tenants: TenantsArgs = Field(default_factory=TenantsArgs, description="Per-tenant quotas the runner applies.")


class AuthSettings(Strict):
    """The keys a front door accepts, as sha256 digests only (deployments.tenants): no key is kept in clear. None of
    the three given: no auth, every caller is the tenant `default`."""

    api_key_digest: str | None = Field(None, description="Digest of the legacy `api_key`: the tenant `default`.")
    api_keys: dict[str, tuple[str, ...]] = Field(
        default_factory=dict, description="`api_keys`: tenant -> its keys' 'sha256:<hex>' digests."
    )
    api_keys_file: str | None = Field(None, description="A file of the same mapping, read again when it changes.")
    reload_s: float = Field(5.0, gt=0, description="How often the door looks at the file's modification time.")


class IngressSettings(Strict):
    """The ingress: the HTTP door and the OpenPI WebSocket door on one ASGI app."""

    graph: GraphSettings = Field(default_factory=GraphSettings)
    http: HttpArgs = Field(default_factory=HttpArgs)
    model_name: str = Field("dreamzero", min_length=1, description="Name reported by /v1/models.")
    auth: AuthSettings = Field(default_factory=AuthSettings, description="The API keys and the tenants they name.")


class ZmqDoorSettings(Strict):
    """The ZeroMQ door (RLDX-1 clients)."""

    graph: GraphSettings = Field(default_factory=GraphSettings)
    zmq: ZmqArgs = Field(default_factory=ZmqArgs)
    auth: AuthSettings = Field(default_factory=AuthSettings, description="The `api_token`s and the tenants they name.")


class PolicySettings(CheckpointArgs, PolicyArgs):
    """A Policy replica: the model it loads (or the episode it replays), its session store and batching.

    Its fields are declared once, where the YAML's are: the checkpoint fields at the top of `args` (`CheckpointArgs`)
    and the `policy:` section (`PolicyArgs`) by inheritance, the `sessions:`, `batching:` and `video:` sections held
    whole. `build_app` fills it from the validated args by field name (`serve_graph.builder.policy_settings`), adding
    only what it resolved: the checkpoint's layout, preset and tokenizer, the device and the embodiment's statistics."""

    sessions: SessionArgs = Field(default_factory=SessionArgs)
    batching: BatchingArgs = Field(default_factory=BatchingArgs)
    video: VideoArgs = Field(default_factory=VideoArgs, description="Recording of the predicted video.")
    embodiment: EmbodimentSettings = Field(default_factory=EmbodimentSettings)
    retry_after_s: float = Field(1.0, gt=0, description="Retry-After of a capacity refusal without a better hint.")

    @model_validator(mode="before")
    @classmethod
    def _device(cls, data: Any) -> Any:
        """The device settled here (cuda with GPUs, else cpu), so a replica never picks one of its own."""
        if isinstance(data, dict) and data.get("device") is None:
            data = {**data, "device": resolve_device(None, data.get("num_gpus") or 0)}
        return data
