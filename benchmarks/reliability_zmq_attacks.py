"""The ZeroMQ door's attacks of `benchmarks/reliability.py` (issue 45), on the attack app with the door on loopback.

- `zmq-bombs`: messages of about 64 MiB (the door's `max_message_bytes`) whose `data` is empty lists or empty maps,
  without a key and with the attacker's valid key (put after `data`, so the door must skip all of it to find the
  token): the reply, its time, the door replica's RSS rise, `/healthz` and the door's own `ping` meanwhile.
- `zmq-reset`: the attacker holds sessions on the Policy, then sends `reset` without ids as fast as it is answered;
  the resets answered and refused (429), the Policy calls and session resets they caused, and another tenant's
  `get_action` latency before and during it.
- `zmq-rejected`: thousands of rejected `get_action` requests (16 session ids each) from fixed identities: the door's
  RSS before and after, and what a `reset` without ids of those identities then clears (must be nothing).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import msgpack
import numpy as np
import zmq
from reliability_attacks import KEYS, MIB, Sampler, list_tree
from reliability_stats import latency_summary

from dreamzero_client.wire import rldx

#: the door's `max_message_bytes` (64 MiB, as shipped): a larger message is dropped by ZeroMQ itself, never answered
ZMQ_MAX_MESSAGE = 64 * MIB


class ZmqCaller:
    """One REQ socket (a fixed routing id when `identity` is given), every wait bounded by `timeout_s`. Replies are
    dicts: an error reply as the door sent it, a success as `{"status": 200, "reply": ...}`, no reply in time as
    `{"status": "timeout"}` (the socket is then rebuilt: a REQ socket that missed its reply cannot send again)."""

    def __init__(self, port: int, tenant: str | None, timeout_s: float, identity: bytes | None = None):
        self.port, self.token, self.timeout_s, self.identity = port, KEYS.get(tenant or ""), timeout_s, identity
        self.ctx = zmq.Context()
        self.sock = None
        self._open()

    def _open(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        self.sock = self.ctx.socket(zmq.REQ)
        for opt, value in ((zmq.LINGER, 0), (zmq.RCVTIMEO, int(self.timeout_s * 1000)),
                           (zmq.SNDTIMEO, int(self.timeout_s * 1000))):  # fmt: skip
            self.sock.setsockopt(opt, value)
        if self.identity is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, self.identity)
        self.sock.connect(f"tcp://127.0.0.1:{self.port}")

    def call_raw(self, payload: bytes) -> dict:
        try:
            self.sock.send(payload)
            reply = rldx.unpack(self.sock.recv())
        except zmq.Again:
            self._open()
            return {"status": "timeout", "error": f"no reply within {self.timeout_s:g} s"}
        if isinstance(reply, dict) and "error" in reply:
            return reply
        return {"status": 200, "reply": reply}

    def message(self, endpoint: str, data: dict | None = None) -> bytes:
        request: dict = {"endpoint": endpoint, "data": data}
        if self.token:
            request["api_token"] = self.token
        return rldx.pack(request)

    def call(self, endpoint: str, data: dict | None = None) -> dict:
        return self.call_raw(self.message(endpoint, data))

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def wait_for_door(port: int, timeout_s: float = 180.0) -> float:
    """Seconds until the door answers `ping` (it binds when its replica starts, which /health does not wait for)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        caller = ZmqCaller(port, "victim", 2.0)
        try:
            if caller.call("ping").get("status") == 200:
                return time.monotonic() - t0
        finally:
            caller.close()
        time.sleep(0.5)
    raise TimeoutError(f"the ZeroMQ door on port {port} did not answer within {timeout_s} s")


def ping_probe(port: int):
    """A Sampler probe: one `ping` of the victim through its own socket (the door's liveness)."""
    caller = ZmqCaller(port, "victim", 30.0)
    return lambda: caller.call("ping").get("status") == 200


