"""The one request path behind every front door: a parsed request -> Preprocess -> Policy -> Postprocess -> reply data.

HTTP, the OpenPI WebSocket and the ZeroMQ door each decode their wire into a `GenerationRequest` (its per-row options
one `RowOptions`, carried as it is to the model batch), call `GraphRunner.run` and encode the `GraphReply` in their
own format; so the transport choice, the stage timings, the deadline, the cancellation of downstream calls and the
session reports are the same whichever door a robot uses.
Errors are raised as they are; each door maps them through the one table (`deployments.error_replies`).

Tenants are applied here, once for every door: the caller's tenant (from its key, `deployments.auth`) scopes every
session id and the routing key (`deployments.tenants.scoped_id`), its rate and rows quotas are checked before
anything leaves the door, its session quotas travel with the request to the Policy replica, and the reply's session
reports carry the ids the door passed in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from deployments.calls import Transport, arrays_bytes, bounded, over_grpc
from deployments.config.settings import GraphSettings
from deployments.metrics import ServingMetrics, serving_metrics
from deployments.model_info import ModelInfo
from deployments.preprocess import load_embodiment, normalised_batch
from deployments.requests.generations import GenerationRequest
from deployments.requests.rows import RowOptions
from deployments.routing import policy_generate, sticky_call
from deployments.stages import RawStages
from deployments.tenants import DEFAULT_TENANT, SessionLimits, TenantQuotas, scoped_id
from dreamzero.errors import CapacityError, InvalidObservation, NotReady, QuotaExceeded
from dreamzero.session_notice import SingleFrameNotice
from dreamzero.types import SessionReport

log = logging.getLogger("dreamzero.serve.graph")

#: bounds on the runner's own calls (a request's trip is bounded by `GraphSettings.request_timeout_s`)
HEALTH_TIMEOUT_S, INFO_TIMEOUT_S, SESSION_CALL_TIMEOUT_S = 5.0, 30.0, 10.0


@dataclass
class GraphReply:
    actions: np.ndarray  # [B, H, D]: normalised + padded (normalised form) or robot actions (raw form)
    sessions: list[SessionReport]  # one per row, in request order
    timings_ms: dict[str, float]
    replica: str
    batch_requests: int = 1  # requests merged into the model call that served this one
    video: np.ndarray | None = None  # uint8 [B, T, H, W, 3] predicted frames (`return_video` requests only)
    # the request's rows as served: the caller's own ids, every row's traffic class resolved (the reply echo reads it)
    rows: RowOptions | None = None


def scope_request(req: GenerationRequest, tenant: str) -> GenerationRequest:
    """The request as the model and the router see it: session ids and routing key scoped by the tenant (the
    `default` tenant's request as it is, unless an id needs escaping)."""
    ids = [scoped_id(tenant, sid) for sid in req.session_ids]
    key = scoped_id(tenant, req.route_key)
    if ids == req.session_ids and key == req.route_key:
        return req
    return dataclasses.replace(req, rows=req.rows.replace(session_ids=ids), routing_key=key)


def own_reports(reports: list[SessionReport], own_ids: list[str]) -> list[SessionReport]:
    """Session reports under the ids the caller sent (never a scoped id, which names the tenant)."""
    return [r if r.session_id == sid else dataclasses.replace(r, session_id=sid) for r, sid in zip(reports, own_ids)]


def predicted_video(rows: list | None) -> np.ndarray:
    """The policy's per-row frames -> uint8 [B, T, H, W, 3]; a policy without a video model (a replay) is refused."""
    if rows is None or any(r is None for r in rows):
        raise InvalidObservation(
            "return_video: this server's policy predicts no video (a replay policy); send the request without it",
            field="return_video",
        )
    return np.stack(rows)


async def stage_call(calls: PendingCalls, response: Any, timeout_s: float, stage: str) -> Any:
    """A Preprocess / Postprocess call bounded by its own `<stage>.call_timeout_s`: a dead or stuck stage replica
    answers a prompt 503 (retryable) rather than holding the request until the whole trip's bound."""
    try:
        return await asyncio.wait_for(calls(response), timeout_s)
    except asyncio.TimeoutError:
        calls.cancel()
        raise CapacityError(
            f"the {stage} stage did not answer within {timeout_s:g} s ({stage}.call_timeout_s): a replica may have "
            "died and is being replaced; retry"
        ) from None


class PendingCalls:
    """The downstream calls of one request, so that a request past its deadline (or cancelled) cancels what it
    started instead of leaving it to run on a replica."""

    def __init__(self) -> None:
        self._pending: list[Any] = []

    async def __call__(self, response: Any) -> Any:
        self._pending.append(response)
        return await response

    def cancel(self) -> None:
        for response in self._pending:
            cancel = getattr(response, "cancel", None)
            if cancel is not None:
                cancel()


class GraphRunner:
    """Runs requests through the graph's three deployments; one per front-door replica."""

    def __init__(
        self,
        preprocess: Any,
        policy: Any,
        postprocess: Any,
        settings: GraphSettings,
        metrics: ServingMetrics | None = None,
    ):
        self.settings = settings
        self.preprocess, self.policy, self.postprocess = (over_grpc(h) for h in (preprocess, policy, postprocess))
        self.policy_transport = Transport(policy)  # generate calls pick their transport by the batch's size
        self.embodiment = load_embodiment(settings.embodiment)
        self.metrics = metrics or serving_metrics()
        self.stages = RawStages(self.embodiment, Transport(preprocess), self.postprocess, settings, self.metrics)
        self.quotas = TenantQuotas(settings.tenants)
        self._info: ModelInfo | None = None
        self.single_frame = SingleFrameNotice(log)  # the loop that resends a first call's 1 frame, told once

    @property
    def max_rows(self) -> int:
        """Most session rows one request may carry (the doors' parsers refuse more, naming the field)."""
        return self.settings.max_rows

    # 1. One request -----------------------------------------------------------------------------------------------
    async def run(
        self, req: GenerationRequest, timeout_s: float | None = None, tenant: str = DEFAULT_TENANT
    ) -> GraphReply:
        """The request's trip through the graph for `tenant`, within `timeout_s` (default `request_timeout_s`); past
        it the downstream calls still running are cancelled and `asyncio.TimeoutError` is raised (503 in every door).
        A request over the tenant's rate or rows quota raises `QuotaExceeded` (429) before anything starts. Rows
        that name no traffic class get the tenant's, else the door's default (`RowOptions.with_classes`)."""
        try:
            self.quotas.admit(tenant, len(req.session_ids))
        except QuotaExceeded as exc:
            self.metrics.tenant_quota_refusals.inc(1, tags={"tenant": tenant, "quota": exc.quota})
            raise
        rows = req.rows.with_classes(self.quotas.quota(tenant).traffic_class)
        if rows is not req.rows:
            req = dataclasses.replace(req, rows=rows)
        scoped = scope_request(req, tenant)
        calls = PendingCalls()
        try:
            reply = await asyncio.wait_for(
                self._run(scoped, calls, self.quotas.session_limits(tenant)),
                timeout_s or self.settings.request_timeout_s,
            )
        except (asyncio.TimeoutError, asyncio.CancelledError):
            calls.cancel()
            raise
        self.single_frame(reply.sessions)  # scoped ids: one tenant's session never hides another's
        if scoped is not req:
            reply.sessions = own_reports(reply.sessions, req.session_ids)
        reply.rows = req.rows
        return reply

    async def _run(
        self, req: GenerationRequest, calls: PendingCalls, limits: SessionLimits | None = None
    ) -> GraphReply:
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        ctx = None
        if req.form == "raw":
            pre = self.settings.preprocess.call_timeout_s
            batch, ctx = await stage_call(calls, self.stages.preprocess(req), pre, "preprocess")
            timings["preprocess"] = (time.perf_counter() - t0) * 1000.0
        else:
            batch = normalised_batch(req)
        t1 = time.perf_counter()
        policy = self.policy_transport.pick(arrays_bytes(batch))
        out = await calls(policy_generate(policy, req.route_key, batch, limits))
        timings["policy"] = (time.perf_counter() - t1) * 1000.0
        actions = out.result.actions
        if req.form == "raw":
            t2 = time.perf_counter()
            post = self.settings.postprocess.call_timeout_s
            actions = await stage_call(calls, self.stages.postprocess(actions, ctx), post, "postprocess")
            timings["postprocess"] = (time.perf_counter() - t2) * 1000.0
        timings["graph"] = (time.perf_counter() - t0) * 1000.0
        timings.update({f"model.{k}": float(v) for k, v in out.result.timings_ms.items()})
        self.metrics.observe_stages(timings)
        actions = np.asarray(actions, dtype=np.float32)
        video = predicted_video(out.result.video) if req.return_video else None
        return GraphReply(actions, list(out.result.sessions), timings, out.replica, out.batch_requests, video)

    # 2. Session control (routed by the key the sessions were sent under) ------------------------------------------
    async def drop_sessions(
        self, route_key: str, session_ids: list[str], timeout_s: float | None = None, tenant: str = DEFAULT_TENANT
    ) -> None:
        """Free a tenant's sessions on the replica holding them (a connection closed)."""
        ids = [scoped_id(tenant, sid) for sid in session_ids]
        call = sticky_call(self.policy, "drop_sessions", scoped_id(tenant, route_key), ids)
        await bounded(call, timeout_s or SESSION_CALL_TIMEOUT_S)

    async def reset_sessions(
        self, route_key: str, session_ids: list[str], timeout_s: float | None = None, tenant: str = DEFAULT_TENANT
    ) -> None:
        """Restart a tenant's sessions at their next call, flagged `reset_requested`."""
        ids = [scoped_id(tenant, sid) for sid in session_ids]
        call = sticky_call(self.policy, "reset_sessions", scoped_id(tenant, route_key), ids)
        await bounded(call, timeout_s or SESSION_CALL_TIMEOUT_S)

    # 3. What the doors report ---------------------------------------------------------------------------------------
    async def model_info(self) -> ModelInfo:
        if self._info is None:
            info = await bounded(self.policy.info.remote(), INFO_TIMEOUT_S)
            self._info = ModelInfo.from_policy(info, self.embodiment)
        return self._info

    async def health(self) -> dict[str, bool]:
        """{deployment: True} when one replica of each answers `ready`; raises NotReady naming the first that
        does not."""
        states = {}
        stages = {"preprocess": self.preprocess, "policy": self.policy, "postprocess": self.postprocess}
        for name, handle in stages.items():
            try:
                await bounded(handle.ready.remote(), HEALTH_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - any failure means "not ready yet"
                raise NotReady(f"deployment {name} cannot serve yet ({type(exc).__name__})") from None
            states[name] = True
        return states

    def close(self) -> None:
        self.stages.close()
