"""The two network links of `DroidPolicy`: the OpenPI WebSocket and the HTTP action endpoint.

Both send the same frames (`droid.FRAME_OFFSETS`) and echo the session's continuity fields from the last reply (the
HTTP body's `parameters.expected_steps` / `expected_incarnations`; on OpenPI the keys of the same names, a list of
one), so a server that lost the session restarts it and says so instead of reusing stale state.

A query with `rtc` (real-time chunking, docs/rtc.md) adds, for its one row, `rtc_prefix_len` [d], `rtc_exec_horizon`
[s] and, when the client sends its own, `action_prefix` float32 [1, P, 8] in robot units (HTTP: in `parameters`;
OpenPI: keys of the same names, like the continuity fields).

The fleet's fields of a query (docs/fleet.md: `observed_at`, `traffic_class`, `deadline_ms`) go the same way, each
only when the query sets it, so a server that does not know them sees today's message: on OpenPI as keys (a list of
one), over HTTP through `ActionClient.generate`'s keyword arguments of the same names.

    policy = DroidPolicy(connect("ws://gpu-box:8000"), prompt="wipe the table")
    policy = DroidPolicy(connect("wss://gpu-box:8443", ca_bundle="ca.pem"), prompt="wipe the table")  # TLS
"""

from __future__ import annotations

import numpy as np

from dreamzero_client.errors import ConfigError
from dreamzero_client.tls import check_scheme, client_context
from dreamzero_client.wire.openpi import OPENPI_CARTESIAN_KEY
from dreamzero_droid import droid
from dreamzero_droid.policy import LinkReply, Query, as_call_error
from dreamzero_droid.rtc import RtcRequest


def rtc_fields(rtc: RtcRequest | None) -> dict:
    """The RTC fields of one row as both links send them (a list of one per field: the row-wise form)."""
    if rtc is None:
        return {}
    fields = {"rtc_prefix_len": [int(rtc.prefix_len)], "rtc_exec_horizon": [int(rtc.exec_horizon)]}
    if rtc.action_prefix is not None:
        fields["action_prefix"] = np.asarray(rtc.action_prefix, dtype=np.float32)[None]
    return fields


#: the fleet's per-row fields a query may carry (docs/fleet.md)
FLEET_FIELDS = ("observed_at", "traffic_class", "deadline_ms")


def fleet_fields(query) -> dict:
    """The fleet fields a query sets, each as a list of one (the row-wise form); {} when it sets none (a
    franka_pnp query has no such fields)."""
    return {name: [value] for name in FLEET_FIELDS if (value := getattr(query, name, None)) is not None}


class OpenPILink:
    """`dreamzero_client.openpi_client.OpenPIClient`, opened on first use and dropped after a transport failure,
    so the next query reconnects (and fails fast with "server_unreachable" while the server is gone)."""

    name = "openpi"
    return_video = False  # set True to ask for the predicted frames with every chunk (LinkReply.video)

    def __init__(
        self,
        url: str = "ws://127.0.0.1:8000",
        api_key: str | None = None,
        timeout_s: float = 120.0,
        max_reconnects: int = 1,
        echo_continuity: bool = True,
        client_factory=None,
        ca_bundle: str | None = None,
    ):
        self.url, self.api_key, self.timeout_s, self.max_reconnects = url, api_key, timeout_s, max_reconnects
        self.ca_bundle = ca_bundle  # wss://: the CA certificate(s) the server's must chain to (None: system store)
        if ca_bundle is not None:
            client_context(ca_bundle)  # a missing or unreadable file fails here, not at the first query
        self.echo_continuity = echo_continuity  # off for servers that reject unknown keys
        self._factory = client_factory or self._default_factory
        self._client = None
        self.server_metadata: dict | None = None

    def _default_factory(self):
        from dreamzero_client.openpi_client import OpenPIClient

        # resume: our server's extended handshake (it names the embodiment) and sessions that survive a reconnect;
        # other servers ignore the query parameters
        return OpenPIClient(
            self.url,
            api_key=self.api_key,
            timeout_s=self.timeout_s,
            max_reconnects=self.max_reconnects,
            resume=self.echo_continuity,
            ca_bundle=self.ca_bundle,
        )

    def open(self) -> dict:
        """Connect now (otherwise the first query does) and return the server's handshake config."""
        self._connected()
        return dict(self.server_metadata or {})

    def _connected(self):
        if self._client is None:
            try:
                self._client = self._factory()
                self.server_metadata = dict(self._client.get_server_metadata() or {})
            except Exception:
                self._drop()
                raise
        return self._client

    def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a dead socket may raise; the connection is gone anyway
                pass

    def openpi_observation(self, query: Query) -> dict:
        """The observation keys of a query's OpenPI message (another embodiment's link overrides this)."""
        msg = droid.openpi_observation(query.frames)
        msg[OPENPI_CARTESIAN_KEY] = np.zeros(6, dtype=np.float32)  # DROID clients send it; DreamZero ignores it
        return msg

    def message(self, query: Query) -> dict:
        """The OpenPI infer message of a query."""
        msg = self.openpi_observation(query)
        msg.update(prompt=query.prompt, session_id=query.session_id, response_format="dict")
        if self.echo_continuity and not query.first_call:
            if query.expected_step is not None:
                msg["expected_steps"] = [query.expected_step]
            if query.expected_incarnation is not None:
                msg["expected_incarnations"] = [query.expected_incarnation]
        msg.update(rtc_fields(query.rtc))
        msg.update(fleet_fields(query))
        if self.return_video:
            msg["return_video"] = True
        return msg

    def send(self, query: Query) -> LinkReply:
        client = self._connected()
        try:
            reply = client.infer(self.message(query))
        except Exception as exc:
            if as_call_error(exc).reason in ("server_unreachable", "timeout"):
                self._drop()
            raise
        return LinkReply(
            reply.get("actions"), reply.get("session"), dict(reply.get("timings") or {}), reply.get("video")
        )

    def reset(self, session_id: str) -> None:
        if self._client is None:
            return  # nothing to reset: the server freed the connection's sessions when it closed
        try:
            self._client.reset(session_id)
        except Exception:
            self._drop()
            raise

    def close(self) -> None:
        self._drop()


