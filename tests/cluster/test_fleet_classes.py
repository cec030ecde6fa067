"""Issue 47's scheduling on one live replica (docs/fleet.md "Scheduling"): one realtime robot and a saturating
evaluation farm share it. With traffic classes on, the robot keeps its pace (0 stalls) and the farm keeps at least
half the throughput it has alone; with them off (`batching.traffic_classes: false`, set live through the Policy's
`user_config`, no new replicas) the same robot stalls behind the farm's queued requests.

The robot is felt the way a robot feels it: it queries its next chunk as the current one starts executing (stating
the time its buffer has left as `deadline_ms`) and stalls when that chunk is not there once the current chunk's
executed part ran out. Its pace comes from this machine's measured costs, not from constants: the executed part lasts
three times the farm's mean call period (`max_batch_rows` 16: each farm request of 16 rows is a call of its own) plus
twice a lone robot call, a margin for the farm's costlier calls (its sessions' restarts) and a loaded host. With
classes on the robot waits at most the call in progress and its own; first come, first served it also waits for the
farm requests queued before it (four more streams), which is longer than its pace.
"""

from __future__ import annotations

import statistics
import threading
import time

import pytest

from dreamzero_client.http_client import ActionClient
from tests.support.cluster import APP, BASE_ARGS, DEPLOY_TIMEOUT_S, IMPORT_PATH, forget_deployed_app, wait_deployed
from tests.support.request_builders import normalised_observation

pytestmark = pytest.mark.cluster

ARGS = {
    **BASE_ARGS,
    "sessions": {"max_sessions": 128, "ttl_s": 600},
    # one farm request fills a call: the robot either goes first (classes) or queues behind the farm's (FIFO)
    "batching": {"max_batch_size": 8, "batch_wait_timeout_s": 0.01, "max_batch_rows": 16},
}
FARM_STREAMS, FARM_ROWS = 5, 16
ROBOT_CHUNKS = 8  # with classes on; off, the first few stall already
ROBOT_CHUNKS_OFF = 5
HW = (32, 64)  # the tiny model's input size: no resize
PROMPT = "put the marker in the cup"


def observation(rows: int, frames: int) -> dict:
    return normalised_observation(rows, frames, HW)


class Farm:
    """FARM_STREAMS clients each posting FARM_ROWS-environment batch requests back to back."""

    def __init__(self, base_url: str, tag: str):
        self.base_url, self.tag = base_url, tag
        self.rows, self.stop, self.errors = 0, threading.Event(), []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._stream, args=(k,), daemon=True) for k in range(FARM_STREAMS)]

    def _stream(self, k: int) -> None:
        ids = [f"{self.tag}-farm{k}-env{i}" for i in range(FARM_ROWS)]
        first, later = observation(FARM_ROWS, 1), observation(FARM_ROWS, 4)
        try:
            with ActionClient(self.base_url, timeout_s=60, max_retries=0) as client:
                obs = first
                while not self.stop.is_set():
                    client.generate(obs, PROMPT, ids, form="normalised", traffic_class="batch")
                    obs = later
                    with self._lock:
                        self.rows += FARM_ROWS
        except Exception as exc:  # noqa: BLE001 - reported by the test, not lost in a thread
            self.errors.append(exc)

    def __enter__(self) -> Farm:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in self._threads), "a farm stream did not end within 60 s"

    def rows_per_s(self, seconds: float) -> float:
        """Rows answered per second over the next `seconds`."""
        before = self.rows
        time.sleep(seconds)
        return (self.rows - before) / seconds


