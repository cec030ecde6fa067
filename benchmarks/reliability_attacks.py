"""The attacks of `benchmarks/reliability.py` (issue 45): bomb bodies per door and request-slot exhaustion.

- `bombs`: bodies of empty lists, of empty maps and of lists nested to the depth limit, as msgpack and JSON to the
  HTTP door and as msgpack frames to the OpenPI WebSocket; for each, the reply, the Ingress replica's RSS rise
  (sampled every 0.1 s) and the slowest `/healthz` answer while it was decoded.
- `slots`: one tenant opens WebSockets up to its cap (and one more) and trickles bodies a byte a second, a socket
  sends a junk frame every third of the idle timeout; meanwhile another tenant calls and `/healthz` is polled.

Both run on an app with two tenants (`attacker`, `victim`) and the shipped connection caps (with the ZeroMQ door on
loopback, whose attacks are in `reliability_zmq_attacks.py`; the eviction flood and NaN inputs are in
`reliability_session_attacks.py`). `Sampler` measures every attack: `/healthz` (and any other probe) and a door's RSS.
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgpack

from dreamzero_client.wire import codec, generations, routes

MIB = 1024 * 1024
KEYS = {"attacker": "attacker-key-5c1e", "victim": "victim-key-a9d2"}
#: uvicorn (behind Serve's proxy) caps a WebSocket message at 16 MiB: the WebSocket bombs stay under it
WS_BOMB_BYTES = 15 * MIB


def attack_args(server_args: dict, zmq_port: int | None = None) -> dict:
    """`server_args` with two tenants and the shipped connection caps (the other scenarios raise them: their
    clients all come from one address without a key); with `zmq_port`, the ZeroMQ door too (on loopback)."""
    http = {k: v for k, v in server_args["http"].items() if not k.startswith(("ws_max", "body_reads"))}
    digests = {t: "sha256:" + hashlib.sha256(k.encode()).hexdigest() for t, k in KEYS.items()}
    out = {**server_args, "http": http, "api_keys": digests}
    if zmq_port is not None:
        out["zmq"] = {"port": zmq_port, "host": "127.0.0.1"}
    return out


def _auth(tenant: str, scheme: str = "Bearer") -> dict:
    return {"Authorization": f"{scheme} {KEYS[tenant]}"}


# 1. Bomb bodies ---------------------------------------------------------------------------------------------------


def list_tree(leaf: bytes, size: int) -> bytes:
    """`[[[leaf x fan] x fan] x n]` as msgpack, at most about `size` bytes (every list within the container limit)."""
    fan = 4000
    inner = b"\xdc" + fan.to_bytes(2, "big") + leaf * fan
    mid_n = max(1, min(fan, size // len(inner)))
    mid = b"\xdc" + mid_n.to_bytes(2, "big") + inner * mid_n
    n = max(1, min(fan, size // len(mid)))
    return b"\xdc" + n.to_bytes(2, "big") + mid * n


def msgpack_tree(leaf: bytes, size: int) -> bytes:
    """`{"input": [[[leaf x fan] x fan] x n]}` of about `size` bytes."""
    return b"\x81\xa5input" + list_tree(leaf, size)


def json_run(unit: bytes, size: int) -> bytes:
    return b'{"input":[' + (unit + b",") * ((size - 64 - len(unit)) // (len(unit) + 1)) + unit + b"]}"


def msgpack_blob(size: int) -> bytes:
    """`{"input": <bin of about `size` bytes>}`: as large, but cheap to decode (the transport's share of a bomb)."""
    n = size - 64
    return b"\x81\xa5input" + b"\xc6" + n.to_bytes(4, "big") + b"\x00" * n


def bomb_bodies(size: int) -> dict[str, tuple[str, bytes]]:
    """name -> (door, body). Nested: each leaf is 60 lists deep (within the depth limit of 64). The `blob` bodies
    are the baseline: a body as large that builds one object."""
    deep_mp, deep_json = b"\x91" * 60 + b"\x90", b"[" * 60 + b"]" * 60
    out = {
        "http-msgpack-blob": ("http-msgpack", msgpack_blob(size)),
        "ws-msgpack-blob": ("ws", msgpack_blob(min(size, WS_BOMB_BYTES))),
    }
    for name, leaf in (("lists", b"\x90"), ("maps", b"\x80"), ("nested", deep_mp)):
        out[f"http-msgpack-{name}"] = ("http-msgpack", msgpack_tree(leaf, size))
        out[f"ws-msgpack-{name}"] = ("ws", msgpack_tree(leaf, min(size, WS_BOMB_BYTES)))
    for name, unit in (("lists", b"[]"), ("maps", b"{}"), ("nested", deep_json)):
        out[f"http-json-{name}"] = ("http-json", json_run(unit, size))
    return out


class Sampler:
    """While open: `/healthz` polled every 50 ms (and each extra probe, e.g. a ZeroMQ `ping`, likewise), every answer's
    latency kept, and the peak RSS of the replicas whose label starts with `rss_prefix` (`Ingress/`: the front door,
    `ZmqIngress/`: the ZeroMQ door), sampled every 0.1 s."""

    def __init__(self, cluster, rss_prefix: str = "Ingress/", probes: dict | None = None):
        self.cluster, self.rss_prefix = cluster, rss_prefix
        self.probes = {"healthz": self._healthz, **(probes or {})}  # name -> one check (True: answered fine)
        self.latencies: dict[str, list[float]] = {name: [] for name in self.probes}
        self.failures: dict[str, int] = dict.fromkeys(self.probes, 0)
        self.rss_before = self._rss()
        self.rss_peak = self.rss_before
        self._stop = threading.Event()
        self._client = httpx.Client(timeout=30, trust_env=False)
        self._threads = [threading.Thread(target=self._poll, args=(n,), daemon=True) for n in self.probes]
        self._threads.append(threading.Thread(target=self._sample_rss, daemon=True))

    def _rss(self) -> int:
        return sum(v for k, v in self.cluster.rss().items() if k.startswith(self.rss_prefix))

    def _healthz(self) -> bool:
        try:
            return self._client.get(f"{self.cluster.url}/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    def _poll(self, name: str) -> None:
        check = self.probes[name]
        while not self._stop.is_set():
            t = time.perf_counter()
            ok = check()
            self.latencies[name].append(time.perf_counter() - t)
            self.failures[name] += not ok
            self._stop.wait(0.05)

    def _sample_rss(self) -> None:
        while not self._stop.is_set():
            self.rss_peak = max(self.rss_peak, self._rss())
            self._stop.wait(0.1)

    def __enter__(self) -> Sampler:
        for t in self._threads:
            t.start()
        time.sleep(0.3)
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.5)  # the replica's memory after the refusal
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
        self._client.close()

    @property
    def healthz_worst_s(self) -> float:
        return max(self.latencies["healthz"], default=0.0)

    def figures(self) -> dict:
        out: dict = {}
        for name, lat in self.latencies.items():
            ms = sorted(lat)
            out[f"{name}_worst_ms"] = round(ms[-1] * 1000, 1) if ms else None
            out[f"{name}_p99_ms"] = round(ms[min(len(ms) - 1, int(0.99 * len(ms)))] * 1000, 1) if ms else None
            out[f"{name}_failures"] = self.failures[name]
        label = self.rss_prefix.rstrip("/").lower()
        out[f"{label}_rss_before_mib"] = round(self.rss_before / MIB, 1)
        out[f"{label}_rss_rise_mib"] = round((self.rss_peak - self.rss_before) / MIB, 1)
        return out


def _send_bomb(url: str, door: str, body: bytes, timeout_s: float) -> tuple[int | str, str]:
    """(status, the reply's message) of one bomb."""
    if door == "ws":
        from websockets.exceptions import ConnectionClosed
        from websockets.sync.client import connect

        ws_url = url.replace("http://", "ws://") + routes.OPENPI_WS_PATH
        try:
            with connect(ws_url, additional_headers=_auth("attacker", "Api-Key"), open_timeout=30, max_size=None) as ws:
                ws.recv(timeout=timeout_s)
                ws.send(body)
                frame = msgpack.unpackb(ws.recv(timeout=timeout_s))
                return frame.get("status", "?"), str(frame.get("message", ""))[:160]
        except ConnectionClosed as exc:
            return f"closed {exc.rcvd.code if exc.rcvd else '-'}", ""
    ctype = codec.JSON_CONTENT_TYPE if door == "http-json" else codec.MSGPACK_CONTENT_TYPE
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        resp = client.post(
            f"{url}{routes.GENERATIONS_PATH}", content=body, headers={**_auth("attacker"), "content-type": ctype}
        )
    try:
        message = codec.decode_body(resp.content, resp.headers.get("content-type"))[0]["error"]["message"]
    except Exception:  # noqa: BLE001 - reported as it came
        message = resp.text[:160]
    return resp.status_code, str(message)[:160]


def scenario_bombs(cluster, args) -> dict:
    """Each bomb body alone, with /healthz polled and the Ingress RSS sampled around it."""
    size = int(args.bomb_mib * MIB)
    out: dict = {"body_mib": args.bomb_mib, "ws_body_mib": min(size, WS_BOMB_BYTES) / MIB, "attacks": {}}
    ok = True
    for name, (door, body) in bomb_bodies(size).items():
        with Sampler(cluster) as sampler:
            t = time.perf_counter()
            status, message = _send_bomb(cluster.url, door, body, args.timeout_s * 4)
            wall = time.perf_counter() - t
        fig = sampler.figures()
        refused = isinstance(status, int) and 400 <= status < 500 and status != 413
        rise_ok = fig["ingress_rss_rise_mib"] <= 6 * len(body) / MIB
        out["attacks"][name] = {"status": status, "message": message, "reply_s": round(wall, 2), **fig}
        ok = ok and refused and rise_ok and fig["healthz_worst_ms"] < 500 and not fig["healthz_failures"]
    out["pass"] = ok
    return out


# 2. Slot exhaustion -----------------------------------------------------------------------------------------------


def _trickle(url: str, seconds: float) -> str:
    """A body of the attacker sent a byte a second: the status line the server answered with."""
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=seconds + 30) as s:
        s.sendall(
            b"POST /v1/actions/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
            + f"Authorization: Bearer {KEYS['attacker']}\r\n".encode()
            + b"Content-Length: 100000\r\n\r\n"
        )
        try:
            while time.monotonic() - t0 < seconds:
                s.sendall(b"\x00")
                time.sleep(1.0)
            return s.recv(200).split(b"\r\n", 1)[0].decode(errors="replace") or "closed"
        except OSError:  # the server answered and closed while we were still sending
            return f"closed by server after {time.monotonic() - t0:.1f} s"


