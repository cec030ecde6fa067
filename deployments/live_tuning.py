"""The Policy knobs a running replica can change: Serve's `user_config`, applied by `PolicyDeployment.reconfigure`.

Serve hashes an application's `args` into its code version, so any change there replaces every replica (every live
session restarts). The `deployments:` section of the Serve config is applied in place: `num_replicas` /
`autoscaling_config` scale without touching the other replicas, and a changed `user_config` reaches each running
replica's `reconfigure` (and every new one at start). These knobs go there:

    deployments:
      - name: Policy
        user_config:
          sessions: {ttl_s: 1800, max_sessions: 64}
          batching: {max_batch_size: 8, batch_wait_timeout_s: 0.01, rows_per_request: 4, traffic_classes: true}
          pipeline: {num_inference_steps: 8}

A `user_config` is the whole live state: what it leaves out takes the value from `args` again. What the replica sized
or loaded at start (model path, device, dtype, embodiment, `batching.max_batch_rows`, `sessions.max_bytes`,
`cfg_scale`, ...) is not here: it needs new replicas (an `args` change). Docs: docs/serving.md, "Changing a running
server".
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError

from deployments.config.sections import Strict
from dreamzero.errors import ConfigError

#: the inference-loop fields read afresh at every model call (the rest shape session state or were sized at start)
LIVE_PIPELINE_FIELDS = (
    "num_inference_steps", "sigma_shift", "dit_step_mask", "dynamic_skip", "dynamic_skip_warmup",
    "dynamic_skip_thresholds",
)  # fmt: skip
#: fields an operator may try here that need new replicas, with where they go instead
NEEDS_NEW_REPLICAS = {
    "sessions.max_bytes": "the replica sized its session memory at start",
    "batching.max_batch_rows": "the replica sized its batches (and warmed up) at start",
    "batching.enabled": "the replica chose batching at start",
}


class LiveSessions(Strict):
    ttl_s: float | None = Field(None, gt=0, description="Idle seconds after which a session is evicted.")
    max_sessions: int | None = Field(
        None, ge=1, description="Sessions the replica keeps (at most the start value: memory was sized for it)."
    )


class LiveBatching(Strict):
    max_batch_size: int | None = Field(None, ge=1, description="Most requests merged into one batch.")
    batch_wait_timeout_s: float | None = Field(None, ge=0, le=1.0, description="How long a free model waits.")
    rows_per_request: int | None = Field(None, ge=1, description="Most sessions one request may carry.")
    traffic_classes: bool | None = Field(None, description="Realtime rows first; false: first come, first served.")
    batch_floor_calls: int | None = Field(None, ge=1, description="Calls without batch rows before batch goes first.")
    realtime_admission: bool | None = Field(None, description="Refuse new realtime sessions past the pace.")


class LiveTuning(Strict):
    """A Policy `user_config`: each field null/absent = the `args` value."""

    sessions: LiveSessions = Field(default_factory=LiveSessions)
    batching: LiveBatching = Field(default_factory=LiveBatching)
    pipeline: dict[str, Any] = Field(default_factory=dict, description=f"Any of {list(LIVE_PIPELINE_FIELDS)}.")


def parse_live_tuning(config: dict[str, Any] | None) -> LiveTuning:
    """Validate a `user_config`; ConfigError names each bad field (and, for a start-time knob, why and where)."""
    config = dict(config or {})
    problems = []
    for dotted, why in NEEDS_NEW_REPLICAS.items():
        section, key = dotted.split(".")
        if isinstance(config.get(section), dict) and key in config[section]:
            problems.append(f"  user_config.{dotted}: not live ({why}); change it in the application's args")
    for key in config.get("pipeline") or {}:
        if key not in LIVE_PIPELINE_FIELDS:
            problems.append(
                f"  user_config.pipeline.{key}: not live (only {list(LIVE_PIPELINE_FIELDS)}); "
                "change it in args.pipeline"
            )
    if not problems:
        try:
            return LiveTuning.model_validate(config)
        except ValidationError as err:
            for e in err.errors():
                where = ".".join(str(p) for p in e["loc"])
                msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
                problems.append(f"  user_config.{where}: {msg}")
    raise ConfigError(
        "invalid Policy user_config (docs/serving.md, 'Changing a running server'):\n" + "\n".join(problems)
    )


def apply_live_tuning(replica: Any, tuning: LiveTuning) -> dict[str, Any]:
    """Set the knobs on a PolicyDeployment's parts (`replica`: its engine's store and loop config, its batcher, its
    admission), each from `tuning` or else from its start settings; returns what is in effect. Checks everything
    before changing anything, so a refused config leaves the replica as it was."""
    start = replica.settings
    sessions = start.sessions.model_copy(update=tuning.sessions.model_dump(exclude_none=True))
    batching = start.batching.model_copy(update=tuning.batching.model_dump(exclude_none=True))
    if sessions.max_sessions > start.sessions.max_sessions:
        raise ConfigError(
            f"user_config.sessions.max_sessions: {sessions.max_sessions} is above the start value "
            f"{start.sessions.max_sessions} this replica's memory was sized for; raise it in args (new replicas)"
        )
    engine = replica.engine
    pipeline_cfg = None
    if hasattr(engine.pipeline, "config") and start.replay is None:
        base = replica.start_loop  # the loop knobs of `args`: a user_config's `pipeline` applies over them
        if tuning.pipeline and engine.cfg_parallel == 2:
            raise ConfigError("user_config.pipeline: not live with policy.cfg_parallel: 2 (both ranks run the loop)")
        try:
            pipeline_cfg = type(base).model_validate({**base.model_dump(), **tuning.pipeline})
        except ValidationError as err:
            raise ConfigError(f"user_config.pipeline: {err.errors()[0]['msg']}") from None
    store = engine.store
    store.ttl_s, store.max_sessions = sessions.ttl_s, sessions.max_sessions
    replica.batcher.max_batch_size, replica.batcher.wait_s = batching.max_batch_size, batching.batch_wait_timeout_s
    replica.admission.rows_per_request = batching.rows_per_request
    replica.batcher.classes, replica.batcher.floor_calls = batching.traffic_classes, batching.batch_floor_calls
    replica.admission.pace.enabled = batching.realtime_admission
    if pipeline_cfg is not None:
        engine.pipeline.config = pipeline_cfg  # read afresh by the next model call (denoise_block)
    return {
        "sessions": {"ttl_s": store.ttl_s, "max_sessions": store.max_sessions},
        "batching": {
            "max_batch_size": batching.max_batch_size,
            "batch_wait_timeout_s": batching.batch_wait_timeout_s,
            "rows_per_request": batching.rows_per_request,
            "traffic_classes": batching.traffic_classes,
            "batch_floor_calls": batching.batch_floor_calls,
            "realtime_admission": batching.realtime_admission,
        },
        "pipeline": {k: getattr(pipeline_cfg, k) for k in LIVE_PIPELINE_FIELDS} if pipeline_cfg is not None else {},
    }