def robot(base_url: str, session: str, period_s: float, chunks: int) -> tuple[int, list[float]]:
    """(stalls, latencies in s) of a robot whose every chunk's executed part lasts `period_s`."""
    first, later = observation(1, 1), observation(1, 4)
    stalls, latencies = 0, []
    with ActionClient(base_url, timeout_s=60, max_retries=0) as client:
        client.generate(first, PROMPT, session, form="normalised", traffic_class="realtime")
        start = time.monotonic()  # the first chunk starts executing; the next query goes out now
        for _ in range(chunks):
            runs_out = start + period_s
            sent = time.monotonic()
            left_ms = max(0.0, (runs_out - sent) * 1000.0)
            client.generate(later, PROMPT, session, form="normalised", traffic_class="realtime", deadline_ms=left_ms)
            got = time.monotonic()
            latencies.append(got - sent)
            if got > runs_out:  # the arm held: no action to execute until this chunk arrived
                stalls += 1
                start = got
            else:
                start = runs_out
            time.sleep(max(0.0, start - time.monotonic()))
    return stalls, latencies


def set_classes(on: bool) -> None:
    """The live knob through the Policy's `user_config` (deployments.live_tuning): the replica stays."""
    from ray import serve
    from ray.serve.schema import ServeDeploySchema

    app = {
        "name": APP,
        "route_prefix": "/",
        "import_path": IMPORT_PATH,
        "args": ARGS,
        "deployments": [{"name": "Policy", "user_config": {"batching": {"traffic_classes": on}}}],
    }
    started = time.time()
    serve.context._get_global_client().deploy_apps(ServeDeploySchema(applications=[app]))
    wait_deployed(started, DEPLOY_TIMEOUT_S)
    forget_deployed_app()  # the running app now differs from any args-only deploy: the next module deploys its own


def test_a_robot_keeps_its_pace_beside_a_saturating_farm_only_with_classes(serve_cluster, ensure_app):
    base_url = serve_cluster[0]
    ensure_app(ARGS, 1)
    # measured costs on this machine, now: a lone robot call, and the farm's call period when it saturates alone
    with ActionClient(base_url, timeout_s=60, max_retries=0) as client:
        client.generate(observation(1, 1), PROMPT, "calibrate", form="normalised", traffic_class="realtime")
        lone = []
        for _ in range(5):
            t0 = time.monotonic()
            client.generate(observation(1, 4), PROMPT, "calibrate", form="normalised", traffic_class="realtime")
            lone.append(time.monotonic() - t0)
    t1 = statistics.median(lone)
    with Farm(base_url, "alone") as farm:
        time.sleep(1.5)  # every stream past its first call
        alone = farm.rows_per_s(4.0)
    assert not farm.errors, farm.errors
    farm_call_s = FARM_ROWS / alone
    period_s = 3 * farm_call_s + 2 * t1
    measured = f"lone robot call {t1 * 1000:.0f} ms, farm call {farm_call_s * 1000:.0f} ms, pace {period_s:.2f} s"

    with Farm(base_url, "on") as farm:
        time.sleep(1.0)
        rows_before, t0 = farm.rows, time.monotonic()
        stalls_on, lat_on = robot(base_url, "robot-on", period_s, ROBOT_CHUNKS)
        shared = (farm.rows - rows_before) / (time.monotonic() - t0)
    assert not farm.errors, farm.errors

    set_classes(False)
    with Farm(base_url, "off") as farm:
        time.sleep(1.0)
        stalls_off, lat_off = robot(base_url, "robot-off", period_s, ROBOT_CHUNKS_OFF)
    assert not farm.errors, farm.errors
    report = (
        f"{measured}; classes on: {stalls_on} stalls, robot p50/max {statistics.median(lat_on) * 1000:.0f}/"
        f"{max(lat_on) * 1000:.0f} ms, farm {shared:.0f} rows/s of {alone:.0f} alone; classes off: {stalls_off} "
        f"stalls, robot p50/max {statistics.median(lat_off) * 1000:.0f}/{max(lat_off) * 1000:.0f} ms"
    )
    print(report)
    assert stalls_on == 0, report
    assert shared >= 0.5 * alone, report  # the farm keeps at least half the replica's throughput
    assert stalls_off >= 2, report  # first come, first served: the robot waits behind the farm and stalls
