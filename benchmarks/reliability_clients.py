"""The client side of `benchmarks/reliability.py`: the three ways a robot talks to the server, each call bounded.

- `raw`: `ActionClient`, raw DROID form (three 180x320 cameras + joints);
- `normalised`: `ActionClient`, RLinf normalised form (canvas + 64-d state);
- `openpi`: `OpenPIClient(resume=True)` on `/v1/realtime/robot/openpi` (it echoes the step and incarnation of the
  session's last reply, and a reopened connection continues the session).

A `Worker` runs one client for a bounded number of calls and a deadline, never more, and records every call: its
latency, the error it raised (if any) and the session report checked by a `ContinuityLedger`. The HTTP client
echoes `expected_steps` / `expected_incarnations` on its own; the ledger is the independent check of what came back.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
from reliability_stats import ContinuityLedger
from serving_common import droid_observation, normalised_observation

from dreamzero_client.http_client import ActionClient
from dreamzero_client.openpi_client import OpenPIClient
from dreamzero_client.wire import routes

KINDS = ("raw", "normalised", "openpi")
PROMPT = "pick up the cup"


def openpi_observation(session: str, seed: int = 0) -> dict:
    """One OpenPI DROID frame (the keys openpi's DROID clients send)."""
    rng = np.random.default_rng(seed)
    shape = (180, 320, 3)
    return {
        "observation/exterior_image_0_left": rng.integers(0, 256, shape, dtype=np.uint8),
        "observation/exterior_image_1_left": rng.integers(0, 256, shape, dtype=np.uint8),
        "observation/wrist_image_left": rng.integers(0, 256, shape, dtype=np.uint8),
        "observation/joint_position": rng.uniform(-1, 1, 7),
        "observation/gripper_position": np.array([0.2]),
        "prompt": PROMPT,
        "session_id": session,
        "response_format": "dict",  # the reply then carries the session report
    }


def error_label(exc: BaseException) -> str:
    """`ServerUnavailableError(503)`, `ServerUnavailableError(timeout)`, `PolicyServerError(503)`, ..."""
    detail = getattr(exc, "status", None) or getattr(exc, "code", None)
    if detail is None and type(exc).__name__ == "ServerUnavailableError":
        detail = "timeout" if "Timeout" in str(exc) else "connection"  # httpx's ReadTimeout, ConnectTimeout, ...
    return f"{type(exc).__name__}({detail})" if detail is not None else type(exc).__name__


@dataclass
class CallRecord:
    start: float  # monotonic
    end: float
    ok: bool
    error: str | None = None  # exception class name (after the client's own retries)
    message: str | None = None
    verdict: str | None = None  # ContinuityLedger verdict of the reply
    replica: str | None = None


@dataclass
class Worker:
    """One client: `calls` calls at most, none started after `deadline` (monotonic), each bounded by `timeout_s`.

    `sessions` > 1 cycles the calls over that many sessions (the scale scenario's live sessions); `episode_steps`
    starts a new session id every that many calls (the soak's episodes).
    """

    name: str
    kind: str
    url: str
    calls: int
    deadline: float
    timeout_s: float = 30.0
    sessions: int = 1
    episode_steps: int | None = None
    pause_s: float = 0.0
    http_retries: int = 3
    connections: int = 0  # WebSocket connections opened (the first and every reconnect)
    ledger: ContinuityLedger = field(default_factory=ContinuityLedger)
    records: list[CallRecord] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")

    def session_id(self, i: int) -> str:
        episode = 0 if not self.episode_steps else i // (self.episode_steps * self.sessions)
        return f"{self.name}-s{i % self.sessions}-e{episode}"

    def run(self) -> None:
        if self.kind == "openpi":
            self._run_openpi()
        else:
            self._run_http()

    def _done(self, i: int) -> bool:
        return i >= self.calls or time.monotonic() >= self.deadline or self.stop.is_set()

    def _run_http(self) -> None:
        # retries: 503 / connection errors while a replica is replaced are retried by the client itself, bounded
        with ActionClient(
            self.url, timeout_s=self.timeout_s, max_retries=self.http_retries, backoff_s=0.5, max_backoff_s=5
        ) as c:
            i = 0
            while not self._done(i):
                sid = self.session_id(i)
                first = sid not in c.session_steps
                if self.kind == "raw":
                    obs, form = droid_observation(1 if first else 4, seed=i), "raw"
                else:
                    obs, form = normalised_observation(1 if first else 4, seed=i), "normalised"
                t0 = time.monotonic()
                try:
                    res = c.generate(obs, PROMPT, sid, form=form)
                except Exception as exc:  # noqa: BLE001 - every failure is recorded, none ends the run
                    self.records.append(CallRecord(t0, time.monotonic(), False, error_label(exc), str(exc)[:300]))
                else:
                    verdict = self.ledger.record(sid, res.sessions[0])
                    served_by = res.response.get("served_by")
                    self.records.append(CallRecord(t0, time.monotonic(), True, verdict=verdict, replica=served_by))
                i += 1
                if self.pause_s:
                    time.sleep(self.pause_s)

    def _run_openpi(self) -> None:
        host, port = self.url.split("://", 1)[1].rsplit(":", 1)
        client: OpenPIClient | None = None
        connection = 0
        i = 0
        try:
            while not self._done(i):
                sid = self.session_id(i)
                t0 = time.monotonic()
                try:
                    if client is None:  # a fresh client is a fresh server session
                        client = OpenPIClient(
                            host,
                            int(port),
                            routes.OPENPI_WS_PATH,
                            timeout_s=self.timeout_s,
                            max_reconnects=3,
                            resume=True,
                        )
                        connection += 1
                    # resume=True: a reopened connection continues the session, so it is judged on the same key
                    reply = client.infer(openpi_observation(sid, seed=i))
                except Exception as exc:  # noqa: BLE001 - every failure is recorded, none ends the run
                    self.records.append(CallRecord(t0, time.monotonic(), False, error_label(exc), str(exc)[:300]))
                    if client is not None and client._ws is None:  # closed after a timeout: reconnect next time
                        client.close()
                        client = None
                else:
                    key = f"{sid}@{connection}"
                    verdict = self.ledger.record(key, reply.get("session", {}))
                    self.records.append(CallRecord(t0, time.monotonic(), True, verdict=verdict))
                i += 1
                if self.pause_s:
                    time.sleep(self.pause_s)
        finally:
            self.connections = connection
            if client is not None:
                client.close()


def run_workers(workers: list[Worker], grace_s: float, during=None) -> list[str]:
    """Run every worker in its own thread; `during()` runs in this thread meanwhile. Returns the hung workers' names.

    A worker still running `grace_s` after its deadline is hung: its current call exceeded every bound.
    """
    threads = [threading.Thread(target=w.run, name=w.name, daemon=True) for w in workers]
    for t in threads:
        t.start()
    if during is not None:
        during()
    hung = []
    for w, t in zip(workers, threads):
        t.join(timeout=max(0.0, w.deadline + grace_s - time.monotonic()))
        if t.is_alive():
            w.stop.set()
            hung.append(w.name)
    return hung


def mixed_workers(n: int, url: str, calls: int, deadline: float, prefix: str, **kw) -> list[Worker]:
    """`n` workers spread over the three kinds (raw, normalised, openpi, raw, ...)."""
    return [Worker(f"{prefix}{i:02d}", KINDS[i % 3], url, calls, deadline, **kw) for i in range(n)]
