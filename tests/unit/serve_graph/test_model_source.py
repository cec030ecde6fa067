"""`build_app` accepts a checkpoint in each of the three layouts, reads its statistics and tokenizer once, and hands
the CPU stages data instead of paths; a checkpoint that cannot load fails at start naming the field to fix."""

from __future__ import annotations

import json
import pickle
import shutil

import pytest

from deployments.config.settings import EmbodimentSettings, StageSettings
from deployments.postprocess import PostprocessDeployment
from deployments.preprocess import PreprocessDeployment
from dreamzero.errors import ConfigError
from serve_graph.config import parse_app_args
from serve_graph.model_source import resolve_model
from tests.support.checkpoints import write_tiny_layouts

#: a full_weights.pt stores no config
PRESET = {"hf": None, "full_weights": "tiny", "diffusers": None}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    return write_tiny_layouts(tmp_path_factory.mktemp("layouts"))


def _args(path, layout: str, **extra) -> dict:
    return {"model_path": str(path), "checkpoint_config": PRESET[layout], **extra}


@pytest.mark.parametrize("layout", ["hf", "full_weights", "diffusers"])
def test_each_layout_is_resolved_once_into_data(layouts, layout):
    from serve_graph.builder import build_app, ingress_settings, zmq_door_settings

    path = layouts[layout]
    cfg = parse_app_args(_args(path, layout))
    model = resolve_model(cfg)
    assert (model.layout, model.checkpoint_config) == (layout, PRESET[layout])
    assert model.tokenizer_path == str(path.parent / "tokenizer" if layout == "full_weights" else path / "tokenizer")
    assert model.metadata_source.endswith("experiment_cfg/metadata.json")
    assert list(model.metadata) == ["oxe_droid"] and "statistics" in model.metadata["oxe_droid"]
    # what the CPU stages receive: picklable data that names no file of the checkpoint
    shipped = pickle.dumps(model.metadata)
    assert str(path) not in json.dumps(model.metadata) and pickle.loads(shipped) == model.metadata
    # the front doors' settings name no path at all (their replicas may run on nodes without the checkpoint)
    door_cfg = parse_app_args({**_args(path, layout), "zmq": {}})
    for door in (ingress_settings(door_cfg, model), zmq_door_settings(door_cfg, model)):
        assert str(path) not in door.model_dump_json() and door.graph.embodiment.tag == "oxe_droid"
        assert pickle.loads(pickle.dumps(door)) == door
    build_app(_args(path, layout))


def test_a_folder_holding_full_weights_is_accepted(layouts):
    cfg = parse_app_args({"model_path": str(layouts["full_weights"].parent), "checkpoint_config": "tiny"})
    assert cfg.resolved_layout == "full_weights"
    assert resolve_model(cfg).metadata_source.startswith(str(layouts["full_weights"].parent))


def test_full_weights_without_a_config_names_checkpoint_config(layouts):
    with pytest.raises(ConfigError, match="checkpoint_config"):
        parse_app_args({"model_path": str(layouts["full_weights"])})
    with pytest.raises(ConfigError, match="args.checkpoint_config: 'tiny_14b' is no preset"):
        parse_app_args({"model_path": str(layouts["full_weights"]), "checkpoint_config": "tiny_14b"})


def test_paths_that_hold_no_checkpoint_name_model_path(layouts, tmp_path):
    with pytest.raises(ConfigError, match="args.model_path: .* does not exist"):
        parse_app_args({"model_path": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="model_path: .*no checkpoint layout"):
        parse_app_args({"model_path": str(tmp_path)})
    weights = tmp_path / "weights.safetensors"
    weights.write_bytes(b"x")
    with pytest.raises(ConfigError, match="model_path: .*not a torch state dict"):
        parse_app_args({"model_path": str(weights)})
    with pytest.raises(ConfigError, match="has no model_index.json, which checkpoint_layout diffusers needs"):
        parse_app_args({"model_path": str(layouts["hf"]), "checkpoint_layout": "diffusers"})


def test_statistics_come_from_beside_the_checkpoint_or_metadata_path(layouts, tmp_path):
    copy = shutil.copytree(layouts["hf"], tmp_path / "hf")
    stats = json.loads((copy / "experiment_cfg" / "metadata.json").read_text())
    shutil.rmtree(copy / "experiment_cfg")
    with pytest.raises(ConfigError, match="args.metadata_path: model_path .* has no experiment_cfg/metadata.json"):
        resolve_model(parse_app_args({"model_path": str(copy)}))
    stats["oxe_droid"]["statistics"]["state"]["gripper_position"]["q99"] = [0.75]
    (copy / "metadata.json").write_text(json.dumps(stats))  # the second name looked for
    model = resolve_model(parse_app_args({"model_path": str(copy)}))
    assert model.metadata["oxe_droid"]["statistics"]["state"]["gripper_position"]["q99"] == [0.75]
    # the CPU stages build their embodiment from this data, not from a file
    for stage_cls in (PreprocessDeployment, PostprocessDeployment):
        stage = stage_cls(StageSettings(embodiment=EmbodimentSettings(tag="oxe_droid", metadata=model.metadata)))
        assert stage.embodiment.metadata.stats("state.gripper_position").q99.tolist() == [0.75]
    explicit = tmp_path / "other.json"
    explicit.write_text(json.dumps({"libero_sim": stats["libero_sim"]}))
    with pytest.raises(ConfigError, match="args.metadata_path: .*no embodiment tag 'oxe_droid'"):
        resolve_model(parse_app_args({"model_path": str(copy), "metadata_path": str(explicit)}))


def test_a_missing_tokenizer_fails_at_start_naming_tokenizer_path(layouts, tmp_path, monkeypatch):
    monkeypatch.delenv("DREAMZERO_TOKENIZER_PATH", raising=False)
    copy = shutil.copytree(layouts["hf"], tmp_path / "hf")
    shutil.rmtree(copy / "tokenizer")
    with pytest.raises(ConfigError, match="args.tokenizer_path: no tokenizer found"):
        resolve_model(parse_app_args({"model_path": str(copy)}))
    model = resolve_model(parse_app_args({"model_path": str(copy), "tokenizer_path": str(layouts["hf"] / "tokenizer")}))
    assert model.tokenizer_path == str(layouts["hf"] / "tokenizer")


def test_the_embedded_default_uses_the_shipped_statistics():
    from dreamzero.metadata import default_metadata_path

    model = resolve_model(parse_app_args({}))
    assert (model.layout, model.tokenizer_path, model.metadata_source) == (None, None, str(default_metadata_path()))


def test_stage_resources_reach_the_ray_actor_options():
    from serve_graph.builder import _cpu_options, policy_options

    cfg = parse_app_args({"policy": {"resources": {"gpu_node": 0.01}}, "ingress": {"resources": {"head": 0.01}}})
    assert policy_options(cfg)["ray_actor_options"]["resources"] == {"gpu_node": 0.01}
    assert _cpu_options("Ingress", cfg.ingress)["ray_actor_options"]["resources"] == {"head": 0.01}
