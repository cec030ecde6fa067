"""Who a caller is and what it may hold open.

The API key check shared by the HTTP routes (one FastAPI dependency), the OpenPI WebSocket handshake and the ZeroMQ
door's `api_token`: a key -> the tenant it names (deployments.tenants), or `Unauthorized`. And the connection caps
of the HTTP / WebSocket front door (`ConnectionSlots`): every open WebSocket and every request body still arriving
holds one of the Ingress replica's Serve slots, so each caller may hold only a few of them (docs/serving.md,
"Connections and request slots").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from deployments.tenants import TenantKeys
from dreamzero.errors import QuotaExceeded, Unauthorized

#: the schemes a client may send the key with: `Bearer` (HTTP clients) and `Api-Key` (openpi-client)
SCHEMES = ("bearer", "api-key")
HEADER_MESSAGE = "missing or wrong API key; send 'Authorization: Bearer <key>' or 'Api-Key <key>'"
TOKEN_MESSAGE = "Unauthorized: missing or wrong api_token"


def tenant_from_header(keys: TenantKeys, authorization: str | None) -> str:
    """The tenant whose key `authorization` carries; `Unauthorized` for a missing or unknown key (no key configured:
    everyone is the tenant `default`)."""
    if not keys.required:
        return keys.identify(None)
    scheme, _, token = (authorization or "").strip().partition(" ")
    tenant = keys.identify(token.strip()) if scheme.lower() in SCHEMES else None
    if tenant is None:
        raise Unauthorized(HEADER_MESSAGE)
    return tenant


def tenant_from_token(keys: TenantKeys, token: str | None) -> str:
    """The same for the ZeroMQ door's `api_token` field."""
    tenant = keys.identify(token if isinstance(token, str) else None)
    if tenant is None:
        raise Unauthorized(TOKEN_MESSAGE)
    return tenant


def caller_of(keys: TenantKeys, tenant: str, client_host: str | None) -> str:
    """Whom a connection cap counts: the tenant when keys are configured, else the client's address (without keys
    every caller is the tenant `default`, and one robot must not hold everyone's share)."""
    if keys.required:
        return f"tenant:{tenant}"
    return f"address:{client_host or 'unknown'}"


class ConnectionSlots:
    """Counts what each caller holds open on one replica (WebSockets, or bodies still arriving) and refuses past
    `per_caller` or `total` with a 429 naming the knob. Single event loop: no lock needed."""

    def __init__(
        self, what: str, per_caller: int, per_caller_knob: str, total: int | None = None, total_knob: str = ""
    ):
        self.what, self.per_caller, self.per_caller_knob = what, per_caller, per_caller_knob
        self.total, self.total_knob = total, total_knob
        self.held: dict[str, int] = {}
        self.count = 0

    def acquire(self, caller: str) -> None:
        """Take one slot for `caller`; `QuotaExceeded` (quota = the knob's name) when it holds its share already."""
        if self.held.get(caller, 0) >= self.per_caller:
            who = caller.partition(":")[0]
            raise QuotaExceeded(
                f"this {who} holds {self.per_caller} {self.what} on this server already (http.{self.per_caller_knob}); "
                "close one first",
                self.per_caller_knob,
                retry_after_s=1.0,
            )
        if self.total is not None and self.count >= self.total:
            raise QuotaExceeded(
                f"this server holds {self.total} {self.what} already (http.{self.total_knob}); retry later",
                self.total_knob,
                retry_after_s=1.0,
            )
        self.held[caller] = self.held.get(caller, 0) + 1
        self.count += 1

    def release(self, caller: str) -> None:
        n = self.held.get(caller, 0) - 1
        if n > 0:
            self.held[caller] = n
        else:
            self.held.pop(caller, None)
        self.count = max(0, self.count - 1)

    @contextmanager
    def hold(self, caller: str) -> Iterator[None]:
        self.acquire(caller)
        try:
            yield
        finally:
            self.release(caller)
