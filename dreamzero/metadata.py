"""`metadata.json`: the normalisation statistics and modality shapes a checkpoint was trained with.

Format (several embodiment tags may share one file):
    {"<tag>": {"statistics": {"state": {"<subkey>": {"min": [..], "max": [..], "mean": [..], "std": [..],
                                                     "q01": [..], "q99": [..]}},
                              "action": {...}},
               "modalities": {"video": {"<name>": {"resolution": [w, h], "channels": 3, "fps": 15.0}},
                              "state": {"<subkey>": {"absolute": true, "rotation_type": null, "shape": [D],
                                                     "continuous": true}},
                              "action": {...}},
               "embodiment_tag": "<tag>",
               "normalisation_bounds": {"action": "min_max"}}}   # optional; default "q01_q99" for both groups
Statistics are per dimension, float64, population std, linear-interpolation quantiles (see `compute_key_stats`).

`normalisation_bounds` says which two statistics of a group map to -1 and +1: "q01_q99" (upstream's choice, and the
default) or "min_max". With q01/q99 the 2% of values outside the percentiles are clamped in training; for the
relative action chunks of short scripted reaches that clamp cuts the end of the first chunk, so a model trained on
them under-reaches (docs/training.md), and "min_max" keeps every recorded action reachable.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dreamzero.errors import ConfigError

logger = logging.getLogger(__name__)

STAT_NAMES = ("min", "max", "mean", "std", "q01", "q99")
GROUPS = ("state", "action")
BOUNDS = {"q01_q99": ("q01", "q99"), "min_max": ("min", "max")}  # normalisation bounds -> the statistics they use
DEFAULT_BOUNDS = "q01_q99"


def default_metadata_path() -> Path:
    """The shipped metadata.json with synthetic statistics for the embedded tiny model (oxe_droid, libero_sim, ...)."""
    return Path(__file__).resolve().parent / "assets" / "metadata.json"


@dataclass(frozen=True)
class KeyStats:
    """The six statistics of one state/action key, each float64 [D]."""

    min: np.ndarray
    max: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    q01: np.ndarray
    q99: np.ndarray

    @property
    def dim(self) -> int:
        return int(self.q01.shape[0])

    def to_dict(self) -> dict[str, list[float]]:
        return {name: [float(v) for v in getattr(self, name)] for name in STAT_NAMES}

    def bounds(self, kind: str = DEFAULT_BOUNDS) -> tuple[np.ndarray, np.ndarray]:
        """The (low, high) pair that normalisation maps to -1 and +1, for a `BOUNDS` name."""
        low, high = BOUNDS[kind]
        return getattr(self, low), getattr(self, high)


@dataclass
class EmbodimentMetadata:
    """Validated statistics and modalities of one embodiment tag."""

    tag: str
    state: dict[str, KeyStats]  # subkey (e.g. "joint_position") -> stats
    action: dict[str, KeyStats]
    modalities: dict[str, Any] = field(default_factory=dict)
    synthetic: bool = False  # True for the shipped placeholder statistics
    bounds: dict[str, str] = field(default_factory=lambda: dict.fromkeys(GROUPS, DEFAULT_BOUNDS))  # group -> BOUNDS

    def stats(self, key: str) -> KeyStats:
        """Statistics of a full key such as `state.joint_position` or `action.gripper_position`."""
        group, _, sub = key.partition(".")
        table = {"state": self.state, "action": self.action}.get(group)
        if table is None or sub not in table:
            known = [f"state.{k}" for k in self.state] + [f"action.{k}" for k in self.action]
            raise ConfigError(f"metadata for {self.tag!r} has no statistics for {key!r}; it has {known}")
        return table[sub]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "statistics": {
                "state": {k: v.to_dict() for k, v in self.state.items()},
                "action": {k: v.to_dict() for k, v in self.action.items()},
            },
            "modalities": self.modalities,
            "embodiment_tag": self.tag,
        }
        if self.synthetic:
            out["synthetic"] = True
        if any(kind != DEFAULT_BOUNDS for kind in self.bounds.values()):
            out["normalisation_bounds"] = dict(self.bounds)
        return out


# ---------------------------------------------------------------------------------------------------------------------
# 1. Statistics
# ---------------------------------------------------------------------------------------------------------------------


def compute_key_stats(values: np.ndarray) -> KeyStats:
    """Per-dimension statistics of values [N, D] in float64: population std, linear-interpolation quantiles."""
    x = np.asarray(values, np.float64)
    if x.ndim != 2 or x.shape[0] == 0:
        raise ConfigError(f"statistics need a non-empty [N, D] array, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ConfigError("statistics input holds NaN or inf values")
    return KeyStats(
        min=x.min(axis=0),
        max=x.max(axis=0),
        mean=x.mean(axis=0),
        std=x.std(axis=0, ddof=0),
        q01=np.quantile(x, 0.01, axis=0, method="linear"),
        q99=np.quantile(x, 0.99, axis=0, method="linear"),
    )


# ---------------------------------------------------------------------------------------------------------------------
# 2. Loading and validation
# ---------------------------------------------------------------------------------------------------------------------


def read_metadata_file(source: dict | str | Path | None) -> dict[str, Any]:
    """The raw {tag: {...}} mapping from a dict, a path to metadata.json (or a checkpoint dir), or None (shipped)."""
    if isinstance(source, dict):
        return source
    path = default_metadata_path() if source is None else Path(source)
    if path.is_dir():
        candidates = [path / "experiment_cfg" / "metadata.json", path / "metadata.json"]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise ConfigError(f"no metadata.json in {path} (looked for {[str(c) for c in candidates]})")
        path = found
    if not path.is_file():
        raise ConfigError(f"metadata file {path} does not exist")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"metadata file {path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"metadata file {path} must hold a JSON object {{tag: {{...}}}}, got {type(raw).__name__}")
    return raw


def _parse_key_stats(raw: Any, where: str) -> KeyStats:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be an object with {list(STAT_NAMES)}, got {type(raw).__name__}")
    arrays = {}
    for name in STAT_NAMES:
        if name not in raw:
            raise ConfigError(f"{where} is missing the statistic {name!r} (needs {list(STAT_NAMES)})")
        value = raw[name]
        try:
            arr = np.asarray(value, np.float64).reshape(-1) if not isinstance(value, str) else None
        except (TypeError, ValueError):
            arr = None
        if arr is None or arr.size == 0:
            raise ConfigError(f"{where}.{name} must be a non-empty list of numbers, got {value!r}")
        if not np.isfinite(arr).all():
            raise ConfigError(f"{where}.{name} holds NaN or inf: {value!r}")
        arrays[name] = arr
    dims = {name: a.shape[0] for name, a in arrays.items()}
    if len(set(dims.values())) != 1:
        raise ConfigError(f"{where}: statistics have different dimensions {dims}")
    if (arrays["q01"] > arrays["q99"]).any():
        raise ConfigError(f"{where}: q01 > q99 in some dimension (q01={arrays['q01']}, q99={arrays['q99']})")
    return KeyStats(**arrays)


def parse_embodiment_metadata(raw: dict[str, Any], tag: str) -> EmbodimentMetadata:
    """Validate one tag of a metadata mapping; a missing tag, statistic or a dimension mismatch fails naming it."""
    if tag not in raw:
        known = sorted(k for k, v in raw.items() if isinstance(v, dict))
        close = difflib.get_close_matches(tag, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"metadata has no embodiment tag {tag!r}; it has {known}.{hint}")
    entry = raw[tag]
    if not isinstance(entry, dict) or "statistics" not in entry:
        raise ConfigError(f"metadata[{tag!r}] must be an object with a 'statistics' entry")
    statistics = entry["statistics"]
    groups: dict[str, dict[str, KeyStats]] = {}
    for group in GROUPS:
        table = statistics.get(group) if isinstance(statistics, dict) else None
        if not isinstance(table, dict) or not table:
            raise ConfigError(f"metadata[{tag!r}].statistics.{group} is missing or empty")
        groups[group] = {
            sub: _parse_key_stats(s, f"metadata[{tag!r}].statistics.{group}.{sub}") for sub, s in table.items()
        }
    modalities = entry.get("modalities") or {}
    if not isinstance(modalities, dict):
        raise ConfigError(f"metadata[{tag!r}].modalities must be an object")
    # modalities' declared shapes must agree with the statistics' widths
    for group in GROUPS:
        for sub, spec in (modalities.get(group) or {}).items():
            shape = spec.get("shape") if isinstance(spec, dict) else None
            if shape is None or sub not in groups[group]:
                continue
            width = math.prod(int(s) for s in shape)
            if width != groups[group][sub].dim:
                raise ConfigError(
                    f"metadata[{tag!r}]: modalities.{group}.{sub}.shape {list(shape)} does not match the "
                    f"statistics' {groups[group][sub].dim} dims"
                )
    meta = EmbodimentMetadata(
        tag=tag, state=groups["state"], action=groups["action"], modalities=modalities,
        synthetic=bool(entry.get("synthetic", False)), bounds=_parse_bounds(entry, tag),
    )  # fmt: skip
    if meta.synthetic:
        logger.warning("metadata for %r holds SYNTHETIC statistics (placeholders, not from any dataset)", tag)
    return meta


def _parse_bounds(entry: dict[str, Any], tag: str) -> dict[str, str]:
    raw = entry.get("normalisation_bounds") or {}
    where = f"metadata[{tag!r}].normalisation_bounds"
    if not isinstance(raw, dict):
        raise ConfigError(f'{where} must be an object such as {{"action": "min_max"}}')
    for group, kind in raw.items():
        if group not in GROUPS:
            raise ConfigError(f"{where} has an unknown group {group!r}; the groups are {list(GROUPS)}")
        if kind not in BOUNDS:
            raise ConfigError(f"{where}.{group} is {kind!r}; use one of {sorted(BOUNDS)}")
    return {group: raw.get(group, DEFAULT_BOUNDS) for group in GROUPS}


def load_embodiment_metadata(source: dict | str | Path | None, tag: str) -> EmbodimentMetadata:
    """Load and validate the statistics of `tag` from a dict, a file/checkpoint path, or None (the shipped file)."""
    if isinstance(source, EmbodimentMetadata):
        if source.tag != tag:
            raise ConfigError(f"metadata is for {source.tag!r}, not {tag!r}")
        return source
    return parse_embodiment_metadata(read_metadata_file(source), tag)


# ---------------------------------------------------------------------------------------------------------------------
# 3. Writing and merging
# ---------------------------------------------------------------------------------------------------------------------


def merge_metadata(*sources: dict[str, Any], overwrite: bool = False) -> dict[str, Any]:
    """Merge several {tag: {...}} mappings into one; a tag present twice fails unless `overwrite` (last one wins)."""
    merged: dict[str, Any] = {}
    for source in sources:
        for tag, entry in source.items():
            if tag in merged and not overwrite and merged[tag] != entry:
                raise ConfigError(
                    f"embodiment tag {tag!r} appears in more than one input; pass overwrite to replace it"
                )
            merged[tag] = entry
    return merged


def save_metadata(metadata: dict[str, Any], path: str | Path) -> Path:
    """Write a {tag: {...}} mapping (validated first) as indented JSON."""
    for tag in metadata:
        parse_embodiment_metadata(metadata, tag)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(metadata, indent=2) + "\n")
    return path
