"""Ingress deployment: the front door. Decodes and validates requests, picks the routing key and drives Preprocess ->
Policy -> Postprocess; it never loads the model.

The HTTP routes, the API-key dependency and the exception handlers live in `deployments.http_app`, the OpenPI
WebSocket adapter in `deployments.openpi_ws`; this class holds what both drive: the graph and the replies' content.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import FastAPI, Request

from deployments.calls import Transport, arrays_bytes, bounded, over_grpc
from deployments.http_app import build_fastapi_app
from deployments.openpi_ws import OpenPISocketServer
from deployments.preprocess import load_embodiment, openpi_key_map
from deployments.stages import RawStages
from dreamzero.errors import NotReady, PayloadTooLarge
from dreamzero.types import ModelBatch
from dreamzero_client.wire import codec, generations, openpi, replies, routes
from serve_graph.config import parse_app_args
from serve_graph.metrics import serving_metrics
from serve_graph.routing import policy_generate, sticky_call

log = logging.getLogger("dreamzero.serve.ingress")

#: bounds on the ingress's own calls (requests through the graph use `http.request_timeout_s`)
HEALTH_TIMEOUT_S, INFO_TIMEOUT_S, DROP_TIMEOUT_S = 5.0, 30.0, 10.0


@dataclass
class GraphReply:
    actions: np.ndarray  # [B, H, D]: normalised + padded (normalised form) or robot actions (raw form)
    sessions: list  # SessionReport per row
    timings_ms: dict[str, float]
    replica: str
    batch_requests: int = 1  # requests merged into the model call that served this one


class IngressDeployment:
    """Plain class; `build_app` wraps it with `serve.ingress()` (the ASGI app is built per replica)."""

    def __init__(self, preprocess: Any, policy: Any, postprocess: Any, args: dict, metadata: dict | None = None):
        """`metadata`: the embodiment's statistics as read by `build_app` (None: the shipped file); the ingress never
        opens the checkpoint (its args come without model_path)."""
        self.cfg = parse_app_args(args)
        self.preprocess, self.policy, self.postprocess = (over_grpc(h) for h in (preprocess, policy, postprocess))
        self.policy_transport = Transport(policy)  # generate calls pick their transport by the batch's size
        self.embodiment = load_embodiment(self.cfg.embodiment, metadata)
        self.api_key = self.cfg.resolved_api_key
        self.metrics = serving_metrics()
        self.stages = RawStages(self.embodiment, Transport(preprocess), self.postprocess, self.cfg, self.metrics)
        self._policy_info: dict | None = None
        self.openpi = OpenPISocketServer(
            run_graph=self.run_graph,
            handshake=self.handshake,
            drop_session=self.drop_session,
            key_map=openpi_key_map(self.embodiment),
            limits=self.cfg.http,
            api_key=self.api_key,
            metrics=self.metrics,
        )

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve calls this once per replica, after __init__."""
        return build_fastapi_app(self)

    # 1. The graph (shared by HTTP and WebSocket) ----------------------------------------------------------------
    async def run_graph(self, req: generations.GenerationRequest) -> GraphReply:
        timeout = self.cfg.http.request_timeout_s
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        ctx = None
        if req.form == "raw":
            batch, ctx = await bounded(self.stages.preprocess(req), timeout)
            timings["preprocess"] = (time.perf_counter() - t0) * 1000.0
        else:
            batch = ModelBatch.from_normalised(req)
        t1 = time.perf_counter()
        policy = self.policy_transport.pick(arrays_bytes(batch))
        out = await bounded(policy_generate(policy, req.route_key, batch), timeout)
        timings["policy"] = (time.perf_counter() - t1) * 1000.0
        actions = out.result.actions
        if req.form == "raw":
            t2 = time.perf_counter()
            actions = await bounded(self.stages.postprocess(actions, ctx), timeout)
            timings["postprocess"] = (time.perf_counter() - t2) * 1000.0
        timings["graph"] = (time.perf_counter() - t0) * 1000.0
        timings.update({f"model.{k}": float(v) for k, v in out.result.timings_ms.items()})
        actions = np.asarray(actions, dtype=np.float32)
        return GraphReply(actions, list(out.result.sessions), timings, out.replica, out.batch_requests)

    async def drop_session(self, model_id: str) -> None:
        """Free a WebSocket session on its replica; a failure is only logged (the store evicts it anyway)."""
        try:
            await bounded(sticky_call(self.policy, "drop_sessions", model_id, [model_id]), DROP_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the replica may be gone
            log.warning("could not drop session %s: %s", model_id, type(exc).__name__)

    # 2. POST /v1/actions/generations ----------------------------------------------------------------------------
    def parse(self, body: bytes, content_type: str | None) -> generations.GenerationRequest:
        """Decode and validate a body; raises the error that names the bad field."""
        obj, flavour = codec.decode_body(body, content_type)
        return generations.parse_generation_request(obj, flavour, max_batch=self.cfg.sessions.max_sessions)

    async def answer(self, req: generations.GenerationRequest, t0: float) -> tuple[bytes, str]:
        """Run a parsed request (decoding started at `t0`) -> (reply body in the request's codec, content type)."""
        t_decode = (time.perf_counter() - t0) * 1000.0
        reply = await self.run_graph(req)
        timings = {"decode": t_decode, **reply.timings_ms}
        timings["ingress_total"] = (time.perf_counter() - t0) * 1000.0
        resp = replies.build_response(req, reply.actions, reply.sessions, timings)
        resp["served_by"] = reply.replica
        resp["batch_requests"] = reply.batch_requests
        self.metrics.observe_stages(timings)
        return codec.encode_body(resp, req.flavour)

    async def generate(self, body: bytes, content_type: str | None) -> tuple[bytes, str]:
        """`parse` + `answer` in one call (the graph tests drive the ingress through it, without HTTP)."""
        t0 = time.perf_counter()
        return await self.answer(self.parse(body, content_type), t0)

    async def read_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it passes the limit (before it is all in memory)."""
        limit = self.cfg.http.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"request body of {int(declared)} bytes exceeds the limit of {limit} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def count_request(self, status: int, form: str) -> None:
        self.metrics.requests.inc(1, tags={"route": routes.GENERATIONS_PATH, "status": str(status), "form": form})

    # 3. Health, metadata, models --------------------------------------------------------------------------------
    async def health(self) -> dict:
        """Ready when one replica of every deployment answers; raises NotReady otherwise."""
        states = {}
        for name, handle in (
            ("preprocess", self.preprocess),
            ("policy", self.policy),
            ("postprocess", self.postprocess),
        ):
            try:
                await bounded(handle.ready.remote(), HEALTH_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - any failure means "not ready yet"
                raise NotReady(f"deployment {name} cannot serve yet ({type(exc).__name__})") from None
            states[name] = True
        return {"status": "ok", "deployments": states}

    async def policy_info(self) -> dict:
        if self._policy_info is None:
            self._policy_info = await bounded(self.policy.info.remote(), INFO_TIMEOUT_S)
        return self._policy_info

    async def metadata(self) -> dict:
        info = await self.policy_info()
        return {
            "object": "action.metadata",
            "policy_family": "dreamzero",
            "model": self.cfg.model_name,
            "config": info["config_name"],
            "embodiment": self.cfg.embodiment,
            "action_horizon": info["action_horizon"],
            "action_dim": int(getattr(self.embodiment, "action_dim", info["max_action_dim"])),
            "padded_action_dim": info["max_action_dim"],
            "max_state_dim": info["max_state_dim"],
            "forms": list(generations.FORMS),
            "defaults": {
                "seed": info["default_seed"],
                "response_format": "envelope",
                "output_format": "numpy",
                "num_inference_steps": info["num_inference_steps"],
            },
            "openpi": await self.handshake(),
        }

    async def models(self) -> dict:
        info = await self.policy_info()
        entry = {
            "id": self.cfg.model_name,
            "object": "model",
            "owned_by": "dreamzero",
            "config": info["config_name"],
            "embodiment": self.cfg.embodiment,
            "action_horizon": info["action_horizon"],
        }
        return {"object": "list", "data": [entry]}

    async def handshake(self) -> dict:
        info = await self.policy_info()
        cfg = dict(self.embodiment.openpi_server_config())
        cfg.setdefault("action_horizon", info["action_horizon"])
        cfg.setdefault("action_dim", int(getattr(self.embodiment, "action_dim", info["max_action_dim"])))
        return openpi.handshake_config(**cfg)
