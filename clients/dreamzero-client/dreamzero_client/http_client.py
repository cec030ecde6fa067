"""HTTP client for `POST /v1/actions/generations` (ours, and any sglang-compatible action server).

    with ActionClient("http://127.0.0.1:8000") as client:
        client.wait_until_ready(timeout_s=300)
        result = client.generate(obs, "pick up the cube", session_ids="episode-0")
        result.actions  # float32 [B, H, D]

Session continuity, retries, errors and TLS: docs/clients.md ("HTTP: `ActionClient`"). Needs the `http` extra.
"""

from __future__ import annotations

import email.utils
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from dreamzero_client import tls
from dreamzero_client.errors import (
    AuthenticationError,
    BadRequestError,
    InvalidRequest,
    MissingDependency,
    ProtocolError,
    QuotaExceededError,
    ReadyTimeout,
    ServerError,
    ServerUnavailableError,
)
from dreamzero_client.tls import is_loopback
from dreamzero_client.wire import codec, generations, replies, routes

try:
    import httpx
except ImportError as _missing:  # the `http` extra is not installed: ActionClient names it when it is made
    httpx, _HTTPX_MISSING = None, _missing

log = logging.getLogger("dreamzero.clients.http")

RETRY_STATUSES = frozenset({500, 502, 503, 504})
#: restart reasons a client causes itself; any other restart of a known session is worth a warning
_EXPECTED_RESTARTS = ("new_session", "reset_requested", "prompt_changed")


