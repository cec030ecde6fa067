"""`dreamzero-make-metadata`: compute a metadata.json from a LeRobot dataset on disk, or merge several files.

    dreamzero-make-metadata generate DATASET --preset libero_sim -o metadata.json
    dreamzero-make-metadata generate DATASET --tag my_robot --state arm=observation.state[0:6] \
        --state gripper=observation.state[6:7] --action arm=action[0:6] --action gripper=action[6:7] \
        --video front=observation.images.front -o metadata.json --merge
    dreamzero-make-metadata merge all.json droid.json libero.json

Statistics are per dimension over every frame of every episode (float64, population std, linear quantiles); a
relative action subkey is described by its deltas `action[t + k] - state[t]`, k < horizon, within each episode.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dreamzero.cli_help import DefaultsHelpFormatter
from dreamzero.errors import ConfigError
from dreamzero.lerobot_dataset import PRESETS, ColumnSlice, DatasetPreset, LeRobotDataset, get_preset
from dreamzero.metadata import (
    BOUNDS,
    DEFAULT_BOUNDS,
    compute_key_stats,
    merge_metadata,
    read_metadata_file,
    save_metadata,
)
from dreamzero.progress import iterate

logger = logging.getLogger(__name__)


def relative_deltas(action: np.ndarray, state: np.ndarray, horizon: int, frame_stride: int = 1) -> np.ndarray:
    """In-episode pairs `action[t + k] - state[t]`, k in [0, horizon), t = 0, stride, ...: [N, D] x 2 -> [M, D]."""
    n = action.shape[0]
    return np.concatenate([(action[k:] - state[: n - k])[::frame_stride] for k in range(min(horizon, n))], axis=0)


def _video_modalities(dataset: LeRobotDataset, video: dict[str, str]) -> dict[str, Any]:
    out = {}
    for name, key in video.items():
        feature = dataset.features.get(key)
        if feature is None:
            logger.warning("video feature %r (%s) is not in the dataset; left out of modalities", key, name)
            continue
        shape = list(feature.get("shape") or [])
        names = list(feature.get("names") or [])
        if len(shape) != 3:
            raise ConfigError(f"video feature {key!r}: expected a 3-D shape, meta/info.json has {shape}")
        # resolution is written [width, height] (the reader's order); shapes are [h, w, c] unless names say otherwise
        if "height" in names and "width" in names:
            h, w = shape[names.index("height")], shape[names.index("width")]
        elif shape[0] == 3 and shape[-1] != 3:
            h, w = shape[1], shape[2]
        else:
            h, w = shape[0], shape[1]
        fps = (feature.get("info") or {}).get("video.fps", dataset.fps)
        out[name] = {"resolution": [int(w), int(h)], "channels": 3, "fps": float(fps) if fps else None}
    return out


def compute_metadata(
    dataset: LeRobotDataset | Sequence[LeRobotDataset],
    preset: DatasetPreset,
    tag: str | None = None,
    max_episodes: int | None = None,
    frame_stride: int = 1,
    progress: bool = True,
    action_bounds: str = DEFAULT_BOUNDS,
) -> dict[str, Any]:
    """{tag: {statistics, modalities, embodiment_tag}} for one dataset and one column preset; given several datasets
    (a mixture's datasets of one tag), the statistics of all their frames together (the video modalities: the first's).

    action_bounds: the statistics actions are normalised between (`dreamzero.metadata.BOUNDS`); anything but the
    default is written as the tag's `normalisation_bounds`.

    frame_stride > 1 uses every k-th frame of each episode (exact statistics of a subsample): for DROID-scale data,
    whose relative statistics otherwise hold `horizon` deltas per frame in memory.
    """
    tag = tag or preset.tag
    datasets = [dataset] if isinstance(dataset, LeRobotDataset) else list(dataset)
    if not datasets:
        raise ConfigError("compute_metadata: no dataset given")
    if action_bounds not in BOUNDS:
        raise ConfigError(f"action_bounds is {action_bounds!r}; use one of {sorted(BOUNDS)}")
    collected: dict[tuple[str, str], list[np.ndarray]] = {}
    for one in datasets:
        _collect_values(one, preset, tag, max_episodes, frame_stride, progress, collected)

    statistics: dict[str, dict[str, Any]] = {"state": {}, "action": {}}
    modalities: dict[str, Any] = {"video": _video_modalities(datasets[0], preset.video), "state": {}, "action": {}}
    for (group, name), chunks in collected.items():
        stats = compute_key_stats(np.concatenate(chunks, axis=0))
        statistics[group][name] = stats.to_dict()
        relative = group == "action" and name in preset.relative
        modalities[group][name] = {"absolute": not relative, "rotation_type": None, "shape": [stats.dim],
                                   "continuous": True}  # fmt: skip
    entry = {"statistics": statistics, "modalities": modalities, "embodiment_tag": tag}
    if action_bounds != DEFAULT_BOUNDS:
        entry["normalisation_bounds"] = {"action": action_bounds}
    return {tag: entry}


def _collect_values(
    dataset: LeRobotDataset,
    preset: DatasetPreset,
    tag: str,
    max_episodes: int | None,
    frame_stride: int,
    progress: bool,
    collected: dict[tuple[str, str], list[np.ndarray]],
) -> None:
    """Append one dataset's state and action values (relative actions as deltas) to `collected`, per (group, name)."""
    state_slices, action_slices = dataset.resolve_slices(preset)
    for group, slices in (("state", state_slices), ("action", action_slices)):
        names = [s.name for s in slices]
        if len(set(names)) != len(names):
            raise ConfigError(f"{group} subkey names repeat: {names}")
    state_by_name = {s.name: s for s in state_slices}
    for action_name, state_name in preset.relative.items():
        if action_name not in {s.name for s in action_slices} or state_name not in state_by_name:
            raise ConfigError(f"relative action {action_name!r} -> state {state_name!r}: one of them is not defined")
    columns = sorted({s.column for s in (*state_slices, *action_slices)})
    missing = [c for c in columns if c not in dataset.features]
    if missing:
        raise ConfigError(
            f"columns {missing} are not features of {dataset.root} (features: {sorted(dataset.features)}); "
            "pick other columns with --state NAME=COLUMN[START:END] / --action ..."
        )
    episodes = dataset.episode_indices[:max_episodes] if max_episodes else dataset.episode_indices
    if not episodes:
        raise ConfigError(f"{dataset.root} has no episodes")
    if frame_stride < 1:
        raise ConfigError(f"frame_stride must be >= 1, got {frame_stride}")
    for episode in iterate(episodes, desc=f"{tag}: episodes", unit="ep", enabled=progress):
        frames = dataset.episode_columns(episode, columns)
        values = {("state", s.name): s.take(frames[s.column]) for s in state_slices}
        values |= {("action", s.name): s.take(frames[s.column]) for s in action_slices}
        for s in (*state_slices, *action_slices):
            if s.take(frames[s.column]).shape[1] == 0:
                width = frames[s.column].shape[1]
                raise ConfigError(f"{s.name}={s.column}[{s.start}:{s.end}] selects no values (column width {width})")
        relative = {}
        for action_name, state_name in preset.relative.items():
            a, s = values[("action", action_name)], values[("state", state_name)]
            if a.shape[1] != s.shape[1]:
                raise ConfigError(
                    f"relative action {action_name} has {a.shape[1]} dims, state {state_name} {s.shape[1]}"
                )
            relative[("action", action_name)] = relative_deltas(a, s, preset.horizon, frame_stride)
        values = {key: v[::frame_stride] for key, v in values.items()} | relative
        for key, v in values.items():
            collected.setdefault(key, []).append(v)


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dreamzero-make-metadata", description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate",
        help="compute statistics from a LeRobot dataset (v2 or v3 layout)",
        formatter_class=DefaultsHelpFormatter,
    )
    gen.add_argument("dataset", type=Path, help="dataset root (holds meta/info.json)")
    gen.add_argument("--preset", choices=sorted(PRESETS), help="column preset of a known embodiment tag")
    gen.add_argument("--tag", help="embodiment tag to write (default: the preset's)")
    gen.add_argument("--state", action="append", default=[], metavar="NAME=COLUMN[START:END]",
                     help="a state subkey (repeat, in concat order); replaces the preset's")  # fmt: skip
    gen.add_argument("--action", action="append", default=[], metavar="NAME=COLUMN[START:END]",
                     help="an action subkey (repeat, in concat order); replaces the preset's")  # fmt: skip
    gen.add_argument("--video", action="append", default=[], metavar="NAME=FEATURE", help="a camera (repeat)")
    gen.add_argument("--relative", action="append", default=[], metavar="ACTION=STATE",
                     help="describe action subkey ACTION by its deltas from state subkey STATE")  # fmt: skip
    gen.add_argument("--horizon", type=int, help="action chunk length of relative statistics")
    gen.add_argument("--max-episodes", type=int, help="use only the first N episodes")
    gen.add_argument("--frame-stride", type=int, default=1, help="use every k-th frame (large datasets)")
    gen.add_argument(
        "--action-bounds",
        choices=sorted(BOUNDS),
        default=DEFAULT_BOUNDS,
        help="statistics that actions are normalised between (min_max: nothing is clamped)",
    )
    gen.add_argument("-o", "--output", type=Path, required=True, help="metadata.json to write")
    gen.add_argument("--merge", action="store_true", help="add the tag to an existing output file")
    gen.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing output file; with --merge, replace the tag in it if present",
    )
    gen.add_argument(
        "--no-progress", action="store_true", help="no progress (a bar on a terminal, a line every 30 s in a log)"
    )

    merge = sub.add_parser(
        "merge", help="merge several metadata.json files into one", formatter_class=DefaultsHelpFormatter
    )
    merge.add_argument("output", type=Path)
    merge.add_argument("inputs", type=Path, nargs="+")
    merge.add_argument("--overwrite", action="store_true", help="a tag present twice: the last input wins")
    return parser


