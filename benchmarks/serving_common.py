"""Shared plumbing of the serving benchmarks: a private single-node Ray + Serve, request builders, docs sections."""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from dreamzero_client.wire import codec, generations

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: tests/ of the repository
from tests.support.host import free_port

GEN = "/v1/actions/generations"
MSGPACK = {"content-type": "application/msgpack", "accept": "application/msgpack"}
#: the tiny embedded model with the upstream 8-of-16-step mask (the shipped serve_config.yaml defaults)
BASE_ARGS: dict = {"sessions": {"max_sessions": 64}}
_OWN_TMP: dict[str, str] = {}


#: what a user puts in the environment of `serve run` for the proxy's half of the replicas' fast path (docs/serving.md)
PROXY_FAST_PATH_ENV = {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
#: HAProxy in front of the ingress replicas instead of Serve's Python proxy (docs/serving.md, "Front door")
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}


def start_serve(num_cpus: int = 2, proxy_fast_path: bool = False, haproxy: bool = False) -> str:
    """Start a private Ray (own temp dir, no dashboard) and Serve's HTTP front door on a free port; returns its URL.

    `proxy_fast_path` / `haproxy` start Ray with PROXY_FAST_PATH_ENV / HAPROXY_ENV, as `serve run` would be started.
    """
    import ray
    from ray import serve

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if proxy_fast_path:
        os.environ.update(PROXY_FAST_PATH_ENV)
    if haproxy:
        os.environ.update(HAPROXY_ENV)
    if "RAY_TMPDIR" not in os.environ:
        os.environ["RAY_TMPDIR"] = _OWN_TMP["dir"] = tempfile.mkdtemp(prefix="rayB", dir="/tmp")
    port = free_port()
    try:
        ray.init(num_cpus=num_cpus, include_dashboard=False, object_store_memory=200 * 1024 * 1024, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
    except BaseException:  # e.g. "node timed out during startup" on a loaded box: leave no session dir behind
        stop_serve()
        raise
    return f"http://127.0.0.1:{port}"


def deploy(base_url: str, args: dict, name: str = "bench", route_prefix: str = "/", timeout_s: float = 300) -> str:
    """Deploy the graph as application `name` under `route_prefix`; returns its URL once /health answers 200."""
    from ray import serve

    from serve_graph.builder import build_app

    serve.run(build_app(args), name=name, route_prefix=route_prefix, blocking=False)
    url = base_url + route_prefix.rstrip("/")
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=10, trust_env=False) as client:
        while time.monotonic() < deadline:
            try:
                if client.get(url + "/health").status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"{url}/health not 200 within {timeout_s} s")


def front_door(proxy_fast_path: bool = False, haproxy: bool = False) -> str:
    """How the benchmark's HTTP front door was started, for the report, and the flags that reproduce it."""
    if haproxy:
        return "HAProxy front door (`RAY_SERVE_ENABLE_HA_PROXY=1`, docs/serving.md)"
    if proxy_fast_path:
        return "Serve proxy started with `RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0` (docs/serving.md)"
    return "Serve proxy with Ray's defaults"


def front_door_flags(proxy_fast_path: bool = False, haproxy: bool = False) -> str:
    return (" --proxy-fast-path" if proxy_fast_path else "") + (" --haproxy" if haproxy else "")


def stop_serve() -> None:
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
    if _OWN_TMP.get("dir"):  # Ray's session logs of this run
        os.environ.pop("RAY_TMPDIR", None)
        shutil.rmtree(_OWN_TMP.pop("dir"), ignore_errors=True)


def tiny_canvas() -> tuple[int, int]:
    """The tiny model's input size: normalised clients send the canvas the model takes (no in-model resize)."""
    from dreamzero.config import preset

    return tuple(preset("tiny").pipeline.model_input_hw)


def normalised_observation(t: int, hw: tuple[int, int] | None = None, seed: int = 0) -> dict:
    """One RLinf-style normalised row (canvas already at the tiny model's input size unless `hw` says otherwise)."""
    hw = hw or tiny_canvas()
    rng = np.random.default_rng(seed)
    mask = np.zeros((1, 1, 64), bool)
    mask[..., :8] = True
    return {
        "images": rng.integers(0, 256, (1, t, *hw, 3), dtype=np.uint8),
        "state": (rng.uniform(-1, 1, (1, 1, 64)) * mask).astype(np.float32),
        "state_mask": mask,
    }


def droid_observation(t: int, seed: int = 0) -> dict:
    """One raw DROID row: three 180x320 cameras, 7 joints + gripper."""
    rng = np.random.default_rng(seed)
    views = ("video.exterior_image_1_left", "video.exterior_image_2_left", "video.wrist_image_left")
    obs = {k: rng.integers(0, 256, (1, t, 180, 320, 3), dtype=np.uint8) for k in views}
    obs["state.joint_position"] = rng.uniform(-1, 1, (1, 7)).astype(np.float32)
    obs["state.gripper_position"] = rng.uniform(0, 1, (1, 1)).astype(np.float32)
    return obs


def request_body(
    observation: dict, session_id: str, expected_step: int | None, prompt: str = "pick up the cup"
) -> bytes:
    body = generations.build_request_body(
        observation, [prompt], [session_id], expected_steps=None if expected_step is None else [expected_step]
    )
    return codec.encode_msgpack(body)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def write_section(path: Path, title: str, body: str) -> None:
    """Replace (or append) the `## <title>` section of a markdown file, leaving the other sections alone."""
    heading = f"## {title}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = f"{heading}\n\n{body.rstrip()}\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _: section + "\n", text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    path.write_text(text)


def machine_line() -> str:
    import torch

    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = ", ".join(f"{x:.0f}" for x in os.getloadavg())  # other processes' demand: scale wall-clock figures by it
    return f"{os.cpu_count()} CPU cores (shared, load average {load} at the end), torch threads " + (
        f"{torch.get_num_threads()}, run {when}"
    )
