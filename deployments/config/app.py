"""The whole `args:` of `serve_config.yaml` (`AppArgs`), and the checkpoint fields at its top (`CheckpointArgs`).

`AppArgs` composes the sections (`deployments.config.sections`) and checks what spans them. Its validators look at
values only; the files the args name (checkpoint, tokenizer, statistics, key files, a replay's dataset) are checked
once by `serve_graph.config.check_files` before any replica starts. `validate_args` gives a `ConfigError` whose message
names every bad field (`args.<field>: <what to do>`).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from deployments.config.sections import (
    BatchingArgs,
    CpuStageArgs,
    HttpArgs,
    PolicyArgs,
    PostprocessArgs,
    PreprocessArgs,
    SessionArgs,
    Strict,
    TenantsArgs,
    VideoArgs,
    ZmqArgs,
    expand_path,
)
from dreamzero.config import PipelineConfig
from dreamzero.errors import ConfigError

# deployments.tenants (key digests, the tenant `default`) is imported where it is used: it reads its quota types from
# this package, which imports this module first.

log = logging.getLogger("dreamzero.serve.config")


def resolve_device(device: str | None, num_gpus: float) -> str:
    """The torch device of a Policy replica: as given, else cuda when it has GPUs, else cpu."""
    return device or ("cuda" if num_gpus > 0 else "cpu")


class CheckpointArgs(Strict):
    """The top-level args that say which model a Policy replica loads and how; the Policy is bound with them as
    validated (`PolicySettings.checkpoint`), with the layout, preset, tokenizer and device `build_app` resolved."""

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

    @field_validator("model_path")
    @classmethod
    def _model_path(cls, v: str | None) -> str | None:
        from dreamzero.embedded_default import resolve_model_path

        try:
            v = resolve_model_path(v)  # "embedded:<name>": a trained model shipped in the package
        except ConfigError as exc:
            raise ValueError(str(exc).removeprefix("model_path: ")) from None
        return expand_path(v)

    @field_validator("checkpoint_config")
    @classmethod
    def _known_preset(cls, v: str | None) -> str | None:
        from dreamzero.config import PRESETS

        if v is not None and v not in PRESETS:
            raise ValueError(f"{v!r} is no preset; use one of {sorted(PRESETS)} or null")
        return v

    @field_validator("tokenizer_path")
    @classmethod
    def _tokenizer_path(cls, v: str | None) -> str | None:
        return expand_path(v)

    @field_validator("pipeline")
    @classmethod
    def _known_pipeline_knobs(cls, v: dict[str, Any]) -> dict[str, Any]:
        try:  # names and values, at start rather than in the replica (one check: dreamzero.config)
            PipelineConfig().with_overrides(v)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return v


class AppArgs(CheckpointArgs):
    """Everything `build_app` needs. Only `model_path` changes between the CPU default and a GPU deployment."""

    model_name: str = Field("dreamzero", min_length=1, description="Name reported by /v1/models and echoed back.")
    embodiment: str | None = Field(
        None,
        min_length=1,
        description="Embodiment tag of the raw form, the WebSocket and the ZeroMQ door (oxe_droid, libero_sim, "
        "franka_pnp); null: the checkpoint's own (its config's embodiment_tag; oxe_droid for the embedded models).",
    )
    metadata_path: str | None = Field(
        None,
        description="metadata.json with normalisation statistics; default: the checkpoint's "
        "experiment_cfg/metadata.json, else the embodiment's bundled synthetic statistics.",
    )
    api_key: str | None = Field(
        None,
        description="Required key (`Authorization: Bearer <key>` or `Api-Key <key>`): its digest 'sha256:<hex of the "
        "key>' (a key in clear is hashed as it is read, but Serve logs and Ray's dashboard show a YAML's args as "
        "given: use the digest or api_key_env there); null disables auth.",
        repr=False,
    )
    api_key_env: str | None = Field(
        None, description="Name of an environment variable holding the API key (wins over `api_key`)."
    )
    api_keys: dict[str, Any] | None = Field(
        None,
        description="Keys that name tenants: tenant -> 'sha256:<hex of the key>' (a list of digests while a key is "
        "rotated). Each tenant's sessions are its own (docs/serving.md, 'Tenants and TLS'); `api_key` beside it is "
        "the tenant `default`.",
    )
    api_keys_file: str | None = Field(
        None,
        description="A YAML or JSON file holding the `api_keys` mapping, read again by the front doors when it "
        "changes (rotation without a restart); instead of `api_keys`.",
    )
    api_keys_reload_s: float = Field(
        5.0, gt=0, description="How often the front doors look at api_keys_file's modification time."
    )
    tenants: TenantsArgs = Field(
        default_factory=TenantsArgs, description="Per-tenant quotas: sessions, requests per second, rows."
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
    video: VideoArgs = Field(
        default_factory=VideoArgs, description="Server-side MP4s of each session's predicted video; off by default."
    )

    @field_validator("api_key")
    @classmethod
    def _hash_legacy_key(cls, v: str | None) -> str | None:
        """Keep only the digest: the parsed args (and whatever logs or pickles them) never hold the key in clear."""
        from deployments.tenants import DEFAULT_TENANT, DIGEST_PREFIX, key_digest, parse_key_table

        if not v:
            return None
        if v.startswith(DIGEST_PREFIX):
            try:
                return parse_key_table({DEFAULT_TENANT: v}, "api_key")[DEFAULT_TENANT][0]
            except ConfigError as exc:
                raise ValueError(str(exc).removeprefix("api_key.default: ")) from None
        log.warning(
            "args.api_key is given in clear: it is hashed now, but Serve logs a serve_config.yaml's args as given and "
            "Ray's dashboard shows them; give its digest 'sha256:<hex>' or api_key_env instead"
        )
        return key_digest(v)

    @field_validator("metadata_path", "api_keys_file")
    @classmethod
    def _paths(cls, v: str | None) -> str | None:
        return expand_path(v)

    @field_validator("api_keys")
    @classmethod
    def _key_table(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        from deployments.tenants import parse_key_table

        try:
            parse_key_table(v, "api_keys")
        except ConfigError as exc:  # the message as `args.api_keys: <entry>: <what to do>`
            raise ValueError(str(exc).removeprefix("api_keys: ").removeprefix("api_keys.")) from None
        return v

    @model_validator(mode="after")
    def _one_source_of_keys(self) -> AppArgs:
        from deployments.tenants import DEFAULT_TENANT

        if self.api_keys is not None and self.api_keys_file is not None:
            raise ValueError("give api_keys or api_keys_file, not both (the file is the one that can be rotated)")
        legacy = self.api_key_env is not None or bool(self.api_key)
        if legacy and DEFAULT_TENANT in (self.api_keys or {}):
            raise ValueError(
                f"api_key is the key of the tenant {DEFAULT_TENANT!r}, which api_keys names too; drop one of them"
            )
        return self

    @model_validator(mode="after")
    def _connections_leave_slots(self) -> AppArgs:
        """WebSockets and arriving bodies hold Ingress slots: no cap may reach the slots a replica has, and the
        WebSockets' total (null: half the slots) is settled here so the door reads a number."""
        slots, h = self.ingress.max_ongoing_requests, self.http
        given = set(h.model_fields_set)
        # caps left at their defaults follow a smaller Ingress (half its slots, at least 1); set ones are checked
        fitted = {
            name: max(1, min(getattr(h, name), slots // 2))
            for name in ("ws_max_per_tenant", "body_reads_per_tenant")
            if name not in h.model_fields_set and getattr(h, name) >= slots
        }
        if fitted:
            h = h.model_copy(update=fitted)
            self = self.model_copy(update={"http": h})
        for name in ("ws_max_per_tenant", "body_reads_per_tenant", "ws_max_total"):
            value = getattr(h, name)
            if value is not None and value >= slots and name in given:
                raise ValueError(
                    f"http.{name} is {value} but ingress.max_ongoing_requests is {slots}: one caller could take every "
                    "slot of the Ingress; lower it or raise ingress.max_ongoing_requests"
                )
        if h.ws_max_total is None:
            return self.model_copy(update={"http": h.model_copy(update={"ws_max_total": max(1, slots // 2)})})
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
        return resolve_device(self.device, self.policy.num_gpus)

    @property
    def resolved_layout(self) -> str | None:
        """The checkpoint layout: as given, else detected from model_path's files; None for the embedded default."""
        if self.model_path is None:
            return None
        from dreamzero.checkpoint import detect_layout

        return self.checkpoint_layout or detect_layout(self.model_path)

    @property
    def key_digests(self) -> dict[str, tuple[str, ...]]:
        """`api_keys` as tenant -> key digests."""
        from deployments.tenants import parse_key_table

        return parse_key_table(self.api_keys, "api_keys")

    @property
    def api_key_digest(self) -> str | None:
        """The legacy `api_key`'s digest (the tenant `default`): `api_key_env`'s key hashed here, else `api_key` (held
        as its digest since validation); no front door gets a key in clear."""
        from deployments.tenants import key_digest

        if self.api_key_env:
            return key_digest(os.environ[self.api_key_env])
        return self.api_key


def format_problems(problems: list[tuple[str, str]]) -> str:
    """(field path, message) pairs as one message: a line `args.<field>: <what to do>` each, under one heading."""
    return "invalid serve_config.yaml args:\n" + "\n".join(f"  args.{where}: {msg}" for where, msg in problems)


def error_lines(err: ValidationError) -> list[tuple[str, str]]:
    """(field path, message) of every problem pydantic found."""
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "args"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field; check the spelling against docs/serving.md"
        lines.append((where, msg))
    return lines


def validate_args(args: dict[str, Any] | AppArgs | None) -> AppArgs:
    """`args` (a dict from YAML, or an AppArgs) as AppArgs; ConfigError listing every problem. Reads no file."""
    if isinstance(args, AppArgs):
        return args
    try:
        return AppArgs.model_validate(args or {})
    except ValidationError as err:
        raise ConfigError(format_problems(error_lines(err))) from None