def droid_rows(b: int, t: int, seed: int = 0, state: float | None = None, hw: tuple = (180, 320)) -> dict:
    """An RLDX DROID observation of `b` rows and `t` frames of `hw`; `state`: every joint at that value."""
    rng = np.random.default_rng(seed)
    obs = {
        f"video.{cam}": rng.integers(0, 256, (b, t, *hw, 3), dtype=np.uint8)
        for cam in ("exterior_image_1_left", "exterior_image_2_left", "wrist_image_left")
    }
    joints = np.array([0.0, -0.6, 0.0, -2.5, 0.0, 1.9, 0.5], np.float32) if state is None else np.full(7, state)
    obs["state.joint_position"] = np.broadcast_to(joints.astype(np.float32), (b, t, 7)).copy()
    obs["state.gripper_position"] = np.full((b, t, 1), 0.25, np.float32)
    obs["annotation.language.language_instruction"] = ["pick up the cup"] * b
    return obs


def _status(reply: dict) -> int | str:
    return reply.get("status", "?")


# 1. Bombs ---------------------------------------------------------------------------------------------------------


def zmq_bomb(leaf: bytes, size: int, token: str | None) -> bytes:
    """`{"endpoint": "get_action", "data": {"observation": <tree of leaf>}, "api_token": token}` within `size` bytes:
    the token after `data`, so finding it means skipping the whole tree."""
    head = msgpack.packb("endpoint") + msgpack.packb("get_action") + msgpack.packb("data") + b"\x81"
    head += msgpack.packb("observation")
    tail = (msgpack.packb("api_token") + msgpack.packb(token)) if token else b""
    body = list_tree(leaf, size - len(head) - len(tail) - 16)
    return (b"\x83" if token else b"\x82") + head + body + tail


def scenario_zmq_bombs(cluster, args, port: int) -> dict:
    """Each bomb alone, with /healthz and the door's `ping` polled and the door replica's RSS sampled around it."""
    size = min(int(args.bomb_mib * MIB), ZMQ_MAX_MESSAGE) - 64 * 1024
    out: dict = {"message_mib": round(size / MIB, 1), "attacks": {}}
    ok = True
    for name, leaf in (("lists", b"\x90"), ("maps", b"\x80")):
        for keyed in (False, True):
            body = zmq_bomb(leaf, size, KEYS["attacker"] if keyed else None)
            caller = ZmqCaller(port, None, args.timeout_s * 4)
            try:
                with Sampler(cluster, "ZmqIngress/", {"zmq_ping": ping_probe(port)}) as sampler:
                    t = time.perf_counter()
                    reply = caller.call_raw(body)
                    wall = time.perf_counter() - t
            finally:
                caller.close()
            fig = sampler.figures()
            status = _status(reply)
            label = f"{name}-{'with-key' if keyed else 'no-key'}"
            out["attacks"][label] = {"status": status, "message": str(reply.get("error", ""))[:160],
                                     "reply_s": round(wall, 2), **fig}  # fmt: skip
            refused = isinstance(status, int) and 400 <= status < 500
            ok = (
                ok
                and refused
                and fig["zmqingress_rss_rise_mib"] <= 6 * len(body) / MIB
                and fig["healthz_worst_ms"] < 500
                and fig["zmq_ping_worst_ms"] < 500
                and not fig["healthz_failures"] + fig["zmq_ping_failures"]
            )
    out["pass"] = ok
    return out


# 2. Reset amplification -------------------------------------------------------------------------------------------


def _audit_resets(cluster, tenant: str) -> int | None:
    """`session reset` lines of `tenant` in the audit log of our node (None when there is no such file)."""
    from pathlib import Path

    root = Path(cluster.ray_tmp)  # Ray's session folders are under RAY_TMPDIR/ray
    files = [*root.glob("ray/session_2*/logs/serve/dreamzero_audit.log"), *root.glob("session_2*/logs/serve/*.log")]
    files = [f for f in files if f.name == "dreamzero_audit.log"]
    if not files:
        return None
    return sum(
        1
        for f in files
        for line in f.read_text(errors="replace").splitlines()
        if "session reset" in line and f"tenant={tenant}" in line
    )


