"""`policy.cfg_parallel: 2` through `serve run`: the same actions as `cfg_parallel: 1`, and a lost rank 1.

One `serve run` holds two applications of the tiny model (fp32, CPU, gloo): the shipped layout at `/` (one Policy
replica) and the same with `policy.cfg_parallel: 2` at `/cfg2` (two Policy replicas of two ranks each, behind the
session-aware router). Both answer the same requests side by side: several chunks, a reset, a step mismatch, a
late-joining session and a batch of three, with own seeds and RTC. Then robots, one session each, send chunks to
`/cfg2` while rank 1 of one replica is killed (SIGKILL): every request gets an answer (503 while the pair is broken,
never a hang), the robots of the other replica continue untouched, those of the broken one come back flagged
restarted, and Serve starts a replacement replica.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from dreamzero_client.wire import codec, generations
from tests.support.request_builders import decode, normalised_observation
from tests.support.serve_process import ROOT, ServeRun

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MSGPACK = {"content-type": "application/msgpack", "accept": "application/msgpack"}
#: measured fp32 difference of the two layouts on the tiny model: ~1e-6 (docs/model.md, "CFG-parallel")
ROUND_OFF = 2e-5
REQUEST_TIMEOUT_S = 120


def two_apps(workdir: Path) -> Path:
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    one = cfg["applications"][0]
    one["args"]["model_path"] = None  # the tiny model: fp32 on CPU
    one["args"]["policy"]["cfg_timeout_s"] = 20.0
    two = yaml.safe_load(yaml.safe_dump(one))
    two.update(name="cfg2", route_prefix="/cfg2")
    two["args"]["policy"]["cfg_parallel"] = 2
    for d in two["deployments"]:
        if d["name"] == "Policy":
            d["num_replicas"] = 2  # the router keeps each session on its pair; one pair's loss leaves the other's
    cfg["applications"].append(two)
    path = workdir / "cfg_parallel.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def body(ids, t, obs_seed, **kw) -> bytes:
    obs = normalised_observation(len(ids), t, seed=obs_seed)
    req = generations.build_request_body(obs, ["a formatted prompt"] * len(ids), ids, **kw)
    return codec.encode_body(req, codec.OPENPI)[0]


def chunks():
    """Several chunks of sessions that start, continue, reset, miss their expected step, join late and share a
    batch."""
    return [
        body(["r1"], 1, 0),
        body(["r1"], 4, 1, seed=7),
        body(["r1", "r2"], 4, 2, rtc_prefix_len=[4, None]),
        body(["r1", "r2"], 4, 3, reset_mask=[True, False]),
        body(["r1", "r2", "r3"], 4, 4, seed=[1, 2, 3], expected_steps=[2, 99, None]),
        body(["r1", "r2", "r3"], 4, 5),
    ]


def post(client, url, payload):
    resp = client.post(url + "/v1/actions/generations", content=payload, headers=MSGPACK)
    return resp.status_code, (decode(resp.content) if resp.status_code == 200 else resp.text)


def actions(out) -> np.ndarray:
    return np.stack([np.asarray(d["action"]["values"]) for d in out["data"]])


def sessions(out) -> list:
    return [(s["session_id"], s["step"], s["restarted"], s.get("restart_reason")) for s in out["sessions"]]


class Robot(threading.Thread):
    """One session sending chunks back to back (its expected step stated), retrying a 503 after a short pause."""

    def __init__(self, client, url: str, sid: str, stop: threading.Event):
        super().__init__(daemon=True)
        self.client, self.url, self.sid, self.stop = client, url, sid, stop
        self.replies: list[dict] = []  # status, seconds, and for a 200 the session report and the replica

    def run(self) -> None:
        step, n = None, 0
        while not self.stop.is_set():
            kw = {} if step is None else {"expected_steps": [step]}
            t0 = time.monotonic()
            status, out = post(self.client, self.url, body([self.sid], 1 if step is None else 4, n, **kw))
            reply = {"status": status, "s": time.monotonic() - t0, "at": time.monotonic()}
            if status == 200:
                (report,) = out["sessions"]
                reply.update(report=report, served_by=out["served_by"])
                step = report["step"]
            else:
                time.sleep(0.5)
            self.replies.append(reply)
            n += 1


def test_cfg_parallel_serves_the_same_actions_and_survives_a_lost_rank(tmp_path):
    with ServeRun(tmp_path, config=two_apps(tmp_path)) as server:
        one, two = server.url, server.url + "/cfg2"
        with httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
            models = client.get(two + "/v1/models").json()["data"][0]
            ranks = models["topology"]["ranks"]
            assert [(r["rank"], r["branch"]) for r in ranks] == [(0, "cond"), (1, "uncond")]
            assert "topology" not in client.get(one + "/v1/models").json()["data"][0]
            worst, seen = 0.0, set()
            for payload in chunks():
                (s1, a), (s2, b) = post(client, one, payload), post(client, two, payload)
                assert s1 == s2 == 200, (a, b)
                assert sessions(a) == sessions(b)
                assert "model.cfg_exchange" in b["timings"] and "model.cfg_exchange" not in a["timings"]
                worst = max(worst, float(np.abs(actions(a) - actions(b)).max()))
                seen |= {s[3] for s in sessions(b)}
            assert worst <= ROUND_OFF, worst
            assert {"new_session", "reset_requested", "step_mismatch"} <= seen
            assert {s[3] for s in sessions(b)} == {None}  # the last chunk continued every session

            # robots on both pairs (started one by one, so that the router sees each placement: six of them cannot
            # all go to the replica without r1..r3), then rank 1 of one pair dies under their load
            stop = threading.Event()
            robots = [Robot(client, two, f"k{i}", stop) for i in range(6)]
            try:
                for r in robots:
                    r.start()
                    deadline = time.monotonic() + REQUEST_TIMEOUT_S
                    while not any(x["status"] == 200 for x in r.replies):
                        assert time.monotonic() < deadline, f"robot {r.sid} was never served"
                        time.sleep(0.2)
                    time.sleep(1.5)  # the replica's next routing report
                before = {x["served_by"] for r in robots for x in r.replies if "served_by" in x}
                assert len(before) == 2, "the robots' sessions did not spread over both replicas"
                os.kill(int(ranks[1]["pid"]), signal.SIGKILL)
                deadline, probes, new = time.monotonic() + 180, 0, set()
                while time.monotonic() < deadline:  # until every robot hit is served again and a new replica serves
                    hit = [r for r in robots if any(x["status"] != 200 for x in r.replies)]
                    recovered = hit and all(r.replies[-1]["status"] == 200 for r in hit)
                    new |= {x.get("served_by") for r in robots for x in r.replies} - before - {None}
                    if recovered and not new:  # a new session goes to the least loaded replica: the replacement
                        status, out = post(client, two, body([f"p{probes}"], 1, probes))
                        assert status in (200, 503), out
                        new |= {out["served_by"]} - before if status == 200 else set()
                        probes += 1
                    if recovered and new:
                        break
                    time.sleep(1.0)
            finally:
                stop.set()
                for r in robots:
                    r.join(REQUEST_TIMEOUT_S)
                    assert not r.is_alive(), f"robot {r.sid} hangs"
            replies = [x for r in robots for x in r.replies]
            assert {x["status"] for x in replies} <= {200, 503}, replies
            assert max(x["s"] for x in replies) < REQUEST_TIMEOUT_S
            hit = [r for r in robots if any(x["status"] == 503 for x in r.replies)]
            untouched = [r for r in robots if r not in hit]
            assert hit and untouched, [(r.sid, [x["status"] for x in r.replies]) for r in robots]
            for r in untouched:  # the other pair's sessions never restarted (but where their window filled)
                reasons = [x["report"]["restart_reason"] for x in r.replies[1:]]
                assert set(reasons) <= {None, "window_full"}, (r.sid, reasons)
            for r in hit:  # never continued on half a state: the first answer after the 503s is a flagged restart
                last_503 = max(i for i, x in enumerate(r.replies) if x["status"] == 503)
                after = r.replies[last_503 + 1 :]
                assert after, f"robot {r.sid} was never served again"
                assert after[0]["report"]["restarted"], (r.sid, after[0])
                assert after[0]["report"]["restart_reason"] in {"new_session", "evicted", "step_mismatch"}
            assert new, "no replacement replica served after the kill"
        assert server.stop() is not None
