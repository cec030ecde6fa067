"""Ingress deployment: the application's front door on Serve's HTTP proxy. It hosts every registered door that runs
on its ASGI app (the HTTP door, the OpenPI WebSocket door: `deployments.doors.hosted_doors`) over one graph runner,
and never loads the model.

Serve deploys only the deployments an application's ingress reaches through its constructor arguments, so the
ingress also holds the handles of the other doors (the ZeroMQ door, a deployment of its own that binds a port).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from deployments.config.settings import IngressSettings
from deployments.doors import hosted_doors
from deployments.doors.http import build_fastapi_app
from deployments.doors.openpi_ws import OpenPISocketServer  # noqa: F401 - importing a door module registers it
from deployments.graph_runner import GraphRunner
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
        self.hosted = hosted_doors(self.runner, self.settings, self.keys)  # every registered door this app serves
        self.http, self.openpi = self.hosted["http"], self.hosted["openpi_ws"]
        self.doors = dict(doors or {})

    def reconfigure(self, user_config: dict | None, rank: object = None) -> None:
        """Serve's `user_config` of the Ingress: `api_keys` and `tenants` (quotas) replace the `args` values without
        replacing the replica (deployments.tenants.DoorTenantConfig). `rank` is unused: taking it makes Serve call
        this when a deploy removes `user_config` (None: back to `args`), as PolicyDeployment.reconfigure says."""
        keys, quotas = parse_door_config(user_config)
        self.keys.replace_static(keys)
        self.runner.quotas.update(quotas)

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve calls this once per replica, after __init__."""
        return build_fastapi_app(self.http, *(door for door in self.hosted.values() if door is not self.http))
