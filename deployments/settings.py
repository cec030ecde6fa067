"""One typed settings object per deployment, built and bound by `serve_graph.builder` (Ray Serve LLM's pattern).

Each deployment gets exactly what it applies, made of the same sections the YAML was validated against
(`deployments.sections`): no flattened keyword lists, no args dict parsed again in the replica. The objects are
frozen pydantic models, pickled into the replicas as they are (not validated again there). Nothing here names a path
that a CPU stage would open: the embodiment's statistics travel as data (`EmbodimentSource`), and only the policy
gets `model_path`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from deployments.sections import (
    BatchingArgs,
    HttpArgs,
    PostprocessArgs,
    PreprocessArgs,
    ReplayArgs,
    SessionArgs,
    Strict,
    TenantsArgs,
    VideoArgs,
    ZmqArgs,
)


class EmbodimentSource(Strict):
    """The embodiment a deployment transforms for, with the statistics `build_app` read once."""

    tag: str = Field("oxe_droid", description="Embodiment tag (dreamzero.embodiments).")
    metadata: dict[str, Any] | None = Field(
        None, description="{tag: metadata.json entry} as read by build_app; None: the embodiment's shipped file."
    )


class StageSettings(Strict):
    """A Preprocess or Postprocess replica: the embodiment whose transforms it runs."""

    embodiment: EmbodimentSource = Field(default_factory=EmbodimentSource)


class GraphSettings(Strict):
    """The one request path of a front door (`deployments.graph_runner.GraphRunner`)."""

    embodiment: EmbodimentSource = Field(default_factory=EmbodimentSource)
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


class PolicySettings(Strict):
    """A Policy replica: the model it loads (or the episode it replays), its session store and batching."""

    model_path: str | None = Field(None, description="Checkpoint path; None: the embedded tiny default.")
    checkpoint_layout: Literal["hf", "full_weights", "diffusers"] | None = None
    checkpoint_config: str | None = Field(None, description="Preset name replacing the checkpoint's config.")
    tokenizer_path: str | None = None
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    pipeline: dict[str, Any] = Field(default_factory=dict, description="PipelineConfig overrides (validated).")
    sessions: SessionArgs = Field(default_factory=SessionArgs)
    batching: BatchingArgs = Field(default_factory=BatchingArgs)
    torch_threads: int | None = Field(None, ge=1, description="Most torch threads of a CPU model call.")
    rows_per_thread: int = Field(4, ge=1)
    replay: ReplayArgs | None = Field(None, description="Recorded actions instead of a model.")
    cfg_parallel: Literal[1, 2] = Field(1, description="Ranks per replica, one CFG branch each (2: one co-located).")
    cfg_timeout_s: float = Field(120.0, gt=0, description="Bound of every exchange between the two ranks.")
    placement: dict[str, str] = Field(default_factory=dict, description="`policy.placement`: the fields set.")
    cfg_rank_options: dict[str, Any] = Field(
        default_factory=dict, description="Ray actor options of rank 1 (num_cpus, num_gpus), as the replica's."
    )
    embodiment: EmbodimentSource = Field(default_factory=EmbodimentSource)
    return_latents: bool = False
    video: VideoArgs = Field(default_factory=VideoArgs, description="Recording of the predicted video.")
    retry_after_s: float = Field(1.0, gt=0, description="Retry-After of a capacity refusal without a better hint.")