def _junk_socket(url: str, every_s: float, bound_s: float) -> dict:
    """A WebSocket that sends a junk frame every `every_s`: when (if) the server closes it."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    ws_url = url.replace("http://", "ws://") + routes.OPENPI_WS_PATH
    t0 = time.monotonic()
    with connect(ws_url, additional_headers=_auth("victim", "Api-Key"), open_timeout=30) as ws:
        ws.recv(timeout=30)
        try:
            while time.monotonic() - t0 < bound_s:
                ws.send(b"\xc1")
                ws.recv(timeout=30)
                time.sleep(every_s)
            return {"outcome": "still open", "wall_s": round(time.monotonic() - t0, 1)}
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd else "-"
            return {"outcome": f"closed by server ({code})", "wall_s": round(time.monotonic() - t0, 1)}


def _victim_calls(url: str, n: int, timeout_s: float) -> list[float]:
    """`n` normalised calls of the victim tenant (one session): their latencies; an error raises."""
    from serving_common import normalised_observation

    out = []
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        for i in range(n):
            body = generations.build_request_body(normalised_observation(1 if i == 0 else 4), ["p"], ["victim-0"])
            payload, ctype = codec.encode_body(body)
            t = time.perf_counter()
            resp = client.post(
                f"{url}{routes.GENERATIONS_PATH}", content=payload, headers={**_auth("victim"), "content-type": ctype}
            )
            resp.raise_for_status()
            out.append(time.perf_counter() - t)
    return out


def scenario_slots(cluster, args, ws_cap: int, idle_s: float) -> dict:
    """The attacker holds `ws_cap` WebSockets (+1 refused), trickles `ws_cap` bodies and keeps a junk socket; the
    victim's calls and /healthz during it against before it."""
    from websockets.sync.client import connect

    def pctl(xs: list[float], q: float) -> float:
        return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1)

    before = _victim_calls(cluster.url, 6, args.timeout_s)[1:]  # the first starts the session
    ws_url = cluster.url.replace("http://", "ws://") + routes.OPENPI_WS_PATH
    held, out = [], {}
    try:
        for _ in range(ws_cap):
            ws = connect(ws_url, additional_headers=_auth("attacker", "Api-Key"), open_timeout=30)
            ws.recv(timeout=30)
            held.append(ws)
        with connect(ws_url, additional_headers=_auth("attacker", "Api-Key"), open_timeout=30) as extra:
            frame = msgpack.unpackb(extra.recv(timeout=30))
            out["ws_over_cap"] = {"status": frame.get("status"), "message": str(frame.get("message"))[:120]}
        with ThreadPoolExecutor(ws_cap + 1) as pool, Sampler(cluster) as sampler:
            trickles = [pool.submit(_trickle, cluster.url, args.trickle_s) for _ in range(ws_cap)]
            junk = pool.submit(
                _junk_socket, cluster.url, idle_s / 3, idle_s * 4
            )  # the victim's: the attacker's are all held
            time.sleep(1.5)  # the trickles are slow bodies by now
            during = _victim_calls(cluster.url, 5, args.timeout_s)
            out["trickles"] = dict.fromkeys(sorted({f.result(timeout=args.trickle_s + 60) for f in trickles}), 0)
            for f in trickles:
                out["trickles"][f.result()] += 1
            out["junk_socket"] = junk.result(timeout=idle_s * 4 + 60)
        out.update(sampler.figures())
    finally:
        for ws in held:
            ws.close()
    out["victim_ms"] = {
        "before_p50": pctl(before, 0.5),
        "during_p50": pctl(during, 0.5),
        "during_max": pctl(during, 1.0),
    }
    out["pass"] = (
        out["ws_over_cap"]["status"] == 429
        and out["junk_socket"]["outcome"].startswith("closed")
        and out["healthz_worst_ms"] < 500
        and out["healthz_failures"] == 0
        and out["victim_ms"]["during_max"] < 4 * out["victim_ms"]["before_p50"] + 500
    )
    return out
