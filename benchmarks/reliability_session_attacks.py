"""The session attacks of `benchmarks/reliability.py` (issue 45): a cross-tenant eviction flood and NaN inputs.

- `evict-count` / `evict-bytes`: one Policy replica whose store holds ~16 sessions (`sessions.max_sessions: 16`, or
  `sessions.max_bytes` sized to 16 sessions of the served model); the victim holds 4 live sessions stepping
  continuously while the attacker (no quota) floods new sessions, 8 rows a request. Counted: the victim's steps
  answered `evicted` (must be 0), the attacker's refusals (503 / 429) and the Policy's own evictions.
- `nan`: requests whose state would turn into NaN actions (a normalised state of 1e30, NaN, -inf; a raw joint state of
  1e30 over HTTP and the ZeroMQ door): every one must be a 4xx naming the field, none a 200 with non-finite actions.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
from reliability_attacks import KEYS, Sampler
from reliability_clients import error_label
from reliability_stats import latency_summary
from serving_common import normalised_observation

from dreamzero_client.http_client import ActionClient
from dreamzero_client.wire import codec, generations, routes

#: sessions the store holds in both eviction runs, the victim's live sessions, the attacker's rows per request
STORE_SESSIONS, VICTIM_SESSIONS, FLOOD_ROWS = 16, 4, 8


def session_peak_bytes() -> int:
    """The peak footprint the served tiny model's Policy reserves per session (`sessions.max_bytes` counts these),
    from the configs alone, as the pipeline computes it (CPU: float32)."""
    import torch

    from dreamzero.config import preset
    from dreamzero.sessions import footprint_for

    cfg = preset("tiny")
    canvas = tuple(cfg.pipeline.model_input_hw)
    return footprint_for(cfg.dit, cfg.pipeline, cfg.vae, cfg.image_encoder, canvas, torch.float32).peak


def eviction_sessions(by: str, peak_bytes: int | None) -> dict:
    """The `sessions` args of an eviction run: the count, or a byte budget of 16.5 sessions (count left at 64)."""
    if by == "count":
        return {"max_sessions": STORE_SESSIONS, "ttl_s": 600}
    return {"max_sessions": 64, "ttl_s": 600, "max_bytes": int((STORE_SESSIONS + 0.5) * peak_bytes)}


def _rows(b: int, t: int, seed: int) -> dict:
    one = [normalised_observation(t, seed=seed + i) for i in range(b)]
    return {k: np.concatenate([o[k] for o in one]) for k in one[0]}


def _victim(url: str, sid: str, stop: threading.Event, timeout_s: float) -> dict:
    """One victim session stepping until `stop`: its replies' restart reasons and errors (no client retries)."""
    reasons, errors, lat = Counter(), Counter(), []
    with ActionClient(url, api_key=KEYS["victim"], timeout_s=timeout_s, max_retries=0) as client:
        i = 0
        while not stop.is_set():
            t = time.perf_counter()
            try:
                res = client.generate(_rows(1, 1 if i == 0 else 4, i), "p", [sid], form="normalised")
            except Exception as exc:  # noqa: BLE001 - every failure is counted
                errors[error_label(exc)] += 1
            else:
                lat.append(time.perf_counter() - t)
                report = res.sessions[0]
                reasons[str(report.get("restart_reason")) if report.get("restarted") else "continued"] += 1
            i += 1
    return {"reasons": reasons, "errors": errors, "latencies": lat}


def _flood(url: str, k: int, stop: threading.Event, timeout_s: float) -> dict:
    """The attacker: 8 fresh sessions a request until `stop`; the replies by outcome."""
    outcomes = Counter()
    with ActionClient(url, api_key=KEYS["attacker"], timeout_s=timeout_s, max_retries=0) as client:
        i = 0
        while not stop.is_set():
            ids = [f"flood{k}-{i}-{j}" for j in range(FLOOD_ROWS)]
            try:
                client.generate(_rows(FLOOD_ROWS, 1, i), "p", ids, form="normalised")
                outcomes["200"] += 1
            except Exception as exc:  # noqa: BLE001 - refusals are the point
                outcomes[str(getattr(exc, "status", None) or error_label(exc))] += 1
            client.forget_sessions(ids)
            i += 1
    return outcomes