def _preset_from_args(args: argparse.Namespace) -> DatasetPreset:
    if args.preset is None and args.tag is None:
        raise ConfigError("pass --preset TAG (one of " + ", ".join(sorted(PRESETS)) + ") or --tag with columns")
    if any("=" not in v for v in args.video + args.relative):
        raise ConfigError("--video and --relative take NAME=VALUE")
    base = get_preset(args.preset) if args.preset else DatasetPreset(tag=args.tag)
    preset = DatasetPreset(
        tag=args.tag or base.tag,
        state=[ColumnSlice.parse(s) for s in args.state] or list(base.state),
        action=[ColumnSlice.parse(s) for s in args.action] or list(base.action),
        video=dict(v.split("=", 1) for v in args.video) if args.video else dict(base.video),
        modality_state_column=base.modality_state_column,
        modality_action_column=base.modality_action_column,
        relative=dict(r.split("=", 1) for r in args.relative) if args.relative else dict(base.relative),
        horizon=args.horizon or base.horizon,
    )
    if preset.horizon < 1:
        raise ConfigError(f"--horizon must be >= 1, got {preset.horizon}")
    return preset


def _existing_output(args: argparse.Namespace, tag: str) -> dict | None:
    """The output file's tags that `generate --merge` keeps (None: nothing to keep); refuses to replace a file or one
    of its tags unless --overwrite says so."""
    if not args.output.exists():
        return None
    if not args.merge:
        if args.overwrite:
            return None
        raise ConfigError(
            f"{args.output} exists; pass --merge to add the tag {tag!r} to it, or --overwrite to replace the file"
        )
    existing = read_metadata_file(args.output)
    if tag in existing and not args.overwrite:
        raise ConfigError(f"{args.output} already holds the tag {tag!r}; pass --overwrite to replace it")
    return existing


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "merge":
            merged = merge_metadata(*(read_metadata_file(p) for p in args.inputs), overwrite=args.overwrite)
            save_metadata(merged, args.output)
            print(f"wrote {args.output} with tags {sorted(merged)}")
            return 0
        preset = _preset_from_args(args)
        existing = _existing_output(args, preset.tag)  # refused here, before minutes of statistics, not after
        dataset = LeRobotDataset(args.dataset)
        result = compute_metadata(
            dataset,
            preset,
            max_episodes=args.max_episodes,
            frame_stride=args.frame_stride,
            progress=not args.no_progress,
            action_bounds=args.action_bounds,
        )
        if existing is not None:
            result = merge_metadata(existing, result, overwrite=True)  # a tag present was refused or allowed above
        save_metadata(result, args.output)
        print(f"wrote {args.output} with tags {sorted(result)}")
        return 0
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
