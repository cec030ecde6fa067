"""The sections of the serving app's args (`serve_config.yaml`): one `...Args` model per block of the YAML.

`deployments.config.app.AppArgs` composes them into the whole `args:` mapping; the per-deployment settings
(`deployments.config.settings`) are made of them, so a deployment reads the same typed section the YAML was checked
against. Validators only look at the values: what a path names on disk (a dataset, a key file) is checked once at
start by `serve_graph.config.check_files` and read by the replica that uses it. Every field carries a description:
`docs/serving.md` is the readable reference.
"""

# Longer than ~400 lines on purpose: one typed section per block of the YAML `args`, each read top to bottom.

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from dreamzero.errors import ConfigError
from dreamzero.sizes import parse_bytes

MIB = 1024 * 1024
#: a tenant's name: it prefixes the tenant's session ids and labels its metrics and audit lines
TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,47}$")
TENANT_NAME_RULE = "1-48 characters of a-z, 0-9, '_' and '-', starting with a letter or digit"


def expand_path(value: str | None) -> str | None:
    """None, or the path with `~` expanded (no file is looked at: `serve_graph.config.check_files` does that)."""
    return None if value is None else str(Path(value).expanduser())


class Strict(BaseModel):
    # A typo in the YAML must fail loudly rather than be ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)


class AutoscalingArgs(Strict):
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


class CpuStageArgs(Strict):
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
    call_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Bound on one raw request's transforms (milliseconds of CPU when healthy); past it, e.g. on a "
        "dead or stuck Preprocess replica, the request gets a prompt 503 instead of waiting for "
        "http.request_timeout_s.",
    )

    @field_validator("ingress_max_bytes")
    @classmethod
    def _size(cls, v: int | str) -> int:
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
    call_timeout_s: float = Field(
        10.0, gt=0, description="Bound on one request's postprocess call; past it the request gets a prompt 503."
    )


class ReplayArgs(Strict):
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
    def _expand(cls, v: str) -> str:
        return str(expand_path(v))


class PolicyArgs(Strict):
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
    cfg_parallel: Literal[1, 2] = Field(
        1,
        description="Devices per replica for classifier-free guidance: 2 runs the conditional branch on the "
        "replica and the unconditional one on a co-located rank (one more GPU each, `num_gpus` per rank), "
        "exchanging the predictions at every step (docs/serving.md, 'CFG-parallel replicas').",
    )
    cfg_timeout_s: float = Field(
        120.0, gt=0, description="Bound of every exchange between the two ranks of a cfg_parallel: 2 replica."
    )
    placement: dict[str, str] = Field(
        default_factory=dict,
        description="Where components live and the DiT's weight precision, each `auto` (the memory planner's choice, "
        "the default) or set: text_encoder gpu | cpu | offload, image_encoder gpu | cpu, dit_weights model | fp8 "
        "(docs/model.md, 'Fitting a card'; `dreamzero-plan` prints the plan).",
    )

    @field_validator("placement")
    @classmethod
    def _known_placement(cls, v: dict[str, str]) -> dict[str, str]:
        if not v:
            return v
        from dreamzero.planner import explicit_placement  # torch: only when a placement is set

        try:
            explicit_placement(v)
        except ConfigError as exc:
            raise ValueError(str(exc).removeprefix("policy.placement").lstrip(".: ")) from None
        return v

    @model_validator(mode="after")
    def _cfg_parallel_needs_a_model(self) -> PolicyArgs:
        if self.cfg_parallel == 2 and self.replay is not None:
            raise ValueError("policy.cfg_parallel: 2 needs a model; policy.replay has no guidance branches")
        return self

    @property
    def cfg_rank_options(self) -> dict[str, Any]:
        """Ray actor options of a cfg_parallel: 2 replica's rank 1: the replica's own CPUs and GPUs."""
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}


class SessionArgs(Strict):
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
        try:
            return parse_bytes(v)
        except ConfigError as exc:
            raise ValueError(str(exc)) from exc