def scenario_evict(cluster, args, by: str, peak_bytes: int | None = None) -> dict:
    """On the eviction app just deployed: the victim's sessions step, then the attacker floods for
    `args.evict_s` while they go on."""
    stop = threading.Event()
    out: dict = {"by": by, "store": f"{STORE_SESSIONS} sessions" if by == "count" else f"{peak_bytes} B x 16.5"}
    with ThreadPoolExecutor(VICTIM_SESSIONS + 2) as pool:
        victims = [pool.submit(_victim, cluster.url, f"b{i}", stop, args.timeout_s) for i in range(VICTIM_SESSIONS)]
        time.sleep(3)  # the victim's sessions are live and stepping
        with Sampler(cluster) as sampler:
            floods = [pool.submit(_flood, cluster.url, k, stop, args.timeout_s) for k in range(2)]
            time.sleep(args.evict_s)
            stop.set()
            attacker = sum((f.result(timeout=args.timeout_s + 60) for f in floods), Counter())
        results = [f.result(timeout=args.timeout_s + 60) for f in victims]
    stats = next(iter(cluster.policy_stats(1).values()), {})
    reasons = sum((r["reasons"] for r in results), Counter())
    errors = sum((r["errors"] for r in results), Counter())
    out["victim"] = {"steps": dict(reasons), "errors": dict(errors),
                     "latency": latency_summary([x for r in results for x in r["latencies"]])}  # fmt: skip
    out["attacker"] = dict(attacker)
    out["policy"] = {k: stats.get(k) for k in ("live", "max_sessions", "max_bytes", "reserved_bytes", "evictions")}
    if stats.get("live") and stats.get("reserved_bytes"):
        out["policy"]["reserved_per_session"] = round(stats["reserved_bytes"] / stats["live"])
    out.update(sampler.figures())
    # the attacker's own idle sessions make room first (no refusal needed); 503 / 429 when even they cannot
    out["attacker_refusals"] = sum(v for k, v in attacker.items() if k in ("503", "429"))
    out["attacker_sessions_started"] = attacker.get("200", 0) * FLOOD_ROWS
    out["pass"] = reasons.get("evicted", 0) == 0 and not errors and reasons.get("continued", 0) > 0
    return out


def _http_probe(url: str, tenant: str, obs: dict, form: str, timeout_s: float) -> tuple[int, str | None, bool]:
    """(status, the error's field, whether a 200 carried non-finite actions) of one request."""
    body = generations.build_request_body(obs, ["p"], [f"nan-{time.monotonic_ns()}"], form=form)
    payload, ctype = codec.encode_body(body)
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        resp = client.post(f"{url}{routes.GENERATIONS_PATH}", content=payload,
                           headers={"Authorization": f"Bearer {KEYS[tenant]}", "content-type": ctype})  # fmt: skip
    reply = codec.decode_body(resp.content, resp.headers.get("content-type"))[0]
    if resp.status_code == 200:
        arrays = [np.asarray(v, np.float64) for v in _leaves(reply)]
        return 200, None, not all(np.isfinite(a).all() for a in arrays if a.dtype.kind == "f")
    err = reply.get("error", {}) if isinstance(reply, dict) else {}
    return resp.status_code, err.get("field"), False


def _leaves(obj):
    """Every float array or number under a decoded reply (to check the actions are finite)."""
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)
    elif isinstance(obj, (np.ndarray, float)):
        yield obj


def scenario_nan(cluster, args, zmq_port: int | None) -> dict:
    """`args.nan_requests` requests of each kind; their statuses and the fields the refusals name."""
    from reliability_zmq_attacks import ZmqCaller, droid_rows
    from serving_common import droid_observation

    def normalised(value: float) -> dict:
        obs = normalised_observation(1)
        obs["state"][0, 0, 0] = value
        return obs

    def raw_http() -> dict:
        obs = droid_observation(1)
        obs["state.joint_position"][0, 0] = 1e30
        return obs

    kinds = {
        "http-normalised-1e30": lambda: _http_probe(cluster.url, "attacker", normalised(1e30), "normalised", 30),
        "http-normalised-nan": lambda: _http_probe(cluster.url, "attacker", normalised(np.nan), "normalised", 30),
        "http-normalised-neg-inf": lambda: _http_probe(cluster.url, "attacker", normalised(-np.inf), "normalised", 30),
        "http-raw-1e30": lambda: _http_probe(cluster.url, "attacker", raw_http(), "raw", 30),
    }
    out: dict = {"requests_each": args.nan_requests, "kinds": {}}
    if zmq_port is not None:
        caller = ZmqCaller(zmq_port, "attacker", args.timeout_s)

        def zmq_raw() -> tuple[int, str | None, bool]:
            reply = caller.call("get_action", {"observation": droid_rows(1, 1, state=1e30),
                                               "options": {"session_ids": [f"nan-{time.monotonic_ns()}"]}})  # fmt: skip
            status = reply.get("status")
            bad = status == 200 and not all(np.isfinite(np.asarray(a)).all() for a in reply["reply"][0].values())
            return status, reply.get("field"), bad

        kinds["zmq-raw-1e30"] = zmq_raw
    ok = True
    try:
        for name, probe in kinds.items():
            statuses, fields, nan_200 = Counter(), Counter(), 0
            for _ in range(args.nan_requests):
                status, field, bad = probe()
                statuses[str(status)] += 1
                fields[str(field)] += 1
                nan_200 += bad
            out["kinds"][name] = {"by_status": dict(statuses), "fields": dict(fields), "200_with_nan": nan_200}
            ok = ok and nan_200 == 0 and all(s.startswith("4") for s in statuses) and "None" not in fields
    finally:
        if zmq_port is not None:
            caller.close()
    out["pass"] = ok
    return out