def _flood_while_victim_steps(port: int, caller: ZmqCaller, endpoint: str, args) -> tuple[Counter, dict, list, float]:
    """`endpoint` (reset or ping) sent by `caller` as fast as it is answered for `args.zmq_reset_s` while the victim
    steps: (replies by status, the victim's figures, sessions each answered reset cleared, seconds)."""
    replies: Counter = Counter()
    cleared: list[int] = []
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        victim = pool.submit(_victim_steps, port, args.zmq_reset_s + 60, args.timeout_s, stop)
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.zmq_reset_s:
            reply = caller.call(endpoint, {"options": {}} if endpoint == "reset" else None)
            replies[str(_status(reply))] += 1
            if endpoint == "reset" and _status(reply) == 200:
                cleared.append(len(reply["reply"].get("cleared_sessions", [])))
        wall = time.monotonic() - t0
        stop.set()
        return replies, victim.result(timeout=args.timeout_s + 60), cleared, wall


def _victim_steps(port: int, seconds: float, timeout_s: float, stop: threading.Event | None = None) -> dict:
    """The victim steps one session over the ZeroMQ door for `seconds` (or until `stop`): latencies, errors."""
    caller = ZmqCaller(port, "victim", timeout_s)
    lat, errors = [], Counter()
    t0 = time.monotonic()
    try:
        i = 0
        while time.monotonic() - t0 < seconds and not (stop is not None and stop.is_set()):
            t = time.perf_counter()
            reply = caller.call("get_action", {"observation": droid_rows(1, 1 if i == 0 else 4, seed=i),
                                               "options": {"session_ids": [f"v{int(t0)}"]}})  # fmt: skip
            if _status(reply) == 200:
                lat.append(time.perf_counter() - t)
            else:
                errors[str(_status(reply))] += 1
            i += 1
    finally:
        caller.close()
    return {**latency_summary(lat[1:]), "errors": dict(errors)}  # the first call starts the session


