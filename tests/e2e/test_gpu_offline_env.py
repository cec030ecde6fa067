"""The air-gapped GPU machine, rehearsed on CPU: a fresh virtualenv stands in for its Python (torch, transformers,
safetensors, tokenizers, sentencepiece, numba, msgpack, pyyaml, numpy at .venv's versions; no Ray, no diffusers, no
pydantic, no pytest). scripts/gpu-wheels.sh fills a wheel folder for this Python, scripts/gpu-offline-env.sh installs it
with no index into a plain folder, and with the PYTHONPATH it prints: the tiny model runs a chunk, the GPU tier
collects and skips (no CUDA here), the latency benchmark imports, and `import ray` fails.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# the rehearsal's `offline` stage (scripts/gpu-check.sh --rehearse); CI runs it as a test of its own, beside the
# rehearsal's other stages on the other pytest-xdist worker (tests/e2e/test_gpu_rehearsal.py: CI_STAGES)
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CLIENT_DIRS = [str(ROOT / "clients" / d) for d in ("dreamzero-client", "dreamzero-droid", "dreamzero-franka")]
# the GPU machine's own packages, at .venv's versions, with what they require (huggingface-hub among them) ...
BOX = (
    "safetensors",
    "tokenizers",
    "sentencepiece",
    "numba",
    "msgpack",
    "pyyaml",
    "numpy",
    "regex",
    "tqdm",
    "packaging",
)
# ... except transformers' own requirements: here its `typer` brings pydantic, which that machine does not have
BOX_NO_DEPS = ("transformers",)
ABSENT = ("ray", "diffusers", "pydantic", "pytest", "httpx", "websockets")

CHUNK = textwrap.dedent(
    """
    import sys

    import numpy as np

    from dreamzero.pipeline import DreamZeroPipeline
    from dreamzero.pipeline.budget import warmup_batch, warmup_canvas_hw

    pipe = DreamZeroPipeline.load(None)
    res = pipe.generate(warmup_batch(pipe, 1, warmup_canvas_hw(pipe)))
    assert res.actions.shape[0] == 1 and np.isfinite(res.actions).all(), res.actions.shape
    import diffusers, pydantic, torch

    site = sys.argv[1].rstrip("/") + "/"
    assert diffusers.__file__.startswith(site) and pydantic.__file__.startswith(site), (diffusers, pydantic)
    assert not torch.__file__.startswith(site), torch.__file__
    assert "ray" not in sys.modules
    print("chunk ok", res.actions.shape)
    """
)


def _env(**extra: str) -> dict[str, str]:
    # nothing of this process's paths; and no simulated GPU: the box's tier collects and skips here (the rehearsal's
    # tier stage runs it on the simulated one)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DREAMZERO_SIMULATED_GPU")}
    return env | extra


def _run(args, *, timeout=600, cwd=ROOT, env=None, check=True) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env or _env()
    )
    if check:
        assert r.returncode == 0, f"{args}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def test_gpu_machine_environment_from_the_wheel_folder_alone(tmp_path):
    took = {}
    t0 = t = time.monotonic()

    def lap(name):
        nonlocal t
        took[name], t = time.monotonic() - t, time.monotonic()

    _run([sys.executable, "-m", "venv", tmp_path / "box"], timeout=300)
    box = tmp_path / "box" / "bin" / "python"
    pip = [box, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    torch = _run([*pip, "--only-binary=:all:", f"torch=={md.version('torch')}"], check=False)
    if torch.returncode != 0:  # CI offers a local CPU wheel; elsewhere do not fetch a CUDA build here
        pytest.skip(f"no wheel of torch=={md.version('torch')} for the stand-in machine: {torch.stderr[-500:]}")
    _run([*pip, "--no-deps", *(f"{n}=={md.version(n)}" for n in BOX_NO_DEPS)])
    _run([*pip, *(f"{n}=={md.version(n)}" for n in BOX)])
    probe = "import importlib.util as u, sys; print([m for m in sys.argv[1:] if u.find_spec(m)])"
    assert _run([box, "-c", probe, *ABSENT], cwd=tmp_path).stdout.strip() == "[]", "the stand-in has too much"
    lap("stand-in machine")

    wheels, site = tmp_path / "wheels", tmp_path / "site"
    made = _run(
        ["bash", ROOT / "scripts" / "gpu-wheels.sh", wheels, "--python-version", "current"],
        env=_env(PYTHON=sys.executable),
    )
    assert "MiB in" in made.stdout and (wheels / "requirements.txt").is_file(), made.stdout
    lap("gpu-wheels.sh")

    offline = ["bash", ROOT / "scripts" / "gpu-offline-env.sh", wheels, site, "--python", box]
    nowhere = {k: "http://127.0.0.1:9/simple" for k in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS")}
    first = _run(offline, env=_env(**nowhere))  # were pip to look anywhere, it would fail
    lap("gpu-offline-env.sh")
    again = _run(offline)
    lap("gpu-offline-env.sh again")
    assert "already holds" in again.stderr, again.stderr
    assert "fallback wheel is left out" in first.stderr, first.stderr  # .venv's huggingface-hub meets diffusers
    assert first.stdout == again.stdout and len(first.stdout.splitlines()) == 1, first.stdout
    key, _, pythonpath = first.stdout.strip().partition("=")
    assert key == "PYTHONPATH" and pythonpath.split(":") == [str(site), str(ROOT), *CLIENT_DIRS]
    env = _env(PYTHONPATH=pythonpath)

    chunk = _run([box, "-c", CHUNK, site], cwd=tmp_path, env=env)
    assert "chunk ok" in chunk.stdout, chunk.stdout
    lap("tiny chunk")
    collected = _run([box, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", "tests/gpu"], env=env)
    assert "collected" in collected.stdout and "error" not in collected.stdout.lower(), collected.stdout
    tier = _run([box, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "-m", "gpu", "tests/gpu"], env=env)
    assert "skipped" in tier.stdout and "passed" not in tier.stdout, tier.stdout  # no CUDA here
    _run([box, ROOT / "benchmarks" / "model_latency.py", "--help"], env=env)
    no_ray = _run([box, "-c", "import ray"], cwd=tmp_path, env=env, check=False)
    assert no_ray.returncode != 0 and "No module named 'ray'" in no_ray.stderr, no_ray.stderr
    lap("tier, benchmark, no ray")
    took["total"] = time.monotonic() - t0
    print("\n" + ", ".join(f"{k} {v:.0f} s" for k, v in took.items()))