@dataclass
class ActionResult:
    """One chunk of actions for B sessions."""

    actions: np.ndarray  # float32 [B, H, D]: robot actions (raw form) or normalised, padded actions (normalised)
    sessions: list[dict]  # per row: session_id, step, restarted, restart_reason, frame_position
    timings: dict[str, float] = field(default_factory=dict)  # ms per server stage
    response: dict = field(default_factory=dict)  # the decoded reply, as sent
    form: str | None = None
    video: np.ndarray | None = None  # uint8 [B, T, H, W, 3] predicted frames (generate(return_video=True))


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a `Retry-After` header (delta-seconds or an HTTP date); None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class ActionClient:
    """Client of `POST /v1/actions/generations`, `GET /health`, `/v1/actions/metadata`, `/v1/models`.

    `timeout_s` bounds each attempt; the k-th of `max_retries` retries waits `backoff_s * k` s or the server's
    `Retry-After` (at most `max_backoff_s`). `ca_bundle`: PEM file of the CA(s) an https:// server chains to.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 5,
        backoff_s: float = 1.0,
        msgpack: bool = True,
        model: str = "dreamzero",
        max_backoff_s: float = 60.0,
        ca_bundle: str | os.PathLike | None = None,
    ):
        if httpx is None:
            raise MissingDependency(
                f"ActionClient needs httpx ({_HTTPX_MISSING}): pip install 'dreamzero-client[http]'"
            ) from _HTTPX_MISSING
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url must look like 'http://host:port' or 'https://host:port', got {base_url!r}")
        tls.check_scheme(parts.scheme, ca_bundle, "base_url")
        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0:
            raise ValueError("timeout_s must be > 0, max_retries and backoff_s >= 0")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.model = model
        self.flavour = codec.OPENPI if msgpack else codec.JSON
        headers = {"Accept": codec.content_type_for(self.flavour), "User-Agent": "dreamzero-client"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        # trust_env=False ignores HTTP(S)_PROXY for loopback servers; remote ones keep the environment's proxy rules.
        # No redirects: a 3xx to http:// must not carry the key and the observations away from TLS.
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(self.timeout_s),
            trust_env=not is_loopback(parts.hostname),
            follow_redirects=False,
            **({"verify": tls.client_context(ca_bundle)} if parts.scheme == "https" else {}),
        )
        self._steps: dict[str, int] = {}  # session id -> step of its last reply
        self._incarnations: dict[str, str] = {}  # session id -> incarnation of its last reply (echoed back)
        self._pending_resets: set[str] = set()

    def reset_sessions(self, session_ids: str | Sequence[str]) -> None:
        """Mark sessions so the next `generate` that includes them sets their `reset_mask` row."""
        ids = [session_ids] if isinstance(session_ids, str) else list(session_ids)
        self._pending_resets.update(ids)
        for sid in ids:
            self._steps.pop(sid, None)
            self._incarnations.pop(sid, None)

    def forget_sessions(self, session_ids: str | Sequence[str]) -> None:
        """Drop local bookkeeping for finished sessions (the server evicts them on its own)."""
        for sid in [session_ids] if isinstance(session_ids, str) else session_ids:
            self._steps.pop(sid, None)
            self._incarnations.pop(sid, None)
            self._pending_resets.discard(sid)

    @property
    def session_steps(self) -> dict[str, int]:
        return dict(self._steps)

    def generate(
        self,
        observation: Mapping[str, Any],
        prompts: str | Sequence[str],
        session_ids: str | Sequence[str],
        form: str = "raw",
        reset: bool | Sequence[bool] | None = None,
        seed: int | Sequence[int] | None = None,
        negative_prompts: str | Sequence[str] | None = None,
        routing_key: str | None = None,
        timeout_s: float | None = None,
        expected_steps: Sequence[int | None] | None = None,
        expected_incarnations: Sequence[str | None] | None = None,
        rtc_prefix_len: int | Sequence[int | None] | None = None,
        rtc_exec_horizon: int | Sequence[int | None] | None = None,
        action_prefix: Any = None,
        return_video: bool = False,
        traffic_class: str | Sequence[str] | None = None,
        deadline_ms: float | Sequence[float | None] | None = None,
        observed_at: float | Sequence[float | None] | None = None,
    ) -> ActionResult:
        """One action chunk for every session in `session_ids` (observation arrays carry a leading batch dim B).

        `expected_steps` / `expected_incarnations` (per row) replace what the client tracked, for a caller that
        keeps continuity itself. The RTC and fleet arguments (docs/rtc.md, docs/fleet.md: sent only when given) take
        one value for every row or one per row.
        """
        ids = [session_ids] if isinstance(session_ids, str) else list(session_ids)
        b = len(ids)
        if b == 0:
            raise ValueError("session_ids must name at least one session")
        prompt_list = [prompts] * b if isinstance(prompts, str) else list(prompts)
        if len(prompt_list) != b:
            raise ValueError(f"got {len(prompt_list)} prompts for {b} sessions")
        if reset is None or isinstance(reset, bool):
            mask = [bool(reset)] * b
        else:
            mask = [bool(r) for r in reset]
            if len(mask) != b:
                raise ValueError(f"reset has {len(mask)} entries for {b} sessions")
        mask = [m or sid in self._pending_resets for m, sid in zip(mask, ids)]
        expected = list(expected_steps) if expected_steps is not None else [self._steps.get(s) for s in ids]
        known = [self._incarnations.get(s) for s in ids]
        incarnations = list(expected_incarnations) if expected_incarnations is not None else known
        if len(expected) != b or len(incarnations) != b:
            raise ValueError(f"expected_steps / expected_incarnations need {b} entries, one per session")
        expected = [None if m else s for m, s in zip(mask, expected)]
        incarnations = [None if m else s for m, s in zip(mask, incarnations)]
        negatives = [negative_prompts] * b if isinstance(negative_prompts, str) else negative_prompts
        body = generations.build_request_body(
            observation,
            prompt_list,
            ids,
            form=form,
            reset_mask=mask,
            negative_prompts=negatives,
            seed=seed,
            expected_steps=expected if any(s is not None for s in expected) else None,
            expected_incarnations=incarnations if any(s is not None for s in incarnations) else None,
            routing_key=routing_key,
            model=self.model,
            output_format="numpy" if self.flavour != codec.JSON else "list",
            return_video=return_video,
        )
        body["parameters"].update(self._rtc_parameters(b, rtc_prefix_len, rtc_exec_horizon, action_prefix))
        body["parameters"].update(generations.fleet_fields(traffic_class, deadline_ms, observed_at))
        content, ctype = codec.encode_body(body, self.flavour)
        resp = self._request(
            "POST", routes.GENERATIONS_PATH, content=content, headers={"Content-Type": ctype}, timeout_s=timeout_s
        )
        reply = self._decode(resp)
        try:
            parsed = replies.parse_actions_response(reply)
        except InvalidRequest as e:
            raise ProtocolError(str(e)) from None
        if parsed.actions.ndim != 3 or parsed.actions.shape[0] != b:
            raise ProtocolError(f"expected actions [B={b}, H, D], got shape {list(parsed.actions.shape)}")
        self._record(ids, parsed.sessions)
        return ActionResult(parsed.actions, parsed.sessions, parsed.timings, reply, parsed.form, parsed.video)

    def _rtc_parameters(self, b: int, prefix_len, exec_horizon, action_prefix) -> dict:
        """The RTC keys of `parameters` (only those given); shapes per row are checked here, values by the server."""
        params: dict[str, Any] = {}
        for key, value in (("rtc_prefix_len", prefix_len), ("rtc_exec_horizon", exec_horizon)):
            if value is None:
                continue
            rows = [value] * b if isinstance(value, int | np.integer) else list(value)
            if len(rows) != b:
                raise ValueError(f"{key} has {len(rows)} entries for {b} sessions")
            params[key] = [None if v is None else int(v) for v in rows]
        if action_prefix is not None:
            if isinstance(action_prefix, np.ndarray) and action_prefix.ndim in (2, 3):
                if action_prefix.ndim == 3 and action_prefix.shape[0] != b:
                    raise ValueError(f"action_prefix has {action_prefix.shape[0]} rows for {b} sessions")
                params["action_prefix"] = action_prefix.astype(np.float32, copy=False)  # [P, D] is every row's
            else:
                rows = list(action_prefix)
                if len(rows) != b:
                    raise ValueError(f"action_prefix has {len(rows)} entries for {b} sessions")
                params["action_prefix"] = [None if r is None else np.asarray(r, np.float32) for r in rows]
        return params

    def _record(self, ids: list[str], sessions: list[dict]) -> None:
        for sid in ids:
            self._pending_resets.discard(sid)
        for s in sessions:
            sid, step = s.get("session_id"), s.get("step")
            if not isinstance(sid, str) or not isinstance(step, int):
                continue
            known = self._steps.get(sid)
            if s.get("restarted") and known is not None and s.get("restart_reason") not in _EXPECTED_RESTARTS:
                log.warning(
                    "session %s restarted by the server (%s) after step %d", sid, s.get("restart_reason"), known
                )
            self._steps[sid] = step
            if isinstance(s.get("incarnation"), str):
                self._incarnations[sid] = s["incarnation"]

    def health(self, timeout_s: float = 5.0) -> dict:
        """One `GET /health` (no retries); the body on 200, else a typed error."""
        try:
            resp = self._http.get(routes.HEALTH_PATH, timeout=timeout_s)
        except httpx.HTTPError as e:
            self._raise_if_tls(e)
            raise ServerUnavailableError(f"GET {routes.HEALTH_PATH} failed: {_describe(e)}", attempts=1) from e
        if resp.status_code != 200:
            code, message, fld = self._error_parts(resp)
            if resp.status_code in (401, 403):
                raise AuthenticationError(message, resp.status_code, code, fld)
            raise ServerUnavailableError(
                f"not ready: HTTP {resp.status_code} {message}", 1, resp.status_code, server_message=message
            )
        return self._decode(resp, lenient=True)

    def wait_until_ready(self, timeout_s: float = 900.0, poll_interval_s: float = 1.0) -> dict:
        """Poll `GET /health` until it answers 200 (each try bounded by 5 s), at most `timeout_s` in all."""
        deadline = time.monotonic() + timeout_s
        last = "no attempt made"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ReadyTimeout(f"{self.base_url} not ready after {timeout_s:.1f} s (last: {last})")
            try:
                return self.health(timeout_s=max(0.05, min(5.0, remaining)))
            except ServerUnavailableError as e:
                last = str(e)
            time.sleep(max(0.0, min(poll_interval_s, deadline - time.monotonic())))

    def metadata(self) -> dict:
        """`GET /v1/actions/metadata`: policy family, action horizon and dims, defaults."""
        return self._decode(self._request("GET", routes.METADATA_PATH), lenient=True)

    def models(self) -> dict:
        """`GET /v1/models` (OpenAI-style model list)."""
        return self._decode(self._request("GET", routes.MODELS_PATH), lenient=True)

    def _request(
        self,
        method: str,
        path: str,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> httpx.Response:
        timeout = httpx.Timeout(timeout_s if timeout_s is not None else self.timeout_s)
        last_status: int | None = None
        last_message = ""
        for attempt in range(self.max_retries + 1):
            retry_after = None
            try:
                resp = self._http.request(method, path, content=content, headers=headers, timeout=timeout)
            except httpx.TransportError as e:  # connection refused/reset, timeouts, protocol errors
                self._raise_if_tls(e)
                last_status, last_message = None, _describe(e)
            else:
                if resp.status_code < 300:
                    return resp
                code, message, fld = self._error_parts(resp)
                if resp.status_code == 429:  # the key's tenant is over a quota: the caller decides whether to wait
                    wait = parse_retry_after(resp.headers.get("Retry-After"))
                    raise QuotaExceededError(message, 429, code, fld, resp.content, retry_after_s=wait)
                if resp.status_code not in RETRY_STATUSES:
                    cls = AuthenticationError if resp.status_code in (401, 403) else BadRequestError
                    if resp.status_code >= 500 or resp.status_code < 400:
                        cls = ServerError
                    raise cls(message, resp.status_code, code, fld, body=resp.content)
                last_status, last_message = resp.status_code, message
                retry_after = parse_retry_after(resp.headers.get("Retry-After"))
            what = f"HTTP {last_status}: {last_message}" if last_status else last_message
            if attempt == self.max_retries:
                break
            delay = min(self.max_backoff_s, retry_after if retry_after is not None else self.backoff_s * (attempt + 1))
            log.warning(
                "%s %s failed (%s); retry %d/%d in %.1f s", method, path, what, attempt + 1, self.max_retries, delay
            )
            time.sleep(delay)
        raise ServerUnavailableError(
            f"{method} {self.base_url}{path} failed after {self.max_retries + 1} attempts; last: {what}",
            attempts=self.max_retries + 1,
            status=last_status,
            server_message=last_message if last_status else None,
        )

    def _raise_if_tls(self, exc: Exception) -> None:
        """A certificate that does not verify is final: retrying cannot fix it, and falling back is not an option."""
        err = tls.secure_channel_error(exc, self.base_url)
        if err is not None:
            raise err from exc

    @staticmethod
    def _error_parts(resp: httpx.Response) -> tuple[str | None, str, str | None]:
        body: Any = resp.content
        try:
            body, _ = codec.decode_body(resp.content, resp.headers.get("content-type"))
        except InvalidRequest:
            pass  # plain text or an HTML error page: report it as text
        code, message, fld = replies.parse_error_body(body)
        return code, (message or resp.reason_phrase)[:2000], fld

    def _decode(self, resp: httpx.Response, lenient: bool = False) -> Any:
        ctype = resp.headers.get("content-type", "")
        try:
            body, _ = codec.decode_body(resp.content, ctype)
        except InvalidRequest as e:
            if lenient:
                return {"status": resp.text}
            raise ProtocolError(f"cannot read the reply (Content-Type {ctype!r}): {e}") from None
        return body

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ActionClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
