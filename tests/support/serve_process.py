"""`serve run <config>` as a user runs it, in a subprocess: a free loopback port, a private RAY_TMPDIR, /health within
a bound, SIGTERM at the end (a backgrounded `serve run` ignores SIGINT), and no Ray process left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.support.host import free_port, kill_leftovers

ROOT = Path(__file__).resolve().parents[2]
HEALTH_TIMEOUT_S = 300
#: what `serve run` logs when `build_app` (or a replica's constructor) raised, e.g. a ConfigError
DEPLOY_FAILED = "failed with exception"
SIMULATED_GPU_ENV = "DREAMZERO_SIMULATED_GPU"  # dreamzero.device's name (neither it nor torch is imported at load)


class ServeRun:
    """Context manager: `with ServeRun(tmp_path) as server: server.url`.

    `args` is merged into the first application's `args:`; `haproxy=True` puts HAProxy in front (Ray 2.60's
    RAY_SERVE_ENABLE_HA_PROXY) with private config and socket paths so parallel runs cannot collide.

    `gpus=N` is for a config whose policy asks for GPUs (`policy.num_gpus`): on a machine without CUDA the local
    cluster `serve run` starts advertises N GPUs (RAY_OVERRIDE_RESOURCES; Ray then sets CUDA_VISIBLE_DEVICES for the
    replica, harmless on a CPU), which only makes sense on a CPU simulating a GPU: $DREAMZERO_SIMULATED_GPU, from
    this process's environment or `env`, reaches `serve run` and its replicas (ValueError when neither has it). With
    CUDA nothing is overridden: Ray finds the real GPUs.

    `http_options` is merged into the config's `http_options:`; with `ssl_certfile` there the proxy serves HTTPS and
    WSS, `url` is `https://localhost:<port>` (the test certificate's name) and /health is polled verifying it against
    `ca_bundle`.
    """

    def __init__(
        self,
        workdir: Path,
        args: dict[str, Any] | None = None,
        haproxy: bool = False,
        env: dict[str, str] | None = None,
        config: Path = ROOT / "serve_config.yaml",
        gpus: int | None = None,
        http_options: dict[str, Any] | None = None,
        ca_bundle: Path | None = None,
    ):
        self.workdir = Path(workdir)
        self.port = free_port()
        cfg = yaml.safe_load(Path(config).read_text())
        cfg["http_options"].update({"host": "127.0.0.1", "port": self.port, **(http_options or {})})
        tls = bool(cfg["http_options"].get("ssl_certfile"))
        self.verify = ssl.create_default_context(cafile=str(ca_bundle)) if ca_bundle else True
        if args:
            cfg["applications"][0].setdefault("args", {}).update(args)
        self.config_path = self.workdir / "serve_config.yaml"
        self.config_path.write_text(yaml.safe_dump(cfg))
        self.ray_tmp = tempfile.mkdtemp(prefix="rayE2E", dir="/tmp")  # short: Ray's socket paths have a length limit
        self.env = {**os.environ, "RAY_TMPDIR": self.ray_tmp, "RAY_AUTH_MODE": "disabled", **(env or {})}
        self.env.pop("RAY_ADDRESS", None)
        if gpus:
            self._advertise_gpus(gpus)
        if haproxy:
            self.env |= {
                "RAY_SERVE_ENABLE_HA_PROXY": "1",
                "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": f"{self.ray_tmp}/haproxy/haproxy.cfg",
                "RAY_SERVE_HAPROXY_SOCKET_PATH": f"{self.ray_tmp}/haproxy/admin.sock",
            }
        self.log_path = self.workdir / "serve_run.log"
        self.url = f"https://localhost:{self.port}" if tls else f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def _advertise_gpus(self, gpus: int) -> None:
        import torch

        if torch.cuda.is_available():
            return
        if not self.env.get(SIMULATED_GPU_ENV, "").strip():
            raise ValueError(
                f"ServeRun(gpus={gpus}) on a machine without CUDA needs ${SIMULATED_GPU_ENV} (e.g. 141GiB) in the "
                "environment or in env=: the policy's GPU would be a CPU that no check could size"
            )
        self.env["RAY_OVERRIDE_RESOURCES"] = json.dumps({"GPU": int(gpus)})

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_bytes()[-n:].decode("utf-8", "replace") if self.log_path.exists() else ""

    def __enter__(self) -> ServeRun:
        serve_bin = Path(sys.executable).with_name("serve")
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(
                [str(serve_bin), "run", str(self.config_path)],
                cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        with httpx.Client(timeout=5, trust_env=False, verify=self.verify) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"serve run exited with {self.proc.returncode}:\n{self.log_tail()}")
                if DEPLOY_FAILED in self.log_tail(20000):  # Ray 2.60's `serve run` keeps running after a failed build
                    raise RuntimeError(f"serve run could not deploy the app:\n{self.log_tail()}")
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(1.0)
        raise TimeoutError(f"/health not 200 within {HEALTH_TIMEOUT_S} s:\n{self.log_tail()}")

    def stop(self) -> int | None:
        """SIGTERM and wait (bounded); then SIGKILL whatever is left of the process group and of Ray's processes."""
        code = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        kill_leftovers(self.ray_tmp, grace_s=30)  # Ray's processes exit after the driver
        shutil.rmtree(self.ray_tmp, ignore_errors=True)
        return code
