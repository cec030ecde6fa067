"""Typed arguments of the serving app (`args:` of `serve_config.yaml`), validated before anything starts.

`parse_app_args(dict)` turns the YAML `args` into `AppArgs` or raises `ConfigError` whose message names every bad
field and says how to fix it. Every field carries a description: `docs/serving.md` is the readable reference.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dreamzero.config import PipelineConfig
from dreamzero.errors import ConfigError

MIB = 1024 * 1024


class _Strict(BaseModel):
    # A typo in the YAML must fail loudly rather than be ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)


class AutoscalingArgs(_Strict):
    """Ray Serve autoscaling of the policy deployment (replaces `num_replicas` when given)."""

    min_replicas: int = Field(1, ge=0, description="Fewest policy replicas kept alive (0 lets it scale to zero).")
    max_replicas: int = Field(1, ge=1, description="Most policy replicas (each holds the model and `num_gpus` GPUs).")
    initial_replicas: int | None = Field(None, ge=0, description="Replicas started first; default `min_replicas`.")
    target_ongoing_requests: float = Field(
        2.0, gt=0, description="Ongoing requests per replica that autoscaling aims for (Ray's default is 2)."
    )
    upscale_delay_s: float = Field(30.0, ge=0, description="How long load must stay high before adding a replica.")
    downscale_delay_s: float = Field(
        600.0, ge=0, description="How long load must stay low before removing a replica (its sessions restart)."
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingArgs:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas}); raise max_replicas"
            )
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError("initial_replicas must lie between min_replicas and max_replicas")
        return self

    def to_ray(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class CpuStageArgs(_Strict):
    """Replicas and resources of a CPU stage (ingress, preprocess, postprocess)."""

    num_replicas: int = Field(1, ge=1, description="Replicas of this stage.")
    num_cpus: float = Field(
        0.0, ge=0, description="CPUs reserved per replica; 0 lets several replicas share a small machine."
    )
    max_ongoing_requests: int = Field(64, ge=1, description="Concurrent requests one replica accepts.")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources per replica, e.g. {head: 0.01} to keep the stage on the node started "
        "with `--resources '{\"head\": 1}'`.",
    )


class PreprocessArgs(CpuStageArgs):
    """The Preprocess stage: its replicas, and where a raw request's transforms run."""

    placement: Literal["auto", "ingress", "replicas"] = Field(
        "auto",
        description="Where a raw request's transforms run: `replicas` (always the Preprocess deployment, one hop "
        "each way), `ingress` (in the front door's process, on its worker threads, no hop), or `auto`: in the front "
        "door when the request's arrays hold at most `ingress_max_bytes`, else on the replicas (docs/serving.md).",
    )
    ingress_max_bytes: int | str = Field(
        8 * MIB,
        description="With placement auto: the largest request (bytes of its arrays, a count or a size like "
        "'8MiB') whose transforms run in the front door; larger ones (720p cameras, many rows) go to the replicas.",
    )
    ingress_threads: int = Field(
        2, ge=1, description="Worker threads of each front-door replica for transforms it runs itself."
    )

    @field_validator("ingress_max_bytes")
    @classmethod
    def _size(cls, v: int | str) -> int:
        from dreamzero.device import parse_bytes

        try:
            n = parse_bytes(v, field="preprocess.ingress_max_bytes")
        except ConfigError as exc:
            raise ValueError(str(exc)) from exc
        if not isinstance(n, int):
            raise ValueError(f"{v!r}: give a size in bytes, e.g. 8MiB (use placement: replicas to never run here)")
        return n


class PostprocessArgs(CpuStageArgs):
    """The Postprocess stage: its replicas, and where a raw request's actions are converted."""

    placement: Literal["ingress", "replicas"] = Field(
        "ingress",
        description="Where robot actions are made from the model's chunk: `ingress` (in the front door's process; "
        "microseconds of numpy on [B, H, 32]) or `replicas` (the Postprocess deployment, one hop each way).",
    )


