"""Ingress deployment: the application's front door on Serve's HTTP proxy. It hosts the HTTP door and the OpenPI
WebSocket door on one ASGI app over one graph runner, and never loads the model.

Serve deploys only the deployments an application's ingress reaches through its constructor arguments, so the
ingress also holds the handles of the other doors (the ZeroMQ door, a deployment of its own that binds a port).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from deployments.doors.http import HttpDoor, build_fastapi_app
from deployments.doors.openpi_ws import OpenPISocketServer
from deployments.graph_runner import GraphRunner
from deployments.settings import IngressSettings
from deployments.tenants import TenantKeys, parse_door_config


class IngressDeployment:
    """Plain class; `build_app` wraps it with `serve.ingress()` (the ASGI app is built per replica)."""

    def __init__(
        self,
        preprocess: Any,
        policy: Any,
        postprocess: Any,
        settings: IngressSettings | None = None,
        doors: dict[str, Any] | None = None,
    ):
        """`doors`: the handles of the other front doors' deployments, held so that Serve deploys them with the app."""
        self.settings = settings or IngressSettings()
        self.runner = GraphRunner(preprocess, policy, postprocess, self.settings.graph)
        self.keys = TenantKeys.from_settings(self.settings.auth)  # one key check for both doors
        self.http = HttpDoor(self.runner, self.settings, self.keys)
        self.openpi = OpenPISocketServer(self.runner, self.settings, self.keys)
        self.doors = dict(doors or {})

    def reconfigure(self, user_config: dict) -> None:
        """Serve's `user_config` of the Ingress: `api_keys` and `tenants` (quotas) replace the `args` values without
        replacing the replica (deployments.tenants.DoorTenantConfig)."""
        keys, quotas = parse_door_config(user_config)
        self.keys.replace_static(keys)
        self.runner.quotas.update(quotas)

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve calls this once per replica, after __init__."""
        return build_fastapi_app(self.http, self.openpi)

    # the HTTP door's calls without HTTP (the graph tests drive the ingress through its handle)
    async def generate(self, body: bytes, content_type: str | None) -> tuple[bytes, str]:
        return await self.http.generate(body, content_type)

    async def health(self) -> dict:
        return await self.http.health()

    async def metadata(self) -> dict:
        return await self.http.metadata()

    async def models(self) -> dict:
        return await self.http.models()