class HttpLink:
    """`POST /v1/actions/generations` through `dreamzero_client.http_client.ActionClient`, raw form, one row."""

    name = "http"
    return_video = False  # set True to ask for the predicted frames with every chunk (LinkReply.video)

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        timeout_s: float = 120.0,
        max_retries: int = 2,
        client=None,
        ca_bundle: str | None = None,
    ):
        if client is None:
            from dreamzero_client.http_client import ActionClient

            # fewer retries than the client's default: a dead server should fail an episode in seconds, not minutes
            client = ActionClient(
                base_url, api_key=api_key, timeout_s=timeout_s, max_retries=max_retries, ca_bundle=ca_bundle
            )
        self.client = client

    def raw_observation(self, query: Query) -> dict:
        """The raw form's observation of a query's one row (another embodiment's link overrides this)."""
        return droid.raw_observation(query.frames)

    def send(self, query: Query) -> LinkReply:
        result = self.client.generate(
            self.raw_observation(query),
            query.prompt,
            query.session_id,
            form="raw",
            expected_steps=[None if query.first_call else query.expected_step],
            expected_incarnations=[None if query.first_call else query.expected_incarnation],
            **rtc_fields(query.rtc),
            **fleet_fields(query),
            **({"return_video": True} if self.return_video else {}),
        )
        sessions = result.sessions or [None]
        video = getattr(result, "video", None)  # an injected client may predate predicted video
        video = None if video is None else video[0]
        return LinkReply(result.actions[0], sessions[0], dict(result.timings or {}), video)

    def reset(self, session_id: str) -> None:
        # session ids are never reused, so forgetting the id is the reset; the server evicts the idle state (LRU/TTL)
        self.client.forget_sessions([session_id])

    def close(self) -> None:
        self.client.close()


def connect(
    url: str,
    api_key: str | None = None,
    timeout_s: float = 30.0,
    max_reconnects: int = 1,
    field: str = "server",
    ca_bundle: str | None = None,
):
    """The link for `url`: ws:// / wss:// -> OpenPILink; http:// / https:// -> HttpLink (`field` names it in errors).

    `ca_bundle`: PEM file of the CA certificate(s) a wss:// / https:// server's certificate must chain to (None: the
    system trust store); refused with a ws:// / http:// URL, which would travel in clear."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in ("ws", "wss", "http", "https"):
        raise ConfigError(f"{field}: expected a ws://, wss://, http:// or https:// URL, got {url!r}")
    check_scheme(scheme, ca_bundle, field)
    if scheme in ("ws", "wss"):
        return OpenPILink(url, api_key=api_key, timeout_s=timeout_s, max_reconnects=max_reconnects, ca_bundle=ca_bundle)
    return HttpLink(url, api_key=api_key, timeout_s=timeout_s, max_retries=max_reconnects, ca_bundle=ca_bundle)
