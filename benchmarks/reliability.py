"""Reliability on every path: load, replica kills, scaling, misbehaving clients, a soak and attacks on the front
door (docs/reliability.md).

    PYTHONPATH=$PWD/clients python benchmarks/reliability.py                      # everything, 30-minute soak
    PYTHONPATH=$PWD/clients python benchmarks/reliability.py --only load,kill-policy --clients 6 --requests 20

One private single-node Ray on loopback (benchmarks/reliability_cluster.py) serves the graph with the tiny embedded
model; clients of the three paths (raw HTTP, normalised HTTP, OpenPI WebSocket; benchmarks/reliability_clients.py)
drive it from outside. Every client call is bounded by `--timeout-s`, every scenario by `--scenario-timeout-s`, and
every Ray process of the private temp dir is gone when the script returns. Results: a JSON file (`--json`) and a
summary on stdout; each scenario says whether its criterion held ("pass").
"""
# Longer than ~400 lines on purpose: every scenario of docs/reliability.md in one script that shares one cluster set-up.

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the sibling helper modules
from reliability_stats import (
    SCENARIOS,
    is_retryable,
    latency_summary,
    parse_only,
    recovery_time_s,
    rss_drift,
    rss_within,
)

#: the tiny embedded model with the cheapest loop that still runs every stage (as tests/cluster does)
SERVER_ARGS = {
    "pipeline": {"num_inference_steps": 2, "dit_step_mask": None},
    "sessions": {"max_sessions": 64, "ttl_s": 600},
    "batching": {"max_batch_size": 8, "batch_wait_timeout_s": 0.01},
    # the door's own bounds, as shipped: Serve's proxy timeout stays off (it would end every WebSocket connection at
    # that age), and a request body that has not arrived within request_timeout_s is a 408 from the door
    "http": {
        "ws_idle_timeout_s": 10.0,
        "request_timeout_s": 60.0,
        # every client here comes from one address without a key, which the connection caps count as one caller
        # (docs/serving.md, "Connections and request slots"): room for all of them; `bombs` and `slots` use the
        # shipped caps with two tenants (reliability_attacks.attack_args)
        "ws_max_per_tenant": 24,
        "body_reads_per_tenant": 24,
    },
    # every raw request crosses all four deployments, so a Preprocess kill is felt (the shipped `auto` transforms
    # usual sizes in the ingress, where a Preprocess kill touches only large requests)
    "preprocess": {"placement": "replicas"},
    "postprocess": {"placement": "replicas"},
}
BASE_POLICY_REPLICAS = 2
DOOR_TIMEOUT_S = SERVER_ARGS["http"]["request_timeout_s"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help=f"comma-separated scenarios (default all): {','.join(SCENARIOS)}")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients of the load and kill scenarios")
    p.add_argument("--requests", type=int, default=200, help="calls per client in the load and kill scenarios")
    p.add_argument("--timeout-s", type=float, default=30.0, help="bound of every client call (per attempt)")
    p.add_argument("--scenario-timeout-s", type=float, default=1800.0, help="bound of each scenario's client loops")
    p.add_argument("--scale-sessions", type=int, default=100, help="live sessions while scaling 2 -> 4 -> 2")
    p.add_argument("--scale-hold-s", type=float, default=30.0, help="seconds of load after each scaling step")
    p.add_argument("--disconnects", type=int, default=20, help="WebSocket clients that hang up mid-request")
    p.add_argument("--trickle-s", type=float, default=20.0, help="seconds a slow client trickles its body")
    p.add_argument("--soak-minutes", type=float, default=30.0, help="length of the soak")
    p.add_argument("--soak-clients", type=int, default=6, help="clients of the soak (mixed paths)")
    p.add_argument("--soak-pause-s", type=float, default=0.5, help="pause between a soak client's calls")
    p.add_argument("--rss-bound-mib", type=float, default=64.0, help="largest RSS growth per replica after warm-up")
    p.add_argument("--rss-interval-s", type=float, default=15.0, help="RSS / session sampling period of the soak")
    p.add_argument("--bomb-mib", type=float, default=64.0, help="size of the bomb bodies (the body limit: 64)")
    p.add_argument("--zmq-reset-sessions", type=int, default=64, help="sessions the ZeroMQ reset attacker holds")
    p.add_argument("--zmq-reset-s", type=float, default=10.0, help="seconds of resets (and of the victim baseline)")
    p.add_argument("--zmq-rejected", type=int, default=6000, help="rejected ZeroMQ requests of zmq-rejected")
    p.add_argument("--nan-requests", type=int, default=5, help="requests of each kind of the nan scenario")
    p.add_argument("--evict-s", type=float, default=20.0, help="seconds of the eviction flood (each of two runs)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    try:
        args.scenarios = parse_only(args.only)
    except ValueError as e:
        p.error(str(e))
    for name in ("clients", "requests", "scale_sessions", "disconnects", "soak_clients", "zmq_reset_sessions",
                 "zmq_rejected", "nan_requests"):  # fmt: skip
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("timeout_s", "scenario_timeout_s", "soak_minutes", "rss_interval_s", "trickle_s", "zmq_reset_s",
                 "evict_s"):  # fmt: skip
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    return args


# 1. Summaries of worker records ----------------------------------------------------------------------------------


def error_name(record) -> str:
    return record.error if record.error else "ok"


def summarise(workers, hung: list[str]) -> dict:
    """Per path: calls, errors by type, latency of the successful calls, continuity verdicts."""
    out: dict = {"hung_clients": hung, "paths": {}}
    for kind in sorted({w.kind for w in workers}):
        group = [w for w in workers if w.kind == kind]
        records = [r for w in group for r in w.records]
        ok = [r for r in records if r.ok]
        verdicts = Counter(r.verdict for r in ok)
        reasons: Counter = Counter()
        for w in group:
            reasons.update(w.ledger.reasons)
        lost = sum(w.ledger.lost for w in group)
        out["paths"][kind] = {
            "clients": len(group),
            "calls": len(records),
            "errors": dict(Counter(r.error for r in records if not r.ok)),
            "latency": latency_summary([r.end - r.start for r in ok]),
            "verdicts": dict(verdicts),
            "restart_reasons": dict(reasons),
            "lost_state_restarts": lost,
            "error_examples": [r.message for r in records if not r.ok][:3],
        }
        if kind == "openpi":
            out["paths"][kind]["ws_connections_opened"] = sum(w.connections for w in group)
    out["errors"] = sum(sum(p["errors"].values()) for p in out["paths"].values())
    out["silent_stale"] = sum(p["verdicts"].get("silent_stale", 0) for p in out["paths"].values())
    return out


def affected_http_sessions(workers, victim: str, kill_at: float) -> dict:
    """HTTP sessions last served by the killed Policy replica: was their first reply after the kill flagged?"""
    flagged, silent = [], []
    for w in workers:
        if w.kind == "openpi":
            continue
        before = [r for r in w.records if r.ok and r.end <= kill_at]
        if not before or before[-1].replica != victim:
            continue
        after = [r for r in w.records if r.ok and r.end > kill_at and r.replica != victim]
        if after:
            (flagged if after[0].verdict == "restarted" else silent).append(w.name)
    return {"affected": len(flagged) + len(silent), "flagged_restarted": len(flagged), "not_flagged": silent}


# 2. Scenarios ------------------------------------------------------------------------------------------------------


def scenario_load(cluster, args) -> dict:
    from reliability_clients import mixed_workers, run_workers

    deadline = time.monotonic() + args.scenario_timeout_s
    workers = mixed_workers(args.clients, cluster.url, args.requests, deadline, "load", timeout_s=args.timeout_s)
    t0 = time.monotonic()
    hung = run_workers(workers, grace_s=args.timeout_s * 5)
    out = summarise(workers, hung)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    out["all_paths_latency"] = latency_summary([r.end - r.start for w in workers for r in w.records if r.ok])
    out["pass"] = not hung and out["errors"] == 0 and out["silent_stale"] == 0
    return out


def _wait_progress(workers, calls_each: int, timeout_s: float) -> None:
    """Until every worker has `calls_each` successful calls (bounded): kill under load, not before it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(sum(r.ok for r in w.records) >= calls_each for w in workers):
            return
        time.sleep(0.2)


def scenario_kill(cluster, args, deployment: str) -> dict:
    """Kill one `deployment` replica under load; the controller replaces it while the clients keep calling."""
    from reliability_clients import mixed_workers, run_workers

    deadline = time.monotonic() + args.scenario_timeout_s
    # Policy and Ingress kills: the HTTP clients' own bounded retries ride them out (an Ingress dying with calls in
    # flight is a 500 from Serve's proxy, which ActionClient retries with the continuity echo: docs/reliability.md);
    # Preprocess: no retries, so every refusal is seen as it is and timed (it must be a prompt 503)
    retries = 0 if deployment == "Preprocess" else 3
    workers = mixed_workers(
        args.clients, cluster.url, args.requests, deadline, f"k{deployment[:3].lower()}",
        timeout_s=args.timeout_s, http_retries=retries,
    )  # fmt: skip
    event: dict = {}

    def kill() -> None:
        _wait_progress(workers, 3, args.scenario_timeout_s / 4)
        before = set(cluster.replicas(deployment))
        event["victim"] = cluster.kill_one(deployment)
        event["kill_at"] = time.monotonic()
        replicas = BASE_POLICY_REPLICAS if deployment == "Policy" else 1
        # replaced: the controller started a replica under a new name and it is RUNNING (bounded)
        while time.monotonic() - event["kill_at"] < 600 and not set(cluster.replicas(deployment)) - before:
            time.sleep(0.5)
        cluster.wait_replicas(deployment, replicas, 600)
        event["replaced_after_s"] = round(time.monotonic() - event["kill_at"], 1)

    hung = run_workers(workers, grace_s=args.timeout_s * 5, during=kill)
    out = summarise(workers, hung)
    kill_at = event["kill_at"]
    out["killed"] = event["victim"]
    out["replica_replaced_after_s"] = event["replaced_after_s"]
    out["all_served_again_after_s"] = recovery_time_s(
        kill_at, {w.name: [r.end for r in w.records if r.ok] for w in workers}
    )
    out["error_kinds"] = dict(Counter(r.error for w in workers for r in w.records if not r.ok))
    out["non_retryable_errors"] = [e for e in out["error_kinds"] if not is_retryable(e)]
    failed = [r.end - r.start for w in workers for r in w.records if not r.ok]
    out["slowest_error_s"] = round(max(failed), 1) if failed else None
    ok = not hung and not out["non_retryable_errors"] and out["silent_stale"] == 0
    if deployment == "Ingress":  # with the clients' retries nothing may reach the caller, a 500 least of all
        ok = ok and out["errors"] == 0
    if deployment == "Policy":
        victim_id = event["victim"].rsplit("#", 1)[1]
        out["affected_http_sessions"] = affected_http_sessions(workers, victim_id, kill_at)
        out["lost_state_restarts_openpi"] = sum(w.ledger.lost for w in workers if w.kind == "openpi")
        ok = ok and not out["affected_http_sessions"]["not_flagged"] and out["all_served_again_after_s"] is not None
    out["pass"] = ok
    return out


def scenario_scale(cluster, args) -> dict:
    """`--scale-sessions` live sessions while the Policy goes 2 -> 4 -> 2 replicas: none silently stale."""
    from reliability_clients import Worker, run_workers

    deadline = time.monotonic() + args.scenario_timeout_s
    n_ws = max(1, args.scale_sessions // 25)  # one session per WebSocket connection
    n_http = 8
    per_http = max(1, -(-(args.scale_sessions - n_ws) // n_http))
    workers = [Worker(f"sws{i}", "openpi", cluster.url, 10**6, deadline, args.timeout_s) for i in range(n_ws)]
    workers += [
        Worker(f"shttp{i}", ("raw", "normalised")[i % 2], cluster.url, 10**6, deadline, args.timeout_s, per_http)
        for i in range(n_http)
    ]
    phases: list[dict] = []

    def scale() -> None:
        _wait_progress(workers, per_http, args.scenario_timeout_s / 4)  # every session is live
        for replicas in (4, BASE_POLICY_REPLICAS):
            t0 = time.monotonic()
            cluster.deploy(SERVER_ARGS, policy_replicas=replicas)
            phases.append({"policy_replicas": replicas, "scaled_in_s": round(time.monotonic() - t0, 1)})
            time.sleep(args.scale_hold_s)
        for w in workers:
            w.stop.set()

    hung = run_workers(workers, grace_s=args.timeout_s * 5, during=scale)
    out = summarise(workers, hung)
    out["live_sessions"] = n_ws + n_http * per_http
    out["phases"] = phases
    out["replicas_seen"] = len({r.replica for w in workers for r in w.records if r.replica})
    out["pass"] = not hung and out["silent_stale"] == 0 and len(phases) == 2
    return out


def _ws_hang_up(url: str, i: int) -> str:
    """Open the OpenPI socket, send one infer and close without reading the reply."""
    from reliability_clients import openpi_observation
    from websockets.sync.client import connect

    from dreamzero_client.wire import openpi, routes

    ws_url = url.replace("http://", "ws://") + routes.OPENPI_WS_PATH
    with connect(ws_url, open_timeout=30, close_timeout=5, max_size=2**26, compression=None) as ws:
        ws.recv(timeout=30)  # handshake
        ws.send(openpi.pack_frame(openpi_observation(f"gone-{i}", seed=i)))
    return "closed"


def _trickle_http(url: str, seconds: float, timeout_s: float) -> dict:
    """POST a body one byte a second for `seconds`, then wait (bounded) for whatever the server does."""
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
        s.sendall(
            b"POST /v1/actions/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
            b"Content-Length: 100000\r\n\r\n"
        )
        sent = 0
        try:
            while time.monotonic() - t0 < seconds:
                s.sendall(b"\x00")
                sent += 1
                time.sleep(1.0)
            s.settimeout(timeout_s)
            first = s.recv(200)
            outcome = first.split(b"\r\n", 1)[0].decode(errors="replace") or "closed by server"
        except OSError as exc:
            outcome = f"{type(exc).__name__}"
    return {"bytes_sent": sent, "outcome": outcome, "wall_s": round(time.monotonic() - t0, 1)}


def _ws_silent(url: str, timeout_s: float) -> dict:
    """Open the OpenPI socket, read the handshake, send nothing: the server must close it (idle timeout)."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    from dreamzero_client.wire import routes

    t0 = time.monotonic()
    ws_url = url.replace("http://", "ws://") + routes.OPENPI_WS_PATH
    with connect(ws_url, open_timeout=30, close_timeout=5, max_size=2**26) as ws:
        ws.recv(timeout=30)
        try:
            ws.recv(timeout=timeout_s)
            outcome = "unexpected frame"
        except ConnectionClosed as exc:
            outcome = f"closed by server ({exc.rcvd.code if exc.rcvd else 'no code'})"
        except TimeoutError:
            outcome = "still open"
    return {"outcome": outcome, "wall_s": round(time.monotonic() - t0, 1)}


def _live_sessions(cluster) -> int:
    """Sessions held by all Policy replicas together (the replicas' own session-store stats)."""
    return sum(int(s.get("live", 0)) for s in cluster.policy_stats(BASE_POLICY_REPLICAS).values())


def _settle(cluster, metric: str, target: float, timeout_s: float) -> tuple[float | None, float]:
    """Poll a summed gauge until it is <= target (bounded); (last value, seconds waited)."""
    t0 = time.monotonic()
    value = cluster.metric_sum(metric)
    while (value is None or value > target) and time.monotonic() - t0 < timeout_s:
        time.sleep(1.0)
        value = cluster.metric_sum(metric)
    return value, round(time.monotonic() - t0, 1)


def scenario_disconnect(cluster, args) -> dict:
    """WebSocket clients hanging up mid-request, a body trickled byte by byte, a silent socket; normal clients on
    the side. Afterwards the open-connection and live-session gauges come back to where they were."""
    from concurrent.futures import ThreadPoolExecutor

    from reliability_clients import Worker, run_workers

    time.sleep(3)  # gauges report every second
    ws_before = cluster.metric_sum("ray_dreamzero_ws_connections") or 0.0  # absent: no socket was ever counted
    live_before = _live_sessions(cluster)
    deadline = time.monotonic() + args.scenario_timeout_s
    side = [Worker(f"side{i}", "openpi", cluster.url, 10**6, deadline, args.timeout_s) for i in range(2)]
    results: dict = {}

    def misbehave() -> None:
        with ThreadPoolExecutor(6) as pool:
            trickle = pool.submit(_trickle_http, cluster.url, args.trickle_s, DOOR_TIMEOUT_S + 30)
            silent = pool.submit(_ws_silent, cluster.url, SERVER_ARGS["http"]["ws_idle_timeout_s"] + 30)
            hangups = [pool.submit(_ws_hang_up, cluster.url, i) for i in range(args.disconnects)]
            outcomes = Counter()
            for f in hangups:
                try:
                    outcomes[f.result(timeout=120)] += 1
                except Exception as exc:  # noqa: BLE001 - reported
                    outcomes[type(exc).__name__] += 1
            results["hang_ups"] = dict(outcomes)
            results["trickle_http"] = trickle.result(timeout=args.trickle_s + DOOR_TIMEOUT_S + 90)
            results["silent_ws"] = silent.result(timeout=SERVER_ARGS["http"]["ws_idle_timeout_s"] + 90)
        for w in side:
            w.stop.set()

    hung = run_workers(side, grace_s=args.timeout_s * 5, during=misbehave)
    out = {**summarise(side, hung), **results}
    ws_after, ws_wait = _settle(cluster, "ray_dreamzero_ws_connections", ws_before, 60)
    t0 = time.monotonic()
    # the side clients resume (OpenPIClient(resume=True)): their one session each stays for a reconnect until the
    # TTL, by design; the hang-ups' plain connections must leave nothing behind
    expected = live_before + len(side)
    live_after = _live_sessions(cluster)
    while live_after > expected and time.monotonic() - t0 < 60:  # a dropped session is freed within a call
        time.sleep(1.0)
        live_after = _live_sessions(cluster)
    out["ws_connections"] = {"before": ws_before, "after": ws_after, "settled_in_s": ws_wait}
    out["live_sessions"] = {
        "before": live_before,
        "resumable_side_sessions": len(side),
        "after": live_after,
        "settled_in_s": round(time.monotonic() - t0, 1),
    }
    out["pass"] = (
        not hung
        and out["errors"] == 0
        and ws_after is not None
        and ws_after <= ws_before
        and live_after <= expected
        and results["silent_ws"]["outcome"].startswith("closed")
        and not results["trickle_http"]["outcome"].startswith("HTTP/1.1 200")
    )
    return out


def scenario_soak(cluster, args) -> dict:
    """Moderate mixed load for `--soak-minutes` with episodes of 20 steps; RSS and live sessions sampled."""
    from reliability_clients import mixed_workers, run_workers

    length_s = args.soak_minutes * 60
    deadline = time.monotonic() + length_s
    workers = mixed_workers(
        args.soak_clients, cluster.url, 10**7, deadline, "soak",
        timeout_s=args.timeout_s, episode_steps=20, pause_s=args.soak_pause_s,
    )  # fmt: skip
    rss: dict[str, list[tuple[float, int]]] = {}
    live_max: dict[str, int] = {}
    bytes_max: dict[str, int] = {}
    sample_errors: dict[str, int] = {}
    t0 = time.monotonic()

    def sample() -> None:
        while time.monotonic() < deadline:
            now = time.monotonic() - t0
            for label, value in cluster.rss().items():
                rss.setdefault(label, []).append((now, value))
            try:
                for replica, stats in cluster.policy_stats(BASE_POLICY_REPLICAS, timeout_s=30).items():
                    live_max[replica] = max(live_max.get(replica, 0), int(stats.get("live", 0)))
                    bytes_max[replica] = max(bytes_max.get(replica, 0), int(stats.get("bytes", 0)))
            except Exception as exc:  # noqa: BLE001 - a sample lost to a busy replica is recorded, not fatal
                sample_errors[type(exc).__name__] = sample_errors.get(type(exc).__name__, 0) + 1
            time.sleep(min(args.rss_interval_s, max(0.0, deadline - time.monotonic())))

    hung = run_workers(workers, grace_s=args.timeout_s * 5, during=sample)
    warmup_s = min(120.0, 0.2 * length_s)
    drift = rss_drift(rss, warmup_s)
    out = summarise(workers, hung)
    out["minutes"] = round((time.monotonic() - t0) / 60, 1)
    out["rss_warmup_s"] = warmup_s
    out["rss_bound_mib"] = args.rss_bound_mib
    out["rss"] = drift
    out["rss_flat"] = rss_within(drift, args.rss_bound_mib)
    budget = SERVER_ARGS["sessions"]["max_sessions"]
    out["live_sessions_max_per_replica"] = live_max
    out["session_bytes_max_per_replica_mib"] = {r: round(b / 2**20, 2) for r, b in bytes_max.items()}
    out["session_budget_per_replica"] = budget
    out["stats_sample_errors"] = sample_errors
    out["sessions_within_budget"] = bool(live_max) and max(live_max.values()) <= budget
    out["pass"] = (
        (not hung and out["errors"] == 0 and out["silent_stale"] == 0)
        and out["rss_flat"]
        and out["sessions_within_budget"]
    )
    return out


# 3. Main -----------------------------------------------------------------------------------------------------------


def _attack(cluster, args, name: str) -> dict:
    """The attacks (benchmarks/reliability_attacks.py and its siblings) on the app with two tenants, the shipped caps
    and the ZeroMQ door on loopback, deployed once for all of them (they run last); the eviction runs deploy their own
    app (one Policy replica with a small store), so an attack after them deploys the attack app again."""
    import reliability_attacks as attacks
    import reliability_session_attacks as session_attacks
    import reliability_zmq_attacks as zmq_attacks
    from reliability_cluster import free_port

    if name.startswith("evict-"):
        by = name.split("-", 1)[1]
        peak = session_attacks.session_peak_bytes() if by == "bytes" else None
        server = {**SERVER_ARGS, "sessions": session_attacks.eviction_sessions(by, peak)}
        cluster.deploy(attacks.attack_args(server), policy_replicas=1)
        cluster.attack_app = False
        return session_attacks.scenario_evict(cluster, args, by, peak)
    if not getattr(cluster, "attack_app", False):
        cluster.zmq_port = free_port()
        cluster.deploy(attacks.attack_args(SERVER_ARGS, cluster.zmq_port), policy_replicas=BASE_POLICY_REPLICAS)
        zmq_attacks.wait_for_door(cluster.zmq_port)
        cluster.attack_app = True
    port = cluster.zmq_port
    runners = {
        "bombs": lambda: attacks.scenario_bombs(cluster, args),
        "slots": lambda: attacks.scenario_slots(cluster, args, 8, SERVER_ARGS["http"]["ws_idle_timeout_s"]),
        "zmq-bombs": lambda: zmq_attacks.scenario_zmq_bombs(cluster, args, port),
        "zmq-reset": lambda: zmq_attacks.scenario_zmq_reset(cluster, args, port),
        "zmq-rejected": lambda: zmq_attacks.scenario_zmq_rejected(cluster, args, port),
        "nan": lambda: session_attacks.scenario_nan(cluster, args, port),
    }
    return runners[name]()


def print_summary(results: dict) -> None:
    for name, res in results.items():
        if name.startswith("_"):
            continue
        head = "PASS" if res.get("pass") else "FAIL"
        print(f"\n== {name}: {head}")
        for kind, path in res.get("paths", {}).items():
            print(f"  {kind:10s} calls {path['calls']:5d} errors {path['errors']} latency {path['latency']}")
            print(f"  {'':10s} verdicts {path['verdicts']} restarts {path['restart_reasons']}")
        for key, value in res.items():
            if key not in ("paths", "pass"):
                print(f"  {key}: {value}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the clients' retry warnings would drown the summary
    from reliability_cluster import Cluster

    results: dict = {"_run": {"argv": sys.argv[1:], "scenarios": args.scenarios, "server_args": SERVER_ARGS}}
    t_start = time.time()
    with Cluster(request_timeout_s=None) as cluster:
        t0 = time.monotonic()
        cluster.deploy(SERVER_ARGS, policy_replicas=BASE_POLICY_REPLICAS)
        results["_run"]["deploy_s"] = round(time.monotonic() - t0, 1)
        runners = {
            "load": scenario_load,
            "kill-policy": lambda c, a: scenario_kill(c, a, "Policy"),
            "kill-preprocess": lambda c, a: scenario_kill(c, a, "Preprocess"),
            "kill-ingress": lambda c, a: scenario_kill(c, a, "Ingress"),
            "scale": scenario_scale,
            "disconnect": scenario_disconnect,
            "soak": scenario_soak,
            **{name: (lambda c, a, n=name: _attack(c, a, n)) for name in SCENARIOS[SCENARIOS.index("bombs") :]},
        }
        for name in args.scenarios:
            t0 = time.monotonic()
            print(f"-- {name} ({time.strftime('%H:%M:%S')})", flush=True)
            try:
                results[name] = runners[name](cluster, args)
            except Exception as exc:  # noqa: BLE001 - one scenario failing must not hide the others' results
                results[name] = {"pass": False, "exception": f"{type(exc).__name__}: {exc}"}
            results[name]["scenario_s"] = round(time.monotonic() - t0, 1)
            cluster.wait_healthy(600)  # the next scenario starts on a healthy graph
            if args.json:
                args.json.write_text(json.dumps(results, indent=1, default=str))
    results["_run"]["started"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t_start))
    results["_run"]["wall_min"] = round((time.time() - t_start) / 60, 1)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    print_summary(results)
    return 0 if all(r.get("pass") for k, r in results.items() if not k.startswith("_")) else 1


if __name__ == "__main__":
    # `timeout` / `kill` send SIGTERM: unwind through `with Cluster` so Serve, Ray and their processes go too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    threading.excepthook = lambda hook: logging.error("thread %s: %r", hook.thread, hook.exc_value)
    sys.exit(main())
