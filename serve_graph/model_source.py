"""What `build_app` reads from the checkpoint once, in the driver, so that only Policy replicas open `model_path`.

The CPU stages (ingress, preprocess, postprocess, the ZMQ door) get the embodiment's statistics as a plain dict;
the policy gets the checkpoint's layout, its preset config and the resolved tokenizer directory. Every failure is a
`ConfigError` that names the field to fix, raised before any replica starts.

Where metadata.json comes from, per `model_path`:

| model_path | statistics |
|---|---|
| null (embedded default) | the shipped synthetic file |
| hf / diffusers folder | `<folder>/experiment_cfg/metadata.json`, else `<folder>/metadata.json` |
| `full_weights.pt` file, or a folder holding one | the same two names in the file's folder |

`metadata_path` wins over all of them. A real checkpoint without statistics is an error (never silently synthetic):
wrong statistics give wrong robot actions without any other sign.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dreamzero.errors import ConfigError

METADATA_NAMES = ("experiment_cfg/metadata.json", "metadata.json")


@dataclass(frozen=True)
class ResolvedModel:
    """Plain, picklable data handed to the stages (no path that a CPU stage would open)."""

    embodiment: str
    metadata: dict[str, Any]  # {embodiment tag: its metadata.json entry}
    metadata_source: str  # where the statistics came from (logs, /v1/actions/metadata)
    layout: str | None  # "hf" | "full_weights" | "diffusers"; None: the embedded default
    checkpoint_config: str | None  # preset name for a full_weights.pt without config.json
    tokenizer_path: str | None  # None: the embedded default brings its own


def checkpoint_folder(model_path: str) -> Path:
    """The folder whose files describe the checkpoint (the file's folder for a full_weights.pt)."""
    path = Path(model_path)
    return path.parent if path.is_file() else path


def check_checkpoint(model_path: str, layout: str | None, preset_name: str | None) -> None:
    """ValueError (for the args' validation) unless `model_path` holds a checkpoint the loader can open: detected with
    the checkpoint package's own rules, or checked against the declared `layout`."""
    from dreamzero.checkpoint import CONFIG_FILE, FULL_WEIGHTS_FILE, MODEL_INDEX_FILE, detect_layout
    from dreamzero.errors import CheckpointError

    path = Path(model_path)
    try:
        found = detect_layout(path)
    except CheckpointError as exc:
        raise ValueError(f"model_path: {exc}; or set model_path to null") from None
    layout = layout or found
    needs = {"hf": CONFIG_FILE, "diffusers": MODEL_INDEX_FILE}
    if layout in needs and not (path.is_dir() and (path / needs[layout]).is_file()):
        raise ValueError(f"model_path {model_path!r} has no {needs[layout]}, which checkpoint_layout {layout} needs")
    if layout == "full_weights":
        file = path / FULL_WEIGHTS_FILE if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"model_path {model_path!r} holds no {FULL_WEIGHTS_FILE} (checkpoint_layout full_weights)")
        if preset_name is None and not (file.parent / CONFIG_FILE).is_file():
            raise ValueError(
                f"model_path {model_path!r} is a {FULL_WEIGHTS_FILE}, which stores no config, and there is no "
                f"{CONFIG_FILE} beside it; set checkpoint_config to the preset it was trained with (e.g. droid_14b)"
            )


def metadata_file(model_path: str | None, metadata_path: str | None) -> Path:
    from dreamzero.metadata import default_metadata_path

    if metadata_path is not None:
        return Path(metadata_path)
    if model_path is None:
        return default_metadata_path()
    folder = checkpoint_folder(model_path)
    for name in METADATA_NAMES:
        if (folder / name).is_file():
            return folder / name
    raise ConfigError(
        f"args.metadata_path: model_path {model_path!r} has no {' or '.join(METADATA_NAMES)} in {str(folder)!r}; "
        "set metadata_path to the metadata.json the checkpoint was trained with"
    )


