"""PipelineConfig validation (one place for every way in) and release config.json -> DreamZeroConfig validation."""

from __future__ import annotations

import json
import logging

import pytest
from pydantic import ValidationError

from dreamzero.config import (
    PipelineConfig,
    apply_overrides,
    from_checkpoint_config,
    parse_pipeline_config,
    preset,
    to_checkpoint_config,
    unknown_knob_message,
)
from dreamzero.errors import ConfigError


def test_every_knob_is_documented():
    for name, info in PipelineConfig.model_fields.items():
        assert info.description and len(info.description) > 20, f"pipeline.{name} has no description"


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"cfg_scal": 3.0}, "unknown pipeline knob 'cfg_scal'. Did you mean 'cfg_scale'?"),
        ({"num_inference_step": 4}, "Did you mean 'num_inference_steps'?"),
        ({"zzz": 1}, "Known knobs: ['num_inference_steps'"),
        ({"dynamic_skip": "yes"}, "pipeline.dynamic_skip must be true or false, got 'yes'"),
        ({"conditioning_by_chunk": 1}, "pipeline.conditioning_by_chunk must be true or false, got 1"),
        ({"dit_step_mask": [1] * 16}, "pipeline.dit_step_mask[0] must be true or false, got 1"),
        ({"num_inference_steps": 2.0}, "pipeline.num_inference_steps must be int, got 2.0"),
        ({"num_inference_steps": "16"}, "pipeline.num_inference_steps must be int"),
        ({"num_inference_steps": 0}, "pipeline.num_inference_steps: Input should be greater than or equal to 1"),
        ({"sigma_shift": 0.0}, "pipeline.sigma_shift: Input should be greater than 0"),
        ({"dit_step_mask": [True, False]}, "dit_step_mask has 2 entries but num_inference_steps is 16"),
        ({"dit_step_mask": [False] + [True] * 15}, "pipeline.dit_step_mask: the first entry must be true"),
        ({"dynamic_skip_warmup": 0}, "pipeline.dynamic_skip_warmup"),
        ({"dynamic_skip_thresholds": [[1.5, 2]]}, "pipeline.dynamic_skip_thresholds[0][0]"),
        ({"dynamic_skip_thresholds": [[0.9, -1]]}, "pipeline.dynamic_skip_thresholds[0][1]"),
        ({"prompt_cache_size": -1}, "pipeline.prompt_cache_size"),
        ({"model_input_hw": [32]}, "pipeline.model_input_hw[1]: missing"),
        ({"model_input_hw": [0, 64]}, "pipeline.model_input_hw[0]"),
        ({"compile": "full"}, "pipeline.compile: Input should be 'none', 'dit' or 'all', got 'full'"),
    ],
)
def test_bad_knobs_fail_naming_the_field_and_the_fix(overrides, needle):
    with pytest.raises(ConfigError) as info:
        PipelineConfig().with_overrides(overrides)
    assert needle in str(info.value)
    with pytest.raises(ConfigError) as again:  # every way in gives the same message
        parse_pipeline_config({**PipelineConfig().model_dump(), **overrides})
    assert str(again.value) == str(info.value)


def test_several_problems_are_all_listed():
    with pytest.raises(ConfigError) as info:
        PipelineConfig().with_overrides({"dynamic_skip": "no", "prompt_cache_size": -3, "cfg_scal": 1.0})
    text = str(info.value)
    assert "dynamic_skip" in text and "prompt_cache_size" in text and "cfg_scal" in text


def test_good_overrides_from_yaml_lists():
    cfg = apply_overrides(PipelineConfig(), {"num_inference_steps": 4, "dit_step_mask": [True, False, True, True]})
    assert cfg.dit_step_mask == (True, False, True, True) and cfg.num_inference_steps == 4
    cfg = cfg.with_overrides({"model_input_hw": [32, 64], "dynamic_skip_thresholds": [[0.9, 3]], "compile": "dit"})
    assert cfg.model_input_hw == (32, 64) and cfg.dynamic_skip_thresholds == ((0.9, 3),) and cfg.compile == "dit"
    assert cfg.with_overrides({"cfg_scale": 1}).cfg_scale == 1.0  # an int is a fine float
    assert PipelineConfig().with_overrides(None) == PipelineConfig()


