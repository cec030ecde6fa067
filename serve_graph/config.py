"""`parse_app_args(args)`: the YAML `args` of `serve_config.yaml` checked before anything starts.

Two steps, both raising `ConfigError` whose message names every bad field (`args.<field>: <what to do>`):
`deployments.config.validate_args` checks the values (the models' validators read no file), then `check_files`
checks what those values name on this machine: the checkpoint (and that its layout loads), the tokenizer and
statistics paths, the API key file, a replay's dataset and the ZeroMQ door's CURVE keys. The replicas read the same
files again where they use them. The vocabulary itself (`AppArgs`, its sections, the per-deployment settings) lives
in `deployments.config`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from deployments.config.app import AppArgs, format_problems, validate_args
from dreamzero.errors import ConfigError

__all__ = ["AppArgs", "check_files", "parse_app_args"]


def parse_app_args(args: dict[str, Any] | AppArgs | None) -> AppArgs:
    """Validate `args` (a dict from YAML, or an AppArgs) and check the files it names; ConfigError listing every
    problem. An AppArgs passed in is taken as validated: only its files are checked."""
    cfg = validate_args(args)
    check_files(cfg)
    return cfg


def _path_problem(value: str | None, check: Callable[[Path], bool], problem: str) -> str | None:
    if value is None or check(Path(value)):
        return None
    return f"{value!r} {problem} or set it to null"


def check_files(cfg: AppArgs) -> None:
    """ConfigError naming every field whose file or folder is missing or unreadable (the start-time check that the
    validators leave out: they read nothing)."""
    found = {
        "model_path": _path_problem(
            cfg.model_path, Path.exists, "does not exist; point model_path at a checkpoint (file or folder)"
        ),
        "tokenizer_path": _path_problem(
            cfg.tokenizer_path, Path.is_dir, "is not a directory; point tokenizer_path at a local google/umt5-xxl copy"
        ),
        "metadata_path": _path_problem(
            cfg.metadata_path, Path.is_file, "is not a file; give the path of a metadata.json"
        ),
        "api_keys_file": _api_keys_file_problem(cfg.api_keys_file),
    }
    if cfg.policy.replay is not None:
        found["policy.replay.dataset"] = _path_problem(
            cfg.policy.replay.dataset,
            Path.is_dir,
            "is not a directory; point policy.replay.dataset at a LeRobot dataset",
        )
    if cfg.zmq is not None and cfg.zmq.curve is not None:
        found["zmq.curve"] = _curve_problem(cfg)
    if cfg.model_path is not None and found["model_path"] is None:
        found["model_path"] = _checkpoint_problem(cfg)
    problems = [(field, message) for field, message in found.items() if message is not None]
    if problems:
        raise ConfigError(format_problems(problems))


def _api_keys_file_problem(path: str | None) -> str | None:
    from deployments.tenants import read_key_file

    problem = _path_problem(
        path, Path.is_file, "is not a file; point api_keys_file at a YAML or JSON file of key digests"
    )
    if problem is not None or path is None:
        return problem
    try:
        read_key_file(path)
    except ConfigError as exc:
        return str(exc)
    return None


def _curve_problem(cfg: AppArgs) -> str | None:
    """The door's own key reading, run once here: the same message at `serve run` as the replica would log."""
    from deployments.doors.zmq import curve_allowed_clients, curve_server_keys

    try:  # the line already says `zmq.curve`: the messages name the field below it
        curve_server_keys(cfg.zmq.curve, field_prefix="")
        curve_allowed_clients(cfg.zmq.curve, field_prefix="")
    except ConfigError as exc:
        return str(exc)
    return None


def _checkpoint_problem(cfg: AppArgs) -> str | None:
    from serve_graph.model_source import check_checkpoint

    try:
        check_checkpoint(cfg.model_path, cfg.checkpoint_layout, cfg.checkpoint_config)
    except ValueError as exc:
        return str(exc).removeprefix("model_path: ").removeprefix("model_path ")
    return None
