"""What an operator does to a running server, with sessions stepping throughout: edit the shipped serve_config.yaml's
`deployments:` section (Policy 1 -> 3 -> 1 replicas, a session TTL change through `user_config`) and deploy it again.

The config goes to the controller as `serve deploy` sends it (its `applications`; the cluster's HTTP options are
fixed at start). The only edits besides the operator's: the tiny model and a cheap loop under `args`, made once
before the first deploy. Checked: every call answered (a 503 is retried, as its contract says), the sessions started
before scaling never restart for any reason but the model's own window and never change replica, and the TTL change
reaches the running replica (an idle session past the new TTL comes back `evicted`) and removing it brings the
`args` TTL back, all without a restart. A busy session may come back `evicted` only where its client saw more than
the new TTL pass between two answers while that TTL was live (a loaded CPU or a redeploy's 503s can make a gap that
long; the store is then right to drop it).
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import yaml
from ray import serve

from tests.support.cluster import (
    APP,
    BASE_ARGS,
    DEPLOY_TIMEOUT_S,
    forget_deployed_app,
    wait_deployed,
    wait_healthy,
    wait_replicas,
)
from tests.support.request_builders import decode, normalised_body
from tests.support.serve_process import ROOT

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GEN = "/v1/actions/generations"
ACTIVE = [f"live-{i}" for i in range(4)]
NEW_TTL_S = 12.0
MAX_503_RETRIES = 30


def shipped_config() -> dict:
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    app = cfg["applications"][0]
    app["name"] = APP
    app["args"].update({**copy.deepcopy(BASE_ARGS), "model_path": None})  # the tiny model, the cheap loop
    return cfg


def policy_entry(cfg: dict) -> dict:
    return next(d for d in cfg["applications"][0]["deployments"] if d["name"] == "Policy")


def serve_deploy(cfg: dict, policy_replicas: int) -> None:
    from ray import serve
    from ray.serve.schema import ServeDeploySchema

    started = time.time()
    serve.context._get_global_client().deploy_apps(ServeDeploySchema(applications=cfg["applications"]))
    wait_deployed(started, DEPLOY_TIMEOUT_S)
    wait_replicas("Policy", policy_replicas, DEPLOY_TIMEOUT_S)


class Robot:
    """One session's client: echoes its step and incarnation, retries a 503, records every report."""

    def __init__(self, http, base: str, sid: str):
        self.http, self.base, self.sid = http, base, sid
        self.step: int | None = None
        self.incarnation: str | None = None
        self.reports: list[tuple[dict, str]] = []
        self.times: list[tuple[float, float]] = []  # (sent, answered), monotonic, one per report

    def call(self) -> dict:
        for attempt in range(MAX_503_RETRIES):
            body = normalised_body(
                [self.sid],
                t=1 if self.step is None else 4,
                expected_steps=None if self.step is None else [self.step],
                expected_incarnations=None if self.incarnation is None else [self.incarnation],
            )
            sent = time.monotonic()
            resp = self.http.post(self.base + GEN, content=body, headers={"content-type": "application/msgpack"})
            if resp.status_code == 503:
                time.sleep(0.5 + 0.1 * attempt)
                continue
            assert resp.status_code == 200, (self.sid, resp.status_code, resp.content[:300])
            out = decode(resp.content)
            report = out["sessions"][0]
            self.step, self.incarnation = report["step"], report["incarnation"]
            self.reports.append((report, out["served_by"]))
            self.times.append((sent, time.monotonic()))
            return report
        raise AssertionError(f"{self.sid}: still 503 after {MAX_503_RETRIES} retries")


def test_scaling_and_a_ttl_change_through_the_shipped_config_lose_no_session(http, serve_cluster):
    base = serve_cluster[0]
    cfg = shipped_config()
    assert policy_entry(cfg)["num_replicas"] == 1  # the shipped file has the section the operator edits
    try:
        serve_deploy(cfg, 1)
        wait_healthy(base, DEPLOY_TIMEOUT_S)
        robots = [Robot(http, base, sid) for sid in ACTIVE]
        idle = Robot(http, base, "idle-0")
        for robot in (*robots, idle):
            robot.call()
        idle_since = time.monotonic()
        stop, errors = threading.Event(), []

        def drive(robot: Robot) -> None:
            try:
                while not stop.is_set():
                    robot.call()
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                errors.append(exc)

        threads = [threading.Thread(target=drive, args=(r,), daemon=True) for r in robots]
        for t in threads:
            t.start()

        policy_entry(cfg)["user_config"] = {"sessions": {"ttl_s": NEW_TTL_S}}  # edit 1: a shorter session TTL
        short_ttl_from = time.monotonic()  # the new TTL is live at most from here to the end of edit 2
        serve_deploy(cfg, 1)
        time.sleep(max(0.0, NEW_TTL_S + 2 - (time.monotonic() - idle_since)))
        expired = idle.call()  # one replica: it is routed where its state was, so the reason is the store's
        del policy_entry(cfg)["user_config"]  # edit 2: back to the args TTL
        serve_deploy(cfg, 1)
        short_ttl_until = time.monotonic()
        # Serve calls reconfigure on a removed user_config only where it takes `rank`: the running replica must have
        # taken the args TTL back, not kept the short one (sessions evicted after the revert, once, in CI)
        live = serve.get_deployment_handle("Policy", APP).tuning_in_effect.remote().result(timeout_s=60)
        assert live["sessions"]["ttl_s"] == BASE_ARGS["sessions"]["ttl_s"], live
        policy_entry(cfg)["num_replicas"] = 3  # edit 3: scale up
        serve_deploy(cfg, 3)
        time.sleep(3)
        policy_entry(cfg)["num_replicas"] = 1  # edit 4: scale down (Serve stops the newest replicas first)
        serve_deploy(cfg, 1)
        time.sleep(3)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads), "a client hung"

        assert expired["restarted"] and expired["restart_reason"] == "evicted", expired  # the new TTL was live
        for robot in robots:
            reports = robot.reports
            assert len(reports) >= 10, (robot.sid, len(reports))
            reasons = {r["restart_reason"] for r, _ in reports[1:]}
            assert reasons <= {None, "window_full", "evicted"}, (robot.sid, reasons)  # nothing replaced
            for i, (report, _) in enumerate(reports[1:], start=1):  # nothing lost but by the TTL, rightly
                if report["restart_reason"] == "evicted":
                    # the store last touched it between the previous call's send and answer, and looked it up
                    # between this one's send and answer: the longest gap it can have seen
                    before, at = robot.times[i - 1][0], robot.times[i][1]
                    assert at - before > NEW_TTL_S, (robot.sid, i, "evicted after at most", at - before)
                    assert before < short_ttl_until and at > short_ttl_from, (robot.sid, i, "evicted outside it")
            assert len({replica for _, replica in reports}) == 1, (robot.sid, "changed replica")
            for (prev, _), (cur, _) in zip(reports, reports[1:]):
                if not cur["restarted"]:
                    assert (cur["step"], cur["incarnation"]) == (prev["step"] + 1, prev["incarnation"])
    finally:
        forget_deployed_app()  # the next test deploys its own app again
