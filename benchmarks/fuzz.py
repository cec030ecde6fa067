"""Fuzz the wire protocol and the Franka safety layer; report crashes as a table.

Offline (default): every target of `tests/support/fuzz.py` (the strategies the unit tests use) with 10,000
examples each, derandomized. A crash is any exception other than the project's typed errors (`DreamZeroError`) or a
broken invariant (`AssertionError`); crashes are grouped by exception type and the line that raised it.

Live (`--url http://127.0.0.1:8000`, loopback only): against a running `serve run serve_config.yaml`, mutated
`POST /v1/actions/generations` requests and mutated frames on the OpenPI WebSocket (`/v1/realtime/robot/openpi`),
2,000 in all. Every reply must be a 2xx (the mutation left the request valid) or a 4xx with an error body and no
traceback text; every frame an action reply or an error frame that is not an internal error; the socket stays open.
A well-formed neighbour (one HTTP session and one WebSocket session) is called between mutants: its step must grow
by one per call and it must never restart. `/health` must answer 200 at the end. Bounded by `--requests` and
`--max-seconds`; every call has a timeout.

    PYTHONPATH=$PWD/clients python benchmarks/fuzz.py --jobs 5             # offline, 10,000 per target
    PYTHONPATH=$PWD/clients python benchmarks/fuzz.py --url http://127.0.0.1:8000 --offline-examples 0

Exit status 1 when anything crashed or failed.
"""
# Longer than ~400 lines on purpose: the offline and the live mode share targets, mutations and the report; a user
# runs one script.

from __future__ import annotations

import argparse
import sys
import time
import traceback
import urllib.parse
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import numpy as np
from hypothesis import given, settings
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from dreamzero_client.wire import codec, generations, openpi, routes
from tests.support import fuzz as ft

LOOPBACK = ("127.0.0.1", "localhost", "::1")
CALL_TIMEOUT_S = 120.0
DROID_HW = (180, 320)


# 1. Offline: every target, N examples, crashes grouped ---------------------------------------------------------------


@dataclass
class Crash:
    count: int
    message: str
    example: str


@dataclass
class TargetResult:
    name: str
    what: str
    outcomes: Counter = field(default_factory=Counter)
    crashes: dict[str, Crash] = field(default_factory=dict)
    seconds: float = 0.0


