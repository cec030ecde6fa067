"""The embedded default model: built locally in seconds, cached, deterministic, loud about being meaningless."""

from __future__ import annotations

import hashlib
import logging
import os

import torch

from dreamzero import embedded_default
from dreamzero.checkpoint import load_model
from dreamzero.config import preset
from dreamzero.embedded_default import build_default_model, default_model_dir


def _digest(path) -> dict[str, str]:
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir()) if f.suffix == ".safetensors"
    }


def test_builds_once_loads_and_warns(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="dreamzero.embedded_default"):
        path = default_model_dir(tmp_path)
    assert path.parent == tmp_path and path.name.startswith("tiny-")
    assert "MEANINGLESS" in caplog.text
    stamp = (path / "config.json").stat().st_mtime_ns
    assert default_model_dir(tmp_path) == path  # cached: not rebuilt
    assert (path / "config.json").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary folders left behind

    model = load_model(path, device="cpu", dtype=torch.float32)
    assert model.config == preset("tiny")
    assert len(model.text_encoder.tokenizer) == preset("tiny").text_encoder.vocab_size
    rows = model.text_encoder.encode(["pick up the cup", "open the drawer"])
    assert rows.shape == (2, 512, 32) and not torch.equal(rows[0], rows[1])
    # every pathway has non-trivial weights (no zero-initialised projections)
    for name, p in model.named_parameters():
        assert p.abs().max() > 0, name


def test_environment_variable_picks_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DREAMZERO_CACHE_DIR", str(tmp_path / "env-cache"))
    monkeypatch.setattr(embedded_default, "build_default_model", _fake_build)
    assert default_model_dir().parent == tmp_path / "env-cache"


def _fake_build(path):
    (path / "config.json").write_text("{}")
    return path


def test_weights_are_deterministic(tmp_path):
    a = build_default_model(tmp_path / "a")
    b = build_default_model(tmp_path / "b")
    assert _digest(a) == _digest(b) and _digest(a)


def test_losing_the_race_keeps_the_winners_copy(tmp_path, monkeypatch):
    # Another process finishes first: our rename fails, we keep theirs and clean up our temporary folder.
    target = tmp_path / f"tiny-{embedded_default._recipe_hash()}"

    def racing_build(path):
        _fake_build(path)
        target.mkdir()
        (target / "config.json").write_text('{"winner": true}')
        (target / ".complete").write_text("ok\n")
        return path

    monkeypatch.setattr(embedded_default, "build_default_model", racing_build)
    assert default_model_dir(tmp_path) == target
    assert (target / "config.json").read_text() == '{"winner": true}'
    assert os.listdir(tmp_path) == [target.name]


def test_incomplete_cache_is_rebuilt(tmp_path, monkeypatch):
    target = tmp_path / f"tiny-{embedded_default._recipe_hash()}"
    target.mkdir()
    (target / "config.json").write_text("half-written")
    monkeypatch.setattr(embedded_default, "build_default_model", _fake_build)
    assert default_model_dir(tmp_path) == target
    assert (target / "config.json").read_text() == "{}" and (target / ".complete").is_file()
