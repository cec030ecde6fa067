"""The serving configuration's one vocabulary (deployments/config/, docs/architecture.md "Configuration"): one naming
rule, validators that read no file, the files checked once at start naming their field, and a Policy bound with the
validated sections themselves rather than a copy of their fields."""

from __future__ import annotations

import inspect
import pathlib

import pytest
from pydantic import BaseModel

from deployments.config import app, sections, settings
from deployments.config.app import AppArgs, CheckpointArgs, validate_args
from deployments.config.sections import PolicyArgs
from deployments.config.settings import PolicySettings
from dreamzero.errors import ConfigError
from serve_graph.builder import build_app, policy_settings
from serve_graph.config import parse_app_args
from serve_graph.model_source import resolve_model

#: args naming a file or folder in every place that can name one, none of which exists
ON_DISK = {
    "model_path": "/srv/absent/checkpoint",
    "tokenizer_path": "/srv/absent/tokenizer",
    "metadata_path": "/srv/absent/metadata.json",
    "api_keys_file": "/srv/absent/keys.yaml",
    "policy": {"replay": {"dataset": "/srv/absent/dataset"}},
    "zmq": {"curve": {"secret_key_file": "/srv/absent/door.key_secret", "client_keys_dir": "/srv/absent/clients"}},
}


def _models(module) -> dict[str, type[BaseModel]]:
    return {
        name: obj
        for name, obj in vars(module).items()
        if inspect.isclass(obj) and issubclass(obj, BaseModel) and obj.__module__ == module.__name__
    }


def test_one_suffix_per_kind_of_model():
    # a YAML block ends in Args, what a deployment is bound with in Settings; `Config` is the model's (dreamzero)
    assert {n for n in _models(sections) if n != "Strict" and not n.endswith("Args")} == set()
    assert {n for n in _models(app) if not n.endswith("Args")} == set()
    assert {n for n in _models(settings) if not n.endswith("Settings")} == set()
    assert len(_models(sections)) > 10 and "PolicySettings" in _models(settings)


def test_validators_read_no_file(monkeypatch):
    touched: list[str] = []

    def recorder(name):
        real = getattr(pathlib.Path, name)

        def record(self, *args, **kwargs):
            if str(self).startswith("/srv/absent"):
                touched.append(f"{name}({self})")
            return real(self, *args, **kwargs)

        return record

    with monkeypatch.context() as patch:  # undone before any assertion: pytest's own reporting reads files
        for name in ("stat", "exists", "is_dir", "is_file", "read_text", "read_bytes", "open", "iterdir", "glob"):
            patch.setattr(pathlib.Path, name, recorder(name))
        cfg = validate_args(ON_DISK)
    assert touched == []
    assert cfg.model_path == ON_DISK["model_path"] and cfg.zmq.curve.client_keys_dir == "/srv/absent/clients"


def test_the_files_are_checked_at_start_each_naming_its_field():
    with pytest.raises(ConfigError) as bad:
        parse_app_args(ON_DISK)
    lines = str(bad.value).splitlines()
    assert lines[0] == "invalid serve_config.yaml args:"
    fields = [line.strip().split(":", 1)[0] for line in lines[1:]]
    assert fields == [
        "args.model_path",
        "args.tokenizer_path",
        "args.metadata_path",
        "args.api_keys_file",
        "args.policy.replay.dataset",
        "args.zmq.curve",
    ]
    assert "'/srv/absent/checkpoint' does not exist" in lines[1]
    assert "secret_key_file: cannot read '/srv/absent/door.key_secret'" in lines[6]


def test_serve_run_fails_on_a_missing_curve_key_before_any_deployment_is_bound():
    with pytest.raises(ConfigError) as bad:
        build_app({"zmq": {"curve": {"secret_key_file": "/srv/absent/door.key_secret"}}})
    assert str(bad.value).splitlines()[1:] == [
        "  args.zmq.curve: secret_key_file: cannot read '/srv/absent/door.key_secret' (FileNotFoundError: [Errno 2] "
        "No such file or directory: '/srv/absent/door.key_secret')"
    ]


def test_the_policy_is_bound_with_the_validated_sections():
    cfg = parse_app_args(
        {
            "policy": {"torch_threads": 3, "rows_per_thread": 2, "cfg_timeout_s": 30, "num_cpus": 2},
            "sessions": {"max_sessions": 7},
            "batching": {"max_batch_rows": 5},
            "video": {"every_n_chunks": 3},
            "pipeline": {"num_inference_steps": 2, "dit_step_mask": None},
            "return_latents": True,
            "dtype": "float32",
            "http": {"retry_after_s": 2.5},
        }
    )
    s = policy_settings(cfg, resolve_model(cfg))
    # the sections it applies whole are the very objects the YAML was validated into
    assert s.sessions is cfg.sessions and s.batching is cfg.batching and s.video is cfg.video
    # the checkpoint fields and the policy section, field by field as the user wrote them (nothing left behind)
    for name in CheckpointArgs.model_fields:
        if name not in ("checkpoint_layout", "checkpoint_config", "tokenizer_path", "device"):  # resolved
            assert getattr(s, name) == getattr(cfg, name), name
    for name in PolicyArgs.model_fields:
        assert getattr(s, name) == getattr(cfg.policy, name), name
    assert s.device == "cpu" and s.retry_after_s == 2.5 and s.cfg_rank_options == {"num_cpus": 2.0, "num_gpus": 0.0}
    assert set(PolicySettings.model_fields) == set(CheckpointArgs.model_fields) | set(PolicyArgs.model_fields) | {
        "sessions",
        "batching",
        "video",
        "embodiment",
        "retry_after_s",
    }


def test_a_policy_replica_never_chooses_its_own_device():
    assert PolicySettings().device == "cpu" and PolicySettings(num_gpus=1).device == "cuda"
    assert PolicySettings(device="cuda:1", num_gpus=1).device == "cuda:1"
    assert issubclass(AppArgs, CheckpointArgs)  # the checkpoint fields stay at the top of `args`, as users write them
