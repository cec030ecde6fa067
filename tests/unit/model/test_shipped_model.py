"""The trained default shipped in the package (embedded:small-scene1) and the way a config names it.

Checked: the reference resolves to the packaged folder, which holds a model `load_model` reads as the `small` preset,
its training statistics and record, within the repository size cap; the shipped serve_config.yaml serves it with
those statistics; `model_path: null` still means the random tiny model; a bad name lists the shipped ones; the ship
step copies what serving reads and nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from dreamzero.checkpoint import load_model, save_model
from dreamzero.config import preset
from dreamzero.embedded_default import SHIPPED_MODELS_DIR, resolve_model_path, shipped_models
from dreamzero.errors import ConfigError
from dreamzero.model.dreamzero import DreamZeroModel
from dreamzero.model.tokenizer import build_local_tokenizer
from dreamzero.train.ship import MAX_WEIGHTS_BYTES, ship_checkpoint
from dreamzero.train.trainer import STATE_FILE
from serve_graph.config import parse_app_args
from serve_graph.model_source import resolve_model

ROOT = Path(__file__).resolve().parents[3]
NAME = "small-scene1"


def test_the_reference_resolves_to_a_loadable_small_model():
    assert NAME in shipped_models()
    path = Path(resolve_model_path(f"embedded:{NAME}"))
    assert path == SHIPPED_MODELS_DIR / NAME
    assert sum(p.stat().st_size for p in path.glob("*.safetensors")) <= MAX_WEIGHTS_BYTES
    model = load_model(path, device="cpu", dtype=torch.float32)
    small = preset("small")
    record = json.loads((path / "training.json").read_text())
    # the preset's inference loop, but for the knobs chosen at shipping (`ship --pipeline`), which the record names
    assert model.config.dit == small.dit
    assert model.config.pipeline == small.pipeline.with_overrides(record.get("pipeline_overrides"))
    assert model.config.pipeline.model_input_hw == (64, 128) and model.config.pipeline.cfg_scale == 1.0
    # trained, not the seeded random start: the DiT differs from the preset's random weights
    random = DreamZeroModel.from_config(small, device="cpu", dtype=torch.float32, seed=1140)
    assert not torch.equal(model.model.state_dict()["blocks.0.self_attn.q.weight"],
                           random.model.state_dict()["blocks.0.self_attn.q.weight"])  # fmt: skip
    meta = json.loads((path / "experiment_cfg" / "metadata.json").read_text())
    assert "oxe_droid" in meta and not meta["oxe_droid"].get("synthetic", False)
    assert record["step"] > 0 and record["config"]["embodiment"] == "oxe_droid"
    assert not (path / STATE_FILE).exists()


def test_the_shipped_config_serves_it_and_null_keeps_the_random_tiny_model():
    args = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
    cfg = parse_app_args(args)
    assert cfg.model_path == str(SHIPPED_MODELS_DIR / NAME) and cfg.resolved_layout == "hf"
    resolved = resolve_model(cfg)
    assert resolved.metadata_source == str(SHIPPED_MODELS_DIR / NAME / "experiment_cfg" / "metadata.json")
    assert parse_app_args({**args, "model_path": None}).resolved_layout is None  # the embedded tiny default


def test_an_unknown_name_lists_the_shipped_models():
    with pytest.raises(ConfigError, match=f"args.model_path: .*names no shipped model.*{NAME}"):
        parse_app_args({"model_path": "embedded:nope"})
    assert resolve_model_path("/some/where") == "/some/where" and resolve_model_path(None) is None


def test_ship_copies_what_serving_reads(tmp_path):
    ckpt = tmp_path / "run" / "checkpoint-0000002"
    model = DreamZeroModel.from_config(preset("tiny"), device="cpu", dtype=torch.float32, seed=0)
    model.text_encoder.tokenizer = build_local_tokenizer(preset("tiny").text_encoder.vocab_size)
    save_model(model, ckpt)
    (ckpt / "experiment_cfg").mkdir()
    (ckpt / "experiment_cfg" / "metadata.json").write_text("{}")
    torch.save({"step": 2, "config": {"steps": 2}, "optimizer": {}}, ckpt / STATE_FILE)
    log = [{"step": s, "loss": 1.0 / s, "video_loss": 0.5, "action_loss": 0.5, "seconds": 2.0} for s in (1, 2, 3)]
    (ckpt.parent / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    dest = ship_checkpoint(ckpt, "t", tmp_path / "models")
    assert not (dest / STATE_FILE).exists() and (dest / "experiment_cfg" / "metadata.json").is_file()
    record = json.loads((dest / "training.json").read_text())
    assert record["step"] == 2 and record["step_seconds_total"] == 4.0  # steps after the checkpoint are not counted
    assert load_model(dest, device="cpu", dtype=torch.float32).config.dit == preset("tiny").dit
    assert "init_record" not in record
    with pytest.raises(ConfigError, match="checkpoint: .* is not a dreamzero-train checkpoint"):
        ship_checkpoint(tmp_path / "models", "u", tmp_path / "models")
    # a second stage started from that checkpoint: its record carries the first stage's
    second = tmp_path / "run2" / "checkpoint-0000005"
    save_model(model, second)
    (second / "experiment_cfg").mkdir()
    (second / "experiment_cfg" / "metadata.json").write_text("{}")
    torch.save({"step": 5, "config": {"steps": 5, "init": str(ckpt)}, "optimizer": {}}, second / STATE_FILE)
    record = json.loads((ship_checkpoint(second, "t2", tmp_path / "models") / "training.json").read_text())
    assert (
        record["step"] == 5 and record["init_record"]["step"] == 2 and record["init_record"]["config"] == {"steps": 2}
    )
    # a stage started from a shipped model (no optimizer state there): it carries the record that model shipped with
    third = tmp_path / "run3" / "checkpoint-0000007"
    save_model(model, third)
    (third / "experiment_cfg").mkdir()
    (third / "experiment_cfg" / "metadata.json").write_text("{}")
    shipped = tmp_path / "models" / "t2"
    torch.save({"step": 7, "config": {"steps": 7, "init": str(shipped)}, "optimizer": {}}, third / STATE_FILE)
    record = json.loads((ship_checkpoint(third, "t3", tmp_path / "models") / "training.json").read_text())
    assert record["step"] == 7 and record["init_record"]["step"] == 5
    assert record["init_record"]["init_record"]["step"] == 2 and record["config"]["init"] == "t2"
    for broken in ("{not json", "[1, 2]"):  # a shipped model whose record is damaged: named, nothing written
        (shipped / "training.json").write_text(broken)
        with pytest.raises(ConfigError, match="init: .*training.json"):
            ship_checkpoint(third, "t4", tmp_path / "models")
        assert not (tmp_path / "models" / "t4").exists() and not (tmp_path / "models" / ".t4.tmp").exists()


def test_ship_writes_chosen_inference_knobs_and_refuses_bad_ones(tmp_path, capsys):
    from dreamzero.train.ship import main

    ckpt = tmp_path / "run" / "checkpoint-0000001"
    model = DreamZeroModel.from_config(preset("tiny"), device="cpu", dtype=torch.float32, seed=0)
    model.text_encoder.tokenizer = build_local_tokenizer(preset("tiny").text_encoder.vocab_size)
    save_model(model, ckpt)
    torch.save({"step": 1, "config": {"steps": 1}, "optimizer": {}}, ckpt / STATE_FILE)
    models = tmp_path / "models"
    assert main([str(ckpt), "--name", "k", "--dest", str(models), "--pipeline", '{"sigma_shift": 12.0}']) == 0
    shipped = load_model(models / "k", device="cpu", dtype=torch.float32).config.pipeline
    assert shipped == preset("tiny").pipeline.with_overrides({"sigma_shift": 12.0})
    assert json.loads((models / "k" / "training.json").read_text())["pipeline_overrides"] == {"sigma_shift": 12.0}
    with pytest.raises(ConfigError, match="sigma_shift"):  # a bad value: nothing is written
        ship_checkpoint(ckpt, "bad", models, pipeline={"sigma_shift": -1.0})
    assert not (models / "bad").exists() and not (models / ".bad.tmp").exists()
    capsys.readouterr()
    assert main([str(models), "--name", "bad", "--dest", str(models)]) == 2  # the CLI: one line, exit status 2
    assert capsys.readouterr().err.startswith("error: checkpoint: ")
    with pytest.raises(SystemExit):  # a misspelt knob fails at the command line, naming the closest one
        main([str(ckpt), "--name", "bad", "--dest", str(models), "--pipeline", '{"sigma_shfit": 12.0}'])
    assert "Did you mean 'sigma_shift'?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(ckpt), "--name", "bad", "--dest", str(models), "--pipeline", "[1]"])
    assert "expected a JSON object" in capsys.readouterr().err


def test_train_starts_from_a_named_preset(tmp_path, capsys):
    from dreamzero.train.cli import _random_preset_model, main

    path = _random_preset_model(str(tmp_path), "small")
    assert path == tmp_path / "init-small" and load_model(path, device="cpu").config.dit == preset("small").dit
    with pytest.raises(ConfigError, match="unknown preset 'smal'"):
        _random_preset_model(str(tmp_path), "smal")
    assert main(["--dataset", str(tmp_path), "--out", str(tmp_path), "--preset", "small", "--init", str(path)]) == 2
    assert "error: --preset and --init" in capsys.readouterr().err  # one line, not a traceback
