"""Read LeRobot datasets on disk (v2.x and v3.0 layouts) with pyarrow only; no `lerobot` dependency.

v2.x: `meta/info.json`, `meta/episodes.jsonl`, one parquet per episode at `data_path` (default
      `data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet`).
v3.0: `meta/info.json`, the episode table as parquet under `meta/episodes/`, data files at `data_path` holding one or
      many episodes (rows tagged by an `episode_index` column; the episode table says which file): what lerobot
      writes, what our writer writes (one episode per file) and what it wrote before (every episode in file 0).
Optional `meta/modality.json` (GR00T style) names start/end slices of `observation.state` and `action`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from dreamzero_client.errors import ConfigError
from dreamzero_droid.lerobot.layout import EPISODES_FILE, arrow, read_tasks


def column_to_array(table, column: str, where: str) -> np.ndarray:
    """A numeric scalar or fixed-length list column of a pyarrow table -> float64 [N, D]."""
    pa, _ = arrow()
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
    """Read access to a LeRobot dataset directory: features, tasks, episodes, per-episode columns."""

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
        self._file_cache: tuple[Path, Any] | None = None

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

    def tasks(self) -> dict[int, str]:
        """{task_index: task} (tasks.parquet as we or lerobot write it, or v2's tasks.jsonl)."""
        return read_tasks(self.root)

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
        _, pq = arrow()
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

    def _read_table(self, path: Path):
        if self._file_cache is not None and self._file_cache[0] == path:
            return self._file_cache[1]
        pa, pq = arrow()
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
        pa, _ = arrow()
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


def episode_marks(root: str | Path) -> list[dict]:
    """[{episode_index, length, success, outcome, note}] of a dataset our writer wrote, in episode order (None where a
    dataset has no such mark)."""
    _, pq = arrow()
    rows = pq.read_table(Path(root) / EPISODES_FILE).to_pylist()
    keys = ("episode_index", "length", "success", "outcome", "note")
    return sorted(({k: r.get(k) for k in keys} for r in rows), key=lambda r: r["episode_index"])


def dataset_video_encoding(root: str | Path) -> str:
    """The `VIDEO_ENCODINGS` name a dataset's videos use (by info.json's pix_fmt; "standard" when unsure)."""
    from dreamzero_droid.lerobot.writer import VIDEO_ENCODINGS

    features = json.loads((Path(root) / "meta" / "info.json").read_text())["features"]
    fmts = {(f.get("info") or {}).get("video.pix_fmt") for f in features.values() if f.get("dtype") == "video"}
    names = [n for n, kw in VIDEO_ENCODINGS.items() if kw["pix_fmt_out"] in fmts]
    return names[0] if names else "standard"
