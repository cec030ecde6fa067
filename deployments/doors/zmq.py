"""The ZeroMQ door: RLDX-1 / Isaac-GR00T `PolicyClient`s (a REQ socket, msgpack frames) talk to the graph as they are.
Requests go through the same graph runner as HTTP's, so sessions, batching, continuity reports and RTC behave
exactly as over HTTP (docs/zmq.md). The door is its own Serve deployment (`ZmqIngressDeployment`): it binds a port.

Why a ROUTER socket where RLDX-1 binds REP: REP answers one request at a time, so robots would queue behind each
other and never share a batch. ROUTER accepts the same REQ peers (each message arrives as [identity, b"", payload]),
lets every request run concurrently and sends each reply back to its identity.

A "client" is the peer's ZMQ identity (routing id): random per REQ socket, or the client's own ZMQ_ROUTING_ID, which
lets a robot keep its sessions across reconnects. Session ids are namespaced by it, so two robots both saying
`default_0` never share a session, and `reset` without ids clears only the caller's sessions. The `api_token` names
the caller's tenant (deployments.auth), and a client namespace belongs to the tenant that used it: the graph runner
scopes every id by tenant and the door remembers sessions per (tenant, identity), so another tenant's client that
picks the same identity reaches (and `reset` lists) only sessions of its own.

A caller without a key costs next to nothing (issue 45): the door reads only the message's `endpoint` and
`api_token` (skipping `data` unbuilt) and checks the token before it unpacks anything else; the full message is then
unpacked within decode limits sized from the widest legal request (`DecodeLimits`), off the event loop when large.
It remembers only the sessions of requests the Policy answered (bounded per client and in all, least recently used
first, forgotten when idle), so `reset` without ids fans out to a bounded list, and resets are rate-limited per
tenant. `kill` is the operator's: only the tenant `admin` (or a server's only tenant) may use it, and a killed door
reports itself unhealthy so Serve replaces it (docs/zmq.md).
"""

# Longer than ~400 lines on purpose: the door's request path, its bounded header read and unpack, its session
# memory and the socket loop are one contract with the RLDX wire, read together.

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

import msgpack

from deployments.audit import configure_audit_log, configure_info_log
from deployments.auth import tenant_from_token
from deployments.config.sections import ZmqCurveArgs
from deployments.config.settings import ZmqDoorSettings
from deployments.doors import Door, register_door
from deployments.error_replies import classify
from deployments.graph_runner import GraphRunner
from deployments.requests import rldx as rldx_requests
from deployments.requests.generations import GenerationRequest
from deployments.requests.limits import decode_in_worker, request_limits
from deployments.tenants import (
    DEFAULT_TENANT,
    UNAUTHENTICATED,
    TenantKeys,
    TokenBucket,
    audit_refusal,
    parse_door_config,
)
from dreamzero.errors import (
    CapacityError,
    ConfigError,
    InvalidObservation,
    InvalidRequest,
    PayloadTooLarge,
    QuotaExceeded,
    Unauthorized,
)
from dreamzero_client.wire import rldx
from dreamzero_client.wire.limits import Budget, DecodeLimits

log = logging.getLogger("dreamzero.serve.zmq")

ROUTE = "zmq"
#: prefix of the policy's session ids for ZMQ clients
ZMQ_SESSION_PREFIX = "zmq"
#: clients whose session lists are remembered (for `reset` without ids); the oldest is forgotten first
MAX_REMEMBERED_CLIENTS = 4096
#: sessions remembered per client and in all (least recently used forgotten first), and how long an idle one is
MAX_SESSIONS_PER_CLIENT = 256
MAX_REMEMBERED_SESSIONS = 16384
REMEMBER_IDLE_S = 3600.0
#: `reset` calls per tenant and door replica: a token bucket (per second, burst)
RESETS_PER_S, RESET_BURST = 2.0, 10
#: the tenant whose key may use `kill` on a server with several tenants
KILL_TENANT = "admin"
#: keys of a request map, and the longest `endpoint` / `api_token` string read before the token check
REQUEST_KEYS = 8
MAX_HEADER_STR = 4096


