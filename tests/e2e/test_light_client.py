"""The light client package alone: a fresh virtualenv with only `./clients` installed (numpy, msgpack, httpx,
websockets from the package index) talks to `serve run serve_config.yaml` over HTTP (both forms' client) and the
OpenPI WebSocket, and never imports torch or Ray.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.e2e.serve_process import ROOT, ServeRun

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CLIENT_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    from dreamzero_client.http_client import ActionClient
    from dreamzero_client.openpi_client import OpenPIClient

    url = sys.argv[1]
    rng = np.random.default_rng(0)
    img = lambda t=1: rng.integers(0, 256, (1, t, 180, 320, 3), dtype=np.uint8)

    def obs(t):  # a session's first call sends 1 frame, later calls a 4-frame stack (1 frame would restart it)
        return {
            "video.exterior_image_1_left": img(t),
            "video.exterior_image_2_left": img(t),
            "video.wrist_image_left": img(t),
            "state.joint_position": rng.uniform(-1, 1, (1, 7)).astype(np.float32),
            "state.gripper_position": np.zeros((1, 1), np.float32),
        }

    with ActionClient(url, timeout_s=300, max_retries=2) as client:
        steps = [client.generate(obs(t), "pick up the cup", "venv-http").sessions[0]["step"] for t in (1, 4)]
    assert steps == [1, 2], steps
    with OpenPIClient(url.replace("http://", "ws://") + "/v1/realtime/robot/openpi", timeout_s=300) as ws:
        frame = {
            "observation/exterior_image_0_left": img()[0, 0],
            "observation/exterior_image_1_left": img()[0, 0],
            "observation/wrist_image_left": img()[0, 0],
            "observation/joint_position": np.zeros(7, np.float32),
            "observation/gripper_position": np.zeros(1, np.float32),
            "prompt": "pick up the cup",
            "session_id": "venv-ws",
        }
        reply = ws.infer(frame)
    assert np.asarray(reply["actions"]).shape[-1] == 8, reply
    heavy = [m for m in ("torch", "ray", "transformers", "diffusers") if m in sys.modules]
    assert not heavy, heavy
    print("light client ok")
    """
)


def test_fresh_venv_with_only_the_client_package_talks_to_serve_run(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    source = shutil.copytree(
        ROOT / "clients", tmp_path / "clients", ignore=shutil.ignore_patterns("build", "*.egg-info")
    )
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", str(source)], capture_output=True, text=True, timeout=900
    )
    assert install.returncode == 0, install.stderr[-3000:]
    listed = subprocess.run([str(python), "-m", "pip", "list"], capture_output=True, text=True, timeout=120).stdout
    assert "torch" not in listed and "ray" not in listed.split(), listed
    with ServeRun(tmp_path) as server:
        run = subprocess.run(
            [str(python), "-c", CLIENT_SCRIPT, server.url], capture_output=True, text=True, timeout=900, cwd=tmp_path
        )
        assert run.returncode == 0, f"{run.stdout}\n{run.stderr[-3000:]}\n{server.log_tail()}"
        assert "light client ok" in run.stdout