def read_statistics(embodiment: str, model_path: str | None, metadata_path: str | None) -> tuple[dict, str]:
    """({tag: entry} of the served embodiment, source), validated by building the embodiment from it."""
    from dreamzero.embodiments import get_embodiment
    from dreamzero.metadata import read_metadata_file

    source = metadata_file(model_path, metadata_path)
    field = "args.metadata_path" if metadata_path is not None else "args.embodiment"
    try:
        raw = read_metadata_file(source)
        entry = {embodiment: raw[embodiment]} if embodiment in raw else raw  # an absent tag fails below, naming it
        get_embodiment(embodiment, entry)
    except ConfigError as exc:
        raise ConfigError(f"{field}: {exc}") from exc
    return entry, str(source)


def model_config(cfg):
    """The DreamZeroConfig the Policy replicas will load for `cfg` (an AppArgs): the checkpoint's, its preset's, or
    the embedded tiny model's; None for a replay (no model)."""
    from dreamzero.config import apply_overrides, preset

    if cfg.policy.replay is not None:
        return None
    found = (
        preset("tiny")
        if cfg.model_path is None
        else _model_config(cfg.model_path, cfg.resolved_layout, cfg.checkpoint_config)
    )
    return dataclasses.replace(found, pipeline=apply_overrides(found.pipeline, dict(cfg.pipeline) or None))


def _model_config(model_path: str, layout: str, preset_name: str | None):
    """The checkpoint's DreamZeroConfig (its config files, or the preset that replaces them)."""
    from dreamzero.config import preset

    if preset_name is not None:
        return preset(preset_name)
    if layout == "diffusers":
        from dreamzero.checkpoint import read_diffusers_config

        return read_diffusers_config(Path(model_path))
    from dreamzero.checkpoint import read_config

    return read_config(checkpoint_folder(model_path))  # hf, or the config.json beside a full_weights.pt


def resolve_tokenizer(model_path: str, layout: str, preset_name: str | None, tokenizer_path: str | None) -> str:
    from dreamzero.errors import CheckpointError
    from dreamzero.model.tokenizer import resolve_tokenizer_path

    try:
        cfg = _model_config(model_path, layout, preset_name)
    except (CheckpointError, ConfigError) as exc:
        raise ConfigError(f"args.model_path: cannot read the checkpoint's config: {exc}") from exc
    try:
        found = resolve_tokenizer_path(tokenizer_path, cfg.text_encoder.tokenizer_path, checkpoint_folder(model_path))
    except CheckpointError as exc:
        raise ConfigError(f"args.tokenizer_path: {exc}") from exc
    return str(found)


#: the embodiment of the embedded models and of a replay without a checkpoint
DEFAULT_EMBODIMENT = "oxe_droid"


def resolve_embodiment(cfg) -> str:
    """`args.embodiment`, else the checkpoint's own `embodiment_tag` (so a LIBERO checkpoint serves libero_sim with
    nothing else changed), else DEFAULT_EMBODIMENT."""
    if cfg.embodiment is not None:
        return cfg.embodiment
    if cfg.model_path is None or cfg.policy.replay is not None:
        return DEFAULT_EMBODIMENT
    from dreamzero.errors import CheckpointError

    try:
        tag = _model_config(cfg.model_path, cfg.resolved_layout, cfg.checkpoint_config).embodiment_tag
    except CheckpointError as exc:
        raise ConfigError(
            f"args.embodiment: cannot read the checkpoint's embodiment_tag ({exc}); set embodiment"
        ) from exc
    return tag or DEFAULT_EMBODIMENT


def resolve_model(cfg) -> ResolvedModel:
    """Everything the stages need from `cfg` (an `AppArgs`, already validated), read once."""
    embodiment = resolve_embodiment(cfg)
    metadata, source = read_statistics(embodiment, cfg.model_path, cfg.metadata_path)
    if cfg.model_path is None:
        return ResolvedModel(embodiment, metadata, source, None, None, None)
    if cfg.policy.replay is not None:  # recorded actions: the weights (and their tokenizer) are never loaded
        return ResolvedModel(embodiment, metadata, source, None, None, None)
    layout = cfg.resolved_layout
    tokenizer = resolve_tokenizer(cfg.model_path, layout, cfg.checkpoint_config, cfg.tokenizer_path)
    return ResolvedModel(embodiment, metadata, source, layout, cfg.checkpoint_config, tokenizer)
