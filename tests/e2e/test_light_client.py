"""The robot's client alone: a fresh virtualenv where `pip install ./clients/dreamzero-client` (from the package index)
brings numpy, msgpack and websockets and nothing else; the robot client's tests pass there, copied out of the repo so
that no server package is importable; and the client talks to `serve run serve_config.yaml` over HTTP (the `http`
extra) and the OpenPI WebSocket without importing torch or Ray. One virtualenv serves the module."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.support.robot_client import DEPENDENCIES, ROBOT_CLIENT_TESTS, TEST_LIBRARIES, client_test_closure
from tests.support.serve_process import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
PIP_TIMEOUT_S = 900

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


def _pip(python, *args):
    done = subprocess.run([str(python), "-m", "pip", *args], capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _installed(python) -> set[str]:
    lines = _pip(python, "list", "--format=freeze").splitlines()
    return {line.split("==")[0].lower().replace("_", "-") for line in lines if "==" in line}


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory):
    """(the venv's python, what `pip install ./clients/dreamzero-client` alone added); then the `http` extra and the
    test-only libraries are installed beside it, for the tests and the live check."""
    work = tmp_path_factory.mktemp("robot-client")
    subprocess.run([sys.executable, "-m", "venv", str(work / "venv")], check=True, timeout=300)
    python = work / "venv" / "bin" / "python"
    source = shutil.copytree(
        ROOT / "clients" / "dreamzero-client",
        work / "dreamzero-client",
        ignore=shutil.ignore_patterns("build", "*.egg-info"),
    )
    before = _installed(python)
    _pip(python, "install", "-q", str(source))
    alone = _installed(python) - before
    _pip(python, "install", "-q", f"{source}[http]", *TEST_LIBRARIES)
    return python, alone


def test_the_robot_client_alone_installs_numpy_msgpack_and_websockets(client_venv):
    _, alone = client_venv
    assert alone == {"dreamzero-client"} | DEPENDENCIES


def test_the_robot_clients_tests_pass_with_that_package_alone(client_venv, tmp_path):
    python, _ = client_venv
    bad, files = client_test_closure(ROBOT_CLIENT_TESTS)
    assert bad == []
    for path in files:  # the tests and their helpers, and nothing else of the repository
        target = tmp_path / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 300\n")
    code = (
        "import importlib.util as u; print([m for m in ('torch', 'ray', 'dreamzero', 'deployments') if u.find_spec(m)])"
    )
    found = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert found.stdout.strip() == "[]", found.stdout + found.stderr
    run = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *ROBOT_CLIENT_TESTS],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "error" not in run.stdout.splitlines()[-1], run.stdout[-2000:]


def test_the_client_talks_to_serve_run_without_torch_or_ray(client_venv, tmp_path, shipped_server):
    python, server = client_venv[0], shipped_server  # the shared `serve run` of the shipped config
    run = subprocess.run(
        [str(python), "-c", CLIENT_SCRIPT, server.url], capture_output=True, text=True, timeout=900, cwd=tmp_path
    )
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr[-3000:]}\n{server.log_tail()}"
    assert "light client ok" in run.stdout