def crash_key(exc: BaseException) -> str:
    """Exception type and the deepest project line that raised it: one row per distinct bug, not per example."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "site-packages" not in f.filename]
    where = frames[-1] if frames else traceback.extract_tb(exc.__traceback__)[-1]
    return f"{type(exc).__name__} at {Path(where.filename).name}:{where.lineno}"


def short(example: Any, limit: int = 160) -> str:
    text = repr(example)
    return text if len(text) <= limit else text[:limit] + "..."


def fuzz_offline(target: ft.Target, examples: int) -> TargetResult:
    result = TargetResult(target.name, target.what)

    @settings(settings.get_profile("fuzz"), max_examples=examples)
    @given(target.strategy())
    def run(example):
        try:
            result.outcomes[target.run(example)] += 1
        except Exception as exc:  # noqa: BLE001 - every crash is recorded; the run goes on
            result.outcomes["crash"] += 1
            key = crash_key(exc)
            if key not in result.crashes:
                result.crashes[key] = Crash(0, str(exc)[:160], short(example))
            result.crashes[key].count += 1

    t0 = time.perf_counter()
    with np.errstate(all="ignore"):
        run()
    result.seconds = time.perf_counter() - t0
    return result


def fuzz_offline_by_name(name: str, examples: int) -> TargetResult:
    """For a worker process: targets hold lambdas, so only the name crosses the process boundary."""
    return fuzz_offline(ft.TARGETS_BY_NAME[name], examples)


def offline_table(results: list[TargetResult]) -> str:
    lines = [
        "| target | what | examples | accepted | rejected (typed) | crashes | distinct | s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        n = sum(r.outcomes.values())
        lines.append(
            f"| {r.name} | {r.what} | {n} | {r.outcomes['accepted']} | {r.outcomes['rejected']} | "
            f"{r.outcomes['crash']} | {len(r.crashes)} | {r.seconds:.0f} |"
        )
    for r in results:
        for key, c in r.crashes.items():
            lines.append(f"\n- {r.name}: {key} x{c.count}: {c.message}\n  example: {c.example}")
    return "\n".join(lines)


# 2. Live: mutated HTTP requests and WebSocket frames, a neighbour session between them -------------------------------


@dataclass
class LiveResult:
    http_status: Counter = field(default_factory=Counter)
    ws_outcomes: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    neighbour_calls: int = 0
    neighbour_steps: dict[str, list[int]] = field(default_factory=dict)
    neighbour_window_restarts: dict[str, int] = field(default_factory=dict)
    health_after: int | None = None
    seconds: float = 0.0
    stopped_early: bool = False

    def fail(self, what: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(what)


class Neighbour:
    """A well-formed client on both front doors; `call()` checks its continuity."""

    def __init__(self, base_url: str, http: httpx.Client, result: LiveResult, stack: ExitStack):
        self.base_url, self.http, self.result, self.stack = base_url, http, result, stack
        self.rng = np.random.default_rng(7)
        self.steps: dict[str, list[int]] = result.neighbour_steps
        self.window: dict[str, int] = {}  # door -> step after which the model's window restart came
        self.restarts: dict[str, int] = result.neighbour_window_restarts
        self.ws = None

    def _frames(self, t: int) -> dict[str, np.ndarray]:
        return {
            view: self.rng.integers(0, 256, (1, t, *DROID_HW, 3), dtype=np.uint8)
            for view in ("video.exterior_image_1_left", "video.exterior_image_2_left", "video.wrist_image_left")
        }

    def call(self) -> None:
        self.result.neighbour_calls += 1
        self._http_call()
        self._ws_call()

    def _check(self, door: str, report: dict) -> None:
        """Step +1 per call. The one restart allowed is the model's own: `window_full` once the attention window
        (4 chunks on DROID) is used up, always at the same step; anything else means the fuzz traffic reached it."""
        steps = self.steps.setdefault(door, [])
        step, restarted, reason = report.get("step"), report.get("restarted"), report.get("restart_reason")
        if steps:
            window_restart = restarted and reason == "window_full" and step == 1
            if window_restart and self.window.setdefault(door, steps[-1]) != steps[-1]:
                self.result.fail(
                    f"neighbour {door}: window restart after step {steps[-1]}, before after {self.window[door]}"
                )
            elif not window_restart and (restarted or step != steps[-1] + 1):
                self.result.fail(f"neighbour {door}: step {steps[-1]} -> {step}, restarted={restarted} ({reason})")
        steps.append(step)
        self.restarts[door] = self.restarts.get(door, 0) + bool(restarted and steps[:-1])

    def _http_call(self) -> None:
        first = "http" not in self.steps
        obs = self._frames(1 if first else 4)  # later calls send 4-frame stacks: one frame would restart the session
        obs["state.joint_position"] = self.rng.uniform(-1, 1, (1, 7)).astype(np.float32)
        obs["state.gripper_position"] = np.zeros((1, 1), np.float32)
        body = generations.build_request_body(obs, ["pick up the cup"], ["fuzz-neighbour-http"])
        data, ctype = codec.encode_body(body)
        try:
            resp = self.http.post(
                self.base_url + routes.GENERATIONS_PATH, content=data, headers={"content-type": ctype}
            )
        except httpx.HTTPError as exc:
            self.result.fail(f"neighbour http: {exc!r}")
            return
        if resp.status_code != 200:
            self.result.fail(f"neighbour http: status {resp.status_code} {resp.content[:200]!r}")
            return
        reply, _ = codec.decode_msgpack(resp.content)
        self._check("http", reply["sessions"][0])

    def _ws_call(self) -> None:
        if self.ws is None:
            self.ws = _ws_connect(self.base_url, self.stack)
        frame = {
            key: self.rng.integers(0, 256, (*DROID_HW, 3), dtype=np.uint8)  # one frame per camera: the server
            for key in openpi.OPENPI_DROID_KEY_MAP  # keeps the 4-frame buffer of a WebSocket session
            if "image" in key
        }
        frame["observation/joint_position"] = self.rng.uniform(-1, 1, 7)
        frame["observation/gripper_position"] = np.array([0.0])
        # the dict form (opt-in; the default reply is the reference servers' bare array) carries the session report
        frame.update(prompt="pick up the cup", session_id="fuzz-neighbour-ws", response_format="dict")
        try:
            self.ws.send(openpi.pack_frame(frame))
            reply, _ = openpi.unpack_frame(self.ws.recv(timeout=CALL_TIMEOUT_S))
        except (ConnectionClosed, TimeoutError) as exc:
            self.result.fail(f"neighbour ws: {exc!r}")
            self.ws = None
            return
        if openpi.is_error_frame(reply) or not isinstance(reply, dict) or "session" not in reply:
            self.result.fail(f"neighbour ws: unexpected reply {short(reply)}")
            return
        self._check("ws", reply["session"])


def _ws_connect(base_url: str, stack: ExitStack):
    url = base_url.replace("http://", "ws://") + routes.OPENPI_WS_PATH
    ws = stack.enter_context(connect(url, max_size=None, open_timeout=30, close_timeout=5))
    ws.recv(timeout=CALL_TIMEOUT_S)  # the handshake config
    return ws


def _check_http_reply(resp: httpx.Response, result: LiveResult, body: bytes) -> None:
    status = resp.status_code
    result.http_status[status] += 1
    if b"Traceback" in resp.content:
        result.fail(f"http {status}: traceback text in the reply to {body[:80]!r}")
    if 200 <= status < 300:
        return
    if not 400 <= status < 500:
        result.fail(f"http {status}: {resp.content[:200]!r} for body {body[:120]!r}")
        return
    try:
        ctype = resp.headers.get("content-type", "")
        err = codec.decode_json(resp.content) if "json" in ctype else codec.decode_msgpack(resp.content)[0]
        assert err["error"]["message"]
    except Exception:  # noqa: BLE001 - any unreadable error body is a finding
        result.fail(f"http {status}: error body unreadable: {resp.content[:200]!r}")


def _check_ws_reply(data: Any, result: LiveResult, sent: bytes | str) -> None:
    if not isinstance(data, bytes):
        result.ws_outcomes["text frame"] += 1
        result.fail(f"ws: text frame {str(data)[:200]!r} for {sent[:80]!r}")
        return
    try:
        reply, _ = openpi.unpack_frame(data)
    except Exception:  # noqa: BLE001
        result.ws_outcomes["unreadable"] += 1
        result.fail(f"ws: unreadable reply {data[:120]!r}")
        return
    if openpi.is_error_frame(reply):
        code = reply.get("code")
        result.ws_outcomes[f"error frame ({code})"] += 1
        if code == "internal_error" or "Traceback" in str(reply.get("message")):
            result.fail(f"ws: internal error frame {short(reply)} for {sent[:120]!r}")
    elif isinstance(reply, dict) and reply.keys() == {"status"} and reply["status"] == "reset successful":
        result.ws_outcomes["reset"] += 1
    else:
        result.ws_outcomes["actions"] += 1


class _OutOfTime(Exception):
    """Ends the live run at --max-seconds (raised inside a hypothesis example, caught around the run)."""


def fuzz_live(base_url: str, total: int, max_seconds: float, neighbour_every: int) -> LiveResult:
    result = LiveResult()
    t0 = time.monotonic()
    sent = Counter()

    part_end = [t0 + max_seconds / 2]  # each front door gets half of the time

    def check_time() -> None:
        if time.monotonic() > part_end[0]:
            result.stopped_early = True
            raise _OutOfTime

    with ExitStack() as stack:
        http = stack.enter_context(httpx.Client(timeout=CALL_TIMEOUT_S, trust_env=False))
        resp = http.get(base_url + routes.HEALTH_PATH, timeout=10)
        if resp.status_code != 200:
            raise SystemExit(f"{base_url}/health answered {resp.status_code}; start the server first")
        neighbour = Neighbour(base_url, http, result, stack)
        neighbour.call()

        last_call = [time.monotonic()]

        def between() -> None:
            """The neighbour every N mutants, and at least every 10 s (the server closes idle sockets after 30 s)."""
            if (sent["http"] + sent["ws"]) % neighbour_every == 0 or time.monotonic() - last_call[0] > 10:
                neighbour.call()
                last_call[0] = time.monotonic()

        @settings(settings.get_profile("fuzz"), max_examples=total // 2)
        @given(ft.wire_bodies(ft.generation_bodies(DROID_HW, max_batch=2)))
        def http_mutants(example):
            check_time()
            body, ctype = example
            headers = {} if ctype is None else {"content-type": ctype}
            sent["http"] += 1
            try:
                resp = http.post(base_url + routes.GENERATIONS_PATH, content=body, headers=headers)
            except httpx.HTTPError as exc:
                result.http_status["no reply"] += 1
                result.fail(f"http: {exc!r} for body {body[:120]!r}")
            else:
                try:
                    _check_http_reply(resp, result, body)
                except Exception as exc:  # noqa: BLE001 - a bug of this script must not end the run unreported
                    result.fail(f"http: checking the reply failed: {exc!r}")
            between()

        ws_box: list = [None]  # connected on the first frame: an idle socket would be closed during the HTTP part

        @settings(settings.get_profile("fuzz"), max_examples=total - total // 2)
        @given(ft.openpi_wire_frames(DROID_HW))
        def ws_mutants(frame):
            check_time()
            sent["ws"] += 1
            try:
                if ws_box[0] is None:
                    ws_box[0] = _ws_connect(base_url, stack)
                ws_box[0].send(frame)
                _check_ws_reply(ws_box[0].recv(timeout=CALL_TIMEOUT_S), result, frame)
            except (ConnectionClosed, TimeoutError, OSError) as exc:
                result.ws_outcomes["connection lost"] += 1
                result.fail(f"ws: {exc!r} after {frame[:120]!r}")
                ws_box[0] = None
            except Exception as exc:  # noqa: BLE001 - a bug of this script must not end the run unreported
                result.fail(f"ws: checking the reply failed: {exc!r}")
            between()

        with np.errstate(all="ignore"):
            for part in (http_mutants, ws_mutants):
                try:
                    part()
                except _OutOfTime:  # hypothesis hands the exception back after the example that raised it
                    pass
                part_end[0] = t0 + max_seconds
        neighbour.call()
        result.health_after = http.get(base_url + routes.HEALTH_PATH, timeout=10).status_code
        if result.health_after != 200:
            result.fail(f"/health answered {result.health_after} after the run")
    result.seconds = time.monotonic() - t0
    result.http_status["sent"] = sent["http"]
    result.ws_outcomes["sent"] = sent["ws"]
    return result


def live_report(r: LiveResult) -> str:
    http = ", ".join(f"{k}: {v}" for k, v in sorted(r.http_status.items(), key=lambda kv: str(kv[0])))
    ws = ", ".join(f"{k}: {v}" for k, v in sorted(r.ws_outcomes.items()))
    steps = {door: f"{len(s)} calls, max step {max(s)}" for door, s in r.neighbour_steps.items() if s}
    lines = [
        "| what | result |",
        "|---|---|",
        f"| HTTP mutants | {http} |",
        f"| WebSocket mutants | {ws} |",
        f"| neighbour sessions (HTTP, WebSocket) | {steps}; window_full restarts {r.neighbour_window_restarts}, "
        "any other restart or step jump is a failure |",
        f"| /health after | {r.health_after} |",
        f"| failures | {len(r.failures)} |",
        f"| time | {r.seconds:.0f} s{' (cut by --max-seconds, half per door)' if r.stopped_early else ''} |",
    ]
    return "\n".join(lines + [f"\n- {f}" for f in r.failures])


# 3. CLI ----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--offline-examples", type=int, default=10_000, help="examples per offline target (0 = skip)")
    p.add_argument("--targets", default=",".join(t.name for t in ft.TARGETS), help="offline targets, comma-separated")
    p.add_argument("--jobs", type=int, default=1, help="offline targets run in this many processes at once")
    p.add_argument("--url", help="live mode: a running server on loopback, e.g. http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=2000, help="live mode: mutated requests + frames in all")
    p.add_argument("--max-seconds", type=float, default=1800, help="live mode: stop sending after this long")
    p.add_argument("--neighbour-every", type=int, default=25, help="live mode: a neighbour call every N mutants")
    args = p.parse_args(argv)

    failed = False
    if args.offline_examples > 0:
        names = [n.strip() for n in args.targets.split(",") if n.strip()]
        unknown = sorted(set(names) - set(ft.TARGETS_BY_NAME))
        if unknown:
            p.error(f"--targets: unknown {unknown}; choose from {sorted(ft.TARGETS_BY_NAME)}")
        with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = [pool.submit(fuzz_offline_by_name, name, args.offline_examples) for name in names]
            results = []
            for future in futures:
                results.append(future.result())
                print(f"{results[-1].name}: {dict(results[-1].outcomes)} in {results[-1].seconds:.0f} s", flush=True)
        print("\n" + offline_table(results) + "\n", flush=True)
        failed |= any(r.crashes for r in results)
    if args.url:
        host = urllib.parse.urlsplit(args.url).hostname
        if host not in LOOPBACK:
            p.error(f"--url must be a loopback address ({', '.join(LOOPBACK)}), got host {host!r}")
        live = fuzz_live(args.url.rstrip("/"), args.requests, args.max_seconds, args.neighbour_every)
        print("\n" + live_report(live) + "\n", flush=True)
        failed |= bool(live.failures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
