"""The API key check shared by the HTTP routes (one FastAPI dependency) and the OpenPI WebSocket handshake."""

from __future__ import annotations

import hmac

from dreamzero.errors import Unauthorized

#: the schemes a client may send the key with: `Bearer` (HTTP clients) and `Api-Key` (openpi-client)
SCHEMES = ("bearer", "api-key")


def check_api_key(expected: str | None, authorization: str | None) -> None:
    """Raise `Unauthorized` unless `authorization` carries `expected` (no key configured: everyone passes)."""
    if expected is None:
        return
    scheme, _, token = (authorization or "").strip().partition(" ")
    # compare_digest: the time taken does not tell how much of a guessed key was right
    if scheme.lower() not in SCHEMES or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise Unauthorized("missing or wrong API key; send 'Authorization: Bearer <key>' or 'Api-Key <key>'")
