"""Tenants: the API keys that say who calls, the session namespace of each tenant, and its quotas.

1. Keys. `api_keys:` maps a tenant name to the sha256 digest of its key (`team-a: "sha256:<hex>"`, or a list of
   digests while a key is being rotated); `api_keys_file:` holds the same mapping in a YAML / JSON file that the doors
   read again when its modification time changes; the legacy single `api_key` is the tenant `default`. A presented
   key is hashed and compared with `hmac.compare_digest` against every digest of the table (no early exit), so the
   time taken says nothing about which entry or how much of it matched. No key is kept or logged in clear: the
   settings carry digests only. No key configured at all: every caller is the tenant `default`.
2. Namespaces. A session is (tenant, session id): `scoped_id` makes the one id the model and the session router see,
   `split_scoped` gives the tenant and its own id back. The tenant `default` keeps its ids as they are (a single-key
   server is unchanged); another tenant's ids become `@<tenant>/<id>`, and a `default` id that itself starts with
   `@` is escaped as `@@...`, so no id of one tenant can name a session of another.
3. Quotas. Requests per second (a token bucket per front-door replica) and rows per request are checked by the
   graph runner before a request leaves the door; live sessions per replica and in total travel with the request
   (`SessionLimits`) and are checked by the Policy replica's session store, which alone knows whether a session is
   new; the total across replicas comes from `deployments.tenant_ledger` (docs/serving.md, "Tenants and TLS").
4. Audit. One line per session start, reset, eviction, end and refusal on the `dreamzero.audit` logger, naming the
   tenant and the reason; never a key, never a payload; a session id escaped so it cannot forge a line
   (deployments.audit, which also says where the log goes).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import Field, ValidationError

from deployments.audit import audit_log, field
from deployments.config.sections import TENANT_NAME, TENANT_NAME_RULE, Strict, TenantQuotaArgs, TenantsArgs
from dreamzero.errors import ConfigError, QuotaExceeded

log = logging.getLogger("dreamzero.serve.tenants")

DEFAULT_TENANT = "default"
DIGEST_PREFIX = "sha256:"
#: a scoped id: `@<tenant>/<id>`; a default-tenant id starting with `@` is escaped as `@@<id>`
SCOPE_MARK, SCOPE_SEP = "@", "/"
#: label of requests refused before a tenant was known (a missing or wrong key)
UNAUTHENTICATED = "unauthenticated"


# 1. Keys --------------------------------------------------------------------------------------------------------------


def key_digest(key: str) -> str:
    """`"sha256:<hex>"` of a key: what `api_keys` holds (`printf %s "$KEY" | sha256sum` gives the same hex)."""
    return DIGEST_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def _digest(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.startswith(DIGEST_PREFIX):
        raise ConfigError(f"{where}: give the key's digest as 'sha256:<64 hex digits>', not the key itself")
    hexpart = value[len(DIGEST_PREFIX) :].lower()
    if len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise ConfigError(f"{where}: 'sha256:' must be followed by 64 hex digits (printf %s \"$KEY\" | sha256sum)")
    return DIGEST_PREFIX + hexpart


def parse_key_table(entries: Any, where: str = "api_keys") -> dict[str, tuple[str, ...]]:
    """`{tenant: "sha256:<hex>" | [digests]}` -> `{tenant: (digest, ...)}`; ConfigError naming `where.<tenant>`."""
    if entries is None:
        return {}
    if not isinstance(entries, Mapping):
        raise ConfigError(f"{where}: must map tenant names to 'sha256:<hex>' key digests, got {type(entries).__name__}")
    table: dict[str, tuple[str, ...]] = {}
    owner: dict[str, str] = {}
    for tenant, value in entries.items():
        if not isinstance(tenant, str) or not TENANT_NAME.match(tenant):
            raise ConfigError(f"{where}: tenant name {tenant!r}: use {TENANT_NAME_RULE}")
        values = value if isinstance(value, (list, tuple)) else [value]
        if not values:
            raise ConfigError(f"{where}.{tenant}: give at least one key digest")
        digests = tuple(_digest(v, f"{where}.{tenant}" if len(values) == 1 else f"{where}.{tenant}[{i}]")
                        for i, v in enumerate(values))  # fmt: skip
        for d in digests:
            if owner.setdefault(d, tenant) != tenant:
                raise ConfigError(f"{where}.{tenant}: this key is also the key of {owner[d]!r}; one key, one tenant")
        table[tenant] = digests
    return table


def read_key_file(path: str) -> dict[str, tuple[str, ...]]:
    """The key table in a YAML or JSON file (a JSON document is YAML too); ConfigError naming the file and entry."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            entries = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"api_keys_file {path!r}: cannot read it ({exc.strerror or type(exc).__name__})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"api_keys_file {path!r}: not YAML or JSON{at}") from None
    return parse_key_table(entries if entries is not None else {}, f"api_keys_file {path!r}")


