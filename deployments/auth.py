"""The API key check shared by the HTTP routes (one FastAPI dependency), the OpenPI WebSocket handshake and the
ZeroMQ door's `api_token`: a key -> the tenant it names (deployments.tenants), or `Unauthorized`."""

from __future__ import annotations

from deployments.tenants import TenantKeys
from dreamzero.errors import Unauthorized

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
