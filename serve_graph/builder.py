"""`build_app(args)`: the only place where plain classes become Ray Serve deployments, and the only module of
`serve_graph` that imports `deployments` (the import rule: docs/architecture.md, "Import direction").

`serve run serve_config.yaml` imports `serve_graph.builder:build_app` and passes the YAML `args`; they are validated
first (`serve_graph.config`), so a bad value fails at start with a message that says how to fix it.

    Ingress ──(raw obs)──> Preprocess ──(ModelBatch)──> Policy (sticky, N replicas) ──> Postprocess ──> reply
          └────────────── normalised form skips pre/post ───────────────┘
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from deployments.ingress import IngressDeployment
from deployments.policy import PolicyDeployment
from deployments.postprocess import PostprocessDeployment
from deployments.preprocess import PreprocessDeployment
from serve_graph.config import AppArgs, CpuStageArgs, parse_app_args
from serve_graph.model_source import resolve_model
from serve_graph.routing import session_router_config

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


def _cpu_options(name: str, stage: CpuStageArgs) -> dict[str, Any]:
    return {
        "name": name,
        "num_replicas": stage.num_replicas,
        "max_ongoing_requests": stage.max_ongoing_requests,
        "ray_actor_options": {
            "num_cpus": stage.num_cpus,
            "resources": dict(stage.resources),
            "runtime_env": {"env_vars": dict(REPLICA_ENV)},
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
            "runtime_env": {"env_vars": dict(REPLICA_ENV)},
        },
        "request_router_config": session_router_config(),  # sessions stay on the replica holding them
        # a replica busy with long 14B chunks must not be declared dead (the model runs off the event loop anyway)
        "health_check_timeout_s": 120.0,
        "graceful_shutdown_timeout_s": 30.0,
    }
    if p.autoscaling is not None:
        opts["autoscaling_config"] = p.autoscaling.to_ray()
    else:
        opts["num_replicas"] = p.num_replicas
    return opts


def build_app(args: dict[str, Any] | AppArgs | None = None) -> Application:
    """Validate `args` and bind the graph; raises ConfigError naming the bad field."""
    cfg = parse_app_args(args)
    from dreamzero.device import check_serving_device  # no CUDA, no bf16, weights larger than the GPU: fail here

    # the weights-size check reads safetensors headers of the hf layout; other layouts are loaded unchecked
    sized = cfg.model_path if cfg.resolved_layout == "hf" else None
    check_serving_device(cfg.policy.num_gpus, cfg.resolved_device, cfg.dtype, sized)
    # Read once here, at start (a bad file fails now, not on the first request); the CPU stages get data, not paths.
    model = resolve_model(cfg)

    preprocess = serve.deployment(PreprocessDeployment, **_cpu_options(PREPROCESS, cfg.preprocess)).bind(
        model.embodiment, model.metadata
    )
    postprocess = serve.deployment(PostprocessDeployment, **_cpu_options(POSTPROCESS, cfg.postprocess)).bind(
        model.embodiment, model.metadata
    )
    policy = serve.deployment(PolicyDeployment, **policy_options(cfg)).bind(
        model_path=cfg.model_path,
        checkpoint_layout=model.layout,
        checkpoint_config=model.checkpoint_config,
        tokenizer_path=model.tokenizer_path or cfg.tokenizer_path,
        device=cfg.resolved_device,
        dtype=cfg.dtype,
        pipeline_overrides=dict(cfg.pipeline),
        max_sessions=cfg.sessions.max_sessions,
        session_ttl_s=cfg.sessions.ttl_s,
        batching=cfg.batching.enabled,
        max_batch_size=cfg.batching.max_batch_size,
        batch_wait_timeout_s=cfg.batching.batch_wait_timeout_s,
        return_latents=cfg.return_latents,
        torch_threads=cfg.policy.torch_threads,
        rows_per_thread=cfg.policy.rows_per_thread,
        replay=None if cfg.policy.replay is None else cfg.policy.replay.model_dump(),
        embodiment=model.embodiment,
        metadata=model.metadata,
        session_max_bytes=cfg.sessions.max_bytes,
        max_batch_rows=cfg.batching.max_batch_rows,
        rows_per_request=cfg.batching.rows_per_request,
        retry_after_s=cfg.http.retry_after_s,
    )
    ingress_args = front_door_args(cfg)
    if cfg.zmq is not None:
        return _bind_with_zmq_door(cfg, preprocess, policy, postprocess, ingress_args, model.metadata)
    ingress_cls = serve.ingress()(IngressDeployment)  # the ASGI app is built per replica by the class itself
    return serve.deployment(ingress_cls, **_cpu_options(INGRESS, cfg.ingress)).bind(
        preprocess, policy, postprocess, ingress_args, model.metadata
    )


def front_door_args(cfg: AppArgs) -> dict[str, Any]:
    """The args the ingress and the ZMQ door validate again in their replicas. The key is resolved here (their process
    may not see the env var named by api_key_env); the paths only the policy opens are dropped: they may not exist
    on the front door's node, and the statistics travel as data."""
    only_policy = {"model_path", "tokenizer_path", "metadata_path", "checkpoint_layout", "checkpoint_config"}
    update: dict[str, Any] = dict.fromkeys(only_policy)
    update.update(api_key=cfg.resolved_api_key, api_key_env=None, policy=cfg.policy.model_copy(update={"replay": None}))
    return cfg.model_copy(update=update).model_dump()


def _bind_with_zmq_door(cfg: AppArgs, preprocess, policy, postprocess, ingress_args: dict, metadata) -> Application:
    """The graph plus the ZeroMQ front door (deployments/zmq_ingress.py), one replica: it binds a fixed port."""
    from deployments.zmq_ingress import IngressWithZmqDoor, ZmqIngressDeployment

    door_stage = CpuStageArgs(num_replicas=1, num_cpus=cfg.zmq.num_cpus, resources=cfg.ingress.resources)
    door_options = _cpu_options(ZMQ_DOOR, door_stage)
    door_options["max_ongoing_requests"] = 1  # it serves no Serve requests, only health checks
    door = serve.deployment(ZmqIngressDeployment, **door_options).bind(
        preprocess, policy, postprocess, ingress_args, metadata
    )
    ingress_cls = serve.ingress()(IngressWithZmqDoor)
    return serve.deployment(ingress_cls, **_cpu_options(INGRESS, cfg.ingress)).bind(
        preprocess, policy, postprocess, ingress_args, metadata, zmq_door=door
    )