class KeyTable:
    """Key digests -> tenant. `identify` hashes the presented key once and compares it with every digest."""

    def __init__(self, table: Mapping[str, Iterable[str]]):
        self._entries = [(t, bytes.fromhex(d[len(DIGEST_PREFIX) :])) for t, ds in table.items() for d in ds]
        self.tenants = frozenset(table)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def identify(self, key: str | None) -> str | None:
        presented = hashlib.sha256((key or "").encode()).digest()
        found = None
        for tenant, digest in self._entries:  # every entry, whatever matched before: constant work per table
            if hmac.compare_digest(presented, digest) and found is None:
                found = tenant
        return found if key else None


class TenantKeys:
    """A front door's key check: the legacy key (tenant `default`), the `api_keys` table (or the one of the door's
    `user_config`) and the file's, which is read again when its modification time changes (looked at most every
    `reload_s`). A file that turns bad keeps the last good table and logs why (the entry, never a key)."""

    def __init__(self, static: Mapping[str, tuple[str, ...]], path: str | None = None, reload_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, legacy: str | None = None):  # fmt: skip
        self.path, self.reload_s, self._clock = path, reload_s, clock
        self._legacy = {} if legacy is None else {DEFAULT_TENANT: (legacy,)}
        # fixed at start: a live change never turns auth off
        self.required = bool(static) or path is not None or legacy is not None
        self._args = self._static = dict(static)
        self._from_file: dict[str, tuple[str, ...]] = {}
        self._stamp: tuple | None = None
        self._checked = -math.inf
        if path is not None:
            self._from_file, self._stamp = read_key_file(path), self._file_stamp()
            self._checked = clock()
        self._table = self._merge()

    @classmethod
    def from_settings(cls, auth) -> TenantKeys:
        return cls(auth.api_keys, auth.api_keys_file, auth.reload_s, legacy=auth.api_key_digest)

    def replace_static(self, table: Mapping[str, tuple[str, ...]] | None) -> None:
        """A door's live `user_config` `api_keys` (already validated) replaces the `args` table; None: back to it."""
        self._static = dict(self._args if table is None else table)
        self.required = self.required or bool(self._static)
        self._table = self._merge()

    def tenants(self) -> frozenset[str]:
        """The tenants that have a key now (empty when no key is configured)."""
        self._maybe_reload()
        return self._table.tenants

    def identify(self, key: str | None) -> str | None:
        """The tenant `key` belongs to; None for a missing or unknown key (`default` when no key is configured)."""
        self._maybe_reload()
        if not self.required:
            return DEFAULT_TENANT
        return self._table.identify(key)

    def _merge(self) -> KeyTable:
        clash = sorted(set(self._static) & set(self._from_file))
        if clash:  # the file wins: it is what an operator edits to rotate
            log.warning("tenant(s) %s have keys in both api_keys and api_keys_file: the file's are used", clash)
        return KeyTable({**self._legacy, **self._static, **self._from_file})

    def _file_stamp(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _maybe_reload(self) -> None:
        if self.path is None or self._clock() - self._checked < self.reload_s:
            return
        self._checked = self._clock()
        stamp = self._file_stamp()
        if stamp is None or stamp == self._stamp:
            if stamp is None and self._stamp is not None:
                log.error("api_keys_file %r is gone; keeping the keys read last", self.path)
                self._stamp = None
            return
        self._stamp = stamp
        try:
            table = read_key_file(self.path)
        except ConfigError as exc:
            log.error("%s; keeping the keys read last", exc)
            return
        self._from_file = table
        self._table = self._merge()
        log.info("api_keys_file %r read again: %d tenant(s)", self.path, len(self._table.tenants))


# 2. Namespaces --------------------------------------------------------------------------------------------------------


def scoped_id(tenant: str, session_id: str) -> str:
    """The id the model and the router see for a tenant's session id (the `default` tenant's ids stay as they are)."""
    if tenant == DEFAULT_TENANT:
        return SCOPE_MARK + session_id if session_id.startswith(SCOPE_MARK) else session_id
    return f"{SCOPE_MARK}{tenant}{SCOPE_SEP}{session_id}"


def split_scoped(model_id: str) -> tuple[str, str]:
    """`scoped_id`'s inverse: (tenant, the client's own id)."""
    if not model_id.startswith(SCOPE_MARK):
        return DEFAULT_TENANT, model_id
    if model_id.startswith(SCOPE_MARK * 2):
        return DEFAULT_TENANT, model_id[1:]
    tenant, sep, own = model_id[1:].partition(SCOPE_SEP)
    return (tenant, own) if sep else (DEFAULT_TENANT, model_id)


def tenant_of(model_id: str) -> str:
    """The tenant of a scoped session id (the session store's `group_of`)."""
    return split_scoped(model_id)[0]


# 3. Quotas ------------------------------------------------------------------------------------------------------------


class TokenBucket:
    """`rate` tokens a second, at most `burst` saved; `take()` -> 0.0 when a token was taken, else the seconds until
    one will be there (nothing taken)."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self._clock = float(rate), float(burst), clock
        self.tokens, self._at = float(burst), clock()

    def take(self) -> float:
        now = self._clock()
        self.tokens = min(self.burst, self.tokens + (now - self._at) * self.rate)
        self._at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


@dataclass(frozen=True)
class SessionLimits:
    """A tenant's session quotas, sent with each of its requests to the Policy replica that checks them."""

    tenant: str
    per_replica: int | None = None
    total: int | None = None


class TenantQuotas:
    """One front-door replica's view of the quotas: per-tenant token buckets, rows, and the session limits it sends
    on. Buckets are per door replica: with N ingress replicas a tenant gets up to N x requests_per_s."""

    def __init__(self, args: TenantsArgs, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.args = self._start = args
        self._buckets: dict[str, tuple[TenantQuotaArgs, TokenBucket]] = {}

    def update(self, args: TenantsArgs | None) -> None:
        """A live change (the door's `user_config`; None: back to `args`). A tenant whose rate changed starts with a
        full bucket."""
        self.args = self._start if args is None else args

    def quota(self, tenant: str) -> TenantQuotaArgs:
        return self.args.for_tenant(tenant)

    def admit(self, tenant: str, rows: int) -> None:
        """Raise QuotaExceeded when a request of `rows` sessions is over the tenant's rows or rate quota."""
        q = self.quota(tenant)
        if q.max_rows_per_request is not None and rows > q.max_rows_per_request:
            raise QuotaExceeded(
                f"tenant {tenant!r} may send at most {q.max_rows_per_request} sessions per request "
                f"(max_rows_per_request), this request holds {rows}; split it",
                "max_rows_per_request",
            )
        if q.requests_per_s is None:
            self._buckets.pop(tenant, None)
            return
        held = self._buckets.get(tenant)
        if held is None or held[0] != q:
            burst = q.burst if q.burst is not None else max(1, math.ceil(q.requests_per_s))
            held = self._buckets[tenant] = (q, TokenBucket(q.requests_per_s, burst, self._clock))
        wait = held[1].take()
        if wait > 0:
            raise QuotaExceeded(
                f"tenant {tenant!r} is over its rate of {q.requests_per_s:g} requests/s (requests_per_s); retry "
                f"after {wait:.2f} s",
                "requests_per_s",
                wait,
            )

    def session_limits(self, tenant: str) -> SessionLimits | None:
        q = self.quota(tenant)
        if q.max_sessions_per_replica is None and q.max_sessions is None:
            return None
        return SessionLimits(tenant, q.max_sessions_per_replica, q.max_sessions)


class DoorTenantConfig(Strict):
    """A front door's `user_config` (Ingress, ZmqIngress): keys and quotas changed without replacing a replica.
    Each field given replaces its `args` value; absent: the `args` value (the `user_config` is the whole live state,
    as the Policy's)."""

    api_keys: dict[str, Any] | None = Field(None, description="tenant -> 'sha256:<hex>' (or a list), as in args.")
    tenants: TenantsArgs | None = Field(None, description="Quotas, as `args.tenants`.")


def parse_door_config(config: Mapping | None) -> tuple[dict[str, tuple[str, ...]] | None, TenantsArgs | None]:
    """Validate a door's `user_config` -> (key table or None, quotas or None); ConfigError names the field."""
    try:
        parsed = DoorTenantConfig.model_validate(dict(config or {}))
    except ValidationError as err:
        e = err.errors()[0]
        where = ".".join(str(p) for p in e["loc"])
        msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        raise ConfigError(f"invalid front-door user_config: user_config.{where}: {msg}") from None
    keys = None if parsed.api_keys is None else parse_key_table(parsed.api_keys, "user_config.api_keys")
    return keys, parsed.tenants


# 4. Audit -------------------------------------------------------------------------------------------------------------

#: restart reasons that begin a new session state (a start) or come from the client's reset; the rest are the model's
#: own restarts (window_full, single_frame, prompt_changed) of a session that goes on
START_REASONS = ("new_session", "evicted", "step_mismatch")
RESET_REASONS = ("reset_requested",)


def audit(event: str, model_id: str, replica: str, detail: str | None = None) -> None:
    """One audit line: `session <event> tenant=<t> session=<own id> replica=<r> [reason|cause=...]`; the id and the
    tenant written by `deployments.audit.field` (escaped unless plain)."""
    tenant, own = split_scoped(model_id)
    extra = f" {detail}" if detail else ""
    audit_log.info("session %s tenant=%s session=%s replica=%s%s", event, field(tenant), field(own), replica, extra)


class RefusalLines:
    """At most one audit line per (tenant, door, reason) a second: a flood of refused requests (a tenant over its
    rate, a caller without a key) must not grow the audit log or cost the door more than the refusal itself. The
    first refusal of a second is written at once; the ones after it are counted into the next line (`repeated=<n>`).
    Bounded: at most `MAX_KEYS` keys are remembered (the least recently written forgotten first)."""

    MAX_KEYS = 4096

    def __init__(self, every_s: float = 1.0, clock=time.monotonic):
        self.every_s, self.clock = every_s, clock
        self._last: dict[tuple[str, str, str], tuple[float, int]] = {}
        self._lock = threading.Lock()

    def admit(self, key: tuple[str, str, str]) -> int | None:
        """The count of refusals folded into this line, or None: fold this one into a later line."""
        now = self.clock()
        with self._lock:
            last, held = self._last.get(key, (float("-inf"), 0))
            if now - last < self.every_s:
                self._last[key] = (last, held + 1)
                return None
            self._last.pop(key, None)
            self._last[key] = (now, 0)
            while len(self._last) > self.MAX_KEYS:
                self._last.pop(next(iter(self._last)))
            return held


_refusal_lines = RefusalLines()


def audit_refusal(tenant: str, where: str, exc: BaseException, rows: int | None = None) -> None:
    """One audit line for a refused request: `refuse tenant=<t> at=<where> reason=<code>[:<quota>] [rows=<n>]
    [repeated=<n>]` (the error's code and quota name, never its message, which may echo the request); repeats of the
    same tenant, door and reason within a second are counted into the next line (`RefusalLines`)."""
    code = getattr(exc, "code", None) or type(exc).__name__
    quota = getattr(exc, "quota", None)
    reason = f"{code}:{quota}" if quota else code
    held = _refusal_lines.admit((tenant, where, reason))
    if held is None:
        return
    n = "" if rows is None else f" rows={rows}"
    more = f" repeated={held}" if held else ""
    audit_log.info("refuse tenant=%s at=%s reason=%s%s%s", field(tenant), field(where), field(reason), n, more)


def audit_reports(reports: Iterable[Any], replica: str) -> None:
    """Audit lines for the session starts and client resets among a model call's reports."""
    for r in reports:
        if not r.restarted:
            continue
        if r.restart_reason in START_REASONS:
            audit("start", r.session_id, replica, f"reason={r.restart_reason}")
        elif r.restart_reason in RESET_REASONS:
            audit("reset", r.session_id, replica, f"reason={r.restart_reason}")
