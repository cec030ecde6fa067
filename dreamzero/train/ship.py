"""Ship a `dreamzero-train` checkpoint as an embedded model: `python -m dreamzero.train.ship <checkpoint> --name N`.

Copies what serving reads (config.json, the safetensors shards and their index, tokenizer/, experiment_cfg/
metadata.json) into `dreamzero/assets/models/<name>/`, leaves the optimizer state behind, and writes
`training.json` beside them (the run's TrainConfig, the last logged losses, the wall time; and, when the run started
`--init` from another dreamzero-train checkpoint that still exists, that run's record under `init_record`, and so on
back to the first stage; from a shipped model, the training.json it shipped with), so a config can serve it as
`model_path: embedded:<name>`. Refuses a checkpoint whose weights exceed the size limit of a repository file.
`--pipeline '{"sigma_shift": 12.0}'` changes the inference-loop defaults the shipped config.json carries (validated
as `pipeline:` overrides are; recorded in training.json), for knobs chosen after training, e.g. with
`python -m eval.mujoco_droid.reach_check --pipeline ...`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from dreamzero.cli_help import pipeline_overrides_arg
from dreamzero.config import parse_pipeline_config
from dreamzero.embedded_default import SHIPPED_MODELS_DIR
from dreamzero.errors import ConfigError
from dreamzero.train.trainer import LOG_FILE, STATE_FILE

MAX_WEIGHTS_BYTES = 30 * 2**20
_PATH_KEYS = ("dataset", "out", "init", "metadata")
SHIPPED_RECORD = "training.json"
_COPIED = ("config.json", "model.safetensors.index.json", "tokenizer", "experiment_cfg")


def _training_record(checkpoint: Path, depth: int = 0) -> dict:
    state = torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=False)
    log_path = checkpoint.parent / LOG_FILE
    lines = [json.loads(line) for line in log_path.read_text().splitlines()] if log_path.is_file() else []
    lines = [r for r in lines if r["step"] <= state["step"]]
    tail = lines[-100:]
    mean = {k: sum(r[k] for r in tail) / len(tail) for k in ("loss", "video_loss", "action_loss")} if tail else {}
    config = state["config"]
    if isinstance(config, dict):  # the folders of the machine that trained it mean nothing elsewhere: keep their names
        config = {k: Path(v).name if k in _PATH_KEYS and isinstance(v, str) else v for k, v in config.items()}
        if config.get("mixture"):
            config["mixture"] = [{**m, **{k: Path(m[k]).name for k in ("path", "metadata") if m.get(k)}}
                                 for m in config["mixture"]]  # fmt: skip
    record = {
        "step": state["step"],
        "config": config,
        "step_seconds_total": round(sum(r["seconds"] for r in lines), 1),  # optimizer steps only, not start-up
        "mean_of_last_100_logged_steps": mean,
    }
    init = state["config"].get("init") if isinstance(state["config"], dict) else None
    if init and depth < 16:  # a multi-stage model: record the stage it started from
        if (Path(init) / STATE_FILE).is_file():
            record["init_record"] = _training_record(Path(init), depth + 1)
        elif (Path(init) / SHIPPED_RECORD).is_file():  # a shipped model has no optimizer state, but its record
            record["init_record"] = _shipped_record(Path(init) / SHIPPED_RECORD)
    return record


def _shipped_record(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"init: {path} is not a readable training record ({exc})") from None
    if not isinstance(record, dict):
        raise ConfigError(f"init: {path} holds a {type(record).__name__}, expected a JSON object")
    return record


def _with_pipeline(config_json: Path, overrides: dict) -> dict:
    """A release config.json with its inference-loop defaults replaced, validated as deployment overrides are."""
    config = json.loads(config_json.read_text())
    ours = config.setdefault("dreamzero", {})
    ours["pipeline"] = parse_pipeline_config({**ours.get("pipeline", {}), **overrides}).model_dump(mode="json")
    return config


def ship_checkpoint(
    checkpoint: str | Path,
    name: str,
    dest_root: str | Path = SHIPPED_MODELS_DIR,
    pipeline: dict | None = None,
) -> Path:
    """Copy `checkpoint` to `<dest_root>/<name>/` (replacing an older copy); returns the new folder. `pipeline`:
    inference-loop overrides written into the shipped config.json (e.g. {"sigma_shift": 12.0})."""
    import tempfile

    from dreamzero.train.lora import ADAPTER_CONFIG, write_merged

    src = Path(checkpoint)
    if not any(src.glob("*.safetensors")) or not (src / STATE_FILE).is_file():
        raise ConfigError(f"checkpoint: {src} is not a dreamzero-train checkpoint (no *.safetensors / {STATE_FILE})")
    if not (src / ADAPTER_CONFIG).is_file():
        return _ship(src, src, name, dest_root, pipeline)
    with tempfile.TemporaryDirectory(prefix="dreamzero-merge-") as tmp:  # LoRA: ship base + adapters merged
        return _ship(src, write_merged(src, Path(tmp) / "merged"), name, dest_root, pipeline)


def _ship(src: Path, weights: Path, name: str, dest_root, pipeline: dict | None) -> Path:
    """Ship the model files of `weights` (src itself, or its merged LoRA model) with the record of `src`."""
    shards = sorted(weights.glob("*.safetensors"))
    size = sum(p.stat().st_size for p in shards)
    if size > MAX_WEIGHTS_BYTES:
        raise ConfigError(f"checkpoint: {size / 2**20:.1f} MiB of weights, over the {MAX_WEIGHTS_BYTES >> 20} MiB cap")
    config = _with_pipeline(weights / "config.json", pipeline) if pipeline else None  # a bad knob fails before any copy
    record = _training_record(src)  # so does a damaged record of the stage it started from
    dest = Path(dest_root) / name
    tmp = dest.with_name(f".{name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for item in [*shards, *(weights / n for n in _COPIED)]:
        if item.is_dir():
            shutil.copytree(item, tmp / item.name)
        elif item.is_file():
            shutil.copy2(item, tmp / item.name)
    if config is not None:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        record["pipeline_overrides"] = pipeline
    (tmp / SHIPPED_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dreamzero.train.ship", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a <out>/checkpoint-<step> folder written by dreamzero-train")
    p.add_argument("--name", required=True, help="shipped model name (served as embedded:<name>)")
    p.add_argument("--dest", default=str(SHIPPED_MODELS_DIR), help="folder of shipped models")
    p.add_argument(
        "--pipeline",
        type=pipeline_overrides_arg,
        default=None,
        help="inference-loop defaults to ship, e.g. '{\"sigma_shift\": 12.0}'",
    )
    args = p.parse_args(argv)
    try:
        print(ship_checkpoint(args.checkpoint, args.name, args.dest, pipeline=args.pipeline))
    except ConfigError as exc:  # not a checkpoint, a bad knob, a broken record: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
