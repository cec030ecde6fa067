"""`build_app(args)`: the composition root, the only place where plain classes become Ray Serve deployments.

`serve run serve_config.yaml` imports `serve_graph.builder:build_app` and passes the YAML `args`; they are validated
first (`serve_graph.config.parse_app_args`: the values, then the files they name), so a bad value fails at start with
a message that says how to fix it. Then each deployment is bound with its own typed settings (`deployments.config`).
Nothing imports this module: it sits above everything it composes (the import rule: docs/architecture.md, "Import
direction").

    Ingress ──(raw obs)──> Preprocess ──(ModelBatch)──> Policy (sticky, N replicas) ──> Postprocess ──> reply
          └────────────── normalised form skips pre/post ───────────────┘
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from ray import serve
from ray.serve import Application

from deployments.config.app import CheckpointArgs
from deployments.config.sections import CpuStageArgs, PolicyArgs
from deployments.config.settings import (
    AuthSettings,
    EmbodimentSettings,
    GraphSettings,
    IngressSettings,
    PolicySettings,
    StageSettings,
    ZmqDoorSettings,
)
from deployments.doors.zmq import ZmqIngressDeployment
from deployments.ingress import IngressDeployment
from deployments.policy import PolicyDeployment
from deployments.postprocess import PostprocessDeployment
from deployments.preprocess import PreprocessDeployment
from dreamzero.device import SIMULATED_GPU_ENV, parse_dtype
from dreamzero.device_checks import check_serving_device, device_facts
from dreamzero.planner import check_fits, plan_serving
from serve_graph.config import AppArgs, parse_app_args
from serve_graph.model_source import ResolvedModel, model_config, resolve_model
from serve_graph.session_router import session_router_config

log = logging.getLogger("dreamzero.serve.builder")

#: Ray Serve settings for every replica of the graph (the per-replica half of RAY_SERVE_THROUGHPUT_OPTIMIZED): user code
#: runs on the replica's own event loop and handle calls route on the caller's loop, instead of hopping between threads
#: and loops on each request. Our code never blocks those loops for long (the model runs on its own thread); what it
#: saves: docs/benchmarks.md, "Serving path settings". The proxy's half is set by starting `serve run` with
#: RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0 (docs/serving.md).
#: The ingress reaches the other deployments over Serve's gRPC transport (deployments/calls.py), whose messages are
#: capped at 4 MB by default on both ends: a few DROID frames exceed that. The HTTP body limit bounds them instead.
REPLICA_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2**31 - 1),
}

#: deployment names (stable: tests, metrics dashboards and `deployments:` overrides in YAML refer to them)
INGRESS, PREPROCESS, POLICY, POSTPROCESS = "Ingress", "Preprocess", "Policy", "Postprocess"
ZMQ_DOOR = "ZmqIngress"


def replica_env() -> dict[str, str]:
    """REPLICA_ENV, plus the simulated GPU of a rehearsal ($DREAMZERO_SIMULATED_GPU) when this process has one, so
    every replica sees the same device as the checks that ran here."""
    env = dict(REPLICA_ENV)
    if os.environ.get(SIMULATED_GPU_ENV):
        env[SIMULATED_GPU_ENV] = os.environ[SIMULATED_GPU_ENV]
    return env


def _cpu_options(name: str, stage: CpuStageArgs) -> dict[str, Any]:
    return {
        "name": name,
        "num_replicas": stage.num_replicas,
        "max_ongoing_requests": stage.max_ongoing_requests,
        "ray_actor_options": {
            "num_cpus": stage.num_cpus,
            "resources": dict(stage.resources),
            "runtime_env": {"env_vars": replica_env()},
        },
    }


def policy_options(cfg: AppArgs) -> dict[str, Any]:
    """Deployment options of the policy: GPUs per replica, sticky router, fixed or autoscaled replica count."""
    p = cfg.policy
    opts: dict[str, Any] = {
        "name": POLICY,
        "max_ongoing_requests": p.max_ongoing_requests,
        "max_queued_requests": p.max_queued_requests,
        "ray_actor_options": {
            "num_cpus": p.num_cpus,
            "num_gpus": p.num_gpus,
            "resources": dict(p.resources),
            "runtime_env": {"env_vars": replica_env()},
        },
        "request_router_config": session_router_config(),  # sessions stay on the replica holding them
        # a replica busy with long 14B chunks must not be declared dead (the model runs off the event loop anyway)
        "health_check_timeout_s": 120.0,
        "graceful_shutdown_timeout_s": 30.0,
    }
    if p.cfg_parallel == 2 and p.num_gpus > 0:
        # the replica (rank 0) and its rank 1 on one node, one bundle each (the rank 1 actor the replica creates
        # lands in the replica's placement group)
        rank = {k: v for k, v in (("CPU", p.num_cpus), ("GPU", p.num_gpus)) if v > 0}
        opts["placement_group_bundles"] = [{**rank, **p.resources}, dict(rank)]
        opts["placement_group_strategy"] = "STRICT_PACK"
    if p.autoscaling is not None:
        opts["autoscaling_config"] = p.autoscaling.to_ray()
    else:
        opts["num_replicas"] = p.num_replicas
    return opts


def embodiment_settings(model: ResolvedModel) -> EmbodimentSettings:
    return EmbodimentSettings(tag=model.embodiment, metadata=model.metadata)


def graph_settings(cfg: AppArgs, model: ResolvedModel, request_timeout_s: float) -> GraphSettings:
    return GraphSettings(
        embodiment=embodiment_settings(model),
        preprocess=cfg.preprocess,
        postprocess=cfg.postprocess,
        request_timeout_s=request_timeout_s,
        max_rows=cfg.sessions.max_sessions,
        tenants=cfg.tenants,
    )


def ingress_settings(cfg: AppArgs, model: ResolvedModel) -> IngressSettings:
    """The HTTP / WebSocket doors' settings. The keys are resolved here (their process may not see the env var named
    by api_key_env) and travel as digests; no path travels but api_keys_file: the statistics are data."""
    return IngressSettings(
        graph=graph_settings(cfg, model, cfg.http.request_timeout_s),
        http=cfg.http,
        model_name=cfg.model_name,
        auth=auth_settings(cfg),
    )


def auth_settings(cfg: AppArgs) -> AuthSettings:
    """The keys every front door accepts, as digests (deployments.tenants)."""
    return AuthSettings(
        api_key_digest=cfg.api_key_digest,
        api_keys=cfg.key_digests,
        api_keys_file=cfg.api_keys_file,
        reload_s=cfg.api_keys_reload_s,
    )


def zmq_door_settings(cfg: AppArgs, model: ResolvedModel) -> ZmqDoorSettings:
    return ZmqDoorSettings(
        graph=graph_settings(cfg, model, cfg.zmq.request_timeout_s), zmq=cfg.zmq, auth=auth_settings(cfg)
    )


def policy_settings(cfg: AppArgs, model: ResolvedModel) -> PolicySettings:
    """The Policy's settings: the checkpoint fields of `args` and the `policy:` section taken by field name (the
    settings model declares them by inheriting both), the sections it applies whole, and what `resolve_model` found."""
    given = {name: getattr(cfg, name) for name in CheckpointArgs.model_fields}
    given |= {name: getattr(cfg.policy, name) for name in PolicyArgs.model_fields}
    given |= {  # resolved once here from the checkpoint's files
        "checkpoint_layout": model.layout,
        "checkpoint_config": model.checkpoint_config,
        "tokenizer_path": model.tokenizer_path or cfg.tokenizer_path,
        "device": cfg.resolved_device,
    }
    return PolicySettings(
        **given,
        sessions=cfg.sessions,
        batching=cfg.batching,
        video=cfg.video,
        embodiment=embodiment_settings(model),
        retry_after_s=cfg.http.retry_after_s,
    )


def _cluster_has_gpus() -> bool:
    try:
        import ray

        return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
    except Exception:  # noqa: BLE001 - no cluster to ask (local testing mode, a plain import)
        return False


def check_gpu_fit(cfg: AppArgs) -> None:
    """A GPU configuration that cannot work fails here, before any replica loads, saying what to change: no CUDA, no
    bf16, or a memory plan (dreamzero.planner: placement, precision, rows, sessions) that finds no way to fit the
    checkpoint with `batching.max_batch_rows`, `sessions.max_bytes` and `policy.placement` as set. Where this
    process sees no GPU but the cluster has some (the build runs on KubeRay's GPU-less head), each replica's own plan
    and memory sizing check instead (dreamzero.planner, dreamzero.pipeline.budget)."""
    if cfg.policy.num_gpus <= 0 and not cfg.resolved_device.startswith("cuda"):
        return
    facts = device_facts()
    if not facts.cuda and _cluster_has_gpus():
        log.info("this process sees no GPU but the Ray cluster has some: the Policy replicas check their own fit")
        return
    check_serving_device(cfg.policy.num_gpus, cfg.resolved_device, cfg.dtype, facts=facts)
    model_cfg = model_config(cfg)
    if model_cfg is None:  # a replay loads no weights
        return
    dtype = parse_dtype(cfg.dtype) if cfg.dtype else torch.bfloat16
    rows, field = cfg.batching.max_batch_rows, None
    if rows is None:  # null: a batch as large as the session store
        rows = cfg.sessions.max_sessions
        field = f"batching.max_batch_rows=null (sessions.max_sessions={rows})"
    plan = plan_serving(
        model_cfg, facts.total_bytes, dtype=dtype, cfg_parallel=cfg.policy.cfg_parallel,
        max_sessions=cfg.sessions.max_sessions, rows=rows, max_bytes=cfg.sessions.max_bytes,
        placement=dict(cfg.policy.placement), name=cfg.model_path or getattr(model_cfg, "name", None),
    )  # fmt: skip
    check_fits(plan, rows, cfg.sessions.max_bytes, dict(cfg.policy.placement), field)
    log.info("memory plan: %s", plan.summary())


def replica_counts_in_args(cfg: AppArgs) -> list[str]:
    """The replica counts / autoscaling set under `args`: they still work, but Serve hashes `args` into the code
    version, so changing one replaces every replica of every deployment (each live session restarts)."""
    stages = (("ingress", cfg.ingress), ("preprocess", cfg.preprocess), ("postprocess", cfg.postprocess))
    found = [f"{name}.num_replicas" for name, stage in stages if "num_replicas" in stage.model_fields_set]
    found += [f"policy.{k}" for k in ("num_replicas", "autoscaling") if k in cfg.policy.model_fields_set]
    return found


def warn_replica_counts_in_args(cfg: AppArgs) -> None:
    found = replica_counts_in_args(cfg)
    if found:
        log.warning(
            "args %s: set replica counts in the Serve config's `deployments:` section instead (e.g. `deployments: "
            "[{name: Policy, num_replicas: 3}]`, autoscaling as `autoscaling_config`), which `serve deploy` applies "
            "in place; a change under args replaces every replica and restarts every live session "
            "(docs/serving.md, 'Changing a running server')",
            ", ".join(found),
        )


def build_app(args: dict[str, Any] | AppArgs | None = None) -> Application:
    """Validate `args` and bind the graph; raises ConfigError naming the bad field."""
    cfg = parse_app_args(args)
    warn_replica_counts_in_args(cfg)
    check_gpu_fit(cfg)
    # Read once here, at start (a bad file fails now, not on the first request); the CPU stages get data, not paths.
    model = resolve_model(cfg)
    stage = StageSettings(embodiment=embodiment_settings(model))

    preprocess = serve.deployment(PreprocessDeployment, **_cpu_options(PREPROCESS, cfg.preprocess)).bind(stage)
    postprocess = serve.deployment(PostprocessDeployment, **_cpu_options(POSTPROCESS, cfg.postprocess)).bind(stage)
    policy = serve.deployment(PolicyDeployment, **policy_options(cfg)).bind(policy_settings(cfg, model))
    doors = {}
    if cfg.zmq is not None:  # the ZeroMQ door, one replica: it binds a fixed port
        door_stage = CpuStageArgs(num_replicas=1, num_cpus=cfg.zmq.num_cpus, resources=cfg.ingress.resources)
        door_options = _cpu_options(ZMQ_DOOR, door_stage)
        door_options["max_ongoing_requests"] = 1  # it serves no Serve requests, only health checks
        doors["zmq"] = serve.deployment(ZmqIngressDeployment, **door_options).bind(
            preprocess, policy, postprocess, zmq_door_settings(cfg, model)
        )
    ingress_cls = serve.ingress()(IngressDeployment)  # the ASGI app is built per replica by the class itself
    return serve.deployment(ingress_cls, **_cpu_options(INGRESS, cfg.ingress)).bind(
        preprocess, policy, postprocess, ingress_settings(cfg, model), doors=doors
    )
