"""Read LeRobot datasets on disk (v2.x and v3.0 layouts) with pyarrow only; no `lerobot` dependency.

v2.x: `meta/info.json`, `meta/episodes.jsonl`, one parquet per episode at `data_path` (default
      `data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet`).
v3.0: `meta/info.json`, episode table as parquet under `meta/episodes/`, many episodes per data file
      (`data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet`), rows tagged by an `episode_index` column.
Optional `meta/modality.json` (GR00T style) names start/end slices of `observation.state` and `action`.
Also holds the column presets of the three embodiment tags, shared by the metadata generator and ReplayPolicy.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dreamzero.errors import ConfigError

# ---------------------------------------------------------------------------------------------------------------------
# 1. Column specs and presets
# ---------------------------------------------------------------------------------------------------------------------

_SPEC_RE = re.compile(r"^(?P<name>[^=]+)=(?P<column>[^\[\]]+)(\[(?P<start>\d*):(?P<end>\d*)\])?$")


@dataclass(frozen=True)
class ColumnSlice:
    """One state/action subkey = `column[start:end]` of a parquet column (None: the whole column)."""

    name: str  # subkey, e.g. "joint_position"
    column: str  # parquet column, e.g. "observation.state"
    start: int | None = None
    end: int | None = None

    @classmethod
    def parse(cls, text: str) -> ColumnSlice:
        """`NAME=COLUMN` or `NAME=COLUMN[START:END]` (the command-line form)."""
        m = _SPEC_RE.match(text.strip())
        if m is None:
            raise ConfigError(f"cannot parse {text!r}: expected NAME=COLUMN or NAME=COLUMN[START:END]")
        start, end = m.group("start"), m.group("end")
        return cls(m.group("name").strip(), m.group("column").strip(), int(start) if start else None,
                   int(end) if end else None)  # fmt: skip

    def take(self, values: np.ndarray) -> np.ndarray:
        return values[:, self.start : self.end]


@dataclass
class DatasetPreset:
    """Which columns make which state/action subkeys for one embodiment tag."""

    tag: str
    state: list[ColumnSlice] = field(default_factory=list)  # empty: from meta/modality.json
    action: list[ColumnSlice] = field(default_factory=list)
    video: dict[str, str] = field(default_factory=dict)  # short name -> feature key
    modality_state_column: str = "observation.state"  # used when slices come from modality.json
    modality_action_column: str = "action"
    relative: dict[str, str] = field(default_factory=dict)  # action subkey -> state subkey (relative stats)
    horizon: int = 1  # chunk length of relative statistics


PRESETS: dict[str, DatasetPreset] = {
    "libero_sim": DatasetPreset(
        tag="libero_sim",
        state=[ColumnSlice("state", "state")],
        action=[ColumnSlice("actions", "actions")],
        video={"image": "image", "wrist_image": "wrist_image"},
    ),
    "oxe_droid": DatasetPreset(
        tag="oxe_droid",
        video={
            "exterior_image_1_left": "observation.images.exterior_image_1_left",
            "exterior_image_2_left": "observation.images.exterior_image_2_left",
            "wrist_image_left": "observation.images.wrist_image_left",
        },
        # the DROID model predicts joint deltas from the current joints over its 24-step chunk
        relative={"joint_position": "joint_position"},
        horizon=24,
    ),
    "franka_pnp": DatasetPreset(
        tag="franka_pnp",
        state=[ColumnSlice("state", "state")],
        action=[ColumnSlice("actions", "actions")],
        video={"image": "observation.images.image", "wrist_image": "observation.images.wrist_image"},
    ),
}


def get_preset(tag: str) -> DatasetPreset:
    if tag not in PRESETS:
        raise ConfigError(f"no dataset preset for {tag!r}; presets exist for {sorted(PRESETS)} (else pass columns)")
    return PRESETS[tag]


# ---------------------------------------------------------------------------------------------------------------------
# 2. The dataset reader
# ---------------------------------------------------------------------------------------------------------------------


def column_to_array(table: pa.Table, column: str, where: str) -> np.ndarray:
    """A numeric scalar or fixed-length list column -> float64 [N, D]."""
    if column not in table.column_names:
        raise ConfigError(f"{where}: column {column!r} is missing; the parquet has {table.column_names}")
    col = table.column(column).combine_chunks()
    n = len(col)
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type) or pa.types.is_fixed_size_list(col.type):
        if col.null_count:
            raise ConfigError(f"{where}: column {column!r} has {col.null_count} null rows")
        lengths = np.asarray(col.value_lengths()) if not pa.types.is_fixed_size_list(col.type) else None
        if lengths is not None and n and (lengths != lengths[0]).any():
            raise ConfigError(f"{where}: column {column!r} rows have different lengths {sorted(set(lengths.tolist()))}")
        flat = col.flatten()
        if not (pa.types.is_integer(flat.type) or pa.types.is_floating(flat.type)):
            raise ConfigError(f"{where}: column {column!r} holds {flat.type}, expected numbers")
        width = (int(lengths[0]) if n else 0) if lengths is not None else col.type.list_size
        return np.asarray(flat.to_numpy(zero_copy_only=False), np.float64).reshape(n, width)
    if pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_boolean(col.type):
        return np.asarray(col.to_numpy(zero_copy_only=False), np.float64).reshape(n, 1)
    raise ConfigError(f"{where}: column {column!r} has type {col.type}, expected numbers or lists of numbers")


class LeRobotDataset:
    """Minimal read access to a LeRobot dataset directory: features, episodes, per-episode columns."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        info_path = self.root / "meta" / "info.json"
        if not info_path.is_file():
            raise ConfigError(f"{self.root} is not a LeRobot dataset: {info_path} is missing")
        try:
            self.info: dict[str, Any] = json.loads(info_path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{info_path} is not valid JSON: {exc}") from exc
        version = str(self.info.get("codebase_version", ""))
        m = re.match(r"v?(\d+)\.", version)
        if m is None or m.group(1) not in ("2", "3"):
            raise ConfigError(f"{info_path}: codebase_version {version!r} is not supported (v2.x or v3.0)")
        self.major = int(m.group(1))
        self.features: dict[str, Any] = self.info.get("features") or {}
        if not self.features:
            raise ConfigError(f"{info_path}: no 'features'")
        self.chunks_size = int(self.info.get("chunks_size", 1000))
        self._episodes = self._read_episodes()
        self._file_cache: tuple[Path, pa.Table] | None = None

    # -- metadata -----------------------------------------------------------------------------------------------------

    @property
    def fps(self) -> float | None:
        return float(self.info["fps"]) if "fps" in self.info else None

    def modality(self) -> dict[str, Any] | None:
        path = self.root / "meta" / "modality.json"
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from exc

    def feature_width(self, column: str) -> int:
        if column not in self.features:
            raise ConfigError(f"column {column!r} is not a feature of {self.root}; features: {sorted(self.features)}")
        shape = self.features[column].get("shape") or [1]
        return int(np.prod(shape))

    @property
    def episode_indices(self) -> list[int]:
        return [e["episode_index"] for e in self._episodes]

    def _read_episodes(self) -> list[dict[str, Any]]:
        meta = self.root / "meta"
        if self.major == 2:
            path = meta / "episodes.jsonl"
            if path.is_file():
                rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
                return sorted(
                    ({"episode_index": int(r["episode_index"])} for r in rows), key=lambda r: r["episode_index"]
                )
            files = sorted((self.root / "data").glob("**/episode_*.parquet"))
            return [{"episode_index": int(re.findall(r"\d+", f.stem)[-1])} for f in files]
        files = sorted((meta / "episodes").glob("**/*.parquet"))
        if not files:
            raise ConfigError(f"{self.root}: v3 dataset without meta/episodes/**/*.parquet")
        rows = []
        for f in files:
            t = pq.read_table(f)
            for name in ("episode_index", "data/chunk_index", "data/file_index"):
                if name not in t.column_names:
                    raise ConfigError(f"{f}: episode table lacks column {name!r}")
            d = t.select(["episode_index", "data/chunk_index", "data/file_index"]).to_pydict()
            rows += [
                {"episode_index": int(e), "chunk_index": int(c), "file_index": int(i)}
                for e, c, i in zip(d["episode_index"], d["data/chunk_index"], d["data/file_index"])
            ]
        return sorted(rows, key=lambda r: r["episode_index"])

    # -- frames -------------------------------------------------------------------------------------------------------

    def _data_file(self, episode: dict[str, Any]) -> Path:
        e = episode["episode_index"]
        if self.major == 2:
            template = self.info.get("data_path", "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet")
            return self.root / template.format(episode_chunk=e // self.chunks_size, episode_index=e)
        template = self.info.get("data_path", "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet")
        return self.root / template.format(chunk_index=episode["chunk_index"], file_index=episode["file_index"])

    def _read_table(self, path: Path) -> pa.Table:
        if self._file_cache is not None and self._file_cache[0] == path:
            return self._file_cache[1]
        if not path.is_file():
            raise ConfigError(f"data file {path} is missing")
        try:
            table = pq.read_table(path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise ConfigError(f"{path} is not a readable parquet file: {exc}") from exc
        self._file_cache = (path, table)
        return table

    def episode_columns(self, episode_index: int, columns: list[str]) -> dict[str, np.ndarray]:
        """{column: float64 [N, D]} of one episode, in frame order; widths checked against meta/info.json."""
        episode = next((e for e in self._episodes if e["episode_index"] == episode_index), None)
        if episode is None:
            raise ConfigError(f"episode {episode_index} is not in {self.root} (it has {len(self._episodes)} episodes)")
        path = self._data_file(episode)
        table = self._read_table(path)
        where = f"{path.relative_to(self.root)} (episode {episode_index})"
        if "episode_index" in table.column_names:
            ep = np.asarray(table.column("episode_index").to_numpy(zero_copy_only=False))
            rows = np.nonzero(ep == episode_index)[0]
            if rows.size == 0:
                raise ConfigError(f"{where}: no rows with episode_index {episode_index}")
            table = table.take(pa.array(rows))
        if "frame_index" in table.column_names:
            order = np.argsort(np.asarray(table.column("frame_index").to_numpy(zero_copy_only=False)), kind="stable")
            table = table.take(pa.array(order))
        out = {}
        for column in columns:
            values = column_to_array(table, column, where)
            if column in self.features and values.shape[1] != self.feature_width(column):
                raise ConfigError(
                    f"{where}: column {column!r} rows have {values.shape[1]} values, meta/info.json declares shape "
                    f"{self.features[column].get('shape')}"
                )
            if not np.isfinite(values).all():
                raise ConfigError(f"{where}: column {column!r} holds NaN or inf")
            out[column] = values
        return out

    # -- presets ------------------------------------------------------------------------------------------------------

    def resolve_slices(self, preset: DatasetPreset) -> tuple[list[ColumnSlice], list[ColumnSlice]]:
        """The preset's state/action slices; empty ones come from meta/modality.json."""
        state, action = list(preset.state), list(preset.action)
        if state and action:
            return state, action
        modality = self.modality()
        if modality is None:
            raise ConfigError(
                f"{self.root}: the {preset.tag} preset takes its state/action slices from meta/modality.json, which is "
                "missing; pass --state NAME=COLUMN[START:END] and --action ... instead"
            )
        groups = {"state": (state, preset.modality_state_column), "action": (action, preset.modality_action_column)}
        for group, (slices, default_column) in groups.items():
            if slices:
                continue
            entries = modality.get(group)
            if not isinstance(entries, dict) or not entries:
                raise ConfigError(f"{self.root}/meta/modality.json has no {group!r} entries")
            for name, spec in entries.items():
                if not isinstance(spec, dict) or "start" not in spec or "end" not in spec:
                    raise ConfigError(f"meta/modality.json {group}.{name} needs 'start' and 'end'")
                column = spec.get("original_key", default_column)
                slices.append(ColumnSlice(name, column, int(spec["start"]), int(spec["end"])))
        return state, action
