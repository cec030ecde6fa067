"""What `EmbeddedPolicy.load` opens for each way of naming a model: no argument (the shipped trained default, as
serve_config.yaml serves), `embedded:<name>` (like every other place that reads a model path), None (the random tiny
model, with the synthetic statistics) and a folder. The pipeline load is replaced by a recorder: which path and which
statistics are picked is what is under test, not the network. Also: a loop that repeats a first call's one frame
(a `single_frame` restart every call) is logged, once per session."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

import dreamzero.pipeline
from dreamzero.embedded_default import SHIPPED_MODELS_DIR
from dreamzero.embodiments import get_embodiment
from dreamzero.errors import ConfigError
from dreamzero.policy import DEFAULT_MODEL, EmbeddedPolicy
from dreamzero.types import ChunkResult, SessionReport
from tests.support.embodiments import droid_metadata, droid_observation

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def loaded(monkeypatch):
    """The model paths `DreamZeroPipeline.load` was asked for."""
    paths = []

    def fake_load(model_path=None, **kwargs):
        paths.append(model_path)
        config = SimpleNamespace(embodiment_tag="oxe_droid")
        return SimpleNamespace(action_horizon=24, model=SimpleNamespace(config=config))

    monkeypatch.setattr(dreamzero.pipeline.DreamZeroPipeline, "load", staticmethod(fake_load))
    return paths


def test_embedded_name_resolves_to_the_shipped_folder_and_its_statistics(loaded):
    policy = EmbeddedPolicy.load("embedded:small-scene1")
    assert loaded == [str(SHIPPED_MODELS_DIR / "small-scene1")]
    assert not policy.embodiment.metadata.synthetic  # its experiment_cfg/metadata.json, not the synthetic file


def test_no_argument_is_the_default_serve_config_yaml_serves(loaded):
    args = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
    assert args["model_path"] == DEFAULT_MODEL
    EmbeddedPolicy.load()
    assert loaded == [str(SHIPPED_MODELS_DIR / DEFAULT_MODEL.removeprefix("embedded:"))]


def test_none_keeps_the_random_tiny_model_with_synthetic_statistics(loaded):
    policy = EmbeddedPolicy.load(None)
    assert loaded == [None]  # the pipeline builds the embedded tiny model
    assert policy.embodiment.metadata.synthetic


def test_an_unknown_embedded_name_lists_the_shipped_models(loaded):
    with pytest.raises(ConfigError, match="names no shipped model.*small-scene1"):
        EmbeddedPolicy.load("embedded:nope")
    assert loaded == []


def test_a_folder_is_passed_through(loaded, tmp_path):
    EmbeddedPolicy.load(tmp_path)
    EmbeddedPolicy.load(str(tmp_path))
    assert loaded == [tmp_path, str(tmp_path)]


class _RestartRule:
    """The pipeline's restart rule for new and 1-frame calls (dreamzero/pipeline/rows.py), and a zero chunk."""

    action_horizon = 24

    def __init__(self):
        self.seen: set[str] = set()

    def generate(self, batch):
        reports = []
        for sid in batch.session_ids:
            reason = "new_session" if sid not in self.seen else "single_frame" if batch.images.shape[1] == 1 else None
            self.seen.add(sid)
            reports.append(SessionReport(sid, 1, reason is not None, reason, 1))
        return ChunkResult(actions=np.zeros((len(batch), 24, 32), np.float32), sessions=reports)


def test_a_repeated_single_frame_restart_is_logged_once_per_session(caplog):
    policy = EmbeddedPolicy(_RestartRule(), get_embodiment("oxe_droid", droid_metadata()))
    with caplog.at_level("WARNING", logger="dreamzero.policy"):
        policy.infer(droid_observation(), "robot-0", "pick")  # the first call: one frame is right
        assert not caplog.records
        policy.infer(droid_observation(frames=4), "robot-0", "pick")  # a block continues
        assert not caplog.records
        for _ in range(3):  # the first call's example repeated: a restart every call
            out = policy.infer(droid_observation(), "robot-0", "pick")
            assert out.sessions[0].restart_reason == "single_frame"
        policy.infer(droid_observation(), "robot-1", "pick")
        policy.infer(droid_observation(), "robot-1", "pick")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and all("single_frame" in m and "frames since the last call" in m for m in messages)
    assert "'robot-0'" in messages[0] and "'robot-1'" in messages[1]
