"""The front doors, one module each, and what they share.

A door owns only its wire: it decodes a message into a `GenerationRequest` whose per-row options are one `RowOptions`
(`deployments.requests`: the HTTP, OpenPI and ZeroMQ decoders live there), runs it through the one request path
(`Door.run`: the door's `GraphRunner`), encodes the `GraphReply`, and counts each answer or error reply once with
`Door.count` (requests by route, the tenant's requests, errors and bytes in / out under the door's name), so every
door's metrics read the same.

A new door (gRPC, say) is one module here: a `Door` subclass with a unique `name`, registered with `@register_door`.
A door the ingress hosts on its ASGI app (`hosted = True`: HTTP, the OpenPI WebSocket) takes `(runner, settings,
keys)` and adds its routes in `mount(app)`; the ingress builds every registered hosted door (`hosted_doors`), so
importing the module where the ingress is built (`deployments/ingress.py`) is its registration. A door that binds a
port of its own (ZeroMQ) is its own deployment: the builder binds it (serve_graph/builder.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from deployments.graph_runner import GraphReply, GraphRunner
from deployments.requests.generations import GenerationRequest
from deployments.requests.replies import row_echo
from deployments.tenants import DEFAULT_TENANT, UNAUTHENTICATED

if TYPE_CHECKING:
    from fastapi import FastAPI

    from deployments.config.settings import IngressSettings
    from deployments.tenants import TenantKeys


class Door:
    """A front door over one graph runner. Subclasses set `name` (the `door` label of every per-tenant metric, and
    the registry's key) and, when the ingress hosts them on its ASGI app, `hosted = True`, a constructor taking
    `(runner, settings: IngressSettings, keys: TenantKeys)` and `mount(app)`."""

    name: ClassVar[str]
    #: built by the ingress (`hosted_doors`) and mounted on its ASGI app; False: a deployment of its own (ZeroMQ)
    hosted: ClassVar[bool] = False

    def __init__(self, runner: GraphRunner):
        self.runner = runner
        self.metrics = runner.metrics

    async def run(
        self, request: GenerationRequest, tenant: str = DEFAULT_TENANT, timeout_s: float | None = None
    ) -> GraphReply:
        """The one request path: the request through the graph as `tenant`'s, within `timeout_s` (default: the
        runner's `request_timeout_s`)."""
        return await self.runner.run(request, timeout_s, tenant)

    def echo(self, reply: GraphReply, request: GenerationRequest) -> list[dict]:
        """Each row's reply echo (`row_echo`: observed_at, its source, server_ms, traffic_class), counted per class
        as chunk latency and deadline misses; every door adds it to its per-row session reports."""
        rows = reply.rows if reply.rows is not None else request.rows
        echo = row_echo(rows)
        self.metrics.observe_rows(self.name, echo, rows.deadline_ms)
        return echo

    def count(
        self,
        tenant: str | None,
        status: int,
        code: str | None = None,
        *,
        route: str,
        form: str = "raw",
        received: int = 0,
        sent: int = 0,
    ) -> None:
        """One answered request (or error reply, with its `code`): the requests by route, status and form; the
        tenant's requests and errors at this door; the bytes it sent and was sent."""
        who = tenant or UNAUTHENTICATED
        self.metrics.requests.inc(1, tags={"route": route, "status": str(status), "form": form})
        self.metrics.count_tenant(who, self.name, status, code)
        self.metrics.count_bytes(who, self.name, received, sent)

    def mount(self, app: FastAPI) -> None:
        """Add this door's routes to the ingress's ASGI app (hosted doors only)."""
        raise NotImplementedError(f"door {self.name!r} is hosted by the ingress but mounts no routes")


#: the registered doors by name; a door module registers its class with `@register_door`
DOORS: dict[str, type[Door]] = {}


def register_door(cls: type[Door]) -> type[Door]:
    """Register a door class under its `name` (unique: it labels the door's metrics)."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__name__} needs a class attribute `name` (its metrics label)")
    known = DOORS.get(name)
    if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"a door named {name!r} is registered already ({known.__module__}.{known.__qualname__})")
    DOORS[name] = cls
    return cls


def hosted_doors(runner: GraphRunner, settings: IngressSettings, keys: TenantKeys) -> dict[str, Any]:
    """Every registered door the ingress hosts, built over its runner, settings and key table, in registration
    order."""
    return {name: cls(runner, settings, keys) for name, cls in DOORS.items() if cls.hosted}