def test_config_is_frozen():
    cfg = PipelineConfig()
    with pytest.raises(ValidationError):
        cfg.num_inference_steps = 0  # a PipelineConfig in hand is always a valid one


def test_unknown_knob_message_is_the_one_place():
    assert unknown_knob_message("dynamic_skp") == unknown_knob_message("dynamic_skp", "pipeline")
    assert "Did you mean 'dynamic_skip'?" in unknown_knob_message("dynamic_skp")
    assert "Did you mean" not in unknown_knob_message("qqqqqqqq")


def test_serve_args_use_the_same_check():
    from serve_graph.config import parse_app_args

    with pytest.raises(ConfigError) as info:
        parse_app_args({"pipeline": {"cfg_scal": 3.0}})
    assert unknown_knob_message("cfg_scal") in str(info.value)
    assert parse_app_args({"pipeline": {"compile": "all"}}).pipeline == {"compile": "all"}


# -- release config.json ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["droid_14b", "libero_5b", "tiny"])
def test_checkpoint_config_round_trip(name):
    cfg = preset(name).__class__(**{**preset(name).__dict__, "pipeline": PipelineConfig(compile="dit")})
    data = to_checkpoint_config(cfg)
    assert from_checkpoint_config(json.loads(json.dumps(data))) == cfg
    assert from_checkpoint_config(data) == cfg  # tuples as written, before any JSON round trip
    assert cfg.to_dict()["pipeline"]["compile"] == "dit"


def _tiny_json() -> dict:
    return json.loads(json.dumps(to_checkpoint_config(preset("tiny"))))


@pytest.mark.parametrize(
    "path, value, needle",
    [
        (("action_head_cfg", "config", "diffusion_model_cfg", "dim"), True, "diffusion_model_cfg.dim must be int"),
        (("action_head_cfg", "config", "diffusion_model_cfg", "dim"), 64.0, "diffusion_model_cfg.dim must be int"),
        (("action_head_cfg", "config", "diffusion_model_cfg", "patch_size"), [1, 2], "patch_size[2]: missing"),
        (("action_head_cfg", "config", "diffusion_model_cfg", "eps"), "tiny", "diffusion_model_cfg.eps must be float"),
        (("action_head_cfg", "config", "vae_cfg", "dim_mult"), 4, "vae_cfg.dim_mult must be a list"),
        (("action_head_cfg", "config", "num_frames"), 3.5, "action_head_cfg.config.num_frames must be int"),
        (("action_head_cfg", "config", "max_action_dim"), "32", "action_head_cfg.config.max_action_dim must be int"),
        (("dreamzero", "pipeline", "dynamic_skip"), "no", "dreamzero.pipeline.dynamic_skip must be true or false"),
        (("dreamzero", "name"), 3, "dreamzero.name must be str"),
        (("action_horizon",), None, "action_horizon must be int"),
    ],
)
def test_bad_checkpoint_values_name_the_field(path, value, needle):
    data = _tiny_json()
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ConfigError) as info:
        from_checkpoint_config(data)
    assert needle in str(info.value)


def test_checkpoint_ignores_foreign_keys_and_warns_on_unknown_pipeline_knobs(caplog):
    data = _tiny_json()
    data["action_head_cfg"]["config"]["diffusion_model_cfg"]["_target_"] = "upstream.CausalWanModel"
    data["dreamzero"]["pipeline"]["cfg_scal"] = 2.0
    with caplog.at_level(logging.WARNING, logger="dreamzero.config"):
        cfg = from_checkpoint_config(data)
    assert cfg == preset("tiny").__class__(**{**preset("tiny").__dict__, "name": "tiny"})
    assert "Did you mean 'cfg_scale'" in caplog.text