class ReplayArgs(_Strict):
    """Serve a LeRobot episode's recorded actions instead of a model (debug the wire and the robot loop, no weights)."""

    dataset: str = Field(..., description="LeRobot dataset directory (v2.1 or v3.0 layout).")
    episode: int = Field(0, ge=0, description="Episode whose actions are replayed.")
    stride: int | None = Field(
        None, ge=1, description="Rows a session's cursor advances per call; default the action horizon."
    )
    action_columns: list[str] | None = Field(
        None, description="Action columns (`name=column[start:end]`) when the embodiment's preset does not fit."
    )

    @field_validator("dataset")
    @classmethod
    def _dataset_exists(cls, v: str) -> str:
        return _existing(v, Path.is_dir, "is not a directory; point policy.replay.dataset at a LeRobot dataset")


class PolicyArgs(_Strict):
    """Replicas, resources and routing of the policy deployment (the only model holder)."""

    num_replicas: int = Field(1, ge=1, description="Fixed replica count; ignored when `autoscaling` is set.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica: 1 on a GPU machine, 0 for the CPU default.")
    num_cpus: float = Field(0.0, ge=0, description="CPUs reserved per replica.")
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="Most torch intra-op threads of a CPU replica's model call (one per `rows_per_thread` rows of "
        "the call); null: Ray's default, num_cpus or 1.",
    )
    rows_per_thread: int = Field(
        4, ge=1, description="Rows of a CPU model call per torch thread, up to `torch_threads` (small calls: 1 thread)."
    )
    autoscaling: AutoscalingArgs | None = Field(None, description="Autoscaling instead of a fixed replica count.")
    max_ongoing_requests: int = Field(
        16, ge=1, description="Requests one replica runs at once (dynamic batching draws from these)."
    )
    max_queued_requests: int = Field(
        256,
        ge=-1,
        description="Requests queued per caller for a busy replica before 503 + Retry-After (-1: unbounded).",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources per replica, e.g. {gpu_node: 0.01} to place the policy on the nodes "
        "started with that resource.",
    )
    replay: ReplayArgs | None = Field(
        None, description="Answer with a LeRobot episode's recorded actions instead of loading a model."
    )


class SessionArgs(_Strict):
    """The bounded per-replica session store."""

    max_sessions: int = Field(
        128, ge=1, description="Sessions one replica keeps; the least recently used idle one is evicted beyond it."
    )
    ttl_s: float = Field(900.0, gt=0, description="Idle seconds after which a session is evicted.")
    max_bytes: int | str | None = Field(
        "auto",
        description="Bytes the sessions of one replica may reserve (each its peak footprint): a count, a size like "
        "'40GiB', or auto: on GPU the free memory after loading and a warm-up of the largest batch, less that "
        "batch's activations and a margin; on CPU no limit. A request that does not fit gets 503 (docs/model.md).",
    )

    @field_validator("max_bytes")
    @classmethod
    def _size(cls, v: int | str | None) -> int | str | None:
        from dreamzero.device import parse_bytes

        try:
            return parse_bytes(v)
        except ConfigError as exc:
            raise ValueError(str(exc)) from exc


class BatchingArgs(_Strict):
    """Dynamic batching of concurrent requests on one policy replica."""

    enabled: bool = Field(True, description="Batch concurrent compatible requests into one forward pass.")
    max_batch_size: int = Field(16, ge=1, description="Most requests merged into one batch.")
    max_batch_rows: int | None = Field(
        None,
        ge=1,
        description="Most session rows in one model call (a request with B sessions is B rows; classifier-free "
        "guidance runs 2 model rows per session row); null: sessions.max_sessions. A larger request "
        "gets 413. On GPU the warm-up runs a batch of this size.",
    )
    rows_per_request: int | None = Field(
        None, ge=1, description="Most sessions (B) one request may carry; null: no limit beyond max_batch_rows."
    )
    batch_wait_timeout_s: float = Field(
        0.005,
        ge=0,
        le=1.0,
        description=(
            "How long a free model waits for the previous batch's clients to come back, and a session's first "
            "request for other starting sessions."
        ),
    )


class HttpArgs(_Strict):
    """Limits of the HTTP and WebSocket front door."""

    max_body_bytes: int = Field(64 * MIB, ge=1024, description="Largest request body; larger ones get 413.")
    ws_max_message_bytes: int = Field(64 * MIB, ge=1024, description="Largest inbound WebSocket message.")
    ws_idle_timeout_s: float = Field(30.0, gt=0, description="A WebSocket silent this long is closed (code 1000).")
    request_timeout_s: float = Field(
        300.0, gt=0, description="Bound on one request's trip through the graph; past it the client gets 503."
    )
    retry_after_s: float = Field(1.0, gt=0, description="`Retry-After` sent with 503 when no better hint exists.")


