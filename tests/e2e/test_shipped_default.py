"""The shipped trained default through `serve run serve_config.yaml`: one held-out evaluation episode.

The config is used as is (free port only), so this checks what a user gets: `model_path: embedded:small-scene1`
resolves to the weights in the package, the server reports the small preset, and one scene-1 episode with a layout
drawn from the demonstrations' distribution (a seed no recording used) runs through the OpenPI WebSocket with the
recipe's settings. Short on purpose (3 chunks); the 20-episode success rate is in docs/training.md.
"""

from __future__ import annotations

import json

import httpx
import pytest
import yaml

from eval.cli import main
from tests.support.serve_process import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_one_episode_with_the_shipped_weights(tmp_path, shipped_server):
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    assert cfg["applications"][0]["args"]["model_path"] == "embedded:small-scene1"
    server = shipped_server  # the shared `serve run` of the shipped config (tests/e2e/conftest.py)
    with httpx.Client(timeout=60, trust_env=False) as client:
        models = client.get(server.url + "/v1/models").json()["data"]
    assert [m["config"] for m in models] == ["small"], models
    out = tmp_path / "eval"
    code = main(
        [
            "--scenes", "1", "--episodes", "1", "--layouts", "compact", "--seed", "100000",
            "--image-size", "90", "160", "--open-loop-horizon", "24", "--max-steps", "72",
            "--port", str(server.port), "--timeout-s", "120", "--out", str(out), "--no-progress",
        ]
    )  # fmt: skip
    assert code == 0, server.log_tail()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed_episodes"] == 0, summary["failures"]
    assert summary["server_calls"] == 3
    record = json.loads((out / "episodes" / "scene1_ep000.json").read_text())
    assert len(record["steps"]) == 72 and all(len(s["action"]) == 8 for s in record["steps"])
    assert (out / "videos" / "scene1_ep000.mp4").stat().st_size > 0