class BatchingArgs(Strict):
    """Dynamic batching of concurrent requests on one policy replica."""

    @field_validator("max_batch_rows")
    @classmethod
    def _rows(cls, v: int | str | None) -> int | str | None:
        if isinstance(v, int) and not isinstance(v, bool) and v < 1:
            raise ValueError(f"{v} rows: give a number >= 1, auto or null")
        return v

    enabled: bool = Field(True, description="Batch concurrent compatible requests into one forward pass.")
    max_batch_size: int = Field(16, ge=1, description="Most requests merged into one batch.")
    max_batch_rows: StrictInt | Literal["auto"] | None = Field(
        "auto",
        description="Most session rows in one model call (a request with B sessions is B rows; classifier-free "
        "guidance runs 2 model rows per session row). auto: on a GPU the largest batch of full-window sessions whose "
        "warm-up and sessions fit the measured memory (capped by sessions.max_sessions), on CPU 32; a number; null: "
        "sessions.max_sessions. A larger request gets 413. On a GPU the warm-up runs a batch of this size.",
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
    # the fleet (docs/fleet.md "Scheduling"): robots' realtime rows first, evaluation farms' batch rows after them
    traffic_classes: bool = Field(
        True,
        description="Fill each model call with realtime rows first (earliest deadline first), then batch rows; "
        "false: first come, first served whatever the class.",
    )
    batch_floor_calls: int = Field(
        4,
        ge=1,
        description="Batch is never starved: after this many consecutive model calls that took no batch row while "
        "batch rows waited, the next call takes the oldest batch request first.",
    )
    realtime_admission: bool = Field(
        True,
        description="Refuse (503 + Retry-After) a new realtime session when one model call of every admitted "
        "realtime row plus its own is predicted (from the replica's measured cost per row) to take longer than the "
        "tightest deadline_ms they state; batch rows are never refused for pace.",
    )


class HttpArgs(Strict):
    """Limits of the HTTP and WebSocket front door."""

    max_body_bytes: int = Field(64 * MIB, ge=1024, description="Largest request body; larger ones get 413.")
    ws_max_message_bytes: int = Field(64 * MIB, ge=1024, description="Largest inbound WebSocket message.")
    ws_idle_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A WebSocket that sent no valid message this long is closed (code 1000); frames answered with an "
        "error frame do not count.",
    )
    request_timeout_s: float = Field(
        300.0, gt=0, description="Bound on one request's trip through the graph; past it the client gets 503."
    )
    retry_after_s: float = Field(1.0, gt=0, description="`Retry-After` sent with 503 when no better hint exists.")
    # Connection caps (docs/serving.md, "Connections and request slots"): every open WebSocket and every body still
    # arriving holds one of the Ingress replica's `max_ongoing_requests` slots, so the door caps them per caller and
    # in all, below the slots, and the rest stay free for other tenants' calls and /health, /healthz.
    ws_max_per_tenant: int = Field(
        8, ge=1, description="Open WebSockets per tenant (per client address when no key is configured), per replica."
    )
    ws_max_total: int | None = Field(
        None,
        ge=1,
        description="Open WebSockets in all, per Ingress replica; below ingress.max_ongoing_requests so that HTTP "
        "calls and health checks always find a slot. null: half of ingress.max_ongoing_requests.",
    )
    body_reads_per_tenant: int = Field(
        8,
        ge=1,
        description="Slow HTTP request bodies (still arriving after 1 s) one tenant (or client address) may be sending "
        "at once, per replica; past it 429. Usual bodies arrive well within the second and are never counted.",
    )
    body_timeout_s: float = Field(60.0, gt=0, description="A request body must have arrived within this (408 past it).")
    body_min_bytes_per_s: int = Field(
        65536,
        ge=0,
        description="Past the first body_grace_s, a body arriving slower than this on average is refused (408); 0: "
        "no minimum rate.",
    )
    body_grace_s: float = Field(5.0, ge=0, description="How long a body may take before body_min_bytes_per_s applies.")


class ZmqCurveArgs(Strict):
    """CURVE encryption and client authentication of the ZeroMQ door (docs/zmq.md, "Encryption: CURVE").

    The server's secret key never sits in the YAML: a key file or an environment variable holds it. The door's replica
    reads it when it binds (`deployments.doors.zmq.curve_server_keys`); `serve run` reads it once before any replica
    starts (`serve_graph.config.check_files`), so a missing file fails there, naming the field.
    `dreamzero-zmq-keys DIR NAME` makes key pairs.
    """

    secret_key_file: str | None = Field(
        None,
        description="The server's secret key: the `<name>.key_secret` certificate `dreamzero-zmq-keys` (or "
        "zmq.auth.create_certificates) writes, or a file holding only the Z85 secret key (a mounted Kubernetes "
        "secret). It must exist on the node of the door's replica.",
    )
    secret_key_env: str | None = Field(
        None,
        description="Instead of a file: the name of an environment variable holding the Z85 secret key (40 "
        "characters), set where the Ray workers run.",
    )
    client_keys: list[str] = Field(
        default_factory=list,
        description="Z85 public keys of the clients let in (public keys: safe in the YAML). With `client_keys_dir`, "
        "the union; both empty: any client that knows the server's public key gets in (still encrypted, and the "
        "api_token check still applies).",
    )
    client_keys_dir: str | None = Field(
        None, description="A directory of client public certificates (`<name>.key`), read when the door starts."
    )

    @model_validator(mode="after")
    def _keys(self) -> ZmqCurveArgs:
        from dreamzero_client import zmq_keys  # a pattern check: no zmq import, no file read

        if (self.secret_key_file is None) == (self.secret_key_env is None):
            raise ValueError(
                "give the server's secret key as exactly one of secret_key_file or secret_key_env "
                "(dreamzero-zmq-keys DIR NAME makes a key pair)"
            )
        try:  # pydantic's error already says `zmq.curve`: the messages name the field below it
            for i, key in enumerate(self.client_keys):
                zmq_keys.check_key(key, f"client_keys[{i}]")
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return self