class ZmqArgs(_Strict):
    """The ZeroMQ front door for RLDX-1 / Isaac-GR00T clients (docs/zmq.md); off unless `zmq:` is given."""

    port: int = Field(5555, ge=1, le=65535, description="TCP port of the ROUTER socket (RLDX-1's default 5555).")
    host: str = Field("0.0.0.0", min_length=1, description="Interface to bind (`0.0.0.0`: every interface).")
    max_message_bytes: int = Field(64 * MIB, ge=1024, description="Largest request; larger ones are dropped by ZMQ.")
    request_timeout_s: float = Field(
        60.0, gt=0, description="Deadline of one request; past it the client gets an error reply (never silence)."
    )
    max_in_flight: int = Field(256, ge=1, description="Requests in flight at once; more get an error reply.")
    allow_kill: bool = Field(False, description="Let the `kill` endpoint close the door (refused when false).")
    num_cpus: float = Field(0.0, ge=0, description="CPUs reserved for the door's replica.")


def _existing(value: str | None, check, problem: str) -> str | None:
    """None, or the user-expanded path when `check(path)` holds; else a message ending in how to fix it."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if not check(path):
        raise ValueError(f"{value!r} {problem} or set it to null")
    return str(path)


class AppArgs(_Strict):
    """Everything `build_app` needs. Only `model_path` changes between the CPU default and a GPU deployment."""

    model_path: str | None = Field(
        None,
        description='Checkpoint in one of three layouts (docs/serving.md, "Checkpoint layouts"): an HF folder with '
        "config.json, a full_weights.pt (or a folder holding one; needs checkpoint_config unless a config.json lies "
        "beside it), or a -Diffusers folder with model_index.json; embedded:<name> names a trained model shipped in "
        "the package (embedded:small-scene1, docs/training.md); null builds the embedded tiny model (random "
        "weights). Only the policy replicas open it.",
    )
    checkpoint_layout: Literal["hf", "full_weights", "diffusers"] | None = Field(
        None, description="Layout of model_path; null detects it from the files."
    )
    checkpoint_config: str | None = Field(
        None,
        description="Preset config (droid_14b, libero_5b, tiny) of the checkpoint: required for a full_weights.pt "
        "with no config.json beside it, otherwise it replaces the checkpoint's own config.",
    )
    tokenizer_path: str | None = Field(
        None,
        description="Local google/umt5-xxl tokenizer directory for a real checkpoint; default: "
        "<model_path>/tokenizer/, else $DREAMZERO_TOKENIZER_PATH (docs/model.md 3.3).",
    )
    model_name: str = Field("dreamzero", min_length=1, description="Name reported by /v1/models and echoed back.")
    embodiment: str = Field("oxe_droid", min_length=1, description="Embodiment tag used for the raw form and WS.")
    metadata_path: str | None = Field(
        None,
        description="metadata.json with normalisation statistics; default: the checkpoint's "
        "experiment_cfg/metadata.json, else the embodiment's bundled synthetic statistics.",
    )
    device: str | None = Field(None, description="Torch device; default cuda when num_gpus > 0, else cpu.")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="Weights dtype; default bfloat16 on GPU, float32 on CPU."
    )
    pipeline: dict[str, Any] = Field(
        default_factory=dict,
        description="Overrides of the inference loop (dreamzero.config.PipelineConfig, docs/model.md 6.2), e.g. "
        "num_inference_steps or compile; names and values are checked here, before any replica starts.",
    )
    return_latents: bool = Field(False, description="Ask the policy for predicted video latents (debugging).")
    api_key: str | None = Field(
        None, description="Required key (`Authorization: Bearer <key>` or `Api-Key <key>`); null disables auth."
    )
    api_key_env: str | None = Field(
        None, description="Name of an environment variable holding the API key (wins over `api_key`)."
    )
    ingress: CpuStageArgs = Field(default_factory=CpuStageArgs, description="Ingress replicas (never load the model).")
    preprocess: PreprocessArgs = Field(
        default_factory=PreprocessArgs, description="Preprocess (CPU) replicas and where transforms run."
    )
    postprocess: PostprocessArgs = Field(
        default_factory=PostprocessArgs, description="Postprocess (CPU) replicas and where actions are made."
    )
    policy: PolicyArgs = Field(default_factory=PolicyArgs, description="Policy (model) replicas.")
    sessions: SessionArgs = Field(default_factory=SessionArgs, description="Session store bounds.")
    batching: BatchingArgs = Field(default_factory=BatchingArgs, description="Dynamic batching.")
    http: HttpArgs = Field(default_factory=HttpArgs, description="HTTP / WebSocket limits.")
    zmq: ZmqArgs | None = Field(None, description="ZeroMQ front door (RLDX-1 clients); null: off.")

    @field_validator("model_path")
    @classmethod
    def _model_path_exists(cls, v: str | None) -> str | None:
        from dreamzero.embedded_default import resolve_model_path

        try:
            v = resolve_model_path(v)  # "embedded:<name>": a trained model shipped in the package
        except ConfigError as exc:
            raise ValueError(str(exc).removeprefix("model_path: ")) from None
        return _existing(v, Path.exists, "does not exist; point model_path at a checkpoint (file or folder)")

    @field_validator("checkpoint_config")
    @classmethod
    def _known_preset(cls, v: str | None) -> str | None:
        from dreamzero.config import PRESETS

        if v is not None and v not in PRESETS:
            raise ValueError(f"{v!r} is no preset; use one of {sorted(PRESETS)} or null")
        return v

    @field_validator("tokenizer_path")
    @classmethod
    def _tokenizer_dir_exists(cls, v: str | None) -> str | None:
        return _existing(v, Path.is_dir, "is not a directory; point tokenizer_path at a local google/umt5-xxl copy")

    @field_validator("metadata_path")
    @classmethod
    def _metadata_exists(cls, v: str | None) -> str | None:
        return _existing(v, Path.is_file, "is not a file; give the path of a metadata.json")

    @field_validator("pipeline")
    @classmethod
    def _known_pipeline_knobs(cls, v: dict[str, Any]) -> dict[str, Any]:
        try:  # names and values, at start rather than in the replica (one check: dreamzero.config)
            PipelineConfig().with_overrides(v)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return v

    @model_validator(mode="after")
    def _checkpoint_is_loadable(self) -> AppArgs:
        if self.model_path is None:
            return self
        from serve_graph.model_source import check_checkpoint

        check_checkpoint(self.model_path, self.checkpoint_layout, self.checkpoint_config)
        return self

    @model_validator(mode="after")
    def _device_matches_gpus(self) -> AppArgs:
        if self.device and self.device.startswith("cuda") and self.policy.num_gpus == 0:
            raise ValueError("device is cuda but policy.num_gpus is 0; set policy.num_gpus: 1 (per replica)")
        if self.device == "cpu" and self.policy.num_gpus > 0:
            raise ValueError("device is cpu but policy.num_gpus > 0; set policy.num_gpus: 0 or drop device")
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise ValueError(f"api_key_env names {self.api_key_env!r}, which is unset or empty; export it first")
        return self

    # derived values -------------------------------------------------------------------------------------------
    @property
    def resolved_device(self) -> str:
        return self.device or ("cuda" if self.policy.num_gpus > 0 else "cpu")

    @property
    def resolved_layout(self) -> str | None:
        """The checkpoint layout: as given, else detected from model_path's files; None for the embedded default."""
        if self.model_path is None:
            return None
        from dreamzero.checkpoint import detect_layout

        return self.checkpoint_layout or detect_layout(self.model_path)

    @property
    def resolved_api_key(self) -> str | None:
        if self.api_key_env:
            return os.environ[self.api_key_env]
        return self.api_key or None


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "args"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field; check the spelling against docs/serving.md"
        lines.append(f"  args.{where}: {msg}")
    return "invalid serve_config.yaml args:\n" + "\n".join(lines)


def parse_app_args(args: dict[str, Any] | AppArgs | None) -> AppArgs:
    """Validate `args` (a dict from YAML, or an AppArgs); raise ConfigError listing every problem."""
    if isinstance(args, AppArgs):
        return args
    try:
        return AppArgs.model_validate(args or {})
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None