def client_namespace(identity: bytes) -> str:
    return identity.hex()


def model_session_id(client: str, session_id: str) -> str:
    return f"{ZMQ_SESSION_PREFIX}-{client}:{session_id}"


@register_door
class ZmqDoor(Door):
    """Request handling of the ZMQ front door, without the socket (tests drive `handle` directly)."""

    # More than ~15 methods on purpose: one per RLDX-1 endpoint plus the socket loop and the client-namespace memory,
    # which read together as the protocol's one state machine

    name = ROUTE  # its own deployment (it binds a port): the builder binds `ZmqIngressDeployment`

    def __init__(self, runner: GraphRunner, settings: ZmqDoorSettings):
        super().__init__(runner)
        self.zcfg = settings.zmq
        self.keys = TenantKeys.from_settings(settings.auth)
        self.embodiment = runner.embodiment
        # (tenant, client) -> {client's session id: (routing key of the request that used it, last use)}, LRU order
        self.sessions: OrderedDict[tuple[str, str], OrderedDict[str, tuple[str, float]]] = OrderedDict()
        self._remembered = 0  # sessions in `self.sessions`, all clients together
        self._reset_buckets: dict[str, TokenBucket] = {}  # tenant -> its `reset` rate
        self.in_flight = 0
        self.killed = asyncio.Event()
        self.limits = request_limits(max_rows=max(1, int(runner.max_rows or 1)), max_bytes=self.zcfg.max_message_bytes)
        self._zap = self._zap_context = None  # CURVE allow-list: the ZAP handler and its context (bind)

    # --- one message ----------------------------------------------------------------------------------------------
    async def handle(self, identity: bytes, payload: bytes) -> bytes:
        """The reply to one message; never raises and never takes longer than the deadline (plus encoding)."""
        t0, received_at = time.perf_counter(), time.time()  # wall clock: rows' deadlines and server_ms count from it
        endpoint, status, code, tenant = "unknown", 200, None, UNAUTHENTICATED
        self.in_flight += 1
        try:
            if self.in_flight > self.zcfg.max_in_flight:
                raise DoorBusy(f"the server has {self.zcfg.max_in_flight} requests in flight; retry shortly")
            if len(payload) > self.zcfg.max_message_bytes:
                raise PayloadTooLarge(f"message of {len(payload)} bytes exceeds {self.zcfg.max_message_bytes} bytes")
            # the token first, from the message's header fields alone: `data` is skipped, never built (off the event
            # loop when large: skipping 64 MiB of small values takes about half a second)
            tenant = self.check_token(await decode_in_worker(len(payload), read_token, payload))
            message = await decode_in_worker(len(payload), bounded_unpack, payload, self.limits)
            request = rldx_requests.parse_request(message)
            endpoint = request.endpoint
            # the runner cancels the downstream calls it started when this deadline cancels it
            reply = await asyncio.wait_for(
                self.dispatch(identity, request, tenant, received_at), self.zcfg.request_timeout_s
            )
            out = rldx.pack(reply)
        except asyncio.TimeoutError:
            status, code = 503, "no_capacity"
            message = f"deadline: no result within {self.zcfg.request_timeout_s:g} s (zmq.request_timeout_s); retry"
            out = rldx.pack({**rldx.error_reply(message), "code": code, "status": status})
        except Exception as exc:  # noqa: BLE001 - every failure becomes an error reply; the REQ client never hangs
            body = self.error_body(exc)
            status, code = body["status"], body["code"]
            out = rldx.pack(body)
            if door_refusal(exc):
                audit_refusal(tenant, f"zmq/{endpoint}", exc)
        finally:
            self.in_flight -= 1
        self.count(tenant, status, code, route=f"{ROUTE}/{endpoint}", received=len(payload), sent=len(out))
        self.metrics.observe_stages({"zmq_total": (time.perf_counter() - t0) * 1000.0})
        return out

    @staticmethod
    def error_body(exc: BaseException) -> dict:
        reply = classify(exc)
        body = rldx.error_reply(reply.message)
        body.update({"code": reply.code, "status": reply.status})
        if reply.retry_after_s is not None:
            body["retry_after_s"] = reply.retry_after_s
        if reply.field is not None:
            body["field"] = reply.field
        return body

    def kill_allowed(self, tenant: str) -> bool:
        """`kill` is the operator's: the tenant `admin`, or the caller of a server whose only tenant is `default` (a
        single legacy key, or none): never one tenant ending the door the others share."""
        return tenant == KILL_TENANT or (tenant == DEFAULT_TENANT and self.keys.tenants() <= {DEFAULT_TENANT})

    def check_token(self, token: str | None) -> str:
        """The tenant the `api_token` names (`default` when the door has no keys); Unauthorized otherwise."""
        return tenant_from_token(self.keys, token)

    def reconfigure(self, user_config: dict | None) -> None:
        """The door's live `user_config`: `api_keys` and `tenants` (quotas) replace the `args` values."""
        keys, quotas = parse_door_config(user_config)
        self.keys.replace_static(keys)
        self.runner.quotas.update(quotas)

    async def dispatch(
        self,
        identity: bytes,
        request: rldx_requests.RldxRequest,
        tenant: str = DEFAULT_TENANT,
        received_at: float | None = None,
    ) -> Any:
        """One request's reply value; `received_at`: the door's wall clock when the message arrived (default: when
        it was decoded)."""
        if request.endpoint == "ping":
            return dict(rldx_requests.PING_REPLY)
        if request.endpoint == "get_modality_config":
            return await self.modality_config()
        if request.endpoint == "kill":
            if not self.zcfg.allow_kill:
                raise Unauthorized("the kill endpoint is disabled on this server (zmq.allow_kill: false)")
            if not self.kill_allowed(tenant):
                raise Unauthorized(f"the kill endpoint needs the operator's key (tenant {KILL_TENANT!r})")
            log.warning("ZMQ door: kill by tenant %s; the replica reports itself unhealthy and is replaced", tenant)
            self.killed.set()
            return None
        client = client_namespace(identity)
        if request.endpoint == "reset":
            return await self.reset(client, rldx_requests.parse_reset(request.data), tenant)
        return await self.get_action(client, request.data, tenant, received_at)

    # --- endpoints --------------------------------------------------------------------------------------------------
    async def get_action(
        self, client: str, data: dict, tenant: str = DEFAULT_TENANT, received_at: float | None = None
    ) -> list:
        req = rldx_requests.parse_get_action(data, self.embodiment.language_key, max_batch=self.runner.max_rows)
        own_ids = req.rows.session_ids
        rows = req.rows.replace(session_ids=[model_session_id(client, s) for s in own_ids])  # the client's namespace
        if received_at is not None:
            rows.received_at = received_at
        gen = GenerationRequest(req.observation, rows, form="raw")
        reply = await self.run(gen, tenant, self.zcfg.request_timeout_s)
        # only now do these sessions exist on the Policy: a refused request's ids are never remembered
        self._remember((tenant, client), own_ids[: len(reply.sessions)], gen.route_key)
        reports = []
        for own_id, report, echo in zip(own_ids, reply.sessions, self.echo(reply, gen)):
            entry = {**report.to_dict(), **echo}
            entry["session_id"] = own_id  # the client's own name, not the namespaced one
            reports.append(entry)
        info = {
            "sessions": reports,
            "timings": reply.timings_ms,
            "served_by": reply.replica,
            "batch_requests": reply.batch_requests,
        }
        if reply.video is not None:
            info["video"] = reply.video  # uint8 [B, T, H, W, 3], one row per session
        return rldx_requests.action_reply(self.embodiment.split_actions(reply.actions), info)

    async def reset(self, client: str, session_ids: list[str] | None, tenant: str = DEFAULT_TENANT) -> dict:
        """Restart the caller's sessions (without ids: those it is remembered to hold, at most
        MAX_SESSIONS_PER_CLIENT); rate-limited per tenant (RESETS_PER_S, 429 past it)."""
        bucket = self._reset_buckets.get(tenant)
        if bucket is None:
            bucket = self._reset_buckets[tenant] = TokenBucket(RESETS_PER_S, RESET_BURST)
            while len(self._reset_buckets) > MAX_REMEMBERED_CLIENTS:
                self._reset_buckets.pop(next(iter(self._reset_buckets)))
        wait = bucket.take()
        if wait > 0:
            raise QuotaExceeded(
                f"tenant {tenant!r} is over {RESETS_PER_S:g} resets/s on this door; retry after {wait:.2f} s",
                "resets_per_s",
                wait,
            )
        if session_ids is not None and len(session_ids) > MAX_SESSIONS_PER_CLIENT:
            raise InvalidObservation(
                f"reset names {len(session_ids)} sessions; at most {MAX_SESSIONS_PER_CLIENT} per call",
                field="options.session_ids",
            )
        known = self._known((tenant, client))
        names = list(known) if session_ids is None else session_ids
        by_route: dict[str, list[str]] = {}
        for name in names:
            model_id = model_session_id(client, name)
            by_route.setdefault(known.get(name, model_id), []).append(model_id)
        for route, model_ids in by_route.items():
            await self.runner.reset_sessions(route, model_ids, self.zcfg.request_timeout_s, tenant)
        return {"cleared_sessions": names}

    async def modality_config(self) -> dict:
        info = await self.runner.model_info()
        emb = self.embodiment
        short = lambda keys: [k.split(".", 1)[1] for k in keys]  # noqa: E731 - `video.cam` -> `cam`
        return {
            "video": rldx.ModalityConfig(list(emb.frame_offsets), short(emb.video_keys)),
            "state": rldx.ModalityConfig([0], short(emb.state_keys)),
            "action": rldx.ModalityConfig(list(range(info.action_horizon)), short(emb.action_keys)),
            "language": rldx.ModalityConfig([0], [emb.language_key]),
        }

    def _remember(self, client: tuple[str, str], session_ids: list[str], route_key: str) -> None:
        """Note the sessions a request of `client` holds on the Policy (bounded: MAX_SESSIONS_PER_CLIENT per client,
        MAX_REMEMBERED_SESSIONS and MAX_REMEMBERED_CLIENTS in all, least recently used forgotten first)."""
        known = self.sessions.pop(client, None) or OrderedDict()
        now = time.monotonic()
        self._remembered -= len(known)
        for sid in session_ids:
            known.pop(sid, None)
            known[sid] = (route_key, now)
        while len(known) > MAX_SESSIONS_PER_CLIENT:
            known.popitem(last=False)
        self.sessions[client] = known
        self._remembered += len(known)
        while len(self.sessions) > MAX_REMEMBERED_CLIENTS or self._remembered > MAX_REMEMBERED_SESSIONS:
            oldest = self.sessions[next(iter(self.sessions))]
            if len(self.sessions) > MAX_REMEMBERED_CLIENTS or len(oldest) <= 1:
                self._remembered -= len(self.sessions.popitem(last=False)[1])
            else:
                oldest.popitem(last=False)
                self._remembered -= 1

    def _known(self, client: tuple[str, str]) -> dict[str, str]:
        """The client's remembered sessions -> routing key, less those idle past REMEMBER_IDLE_S (forgotten)."""
        known = self.sessions.get(client)
        if not known:
            return {}
        cutoff = time.monotonic() - REMEMBER_IDLE_S
        for sid in [sid for sid, (_, at) in known.items() if at < cutoff]:
            del known[sid]
            self._remembered -= 1
        return {sid: route for sid, (route, _) in known.items()}

    def remembered(self) -> int:
        """Sessions the door remembers in all (for tests and the operator)."""
        return self._remembered

    # --- the socket -------------------------------------------------------------------------------------------------
    def bind(self):
        """A bound ROUTER socket of pyzmq's asyncio flavour; ZMQ itself drops messages over the size limit.

        With `zmq.curve` the socket is a CURVE server (every byte encrypted; a peer without the server's public key, or
        a plain one, never completes the handshake), and with an allow-list of client keys a ZAP handler refuses every
        other key during the handshake, before a message reaches `handle`. The handler lives on a context of the
        door's own (ZAP is one handler per context), bound before the socket, so no handshake escapes it.
        """
        import zmq
        import zmq.asyncio

        curve = self.zcfg.curve
        allowed = curve_allowed_clients(curve) if curve is not None else None
        ctx = zmq.asyncio.Context.instance()
        if allowed is not None:
            ctx = self._zap_context = zmq.asyncio.Context()
            self._zap = start_zap(ctx, allowed)
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, self.zcfg.max_message_bytes)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a reply to a peer that left is dropped, not an error
        if curve is not None:
            public, sock.curve_secretkey = curve_server_keys(curve)
            sock.curve_publickey = public
            sock.curve_server = True
            who = "any client with the server key" if allowed is None else f"{len(allowed)} client keys"
            log.info("ZMQ door: CURVE, server public key %s, lets in %s", public.decode(), who)
        sock.bind(f"tcp://{self.zcfg.host}:{self.zcfg.port}")
        return sock

    async def serve(self, sock) -> None:
        """Receive forever; each message is answered by its own task so requests of many robots batch together."""
        tasks: set[asyncio.Task] = set()
        killed = asyncio.ensure_future(self.killed.wait())
        try:
            while True:
                recv = asyncio.ensure_future(sock.recv_multipart(copy=True))
                await asyncio.wait({recv, killed}, return_when=asyncio.FIRST_COMPLETED)
                if not recv.done():
                    recv.cancel()
                    break
                frames = recv.result()
                if len(frames) < 3 or frames[-2] != b"":
                    log.warning("dropping a ZMQ message of %d frames that is not from a REQ/DEALER peer", len(frames))
                    continue
                task = asyncio.create_task(self._answer(sock, frames[:-1], frames[-1]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            killed.cancel()
            if tasks:  # let replies in flight (e.g. the kill acknowledgement) leave
                await asyncio.wait(tasks, timeout=5.0)
            sock.close(linger=0)
            if self._zap is not None:
                self._zap.stop()
                self._zap_context.destroy(linger=0)

    async def _answer(self, sock, envelope: list[bytes], payload: bytes) -> None:
        reply = await self.handle(envelope[0], payload)
        try:
            await sock.send_multipart([*envelope, reply])
        except Exception as exc:  # noqa: BLE001 - the peer may be gone; nothing else to do
            log.warning("could not send a ZMQ reply: %s", type(exc).__name__)


def curve_server_keys(curve: ZmqCurveArgs, field_prefix: str = "zmq.curve.") -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys of the server, read now from `secret_key_file` or `secret_key_env`; ConfigError
    naming the field. The door reads them when it binds; `serve run` once before any replica starts."""
    import os

    import zmq

    from dreamzero_client import zmq_keys

    if not zmq.has("curve"):
        raise ConfigError("this pyzmq's libzmq was built without CURVE (libsodium); install the pyzmq wheel")
    if curve.secret_key_file is not None:
        return zmq_keys.read_secret_key(curve.secret_key_file, f"{field_prefix}secret_key_file")
    value = os.environ.get(curve.secret_key_env or "", "").strip()
    if not value:
        raise ConfigError(f"{field_prefix}secret_key_env names {curve.secret_key_env!r}, which is unset or empty here")
    secret = zmq_keys.check_key(value, f"{field_prefix}secret_key_env (${curve.secret_key_env})")
    return zmq.curve_public(secret), secret


def curve_allowed_clients(curve: ZmqCurveArgs, field_prefix: str = "zmq.curve.") -> frozenset[bytes] | None:
    """The Z85 public keys let in (`client_keys` and the certificates in `client_keys_dir`, read now), or None when
    any client with the server's public key may enter. A `client_keys_dir` that is missing or holds no certificate is
    a ConfigError: an allow-list that lets nobody in is a mistake, never "anyone"."""
    from pathlib import Path

    from dreamzero_client import zmq_keys

    keys = [zmq_keys.check_key(k, f"{field_prefix}client_keys") for k in curve.client_keys]
    folder = curve.client_keys_dir
    if folder is not None:
        if not Path(folder).is_dir():
            raise ConfigError(
                f"{folder!r} is not a directory: point {field_prefix}client_keys_dir at one or set it to null"
            )
        certificates = sorted(Path(folder).expanduser().glob("*.key"))
        found = [zmq_keys.read_public_key(p, f"{field_prefix}client_keys_dir ({p.name})") for p in certificates]
        if not found:
            raise ConfigError(f"{field_prefix}client_keys_dir {folder!r} holds no client certificate (*.key)")
        keys += found
    return frozenset(keys) if keys else None


def start_zap(ctx, allowed: frozenset[bytes]):
    """A ZAP handler on `ctx` that lets in the CURVE clients whose Z85 public key is in `allowed` (ZAP status 400 to
    the others, which their client sees as a refused handshake). Each refused key is logged once: a refused peer
    reconnects every few hundred milliseconds."""
    from zmq.auth.asyncio import AsyncioAuthenticator

    refused: set[bytes] = set()

    class AllowList:
        def callback(self, domain: str, key: bytes) -> bool:
            if key in allowed:
                return True
            if key not in refused and len(refused) < 1024:
                refused.add(key)
                log.warning("ZMQ door refused a CURVE client key not in zmq.curve.client_keys: %s", key.decode())
            return False

    auth = AsyncioAuthenticator(ctx, log=logging.getLogger("dreamzero.serve.zmq.zap"))
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=AllowList())
    return auth


class ZmqIngressDeployment:
    """The Serve deployment around `ZmqDoor`: binds the socket when the replica starts and serves on its event loop.

    The constructor is a coroutine (Serve awaits `async __init__` on the replica's loop), so the receive loop is a
    task of that loop and awaits the graph's handles like any request handler.
    """

    async def __init__(self, preprocess: Any, policy: Any, postprocess: Any, settings: ZmqDoorSettings):
        configure_info_log(log.name)  # Serve sets up only its own logger: the door's INFO lines would be dropped
        configure_audit_log()
        self.door = ZmqDoor(GraphRunner(preprocess, policy, postprocess, settings.graph), settings)
        self._sock = self.door.bind()
        self._task = asyncio.get_running_loop().create_task(self.door.serve(self._sock))
        log.info("ZMQ front door listening on tcp://%s:%d", self.door.zcfg.host, self.door.zcfg.port)

    def ready(self) -> bool:
        return not self._task.done() and not self.door.killed.is_set()

    def reconfigure(self, user_config: dict | None, rank: object = None) -> None:
        """Serve's `user_config` of ZmqIngress: keys and quotas, applied without replacing the replica. `rank` is
        unused: taking it makes Serve call this when a deploy removes `user_config` (None: back to `args`)."""
        self.door.reconfigure(user_config)

    def check_health(self) -> None:
        # a killed door is unhealthy too: Serve replaces the replica, and the new one binds the port again
        if self.door.killed.is_set():
            raise RuntimeError("the ZMQ door was closed by `kill`; this replica is to be replaced")
        if self._task.done():
            raise RuntimeError(f"the ZMQ receive loop stopped: {self._task.exception()!r}")


#: quotas the door's process checks (the graph runner's, and `reset`'s rate); the Policy audits its session quotas
DOOR_QUOTAS = ("requests_per_s", "max_rows_per_request", "resets_per_s")


def door_refusal(exc: BaseException) -> bool:
    """Did the door's process refuse this request itself (an audit line `refuse ... at=zmq/<endpoint>`)? Not the
    Policy's refusals, which the Policy audits: one line per refusal."""
    if isinstance(exc, QuotaExceeded):
        return exc.quota in DOOR_QUOTAS
    return isinstance(exc, (Unauthorized, PayloadTooLarge, DoorBusy))


class DoorBusy(CapacityError):
    """The door has `zmq.max_in_flight` requests in flight (503, `no_capacity`, as any CapacityError)."""


def read_token(payload: bytes) -> str | None:
    """The `api_token` of an RLDX request, read without building its `data` (skipped in C, nothing allocated):
    a caller without a key costs the door no memory. InvalidRequest when the message is not a msgpack map of a few
    string keys or its token / endpoint is not a short string."""
    # streamed from the bytes in small reads: the unpacker's buffer holds at most the largest single value (an
    # array's bytes), never the message's many small values at once
    unpacker = msgpack.Unpacker(
        _Chunks(payload),
        raw=False,
        read_size=min(64 * 1024, max(1, len(payload))),
        max_buffer_size=max(1, len(payload)),
        max_str_len=MAX_HEADER_STR,
        max_map_len=REQUEST_KEYS,
    )
    token = None
    try:
        n = unpacker.read_map_header()
        if n > REQUEST_KEYS:
            raise InvalidRequest(f"a request is a map {{endpoint, data, api_token}}; this one has {n} keys")
        for _ in range(n):
            key = _short_str(unpacker, payload, "a request map's keys must be short strings")
            if key == "api_token":
                token = _short_str(unpacker, payload, "'api_token' must be a string", nil_ok=True)
            elif key == "endpoint":
                _short_str(unpacker, payload, "'endpoint' must be a string", nil_ok=True)
            else:
                unpacker.skip()
    except InvalidRequest:
        raise
    except Exception as exc:  # noqa: BLE001 - garbage bytes from the network
        raise InvalidRequest(f"the message is not a msgpack RLDX request ({type(exc).__name__})") from None
    return token


class _Chunks:
    """`payload` as a file read in chunks by Python code: between two chunks the interpreter may hand the GIL to the
    event loop (the unpacker's C loop over a chunk holds it), so skipping a large `data` never stalls the loop."""

    def __init__(self, payload: bytes):
        self._view, self._at = memoryview(payload), 0

    def read(self, n: int) -> bytes:
        chunk = self._view[self._at : self._at + n]
        self._at += len(chunk)
        return bytes(chunk)


def _short_str(unpacker: msgpack.Unpacker, payload: bytes, message: str, nil_ok: bool = False) -> str | None:
    """The next value when it is a string (or nil when `nil_ok`): its first byte is checked before it is read."""
    at = unpacker.tell()
    first = payload[at] if at < len(payload) else None
    is_str = first is not None and (0xA0 <= first <= 0xBF or first in (0xD9, 0xDA, 0xDB))
    if not is_str and not (nil_ok and first == 0xC0):
        raise InvalidRequest(message)
    return unpacker.unpack()


def bounded_unpack(payload: bytes, limits: DecodeLimits) -> Any:
    """`rldx.unpack` within `limits`: the unpacker's own length limits and a count of every value built."""
    budget = Budget(limits)
    n = limits.max_container_len

    def pairs_hook(pairs: list) -> Any:
        return rldx._decode_custom(budget.pairs_hook(pairs))  # the RLDX tags: ndarrays, configs

    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False, list_hook=budget.list_hook,
                               object_pairs_hook=pairs_hook, max_array_len=n, max_map_len=n)  # fmt: skip
    except InvalidRequest:
        raise
    except ValueError as exc:
        if "exceeds max_" in str(exc):
            raise InvalidRequest(f"the message holds a list or map longer than {n} items (max_container_len)") from None
        raise InvalidRequest(f"the message is not a msgpack RLDX request ({type(exc).__name__})") from None
    except Exception as exc:  # noqa: BLE001 - garbage bytes from the network
        raise InvalidRequest(f"the message is not a msgpack RLDX request ({type(exc).__name__})") from None