class ZmqArgs(Strict):
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
    curve: ZmqCurveArgs | None = Field(
        None, description="CURVE encryption (and an allow-list of client keys); null: plain TCP, as RLDX-1 speaks it."
    )


class VideoArgs(Strict):
    """Server-side recording of the predicted video (dreamzero.video_recorder); off while `save_dir` is null."""

    save_dir: str | None = Field(
        None,
        description="Folder of the MP4s (one folder per session, a file per segment); null: nothing is decoded or "
        "written for recording (a request can still ask for its own frames with return_video).",
    )
    every_n_chunks: int = Field(10, ge=1, description="A session's segment is written every this many chunks.")
    max_bytes: int | str = Field(
        "2GiB", description="Disk the recordings may take (a count or a size like '500MiB'); oldest deleted first."
    )
    with_input: bool = Field(
        False, description="Put the model-input canvas that followed each chunk beside its predicted frames."
    )
    fps: int = Field(15, ge=1, le=120, description="Frame rate of the MP4s.")
    idle_s: float = Field(300.0, gt=0, description="A session idle this long has its segment written.")

    @field_validator("max_bytes")
    @classmethod
    def _size(cls, v: int | str) -> int:
        try:
            n = parse_bytes(v, "video.max_bytes")
        except ConfigError as exc:
            raise ValueError(str(exc)) from exc
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"max_bytes must be a positive size, got {v!r}")
        return n


class TenantQuotaArgs(Strict):
    """What one tenant may use (docs/serving.md, "Tenants and TLS"); every field null = no limit."""

    max_sessions_per_replica: int | None = Field(
        None,
        ge=1,
        description="Live sessions the tenant may hold on one Policy replica; a request starting one more gets 429 "
        "(never an eviction of another tenant's session).",
    )
    max_sessions: int | None = Field(
        None,
        ge=1,
        description="Live sessions the tenant may hold on all Policy replicas together (replicas share their "
        "counts about once a second: a burst of new sessions on several replicas at once may pass it briefly).",
    )
    requests_per_s: float | None = Field(
        None,
        gt=0,
        description="Action requests per second (HTTP generations, WebSocket infer, ZeroMQ get_action), a token "
        "bucket per front-door replica.",
    )
    burst: int | None = Field(
        None, ge=1, description="Requests the bucket holds (a burst after a quiet spell); null: requests_per_s, min 1."
    )
    max_rows_per_request: int | None = Field(
        None, ge=1, description="Most sessions (rows) one request of the tenant may carry."
    )
    traffic_class: Literal["realtime", "batch"] | None = Field(
        None,
        description="The class the tenant's rows are served as when a request does not say (docs/fleet.md): "
        "`realtime` (robots) or `batch` (evaluation farms); null: realtime for a one-row request, batch for more.",
    )


class TenantsArgs(Strict):
    """Quotas of the tenants the API keys name (`api_keys`); the legacy single `api_key` is the tenant `default`."""

    quota: TenantQuotaArgs = Field(
        default_factory=TenantQuotaArgs, description="Quota of every tenant, unless `per_tenant` says otherwise."
    )
    per_tenant: dict[str, TenantQuotaArgs] = Field(
        default_factory=dict,
        description="Per tenant name: the fields it sets replace those of `quota` for that tenant.",
    )

    @field_validator("per_tenant")
    @classmethod
    def _names(cls, v: dict[str, TenantQuotaArgs]) -> dict[str, TenantQuotaArgs]:
        for name in v:
            if not TENANT_NAME.match(name):
                raise ValueError(f"tenant name {name!r}: use {TENANT_NAME_RULE}")
        return v

    def for_tenant(self, tenant: str) -> TenantQuotaArgs:
        own = self.per_tenant.get(tenant)
        if own is None:
            return self.quota
        return self.quota.model_copy(update=own.model_dump(exclude_unset=True))