def scenario_zmq_reset(cluster, args, port: int) -> dict:
    """The attacker holds `args.zmq_reset_sessions` sessions (8 per request), then resets without ids for
    `args.zmq_reset_s`; the victim steps meanwhile (and before, for the baseline)."""
    rows = 8
    attacker = ZmqCaller(port, "attacker", args.timeout_s, identity=b"reset-attacker")
    out: dict = {}
    try:
        held = Counter()
        for r in range(max(1, args.zmq_reset_sessions // rows)):
            ids = [f"a{r}-{k}" for k in range(rows)]
            held[str(_status(attacker.call("get_action", {"observation": droid_rows(rows, 1, seed=r),
                                                          "options": {"session_ids": ids}})))] += 1  # fmt: skip
        out["attacker_sessions"] = {"requests": dict(held), "sessions": held["200"] * rows, "routes": held["200"]}
        out["victim_before"] = _victim_steps(port, args.zmq_reset_s, args.timeout_s)
        # the control: as many messages a second that cost the door nothing (`ping`), so the share of the slowdown
        # that is the attacking client and the door's message handling on this small machine shows apart
        pings, out["victim_during_ping_flood"], _, wall = _flood_while_victim_steps(port, attacker, "ping", args)
        out["ping_flood_per_s"] = round(sum(pings.values()) / max(wall, 1e-9), 1)
        audit_before = _audit_resets(cluster, "attacker")
        with Sampler(cluster, "ZmqIngress/") as sampler:
            replies, out["victim_during"], cleared, out["attack_s"] = _flood_while_victim_steps(
                port, attacker, "reset", args
            )
        time.sleep(2)  # the audit lines of the last resets
        audit_after = _audit_resets(cluster, "attacker")
        out.update(sampler.figures())
    finally:
        attacker.close()
    out["attack_s"] = round(out["attack_s"], 1)
    answered = replies.get("200", 0)
    out["resets"] = {"sent": sum(replies.values()), "by_status": dict(replies), "per_s": round(
        sum(replies.values()) / max(out["attack_s"], 1e-9), 1)}  # fmt: skip
    out["sessions_per_reset"] = max(cleared, default=0)
    # the door calls the Policy once per routing key of the sessions it clears (deployments/doors/zmq.py `reset`)
    out["policy_calls_caused"] = answered * out["attacker_sessions"]["routes"]
    out["session_resets_audited"] = None if audit_before is None or audit_after is None else audit_after - audit_before
    before, control, during = out["victim_before"], out["victim_during_ping_flood"], out["victim_during"]
    out["pass"] = (
        replies.get("429", 0) > 0
        and answered <= 10 + 2 * args.zmq_reset_s + 2  # the bucket: a burst of 10, then 2 a second
        and not (before["errors"] or control["errors"] or during["errors"])
        and None not in (before["p50_ms"], control["p50_ms"], during["p50_ms"])
        and during["p50_ms"] < 1.5 * control["p50_ms"] + 100  # resets cost no more than any message as frequent
    )
    return out


# 3. Rejected requests ---------------------------------------------------------------------------------------------


def scenario_zmq_rejected(cluster, args, port: int) -> dict:
    """`args.zmq_rejected` get_action requests of 16 rows each refused (a state of 1e30), from 4 fixed identities;
    the door's RSS before and after; then `reset` without ids from each identity (what the door remembers)."""
    threads, rows = 4, 16
    per = max(1, args.zmq_rejected // threads)
    statuses: Counter = Counter()
    lock = threading.Lock()

    def reject(k: int) -> None:
        caller = ZmqCaller(port, "attacker", args.timeout_s, identity=f"rejected-{k}".encode())
        try:
            obs = droid_rows(rows, 1, seed=k, state=1e30, hw=(8, 8))  # small: the refusal is the point
            for i in range(per):
                ids = [f"r{k}-{i}-{j}" for j in range(rows)]
                payload = caller.message("get_action", {"observation": obs, "options": {"session_ids": ids}})
                s = str(_status(caller.call_raw(payload)))
                with lock:
                    statuses[s] += 1
        finally:
            caller.close()

    rss = lambda: sum(v for k, v in cluster.rss().items() if k.startswith("ZmqIngress/")) / MIB  # noqa: E731
    time.sleep(6)  # the attacker's reset bucket refills (a burst of 10 at 2 a second)
    before = rss()
    t0 = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(reject, k) for k in range(threads)]:
            f.result(timeout=min(args.scenario_timeout_s, 600))
    wall = time.monotonic() - t0
    time.sleep(2)
    after = rss()
    cleared: dict = {}
    for k in range(threads):
        caller = ZmqCaller(port, "attacker", args.timeout_s, identity=f"rejected-{k}".encode())
        try:
            reply = caller.call("reset", {"options": {}})
            cleared[f"rejected-{k}"] = (
                len(reply["reply"].get("cleared_sessions", [])) if _status(reply) == 200 else _status(reply)
            )
        finally:
            caller.close()
    out = {
        "requests": threads * per,
        "session_ids_sent": threads * per * rows,
        "by_status": dict(statuses),
        "wall_s": round(wall, 1),
        "door_rss_mib": {"before": round(before, 1), "after": round(after, 1), "rise": round(after - before, 1)},
        "cleared_by_reset_without_ids": cleared,
    }
    out["pass"] = (
        "200" not in statuses
        and all(v == 0 for v in cleared.values())
        and after - before < 16  # before issue 45: +31 MiB for 6,000 rejected requests, never freed
    )
    return out
